package model

import (
	"slices"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/research"
)

// RunSeeds streams: every result is seen once as it completes, only the
// smallest failing seed keeps its trace, and at most MaxFailures failures
// are listed, the smallest seeds, the same as a serial run finds.
func TestRunSeedsKeepsOnlyTheSmallestFailures(t *testing.T) {
	n := seeds(1500)
	cfg := SimConfig{Bugs: research.On(research.EagerRelease)}
	seen := map[uint64]int{}
	s := RunSeeds(cfg, 1, n, func(r *SimResult) { seen[r.Seed]++ })
	if len(seen) != n {
		t.Fatalf("each saw %d seeds, want %d", len(seen), n)
	}
	for seed, k := range seen {
		if k != 1 {
			t.Fatalf("seed %d seen %d times", seed, k)
		}
	}
	var failing []uint64
	for i := range n {
		c := cfg
		c.Seed = 1 + uint64(i)
		if Simulate(c).Violation != nil {
			failing = append(failing, c.Seed)
		}
	}
	if s.Violations != len(failing) || len(failing) <= MaxFailures/4 {
		t.Fatalf("%d violations, a serial run finds %d (the workload must fail often for this test)", s.Violations, len(failing))
	}
	want := failing[:min(len(failing), MaxFailures)]
	var got []uint64
	for _, f := range s.Failures {
		got = append(got, f.Seed)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("failures %v, want the smallest failing seeds %v", got, want)
	}
	if s.FirstViolation == nil || s.FirstViolation.Seed != failing[0] || len(s.FirstViolation.Trace) == 0 {
		t.Fatalf("first violation %+v, want seed %d with its trace", s.FirstViolation, failing[0])
	}
}
