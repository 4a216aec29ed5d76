package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/parallel"
	"github.com/kvhandoff/kvhandoff/spec"
	"github.com/kvhandoff/kvhandoff/spec/explore"
)

// mutantConfig is one configuration of the mutation gate: a line of check
// flags, and the configuration they give.
type mutantConfig struct {
	line string
	cfg  spec.Config
}

// readMutantConfigs reads the gate's configurations: one line of check flags
// each; blank lines and lines starting with # are skipped.
func readMutantConfigs(path string) ([]mutantConfig, error) {
	file, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer file.Close()
	var out []mutantConfig
	sc := bufio.NewScanner(file)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		var g checkFlags
		fs := newFlags("check", checkUsage, io.Discard)
		g.define(fs)
		if err := fs.Parse(strings.Fields(line)); err != nil || fs.NArg() > 0 {
			return nil, fmt.Errorf("%s:%d: not check flags: %q", path, n, line)
		}
		if g.bugs != "" || g.mutation != "" || g.matrix || g.simulate || g.needAll {
			return nil, fmt.Errorf("%s:%d: a configuration names bounds and faults only, not %q", path, n, line)
		}
		cfg, err := g.config()
		if err != nil {
			return nil, fmt.Errorf("%s:%d: %w", path, n, err)
		}
		out = append(out, mutantConfig{line: line, cfg: cfg})
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s: no configuration", path)
	}
	return out, nil
}

// runMutants is the mutation gate (docs/spec.md, "The mutation gate"): the
// correct protocol must pass every configuration, and each mutant (every
// switch alone, every mutation of spec.AllMutations) must violate a
// property in one of them, unless spec.Equivalent lists it with its
// argument; a listed one that is caught fails the gate too (the argument is
// wrong). Exit 0 iff all of that holds, 1 if not, 2 on bad usage.
func (f *checkFlags) runMutants(stdout, stderr io.Writer) int {
	configs, err := readMutantConfigs(f.mutants)
	if err != nil {
		return f.usageError(err, stdout, stderr)
	}
	maxMem, err := maxMemory(f.maxMemory)
	if err != nil {
		return f.usageError(err, stdout, stderr)
	}
	start := time.Now()
	runs := 0
	check := func(cfg spec.Config) (*explore.Report, error) {
		runs++
		return explore.Check(cfg, explore.Options{Workers: f.workers, MaxMemory: maxMem, MaxStates: f.maxStates})
	}
	fmt.Fprintln(stdout, "configurations:")
	failed := false
	for i, c := range configs {
		r, err := check(c.cfg)
		if err != nil {
			return f.explorationFailed(err, c.cfg, stdout, stderr)
		}
		verdict := fmt.Sprintf("holds, %d states", r.Stats.States)
		if !r.OK {
			verdict, failed = "VIOLATES "+r.Property+" without any mutation", true
		}
		fmt.Fprintf(stdout, "  %d. %s (%s)\n", i+1, c.line, verdict)
	}
	type mutant struct {
		name string
		bugs spec.Switches
		mu   spec.Mutation
	}
	var mutants []mutant
	for _, sw := range spec.AllSwitches() {
		mutants = append(mutants, mutant{sw.String(), spec.Switches(sw), spec.NoMutation})
	}
	for _, mu := range spec.AllMutations() {
		mutants = append(mutants, mutant{mu.String(), 0, mu})
	}
	fmt.Fprintf(stdout, "%-34s %s\n", "mutant", "caught by")
	// The mutants are independent: each is explored on a core of its own
	// (one worker each, which uses a core better than two workers on one
	// exploration), and reported in order.
	type verdict struct {
		by   string
		runs int
		err  error
		cfg  spec.Config // the configuration whose exploration failed
	}
	verdicts := make([]verdict, len(mutants))
	parallel.For(len(mutants), func(k int) {
		m := mutants[k]
		v := &verdicts[k]
		for i, c := range configs {
			cfg := c.cfg
			cfg.Bugs, cfg.Mutation = m.bugs, m.mu
			v.runs++
			r, err := explore.Check(cfg, explore.Options{Workers: 1, MaxMemory: maxMem, MaxStates: f.maxStates})
			if err != nil {
				v.err, v.cfg = fmt.Errorf("mutant %s, configuration %d: %w", m.name, i+1, err), cfg
				return
			}
			if !r.OK {
				v.by = fmt.Sprintf("%d: %s in %d steps", i+1, r.Property, len(r.Trace))
				return
			}
		}
	})
	caught, equivalent := 0, 0
	for k, m := range mutants {
		v := verdicts[k]
		runs += v.runs
		if v.err != nil {
			return f.explorationFailed(v.err, v.cfg, stdout, stderr)
		}
		by := v.by
		why, listed := spec.Equivalent[m.name]
		switch {
		case by != "" && listed:
			failed = true
			fmt.Fprintf(stdout, "%-34s %s, yet listed as equivalent: FAIL\n", m.name, by)
		case by != "":
			caught++
			fmt.Fprintf(stdout, "%-34s %s\n", m.name, by)
		case listed:
			equivalent++
			fmt.Fprintf(stdout, "%-34s equivalent: %s\n", m.name, why)
		default:
			failed = true
			fmt.Fprintf(stdout, "%-34s NOTHING: FAIL (catch it in a configuration, or list it in spec.Equivalent with the argument why nothing can)\n", m.name)
		}
	}
	fmt.Fprintf(stdout, "%d mutants: %d caught, %d equivalent, %d not caught\n", len(mutants), caught, equivalent, len(mutants)-caught-equivalent)
	fmt.Fprintf(stdout, "%d explorations in %s\n", runs, time.Since(start).Round(time.Second))
	if failed {
		return 1
	}
	return 0
}
