package checker

import (
	"runtime/debug"
	"testing"
)

// TestCollectorFollowsTheHeap: while an exploration runs, GOGC is
// gcPercentSmall for a small heap, gcPercent from smallHeap up, back under
// half of it, never above the program's own; the program's comes back after.
func TestCollectorFollowsTheHeap(t *testing.T) {
	gogc := func() int { p := debug.SetGCPercent(-1); debug.SetGCPercent(p); return p }
	for _, program := range []int{150, 50} {
		prev := debug.SetGCPercent(program)
		restore := tuneCollector(0)
		for _, step := range []struct {
			heap uint64
			want int
		}{
			{1 << 20, gcPercentSmall},
			{smallHeap, gcPercent},
			{smallHeap/2 + 1, gcPercent}, // between: stays
			{smallHeap/2 - 1, gcPercentSmall},
		} {
			adaptCollector(step.heap)
			if got, want := gogc(), min(step.want, program); got != want {
				t.Errorf("program GOGC %d, heap %d: GOGC %d, want %d", program, step.heap, got, want)
			}
		}
		restore()
		if got := gogc(); got != program {
			t.Errorf("after the exploration: GOGC %d, want the program's %d", got, program)
		}
		adaptCollector(smallHeap) // no exploration runs: changes nothing
		if got := gogc(); got != program {
			t.Errorf("with no exploration running: GOGC %d, want the program's %d", got, program)
		}
		debug.SetGCPercent(prev)
	}
}
