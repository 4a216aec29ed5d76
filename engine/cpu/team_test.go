package cpu

import (
	"runtime"
	"sync/atomic"
	"testing"
	"time"
)

// Every index of every product is computed exactly once, over many products
// in a row (the workers spin, park and wake between them), for chunk counts
// from one to every worker.
func TestParallelComputesEveryIndexOnce(t *testing.T) {
	b := NewThreads(4)
	defer b.Close()
	for round := 0; round < 2000; round++ {
		n := 1 + round%37
		hits := make([]atomic.Int32, n)
		b.parallel(n, func(lo, hi int) {
			for i := lo; i < hi; i++ {
				hits[i].Add(1)
			}
		})
		for i := range hits {
			if h := hits[i].Load(); h != 1 {
				t.Fatalf("round %d, n %d: index %d computed %d times", round, n, i, h)
			}
		}
		if round%500 == 0 {
			time.Sleep(2 * spinWait) // let the workers park: the next product must wake them
		}
	}
}

// Close ends the workers, parked or spinning, and a backend used again
// after Close starts new ones.
func TestCloseStopsTheWorkers(t *testing.T) {
	b := NewThreads(3)
	b.parallel(8, func(lo, hi int) {})
	first := b.team
	if n := first.live.Load(); n != 2 {
		t.Fatalf("%d workers after the first product, want 2", n)
	}
	b.Close() // spinning
	waitStopped(t, first)
	b.parallel(8, func(lo, hi int) {})
	second := b.team
	time.Sleep(2 * spinWait) // parked this time
	b.Close()
	waitStopped(t, second)
}

// A backend dropped without Close stops its workers once collected.
func TestADroppedBackendStopsItsWorkers(t *testing.T) {
	b := NewThreads(2)
	b.parallel(8, func(lo, hi int) {})
	tm := b.team
	b = nil
	deadline := time.Now().Add(10 * time.Second)
	for tm.live.Load() != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the workers of a collected backend did not stop")
		}
		runtime.GC()
		time.Sleep(time.Millisecond)
	}
}

func waitStopped(t *testing.T, tm *team) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for tm.live.Load() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d workers still running after Close", tm.live.Load())
		}
		time.Sleep(time.Millisecond)
	}
}
