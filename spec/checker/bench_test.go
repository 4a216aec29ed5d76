package checker_test

import (
	"syscall"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/spec"
	"github.com/kvhandoff/kvhandoff/spec/checker"
	philo "github.com/kvhandoff/kvhandoff/spec/checker/philosophers"
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

// The spec holds its frontier encoded, copies its states with memmove, and
// builds its successors where the checker asks.
var (
	_ checker.Encoder[spec.State]              = (*spec.Model)(nil)
	_ checker.StateCopier[spec.State]          = (*spec.Model)(nil)
	_ checker.Builder[spec.State, spec.Action] = (*spec.Model)(nil)
)

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

// workerRates explores with 1 and with 2 workers, alternately in the same run
// (so that a shared machine's load falls on both alike), and reports each
// one's states/s and CPU per state and the ratio of the two rates. Each
// exploration must find the same states, transitions and verdicts.
func workerRates[S any, A comparable](b *testing.B, m checker.Model[S, A], props checker.Properties[S], opt checker.Options) {
	var wall [2]time.Duration
	var cpu [2]time.Duration
	var idle, serial [2]time.Duration
	var states [2]int
	var first *checker.Result[S, A]
	for b.Loop() {
		for i, w := range []int{1, 2} {
			o := opt
			o.Workers = w
			t0, c0 := time.Now(), cpuTime()
			res, err := checker.Check(m, props, o)
			if err != nil {
				b.Fatal(err)
			}
			wall[i] += time.Since(t0)
			cpu[i] += cpuTime() - c0
			states[i] += res.Stats.States
			idle[i] += res.Stats.Phases.Idle(res.Stats.Elapsed)
			serial[i] += res.Stats.Phases.Serial()
			if first == nil {
				first = res
			} else if res.Stats.States != first.Stats.States || res.Stats.Transitions != first.Stats.Transitions ||
				len(res.Violations) != len(first.Violations) {
				b.Fatalf("%d workers: %+v, %d violations; 1 worker: %+v, %d violations", w, res.Stats, len(res.Violations), first.Stats, len(first.Violations))
			}
		}
	}
	rate := func(i int) float64 { return float64(states[i]) / wall[i].Seconds() }
	b.ReportMetric(rate(0), "states/s-1w")
	b.ReportMetric(rate(1), "states/s-2w")
	b.ReportMetric(rate(1)/rate(0), "speedup-2w")
	b.ReportMetric(float64(cpu[0])/float64(states[0]), "cpu-ns/state-1w")
	b.ReportMetric(float64(cpu[1])/float64(states[1]), "cpu-ns/state-2w")
	// Where the second core went (Stats.Phases): the core time the 2-worker
	// runs left idle (the parallel phases' tails, the serial parts and the
	// rest), as a share of their two cores' time, and the waves' and the
	// liveness analysis' serial parts, as a share of their wall time.
	b.ReportMetric(100*float64(idle[1])/float64(2*wall[1]), "idle-%-2w")
	b.ReportMetric(100*float64(serial[1])/float64(wall[1]), "serial-%-2w")
	b.ReportMetric(0, "ns/op") // an op is two explorations: the rates above say it
}

// BenchmarkWorkersDefaultBounds: 1 and 2 workers at kvhandoff check's default
// bounds (1,052,395 states).
func BenchmarkWorkersDefaultBounds(b *testing.B) {
	m, err := spec.New(spec.NewConfig(3, 4, 2))
	if err != nil {
		b.Fatal(err)
	}
	workerRates(b, m, specProperties(m), checker.Options{DeadlockName: spec.Termination})
}

// BenchmarkWorkersPhilosophers: 1 and 2 workers on 16 naive dining
// philosophers (1,331,714 states, every one explored: All goes on past the
// deadlock), the model of the SPIN comparison.
func BenchmarkWorkersPhilosophers(b *testing.B) {
	m, err := philo.New(16)
	if err != nil {
		b.Fatal(err)
	}
	workerRates(b, m, checker.Properties[uint64]{}, checker.Options{All: true})
}
