package checker

import (
	"math/rand/v2"
	"time"
)

// SimOptions tune Simulate.
type SimOptions struct {
	Seed  uint64 // walk w uses the PCG stream (Seed, w): the same seed replays the same walks
	Walks int    // number of random walks
	Depth int    // steps per walk before faults stop and the walk drains
	// Drain bounds the protocol-only steps taken after Depth to check liveness;
	// 0 means 4*Depth.
	Drain int
	// FaultRate is the probability that a step is a fault when both faults and
	// protocol actions are enabled; 0 means 0.1. Choosing uniformly among all
	// actions would make faults (enabled almost everywhere) end most walks early.
	FaultRate float64
	// DeadlockName is the property a deadlock is reported as; default DeadlockProperty.
	DeadlockName string
}

// SimResult is the outcome of Simulate.
type SimResult[S any, A comparable] struct {
	Walks     int // walks completed
	Steps     int // steps taken in all walks
	MaxDepth  int // longest walk
	Elapsed   time.Duration
	Violation *Violation[S, A] // the first violation found, or nil
	Walk      int              // the walk that found it
}

// Simulate checks m by seeded random walks. Each walk takes uniformly chosen
// actions, faults included, for a random number of steps up to Depth, checking
// every invariant and deadlock on the way; then it drains: it takes only
// protocol actions until none is enabled (or Depth+Drain steps pass in all) and
// checks that the final state reaches every goal. A state with no enabled action
// at all (faults included) that the model does not call finished is a deadlock,
// in either phase. A walk
// that ends where no protocol action is enabled and a goal is not reached is a
// liveness violation; a walk that is still running after Drain steps is not
// judged. Unlike Check, traces are not shortest.
func Simulate[S any, A comparable](m Model[S, A], props Properties[S], opt SimOptions) *SimResult[S, A] {
	start := time.Now()
	res := &SimResult[S, A]{}
	invs, goals := props.Invariants, props.Goals
	drain := opt.Drain
	if drain <= 0 {
		drain = 4 * opt.Depth
	}
	inits := m.Initial()
	type succ struct {
		a A
		s S
	}
	var succs, faults []succ
	deadlockName := opt.DeadlockName
	if deadlockName == "" {
		deadlockName = DeadlockProperty
	}
	rate := opt.FaultRate
	if rate <= 0 {
		rate = 0.1
	}
	for w := 0; w < opt.Walks; w++ {
		rng := rand.New(rand.NewPCG(opt.Seed, uint64(w)))
		cur := inits[rng.IntN(len(inits))]
		trace := []Step[S, A]{{State: cur, Initial: true}}
		fail := func(prop string, kind Kind) *SimResult[S, A] {
			res.Violation = &Violation[S, A]{Property: prop, Kind: kind, Trace: trace}
			res.Walk = w
			res.Elapsed = time.Since(start)
			return res
		}
		checkInvs := func() string {
			for _, inv := range invs {
				if !inv.Holds(&cur) {
					return inv.Name
				}
			}
			return ""
		}
		if p := checkInvs(); p != "" {
			return fail(p, Safety)
		}
		stuck := false
		// Faults stop at a random point of each walk, so that states a fault
		// leaves behind get drained without a later fault repairing them.
		faultsUntil := 1 + rng.IntN(opt.Depth)
		for step := 0; step < opt.Depth+drain; step++ {
			draining := step >= faultsUntil
			succs, faults = succs[:0], faults[:0]
			enabledFaults := 0 // counted while draining too: a deadlock is judged on every action
			m.Successors(&cur, func(a A, n *S) {
				if m.IsFault(a) {
					enabledFaults++
					if !draining {
						faults = append(faults, succ{a, *n})
					}
					return
				}
				succs = append(succs, succ{a, *n})
			})
			if len(succs)+enabledFaults == 0 && !m.Finished(&cur) {
				return fail(deadlockName, Deadlock)
			}
			if len(succs) == 0 && (draining || len(faults) == 0) {
				stuck = true
				break
			}
			var pick succ
			if len(faults) > 0 && (len(succs) == 0 || rng.Float64() < rate) {
				pick = faults[rng.IntN(len(faults))]
			} else {
				pick = succs[rng.IntN(len(succs))]
			}
			cur = pick.s
			trace = append(trace, Step[S, A]{Action: pick.a, State: cur})
			res.Steps++
			if p := checkInvs(); p != "" {
				return fail(p, Safety)
			}
		}
		if stuck {
			for _, g := range goals {
				if !g.Reached(&cur) {
					return fail(g.Name, Liveness)
				}
			}
		}
		res.MaxDepth = max(res.MaxDepth, len(trace)-1)
		res.Walks++
	}
	res.Elapsed = time.Since(start)
	return res
}
