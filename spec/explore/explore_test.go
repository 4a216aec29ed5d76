package explore

import (
	"bytes"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/spec"
	"github.com/kvhandoff/kvhandoff/spec/checker"
)

func bugs(t *testing.T, list string) spec.Switches {
	t.Helper()
	s, err := spec.ParseSwitches(list)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestCorrectProtocolPassesAtDefaultBounds(t *testing.T) {
	r, err := Check(spec.DefaultConfig(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !r.OK {
		var b bytes.Buffer
		WriteText(&b, r.Trace)
		t.Fatalf("the correct protocol violates %s:\n%s", r.Property, b.String())
	}
	if r.Stats.States < 10000 || r.Stats.Acyclic != checker.Yes {
		t.Fatalf("default bounds: %d states, acyclic=%v; want >= 10000 and an acyclic protocol graph", r.Stats.States, r.Stats.Acyclic)
	}
}

// Each switch, alone or with the partners the defense matrix gives, is exposed
// through a counterexample that needs all of them, violating a property the
// catalogue's "seen as" column predicts.
func TestEverySwitchIsExposed(t *testing.T) {
	cases := []struct {
		bugs string
		want []string
	}{
		{"admit-finished,no-token-check,no-tag-check", []string{spec.Isolation}}, // the incident
		{"abort-still-sends,no-tag-check", []string{spec.Isolation, spec.HonestOutcome}},
		{"eager-release", []string{spec.NoForeignWrite}},
		{"timeout-free", []string{spec.NoForeignWrite}},
		{"prefill-early-free,no-checksum", []string{spec.Isolation, spec.HonestOutcome}},
		{"done-unmatched,no-tag-check", []string{spec.Isolation, spec.HonestOutcome}},
		{"no-checksum", []string{spec.Isolation, spec.HonestOutcome}},
		{"leak-on-cancel", []string{spec.NoLeak}},
		{"no-peer-cancel", []string{spec.Termination}},
		{"double-free", []string{spec.Conservation}},
		{"abort-frees-source,no-checksum", []string{spec.Isolation, spec.HonestOutcome}}, // vLLM #21570
		{"checksum-hangs", []string{spec.Termination}},                                   // SGLang #39729
		{"peer-by-name", []string{spec.NoOldIncarnation}},                                // vLLM/Mooncake reconnects: a restarted peer known by name only
		{"pool-wide-key", []string{spec.ReadAsVerified, spec.NoForeignWrite}},            // issue 17: one key for the pool
		{"verify-before-revoke", []string{spec.ReadAsVerified}},                          // issue 17: the time-of-check/time-of-use window
		{"unticketed-bootstrap", []string{spec.Ticketed}},                                // issue 17: anyone signed is a prefill node
		{"scope-dropped", []string{spec.NoCrossScopeRead}},                               // SGLang #37160: the cache key without the scope
		{"client-scope", []string{spec.NoCrossScopeRead}},                                // issue 18: the scope from the request body
		{"evict-pinned", []string{spec.PinnedNeverReallocated}},                          // issue 18: eviction ignores pins
		{"prefix-count-mismatch", []string{spec.PrefixExact}},                            // issue 18: hit and skip disagree by a page
		{"write-shared", []string{spec.PinnedNeverReallocated}},                          // issue 18: a shared page in the grant
		{"write-uncomputed", []string{spec.Isolation, spec.HonestOutcome}},               // issue 19: a WRITE of a page not yet computed ships its stale KV, which its checksum covers
		{"free-computing", []string{spec.Isolation, spec.HonestOutcome}},                 // issue 19: an ended leg's computation writes a source page another request took
	}
	covered := spec.Switches(0)
	for name, base := range map[string]spec.Config{"default": spec.DefaultConfig(), "multi-page": multiPage()} {
		for _, c := range cases {
			t.Run(name+"/"+c.bugs, func(t *testing.T) {
				cfg := base
				cfg.MaxFaults = 2
				cfg.Bugs = bugs(t, c.bugs)
				cfg = cfg.Bugs.Bounds(cfg)
				covered |= cfg.Bugs
				r, err := CheckNeeding(cfg, Options{})
				if err != nil {
					t.Fatal(err)
				}
				if r.OK || !slices.Contains(c.want, r.Property) {
					t.Fatalf("ok=%v property=%q, want a violation of one of %v", r.OK, r.Property, c.want)
				}
			})
		}
	}
	if len(covered.Names()) != len(spec.AllSwitches()) {
		t.Fatalf("switches not covered: have %v", covered)
	}
}

// multiPage has two-page requests, so transfers can be cut, aborted or
// verified with some pages written and others not.
func multiPage() spec.Config {
	cfg := spec.NewConfig(3, 6, 2)
	cfg.PrefillPages = 4
	cfg.Prompts = []int{4, 4, 9}
	return cfg
}

func TestCorrectProtocolPassesWithMultiPageRequests(t *testing.T) {
	cfg := multiPage()
	cfg.MaxFaults = 2
	r, err := Check(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !r.OK {
		t.Fatalf("violates %s", r.Property)
	}
}

func TestIncidentCounterexample(t *testing.T) {
	cfg := spec.DefaultConfig()
	cfg.Bugs = bugs(t, "admit-finished,no-token-check,no-tag-check")
	r, err := Check(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if r.OK || r.Property != spec.Isolation {
		t.Fatalf("want Isolation, got ok=%v %q", r.OK, r.Property)
	}
	var text bytes.Buffer
	WriteText(&text, r.Trace)
	out := text.String()
	for _, want := range []string{
		"prefill marks r2 rejected",    // rejected at intake ...
		"Bootstrap{r2, 5 tokens}",      // ... still handed off
		"pages [",                      // decode reserves pages for 5 tokens
		"Done{r2, 1 tokens, 1 pages",   // prefill wrote one page
		"decode read for r2: page",     // decode read them all
		"= tenant",                     // including another tenant's KV
		"decode r2: reserved -> ready", // verification let it through
		"client sees r2 ok",            // and the client got a success
	} {
		if !strings.Contains(out, want) {
			t.Errorf("trace lacks %q:\n%s", want, out)
		}
	}
	last := r.Trace[len(r.Trace)-1]
	if last.Kind.Kind != spec.DecodeRead {
		t.Fatalf("the violation is the read: last step is %v", last.Kind)
	}
}

// A partner that the counterexample does not need does not count: no-checksum
// fails alone (a corrupted WRITE), and no-token-check adds nothing to that.
func TestCheckNeedingDemandsEverySwitch(t *testing.T) {
	cfg := spec.DefaultConfig()
	cfg.MaxFaults = 1
	cfg.Bugs = bugs(t, "no-checksum,no-token-check")
	plain, err := Check(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if plain.OK {
		t.Fatal("with no-checksum on, a plain check must find the corruption")
	}
	needing, err := CheckNeeding(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !needing.OK {
		var b bytes.Buffer
		WriteText(&b, needing.Trace)
		t.Fatalf("no counterexample should need both switches, got %s:\n%s", needing.Property, b.String())
	}
}

func TestMatrixOfSingleSwitches(t *testing.T) {
	cfg := spec.DefaultConfig()
	cfg.MaxFaults = 1
	x, err := DefenseMatrix(cfg, 1, Options{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	alone := map[string]string{
		"admit-finished": spec.NoSpuriousFailure, "eager-release": spec.NoForeignWrite, "timeout-free": spec.NoForeignWrite, "no-checksum": spec.Isolation,
		"leak-on-cancel": spec.NoLeak, "no-peer-cancel": spec.Termination, "double-free": spec.Conservation,
		"checksum-hangs": spec.Termination,
		"pool-wide-key":  spec.ReadAsVerified, "verify-before-revoke": spec.ReadAsVerified, "unticketed-bootstrap": spec.Ticketed,
		"scope-dropped": spec.NoCrossScopeRead, "client-scope": spec.NoCrossScopeRead, "evict-pinned": spec.PinnedNeverReallocated,
		"prefix-count-mismatch": spec.PrefixExact, "write-shared": spec.PinnedNeverReallocated,
		"write-uncomputed": spec.Isolation, "free-computing": spec.Isolation,
	}
	if !x.Base.OK || len(x.Rows) != len(spec.AllSwitches()) || x.OK() {
		t.Fatalf("base ok=%v rows=%d ok=%v: want a passing base, a row per switch, and some switches unexposed alone", x.Base.OK, len(x.Rows), x.OK())
	}
	for _, row := range x.Rows {
		prop, exposed := alone[row.Bug]
		if exposed != (len(row.ExposedBy) == 1) {
			t.Errorf("%s: exposed_by %v", row.Bug, row.ExposedBy)
			continue
		}
		if exposed && (!slices.Equal(row.ExposedBy[0], []string{row.Bug}) || !slices.Contains(row.Violated, prop)) {
			t.Errorf("%s: exposed_by %v violated %v, want itself and %s", row.Bug, row.ExposedBy, row.Violated, prop)
		}
	}
}

func TestSimulationFindsBugsAndReplaysFromSeed(t *testing.T) {
	cfg := spec.DefaultConfig()
	cfg.Bugs = bugs(t, "eager-release")
	a, err := Simulate(cfg, SimOptions{Seed: 7, Walks: 20000, Depth: 40})
	if err != nil {
		t.Fatal(err)
	}
	if a.OK {
		t.Fatal("20000 walks should find eager-release")
	}
	b, _ := Simulate(cfg, SimOptions{Seed: 7, Walks: 20000, Depth: 40})
	if a.Simulation.Walk != b.Simulation.Walk || !slices.Equal(a.Trace, b.Trace) {
		t.Fatal("the same seed must give the same walk and trace")
	}
	cfg.Bugs = 0
	ok, err := Simulate(cfg, SimOptions{Seed: 7, Walks: 500, Depth: 40})
	if err != nil || !ok.OK {
		t.Fatalf("the correct protocol: %+v %v", ok, err)
	}
}

func TestMermaidTrace(t *testing.T) {
	cfg := spec.DefaultConfig()
	cfg.Bugs = bugs(t, "admit-finished,no-token-check,no-tag-check")
	r, err := Check(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	WriteMermaid(&b, "incident", r.Trace)
	out := b.String()
	if !strings.HasPrefix(out, "sequenceDiagram\n") || !strings.Contains(out, "Prefill->>Decode") {
		t.Fatalf("not a sequence diagram:\n%s", out)
	}
	for _, st := range r.Trace {
		if !strings.Contains(out, ": "+strconv.Itoa(st.Step)+". ") {
			t.Errorf("step %d missing", st.Step)
		}
	}
	if strings.Contains(out, ";") {
		t.Error("a semicolon would end a Mermaid statement early")
	}
}

// verification has two-page requests, one slot, and a corrupt fault that may
// damage a payload, a tag record field, or a Done's or Grant's counts: every
// verification check can refuse.
func verification() spec.Config {
	cfg := spec.NewConfig(2, 4, 2)
	cfg.Prompts, cfg.PrefillPages, cfg.DecodeSlots = []int{4, 4}, 4, 1
	cfg.Faults = spec.Budget{spec.FaultCorrupt: 1}
	cfg.Damage = spec.DamageTag | spec.DamageSend
	return cfg
}

func coverageOf(t *testing.T, cfg spec.Config) (*Report, map[string]uint64) {
	t.Helper()
	cov := new(spec.Coverage)
	r, err := Check(cfg, Options{Coverage: cov})
	if err != nil {
		t.Fatal(err)
	}
	counts := map[string]uint64{}
	for _, row := range CoverageRows(cov) {
		counts[row.Kind+" "+row.Name] = row.Count
	}
	return r, counts
}

// Every step the checker takes is counted once: in a run that passes (no
// trace rebuilt), the actions add up to the transitions explored.
func TestCoverageCountsEveryTransitionOnce(t *testing.T) {
	r, counts := coverageOf(t, verification())
	if !r.OK {
		t.Fatalf("violates %s", r.Property)
	}
	var sum uint64
	for k, n := range counts {
		if strings.HasPrefix(k, "action ") {
			sum += n
		}
	}
	if sum != uint64(r.Stats.Transitions) {
		t.Fatalf("actions add up to %d, the checker explored %d transitions", sum, r.Stats.Transitions)
	}
	for _, d := range []string{"verify-tokens", "verify-pages", "verify-tag-request", "verify-tag-index", "verify-tag-epoch",
		"verify-checksum-first", "verify-checksum-later", "admit-grant-mismatch", "decode-no-slot"} {
		if counts["defense "+d] == 0 {
			t.Errorf("%s never fired", d)
		}
	}
}

// A defense switched off shows as a check that never fires: the coverage gate
// in CI would name it.
func TestCoverageShowsADefenseSwitchedOff(t *testing.T) {
	for sw, branches := range map[string][]string{
		"no-checksum":    {"verify-checksum-first", "verify-checksum-later"},
		"no-tag-check":   {"verify-tag-request", "verify-tag-index", "verify-tag-epoch"},
		"no-token-check": {"verify-tokens", "verify-pages"},
	} {
		cfg := verification()
		cfg.Bugs = bugs(t, sw)
		_, counts := coverageOf(t, cfg)
		for _, b := range branches {
			if counts["defense "+b] != 0 {
				t.Errorf("%s: %s fired %d times", sw, b, counts["defense "+b])
			}
		}
	}
}
