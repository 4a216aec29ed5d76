package model

import (
	"cmp"
	"slices"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/parallel"
)

// MaxFailures is how many failing seeds a Summary lists (the smallest ones);
// the rest are only counted, so a run's memory does not grow with its seeds.
const MaxFailures = 100

// Failure is one failing seed, without its trace (replay the seed for it).
type Failure struct {
	Seed      uint64
	Violation Violation
}

// Summary aggregates runs over consecutive seeds.
type Summary struct {
	Seeds      int
	Requests   int
	Outcomes   map[string]int
	FailedBy   map[string]int // failed requests by the error that decided them
	Violations int
	// FirstViolation is the failing run with the smallest seed, trace included.
	FirstViolation *SimResult
	// Failures are the failing seeds, smallest first, at most MaxFailures.
	Failures    []Failure
	PagesLeaked int
	// DecodeRestarts and ServedByRestartedDecode are the runs' sums
	// (SimResult).
	DecodeRestarts          int
	ServedByRestartedDecode int
	// PrefixHits and PrefixHitPages are the runs' sums (SimResult).
	PrefixHits, PrefixHitPages int
	Elapsed                    time.Duration
}

// RunSeeds simulates seeds first, first+1, ..., first+n-1 of cfg, one run per
// core at a time, and folds each result into the summary as it completes:
// only the smallest failing seed keeps its trace, and at most MaxFailures
// failures are listed, so memory stays flat in n. each, when not nil, sees
// every result as it completes (one call at a time, in completion order,
// before its trace is dropped). The summary does not depend on the number of
// cores.
func RunSeeds(cfg SimConfig, first uint64, n int, each func(*SimResult)) *Summary {
	start := time.Now()
	s := &Summary{Seeds: n, Outcomes: map[string]int{OutcomeOK: 0, OutcomeRejected: 0, OutcomeCancelled: 0, OutcomeFailed: 0},
		FailedBy: map[string]int{}}
	var mu sync.Mutex
	parallel.For(n, func(i int) {
		c := cfg
		c.Seed = first + uint64(i)
		r := Simulate(c)
		mu.Lock()
		defer mu.Unlock()
		if each != nil {
			each(r)
		}
		s.add(r)
	})
	slices.SortFunc(s.Failures, func(a, b Failure) int { return cmp.Compare(a.Seed, b.Seed) })
	s.Elapsed = time.Since(start)
	return s
}

func (s *Summary) add(r *SimResult) {
	s.Requests += r.Requests
	for k, v := range r.Outcomes {
		s.Outcomes[k] += v
	}
	for k, v := range r.FailedBy {
		s.FailedBy[k] += v
	}
	s.PagesLeaked += r.PagesLeaked
	s.PrefixHits += r.PrefixHits
	s.PrefixHitPages += r.PrefixHitPages
	s.DecodeRestarts += r.DecodeRestarts
	s.ServedByRestartedDecode += r.ServedByRestartedDecode
	if r.Violation == nil {
		return
	}
	s.Violations++
	if s.FirstViolation == nil || r.Seed < s.FirstViolation.Seed {
		s.FirstViolation = r // the one trace kept
	}
	f := Failure{Seed: r.Seed, Violation: *r.Violation}
	if len(s.Failures) < MaxFailures {
		s.Failures = append(s.Failures, f)
		return
	}
	// Keep the smallest seeds: replace the largest listed one if r's is smaller.
	worst := 0
	for i, g := range s.Failures {
		if g.Seed > s.Failures[worst].Seed {
			worst = i
		}
	}
	if f.Seed < s.Failures[worst].Seed {
		s.Failures[worst] = f
	}
}
