package checker

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
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
	// copies what it keeps.
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
	// MaxMemory stops exploration with ErrMemoryLimit when the live Go heap,
	// measured with runtime/metrics, exceeds this many bytes; 0 means no limit.
	// While it runs, Check also lowers the runtime's soft memory limit
	// (debug.SetMemoryLimit) to it, so the collector works harder before
	// giving up; with concurrent explorations the limit is the smallest of
	// theirs. Check also lowers GOGC to 25 while it runs (see gcPercent); the
	// program's settings come back when the last exploration ends.
	MaxMemory uint64
	// FrontierMemory is how many bytes of encoded frontier are held in memory
	// before the oldest blocks are spilled to a file in SpillDir (only for a
	// model that implements Encoder); 0 means MaxMemory/8, at most 512 MiB.
	// Below that the frontier also spills past 16 bytes per visited state (but
	// 64 MiB at least): a wide level then costs disk, not memory.
	FrontierMemory int
	// SpillDir is the directory for spill files; "" means os.TempDir().
	SpillDir string
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

// defaultFrontierMemory is the default Options.FrontierMemory: past this the
// frontier is read and written sequentially from disk, which costs little next
// to expanding it.
const defaultFrontierMemory = 512 << 20

// candRef marks an edge whose target is a candidate of the same expansion,
// numbered when the expansion is merged.
const candRef = 1 << 31

// candidate is a successor not in the visited set when it was generated.
type candidate struct {
	parent  int32
	succ    uint16
	fault   bool
	fp      fingerprint
	badMask uint64 // invariants violated (bit i = invariant i)
	goals   uint64 // goals reached
}

// expansion is what a worker produced from one frontier block.
type expansion[S any] struct {
	src         []int32  // the block's states, in order
	edgeEnd     []int32  // per source, the end of its edges in edges
	edges       []uint32 // protocol edges: a state number, or candRef|candidate
	cands       []candidate
	states      []S     // the candidates' states, without an encoder
	data        []byte  // with an encoder: the candidates' encodings, each after its uvarint length
	deadlocks   []int32 // sources with no enabled action that are not finished
	transitions int
	err         error
	local       map[fingerprint]int32 // candidates of this block by fingerprint
	numbers     []int32               // the candidates' state numbers, set by merge
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
	c, err := newRun(m, props, opt, accept)
	if err != nil {
		return nil, err
	}
	return c.run()
}

// run is one exploration.
type run[S any, A comparable] struct {
	m        Model[S, A]
	enc      Encoder[S] // nil: the frontier holds states
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
	bad      bitset   // states that violate an invariant: never expanded
	goalSets []bitset // per goal, the states that reach it
	edges    graph
	res      *Result[S, A]
	found    map[string]bool
	rejects  map[string]int
	stop     bool
	heap     *heap

	blocks  blockPool[S]
	scratch []*worker[S, A]
}

func newRun[S any, A comparable](m Model[S, A], props Properties[S], opt Options, accept func(Violation[S, A]) bool) (*run[S, A], error) {
	if len(props.Invariants) > 64 || len(props.Goals) > 64 {
		return nil, errors.New("checker: at most 64 invariants and 64 goals")
	}
	c := &run[S, A]{m: m, invs: props.Invariants, goals: props.Goals, opt: opt, accept: accept,
		start: time.Now(), seen: newVisited(), res: &Result[S, A]{}, found: map[string]bool{},
		rejects: map[string]int{}, firstDeadlock: -1, heap: newHeap()}
	c.enc, _ = m.(Encoder[S])
	c.workers = opt.Workers
	if c.workers <= 0 {
		c.workers = runtime.GOMAXPROCS(0)
	}
	c.liveness = len(c.goals) > 0 && !opt.SkipLiveness
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
func (c *run[S, A]) report(prop string, kind Kind, idx int32) (bool, error) {
	if c.found[prop] {
		return true, nil
	}
	if c.rejects[prop] >= c.opt.MaxRejects {
		return false, nil
	}
	trace, err := c.rebuild(idx)
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
	if !c.opt.All {
		c.stop = true
	}
	return true, nil
}

func (c *run[S, A]) reportMask(bad uint64, idx int32) error {
	for i := range c.invs {
		if bad&(1<<i) != 0 {
			if _, err := c.report(c.invs[i].Name, Safety, idx); err != nil {
				return err
			}
		}
	}
	return nil
}

// record notes what is known of a new state: its goals, and whether it is bad.
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
	idx  int32
	mask uint64
}

func (c *run[S, A]) stats() Stats {
	st := c.res.Stats
	st.States = c.seen.len()
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
	for i := range c.inits {
		s := &c.inits[i]
		buf = c.m.AppendFingerprint(buf[:0], s)
		if i > maxSuccessors {
			return nil, fmt.Errorf("checker: more than %d initial states", maxSuccessors)
		}
		idx, added := c.seen.insert(fingerprintOf(buf), -1, uint16(i))
		if !added {
			continue
		}
		bad := c.evalInvs(s)
		c.record(idx, c.evalGoals(s), bad)
		if bad != 0 {
			newBad = append(newBad, badState{idx, bad})
			continue
		}
		if err := c.push(cur, idx, s, &buf); err != nil {
			return nil, err
		}
	}
	for _, b := range newBad {
		if err := c.reportMask(b.mask, b.idx); err != nil {
			return nil, err
		}
	}

	outs := make([]*expansion[S], 2*c.workers) // a wave: blocks expanded in parallel, then merged in order
	for i := range outs {
		outs[i] = &expansion[S]{local: map[fingerprint]int32{}}
	}
	blocks := make([]*block[S], len(outs))
	depth := 0
	lastTick := time.Now()
	for cur.states > 0 && !c.stop {
		next := c.newFrontier()
		var deadlocks []int32
		newBad = newBad[:0]
		for {
			n := 0
			for n < len(blocks) {
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
			}
			if n == 0 {
				break
			}
			c.expandWave(blocks[:n], outs[:n])
			for i := 0; i < n; i++ {
				cur.recycle(blocks[i])
				blocks[i] = nil
				if err := c.merge(outs[i], next, &deadlocks, &newBad, &buf); err != nil {
					next.close()
					return nil, err
				}
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
					c.firstDeadlock = d
				}
				continue
			}
			if _, err := c.report(c.deadlockName, Deadlock, d); err != nil {
				return nil, err
			}
		}
		for _, b := range newBad {
			if err := c.reportMask(b.mask, b.idx); err != nil {
				return nil, err
			}
		}
		if cur.states > 0 {
			depth++
		}
		c.res.Stats.Depth = depth
	}
	n := c.seen.len()
	c.res.Stats.States = n
	c.res.Stats.Depth = depth
	c.seen.dropIndex()
	c.blocks = blockPool[S]{}

	if c.liveness && !c.stop {
		c.heap.over(0)
		if n > 1<<20 {
			runtime.GC() // the index's memory, for the reverse graph
		}
		c.edges.close(n)
		rev := c.edges.reverse(n)
		c.heap.over(0)
		c.res.Stats.Acyclic = No
		if acyclic(n, &c.edges, rev) {
			c.res.Stats.Acyclic = Yes
		}
		for gi, g := range c.goals {
			for _, idx := range unreachableGoal(n, rev, c.goalSets[gi], c.bad, c.opt.MaxRejects) {
				ok, err := c.report(g.Name, Liveness, idx)
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
			if _, err := c.report(c.deadlockName, Deadlock, c.firstDeadlock); err != nil {
				return nil, err
			}
		}
	}
	c.heap.over(0)
	c.res.Stats.PeakHeap = c.heap.peak
	sortByLength(c.res.Violations)
	c.res.Stats.Elapsed = time.Since(c.start)
	return c.res, nil
}

// limits checks the state and memory limits after a wave.
func (c *run[S, A]) limits(depth int) error {
	over, _ := c.heap.over(c.opt.MaxMemory)
	var limit error
	switch {
	case c.opt.MaxStates > 0 && c.seen.len() > c.opt.MaxStates:
		limit = ErrTooManyStates
	case over:
		limit = ErrMemoryLimit
	default:
		return nil
	}
	c.res.Stats.States = c.seen.len()
	c.res.Stats.Depth = depth
	c.res.Stats.PeakHeap = c.heap.peak
	c.res.Stats.Elapsed = time.Since(c.start)
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
	return max(1, min(c.opt.FrontierMemory/2, max(32<<20, 8*c.seen.len())))
}

// push appends a state to a frontier, encoded if the model can.
func (c *run[S, A]) push(f *frontier[S], idx int32, s *S, buf *[]byte) error {
	if c.enc == nil {
		return f.pushState(idx, *s)
	}
	*buf = c.enc.AppendState((*buf)[:0], s)
	return f.pushEncoded(idx, *buf)
}

// expandWave expands blocks[i] into outs[i], in parallel.
func (c *run[S, A]) expandWave(blocks []*block[S], outs []*expansion[S]) {
	for len(c.scratch) < c.workers {
		c.scratch = append(c.scratch, newWorker(c))
	}
	var next atomic.Int32
	var wg sync.WaitGroup
	for wi := range min(c.workers, len(blocks)) {
		wg.Add(1)
		go func(w *worker[S, A]) {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= len(blocks) {
					return
				}
				w.expand(blocks[i], outs[i])
			}
		}(c.scratch[wi])
	}
	wg.Wait()
}

// worker is one goroutine's scratch space, kept for the whole run: expanding a
// state allocates nothing.
type worker[S any, A comparable] struct {
	c     *run[S, A]
	state S // the state being expanded
	fbuf  []byte
	ebuf  []byte
	emit  func(a A, succ *S) // looks at one successor of the state being expanded

	out    *expansion[S] // where successors go
	parent int32         // the number of the state being expanded
	n      int           // its successors so far
}

func newWorker[S any, A comparable](c *run[S, A]) *worker[S, A] {
	w := &worker[S, A]{c: c}
	w.emit = w.successor
	return w
}

// expand generates the successors of every state of b. It only reads the
// visited set, which nobody writes while workers run.
func (w *worker[S, A]) expand(b *block[S], out *expansion[S]) {
	c := w.c
	out.src = append(out.src[:0], b.idx...)
	out.edgeEnd, out.edges, out.cands = out.edgeEnd[:0], out.edges[:0], out.cands[:0]
	clear(out.states)
	out.states, out.data, out.deadlocks = out.states[:0], out.data[:0], out.deadlocks[:0]
	out.transitions, out.err = 0, nil
	clear(out.local)
	w.out = out
	data := b.data
	for i, parent := range b.idx {
		var s *S
		if c.enc == nil {
			s = &b.states[i]
		} else {
			l, k := binary.Uvarint(data)
			if k <= 0 || uint64(len(data)-k) < l {
				out.err = errors.New("checker: corrupt frontier block")
				return
			}
			if err := c.enc.DecodeState(data[k:k+int(l)], &w.state); err != nil {
				out.err = fmt.Errorf("checker: DecodeState: %w", err)
				return
			}
			data = data[k+int(l):]
			s = &w.state
		}
		w.parent, w.n = parent, 0
		c.m.Successors(s, w.emit)
		out.transitions += w.n
		out.edgeEnd = append(out.edgeEnd, int32(len(out.edges)))
		if w.n == 0 && !c.m.Finished(s) {
			out.deadlocks = append(out.deadlocks, parent)
		}
	}
	w.out = nil
}

// successor looks at the next successor of the state being expanded.
func (w *worker[S, A]) successor(a A, next *S) {
	c, out := w.c, w.out
	k := w.n
	w.n++
	if k > maxSuccessors {
		out.err = fmt.Errorf("checker: a state has more than %d successors", maxSuccessors)
		return
	}
	w.fbuf = c.m.AppendFingerprint(w.fbuf[:0], next)
	fp := fingerprintOf(w.fbuf)
	fault := c.m.IsFault(a)
	protocol := c.liveness && !fault
	if known := c.seen.lookup(fp); known >= 0 {
		if protocol {
			out.edges = append(out.edges, uint32(known))
		}
		return
	}
	if ci, ok := out.local[fp]; ok {
		if protocol {
			out.edges = append(out.edges, candRef|uint32(ci))
		}
		return
	}
	ci := int32(len(out.cands))
	out.local[fp] = ci
	out.cands = append(out.cands, candidate{parent: w.parent, succ: uint16(k), fault: fault, fp: fp,
		badMask: c.evalInvs(next), goals: c.evalGoals(next)})
	if protocol {
		out.edges = append(out.edges, candRef|uint32(ci))
	}
	if c.enc == nil {
		out.states = append(out.states, *next)
	} else {
		w.ebuf = c.enc.AppendState(w.ebuf[:0], next)
		out.data = binary.AppendUvarint(out.data, uint64(len(w.ebuf)))
		out.data = append(out.data, w.ebuf...)
	}
}

// merge numbers the new states of one expansion, in order, and appends them to
// the next frontier and their edges to the graph.
func (c *run[S, A]) merge(out *expansion[S], next *frontier[S], deadlocks *[]int32, newBad *[]badState, buf *[]byte) error {
	if out.err != nil {
		return out.err
	}
	c.res.Stats.Transitions += out.transitions
	*deadlocks = append(*deadlocks, out.deadlocks...)
	numbers := slices.Grow(out.numbers[:0], len(out.cands))[:len(out.cands)]
	out.numbers = numbers
	data := out.data
	for ci := range out.cands {
		cd := &out.cands[ci]
		var enc []byte
		if c.enc != nil {
			l, k := binary.Uvarint(data)
			enc, data = data[k:k+int(l)], data[k+int(l):]
		}
		idx, added := c.seen.insert(cd.fp, cd.parent, cd.succ)
		numbers[ci] = idx
		if !added {
			continue
		}
		c.record(idx, cd.goals, cd.badMask)
		if cd.badMask != 0 {
			*newBad = append(*newBad, badState{idx, cd.badMask})
			continue
		}
		var err error
		if c.enc == nil {
			err = next.pushState(idx, out.states[ci])
		} else {
			err = next.pushEncoded(idx, enc)
		}
		if err != nil {
			return err
		}
	}
	if !c.liveness {
		return nil
	}
	from := int32(0)
	for si, src := range out.src {
		c.edges.open(src)
		for _, e := range out.edges[from:out.edgeEnd[si]] {
			dst := int32(e)
			if e&candRef != 0 {
				dst = numbers[e&^candRef]
			}
			if err := c.edges.add(dst); err != nil {
				return err
			}
		}
		from = out.edgeEnd[si]
	}
	return nil
}

func sortByLength[S any, A comparable](v []Violation[S, A]) {
	// Insertion sort keeps the discovery order among equal lengths.
	for i := 1; i < len(v); i++ {
		for j := i; j > 0 && len(v[j].Trace) < len(v[j-1].Trace); j-- {
			v[j], v[j-1] = v[j-1], v[j]
		}
	}
}

// rebuild replays the recorded choices from the initial state to produce the
// concrete trace that reaches idx, checking each state's fingerprint.
func (c *run[S, A]) rebuild(idx int32) ([]Step[S, A], error) {
	p := c.seen.path(idx)
	var buf []byte
	cur := c.inits[c.seen.succ.at(int(p[0]))]
	buf = c.m.AppendFingerprint(buf[:0], &cur)
	if fingerprintOf(buf) != c.seen.fps.at(int(p[0])) {
		return nil, ErrNondeterministic
	}
	trace := []Step[S, A]{{State: cur, Initial: true}}
	for _, i := range p[1:] {
		want := int(c.seen.succ.at(int(i)))
		var next S
		var action A
		n, ok := 0, false
		c.m.Successors(&cur, func(a A, s *S) {
			if n == want {
				next, action, ok = *s, a, true
			}
			n++
		})
		if !ok {
			return nil, ErrNondeterministic
		}
		buf = c.m.AppendFingerprint(buf[:0], &next)
		if fingerprintOf(buf) != c.seen.fps.at(int(i)) {
			return nil, ErrNondeterministic
		}
		cur = next
		trace = append(trace, Step[S, A]{Action: action, State: cur})
	}
	return trace, nil
}
