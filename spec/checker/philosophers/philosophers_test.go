package philosophers_test

import (
	"testing"

	"github.com/kvhandoff/kvhandoff/spec/checker"
	"github.com/kvhandoff/kvhandoff/spec/checker/philosophers"
)

// TestStateCountsMatchTheTransferMatrix checks the model against the count of
// valid assignments (and SPIN's counts at 16 and 18, docs/spec.md), and its
// shortest deadlock: every philosopher takes the left fork.
func TestStateCountsMatchTheTransferMatrix(t *testing.T) {
	if got := philosophers.Reachable(16); got != 1331714 {
		t.Fatalf("16 philosophers: %d valid assignments, SPIN explores 1,331,714", got)
	}
	if got := philosophers.Reachable(18); got != 7761798 {
		t.Fatalf("18 philosophers: %d valid assignments, SPIN explores 7,761,798", got)
	}
	for n := 2; n <= 9; n++ {
		m, _ := philosophers.New(n)
		res, err := checker.Check[uint64, int](m, checker.Properties[uint64]{}, checker.Options{})
		if err != nil {
			t.Fatal(err)
		}
		if res.Stats.States != philosophers.Reachable(n) {
			t.Fatalf("n=%d: %d states, want %d", n, res.Stats.States, philosophers.Reachable(n))
		}
		if res.OK() || res.Violations[0].Kind != checker.Deadlock {
			t.Fatalf("n=%d: want a deadlock, got %+v", n, res.Violations)
		}
		tr := res.Violations[0].Trace
		var allLeft uint64
		for i := 0; i < n; i++ {
			allLeft |= 1 << (2 * i)
		}
		if len(tr)-1 != n || tr[n].State != allLeft {
			t.Fatalf("n=%d: the shortest deadlock is every philosopher taking the left fork (%d steps), got %+v", n, n, tr)
		}
	}
}

func TestNewRefusesTablesOutOfRange(t *testing.T) {
	for _, n := range []int{-1, 0, 1, philosophers.MaxN + 1} {
		if _, err := philosophers.New(n); err == nil {
			t.Fatalf("New(%d) accepted", n)
		}
	}
}
