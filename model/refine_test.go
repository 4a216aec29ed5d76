package model

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/spec"
	"pgregory.net/rapid"
)

// refinementRun drives a Refinement with choices from pick: which enabled
// action, and each WRITE's fault variant. After every step the mapping has
// been compared; it then checks the spec's invariants on the (equal) spec
// state; when nothing but faults is left, it checks Termination and NoLeak.
// It returns the first failure.
type refinementRun struct {
	h     *Refinement
	steps int
	// out says the run left the spec's bounds (ErrOutOfBounds): it ends there.
	out bool
}

func newRefinementRun(cfg spec.Config, bugs research.Switches, variant func(r int) uint16) (*refinementRun, error) {
	h, err := NewRefinementWith(cfg, bugs)
	if err != nil {
		return nil, err
	}
	h.Faults = variant
	return &refinementRun{h: h}, nil
}

func (x *refinementRun) fail(err error) error {
	return fmt.Errorf("%w\nsteps: %s", err, strings.Join(x.h.Trace, ", "))
}

// take applies one action, then checks every invariant.
func (x *refinementRun) take(a spec.Action) error {
	if x.out {
		return nil
	}
	x.steps++
	if err := x.h.Step(a); errors.Is(err, ErrOutOfBounds) {
		x.out = true
		return nil
	} else if err != nil {
		return x.fail(err)
	}
	for _, inv := range spec.Invariants {
		if !inv.Holds(x.h.Model(), x.h.State()) {
			return x.fail(fmt.Errorf("%s violated after %v", inv.Name, a))
		}
	}
	return nil
}

// drain takes protocol actions (the first enabled each time) until none is
// left, then checks the goals.
func (x *refinementRun) drain() error {
	for i := 0; i < 1000 && !x.out; i++ {
		var next *spec.Action
		for _, a := range x.h.Enabled() {
			if !a.IsFault() {
				next = &a
				break
			}
		}
		if next == nil {
			break
		}
		if err := x.take(*next); err != nil {
			return err
		}
	}
	if x.out {
		outOfBounds++
		return nil
	}
	for _, g := range spec.Goals {
		if !g.Reached(x.h.Model(), x.h.State()) {
			return x.fail(fmt.Errorf("%s not reached at quiescence", g.Name))
		}
	}
	return nil
}

// walk is a seeded random walk: a fault one step in five when one is
// enabled, a crash allowed in a quarter of the walks, a sixth of the WRITEs
// late, corrupt or both.
func walk(cfg spec.Config, bugs research.Switches, seed uint64) error {
	rng := rand.New(rand.NewPCG(seed, 7))
	x, err := newRefinementRun(cfg, bugs, func(int) uint16 {
		if rng.IntN(6) == 0 {
			return uint16(1 + rng.IntN(3))
		}
		return 0
	})
	if err != nil {
		return err
	}
	crashes := seed%4 == 0 // a crash ends everything: in a quarter of the walks
	for i := 0; i < 60; i++ {
		var proto, faults []spec.Action
		for _, a := range x.h.Enabled() {
			switch {
			case !a.IsFault():
				proto = append(proto, a)
			case a.Kind != spec.Crash || crashes:
				faults = append(faults, a)
			}
		}
		acts := proto
		if len(faults) > 0 && (len(proto) == 0 || rng.IntN(5) == 0) {
			acts = faults
		}
		if len(acts) == 0 {
			break
		}
		if err := x.take(acts[rng.IntN(len(acts))]); err != nil {
			return err
		}
	}
	if err := x.drain(); err != nil {
		return err
	}
	for _, a := range x.h.Trace {
		walkCoverage[strings.SplitN(strings.SplitN(a, "(", 2)[0], "+", 2)[0]]++
		if strings.Contains(a, "+") {
			walkCoverage["late or corrupt WRITE"]++
		}
	}
	for r := range cfg.Prompts {
		walkCoverage["outcome "+x.h.State().Req[r].Outcome.String()]++
	}
	return nil
}

// outOfBounds counts runs that left the spec's bounds and ended early.
var outOfBounds int

// walkCoverage counts what the walks did, so a test can show they reach
// every action and outcome.
var walkCoverage = map[string]int{}

// configs are the deployments the walks run on: the spec's default bounds,
// multi-page prompts, a tight pool, and a window of one WRITE, so that a
// request can be aborted with WRITEs not yet posted.
func configs() []spec.Config {
	def := spec.DefaultConfig()
	multi := spec.NewConfig(3, 6, 2)
	multi.Prompts, multi.PrefillPages = []int{4, 4, 9}, 4
	tight := spec.NewConfig(4, 3, 1)
	tight.DecodeSlots = 3
	narrow := spec.NewConfig(3, 6, 2)
	narrow.Prompts, narrow.PrefillPages, narrow.MaxInFlight = []int{4, 4, 5}, 5, 1
	return []spec.Config{narrow, def, multi, tight}
}

func TestImplementationRefinesTheSpecOnSeededWalks(t *testing.T) {
	seeds := uint64(3000)
	if testing.Short() {
		seeds = 300
	}
	clear(walkCoverage)
	outOfBounds = 0
	for i, cfg := range configs() {
		for seed := uint64(0); seed < seeds; seed++ {
			if err := walk(cfg, research.Switches{}, seed); err != nil {
				t.Fatalf("config %d, seed %d: %v", i, seed, err)
			}
		}
	}
	t.Logf("coverage: %v; %d walks left the spec's bounds", walkCoverage, outOfBounds)
	if outOfBounds*100 > int(seeds)*len(configs()) {
		t.Errorf("%d walks left the spec's bounds: more than 1%%", outOfBounds)
	}
	for _, what := range []string{"Submit", "PrefillRecv", "PrefillRecvQP", "DecodeRecv", "DecodeRecvQP", "PostWrite", "DecodeRead",
		"DetectCrash", "Cancel", "Crash", "Timeout", "Cut", "late or corrupt WRITE",
		"outcome ok", "outcome rejected", "outcome cancelled", "outcome failed"} {
		if walkCoverage[what] == 0 {
			t.Errorf("no walk took %s", what)
		}
	}
}

// checkRefinement is the rapid state machine: rapid draws the deployment,
// every action and every WRITE's fault variant; a failure shrinks to a short
// action sequence and replays from rapid's failfile.
func checkRefinement(t *rapid.T, bugs research.Switches) {
	cfg := spec.NewConfig(rapid.IntRange(2, 4).Draw(t, "requests"), rapid.IntRange(2, 6).Draw(t, "decode pages"), rapid.IntRange(1, 2).Draw(t, "page size"))
	cfg.PrefillPages = rapid.IntRange(1, cfg.DecodePages).Draw(t, "prefill pages")
	cfg.DecodeSlots = rapid.IntRange(1, min(spec.MaxSlots, len(cfg.Prompts))).Draw(t, "slots")
	cfg.MaxInFlight = rapid.IntRange(1, 3).Draw(t, "window")
	for i := range cfg.Prompts { // prompts that fit the prefill pool, and a last one that may not
		limit := cfg.PrefillLimit()
		if i == len(cfg.Prompts)-1 {
			limit = cfg.ContextLimit + 1
		}
		cfg.Prompts[i] = rapid.IntRange(1, limit).Draw(t, "prompt")
	}
	variants := []uint16{0, 0, 0, 0, 0, 0, spec.Late, spec.Corrupt, spec.Late | spec.Corrupt}
	x, err := newRefinementRun(cfg, bugs, func(int) uint16 { return rapid.SampledFrom(variants).Draw(t, "variant") })
	if err != nil {
		t.Fatal(err)
	}
	// Two kinds of action, as in checkWorld: a protocol step (three times as
	// likely) and a fault, each drawn among the actions enabled now.
	crashes := rapid.IntRange(0, 3).Draw(t, "crash allowed") == 0 // a crash ends everything: in a quarter of the runs
	take := func(t *rapid.T, faults bool) {
		var acts []spec.Action
		for _, a := range x.h.Enabled() {
			if a.IsFault() == faults && (a.Kind != spec.Crash || crashes) {
				acts = append(acts, a)
			}
		}
		if len(acts) == 0 {
			return // quiescent (or no fault left): the drain below checks the goals
		}
		if err := x.take(rapid.SampledFrom(acts).Draw(t, "action")); err != nil {
			t.Fatal(err)
		}
	}
	step := func(t *rapid.T) { take(t, false) }
	t.Repeat(map[string]func(*rapid.T){
		"step": step, "step2": step, "step3": step,
		"fault": func(t *rapid.T) { take(t, true) },
	})
	if err := x.drain(); err != nil {
		t.Fatal(err)
	}
	ok := 0
	for r := range cfg.Prompts {
		if x.h.State().Req[r].Outcome == spec.OK {
			ok = 1
		}
	}
	refinementStats.add(x.steps, ok)
}

var refinementStats runStats

func TestRapidImplementationRefinesTheSpec(t *testing.T) {
	atLeast(t, 300)
	refinementStats, outOfBounds = runStats{}, 0
	rapid.Check(t, func(t *rapid.T) { checkRefinement(t, research.Switches{}) })
	st := refinementStats
	t.Logf("%d runs, %.1f spec steps each (PostWrite not counted), %d with a request served, %d left the spec's bounds",
		st.runs, float64(st.repeated)/float64(st.runs), st.total, outOfBounds)
	if st.repeated < 10*st.runs || 3*st.total < st.runs {
		t.Fatalf("%d steps in %d runs, %d with a request served: the state machine barely ran", st.repeated, st.runs, st.total)
	}
}

// FuzzRefinement is the same property as a coverage-guided fuzz target.
func FuzzRefinement(f *testing.F) {
	f.Fuzz(rapid.MakeFuzz(func(t *rapid.T) { checkRefinement(t, research.Switches{}) }))
}

// The harness can fail: each implementation switch (in its matrix
// combination), run beside the spec without it, makes the mapping part ways;
// and run beside the spec with the same switch on, the implementation still
// refines it and the spec's property, checked on the mapped state, breaks.
func TestRefinementCatchesEverySwitch(t *testing.T) {
	if testing.Short() {
		t.Skip("thousands of walks per switch are slow under -race; the full run covers it")
	}
	for _, combo := range matrixCombinations {
		impl := research.On(combo...)
		specBugs, err := spec.ParseSwitches(impl.String())
		if err != nil {
			t.Fatal(err)
		}
		t.Run(impl.String(), func(t *testing.T) {
			var diverged, violated error
			for _, cfg := range configs() {
				for seed := uint64(0); seed < 3000 && (diverged == nil || violated == nil); seed++ {
					if diverged == nil {
						if err := walk(cfg, impl, seed); errors.Is(err, ErrRefinement) {
							diverged = err
						}
					}
					if violated == nil {
						with := cfg
						with.Bugs = specBugs
						if err := walk(with, impl, seed); err != nil {
							if errors.Is(err, ErrRefinement) {
								t.Fatalf("with the switch on both sides, the implementation must still refine the spec: %v", err)
							}
							violated = err
						}
					}
				}
			}
			if diverged == nil {
				t.Errorf("beside the clean spec, the mapping never parted ways")
			} else {
				t.Logf("diverged: %.300s", strings.SplitN(diverged.Error(), "\n", 2)[0])
			}
			if violated == nil {
				t.Errorf("beside the spec with the switch, no property broke")
			} else {
				t.Logf("violated: %.200s", strings.SplitN(violated.Error(), "\n", 2)[0])
			}
		})
	}
}

// The mapping holds the Router to the spec's router: a router that decides
// differently (here: it believes a smaller context than the spec's router,
// so it rejects a prompt the spec dispatches; or it drops a client's cancel
// to decode) parts ways at once.
func TestRefinementCatchesARouterThatDiffers(t *testing.T) {
	cfg := spec.DefaultConfig()
	longest := 0
	for r, p := range cfg.Prompts {
		if p <= cfg.ContextLimit && p > cfg.Prompts[longest] {
			longest = r
		}
	}
	h, err := NewRefinement(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.router.AddNode(protocol.NodeInfo{ID: prefillPeer, Role: protocol.RolePrefill,
		ContextTokens: cfg.Prompts[longest] - 1, PoolPages: cfg.ContextLimit, PageTokens: cfg.PageSize}); err != nil {
		t.Fatal(err)
	}
	err = h.Step(spec.Action{Kind: spec.Submit, Req: int8(longest)})
	if !errors.Is(err, ErrRefinement) || !strings.Contains(err.Error(), "rejected") {
		t.Fatalf("a router with a smaller context: %v, want the mapping to part ways on the rejection", err)
	}

	// Cancels go to both legs; a harness that lost one is caught by the queue view.
	h, err = NewRefinement(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Step(spec.Action{Kind: spec.Submit, Req: 0}); err != nil {
		t.Fatal(err)
	}
	if err := h.router.Cancel(id(0)); err != nil {
		t.Fatal(err)
	}
	h.router.Effects() // the router's cancels are lost on the way
	if err := h.Step(spec.Action{Kind: spec.Cancel, Req: 0}); !errors.Is(err, ErrRefinement) || !strings.Contains(err.Error(), "router to decode") {
		t.Fatalf("cancels lost: %v, want the mapping to part ways on the router's queue to decode", err)
	}
}
