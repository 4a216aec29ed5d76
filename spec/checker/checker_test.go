package checker_test

import (
	"errors"
	"fmt"
	"reflect"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvhandoff/kvhandoff/spec"
	"github.com/kvhandoff/kvhandoff/spec/checker"
)

// byValue adapts a test model's successor code, which emits new values, to
// the checker's emit, which takes the successor by pointer.
func byValue[S any, A comparable](emit func(A, *S)) func(A, S) {
	return func(a A, s S) { emit(a, &s) }
}

// --- a counter: 0..N by +1, with a fault that resets it ---

type counter struct {
	n     int
	reset bool // a fault action that jumps back to 0
}

func (c counter) Initial() []int { return []int{0} }
func (c counter) Successors(s *int, next func(string, *int)) {
	emit := byValue(next)
	if *s < c.n {
		emit("inc", *s+1)
	}
	if c.reset && *s > 0 {
		emit("reset", 0)
	}
}
func (c counter) AppendFingerprint(dst []byte, s *int) []byte { return append(dst, byte(*s)) }
func (c counter) IsFault(a string) bool                       { return a == "reset" }
func (c counter) Finished(s *int) bool                        { return *s == c.n }

func atMost(k int) checker.Invariant[int] {
	return checker.Invariant[int]{Name: fmt.Sprintf("AtMost%d", k), Holds: func(s *int) bool { return *s <= k }}
}

func TestCounterStatesAndDepth(t *testing.T) {
	res, err := checker.Check[int, string](counter{n: 9}, checker.Properties[int]{Invariants: []checker.Invariant[int]{atMost(9)}}, checker.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !res.OK() || res.Stats.States != 10 || res.Stats.Depth != 9 || res.Stats.Transitions != 9 {
		t.Fatalf("got ok=%v %+v, want ok with 10 states, depth 9, 9 transitions", res.OK(), res.Stats)
	}
}

func TestSafetyViolationHasShortestTrace(t *testing.T) {
	res, err := checker.Check[int, string](counter{n: 9, reset: true}, checker.Properties[int]{Invariants: []checker.Invariant[int]{atMost(4)}}, checker.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if res.OK() {
		t.Fatal("AtMost4 should fail")
	}
	v := res.Violations[0]
	if v.Property != "AtMost4" || v.Kind != checker.Safety || len(v.Trace) != 6 {
		t.Fatalf("got %s %s with %d states in the trace, want AtMost4 safety with 6 (0..5)", v.Property, v.Kind, len(v.Trace))
	}
	for i, st := range v.Trace {
		if st.State != i || (i > 0 && st.Action != "inc") || st.Initial != (i == 0) {
			t.Fatalf("step %d: %+v", i, st)
		}
	}
}

// --- a two-process mutex, with and without a check-then-set race ---

type mutexState struct {
	pc    [2]uint8 // 0 idle, 1 checked (racy version), 2 critical
	taken bool
}

type mutex struct{ racy bool }

func (m mutex) Initial() []mutexState { return []mutexState{{}} }
func (m mutex) Successors(s *mutexState, next func(string, *mutexState)) {
	emit := byValue(next)
	for p := 0; p < 2; p++ {
		n := *s
		switch s.pc[p] {
		case 0:
			if m.racy {
				if !s.taken { // check ...
					n.pc[p] = 1
					emit(fmt.Sprintf("check%d", p), n)
				}
			} else if !s.taken { // atomic test-and-set
				n.pc[p], n.taken = 2, true
				emit(fmt.Sprintf("acquire%d", p), n)
			}
		case 1: // ... then set, without looking again
			n.pc[p], n.taken = 2, true
			emit(fmt.Sprintf("set%d", p), n)
		case 2:
			n.pc[p], n.taken = 0, false
			emit(fmt.Sprintf("release%d", p), n)
		}
	}
}
func (m mutex) AppendFingerprint(dst []byte, s *mutexState) []byte {
	return append(dst, s.pc[0], s.pc[1], boolByte(s.taken))
}
func (m mutex) IsFault(string) bool         { return false }
func (m mutex) Finished(s *mutexState) bool { return false }
func boolByte(b bool) byte                  { return map[bool]byte{false: 0, true: 1}[b] }
func mutualExclusion() checker.Invariant[mutexState] {
	return checker.Invariant[mutexState]{Name: "MutualExclusion", Holds: func(s *mutexState) bool { return !(s.pc[0] == 2 && s.pc[1] == 2) }}
}

func TestMutexWithoutRaceHolds(t *testing.T) {
	res, err := checker.Check[mutexState, string](mutex{}, checker.Properties[mutexState]{Invariants: []checker.Invariant[mutexState]{mutualExclusion()}}, checker.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !res.OK() || res.Stats.States != 3 {
		t.Fatalf("ok=%v states=%d, want ok with 3 states", res.OK(), res.Stats.States)
	}
}

func TestMutexRaceFoundWithShortestTrace(t *testing.T) {
	res, err := checker.Check[mutexState, string](mutex{racy: true}, checker.Properties[mutexState]{Invariants: []checker.Invariant[mutexState]{mutualExclusion()}}, checker.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if res.OK() {
		t.Fatal("the racy mutex must violate MutualExclusion")
	}
	// check0, check1, set0, set1 (or the symmetric order): 4 steps.
	if tr := res.Violations[0].Trace; len(tr)-1 != 4 {
		t.Fatalf("trace has %d steps, want 4: %+v", len(tr)-1, tr)
	}
}

// --- deadlock: two processes take two locks in opposite orders ---

type locksState struct{ pc [2]uint8 } // 0 none, 1 first lock, 2 both, 3 done

type locks struct{}

func (locks) Initial() []locksState { return []locksState{{}} }
func (locks) Successors(s *locksState, next func(string, *locksState)) {
	emit := byValue(next)
	held := func(lock int) bool {
		// process 0 takes A then B; process 1 takes B then A.
		for p := 0; p < 2; p++ {
			first := p // process p's first lock is lock p
			if s.pc[p] == 1 && first == lock || s.pc[p] == 2 {
				return true
			}
		}
		return false
	}
	for p := 0; p < 2; p++ {
		n := *s
		switch s.pc[p] {
		case 0:
			if !held(p) {
				n.pc[p] = 1
				emit(fmt.Sprintf("p%d takes its first lock", p), n)
			}
		case 1:
			if !held(1 - p) {
				n.pc[p] = 2
				emit(fmt.Sprintf("p%d takes its second lock", p), n)
			}
		case 2:
			n.pc[p] = 3
			emit(fmt.Sprintf("p%d releases both", p), n)
		}
	}
}
func (locks) AppendFingerprint(dst []byte, s *locksState) []byte {
	return append(dst, s.pc[0], s.pc[1])
}
func (locks) IsFault(string) bool         { return false }
func (locks) Finished(s *locksState) bool { return s.pc[0] == 3 && s.pc[1] == 3 }

func TestDeadlockDetected(t *testing.T) {
	res, err := checker.Check[locksState, string](locks{}, checker.Properties[locksState]{}, checker.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if res.OK() {
		t.Fatal("opposite lock order must deadlock")
	}
	v := res.Violations[0]
	last := v.Trace[len(v.Trace)-1].State
	if v.Kind != checker.Deadlock || v.Property != checker.DeadlockProperty || last.pc != [2]uint8{1, 1} {
		t.Fatalf("got %s %s ending in %+v, want a deadlock with both holding their first lock", v.Property, v.Kind, last)
	}
}

// --- liveness: a retry loop that can be entered only by a fault ---

type retryState struct {
	at    uint8 // 0 start, 1 working, 2 done, 3 stuck (a fault's doing)
	spins uint8
}

type retry struct{ stuckLoops bool }

func (retry) Initial() []retryState { return []retryState{{}} }
func (r retry) Successors(s *retryState, next func(string, *retryState)) {
	emit := byValue(next)
	switch s.at {
	case 0:
		emit("start", retryState{at: 1})
	case 1:
		emit("finish", retryState{at: 2})
		emit("yield", retryState{at: 0}) // a protocol cycle that can always still finish
		emit("break", retryState{at: 3}) // fault
	case 3:
		if r.stuckLoops {
			emit("spin", retryState{at: 3, spins: 1 - s.spins}) // a protocol cycle that never finishes
		} else {
			emit("repair", retryState{at: 2}) // only a fault gets out
		}
	}
}
func (retry) AppendFingerprint(dst []byte, s *retryState) []byte { return append(dst, s.at, s.spins) }
func (retry) IsFault(a string) bool                              { return a == "break" || a == "repair" }
func (retry) Finished(s *retryState) bool                        { return s.at == 2 }

var doneGoal = checker.Properties[retryState]{Goals: []checker.Goal[retryState]{{Name: "Done", Reached: func(s *retryState) bool { return s.at == 2 }}}}

func TestLivenessCycleThatCanStillFinishHolds(t *testing.T) {
	m := retryNoBreak{}
	res, err := checker.Check[retryState, string](m, doneGoal, checker.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !res.OK() || res.Stats.Acyclic != checker.No {
		t.Fatalf("ok=%v acyclic=%v: want ok over a cyclic graph", res.OK(), res.Stats.Acyclic)
	}
}

// retryNoBreak is retry without its fault.
type retryNoBreak struct{ retry }

func (r retryNoBreak) Successors(s *retryState, next func(string, *retryState)) {
	r.retry.Successors(s, func(a string, n *retryState) {
		if a != "break" {
			next(a, n)
		}
	})
}

func TestLivenessIgnoresRecoveryByFault(t *testing.T) {
	res, err := checker.Check[retryState, string](retry{}, doneGoal, checker.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if res.OK() {
		t.Fatal("only a fault leaves the stuck state: Done must fail")
	}
	v := res.Violations[0]
	if v.Property != "Done" || v.Kind != checker.Liveness || v.Trace[len(v.Trace)-1].State.at != 3 {
		t.Fatalf("got %s %s ending in %+v", v.Property, v.Kind, v.Trace[len(v.Trace)-1].State)
	}
}

func TestLivenessProtocolCycleThatNeverFinishes(t *testing.T) {
	res, err := checker.Check[retryState, string](retry{stuckLoops: true}, doneGoal, checker.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if res.OK() || res.Violations[0].Kind != checker.Liveness {
		t.Fatalf("a spin loop that never finishes must violate Done, got %+v", res.Violations)
	}
	if n := len(res.Violations[0].Trace) - 1; n != 2 {
		t.Fatalf("shortest trace to the stuck state is start, break: got %d steps", n)
	}
}

// --- symmetry: k identical processes, each counting to 2 ---

type tokens struct {
	k         int
	canonical bool
}

func (t tokens) Initial() []string { return []string{string(make([]byte, t.k))} }
func (t tokens) Successors(s *string, next func(int, *string)) {
	emit := byValue(next)
	for i := 0; i < t.k; i++ {
		if (*s)[i] < 2 {
			b := []byte(*s)
			b[i]++
			emit(i, string(b))
		}
	}
}
func (t tokens) AppendFingerprint(dst []byte, s *string) []byte {
	b := []byte(*s)
	if t.canonical {
		slices.Sort(b) // processes are interchangeable: only the multiset matters
	}
	return append(dst, b...)
}
func (tokens) IsFault(int) bool { return false }
func (t tokens) Finished(s *string) bool {
	for i := 0; i < t.k; i++ {
		if (*s)[i] != 2 {
			return false
		}
	}
	return true
}

func TestSymmetryReductionCountsMultisets(t *testing.T) {
	full, err := checker.Check[string, int](tokens{k: 4}, checker.Properties[string]{}, checker.Options{})
	if err != nil {
		t.Fatal(err)
	}
	reduced, err := checker.Check[string, int](tokens{k: 4, canonical: true}, checker.Properties[string]{}, checker.Options{})
	if err != nil {
		t.Fatal(err)
	}
	// 3^4 = 81 assignments; multisets of size 4 over 3 values: C(6,2) = 15.
	if full.Stats.States != 81 || reduced.Stats.States != 15 || !full.OK() || !reduced.OK() {
		t.Fatalf("full %d, reduced %d states; want 81 and 15", full.Stats.States, reduced.Stats.States)
	}
	// A counterexample found under symmetry is replayed as concrete states.
	bad := checker.Properties[string]{Invariants: []checker.Invariant[string]{{Name: "NotAllTwo", Holds: func(s *string) bool { return !tokens{k: 4}.Finished(s) }}}}
	res, err := checker.Check[string, int](tokens{k: 4, canonical: true}, bad, checker.Options{})
	if err != nil || res.OK() {
		t.Fatalf("want a violation, got %v %v", res, err)
	}
	tr := res.Violations[0].Trace
	for i := 1; i < len(tr); i++ {
		prev, cur := []byte(tr[i-1].State), []byte(tr[i].State)
		prev[tr[i].Action]++
		if string(prev) != string(cur) {
			t.Fatalf("step %d is not the action applied to the previous concrete state", i)
		}
	}
}

func TestDeterministicAcrossWorkerCounts(t *testing.T) {
	var traces [][]checker.Step[mutexState, string]
	for _, w := range []int{1, 2, 7} {
		res, err := checker.Check[mutexState, string](mutex{racy: true}, checker.Properties[mutexState]{Invariants: []checker.Invariant[mutexState]{mutualExclusion()}}, checker.Options{Workers: w})
		if err != nil {
			t.Fatal(err)
		}
		traces = append(traces, res.Violations[0].Trace)
	}
	for i := 1; i < len(traces); i++ {
		if !slices.Equal(traces[0], traces[i]) {
			t.Fatalf("worker counts gave different counterexamples:\n%v\n%v", traces[0], traces[i])
		}
	}
}

func TestAcceptFilterSkipsRefusedCounterexamples(t *testing.T) {
	props := checker.Properties[int]{Invariants: []checker.Invariant[int]{atMost(4)}}
	// Refuse the shortest counterexample (ending at 5): the next one ends at 6.
	res, err := checker.CheckAccepting[int, string](counter{n: 9}, props, checker.Options{}, func(v checker.Violation[int, string]) bool {
		return v.Trace[len(v.Trace)-1].State != 5
	})
	if err != nil {
		t.Fatal(err)
	}
	// 5 is bad and not expanded, so 6 is unreachable: the property counts as holding.
	if !res.OK() {
		t.Fatalf("want no accepted counterexample, got %+v", res.Violations)
	}
	res, err = checker.CheckAccepting[int, string](counter{n: 9, reset: true}, props, checker.Options{MaxRejects: 1}, func(checker.Violation[int, string]) bool { return false })
	if err != nil || !res.OK() || !res.Truncated {
		t.Fatalf("refusing past MaxRejects must set Truncated: ok=%v truncated=%v err=%v", res.OK(), res.Truncated, err)
	}
}

// The checker writes a refused candidate's trace over the last one's steps;
// a reported violation's trace must survive the candidates refused after it.
func TestAcceptedTracesSurviveLaterRefusedCandidates(t *testing.T) {
	twoAt := func(i int) checker.Invariant[string] {
		return checker.Invariant[string]{Name: fmt.Sprintf("NoTwoAt%d", i), Holds: func(s *string) bool { return (*s)[i] != 2 }}
	}
	props := checker.Properties[string]{Invariants: []checker.Invariant[string]{twoAt(0), twoAt(1)}}
	refused := 0
	res, err := checker.CheckAccepting[string, int](tokens{k: 4}, props, checker.Options{All: true, Workers: 1}, func(v checker.Violation[string, int]) bool {
		if last := v.Trace[len(v.Trace)-1].State; last[3] != 1 {
			refused++
			return false
		}
		return true
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Violations) != 2 || refused < 2 {
		t.Fatalf("want both properties violated after refusals, got %d violations, %d refused", len(res.Violations), refused)
	}
	for _, v := range res.Violations {
		tr := v.Trace
		for i := 1; i < len(tr); i++ {
			prev, cur := []byte(tr[i-1].State), []byte(tr[i].State)
			prev[tr[i].Action]++
			if string(prev) != string(cur) {
				t.Fatalf("%s: step %d is not the action applied to the previous state: %v", v.Property, i, tr)
			}
		}
		last := tr[len(tr)-1].State
		if !tr[0].Initial || last[3] != 1 || props.Invariants[v.Property[len(v.Property)-1]-'0'].Holds(&last) {
			t.Fatalf("%s: the trace does not end where the accepted violation was: %v", v.Property, tr)
		}
	}
}

// selectingTokens is tokens with a Selector that counts what it builds.
type selectingTokens struct {
	tokens
	calls, built *int
}

func (t selectingTokens) SuccessorsWhere(s *string, keep func(int, int) (bool, bool), emit func(int, *string)) {
	*t.calls++
	n, done := 0, false
	t.Successors(s, func(a int, next *string) {
		if done {
			return
		}
		take, more := keep(n, a)
		if take {
			*t.built++
			emit(a, next)
		}
		n, done = n+1, !more
	})
}

// With a Selector a rebuild asks for the one successor of each step that
// its recorded choice names, and builds the same traces as without it.
func TestRebuildWithASelectorTakesOneSuccessorAStep(t *testing.T) {
	notTwoAt := func(i int) checker.Invariant[string] {
		return checker.Invariant[string]{Name: fmt.Sprintf("NoTwoAt%d", i), Holds: func(s *string) bool { return (*s)[i] != 2 }}
	}
	props := checker.Properties[string]{Invariants: []checker.Invariant[string]{notTwoAt(1), notTwoAt(3)}}
	refuseUnlessLastIs1 := func(v checker.Violation[string, int]) bool { return v.Trace[len(v.Trace)-1].State[0] == 1 }
	plain, err := checker.CheckAccepting[string, int](tokens{k: 4}, props, checker.Options{All: true, Workers: 1}, refuseUnlessLastIs1)
	if err != nil {
		t.Fatal(err)
	}
	var calls, built int
	sel, err := checker.CheckAccepting[string, int](selectingTokens{tokens{k: 4}, &calls, &built}, props, checker.Options{All: true, Workers: 1}, refuseUnlessLastIs1)
	if err != nil {
		t.Fatal(err)
	}
	if calls == 0 || built != calls {
		t.Fatalf("the rebuilds called SuccessorsWhere %d times and it built %d successors: want one a call, and some calls", calls, built)
	}
	if len(plain.Violations) != 2 || !reflect.DeepEqual(plain.Violations, sel.Violations) {
		t.Fatalf("with a Selector the violations differ:\n%v\nwithout:\n%v", sel.Violations, plain.Violations)
	}
}

func TestMaxStates(t *testing.T) {
	_, err := checker.Check[string, int](tokens{k: 4}, checker.Properties[string]{}, checker.Options{MaxStates: 10})
	if !errors.Is(err, checker.ErrTooManyStates) {
		t.Fatalf("got %v, want ErrTooManyStates", err)
	}
}

// flaky emits a different successor on every call: its traces cannot be
// replayed. (A random one replayed the same value 1 time in 1,000, and the
// test failed.)
type flaky struct{ calls *atomic.Int32 }

func (flaky) Initial() []int { return []int{0} }
func (f flaky) Successors(s *int, next func(string, *int)) {
	emit := byValue(next)
	if *s < 3 {
		emit("step", *s+1+10*int(f.calls.Add(1)))
	}
}
func (flaky) AppendFingerprint(dst []byte, s *int) []byte {
	return append(dst, byte(*s), byte(*s>>8), byte(*s>>16))
}
func (flaky) IsFault(string) bool { return false }
func (flaky) Finished(*int) bool  { return true }

func TestNondeterministicModelIsAnError(t *testing.T) {
	props := checker.Properties[int]{Invariants: []checker.Invariant[int]{{Name: "Zero", Holds: func(s *int) bool { return *s == 0 }}}}
	_, err := checker.Check[int, string](flaky{new(atomic.Int32)}, props, checker.Options{})
	if !errors.Is(err, checker.ErrNondeterministic) {
		t.Fatalf("got %v, want ErrNondeterministic", err)
	}
}

func TestSimulateFindsRaceAndReplaysFromSeed(t *testing.T) {
	props := checker.Properties[mutexState]{Invariants: []checker.Invariant[mutexState]{mutualExclusion()}}
	a := checker.Simulate[mutexState, string](mutex{racy: true}, props, checker.SimOptions{Seed: 42, Walks: 200, Depth: 20})
	b := checker.Simulate[mutexState, string](mutex{racy: true}, props, checker.SimOptions{Seed: 42, Walks: 200, Depth: 20})
	if a.Violation == nil {
		t.Fatal("200 random walks should find the race")
	}
	if a.Walk != b.Walk || !slices.Equal(a.Violation.Trace, b.Violation.Trace) {
		t.Fatal("the same seed must replay the same walk")
	}
	ok := checker.Simulate[mutexState, string](mutex{}, props, checker.SimOptions{Seed: 42, Walks: 200, Depth: 20})
	if ok.Violation != nil || ok.Walks != 200 {
		t.Fatalf("correct mutex: %+v", ok)
	}
}

func TestSimulateFindsDeadlockAndLiveness(t *testing.T) {
	d := checker.Simulate[locksState, string](locks{}, checker.Properties[locksState]{}, checker.SimOptions{Seed: 1, Walks: 100, Depth: 10})
	if d.Violation == nil || d.Violation.Kind != checker.Deadlock {
		t.Fatalf("want a deadlock, got %+v", d.Violation)
	}
	l := checker.Simulate[retryState, string](retry{}, doneGoal, checker.SimOptions{Seed: 1, Walks: 100, Depth: 3})
	if l.Violation == nil || l.Violation.Kind != checker.Liveness {
		t.Fatalf("want a liveness violation, got %+v", l.Violation)
	}
}

func TestAcyclicIsUnknownUnlessComputed(t *testing.T) {
	// No goals: the protocol graph is not analysed.
	res, err := checker.Check[int, string](counter{n: 3}, checker.Properties[int]{}, checker.Options{})
	if err != nil || res.Stats.Acyclic != checker.Unknown {
		t.Fatalf("without goals: acyclic=%v err=%v, want unknown", res.Stats.Acyclic, err)
	}
	reached := checker.Properties[int]{Goals: []checker.Goal[int]{{Name: "AtEnd", Reached: func(s *int) bool { return *s == 3 }}}}
	res, err = checker.Check[int, string](counter{n: 3}, reached, checker.Options{})
	if err != nil || res.Stats.Acyclic != checker.Yes {
		t.Fatalf("counting up: acyclic=%v err=%v, want yes", res.Stats.Acyclic, err)
	}
	// A violation that stops exploration leaves the graph incomplete.
	reached.Invariants = []checker.Invariant[int]{atMost(1)}
	res, err = checker.Check[int, string](counter{n: 3}, reached, checker.Options{})
	if err != nil || res.OK() || res.Stats.Acyclic != checker.Unknown {
		t.Fatalf("stopped at a violation: acyclic=%v err=%v, want unknown", res.Stats.Acyclic, err)
	}
}

// --- the collector's settings around concurrent explorations ---

// rendezvous is a counter whose Initial waits until every exploration of a
// group has started, and records the collector's settings seen then.
type rendezvous struct {
	counter
	started *sync.WaitGroup
	seen    chan [2]int64 // GOGC and the soft memory limit, read inside the run
}

func (r rendezvous) Initial() []int {
	r.started.Done()
	r.started.Wait()
	p := debug.SetGCPercent(-1)
	debug.SetGCPercent(p)
	r.seen <- [2]int64{int64(p), debug.SetMemoryLimit(-1)}
	return r.counter.Initial()
}

func TestCheckRestoresTheCollectorSettingsAfterConcurrentRuns(t *testing.T) {
	const programPercent, programLimit = 150, int64(1 << 40)
	defer debug.SetGCPercent(debug.SetGCPercent(programPercent))
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(programLimit))
	var started, done sync.WaitGroup
	started.Add(2)
	seen := make(chan [2]int64, 2)
	limits := []uint64{1 << 34, 1 << 33}
	for _, limit := range limits {
		done.Add(1)
		go func() {
			defer done.Done()
			m := rendezvous{counter{n: 3}, &started, seen}
			if _, err := checker.Check(m, checker.Properties[int]{}, checker.Options{MaxMemory: limit}); err != nil {
				t.Error(err)
			}
		}()
	}
	done.Wait()
	for range limits {
		got := <-seen
		if got[0] >= programPercent || got[1] > int64(limits[0]) {
			t.Errorf("inside a run: GOGC %d and memory limit %d, want GOGC lowered and the limit at most %d", got[0], got[1], limits[0])
		}
	}
	p := debug.SetGCPercent(programPercent)
	if l := debug.SetMemoryLimit(-1); p != programPercent || l != programLimit {
		t.Errorf("after both runs: GOGC %d and memory limit %d, want the program's %d and %d back", p, l, programPercent, programLimit)
	}
}

// TestWorkerCountsExploreTheSameGraph: with 1, 2 and 5 workers the spec's
// states, transitions, depth, acyclicity and counterexample are the same, for
// the correct protocol (108,202 states at the default bounds with at most two
// faults: a wave or more per level, with duplicates across blocks and shards) and a bug's
// counterexample.
func TestWorkerCountsExploreTheSameGraph(t *testing.T) {
	cfg := spec.NewConfig(3, 4, 2)
	cfg.MaxFaults = 2
	for _, bugs := range []spec.Switches{0, spec.Switches(0).With(spec.EagerRelease)} {
		cfg.Bugs = bugs
		m, err := spec.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		var first *checker.Result[spec.State, spec.Action]
		for _, w := range []int{1, 2, 5} {
			res, err := checker.Check(m, specProperties(m), checker.Options{Workers: w, DeadlockName: spec.Termination})
			if err != nil {
				t.Fatal(err)
			}
			if bugs == 0 && (!res.OK() || res.Stats.Acyclic != checker.Yes) {
				t.Fatalf("the correct protocol: %+v, %d violations", res.Stats, len(res.Violations))
			}
			if bugs != 0 && res.OK() {
				t.Fatalf("%s: no violation", bugs)
			}
			if first == nil {
				first = res
				continue
			}
			if res.Stats.States != first.Stats.States || res.Stats.Transitions != first.Stats.Transitions ||
				res.Stats.Depth != first.Stats.Depth || res.Stats.Acyclic != first.Stats.Acyclic {
				t.Fatalf("%s: %d workers %+v, 1 worker %+v", bugs, w, res.Stats, first.Stats)
			}
			if len(res.Violations) != len(first.Violations) {
				t.Fatalf("%s: %d workers found %d violations, 1 worker %d", bugs, w, len(res.Violations), len(first.Violations))
			}
			for i, v := range res.Violations {
				if v.Property != first.Violations[i].Property || !slices.Equal(v.Trace, first.Violations[i].Trace) {
					t.Fatalf("%s: %d workers' counterexample of %s differs from 1 worker's", bugs, w, v.Property)
				}
			}
		}
		if bugs == 0 && first.Stats.States != 108202 {
			t.Fatalf("%d states, docs/spec.md says 108,202", first.Stats.States)
		}
	}
}

// --- an idler: 0..N by +1, and an action that changes nothing ---

// idler's "idle" action leaves the state as it is; handBack passes the
// state being expanded itself for it (as a model may), otherwise a copy.
type idler struct {
	n               int
	handBack, fault bool
}

func (m idler) Initial() []int { return []int{0} }
func (m idler) Successors(s *int, emit func(string, *int)) {
	if *s < m.n {
		next := *s + 1
		emit("inc", &next)
	}
	if m.handBack {
		emit("idle", s)
	} else {
		same := *s
		emit("idle", &same)
	}
}
func (m idler) AppendFingerprint(dst []byte, s *int) []byte { return append(dst, byte(*s)) }
func (m idler) IsFault(a string) bool                       { return m.fault && a == "idle" }
func (m idler) Finished(s *int) bool                        { return *s == m.n }

// A successor handed back as the state itself is that state: the same
// states, transitions and liveness verdicts as the same action emitted as a
// copy, whether it is a fault (no cycle) or a protocol action (a cycle of
// one state, so the protocol graph is not acyclic).
func TestAStateHandedBackIsItsOwnSuccessor(t *testing.T) {
	props := checker.Properties[int]{Goals: []checker.Goal[int]{{Name: "End", Reached: func(s *int) bool { return *s == 5 }}}}
	for _, fault := range []bool{false, true} {
		var stats [2]checker.Stats
		for i, handBack := range []bool{false, true} {
			for _, workers := range []int{1, 2} {
				res, err := checker.Check[int, string](idler{n: 5, handBack: handBack, fault: fault}, props, checker.Options{Workers: workers})
				if err != nil {
					t.Fatal(err)
				}
				if !res.OK() {
					t.Fatalf("fault=%v handBack=%v: %v", fault, handBack, res.Violations)
				}
				stats[i] = res.Stats
			}
		}
		want := checker.No
		if fault {
			want = checker.Yes
		}
		for i, s := range stats {
			if s.States != 6 || s.Transitions != 11 || s.Acyclic != want {
				t.Fatalf("fault=%v, handed back %v: %d states, %d transitions, acyclic %v; want 6, 11, %v", fault, i == 1, s.States, s.Transitions, s.Acyclic, want)
			}
		}
	}
}
