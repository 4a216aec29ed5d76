package checker_test

import (
	"slices"
	"testing"

	"github.com/kvhandoff/kvhandoff/spec"
	"github.com/kvhandoff/kvhandoff/spec/checker"
	philo "github.com/kvhandoff/kvhandoff/spec/checker/philosophers"
)

// TestBitstateWithRoomFindsEveryStateAndTheShortestTrace: with a bit array
// far larger than the state space, bitstate mode stores every state the
// exhaustive search does, reports the same shortest counterexample (replayed
// from the path the frontier carries), and estimates (almost) no miss.
func TestBitstateWithRoomFindsEveryStateAndTheShortestTrace(t *testing.T) {
	cfg := spec.NewConfig(3, 4, 2)
	cfg.MaxFaults = 2
	for _, bugs := range []spec.Switches{0, spec.Switches(0).With(spec.EagerRelease), spec.Switches(0).With(spec.AdmitFinished)} {
		cfg.Bugs = bugs
		m, err := spec.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		props := specProperties(m)
		exh, err := checker.Check(m, props, checker.Options{DeadlockName: spec.Termination, SkipLiveness: true})
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range []int{1, 3} {
			bit, err := checker.Check(m, props, checker.Options{DeadlockName: spec.Termination, Bitstate: 64 << 20, Workers: w, Seed: 7})
			if err != nil {
				t.Fatal(err)
			}
			if bit.Stats.States != exh.Stats.States || bit.Stats.Transitions != exh.Stats.Transitions || bit.Stats.Depth != exh.Stats.Depth {
				t.Fatalf("%s, %d workers: bitstate %+v, exhaustive %+v", bugs, w, bit.Stats, exh.Stats)
			}
			if bs := bit.Stats.Bitstate; bs.Bits != 64<<23 || bs.Hashes != 3 || bs.BitsSet == 0 || bs.ExpectedMissed > 1e-3 || bit.Stats.Coverage() < 0.999 {
				t.Fatalf("%s: bitstate stats %+v, coverage %v", bugs, bs, bit.Stats.Coverage())
			}
			if len(bit.Violations) != len(exh.Violations) {
				t.Fatalf("%s: bitstate found %d violations, exhaustive %d", bugs, len(bit.Violations), len(exh.Violations))
			}
			for i, v := range bit.Violations {
				if v.Property != exh.Violations[i].Property || !slices.Equal(v.Trace, exh.Violations[i].Trace) {
					t.Fatalf("%s: bitstate's counterexample of %s differs from the exhaustive one's", bugs, v.Property)
				}
			}
		}
	}
}

// TestBitstateEstimatesWhatATinyArrayMisses: 14 philosophers (228,486
// states) in an array of about one bit per state miss states; the run
// replays from its seed, another seed misses others, and the coverage
// estimate is within a factor of two of the truth (it counts the states
// missed, not what only they lead to, so it is high: 0.79 against 0.62).
func TestBitstateEstimatesWhatATinyArrayMisses(t *testing.T) {
	n := 14
	if testing.Short() {
		n = 12
	}
	m, _ := philo.New(n)
	want := philo.Reachable(n)
	size := uint64(want) / 4 // 2 bits per state
	run := func(seed uint64) checker.Stats {
		res, err := checker.Check[uint64, int](m, checker.Properties[uint64]{}, checker.Options{All: true, Bitstate: size, Seed: seed})
		if err != nil {
			t.Fatal(err)
		}
		return res.Stats
	}
	a, b, c := run(1), run(1), run(2)
	if a.States != b.States || a.Transitions != b.Transitions {
		t.Fatalf("the same seed explored %d and %d states", a.States, b.States)
	}
	if a.States >= want || c.States >= want || a.States == c.States {
		t.Fatalf("%d states reachable; seeds 1 and 2 stored %d and %d", want, a.States, c.States)
	}
	truth := float64(a.States) / float64(want)
	if est := a.Coverage(); est < 0.5*truth || est > 1 || a.Bitstate.ExpectedMissed <= 0 {
		t.Fatalf("coverage %.3f (%d of %d), estimated %.3f (%+v)", truth, a.States, want, est, a.Bitstate)
	}
	t.Logf("%d philosophers, %d states, %d bits: stored %d (%.3f), estimated coverage %.3f", n, want, a.Bitstate.Bits, a.States, truth, a.Coverage())
}

// TestBitstateSpilledFrontierCarriesThePaths: a bitstate frontier spilled to
// disk block by block brings its paths back: the same states and the same
// counterexample as the exhaustive search.
func TestBitstateSpilledFrontierCarriesThePaths(t *testing.T) {
	props := checker.Properties[uint32]{Invariants: []checker.Invariant[uint32]{{Name: "NotAllFive", Holds: func(s *uint32) bool { return *s != 0o555555 }}}}
	exh, err := checker.Check[uint32, string](encodedWide{}, props, checker.Options{})
	if err != nil {
		t.Fatal(err)
	}
	bit, err := checker.Check[uint32, string](encodedWide{}, props, checker.Options{Bitstate: 1 << 20, FrontierMemory: 1, SpillDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	if bit.Stats.Spilled == 0 || bit.Stats.States != exh.Stats.States || len(bit.Violations) != 1 ||
		!slices.Equal(bit.Violations[0].Trace, exh.Violations[0].Trace) {
		t.Fatalf("bitstate %+v, exhaustive %+v", bit.Stats, exh.Stats)
	}
}

// TestSwarmMembersMissDifferentStates: bitstate runs of 12 philosophers in
// a too-small array, with different seeds and search orders, store different
// numbers of states, none all; with room, a shuffled order finds every state
// and the shortest deadlock.
func TestSwarmMembersMissDifferentStates(t *testing.T) {
	m, _ := philo.New(12)
	want := philo.Reachable(12)
	best := 0
	var runs []checker.Stats
	for i := range uint64(4) {
		res, err := checker.Check[uint64, int](m, checker.Properties[uint64]{}, checker.Options{All: true, Bitstate: uint64(want) / 4, Seed: 1 + i, Shuffle: 1 + i})
		if err != nil {
			t.Fatal(err)
		}
		runs = append(runs, res.Stats)
		best = max(best, res.Stats.States)
	}
	if runs[0].States == runs[1].States && runs[1].States == runs[2].States || best >= want {
		t.Fatalf("members stored %+v of %d states", runs, want)
	}
	res, err := checker.Check[uint64, int](m, checker.Properties[uint64]{}, checker.Options{All: true, Bitstate: 16 << 20, Seed: 9, Shuffle: 9})
	if err != nil {
		t.Fatal(err)
	}
	if res.Stats.States != want || res.OK() || len(res.Violations[0].Trace) != 13 {
		t.Fatalf("shuffled with room: %+v", res.Stats)
	}
}
