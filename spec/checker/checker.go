package checker

import (
	"errors"
	"fmt"
	"hash/maphash"
	"runtime"
	"slices"
	"sync"
	"time"
)

// Model is what the checker explores. S is a state, held by value; A is an action
// label, comparable so that traces can be replayed.
type Model[S any, A comparable] interface {
	// Initial returns the initial states.
	Initial() []S
	// Successors calls emit once for every enabled action and the state it leads
	// to. It must not modify *s and must be deterministic.
	Successors(s *S, emit func(a A, next S))
	// AppendFingerprint appends a canonical encoding of *s to dst. States with
	// equal encodings are treated as the same state.
	AppendFingerprint(dst []byte, s *S) []byte
	// IsFault reports whether a is a fault action. Faults may happen but need
	// not: liveness is checked over protocol actions only.
	IsFault(a A) bool
	// Finished reports whether *s may legitimately have no enabled action.
	Finished(s *S) bool
}

// Properties are what Check verifies of a model.
type Properties[S any] struct {
	Invariants []Invariant[S] // safety: checked in every reachable state
	Goals      []Goal[S]      // liveness
}

// Invariant is a named safety property: Holds must be true in every reachable state.
type Invariant[S any] struct {
	Name  string
	Holds func(s *S) bool
}

// Goal is a named liveness property: from every reachable state, a state where
// Reached is true must be reachable through protocol actions.
type Goal[S any] struct {
	Name    string
	Reached func(s *S) bool
}

// Kind classifies a violation.
type Kind int

// The kinds of violation.
const (
	Safety Kind = iota
	Deadlock
	Liveness
)

func (k Kind) String() string {
	switch k {
	case Safety:
		return "safety"
	case Deadlock:
		return "deadlock"
	case Liveness:
		return "liveness"
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// DeadlockProperty is the property name reported for a deadlock.
const DeadlockProperty = "Deadlock"

// Step is one state of a trace and the action that led to it (the zero action
// for the initial state).
type Step[S any, A comparable] struct {
	Action  A
	State   S
	Initial bool
}

// Violation is a property that fails, with a shortest trace that shows it. For a
// safety violation or deadlock the last state is the bad one; for a liveness
// violation the last state is one from which no protocol execution reaches the goal.
type Violation[S any, A comparable] struct {
	Property string
	Kind     Kind
	Trace    []Step[S, A]
}

// Stats describes an exploration.
type Stats struct {
	States      int           // distinct states after symmetry reduction
	Transitions int           // transitions explored, including those to known states
	Depth       int           // deepest BFS level
	Elapsed     time.Duration // wall time
	// Acyclic says whether the graph of protocol (non-fault) transitions has no
	// cycle. It is computed only when the model has goals, liveness is checked and
	// exploration ran to the end; otherwise it is Unknown.
	Acyclic Verdict
}

// Verdict is a yes/no answer that may not have been computed.
type Verdict int8

// The verdicts; the zero value is Unknown.
const (
	Unknown Verdict = iota
	Yes
	No
)

func (v Verdict) String() string {
	switch v {
	case Yes:
		return "yes"
	case No:
		return "no"
	}
	return "unknown"
}

// Known reports whether the verdict was computed.
func (v Verdict) Known() bool { return v == Yes || v == No }

// StatesPerSecond is the exploration rate.
func (s Stats) StatesPerSecond() float64 {
	if s.Elapsed <= 0 {
		return 0
	}
	return float64(s.States) / s.Elapsed.Seconds()
}

// Result is the outcome of Check.
type Result[S any, A comparable] struct {
	Stats Stats
	// Truncated reports that the accept function rejected so many candidates of some
	// property that the search for it was abandoned.
	Truncated bool
	// Violations holds the first violation of each failing property, shortest
	// first. Empty means every property holds within the bounds.
	Violations []Violation[S, A]
}

// OK reports whether no property failed.
func (r *Result[S, A]) OK() bool { return len(r.Violations) == 0 }

// Options tune Check.
type Options struct {
	// Workers is the number of goroutines generating successors; 0 means GOMAXPROCS.
	Workers int
	// MaxStates aborts exploration with ErrTooManyStates past this many states; 0 means no limit.
	MaxStates int
	// All keeps exploring after the first violation to find the first violation
	// of every property; otherwise Check stops at the first one found. States
	// that violate a safety property are not expanded further either way.
	All bool
	// Progress, if set, is called about once a second during exploration.
	Progress func(Stats)
	// DeadlockName is the property a deadlock is reported as; default DeadlockProperty.
	DeadlockName string
	// SkipLiveness disables the liveness check (and its memory for edges).
	SkipLiveness bool
	// MaxRejects bounds how many counterexamples per property CheckAccepting's
	// accept function may refuse (default 100000: with a partner switch that
	// fails alone, refused candidates number in the thousands, and stopping
	// early would leave a combination undecided);
	// past that the property counts as holding and Result.Truncated is set.
	MaxRejects int
}

// ErrNondeterministic is returned when a recorded trace cannot be replayed: the
// model's Successors or AppendFingerprint is not a function of the state.
var ErrNondeterministic = errors.New("checker: trace replay diverged; the model is not deterministic")

// ErrTooManyStates is returned when exploration exceeds Options.MaxStates.
var ErrTooManyStates = errors.New("checker: state limit exceeded")

// LimitError is the error Check returns when it stops at a limit before the
// exploration is complete: errors.Is(err, ErrTooManyStates) (or the error of
// the limit hit) holds, and Stats says how far it got.
type LimitError struct {
	Err   error // the limit: ErrTooManyStates
	Stats Stats // the exploration so far
}

func (e *LimitError) Error() string {
	return fmt.Sprintf("%v: %d states at depth %d", e.Err, e.Stats.States, e.Stats.Depth)
}

func (e *LimitError) Unwrap() error { return e.Err }

type fingerprint [2]uint64

// fixed seeds make fingerprints, and so iteration-independent results, stable within a run.
var seedA, seedB = maphash.MakeSeed(), maphash.MakeSeed()

func fingerprintOf(b []byte) fingerprint {
	return fingerprint{maphash.Bytes(seedA, b), maphash.Bytes(seedB, b)}
}

// dupEdge is a protocol edge to a state that the same worker found earlier in the level.
type dupEdge struct {
	parent int32
	fp     fingerprint
}

// candidate is a successor produced by a worker, not yet merged.
type candidate[S any, A comparable] struct {
	parent  int32
	action  A
	fp      fingerprint
	state   S
	fault   bool
	badMask uint64 // invariants violated by state (bit i = invariant i)
	goals   uint64 // goals reached in state
}

// Check explores every state of m reachable from its initial states.
func Check[S any, A comparable](m Model[S, A], props Properties[S], opt Options) (*Result[S, A], error) {
	return CheckAccepting(m, props, opt, nil)
}

// CheckAccepting is Check with a filter on counterexamples: a violation that
// accept refuses is not reported, and exploration goes on looking for another
// (the bad state is still not expanded). The defense matrix uses it to demand
// traces that need every switch of a combination.
func CheckAccepting[S any, A comparable](m Model[S, A], props Properties[S], opt Options, accept func(Violation[S, A]) bool) (*Result[S, A], error) {
	start := time.Now()
	invs, goals := props.Invariants, props.Goals
	if len(invs) > 64 || len(goals) > 64 {
		return nil, errors.New("checker: at most 64 invariants and 64 goals")
	}
	workers := opt.Workers
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	liveness := len(goals) > 0 && !opt.SkipLiveness
	deadlockName := opt.DeadlockName
	if deadlockName == "" {
		deadlockName = DeadlockProperty
	}
	// A deadlock named after a goal is that goal's violation; the liveness
	// analysis finds its shortest form (a state from which the goal is out of
	// reach may come well before the state where nothing at all can happen).
	deferDeadlocks := false
	for _, g := range goals {
		deferDeadlocks = deferDeadlocks || liveness && g.Name == deadlockName
	}
	var firstDeadlock int32 = -1

	var (
		visited   = make(map[fingerprint]int32)
		parents   []int32
		actions   []A
		fps       []fingerprint
		goalBits  []uint64
		edges     []uint64 // protocol edges src<<32|dst, for liveness
		res       = &Result[S, A]{}
		found     = map[string]bool{}
		inits     = m.Initial()
		frontier  []S
		frontIdx  []int32
		lastTick  = time.Now()
		stopAfter = false
	)
	var zeroA A
	evalInvs := func(s *S) uint64 {
		var bad uint64
		for i, inv := range invs {
			if !inv.Holds(s) {
				bad |= 1 << i
			}
		}
		return bad
	}
	evalGoals := func(s *S) uint64 {
		var g uint64
		for i, goal := range goals {
			if goal.Reached(s) {
				g |= 1 << i
			}
		}
		return g
	}
	rejects := map[string]int{}
	maxRejects := opt.MaxRejects
	if maxRejects <= 0 {
		maxRejects = 100000
	}
	// report records a violation; it returns accepted=false when Accept refused it.
	report := func(prop string, kind Kind, idx int32) (bool, error) {
		if found[prop] {
			return true, nil
		}
		if rejects[prop] >= maxRejects {
			return false, nil
		}
		trace, err := rebuild(m, inits, parents, actions, fps, idx)
		if err != nil {
			return false, err
		}
		if accept != nil && !accept(Violation[S, A]{Property: prop, Kind: kind, Trace: trace}) {
			rejects[prop]++
			if rejects[prop] >= maxRejects {
				res.Truncated = true
			}
			return false, nil
		}
		found[prop] = true
		res.Violations = append(res.Violations, Violation[S, A]{Property: prop, Kind: kind, Trace: trace})
		if !opt.All {
			stopAfter = true
		}
		return true, nil
	}
	reportMask := func(bad uint64, idx int32) error {
		for i := range invs {
			if bad&(1<<i) != 0 {
				if _, err := report(invs[i].Name, Safety, idx); err != nil {
					return err
				}
			}
		}
		return nil
	}
	// bad states are recorded but not expanded.
	badState := map[int32]bool{}
	var buf []byte
	for _, s := range inits {
		buf = m.AppendFingerprint(buf[:0], &s)
		fp := fingerprintOf(buf)
		if _, ok := visited[fp]; ok {
			continue
		}
		idx := int32(len(parents))
		visited[fp] = idx
		parents = append(parents, -1)
		actions = append(actions, zeroA)
		fps = append(fps, fp)
		goalBits = append(goalBits, evalGoals(&s))
		if bad := evalInvs(&s); bad != 0 {
			badState[idx] = true
			if err := reportMask(bad, idx); err != nil {
				return nil, err
			}
			continue
		}
		frontier = append(frontier, s)
		frontIdx = append(frontIdx, idx)
	}

	type workerOut struct {
		cands       []candidate[S, A]
		known       []uint64 // protocol edges to states of earlier levels, src<<32|dst
		dups        []dupEdge
		transitions int
		deadlocks   []int32
	}
	depth := 0
	outs := make([]workerOut, workers) // reused across levels to keep their capacity
	var spare []S                      // the previous frontier's storage, reused for the next
	for len(frontier) > 0 && !stopAfter {
		for w := range outs {
			outs[w].cands = outs[w].cands[:0]
			outs[w].known = outs[w].known[:0]
			outs[w].dups = outs[w].dups[:0]
			outs[w].transitions = 0
			outs[w].deadlocks = outs[w].deadlocks[:0]
		}
		var wg sync.WaitGroup
		chunk := (len(frontier) + workers - 1) / workers
		for w := 0; w < workers; w++ {
			lo, hi := w*chunk, min((w+1)*chunk, len(frontier))
			if lo >= hi {
				continue
			}
			wg.Add(1)
			go func(w, lo, hi int) {
				defer wg.Done()
				out := &outs[w]
				var fbuf []byte
				local := map[fingerprint]bool{} // new this level, seen by this worker
				for i := lo; i < hi; i++ {
					parent := frontIdx[i]
					n := 0
					m.Successors(&frontier[i], func(a A, next S) {
						n++
						out.transitions++
						fbuf = m.AppendFingerprint(fbuf[:0], &next)
						fp := fingerprintOf(fbuf)
						fault := m.IsFault(a)
						if known, ok := visited[fp]; ok { // read-only during this phase
							if liveness && !fault {
								out.known = append(out.known, uint64(parent)<<32|uint64(uint32(known)))
							}
							return
						}
						if local[fp] {
							// Seen by this worker this level: keep only the edge.
							if liveness && !fault {
								out.dups = append(out.dups, dupEdge{parent, fp})
							}
							return
						}
						local[fp] = true
						out.cands = append(out.cands, candidate[S, A]{
							parent: parent, action: a, fp: fp, state: next, fault: fault,
							badMask: evalInvs(&next), goals: evalGoals(&next),
						})
					})
					if n == 0 && !m.Finished(&frontier[i]) {
						out.deadlocks = append(out.deadlocks, parent)
					}
				}
			}(w, lo, hi)
		}
		wg.Wait()

		// Deterministic merge, in frontier order.
		total := 0
		for w := range outs {
			total += len(outs[w].cands)
		}
		nextFrontier := slices.Grow(spare[:0], total)
		nextIdx := make([]int32, 0, total)
		type badNew struct {
			idx  int32
			mask uint64
		}
		var newBad []badNew
		var deadlocks []int32
		for w := range outs {
			res.Stats.Transitions += outs[w].transitions
			deadlocks = append(deadlocks, outs[w].deadlocks...)
			edges = append(edges, outs[w].known...)
			for ci := range outs[w].cands {
				c := &outs[w].cands[ci]
				dst, ok := visited[c.fp] // found by another worker this level?
				if !ok {
					dst = int32(len(parents))
					visited[c.fp] = dst
					parents = append(parents, c.parent)
					actions = append(actions, c.action)
					fps = append(fps, c.fp)
					goalBits = append(goalBits, c.goals)
					if c.badMask != 0 {
						badState[dst] = true
						newBad = append(newBad, badNew{dst, c.badMask})
					} else {
						nextFrontier = append(nextFrontier, c.state)
						nextIdx = append(nextIdx, dst)
					}
				}
				if liveness && !c.fault {
					edges = append(edges, uint64(c.parent)<<32|uint64(uint32(dst)))
				}
			}
			clear(outs[w].cands) // drop references held by old states
			for _, d := range outs[w].dups {
				edges = append(edges, uint64(d.parent)<<32|uint64(uint32(visited[d.fp])))
			}
		}
		for _, d := range deadlocks {
			if deferDeadlocks {
				if firstDeadlock < 0 {
					firstDeadlock = d
				}
				continue
			}
			if _, err := report(deadlockName, Deadlock, d); err != nil {
				return nil, err
			}
		}
		for _, b := range newBad {
			if err := reportMask(b.mask, b.idx); err != nil {
				return nil, err
			}
		}
		if len(nextFrontier) > 0 {
			depth++
		}
		spare = frontier
		frontier, frontIdx = nextFrontier, nextIdx
		res.Stats.States = len(parents)
		res.Stats.Depth = depth
		if opt.MaxStates > 0 && len(parents) > opt.MaxStates {
			res.Stats.Elapsed = time.Since(start)
			return res, &LimitError{Err: ErrTooManyStates, Stats: res.Stats}
		}
		if opt.Progress != nil && time.Since(lastTick) >= time.Second {
			lastTick = time.Now()
			st := res.Stats
			st.Elapsed = time.Since(start)
			opt.Progress(st)
		}
	}
	res.Stats.States = len(parents)
	res.Stats.Depth = depth

	if liveness && !stopAfter {
		res.Stats.Acyclic = No
		if acyclic(len(parents), edges) {
			res.Stats.Acyclic = Yes
		}
		for gi, g := range goals {
			for _, idx := range unreachableGoal(len(parents), edges, goalBits, uint64(1)<<gi, badState, maxRejects) {
				ok, err := report(g.Name, Liveness, idx)
				if err != nil {
					return nil, err
				}
				if ok {
					break
				}
			}
			if stopAfter {
				break
			}
		}
		if firstDeadlock >= 0 && !found[deadlockName] && !stopAfter {
			if _, err := report(deadlockName, Deadlock, firstDeadlock); err != nil {
				return nil, err
			}
		}
	}
	sortByLength(res.Violations)
	res.Stats.Elapsed = time.Since(start)
	return res, nil
}

func sortByLength[S any, A comparable](v []Violation[S, A]) {
	// Insertion sort keeps the discovery order among equal lengths.
	for i := 1; i < len(v); i++ {
		for j := i; j > 0 && len(v[j].Trace) < len(v[j-1].Trace); j-- {
			v[j], v[j-1] = v[j-1], v[j]
		}
	}
}

// unreachableGoal returns up to limit states, lowest index (hence shallowest)
// first, from which no state with the goal bit is reachable over protocol edges.
// States that violate a safety property were not expanded; they and the states
// that reach them are never reported (a liveness verdict there would be an
// artefact of stopping at the safety violation).
func unreachableGoal(n int, edges []uint64, goalBits []uint64, bit uint64, bad map[int32]bool, limit int) []int32 {
	// Reverse adjacency in CSR form.
	start := make([]int32, n+1)
	for _, e := range edges {
		start[uint32(e)+1]++
	}
	for i := 1; i <= n; i++ {
		start[i] += start[i-1]
	}
	rev := make([]int32, len(edges))
	fill := make([]int32, n)
	copy(fill, start[:n])
	for _, e := range edges {
		d := uint32(e)
		rev[fill[d]] = int32(e >> 32)
		fill[d]++
	}
	can := make([]bool, n)
	queue := make([]int32, 0, n)
	for i := 0; i < n; i++ {
		// A bad state was not expanded, so what it could reach is unknown: count
		// it as reaching the goal rather than blame its predecessors.
		if goalBits[i]&bit != 0 || bad[int32(i)] {
			can[i] = true
			queue = append(queue, int32(i))
		}
	}
	for len(queue) > 0 {
		d := queue[len(queue)-1]
		queue = queue[:len(queue)-1]
		for _, s := range rev[start[d]:start[d+1]] {
			if !can[s] {
				can[s] = true
				queue = append(queue, s)
			}
		}
	}
	var out []int32
	for i := 0; i < n && len(out) < limit; i++ {
		if !can[i] {
			out = append(out, int32(i))
		}
	}
	return out
}

// acyclic reports whether the directed graph has no cycle (Kahn's algorithm).
func acyclic(n int, edges []uint64) bool {
	indeg := make([]int32, n)
	start := make([]int32, n+1)
	for _, e := range edges {
		if uint32(e>>32) == uint32(e) {
			return false
		}
		indeg[uint32(e)]++
		start[uint32(e>>32)+1]++
	}
	for i := 1; i <= n; i++ {
		start[i] += start[i-1]
	}
	out := make([]int32, len(edges))
	fill := make([]int32, n)
	copy(fill, start[:n])
	for _, e := range edges {
		s := uint32(e >> 32)
		out[fill[s]] = int32(uint32(e))
		fill[s]++
	}
	queue := make([]int32, 0, n)
	for i := 0; i < n; i++ {
		if indeg[i] == 0 {
			queue = append(queue, int32(i))
		}
	}
	seen := 0
	for len(queue) > 0 {
		v := queue[len(queue)-1]
		queue = queue[:len(queue)-1]
		seen++
		for _, d := range out[start[v]:start[v+1]] {
			indeg[d]--
			if indeg[d] == 0 {
				queue = append(queue, d)
			}
		}
	}
	return seen == n
}

// path returns the state indices from an initial state to idx.
func path(parents []int32, idx int32) []int32 {
	var p []int32
	for i := idx; i >= 0; i = parents[i] {
		p = append(p, i)
	}
	for l, r := 0, len(p)-1; l < r; l, r = l+1, r-1 {
		p[l], p[r] = p[r], p[l]
	}
	return p
}

// rebuild replays the recorded actions from the initial state to produce the
// concrete trace that reaches idx.
func rebuild[S any, A comparable](m Model[S, A], inits []S, parents []int32, actions []A, fps []fingerprint, idx int32) ([]Step[S, A], error) {
	p := path(parents, idx)
	var buf []byte
	var cur S
	for _, s := range inits {
		buf = m.AppendFingerprint(buf[:0], &s)
		if fingerprintOf(buf) == fps[p[0]] {
			cur = s
			break
		}
	}
	trace := []Step[S, A]{{State: cur, Initial: true}}
	for _, i := range p[1:] {
		want := fps[i]
		var next S
		ok := false
		m.Successors(&cur, func(a A, n S) {
			if ok || a != actions[i] {
				return
			}
			buf = m.AppendFingerprint(buf[:0], &n)
			if fingerprintOf(buf) == want {
				next, ok = n, true
			}
		})
		if !ok {
			return nil, ErrNondeterministic
		}
		cur = next
		trace = append(trace, Step[S, A]{Action: actions[i], State: cur})
	}
	return trace, nil
}
