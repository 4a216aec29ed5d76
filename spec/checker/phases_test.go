package checker_test

import (
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/spec"
	"github.com/kvhandoff/kvhandoff/spec/checker"
)

// Stats.Phases accounts for the run: every phase a run at the spec's
// bounds takes is timed, no phase's workers are busier than its wall time
// allows, the phases fit in the run's wall time, the idle core time is
// within the cores' time, and one worker runs a phase it does not spread
// itself, busy all of it. A phase left untimed, busy time summed over the
// wrong goroutines, or Workers unset fails here.
func TestPhasesAccountForTheRunsWallTime(t *testing.T) {
	m, err := spec.New(spec.NewConfig(2, 4, 2))
	if err != nil {
		t.Fatal(err)
	}
	for _, workers := range []int{1, 2} {
		res, err := checker.Check(m, specProperties(m), checker.Options{DeadlockName: spec.Termination, Workers: workers})
		if err != nil {
			t.Fatal(err)
		}
		p := res.Stats.Phases
		if p.Workers != workers {
			t.Fatalf("Phases.Workers = %d, want %d", p.Workers, workers)
		}
		if len(p.Parallel()) != 4 {
			t.Fatalf("Parallel() lists %d phases, want expand, dedup, commit and liveness", len(p.Parallel()))
		}
		for _, ph := range p.Parallel() {
			if ph.Wall <= 0 || ph.Busy <= 0 {
				t.Errorf("%d workers: %s not timed: %+v", workers, ph.Name, ph.Phase)
			}
			if ph.Busy > time.Duration(workers)*ph.Wall {
				t.Errorf("%d workers: %s busy %v, more than %d × its wall time %v", workers, ph.Name, ph.Busy, workers, ph.Wall)
			}
		}
		if p.Number <= 0 || p.Grow <= 0 || p.Collect <= 0 || p.Reverse <= 0 {
			t.Errorf("%d workers: a serial part not timed: number %v, grow %v, collect %v, reverse %v", workers, p.Number, p.Grow, p.Collect, p.Reverse)
		}
		elapsed := res.Stats.Elapsed
		if p.Timed() > elapsed || p.Timed()+p.Other(elapsed) != elapsed {
			t.Errorf("%d workers: the phases add up to %v and the rest %v, against the run's %v", workers, p.Timed(), p.Other(elapsed), elapsed)
		}
		if idle := p.Idle(elapsed); idle < time.Duration(workers-1)*(p.Serial()+p.Other(elapsed)) || idle > time.Duration(workers)*elapsed {
			t.Errorf("%d workers: idle core time %v outside [%v, %v]", workers, idle, time.Duration(workers-1)*(p.Serial()+p.Other(elapsed)), time.Duration(workers)*elapsed)
		}
		if workers == 1 && p.Dedup.Busy != p.Dedup.Wall {
			t.Errorf("1 worker: dedup busy %v, wall %v: one worker runs a phase itself, busy all of it", p.Dedup.Busy, p.Dedup.Wall)
		}
		t.Logf("%d workers, %d states in %v: %+v; serial %v, idle core time %v", workers, res.Stats.States, elapsed, p, p.Serial(), p.Idle(elapsed))
	}
}
