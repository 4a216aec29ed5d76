package explore

import (
	"fmt"
	"time"

	"github.com/kvhandoff/kvhandoff/spec"
	"github.com/kvhandoff/kvhandoff/spec/checker"
)

// Step is one numbered step of a counterexample.
type Step struct {
	Step   int         `json:"step"`
	Action string      `json:"action"`
	Detail string      `json:"detail"`
	Kind   spec.Action `json:"-"`
}

// Report is the outcome of a check or a simulation.
type Report struct {
	Bugs       spec.Switches
	OK         bool
	Property   string // the first violated property, "" if OK
	Kind       checker.Kind
	Violated   []string // every property found violated (first occurrences)
	Stats      checker.Stats
	Trace      []Step
	Simulation *SimStats
	Coverage   *spec.Coverage // what the exploration took, if Options.Coverage was set
}

// SimStats describes a simulation run.
type SimStats struct {
	Seed  uint64
	Walks int
	Steps int
	Walk  int // the walk that failed, if any
}

// Options tune Check.
type Options struct {
	Workers   int
	MaxStates int
	MaxMemory uint64 // bytes of live heap; see checker.Options.MaxMemory
	All       bool   // look for every property's first violation, not only the first one
	Progress  func(checker.Stats)
	// Coverage, if set, counts every action and branch of the spec the
	// exploration takes (see CoverageRows).
	Coverage *spec.Coverage
	// Bitstate, Hashes, Seed and Shuffle select bitstate mode; see checker.Options.
	Bitstate uint64
	Hashes   int
	Seed     uint64
	Shuffle  uint64
}

// Properties binds the spec's predicates to m.
func Properties(m *spec.Model) checker.Properties[spec.State] {
	var p checker.Properties[spec.State]
	for _, inv := range spec.Invariants {
		p.Invariants = append(p.Invariants, checker.Invariant[spec.State]{Name: inv.Name, Holds: func(s *spec.State) bool { return inv.Holds(m, s) }})
	}
	for _, g := range spec.Goals {
		p.Goals = append(p.Goals, checker.Goal[spec.State]{Name: g.Name, Reached: func(s *spec.State) bool { return g.Reached(m, s) }})
	}
	return p
}

// checkerOptions are the options every spec exploration uses: a deadlock is a
// Termination violation, since Finished is exactly Termination's goal.
func checkerOptions(opt Options) checker.Options {
	return checker.Options{Workers: opt.Workers, MaxStates: opt.MaxStates, MaxMemory: opt.MaxMemory, All: opt.All, Progress: opt.Progress, DeadlockName: spec.Termination,
		Bitstate: opt.Bitstate, Hashes: opt.Hashes, Seed: opt.Seed, Shuffle: opt.Shuffle}
}

// Check explores cfg exhaustively.
func Check(cfg spec.Config, opt Options) (*Report, error) {
	m, err := spec.New(cfg)
	if err != nil {
		return nil, err
	}
	if opt.Coverage != nil {
		m = m.WithCoverage(opt.Coverage)
	}
	res, err := checker.Check(m, Properties(m), checkerOptions(opt))
	if err != nil {
		return nil, err
	}
	r := report(m, res)
	r.Coverage = opt.Coverage
	return r, nil
}

func report(m *spec.Model, res *checker.Result[spec.State, spec.Action]) *Report {
	r := &Report{Bugs: m.Config().Bugs, OK: res.OK(), Stats: res.Stats}
	for _, v := range res.Violations {
		r.Violated = append(r.Violated, v.Property)
	}
	if !r.OK {
		v := res.Violations[0]
		r.Property, r.Kind = v.Property, v.Kind
		r.Trace = Describe(m, v.Trace)
	}
	return r
}

// Describe numbers a checker trace and explains each step.
func Describe(m *spec.Model, trace []checker.Step[spec.State, spec.Action]) []Step {
	var out []Step
	for i := 1; i < len(trace); i++ {
		what, detail := m.Describe(&trace[i-1].State, trace[i].Action, &trace[i].State)
		out = append(out, Step{Step: i, Action: what, Detail: detail, Kind: trace[i].Action})
	}
	return out
}

// SimOptions tune Simulate.
type SimOptions struct {
	Seed  uint64
	Walks int
	Depth int
}

// Simulate explores cfg by seeded random walks.
func Simulate(cfg spec.Config, opt SimOptions) (*Report, error) {
	m, err := spec.New(cfg)
	if err != nil {
		return nil, err
	}
	if opt.Walks < 1 || opt.Depth < 1 {
		return nil, fmt.Errorf("simulate: walks and depth must be at least 1")
	}
	start := time.Now()
	res := checker.Simulate(m, Properties(m), checker.SimOptions{Seed: opt.Seed, Walks: opt.Walks, Depth: opt.Depth, DeadlockName: spec.Termination})
	r := &Report{Bugs: cfg.Bugs, OK: res.Violation == nil,
		Stats:      checker.Stats{States: res.Steps, Transitions: res.Steps, Depth: res.MaxDepth, Elapsed: time.Since(start)},
		Simulation: &SimStats{Seed: opt.Seed, Walks: res.Walks, Steps: res.Steps, Walk: res.Walk}}
	if v := res.Violation; v != nil {
		r.Property, r.Kind, r.Violated = v.Property, v.Kind, []string{v.Property}
		r.Trace = Describe(m, v.Trace)
	}
	return r, nil
}
