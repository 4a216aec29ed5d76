package model

import (
	"time"

	"github.com/kvhandoff/kvhandoff/internal/parallel"
)

// Summary aggregates runs over consecutive seeds.
type Summary struct {
	Seeds      int
	Requests   int
	Outcomes   map[string]int
	FailedBy   map[string]int // failed requests by the error that decided them
	Violations int
	// FirstViolation is the failing run with the smallest seed, trace included.
	FirstViolation *SimResult
	PagesLeaked    int
	Elapsed        time.Duration
}

// RunSeeds simulates seeds first, first+1, ..., first+n-1 of cfg, one run per
// core at a time. The summary does not depend on the number of cores.
func RunSeeds(cfg SimConfig, first uint64, n int) *Summary {
	start := time.Now()
	results := make([]*SimResult, n)
	parallel.For(n, func(i int) {
		c := cfg
		c.Seed = first + uint64(i)
		results[i] = Simulate(c)
	})
	s := &Summary{Seeds: n, Outcomes: map[string]int{OutcomeOK: 0, OutcomeRejected: 0, OutcomeCancelled: 0, OutcomeFailed: 0},
		FailedBy: map[string]int{}}
	for _, r := range results {
		s.Requests += r.Requests
		for k, v := range r.Outcomes {
			s.Outcomes[k] += v
		}
		for k, v := range r.FailedBy {
			s.FailedBy[k] += v
		}
		s.PagesLeaked += r.PagesLeaked
		if r.Violation != nil {
			s.Violations++
			if s.FirstViolation == nil {
				s.FirstViolation = r
			} else {
				r.Trace = nil // only the first failing run's trace is kept
			}
		} else {
			r.Trace = nil
		}
	}
	s.Elapsed = time.Since(start)
	return s
}
