package checker_test

// Published models with known answers: the checker's regression suite. State
// counts and counterexample lengths are TLC's for the TLA+ originals (DieHard,
// TCommit and TwoPhase from Lamport's TLA+ examples with three resource
// managers), or derived independently of the checker in the test (the
// philosophers).

import (
	"fmt"
	"testing"

	"github.com/kvhandoff/kvhandoff/spec/checker"
)

// --- DieHard: a 3-gallon and a 5-gallon jug; measure 4 gallons ---

type jugs struct{ small, big uint8 }

type dieHard struct{}

func (dieHard) Initial() []jugs { return []jugs{{}} }
func (dieHard) Successors(s *jugs, next func(string, *jugs)) {
	emit := byValue(next)
	emit("FillSmall", jugs{3, s.big})
	emit("FillBig", jugs{s.small, 5})
	emit("EmptySmall", jugs{0, s.big})
	emit("EmptyBig", jugs{s.small, 0})
	pour := min(s.small, 5-s.big)
	emit("SmallToBig", jugs{s.small - pour, s.big + pour})
	pour = min(s.big, 3-s.small)
	emit("BigToSmall", jugs{s.small + pour, s.big - pour})
}
func (dieHard) AppendFingerprint(dst []byte, s *jugs) []byte { return append(dst, s.small, s.big) }
func (dieHard) IsFault(string) bool                          { return false }
func (dieHard) Finished(*jugs) bool                          { return true }

func TestDieHardMatchesTLC(t *testing.T) {
	notFour := checker.Invariant[jugs]{Name: "NotSolved", Holds: func(s *jugs) bool { return s.big != 4 }}
	res, err := checker.Check[jugs, string](dieHard{}, checker.Properties[jugs]{}, checker.Options{})
	if err != nil {
		t.Fatal(err)
	}
	// TLC: 16 distinct states (every reachable pair of contents).
	if !res.OK() || res.Stats.States != 16 || res.Stats.Transitions != 96 {
		t.Fatalf("got %+v, want 16 states and 96 transitions", res.Stats)
	}
	res, err = checker.Check[jugs, string](dieHard{}, checker.Properties[jugs]{Invariants: []checker.Invariant[jugs]{notFour}}, checker.Options{})
	if err != nil {
		t.Fatal(err)
	}
	// TLC's breadth-first counterexample: 7 states, 6 steps.
	want := []string{"FillBig", "BigToSmall", "EmptySmall", "BigToSmall", "FillBig", "BigToSmall"}
	tr := res.Violations[0].Trace
	if len(tr) != 7 || tr[6].State.big != 4 {
		t.Fatalf("trace %+v, want 6 steps ending with 4 gallons in the big jug", tr)
	}
	for i, a := range want {
		if tr[i+1].Action != a {
			t.Fatalf("step %d is %s, want %s (trace %+v)", i+1, tr[i+1].Action, a, tr)
		}
	}
}

// --- TCommit and TwoPhase (Gray and Lamport), three resource managers ---

const (
	working uint8 = iota
	prepared
	committed
	aborted
)

type tcommit struct{ rms int }

func (m tcommit) Initial() []uint32 { return []uint32{0} }
func rmState(s uint32, r int) uint8 { return uint8(s >> (2 * r) & 3) }
func setRM(s uint32, r int, v uint8) uint32 {
	return s&^(3<<(2*r)) | uint32(v)<<(2*r)
}
func (m tcommit) all(s uint32, ok func(uint8) bool) bool {
	for r := 0; r < m.rms; r++ {
		if !ok(rmState(s, r)) {
			return false
		}
	}
	return true
}
func (m tcommit) Successors(s *uint32, next func(string, *uint32)) {
	emit := byValue(next)
	canCommit := m.all(*s, func(v uint8) bool { return v == prepared || v == committed })
	notCommitted := m.all(*s, func(v uint8) bool { return v != committed })
	for r := 0; r < m.rms; r++ {
		switch v := rmState(*s, r); {
		case v == working:
			emit(fmt.Sprintf("Prepare(%d)", r), setRM(*s, r, prepared))
		}
		v := rmState(*s, r)
		if v == prepared && canCommit {
			emit(fmt.Sprintf("Commit(%d)", r), setRM(*s, r, committed))
		}
		if (v == working || v == prepared) && notCommitted {
			emit(fmt.Sprintf("Abort(%d)", r), setRM(*s, r, aborted))
		}
	}
}
func (tcommit) AppendFingerprint(dst []byte, s *uint32) []byte {
	return append(dst, byte(*s), byte(*s>>8), byte(*s>>16), byte(*s>>24))
}
func (tcommit) IsFault(string) bool { return false }
func (tcommit) Finished(*uint32) bool {
	return true
}

func consistent(rms int) checker.Invariant[uint32] {
	return checker.Invariant[uint32]{Name: "TCConsistent", Holds: func(s *uint32) bool {
		c, a := false, false
		for r := 0; r < rms; r++ {
			c = c || rmState(*s, r) == committed
			a = a || rmState(*s, r) == aborted
		}
		return !(c && a)
	}}
}

func TestTCommitMatchesTLC(t *testing.T) {
	res, err := checker.Check[uint32, string](tcommit{3}, checker.Properties[uint32]{Invariants: []checker.Invariant[uint32]{consistent(3)}}, checker.Options{})
	if err != nil {
		t.Fatal(err)
	}
	// TLC: 34 distinct states with RM = {r1, r2, r3}.
	if !res.OK() || res.Stats.States != 34 {
		t.Fatalf("got ok=%v %+v, want 34 states", res.OK(), res.Stats)
	}
}

// twoPhase packs TwoPhase's variables into a word: rmState (2 bits per RM),
// tmState (bit 8: done), tmPrepared (bits 9..), and msgs: a Prepared message per
// RM (bits 16..), Commit (bit 24) and Abort (bit 25).
type twoPhase struct{ rms int }

const (
	tmDone    = 1 << 8
	tmPrepBit = 9
	msgPrep   = 16
	msgCommit = 1 << 24
	msgAbort  = 1 << 25
)

func (m twoPhase) Initial() []uint32 { return []uint32{0} }
func (m twoPhase) Successors(s *uint32, next func(string, *uint32)) {
	emit := byValue(next)
	v := *s
	allPrepared := true
	for r := 0; r < m.rms; r++ {
		allPrepared = allPrepared && v&(1<<(tmPrepBit+r)) != 0
	}
	if v&tmDone == 0 {
		for r := 0; r < m.rms; r++ {
			if v&(1<<(msgPrep+r)) != 0 {
				emit(fmt.Sprintf("TMRcvPrepared(%d)", r), v|1<<(tmPrepBit+r))
			}
		}
		if allPrepared {
			emit("TMCommit", v|tmDone|msgCommit)
		}
		emit("TMAbort", v|tmDone|msgAbort)
	}
	for r := 0; r < m.rms; r++ {
		if rmState(v, r) == working {
			emit(fmt.Sprintf("RMPrepare(%d)", r), setRM(v, r, prepared)|1<<(msgPrep+r))
			emit(fmt.Sprintf("RMChooseToAbort(%d)", r), setRM(v, r, aborted))
		}
		if v&msgCommit != 0 {
			emit(fmt.Sprintf("RMRcvCommitMsg(%d)", r), setRM(v, r, committed))
		}
		if v&msgAbort != 0 {
			emit(fmt.Sprintf("RMRcvAbortMsg(%d)", r), setRM(v, r, aborted))
		}
	}
}
func (twoPhase) AppendFingerprint(dst []byte, s *uint32) []byte {
	return append(dst, byte(*s), byte(*s>>8), byte(*s>>16), byte(*s>>24))
}
func (twoPhase) IsFault(string) bool   { return false }
func (twoPhase) Finished(*uint32) bool { return true }

func TestTwoPhaseMatchesTLC(t *testing.T) {
	res, err := checker.Check[uint32, string](twoPhase{3}, checker.Properties[uint32]{Invariants: []checker.Invariant[uint32]{consistent(3)}}, checker.Options{})
	if err != nil {
		t.Fatal(err)
	}
	// TLC: 288 distinct states with RM = {r1, r2, r3}.
	if !res.OK() || res.Stats.States != 288 {
		t.Fatalf("got ok=%v %+v, want 288 states", res.OK(), res.Stats)
	}
}

// --- naive dining philosophers: each takes the left fork, then the right ---

// philosophers holds each philosopher's state in 2 bits: 0 thinking, 1 holding
// the left fork, 2 eating (both forks). Philosopher i's left fork is fork i, its
// right fork is fork i+1 mod n.
type philosophers struct{ n int }

func (p philosophers) Initial() []uint32 { return []uint32{0} }
func (p philosophers) phil(s uint32, i int) uint32 {
	return s >> (2 * ((i%p.n + p.n) % p.n)) & 3
}
func (p philosophers) forkFree(s uint32, f int) bool {
	// fork f is philosopher f's left fork and philosopher f-1's right fork.
	return p.phil(s, f) == 0 && p.phil(s, f-1) != 2
}
func (p philosophers) Successors(s *uint32, next func(int, *uint32)) {
	emit := byValue(next)
	v := *s
	for i := 0; i < p.n; i++ {
		set := func(x uint32) uint32 { return v&^(3<<(2*i)) | x<<(2*i) }
		switch p.phil(v, i) {
		case 0:
			if p.forkFree(v, i) {
				emit(3*i, set(1))
			}
		case 1:
			// the right fork: neither the right neighbour's left fork nor held as ours
			if p.phil(v, i+1) == 0 {
				emit(3*i+1, set(2))
			}
		case 2:
			emit(3*i+2, set(0))
		}
	}
}
func (philosophers) AppendFingerprint(dst []byte, s *uint32) []byte {
	return append(dst, byte(*s), byte(*s>>8), byte(*s>>16), byte(*s>>24))
}
func (philosophers) IsFault(int) bool      { return false }
func (philosophers) Finished(*uint32) bool { return false } // philosophers never stop

// validConfigurations counts, without the checker, the assignments of states to
// philosophers in which no fork is held twice; every one is reachable.
func validConfigurations(n int) int {
	count := 0
	total := 1
	for i := 0; i < n; i++ {
		total *= 3
	}
	for c := 0; c < total; c++ {
		st := make([]int, n)
		for i, x := 0, c; i < n; i, x = i+1, x/3 {
			st[i] = x % 3
		}
		ok := true
		for f := 0; f < n; f++ {
			holders := 0
			if st[f] >= 1 { // left fork of philosopher f
				holders++
			}
			if st[(f+n-1)%n] == 2 { // right fork of philosopher f-1
				holders++
			}
			ok = ok && holders <= 1
		}
		if ok {
			count++
		}
	}
	return count
}

func TestNaivePhilosophersDeadlockWhenAllHoldTheirLeftFork(t *testing.T) {
	for n := 2; n <= 5; n++ {
		res, err := checker.Check[uint32, int](philosophers{n}, checker.Properties[uint32]{}, checker.Options{All: true})
		if err != nil {
			t.Fatal(err)
		}
		if res.Stats.States != validConfigurations(n) {
			t.Fatalf("n=%d: %d states, want %d", n, res.Stats.States, validConfigurations(n))
		}
		if res.OK() || res.Violations[0].Kind != checker.Deadlock {
			t.Fatalf("n=%d: want a deadlock, got %+v", n, res.Violations)
		}
		tr := res.Violations[0].Trace
		var allLeft uint32
		for i := 0; i < n; i++ {
			allLeft |= 1 << (2 * i)
		}
		if len(tr)-1 != n || tr[n].State != allLeft {
			t.Fatalf("n=%d: the shortest deadlock is every philosopher taking the left fork (%d steps), got %+v", n, n, tr)
		}
	}
}

func TestSimulateReportsDeadlockReachedWhileDraining(t *testing.T) {
	// Depth 3 stops faults (there are none) by step 3; the deadlock needs 5 steps,
	// so every walk that finds it finds it while draining.
	r := checker.Simulate[uint32, int](philosophers{5}, checker.Properties[uint32]{}, checker.SimOptions{Seed: 1, Walks: 10000, Depth: 3})
	if r.Violation == nil || r.Violation.Kind != checker.Deadlock || r.Violation.Property != checker.DeadlockProperty {
		t.Fatalf("want a deadlock, got %+v after %d walks", r.Violation, r.Walks)
	}
	tr := r.Violation.Trace
	if last := tr[len(tr)-1].State; last != 0b0101010101 {
		t.Fatalf("deadlock reported in %b, want every philosopher holding the left fork", last)
	}
	for i := 1; i < len(tr); i++ {
		found := false
		philosophers{5}.Successors(&tr[i-1].State, func(a int, n *uint32) { found = found || a == tr[i].Action && *n == tr[i].State })
		if !found {
			t.Fatalf("step %d is not a transition of the model", i)
		}
	}
}
