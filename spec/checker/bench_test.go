package checker_test

import (
	"syscall"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/spec"
	"github.com/kvhandoff/kvhandoff/spec/checker"
)

// specProperties binds the spec's predicates, as spec/explore does (explore
// imports the checker, so the benchmark cannot import explore's helper).
func specProperties(m *spec.Model) checker.Properties[spec.State] {
	var p checker.Properties[spec.State]
	for _, inv := range spec.Invariants {
		p.Invariants = append(p.Invariants, checker.Invariant[spec.State]{Name: inv.Name, Holds: func(s *spec.State) bool { return inv.Holds(m, s) }})
	}
	for _, g := range spec.Goals {
		p.Goals = append(p.Goals, checker.Goal[spec.State]{Name: g.Name, Reached: func(s *spec.State) bool { return g.Reached(m, s) }})
	}
	return p
}

// cpuTime is this process's user and system time: on a shared machine, CPU
// per state is steadier than wall time, and states/s on n cores is at most n
// seconds over the CPU seconds per state.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkCheckDefaultBounds explores the spec at kvhandoff check's default
// bounds and reports states/s, CPU per state and heap bytes per visited state.
func BenchmarkCheckDefaultBounds(b *testing.B) {
	m, err := spec.New(spec.NewConfig(3, 4, 2))
	if err != nil {
		b.Fatal(err)
	}
	props := specProperties(m)
	var states int
	var heapPerState float64
	start := cpuTime()
	for b.Loop() {
		res, err := checker.Check(m, props, checker.Options{DeadlockName: spec.Termination})
		if err != nil {
			b.Fatal(err)
		}
		if !res.OK() {
			b.Fatalf("the correct protocol fails %s", res.Violations[0].Property)
		}
		states += res.Stats.States
		heapPerState = float64(res.Stats.PeakHeap) / float64(res.Stats.States)
	}
	b.ReportMetric(float64(states)/b.Elapsed().Seconds(), "states/s")
	b.ReportMetric(float64(cpuTime()-start)/float64(states), "cpu-ns/state")
	b.ReportMetric(heapPerState, "heap-B/state")
}

// The spec holds its frontier encoded.
var _ checker.Encoder[spec.State] = (*spec.Model)(nil)

// BenchmarkCheckTwoPageBounds explores the spec at CI's two-page bounds
// (kvhandoff check --prompts 4,4,9 --pages 6 --prefill-pages 4): 4.9M states.
func BenchmarkCheckTwoPageBounds(b *testing.B) {
	cfg := spec.NewConfig(3, 6, 2)
	cfg.Prompts, cfg.PrefillPages = []int{4, 4, 9}, 4
	m, err := spec.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	props := specProperties(m)
	var states int
	var heapPerState float64
	start := cpuTime()
	for b.Loop() {
		res, err := checker.Check(m, props, checker.Options{DeadlockName: spec.Termination})
		if err != nil {
			b.Fatal(err)
		}
		if !res.OK() {
			b.Fatalf("the correct protocol fails %s", res.Violations[0].Property)
		}
		states += res.Stats.States
		heapPerState = float64(res.Stats.PeakHeap) / float64(res.Stats.States)
	}
	b.ReportMetric(float64(states)/b.Elapsed().Seconds(), "states/s")
	b.ReportMetric(float64(cpuTime()-start)/float64(states), "cpu-ns/state")
	b.ReportMetric(heapPerState, "heap-B/state")
}
