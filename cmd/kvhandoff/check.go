package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvhandoff/kvhandoff/spec"
	"github.com/kvhandoff/kvhandoff/spec/checker"
	"github.com/kvhandoff/kvhandoff/spec/explore"
)

const checkUsage = `usage: kvhandoff check [flags]

Model-checks the executable spec of the handoff protocol (docs/spec.md). Exit
status 0 iff every property holds (with --matrix: iff the correct protocol passes
and every switch is exposed by some combination of at most --matrix-size switches);
1 on a violation; 2 on bad usage; 3 when the bounds are too large to exhaust
within --max-memory (or --max-states). With --json, stdout holds exactly one JSON object on every
exit: "result" is ok, violation, incomplete (exit 3) or error (exit 2).

flags:
`

type checkFlags struct {
	requests, pages, pageSize int
	faults, bugs              string
	maxFaults                 int
	simulate                  bool
	seed                      uint64
	walks, depth              int
	jsonOut, matrix, quiet    bool
	needAll                   bool
	traceFormat               string
	matrixSize, workers       int
	maxStates                 int
	maxMemory                 string
	prompts                   string
	prefillPages              int
	contextLimit              int
	damage                    string
	coverage                  bool
	phases                    bool
	prefills, decodes         int
	restarts                  int
	anySource                 bool
	decodeRestarts            bool
	staticPeers               bool
	maxQueue                  int
	bitstate                  bool
	bitstateSize              string
	hashes                    int
	swarmIndex, swarmCount    int
	mutants                   string
	mutation                  string
	prefixCache               int
	scopes, contents          string
	publicPrefix              string
}

func runCheck(args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "merge" {
		return runCheckMerge(args[1:], stdout, stderr)
	}
	var f checkFlags
	fs := newFlags("check", checkUsage, stderr)
	f.define(fs)
	fs.StringVar(&f.mutants, "mutants", "", "run the mutation gate (docs/spec.md) over the configurations in this file, one line of check flags each (# starts a comment): every mutation and every switch must be caught by one, or be listed as equivalent")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		if code != 0 && f.jsonOut {
			printJSON(stdout, stderr, jsonReport{Result: "error", Error: "bad usage (see stderr)", Bugs: []string{}, Trace: []jsonStep{}})
		}
		return code
	}
	if f.matrix {
		set := false
		fs.Visit(func(fl *flag.Flag) { set = set || fl.Name == "max-faults" })
		if !set {
			f.maxFaults = 2 // the matrix runs dozens of explorations
		}
	}
	if f.traceFormat != "text" && f.traceFormat != "mermaid" {
		return f.usageError(fmt.Errorf("--trace-format must be text or mermaid, not %q", f.traceFormat), stdout, stderr)
	}
	cfg, err := f.config()
	if err != nil {
		return f.usageError(err, stdout, stderr)
	}
	if !f.quiet && !f.jsonOut {
		fmt.Fprintf(stderr, "kvhandoff check: %s\n", describeConfig(cfg))
	}
	switch {
	case f.mutants != "":
		return f.runMutants(stdout, stderr)
	case f.matrix:
		return f.runMatrix(cfg, stdout, stderr)
	case f.simulate:
		r, err := explore.Simulate(cfg, explore.SimOptions{Seed: f.seed, Walks: f.walks, Depth: f.depth})
		if err != nil {
			return f.usageError(err, stdout, stderr)
		}
		return f.printReport(r, stdout, stderr)
	}
	opt := explore.Options{Workers: f.workers}
	if !f.quiet {
		opt.Progress = func(s checker.Stats) {
			fmt.Fprintf(stderr, "  %d states, %.0f states/s, depth %d, %s, heap %d MB\n", s.States, s.StatesPerSecond(), s.Depth, s.Elapsed.Round(time.Second), s.PeakHeap>>20)
		}
	}
	opt.MaxStates = f.maxStates
	if opt.MaxMemory, err = maxMemory(f.maxMemory); err != nil {
		return f.usageError(err, stdout, stderr)
	}
	if f.coverage {
		if f.needAll {
			return f.usageError(errors.New("--coverage does not combine with --need-all"), stdout, stderr)
		}
		opt.Coverage = new(spec.Coverage)
	}
	if err := f.bitstateOptions(&opt); err != nil {
		return f.usageError(err, stdout, stderr)
	}
	var r *explore.Report
	if f.needAll {
		r, err = explore.CheckNeeding(cfg, opt)
	} else {
		r, err = explore.Check(cfg, opt)
	}
	if err != nil {
		return f.explorationFailed(err, cfg, stdout, stderr)
	}
	return f.printReport(r, stdout, stderr)
}

// define declares the flags of one check: its configuration and how it runs.
// The mutation gate parses each of its configurations with them.
func (f *checkFlags) define(fs *flag.FlagSet) {
	fs.IntVar(&f.requests, "requests", 3, "requests: all but the last fit, the last is over-long (1..4)")
	fs.IntVar(&f.pages, "pages", 4, "decode pool pages; the prefill pool gets half (1..8)")
	fs.IntVar(&f.pageSize, "page-size", 2, "tokens per page")
	fs.StringVar(&f.prompts, "prompts", "", "prompt lengths in tokens, comma-separated (overrides --requests), e.g. 4,4,9")
	fs.IntVar(&f.prefillPages, "prefill-pages", 0, "prefill pool pages (0: half of --pages); its intake rejects longer prompts")
	fs.StringVar(&f.faults, "faults", "all", `fault budgets: "all" (every one but lease, restart, partition and dataplane-cut), "none" or name[=N],... of all, cancel, crash, timeout, cut, late, corrupt, rogue, lease, restart, partition, dataplane-cut`)
	fs.IntVar(&f.prefills, "prefills", 1, fmt.Sprintf("prefill nodes, each with the prefill pool (1..%d)", spec.MaxPrefills))
	fs.IntVar(&f.decodes, "decodes", 1, fmt.Sprintf("decode nodes, each with the decode pool and slots (1..%d); a queue pair per (prefill, decode) pair", spec.MaxDecodes))
	fs.IntVar(&f.restarts, "restarts", -1, "restarts of a crashed prefill node under a new incarnation (0..3; the same as restart=N in --faults, which it overrides; needs a crash budget)")
	fs.BoolVar(&f.staticPeers, "static-peers", false, "a registry that never loses a node (node.Static, the in-process registry): the router loses a decode node when its control API stops answering, and no prefill node is told; RC's retry limit breaks a queue pair to a partitioned node")
	fs.BoolVar(&f.decodeRestarts, "decode-restarts", false, "the restart fault may also crash a decode node and bring it back at once under a new incarnation (a fresh pool, epochs from zero); needs a restart budget, shared with prefill restarts")
	fs.BoolVar(&f.anySource, "any-source-pages", false, "a prefill node's intake may take any free source pages, in any order, not only the lowest: every choice explored (the refinement mapping's setting; more states; at most 4096 orders an intake)")
	fs.IntVar(&f.maxQueue, "max-queue", 0, fmt.Sprintf("the bound of every channel, in messages (0: %d; at most %d); a message sent on a full one breaks WithinBounds", spec.MaxQueue, spec.QueueCapacity))
	fs.IntVar(&f.maxFaults, "max-faults", 0, "faults in one execution, all kinds together (0: only the budgets bound them; with --matrix the default is 2)")
	fs.StringVar(&f.bugs, "bug", "", "switches of the bug catalogue to turn on, comma-separated")
	fs.StringVar(&f.mutation, "mutation", "", "one mutation of the spec's rules to turn on (the mutation gate's: docs/spec.md), e.g. key-outlives-record")
	fs.BoolVar(&f.needAll, "need-all", false, "report only counterexamples that need every --bug switch (the matrix's rule): replayed with any one of them off, they no longer fail")
	fs.BoolVar(&f.simulate, "simulate", false, "random walks instead of exhaustive exploration")
	fs.Uint64Var(&f.seed, "seed", 1, "simulation seed: the same seed replays the same walks; with --bitstate, the hash's seed")
	fs.BoolVar(&f.bitstate, "bitstate", false, "bitstate mode (SPIN's supertrace) for bounds too large to store: the visited set is a bit array of half of --max-memory, each state 3 bits; states whose bits collide are missed, and the coverage estimate says how many; no liveness check (docs/spec.md)")
	fs.StringVar(&f.bitstateSize, "bitstate-size", "", "bitstate: the bit array's size, e.g. 1GiB (default: half of --max-memory)")
	fs.IntVar(&f.hashes, "hashes", 3, "bitstate: bits set per state (1..8)")
	fs.IntVar(&f.swarmIndex, "swarm-index", 0, "bitstate swarm: this member's index, 0..--swarm-count-1 (its hash seed is --seed plus the index, and its search order its own); combine the members' --json reports with kvhandoff check merge FILE...")
	fs.IntVar(&f.swarmCount, "swarm-count", 0, "bitstate swarm: the number of members (0: no swarm)")
	fs.IntVar(&f.walks, "walks", 10000, "simulation: number of walks")
	fs.IntVar(&f.depth, "depth", 60, "simulation: steps per walk before it drains")
	fs.BoolVar(&f.jsonOut, "json", false, "print exactly one JSON object on stdout")
	fs.StringVar(&f.traceFormat, "trace-format", "text", "counterexample format: text or mermaid")
	fs.BoolVar(&f.matrix, "matrix", false, "compute the defense matrix")
	fs.IntVar(&f.matrixSize, "matrix-size", 3, "matrix: largest combination of switches tried")
	fs.IntVar(&f.maxStates, "max-states", 0, "give up (exit 3) past this many distinct states (0: no limit but --max-memory)")
	fs.StringVar(&f.maxMemory, "max-memory", "", "give up (exit 3) when the live heap exceeds this, e.g. 16GiB, 500MB (default: 3/4 of the machine's memory); a visited state costs about 65-80 bytes at the peak on large runs (the runtime's ~10 MiB on top), docs/spec.md")
	fs.IntVar(&f.workers, "workers", 0, "exploration goroutines (0: one per core)")
	fs.BoolVar(&f.quiet, "quiet", false, "no progress on stderr")
	fs.IntVar(&f.contextLimit, "context-limit", 0, "the router's limit in tokens, the advertised context (0: the decode pool's capacity)")
	fs.StringVar(&f.damage, "damage", "payload", `what the corrupt fault may damage: payload (always), tag (a tag record's request, index or epoch), send (a Done's or Grant's token or page count), comma-separated`)
	fs.IntVar(&f.prefixCache, "prefix-cache", 0, fmt.Sprintf("pages each decode node's prefix cache may hold (0..%d; 0: no cache). A prefix switch named with no cache runs under the bounds that expose it (docs/spec.md#prefix-reuse)", spec.MaxPrefixCache))
	fs.StringVar(&f.publicPrefix, "public-prefix", "", "with --prefix-cache: a declared public prefix every tenant may share, as its full pages' letters (a request of a tenant scope whose --contents start with it gets the public scope; its chain past it is salted with its tenant)")
	fs.StringVar(&f.scopes, "scopes", "", fmt.Sprintf("with --prefix-cache: each request's tenant scope, comma-separated (0: no reuse; 1..%d); default 0 for all", spec.MaxScopes))
	fs.StringVar(&f.contents, "contents", "", `with --prefix-cache: each request's full pages named by letters, comma-separated (e.g. aa,aa,ab: requests share a prefix as far as their letters agree); default "a" for every page`)
	fs.BoolVar(&f.phases, "phases", false, "print where an exploration's wall time went (not a simulation's): each parallel phase's wall time and its workers' busy time, the serial parts, the cores left idle (\"phases\" in --json, without the flag)")
	fs.BoolVar(&f.coverage, "coverage", false, "count how often each action and each guarded branch of the spec fired; printed after the result (\"coverage\" in --json)")
}

// usageError reports bad usage: exit 2, and with --json an error object.
func (f *checkFlags) usageError(err error, stdout, stderr io.Writer) int {
	fmt.Fprintf(stderr, "kvhandoff check: %v\n", err)
	if f.jsonOut {
		printJSON(stdout, stderr, jsonReport{Result: "error", Error: err.Error(), Bugs: []string{}, Trace: []jsonStep{}})
	}
	return 2
}

// explorationFailed reports an exploration that could not finish: exit 3 at a
// limit (with how far it got), 2 otherwise; with --json as one object.
func (f *checkFlags) explorationFailed(err error, cfg spec.Config, stdout, stderr io.Writer) int {
	fmt.Fprintf(stderr, "kvhandoff check: %v\n", err)
	code, result := 2, "error"
	switch {
	case errors.Is(err, checker.ErrTooManyStates):
		fmt.Fprintln(stderr, "  the bounds are too large to exhaust: lower --max-faults (e.g. 2) or --requests, raise --max-states if memory allows, or use --simulate")
		code, result = 3, "incomplete"
	case errors.Is(err, checker.ErrMemoryLimit):
		fmt.Fprintln(stderr, "  the bounds are too large to exhaust in memory: lower --max-faults (e.g. 2) or --requests, raise --max-memory if the machine has it, or use --simulate")
		code, result = 3, "incomplete"
	}
	var limit *checker.LimitError
	isLimit := errors.As(err, &limit)
	if f.jsonOut {
		out := jsonReport{Result: result, Error: err.Error(), Bugs: cfg.Bugs.Names(), Trace: []jsonStep{}}
		if isLimit {
			out.setStats(limit.Stats)
			f.setBitstate(&out, limit.Stats)
		}
		printJSON(stdout, stderr, out)
	} else if isLimit {
		f.printPhases(stdout, limit.Stats) // how the time went up to the limit
	}
	return code
}

func (f *checkFlags) config() (spec.Config, error) {
	if f.requests < 1 || f.requests > spec.MaxRequests {
		return spec.Config{}, fmt.Errorf("--requests must be 1..%d", spec.MaxRequests)
	}
	if f.maxFaults < 0 {
		return spec.Config{}, fmt.Errorf("--max-faults must be 0 or more")
	}
	cfg := spec.NewConfig(f.requests, f.pages, f.pageSize)
	if f.prefillPages > 0 {
		cfg.PrefillPages = f.prefillPages
	}
	if f.contextLimit > 0 {
		cfg.ContextLimit = f.contextLimit
	}
	if f.prompts != "" {
		cfg.Prompts = nil
		for _, p := range strings.Split(f.prompts, ",") {
			t, err := strconv.Atoi(strings.TrimSpace(p))
			if err != nil {
				return cfg, fmt.Errorf("--prompts: %q is not a token count", p)
			}
			cfg.Prompts = append(cfg.Prompts, t)
		}
		cfg.DecodeSlots = min(spec.MaxSlots, max(1, len(cfg.Prompts)-1))
	}
	var err error
	if cfg.Faults, err = spec.ParseFaults(f.faults); err != nil {
		return cfg, err
	}
	switch {
	case f.restarts > 3:
		return cfg, fmt.Errorf("--restarts must be 0..3, got %d", f.restarts)
	case f.restarts >= 0:
		cfg.Faults[spec.FaultRestart] = uint8(f.restarts)
	}
	if cfg.Bugs, err = spec.ParseSwitches(f.bugs); err != nil {
		return cfg, err
	}
	if cfg.Mutation, err = spec.ParseMutation(f.mutation); err != nil {
		return cfg, err
	}
	if cfg.Damage, err = spec.ParseDamage(f.damage); err != nil {
		return cfg, err
	}
	cfg.MaxFaults = f.maxFaults
	cfg.AnySourcePages = f.anySource
	cfg.DecodeRestarts = f.decodeRestarts
	cfg.StaticPeers = f.staticPeers
	cfg.MaxQueue = f.maxQueue
	cfg.Prefills, cfg.Decodes = f.prefills, f.decodes
	if f.prefills < 1 || f.decodes < 1 {
		return cfg, fmt.Errorf("--prefills and --decodes must be at least 1")
	}
	cfg.PrefixCache = f.prefixCache
	cfg.PublicPrefix = f.publicPrefix
	if f.scopes != "" {
		for _, v := range strings.Split(f.scopes, ",") {
			sc, err := strconv.Atoi(strings.TrimSpace(v))
			if err != nil {
				return cfg, fmt.Errorf("--scopes: %q is not a scope", v)
			}
			cfg.Scopes = append(cfg.Scopes, sc)
		}
	}
	if f.contents != "" {
		for _, v := range strings.Split(f.contents, ",") {
			cfg.Contents = append(cfg.Contents, strings.TrimSpace(v))
		}
	}
	if cfg.PrefixCache == 0 && f.scopes == "" && f.contents == "" && cfg.Bugs.Prefix() {
		// A prefix switch acts only on the cache: named without one, it
		// runs under the bounds that expose it (the matrix's too).
		cfg = cfg.Bugs.Bounds(cfg)
	}
	if f.prompts == "" && cfg.Bugs.Has(spec.WriteUncomputed) {
		// It acts only on a request of two pages: named without --prompts,
		// it runs under the bounds that expose it (the matrix's too).
		cfg = spec.StreamBounds(cfg)
	}
	return cfg, cfg.Validate()
}

func describeConfig(c spec.Config) string {
	prompts := make([]string, len(c.Prompts))
	for i, t := range c.Prompts {
		prompts[i] = fmt.Sprint(t)
	}
	limit := "budgets only"
	if c.MaxFaults > 0 {
		limit = fmt.Sprintf("at most %d per execution", c.MaxFaults)
	}
	topology := ""
	if c.MaxQueue != 0 {
		limit += fmt.Sprintf(", queues of %d", c.QueueBound())
	}
	if c.NumPrefills()*c.NumDecodes() > 1 {
		topology = fmt.Sprintf("%d prefill x %d decode nodes, ", c.NumPrefills(), c.NumDecodes())
	}
	if c.StaticPeers {
		topology += "static peers (the registry loses no node), "
	}
	cache := ""
	if c.PrefixCache > 0 {
		cache = fmt.Sprintf(", prefix cache %d pages (scopes %s, contents %s)", c.PrefixCache, strings.Trim(strings.Join(strings.Fields(fmt.Sprint(c.Scopes)), ","), "[]"), strings.Join(c.Contents, ","))
		if c.PublicPrefix != "" {
			cache = strings.TrimSuffix(cache, ")") + ", public prefix " + c.PublicPrefix + ")"
		}
	}
	return topology + fmt.Sprintf("%d requests (prompts %s tokens), page size %d, decode pool %d pages, prefill pool %d pages (%d tokens), context limit %d, %d decode slots%s; faults %s, %s; bugs: %s",
		len(c.Prompts), strings.Join(prompts, ","), c.PageSize, c.DecodePages, c.PrefillPages, c.PrefillLimit(), c.ContextLimit, c.DecodeSlots, cache, c.Faults, limit, c.Bugs)
}

type jsonStep struct {
	Step   int    `json:"step"`
	Action string `json:"action"`
	Detail string `json:"detail"`
}

type jsonReport struct {
	Result      string   `json:"result"` // ok, violation, incomplete (exit 3), error (exit 2)
	Error       string   `json:"error,omitempty"`
	Property    string   `json:"property"`
	Bugs        []string `json:"bugs"`
	States      int      `json:"states"`
	Transitions int      `json:"transitions"`
	Depth       int      `json:"depth"`
	Seconds     float64  `json:"seconds"`
	// Acyclic: whether the protocol transitions have no cycle (liveness then
	// needs no fairness); null when not computed (a simulation, a violation
	// that stopped the exploration, or an incomplete one).
	Acyclic *bool `json:"acyclic"`
	// HeapBytes is the largest Go heap sampled during the exploration.
	HeapBytes uint64     `json:"heap_bytes"`
	Trace     []jsonStep `json:"trace"`
	// Coverage: with --coverage, every action kind and branch of the spec and
	// how often it fired.
	Coverage []explore.CoverageRow `json:"coverage,omitempty"`
	// Bitstate: with --bitstate, the bit array and the coverage estimate.
	Bitstate *jsonBitstate `json:"bitstate,omitempty"`
	// Phases: an exploration's wall time by phase (docs/spec.md), up to its
	// limit for an incomplete one; absent for a simulation, and for a run
	// stopped before its first wave.
	Phases *jsonPhases `json:"phases,omitempty"`
	// Swarm: with --swarm-count, which member this is.
	Swarm *jsonSwarm `json:"swarm,omitempty"`
	// Bounds: with --bitstate, the configuration, so that merge can refuse
	// reports of different bounds.
	Bounds string `json:"bounds,omitempty"`
}

func (out *jsonReport) setStats(s checker.Stats) {
	out.States, out.Transitions, out.Depth, out.Seconds = s.States, s.Transitions, s.Depth, s.Elapsed.Seconds()
	out.HeapBytes = s.PeakHeap
	if s.Acyclic.Known() {
		yes := s.Acyclic == checker.Yes
		out.Acyclic = &yes
	}
	if hasPhases(s) {
		out.Phases = newJSONPhases(s)
	}
}

// printJSON writes v as the one JSON object on stdout.
func printJSON(stdout, stderr io.Writer, v any) bool {
	enc := json.NewEncoder(stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		fmt.Fprintf(stderr, "kvhandoff check: %v\n", err)
		return false
	}
	return true
}

func (f *checkFlags) printReport(r *explore.Report, stdout, stderr io.Writer) int {
	code := 0
	if !r.OK {
		code = 1
	}
	if f.jsonOut {
		out := jsonReport{Result: "ok", Property: r.Property, Bugs: r.Bugs.Names(), Trace: []jsonStep{}}
		out.setStats(r.Stats)
		if !r.OK {
			out.Result = "violation"
		}
		for _, st := range r.Trace {
			out.Trace = append(out.Trace, jsonStep{st.Step, st.Action, st.Detail})
		}
		if r.Coverage != nil {
			out.Coverage = explore.CoverageRows(r.Coverage)
		}
		f.setBitstate(&out, r.Stats)
		if !printJSON(stdout, stderr, out) {
			return 2
		}
		return code
	}
	what := fmt.Sprintf("%d states, %d transitions, depth %d, %.2fs (%.0f states/s)",
		r.Stats.States, r.Stats.Transitions, r.Stats.Depth, r.Stats.Elapsed.Seconds(), r.Stats.StatesPerSecond())
	if sim := r.Simulation; sim != nil {
		what = fmt.Sprintf("%d walks from seed %d, %d steps, longest %d, %.2fs", sim.Walks, sim.Seed, sim.Steps, r.Stats.Depth, r.Stats.Elapsed.Seconds())
	}
	if r.Stats.Bitstate.Bits > 0 {
		what += "; " + bitstateSummary(r.Stats)
	}
	if r.OK && r.Stats.Bitstate.Bits > 0 {
		fmt.Fprintf(stdout, "ok: no safety violation and no deadlock among the states explored (%s)\n", what)
		return f.printAfter(r, stdout, 0)
	}
	if r.OK {
		fmt.Fprintf(stdout, "ok: every property holds within the bounds (%s%s)\n", what, acyclicity(r))
		return f.printAfter(r, stdout, 0)
	}
	doc := ""
	for _, inv := range spec.Invariants {
		if inv.Name == r.Property {
			doc = inv.Doc
		}
	}
	for _, g := range spec.Goals {
		if g.Name == r.Property {
			doc = g.Doc
		}
	}
	// In Mermaid format everything but the diagram is a Mermaid comment, so the
	// whole output can be fed to a renderer.
	prefix := ""
	if f.traceFormat == "mermaid" {
		prefix = "%% "
	}
	fmt.Fprintf(stdout, "%sVIOLATION of %s (%s) with bugs: %s\n%s  %s: %s\n", prefix, r.Property, r.Kind, r.Bugs, prefix, r.Property, doc)
	switch r.Kind {
	case checker.Liveness:
		fmt.Fprintf(stdout, "%s  after the last step below, no sequence of protocol steps (without further faults) reaches the goal\n", prefix)
	case checker.Deadlock:
		fmt.Fprintf(stdout, "%s  after the last step below, nothing can happen and some request has not ended\n", prefix)
	}
	kind := "shortest counterexample"
	if r.Simulation != nil {
		kind = fmt.Sprintf("counterexample from walk %d of seed %d (not shortest)", r.Simulation.Walk, r.Simulation.Seed)
	}
	fmt.Fprintf(stdout, "%s%s, %d steps:\n", prefix, kind, len(r.Trace))
	if f.traceFormat == "mermaid" {
		explore.WriteMermaid(stdout, fmt.Sprintf("%s violated with %s", r.Property, r.Bugs), r.Trace)
	} else {
		explore.WriteText(stdout, r.Trace)
	}
	fmt.Fprintf(stdout, "%sviolation of %s in %d steps (%s%s)\n", prefix, r.Property, len(r.Trace), what, acyclicity(r))
	return f.printAfter(r, stdout, code)
}

// printAfter prints, after the result, the phases table (--phases) and the
// coverage table (--coverage), naming the defenses that never fired.
func (f *checkFlags) printAfter(r *explore.Report, stdout io.Writer, code int) int {
	f.printPhases(stdout, r.Stats)
	if r.Coverage == nil {
		return code
	}
	rows := explore.CoverageRows(r.Coverage)
	fmt.Fprintln(stdout)
	explore.WriteCoverage(stdout, rows)
	if unfired := explore.Unfired(rows); len(unfired) > 0 {
		fmt.Fprintf(stdout, "defenses that never fired at these bounds: %s\n", strings.Join(unfired, ", "))
	}
	return code
}

func (f *checkFlags) runMatrix(cfg spec.Config, stdout, stderr io.Writer) int {
	start := time.Now()
	var progress func(spec.Switches, *explore.Report)
	if !f.quiet {
		progress = func(set spec.Switches, r *explore.Report) {
			verdict := "holds"
			if !r.OK {
				verdict = "violates " + r.Property
			}
			fmt.Fprintf(stderr, "  %-60s %s (%d states, %.1fs)\n", set, verdict, r.Stats.States, r.Stats.Elapsed.Seconds())
		}
	}
	limit, err := maxMemory(f.maxMemory)
	if err != nil {
		return f.usageError(err, stdout, stderr)
	}
	x, err := explore.DefenseMatrix(cfg, f.matrixSize, explore.Options{MaxStates: f.maxStates, MaxMemory: limit}, progress)
	if err != nil {
		return f.explorationFailed(err, cfg, stdout, stderr)
	}
	code := 0
	if !x.OK() {
		code = 1
	}
	if f.jsonOut {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(struct {
			Matrix []explore.MatrixRow `json:"matrix"`
		}{x.Rows}); err != nil {
			fmt.Fprintf(stderr, "kvhandoff check: %v\n", err)
			return 2
		}
		return code
	}
	base := "passes"
	if !x.Base.OK {
		base = "FAILS " + x.Base.Property
	}
	fmt.Fprintf(stdout, "defense matrix: correct protocol %s (%d states); combinations of up to %d switches\n\n", base, x.Base.Stats.States, x.MaxSize)
	tw := tabwriter.NewWriter(stdout, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "switch\texposed by\tviolates")
	for _, row := range x.Rows {
		var combos []string
		for _, c := range row.ExposedBy {
			combos = append(combos, strings.Join(c, " + "))
		}
		exposed := strings.Join(combos, " | ")
		if exposed == "" {
			exposed = fmt.Sprintf("NOT EXPOSED by any combination of up to %d", x.MaxSize)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", row.Bug, exposed, strings.Join(row.Violated, ", "))
	}
	tw.Flush()
	fmt.Fprintf(stdout, "\n%d explorations in %.1fs\n", x.Runs, time.Since(start).Seconds())
	return code
}

// acyclicity is the summary's note on the protocol transition graph.
func acyclicity(r *explore.Report) string {
	if r.Simulation != nil {
		return ""
	}
	switch r.Stats.Acyclic {
	case checker.Yes:
		return "; protocol transitions acyclic, so liveness needs no fairness"
	case checker.No:
		return "; protocol transitions have cycles, so liveness assumes strong fairness of protocol transitions once faults stop"
	}
	return "; acyclicity not computed"
}

// maxMemory parses --max-memory: bytes, or a number with K, M, G, T (powers of
// 1024, also KiB...) or KB, MB, GB, TB (powers of 1000). Empty means 3/4 of the
// machine's memory, or of the cgroup's limit when lower.
func maxMemory(v string) (uint64, error) {
	v = strings.TrimSpace(v)
	if v == "" {
		total := totalMemory()
		if total == 0 {
			return 0, nil
		}
		return total / 4 * 3, nil
	}
	units := []struct {
		suffix string
		scale  uint64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40},
		{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
		{"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}, {"T", 1 << 40}, {"B", 1}}
	scale := uint64(1)
	for _, u := range units {
		if strings.HasSuffix(v, u.suffix) {
			v, scale = strings.TrimSpace(strings.TrimSuffix(v, u.suffix)), u.scale
			break
		}
	}
	n, err := strconv.ParseFloat(v, 64)
	if err != nil || n <= 0 || n*float64(scale) > 1<<62 {
		return 0, fmt.Errorf("--max-memory: %q is not a size (e.g. 16GiB, 500MB)", v)
	}
	return uint64(n * float64(scale)), nil
}

// totalMemory is the machine's memory (MemTotal in /proc/meminfo), or the
// cgroup v2 limit when that is lower; 0 when neither can be read.
func totalMemory() uint64 {
	var total uint64
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "MemTotal:" {
				if kb, err := strconv.ParseUint(f[1], 10, 64); err == nil {
					total = kb << 10
				}
			}
		}
	}
	if b, err := os.ReadFile("/sys/fs/cgroup/memory.max"); err == nil {
		if limit, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64); err == nil && (total == 0 || limit < total) {
			total = limit
		}
	}
	return total
}
