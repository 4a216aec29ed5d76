package checker

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"time"
)

// Model is what the checker explores. S is a state, held by value; A is an action
// label, comparable so that traces can be replayed.
type Model[S any, A comparable] interface {
	// Initial returns the initial states.
	Initial() []S
	// Successors calls emit once for every enabled action and the state it leads
	// to. It must not modify *s and must be deterministic. *next need only
	// last until emit returns (a model may reuse one scratch state): emit
	// copies what it keeps. For an action that changes nothing the model may
	// pass s itself as next: the checker then knows the successor without
	// computing its fingerprint.
	Successors(s *S, emit func(a A, next *S))
	// AppendFingerprint appends a canonical encoding of *s to dst. States with
	// equal encodings are treated as the same state.
	AppendFingerprint(dst []byte, s *S) []byte
	// IsFault reports whether a is a fault action. Faults may happen but need
	// not: liveness is checked over protocol actions only.
	IsFault(a A) bool
	// Finished reports whether *s may legitimately have no enabled action.
	Finished(s *S) bool
}

// Selector is implemented by a model that can build only some of a state's
// successors. Rebuilding a violation's trace takes one successor of each
// state on it, by its index in Successors' order: with a Selector the
// others are not built (the defense matrix rebuilds hundreds of thousands
// of refused candidates' traces).
type Selector[S any, A comparable] interface {
	// SuccessorsWhere calls emit, as Successors would and in its order,
	// for the successors that keep takes. keep is offered the successors
	// in Successors' order, each with its index there, until it answers
	// more=false.
	SuccessorsWhere(s *S, keep func(n int, a A) (take, more bool), emit func(a A, next *S))
}

// Builder is implemented by a model that can build its successors in states
// the checker provides. SuccessorsIn is Successors, except that the model
// builds each successor in the state that next returns, calling next once
// per successor it builds, before it builds it, and writing no such state
// after it has emitted it. A state handed out holds an earlier successor:
// the model sets all of it (the spec copies the parent in first). The
// checker then keeps a successor whose lookup it defers where it was built,
// instead of copying it (a copy of kilobytes for each successor of a large
// state). A successor emitted elsewhere is taken as Successors' are: s
// itself is s, another state is copied.
type Builder[S any, A comparable] interface {
	SuccessorsIn(s *S, next func() *S, emit func(a A, next *S))
}

// StateCopier is implemented by a model whose states are large: CopyState
// sets *dst to *src. The expansion keeps a copy of each successor whose
// lookup it defers, and Go's assignment copies a struct of kilobytes with
// REP MOVSQ, several times slower than the runtime's memmove.
type StateCopier[S any] interface {
	CopyState(dst, src *S)
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
	// PeakHeap is the largest Go heap (live objects and garbage not yet
	// swept, runtime/metrics) sampled during the exploration, in bytes.
	PeakHeap uint64
	// Spilled is how many bytes of frontier were written to disk.
	Spilled int64
	// Bitstate describes the bit array of a bitstate exploration.
	Bitstate BitstateStats
	// Acyclic says whether the graph of protocol (non-fault) transitions has no
	// cycle. It is computed only when the model has goals, liveness is checked and
	// exploration ran to the end; otherwise it is Unknown.
	Acyclic Verdict
	// Phases is where an exploration's wall time went (not a simulation's).
	Phases Phases
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
	// MaxMemory stops exploration with ErrMemoryLimit when the live Go heap,
	// measured with runtime/metrics, exceeds this many bytes; 0 means no limit.
	// While it runs, Check also lowers the runtime's soft memory limit
	// (debug.SetMemoryLimit) to it, so the collector works harder before
	// giving up; with concurrent explorations the limit is the smallest of
	// theirs. Check also lowers GOGC while it runs, to 100 and, past 256 MiB
	// of heap, to 25 (see gcPercent); the program's settings come back when
	// the last exploration ends.
	MaxMemory uint64
	// FrontierMemory is how many bytes of encoded frontier are held in memory
	// before the oldest blocks are spilled to a file in SpillDir (only for a
	// model that implements Encoder); 0 means MaxMemory/8, at most 512 MiB.
	// Below that the frontier also spills past 16 bytes per visited state (but
	// 64 MiB at least): a wide level then costs disk, not memory.
	FrontierMemory int
	// SpillDir is the directory for spill files; "" means os.TempDir().
	SpillDir string
	// Bitstate, when not 0, explores in bitstate mode (see BitstateStats) with
	// a bit array of this many bytes (rounded down to a power of two): memory
	// for the visited set fixed, at the risk of missing states. Liveness is
	// not checked.
	Bitstate uint64
	// Hashes is how many bits a state sets in bitstate mode; 0 means 3 (SPIN's default).
	Hashes int
	// Seed seeds the bitstate mode's hash: runs with different seeds miss
	// different states.
	Seed uint64
	// Shuffle, when not 0 in bitstate mode, changes the order in which each
	// level's states are expanded (not their depth), by this seed: swarm
	// members with different seeds and orders miss different states.
	Shuffle uint64
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
// exploration is complete: errors.Is(err, ErrTooManyStates) or
// errors.Is(err, ErrMemoryLimit) holds, and Stats says how far it got.
type LimitError struct {
	Err   error // the limit: ErrTooManyStates or ErrMemoryLimit
	Stats Stats // the exploration so far
}

func (e *LimitError) Error() string {
	return fmt.Sprintf("%v: %d states at depth %d", e.Err, e.Stats.States, e.Stats.Depth)
}

func (e *LimitError) Unwrap() error { return e.Err }

// A wave expands frontier blocks until they hold waveBlocks full blocks'
// worth of states (or 4 per worker), from up to 4 times as many blocks:
// enough that the phases' barriers cost little and the tasks balance.
// Counted in states, not blocks, because a level's blocks are far from full
// (each expansion's new states start blocks of their own: 95 states of 256
// on average at the default bounds), and waves of 32 blocks were then more
// than twice as many (364 against 159 there), each with its barriers,
// serial parts and tails.
const waveBlocks = 32

// defaultFrontierMemory is the default Options.FrontierMemory: past this the
// frontier is read and written sequentially from disk, which costs little next
// to expanding it.
const defaultFrontierMemory = 512 << 20

// Check explores every state of m reachable from its initial states.
func Check[S any, A comparable](m Model[S, A], props Properties[S], opt Options) (*Result[S, A], error) {
	return CheckAccepting(m, props, opt, nil)
}

// CheckAccepting is Check with a filter on counterexamples: a violation that
// accept refuses is not reported, and exploration goes on looking for another
// (the bad state is still not expanded). The defense matrix uses it to demand
// traces that need every switch of a combination. accept must not keep the
// violation's Trace past its return: a refused trace's steps are reused for
// the next candidate's.
func CheckAccepting[S any, A comparable](m Model[S, A], props Properties[S], opt Options, accept func(Violation[S, A]) bool) (*Result[S, A], error) {
	c, err := newRun(m, props, opt, accept)
	if err != nil {
		return nil, err
	}
	return c.run()
}

// run is one exploration.
type run[S any, A comparable] struct {
	m        Model[S, A]
	enc      Encoder[S]     // nil: the frontier holds states
	sel      Selector[S, A] // nil: a rebuild builds every successor on its path
	build    Builder[S, A]  // nil: each deferred successor is copied
	invs     []Invariant[S]
	goals    []Goal[S]
	opt      Options
	accept   func(Violation[S, A]) bool
	workers  int
	liveness bool

	deadlockName   string
	deferDeadlocks bool
	firstDeadlock  int32

	start    time.Time
	inits    []S
	seen     *visited
	bits     *bitArray // bitstate mode: the visited set; seen holds initial states only
	stored   int       // bitstate mode: states stored
	bad      bitset    // states that violate an invariant: never expanded
	goalSets []bitset  // per goal, the states that reach it
	edges    graph
	res      *Result[S, A]
	found    map[string]bool
	rejects  map[string]int
	// last is the last trace rebuilt and the choices that made it: a filter
	// that refuses many candidates gets them in breadth-first order, where
	// consecutive ones share most of their path, and a rebuild resumes at
	// the first choice that differs.
	last        []Step[S, A]
	lastChoices []int
	// lastKept says that last is held by a reported violation. Otherwise the
	// next rebuild writes its trace over last's steps: a trace is a State
	// per step (2 KB each for the spec), and the matrix's most filtered
	// combinations refuse millions of candidates, whose fresh traces were
	// a third of their CPU time (with the collections they caused, more).
	lastKept bool
	pick     *tracePick[S, A] // made by the first rebuild
	stop     bool
	heap     *heap

	blocks  blockPool[S]
	scratch []*worker[S, A]
	waves   [numShards]waveSet // per shard, the wave's first occurrences
	ref     []int32            // per candidate of the wave, its first occurrence's index
	num     []int32            // per first occurrence, its state number
}

func newRun[S any, A comparable](m Model[S, A], props Properties[S], opt Options, accept func(Violation[S, A]) bool) (*run[S, A], error) {
	if len(props.Invariants) > 64 || len(props.Goals) > 64 {
		return nil, errors.New("checker: at most 64 invariants and 64 goals")
	}
	c := &run[S, A]{m: m, invs: props.Invariants, goals: props.Goals, opt: opt, accept: accept,
		start: time.Now(), seen: newVisited(), res: &Result[S, A]{}, found: map[string]bool{},
		rejects: map[string]int{}, firstDeadlock: -1, heap: newHeap()}
	c.enc, _ = m.(Encoder[S])
	c.sel, _ = m.(Selector[S, A])
	c.build, _ = m.(Builder[S, A])
	c.workers = opt.Workers
	if c.workers <= 0 {
		c.workers = runtime.GOMAXPROCS(0)
	}
	c.res.Stats.Phases.Workers = c.workers
	if opt.Bitstate > 0 {
		if c.opt.Hashes <= 0 {
			c.opt.Hashes = 3
		}
		c.bits = newBitArray(opt.Bitstate, c.opt.Hashes)
	}
	c.liveness = len(c.goals) > 0 && !opt.SkipLiveness && c.bits == nil
	c.deadlockName = opt.DeadlockName
	if c.deadlockName == "" {
		c.deadlockName = DeadlockProperty
	}
	// A deadlock named after a goal is that goal's violation; the liveness
	// analysis finds its shortest form (a state from which the goal is out of
	// reach may come well before the state where nothing at all can happen).
	for _, g := range c.goals {
		c.deferDeadlocks = c.deferDeadlocks || c.liveness && g.Name == c.deadlockName
	}
	if c.opt.MaxRejects <= 0 {
		c.opt.MaxRejects = 100000
	}
	if c.opt.FrontierMemory <= 0 {
		c.opt.FrontierMemory = defaultFrontierMemory
		if opt.MaxMemory > 0 {
			c.opt.FrontierMemory = int(min(opt.MaxMemory/8, defaultFrontierMemory))
		}
	}
	if c.opt.SpillDir == "" {
		c.opt.SpillDir = os.TempDir()
	}
	c.goalSets = make([]bitset, len(c.goals))
	return c, nil
}

func (c *run[S, A]) evalInvs(s *S) uint64 {
	var bad uint64
	for i, inv := range c.invs {
		if !inv.Holds(s) {
			bad |= 1 << i
		}
	}
	return bad
}

func (c *run[S, A]) evalGoals(s *S) uint64 {
	if !c.liveness {
		return 0
	}
	var g uint64
	for i, goal := range c.goals {
		if goal.Reached(s) {
			g |= 1 << i
		}
	}
	return g
}

// report records a violation; it returns accepted=false when accept refused it.
func (c *run[S, A]) report(prop string, kind Kind, at stateRef) (bool, error) {
	if c.found[prop] {
		return true, nil
	}
	if c.rejects[prop] >= c.opt.MaxRejects {
		return false, nil
	}
	trace, err := c.rebuild(at)
	if err != nil {
		return false, err
	}
	if c.accept != nil && !c.accept(Violation[S, A]{Property: prop, Kind: kind, Trace: trace}) {
		c.rejects[prop]++
		if c.rejects[prop] >= c.opt.MaxRejects {
			c.res.Truncated = true
		}
		return false, nil
	}
	c.found[prop] = true
	c.res.Violations = append(c.res.Violations, Violation[S, A]{Property: prop, Kind: kind, Trace: trace})
	c.lastKept = true
	if !c.opt.All {
		c.stop = true
	}
	return true, nil
}

func (c *run[S, A]) reportMask(bad uint64, at stateRef) error {
	for i := range c.invs {
		if bad&(1<<i) != 0 {
			if _, err := c.report(c.invs[i].Name, Safety, at); err != nil {
				return err
			}
		}
	}
	return nil
}

// reserveRecords makes room to record the states below n (record).
func (c *run[S, A]) reserveRecords(n int) {
	for i := range c.goalSets {
		c.goalSets[i].grow(n)
	}
	c.bad.grow(n)
}

// record notes what is known of a new state, within the room
// reserveRecords made: its goals, and whether it is bad. A wave's commit
// tasks record their own states at once.
func (c *run[S, A]) record(idx int32, goals, badMask uint64) {
	for i := range c.goalSets {
		if goals&(1<<i) != 0 {
			c.goalSets[i].set(idx)
		}
	}
	if badMask != 0 {
		c.bad.set(idx)
	}
}

type badState struct {
	at   stateRef
	mask uint64
}

// count is the number of states stored.
func (c *run[S, A]) count() int {
	if c.bits != nil {
		return c.stored
	}
	return c.seen.len()
}

func (c *run[S, A]) stats() Stats {
	st := c.res.Stats
	st.States = c.count()
	st.Elapsed = time.Since(c.start)
	return st
}

func (c *run[S, A]) run() (*Result[S, A], error) {
	defer tuneCollector(c.opt.MaxMemory)()
	cur := c.newFrontier()
	defer func() { cur.close() }()
	c.inits = c.m.Initial()
	var buf []byte
	var newBad []badState
	var b0 *block[S]
	for i := range c.inits {
		s := &c.inits[i]
		buf = c.m.AppendFingerprint(buf[:0], s)
		if i > maxSuccessors {
			return nil, fmt.Errorf("checker: more than %d initial states", maxSuccessors)
		}
		fp := c.fingerprint(buf)
		var at stateRef
		if c.bits != nil {
			if !c.bits.add(fp) {
				continue
			}
			c.stored++
			at = stateRef{path: binary.AppendUvarint(nil, uint64(i)), fp: fp}
		} else {
			idx, added := c.seen.insert(fp, -1, uint16(i))
			if !added {
				continue
			}
			at.idx = idx
		}
		bad := c.evalInvs(s)
		if c.bits == nil {
			c.reserveRecords(int(at.idx) + 1)
			c.record(at.idx, c.evalGoals(s), bad)
		}
		if bad != 0 {
			newBad = append(newBad, badState{at, bad})
			continue
		}
		if b0 == nil || b0.len() == blockStates {
			if b0 != nil {
				if err := cur.push(b0); err != nil {
					return nil, err
				}
			}
			b0 = c.blocks.get(c.enc != nil)
		}
		if c.bits != nil {
			b0.paths = append(b0.paths, at.path...)
			b0.idx = append(b0.idx, int32(len(b0.paths)))
		} else {
			b0.idx = append(b0.idx, at.idx)
		}
		if c.enc == nil {
			b0.states = append(b0.states, *s)
		} else {
			buf = c.enc.AppendState(buf[:0], s)
			b0.data = binary.AppendUvarint(b0.data, uint64(len(buf)))
			b0.data = append(b0.data, buf...)
		}
	}
	if b0 != nil {
		if err := cur.push(b0); err != nil {
			return nil, err
		}
	}
	for _, b := range newBad {
		if err := c.reportMask(b.mask, b.at); err != nil {
			return nil, err
		}
	}

	waveFull := max(waveBlocks, 4*c.workers) // full blocks' worth of states a wave takes
	waveStates := waveFull * blockStates
	outs := make([]*expansion[S], 4*waveFull)
	for i := range outs {
		outs[i] = &expansion[S]{}
	}
	blocks := make([]*block[S], len(outs))
	depth := 0
	lastTick := time.Now()
	for cur.len() > 0 && !c.stop {
		next := c.newFrontier()
		var deadlocks []stateRef
		newBad = newBad[:0]
		for {
			n, states := 0, 0
			for n < len(blocks) && states < waveStates {
				b, err := cur.take()
				if err != nil {
					next.close()
					return nil, err
				}
				if b == nil {
					break
				}
				blocks[n] = b
				n++
				states += b.len()
			}
			if n == 0 {
				break
			}
			err := c.wave(blocks[:n], outs[:n], next, &deadlocks, &newBad)
			for i := range n {
				cur.recycle(blocks[i])
				blocks[i] = nil
			}
			if err != nil {
				next.close()
				return nil, err
			}
			if err := c.limits(depth); err != nil {
				next.close()
				return c.res, err
			}
			if c.opt.Progress != nil && time.Since(lastTick) >= time.Second {
				lastTick = time.Now()
				st := c.stats()
				st.Depth, st.PeakHeap = depth, c.heap.peak
				c.opt.Progress(st)
			}
		}
		cur.close()
		c.res.Stats.Spilled += next.spilledBytes
		cur = next
		for _, d := range deadlocks {
			if c.deferDeadlocks {
				if c.firstDeadlock < 0 {
					c.firstDeadlock = d.idx
				}
				continue
			}
			if _, err := c.report(c.deadlockName, Deadlock, d); err != nil {
				return nil, err
			}
		}
		for _, b := range newBad {
			if err := c.reportMask(b.mask, b.at); err != nil {
				return nil, err
			}
		}
		if cur.len() > 0 {
			depth++
		}
		c.res.Stats.Depth = depth
	}
	n := c.count()
	c.res.Stats.States = n
	c.res.Stats.Depth = depth
	c.seen.dropIndex()
	c.blocks.free = nil

	if c.liveness && !c.stop {
		c.heap.over(0)
		ph := &c.res.Stats.Phases
		reversing := time.Now()
		if n > 1<<20 {
			runtime.GC() // the index's memory, for the reverse graph
		}
		c.edges.close(n)
		rev := c.edges.reverse(n)
		ph.Reverse = time.Since(reversing)
		c.heap.over(0)
		// The cycle check and the goals' backward search are independent:
		// they run at once, and are reported in goal order.
		var unreached [][]int32
		isAcyclic := false
		parallel(&ph.Liveness, c.workers, 2, func(_, i int) {
			if i == 0 {
				isAcyclic = acyclic(n, &c.edges, rev)
				return
			}
			unreached = unreachableGoals(n, rev, c.goalSets, c.bad, c.opt.MaxRejects)
		})
		c.res.Stats.Acyclic = No
		if isAcyclic {
			c.res.Stats.Acyclic = Yes
		}
		for gi, g := range c.goals {
			for _, idx := range unreached[gi] {
				ok, err := c.report(g.Name, Liveness, stateRef{idx: idx})
				if err != nil {
					return nil, err
				}
				if ok {
					break
				}
			}
			if c.stop {
				break
			}
		}
		if c.firstDeadlock >= 0 && !c.found[c.deadlockName] && !c.stop {
			if _, err := c.report(c.deadlockName, Deadlock, stateRef{idx: c.firstDeadlock}); err != nil {
				return nil, err
			}
		}
	}
	c.heap.over(0)
	c.res.Stats.PeakHeap = c.heap.peak
	if c.bits != nil {
		c.res.Stats.Bitstate = c.bits.stats()
	}
	sortByLength(c.res.Violations)
	c.res.Stats.Elapsed = time.Since(c.start)
	return c.res, nil
}

// limits checks the state and memory limits after a wave.
func (c *run[S, A]) limits(depth int) error {
	over, objects := c.heap.over(c.opt.MaxMemory)
	adaptCollector(objects)
	var limit error
	switch {
	case c.opt.MaxStates > 0 && c.count() > c.opt.MaxStates:
		limit = ErrTooManyStates
	case over:
		limit = ErrMemoryLimit
	default:
		return nil
	}
	c.res.Stats.States = c.count()
	c.res.Stats.Depth = depth
	c.res.Stats.PeakHeap = c.heap.peak
	c.res.Stats.Elapsed = time.Since(c.start)
	if c.bits != nil {
		c.res.Stats.Bitstate = c.bits.stats()
	}
	return &LimitError{Err: limit, Stats: c.res.Stats}
}

func (c *run[S, A]) newFrontier() *frontier[S] {
	return &frontier[S]{encoded: c.enc != nil, budget: c.frontierBudget, dir: c.opt.SpillDir, pool: &c.blocks}
}

// frontierBudget is the memory each of the two frontiers (the level being
// expanded and the next) may hold before spilling: half of FrontierMemory, and
// no more than 8 bytes per visited state (but 32 MiB at least), so that the
// frontier never dominates the per-state cost.
func (c *run[S, A]) frontierBudget() int {
	return max(1, min(c.opt.FrontierMemory/2, max(32<<20, 8*c.count())))
}

func sortByLength[S any, A comparable](v []Violation[S, A]) {
	// Insertion sort keeps the discovery order among equal lengths.
	for i := 1; i < len(v); i++ {
		for j := i; j > 0 && len(v[j].Trace) < len(v[j-1].Trace); j-- {
			v[j], v[j-1] = v[j-1], v[j]
		}
	}
}

// stateRef names a state to report: by number, or in bitstate mode by its
// path (and fingerprint, when known).
type stateRef struct {
	idx  int32
	path []byte
	fp   Fingerprint
}

// fingerprint hashes a canonical encoding: with a seeded hash in bitstate
// mode, whose collisions replay from the seed.
func (c *run[S, A]) fingerprint(b []byte) Fingerprint {
	if c.bits != nil {
		return seededHash(c.opt.Seed, b)
	}
	return FingerprintOf(b)
}

// tracePick is what a rebuild's step looks for among a state's successors,
// with the callbacks that find it, and the rebuild's scratch: made once a
// run, as a State on the heap per rebuild (the callbacks make what they
// capture escape) cost the defense matrix, which rebuilds hundreds of
// thousands of traces, an allocation and a clear of 3.4 KB each.
type tracePick[S any, A comparable] struct {
	next    S
	action  A
	n, want int
	ok      bool
	take    func(a A, s *S)
	wanted  func(n int, a A) (take, more bool)

	path    []int32       // the states from an initial one
	choices []int         // each one's index among its parent's successors
	fps     []Fingerprint // each one's fingerprint
	buf     []byte        // a fingerprint's encoding
}

func (c *run[S, A]) tracePick() *tracePick[S, A] {
	if c.pick == nil {
		p := &tracePick[S, A]{}
		p.take = func(a A, s *S) {
			if p.n == p.want {
				p.next, p.action, p.ok = *s, a, true
			}
			p.n++
		}
		p.wanted = func(n int, _ A) (bool, bool) { return n == p.want, n < p.want }
		c.pick = p
	}
	return c.pick
}

// rebuild replays the recorded choices from the initial state to produce the
// concrete trace that reaches a state, checking each state's fingerprint
// (in bitstate mode, the last one's, when known).
func (c *run[S, A]) rebuild(at stateRef) ([]Step[S, A], error) {
	pick := c.tracePick()
	choices, fps := pick.choices[:0], []Fingerprint(nil)
	if at.path == nil {
		pick.path = c.seen.appendPath(pick.path[:0], at.idx)
		fps = pick.fps[:0]
		for _, i := range pick.path {
			choices = append(choices, int(c.seen.succ.at(int(i))))
			fps = append(fps, c.seen.fps.at(int(i)))
		}
		pick.fps = fps
	} else {
		for p := at.path; len(p) > 0; {
			v, k := binary.Uvarint(p)
			if k <= 0 {
				return nil, errors.New("checker: corrupt path")
			}
			choices, p = append(choices, int(v)), p[k:]
		}
	}
	pick.choices = choices
	if len(choices) == 0 || choices[0] >= len(c.inits) {
		return nil, ErrNondeterministic
	}
	check := func(i int, s *S) bool {
		if fps == nil && (i < len(choices)-1 || at.fp == (Fingerprint{})) {
			return true
		}
		want := at.fp
		if fps != nil {
			want = fps[i]
		}
		pick.buf = c.m.AppendFingerprint(pick.buf[:0], s)
		return c.fingerprint(pick.buf) == want
	}
	// The prefix the last rebuild shares (the same choices make the same
	// states): copied, not replayed.
	k := 0
	for k < len(choices) && k < len(c.lastChoices) && choices[k] == c.lastChoices[k] {
		k++
	}
	var trace []Step[S, A]
	switch {
	case !c.lastKept && cap(c.last) >= len(choices):
		trace = c.last[:k] // the shared prefix in place; the rest is overwritten
		c.lastChoices = c.lastChoices[:k]
	default:
		trace = append(make([]Step[S, A], 0, len(choices)), c.last[:k]...)
	}
	if k == 0 {
		init := &c.inits[choices[0]]
		if !check(0, init) {
			return nil, ErrNondeterministic
		}
		trace = append(trace, Step[S, A]{State: *init, Initial: true})
		k = 1
	}
	for i, want := range choices[k:] {
		i += k - 1
		// trace has room for every step: cur stays put while it grows.
		cur := &trace[len(trace)-1].State
		pick.n, pick.want, pick.ok = 0, want, false
		if c.sel != nil {
			pick.n = want // the one successor emitted is the wanted one
			c.sel.SuccessorsWhere(cur, pick.wanted, pick.take)
		} else {
			c.m.Successors(cur, pick.take)
		}
		if !pick.ok || !check(i+1, &pick.next) {
			return nil, ErrNondeterministic
		}
		trace = append(trace, Step[S, A]{Action: pick.action, State: pick.next})
	}
	c.last, c.lastChoices, c.lastKept = trace, append(c.lastChoices[:0], choices...), false
	return trace, nil
}
