package explore

import (
	"math"
	"slices"
	"sort"
	"sync"

	"github.com/kvhandoff/kvhandoff/internal/parallel"

	"github.com/kvhandoff/kvhandoff/spec"
	"github.com/kvhandoff/kvhandoff/spec/checker"
)

// MatrixRow is one switch of the defense matrix.
type MatrixRow struct {
	Bug       string     `json:"bug"`
	ExposedBy [][]string `json:"exposed_by"`
	Violated  []string   `json:"violated"`
}

// Matrix is the defense matrix: for every switch, the smallest combinations of
// switches whose counterexamples need all of them, and the properties those
// counterexamples violate.
type Matrix struct {
	Base    *Report // the unswitched protocol
	Rows    []MatrixRow
	MaxSize int
	Runs    int // explorations performed
	// Combos holds the report of every combination that exposed something,
	// keyed by its switches.
	Combos map[spec.Switches]*Report
}

// OK reports whether the unswitched protocol passes and every switch is exposed.
func (x *Matrix) OK() bool {
	if !x.Base.OK {
		return false
	}
	for _, r := range x.Rows {
		if len(r.ExposedBy) == 0 {
			return false
		}
	}
	return true
}

// DefenseMatrix computes the matrix for cfg (its Bugs are ignored), trying
// combinations of up to maxSize switches.
//
// A switch exposed on its own has itself as its only row entry. For the others
// the search goes by size, smallest first; at each size it first combines them
// only with switches that are harmless on their own at these bounds (removed
// defenses, not bugs that let more traffic in), so the row answers "which
// defenses hide this bug", and only for switches still unexposed does it then
// allow partners that are harmful on their own. Either way a
// combination counts only through a counterexample that needs every switch in
// it (see CheckNeeding). Combinations of one size run in parallel, one
// exploration per core. progress, if set, is told of each combination checked.
func DefenseMatrix(cfg spec.Config, maxSize int, opt Options, progress func(set spec.Switches, r *Report)) (*Matrix, error) {
	cfg.Bugs = 0
	base, err := Check(cfg, Options{MaxStates: opt.MaxStates, MaxMemory: opt.MaxMemory})
	if err != nil {
		return nil, err
	}
	x := &Matrix{Base: base, MaxSize: maxSize, Runs: 1, Combos: map[spec.Switches]*Report{}}
	all := spec.AllSwitches()
	exposedAt := map[spec.Switch]int{} // size at which each switch was first exposed
	tried := map[spec.Switches]bool{}
	stage := func(size int, pool []spec.Switch) error {
		var sets []spec.Switches
		forCombos(pool, size, func(c []spec.Switch) {
			var set spec.Switches
			open := false
			for _, s := range c {
				set = set.With(s)
				if _, done := exposedAt[s]; !done {
					open = true
				}
			}
			if open && !tried[set] {
				tried[set] = true
				sets = append(sets, set)
			}
		})
		results, err := runAll(cfg, sets, opt, progress)
		if err != nil {
			return err
		}
		x.Runs += len(sets)
		for i, set := range sets {
			if !results[i].OK {
				x.Combos[set] = results[i]
			}
		}
		for _, s := range all {
			if _, done := exposedAt[s]; done {
				continue
			}
			for _, set := range sets {
				if set.Has(s) && x.Combos[set] != nil {
					exposedAt[s] = size
				}
			}
		}
		return nil
	}
	if err := stage(1, all); err != nil {
		return nil, err
	}
	var silent []spec.Switch
	for _, s := range all {
		if _, done := exposedAt[s]; !done {
			silent = append(silent, s)
		}
	}
	for size := 2; size <= maxSize && len(exposedAt) < len(all); size++ {
		if err := stage(size, silent); err != nil {
			return nil, err
		}
		if len(exposedAt) < len(all) {
			if err := stage(size, all); err != nil {
				return nil, err
			}
		}
	}
	for _, s := range all {
		row := MatrixRow{Bug: s.String(), ExposedBy: [][]string{}, Violated: []string{}}
		if size, ok := exposedAt[s]; ok {
			var sets []spec.Switches
			for set := range x.Combos {
				if set.Has(s) && popcount(set) == size {
					sets = append(sets, set)
				}
			}
			slices.Sort(sets)
			for _, set := range sets {
				row.ExposedBy = append(row.ExposedBy, set.Names())
				for _, p := range x.Combos[set].Violated {
					if !slices.Contains(row.Violated, p) {
						row.Violated = append(row.Violated, p)
					}
				}
			}
			sort.Strings(row.Violated)
		}
		x.Rows = append(x.Rows, row)
	}
	return x, nil
}

func popcount(s spec.Switches) int {
	n := 0
	for ; s != 0; s &= s - 1 {
		n++
	}
	return n
}

func forCombos(all []spec.Switch, k int, f func([]spec.Switch)) {
	c := make([]spec.Switch, 0, k)
	var rec func(start int)
	rec = func(start int) {
		if len(c) == k {
			f(c)
			return
		}
		for i := start; i < len(all); i++ {
			c = append(c, all[i])
			rec(i + 1)
			c = c[:len(c)-1]
		}
	}
	rec(0)
}

// runAll checks each set, one exploration per core.
func runAll(cfg spec.Config, sets []spec.Switches, opt Options, progress func(spec.Switches, *Report)) ([]*Report, error) {
	out := make([]*Report, len(sets))
	errs := make([]error, len(sets))
	var mu sync.Mutex // progress reports one at a time
	parallel.For(len(sets), func(i int) {
		c := cfg
		c.Bugs = sets[i]
		c = c.Bugs.Bounds(c) // the faults a switch acts under (peer-by-name: a restart), and a prefix switch's cache
		out[i], errs[i] = CheckNeeding(c, Options{MaxStates: opt.MaxStates, MaxMemory: opt.MaxMemory})
		if progress != nil && errs[i] == nil {
			mu.Lock()
			progress(sets[i], out[i])
			mu.Unlock()
		}
	})
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	return out, nil
}

// CheckNeeding explores cfg and reports only counterexamples that need every
// switch in cfg.Bugs (see the package documentation). It runs on one core;
// of opt, only MaxStates and MaxMemory apply.
//
// The search never gives up: every bad state the exploration reaches is offered
// to the filter, however many are refused, so "holds" is a verdict and not a
// budget running out. (A partner switch that fails on its own makes hundreds of
// thousands of refused candidates: 361,586 for
// admit-finished,no-token-check,leak-on-cancel at the matrix's bounds.)
func CheckNeeding(cfg spec.Config, opt Options) (*Report, error) {
	m, err := spec.New(cfg)
	if err != nil {
		return nil, err
	}
	accept, err := needing(cfg)
	if err != nil {
		return nil, err
	}
	copt := checkerOptions(Options{Workers: 1, MaxStates: opt.MaxStates, MaxMemory: opt.MaxMemory})
	copt.MaxRejects = math.MaxInt
	res, err := checker.CheckAccepting(m, Properties(m), copt, accept)
	if err != nil {
		return nil, err
	}
	return report(m, res), nil
}

// needing returns the counterexample filter for cfg: it accepts a violation only
// if, with any one switch of cfg.Bugs turned off, the same actions no longer
// violate the same property.
//
// The filter is offered every bad state the exploration reaches, hundreds of
// thousands with a partner switch that fails alone, and a breadth-first
// search offers them in an order where consecutive traces share most of
// their actions (siblings, cousins): each switched-off model keeps its last
// replay and resumes at the first action that differs, and a goal's
// reachability is remembered by state. The answers are the same as replaying
// every trace from its start; only the cost differs (the matrix's most
// filtered combination went from 161 s to a fraction of that).
func needing(cfg spec.Config) (func(checker.Violation[spec.State, spec.Action]) bool, error) {
	var without []*replayer
	for _, s := range spec.AllSwitches() {
		if cfg.Bugs.Has(s) {
			c := cfg
			c.Bugs &^= spec.Switches(s)
			mw, err := spec.New(c)
			if err != nil {
				return nil, err
			}
			without = append(without, newReplayer(mw))
		}
	}
	var mu sync.Mutex // the checker may offer candidates from its workers
	return func(v checker.Violation[spec.State, spec.Action]) bool {
		mu.Lock()
		defer mu.Unlock()
		for _, r := range without {
			if r.stillViolates(v) {
				return false
			}
		}
		return true
	}, nil
}

// replayer replays counterexamples on a model with one switch off,
// remembering the last replay: the actions taken and the state after each
// (states[i] after actions[:i]; a replay that found an action disabled
// ends there, dead).
type replayer struct {
	m       *spec.Model
	actions []spec.Action
	states  []spec.State
	dead    bool // the last replay's final action was not enabled
	// reach remembers, by goal and state, whether the goal is reachable
	// from the state without faults (liveness candidates).
	reach map[reachKey]bool
	buf   []byte
	// A replay step has the model build only the first successor whose
	// action is want (wanted, SuccessorsWhere), which pick keeps in next,
	// setting found: fields and closures made once, not locals a closure
	// would move to the heap (a 3.4 KB State an action, millions of actions
	// in the matrix's most filtered combinations).
	want   spec.Action
	next   spec.State
	found  bool
	pick   func(a spec.Action, n *spec.State)
	wanted func(n int, a spec.Action) (take, more bool)
	search
}

// search is goalReachable's depth-first search, kept between searches so
// that one allocates nothing once they have grown: the matrix's most
// filtered combinations run hundreds of thousands of searches, of up to a
// few thousand states each (with a slice of successors and a string key
// allocated per state, the collector took more CPU than the searches).
// Clearing visited costs in proportion to the most it ever held: 0.42 s of
// the 26.5 s of admit-finished,no-token-check,leak-on-cancel, whose largest
// search visits 2,866 states.
type search struct {
	visited  map[checker.Fingerprint]struct{}
	frames   []frame
	pending  []spec.State // the frames' successors not yet searched, the top frame's last
	cur      spec.State   // the state being pushed, copied out of pending
	keep     func(a spec.Action, n *spec.State)
	searched int // how many states the searches pushed (tests)
}

// frame is a state on the search's stack; its successors not yet searched
// are pending[from:] while it is on top.
type frame struct {
	fp   checker.Fingerprint
	from int
}

// reachKey names a goal, by its index in spec.Goals, and a state, by its
// fingerprint: keys of a few bytes (not the encodings) that the collector
// need not scan, taking the checker's own assumption that two states with
// the same fingerprint are the same state.
type reachKey struct {
	goal int
	fp   checker.Fingerprint
}

// newReplayer returns a replayer for m.
func newReplayer(m *spec.Model) *replayer {
	r := &replayer{m: m, reach: map[reachKey]bool{}}
	r.visited = map[checker.Fingerprint]struct{}{}
	r.pick = func(_ spec.Action, n *spec.State) { r.next, r.found = *n, true }
	r.wanted = func(_ int, a spec.Action) (bool, bool) { return a == r.want, a != r.want } // the first match
	r.keep = func(a spec.Action, n *spec.State) {
		if !a.IsFault() {
			r.pending = append(r.pending, *n)
		}
	}
	return r
}

// fingerprint is s's fingerprint in r's model.
func (r *replayer) fingerprint(s *spec.State) checker.Fingerprint {
	r.buf = r.m.AppendFingerprint(r.buf[:0], s)
	return checker.FingerprintOf(r.buf)
}

// maxReach bounds reach: it is cleared when it holds this many answers (a
// bound on memory, not on the answers: 80 MiB of map at the bound).
const maxReach = 1 << 20

// goalReachable reports whether goal g (spec.Goals[g]) is reachable from s
// without faults: a depth-first search that stops at a state known either
// way. When it finds the goal, every state on its stack reaches it; when it
// does not, no state it visited does (it explored their whole closure). Both
// are remembered, so the candidates of one exploration, which share most of
// their futures, search each state about once.
func (r *replayer) goalReachable(g int, s *spec.State) bool {
	fp := r.fingerprint(s)
	if ok, known := r.reach[reachKey{g, fp}]; known {
		return ok
	}
	if len(r.reach) >= maxReach {
		clear(r.reach)
	}
	clear(r.visited)
	r.frames, r.pending = r.frames[:0], r.pending[:0]
	r.cur = *s
	found := r.push(g, fp)
	for !found && len(r.frames) > 0 {
		if top := &r.frames[len(r.frames)-1]; len(r.pending) == top.from {
			r.frames = r.frames[:len(r.frames)-1]
			continue
		}
		r.cur = r.pending[len(r.pending)-1]
		r.pending = r.pending[:len(r.pending)-1]
		found = r.push(g, r.fingerprint(&r.cur))
	}
	if found {
		for _, f := range r.frames {
			r.reach[reachKey{g, f.fp}] = true
		}
		return true
	}
	for fp := range r.visited {
		r.reach[reachKey{g, fp}] = false
	}
	return false
}

// push looks at r.cur, whose fingerprint is fp, and reports whether it
// settles the search: the goal, or a state known to reach it. Otherwise it
// is searched (its successors without faults pending, on a new frame),
// unless it is known not to reach the goal or was visited already.
func (r *replayer) push(g int, fp checker.Fingerprint) bool {
	st := &r.cur
	if ok, known := r.reach[reachKey{g, fp}]; known {
		return ok
	}
	if _, seen := r.visited[fp]; seen {
		return false
	}
	r.visited[fp] = struct{}{}
	r.searched++
	if spec.Goals[g].Reached(r.m, st) {
		r.reach[reachKey{g, fp}] = true
		return true
	}
	r.frames = append(r.frames, frame{fp: fp, from: len(r.pending)})
	r.m.Successors(st, r.keep)
	return false
}

// stillViolates replays v's actions on the model and reports whether they
// are all enabled there and still end in a violation of the same property.
func (r *replayer) stillViolates(v checker.Violation[spec.State, spec.Action]) bool {
	steps := v.Trace[1:]
	// The longest prefix of actions the last replay shares.
	k := 0
	for k < len(steps) && k < len(r.actions) && steps[k].Action == r.actions[k] {
		k++
	}
	if r.dead && k == len(r.actions) {
		return false // its prefix is already disabled here
	}
	if len(r.states) == 0 {
		r.states = append(r.states, r.m.Initial()[0])
	}
	r.actions, r.states, r.dead = r.actions[:k], r.states[:k+1], false
	for i := k; i < len(steps); i++ {
		r.want, r.found = steps[i].Action, false
		r.m.SuccessorsWhere(&r.states[len(r.states)-1], r.wanted, r.pick)
		r.actions = append(r.actions, r.want)
		if !r.found {
			r.dead = true
			return false
		}
		r.states = append(r.states, r.next)
	}
	cur := &r.states[len(r.states)-1]
	switch v.Kind {
	case checker.Safety:
		for _, inv := range spec.Invariants {
			if inv.Name == v.Property {
				return !inv.Holds(r.m, cur)
			}
		}
	case checker.Deadlock, checker.Liveness:
		// A deadlock is reported as Termination: without the switch, the
		// question is whether Termination can still be reached, not whether the
		// state is literally stuck (another request may still move).
		for g := range spec.Goals {
			if spec.Goals[g].Name == v.Property {
				return !r.goalReachable(g, cur)
			}
		}
	}
	return false
}
