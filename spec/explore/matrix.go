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
func needing(cfg spec.Config) (func(checker.Violation[spec.State, spec.Action]) bool, error) {
	var without []*spec.Model
	for _, s := range spec.AllSwitches() {
		if cfg.Bugs.Has(s) {
			c := cfg
			c.Bugs &^= spec.Switches(s)
			mw, err := spec.New(c)
			if err != nil {
				return nil, err
			}
			without = append(without, mw)
		}
	}
	return func(v checker.Violation[spec.State, spec.Action]) bool {
		for _, mw := range without {
			if stillViolates(mw, v) {
				return false
			}
		}
		return true
	}, nil
}

// stillViolates replays v's actions on mw and reports whether they are all
// enabled there and still end in a violation of the same property.
func stillViolates(mw *spec.Model, v checker.Violation[spec.State, spec.Action]) bool {
	cur := mw.Initial()[0]
	for _, st := range v.Trace[1:] {
		var next spec.State
		found := false
		mw.Successors(&cur, func(a spec.Action, n *spec.State) {
			if !found && a == st.Action {
				next, found = *n, true
			}
		})
		if !found {
			return false
		}
		cur = next
	}
	switch v.Kind {
	case checker.Safety:
		for _, inv := range spec.Invariants {
			if inv.Name == v.Property {
				return !inv.Holds(mw, &cur)
			}
		}
	case checker.Deadlock, checker.Liveness:
		// A deadlock is reported as Termination: without the switch, the
		// question is whether Termination can still be reached, not whether the
		// state is literally stuck (another request may still move).
		for _, g := range spec.Goals {
			if g.Name == v.Property {
				return !goalReachable(mw, &cur, func(s *spec.State) bool { return g.Reached(mw, s) })
			}
		}
	}
	return false
}

// goalReachable searches forward from s over protocol actions for a goal state.
func goalReachable(m *spec.Model, s *spec.State, goal func(*spec.State) bool) bool {
	seen := map[string]bool{}
	queue := []spec.State{*s}
	var buf []byte
	for len(queue) > 0 {
		cur := queue[0]
		queue = queue[1:]
		if goal(&cur) {
			return true
		}
		m.Successors(&cur, func(a spec.Action, n *spec.State) {
			if a.IsFault() {
				return
			}
			buf = m.AppendFingerprint(buf[:0], n)
			if !seen[string(buf)] {
				seen[string(buf)] = true
				queue = append(queue, *n)
			}
		})
	}
	return false
}
