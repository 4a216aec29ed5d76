package checker

import (
	"sync"
	"sync/atomic"
	"time"
)

// Phases is where an exploration's wall time went (Stats.Phases), exhaustive
// or bitstate: each parallel phase of the waves, with the time its workers
// were busy, and the serial parts between them. It says what more workers
// cannot speed up: the serial parts, and each parallel phase's tail (its
// last task, while the other workers wait at the barrier).
type Phases struct {
	Workers int
	// The parallel phases of a wave (wave.go): expanding the frontier
	// blocks, deduplicating the wave's candidates by shard, committing the
	// new states (by block and by shard).
	Expand, Dedup, Commit Phase
	// The serial parts of a wave: numbering its new states (and reserving
	// room for their records and edges), growing the visited set's index,
	// and collecting its results in block order (counts, violations, the
	// next frontier's blocks).
	Number, Grow, Collect time.Duration
	// Reverse is building the reverse graph for the liveness analysis
	// (serial), and Liveness its two searches (the cycle check and the
	// goals' backward search, at once).
	Reverse  time.Duration
	Liveness Phase
}

// Phase is a parallel phase's wall time, summed over the waves, and its
// workers' busy time, summed over the workers: Busy/(Wall×Workers) is the
// share of the cores it used.
type Phase struct {
	Wall, Busy time.Duration
}

// NamedPhase is one of Phases' parallel phases, by name.
type NamedPhase struct {
	Name string
	Phase
}

// Parallel lists the parallel phases, in the order a wave runs them.
func (p Phases) Parallel() []NamedPhase {
	return []NamedPhase{{"expand", p.Expand}, {"dedup", p.Dedup}, {"commit", p.Commit}, {"liveness", p.Liveness}}
}

// Serial is the wall time of the serial parts of the waves and of the
// liveness analysis.
func (p Phases) Serial() time.Duration { return p.Number + p.Grow + p.Collect + p.Reverse }

// Timed is the wall time the phases account for.
func (p Phases) Timed() time.Duration {
	t := p.Serial()
	for _, ph := range p.Parallel() {
		t += ph.Wall
	}
	return t
}

// Other is the wall time of a run of elapsed that no phase accounts for:
// the initial states, the levels' frontiers, the memory checks, the
// counterexamples' replay. It runs on one core.
func (p Phases) Other(elapsed time.Duration) time.Duration { return max(elapsed-p.Timed(), 0) }

// Idle is the core time the workers of a run of elapsed spent waiting: in
// the parallel phases (their tails), and on every core but one during the
// serial parts and the rest.
func (p Phases) Idle(elapsed time.Duration) time.Duration {
	idle := time.Duration(p.Workers-1) * (p.Serial() + p.Other(elapsed))
	for _, ph := range p.Parallel() {
		idle += time.Duration(p.Workers)*ph.Wall - ph.Busy
	}
	return idle
}

// parallel runs task(k, i) for i in [0, n) on up to workers goroutines, k
// being the goroutine's number (0 when they run inline, with one worker or
// one task), and adds the phase's wall time and each goroutine's time until
// it found no task left to ph.
func parallel(ph *Phase, workers, n int, task func(k, i int)) {
	start := time.Now()
	if workers <= 1 || n <= 1 {
		for i := range n {
			task(0, i)
		}
		d := time.Since(start)
		ph.Wall += d
		ph.Busy += d
		return
	}
	var next atomic.Int32
	var busy atomic.Int64
	var wg sync.WaitGroup
	for k := range min(workers, n) {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= n {
					break
				}
				task(k, i)
			}
			busy.Add(int64(time.Since(start)))
		})
	}
	wg.Wait()
	ph.Wall += time.Since(start)
	ph.Busy += time.Duration(busy.Load())
}
