package checker_test

import (
	"encoding/binary"
	"errors"
	"slices"
	"testing"

	"github.com/kvhandoff/kvhandoff/spec"
	"github.com/kvhandoff/kvhandoff/spec/checker"
)

// encodedTwoPhase is TwoPhase with an Encoder: its frontier is held as bytes.
type encodedTwoPhase struct{ twoPhase }

func (encodedTwoPhase) AppendState(dst []byte, s *uint32) []byte {
	return binary.AppendUvarint(dst, uint64(*s))
}

func (encodedTwoPhase) DecodeState(src []byte, s *uint32) error {
	v, n := binary.Uvarint(src)
	if n != len(src) {
		return errors.New("bad encoding")
	}
	*s = uint32(v)
	return nil
}

// wideModel is independent counters, so that BFS levels hold thousands of
// states: enough to fill and spill frontier blocks.
type wideModel struct{ twoPhase }

func (wideModel) Initial() []uint32 { return []uint32{0} }
func (wideModel) Successors(s *uint32, next func(string, *uint32)) {
	emit := byValue(next)
	for i := 0; i < 6; i++ {
		if d := *s >> (3 * i) & 7; d < 5 {
			emit("inc", *s+1<<(3*i))
		}
	}
}

// encodedWide is wideModel with an Encoder.
type encodedWide struct{ encodedTwoPhase }

func (encodedWide) Initial() []uint32 { return wideModel{}.Initial() }
func (encodedWide) Successors(s *uint32, next func(string, *uint32)) {
	wideModel{}.Successors(s, next)
}
func (encodedWide) AppendFingerprint(dst []byte, s *uint32) []byte {
	return wideModel{}.AppendFingerprint(dst, s)
}
func (encodedWide) IsFault(string) bool   { return false }
func (encodedWide) Finished(*uint32) bool { return true }

func TestEncodedAndSpilledFrontiersExploreTheSameGraph(t *testing.T) {
	props := checker.Properties[uint32]{
		Invariants: []checker.Invariant[uint32]{{Name: "NotAllFive", Holds: func(s *uint32) bool { return *s != 0o555555 }}},
		Goals:      []checker.Goal[uint32]{{Name: "Anything", Reached: func(*uint32) bool { return true }}},
	}
	var results []*checker.Result[uint32, string]
	for i, opt := range []checker.Options{
		{All: true},
		{All: true},
		{All: true, FrontierMemory: 1, SpillDir: t.TempDir()}, // spill every block
		{All: true, Workers: 1, FrontierMemory: 1, SpillDir: t.TempDir()},
	} {
		var m checker.Model[uint32, string] = encodedWide{}
		if i == 0 {
			m = wideModel{} // the frontier as a slice of states
		}
		res, err := checker.Check(m, props, opt)
		if err != nil {
			t.Fatal(err)
		}
		if opt.FrontierMemory == 1 && res.Stats.Spilled == 0 {
			t.Fatalf("a 1-byte frontier budget spilled nothing: %+v", res.Stats)
		}
		results = append(results, res)
	}
	// 6^6 states; the one bad state is at depth 30, and not expanded.
	for i, r := range results {
		if r.Stats.States != 46656 || r.Stats.Depth != 29 || len(r.Violations) != 1 || len(r.Violations[0].Trace) != 31 {
			t.Fatalf("run %d: %+v, %d violations", i, r.Stats, len(r.Violations))
		}
		if r.Stats.Transitions != results[0].Stats.Transitions || !slices.Equal(r.Violations[0].Trace, results[0].Violations[0].Trace) {
			t.Fatalf("run %d differs from the in-memory run", i)
		}
	}
}

func TestEncodedFrontierMatchesTLC(t *testing.T) {
	res, err := checker.Check[uint32, string](encodedTwoPhase{twoPhase{3}}, checker.Properties[uint32]{Invariants: []checker.Invariant[uint32]{consistent(3)}}, checker.Options{FrontierMemory: 1, SpillDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	if !res.OK() || res.Stats.States != 288 {
		t.Fatalf("got ok=%v %+v, want 288 states", res.OK(), res.Stats)
	}
}

func TestMemoryLimitStopsWithHowFarItGot(t *testing.T) {
	_, err := checker.Check[uint32, string](manyCounters{}, checker.Properties[uint32]{}, checker.Options{MaxMemory: 4 << 20})
	var limit *checker.LimitError
	if !errors.Is(err, checker.ErrMemoryLimit) || !errors.As(err, &limit) {
		t.Fatalf("got %v, want ErrMemoryLimit in a LimitError", err)
	}
	if limit.Stats.States == 0 || limit.Stats.States >= 1<<24 || limit.Stats.PeakHeap < 4<<20 {
		t.Fatalf("stopped with %+v", limit.Stats)
	}
}

// manyCounters has 8^8 states: more than 4 MiB of heap holds.
type manyCounters struct{ wideModel }

func (manyCounters) Successors(s *uint32, next func(string, *uint32)) {
	emit := byValue(next)
	for i := 0; i < 8; i++ {
		if *s>>(3*i)&7 < 7 {
			emit("inc", *s+1<<(3*i))
		}
	}
}

func TestSpecSpilledFrontierMatchesInMemory(t *testing.T) {
	for _, bug := range []spec.Switches{0, spec.Switches(0).With(spec.EagerRelease)} {
		cfg := spec.NewConfig(3, 4, 2)
		cfg.Bugs = bug
		cfg.MaxFaults = 2
		m, err := spec.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		props := specProperties(m)
		mem, err := checker.Check(m, props, checker.Options{DeadlockName: spec.Termination})
		if err != nil {
			t.Fatal(err)
		}
		disk, err := checker.Check(m, props, checker.Options{DeadlockName: spec.Termination, FrontierMemory: 1, SpillDir: t.TempDir()})
		if err != nil {
			t.Fatal(err)
		}
		if disk.Stats.Spilled == 0 && bug == 0 {
			t.Fatal("nothing spilled")
		}
		if mem.Stats.States != disk.Stats.States || mem.Stats.Transitions != disk.Stats.Transitions || mem.OK() != disk.OK() {
			t.Fatalf("bugs %s: in memory %+v, spilled %+v", bug, mem.Stats, disk.Stats)
		}
		if !mem.OK() && !slices.Equal(mem.Violations[0].Trace, disk.Violations[0].Trace) {
			t.Fatalf("bugs %s: the counterexamples differ", bug)
		}
	}
}
