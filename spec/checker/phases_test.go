package checker_test

import (
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/spec"
	"github.com/kvhandoff/kvhandoff/spec/checker"
)

// Stats.Phases accounts for the run: every phase a run at the spec's
// bounds takes is timed, no phase's workers are busier than its wall time
// allows, the phases fit in the run's wall time, and with one worker no
// core waits but in the goroutines' start-up. A phase left untimed, busy
// time summed over the wrong goroutines, or Workers unset fails here.
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
		for name, ph := range map[string]checker.Phase{"expand": p.Expand, "dedup": p.Dedup, "grow": p.Grow, "commit": p.Commit, "liveness": p.Liveness} {
			if ph.Wall <= 0 || ph.Busy <= 0 {
				t.Errorf("%d workers: %s not timed: %+v", workers, name, ph)
			}
			if ph.Busy > time.Duration(workers)*ph.Wall {
				t.Errorf("%d workers: %s busy %v, more than %d × its wall time %v", workers, name, ph.Busy, workers, ph.Wall)
			}
		}
		if p.Number <= 0 || p.Collect <= 0 || p.Reverse <= 0 {
			t.Errorf("%d workers: a serial part not timed: number %v, collect %v, reverse %v", workers, p.Number, p.Collect, p.Reverse)
		}
		if p.Timed() > res.Stats.Elapsed {
			t.Errorf("%d workers: the phases add up to %v, more than the run's %v", workers, p.Timed(), res.Stats.Elapsed)
		}
		if idle := p.Idle(); idle < 0 || idle > time.Duration(workers)*res.Stats.Elapsed {
			t.Errorf("%d workers: idle core time %v outside [0, %v]", workers, idle, time.Duration(workers)*res.Stats.Elapsed)
		}
		if workers == 1 && p.Dedup.Busy != p.Dedup.Wall {
			t.Errorf("1 worker: dedup busy %v, wall %v: one worker runs a phase itself, busy all of it", p.Dedup.Busy, p.Dedup.Wall)
		}
		t.Logf("%d workers, %d states in %v: %+v; serial %v, idle core time %v", workers, res.Stats.States, res.Stats.Elapsed, p, p.Serial(), p.Idle())
	}
}
