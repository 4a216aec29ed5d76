package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/spec"
	"github.com/kvhandoff/kvhandoff/spec/explore"
)

// The mutation gate fails when its configurations catch too little: one
// small faultless configuration leaves the fault-driven mutants uncaught.
func TestMutationGateFailsOnAMutantNothingCatches(t *testing.T) {
	dir := t.TempDir()
	configs := filepath.Join(dir, "configs")
	if err := os.WriteFile(configs, []byte("# one faultless configuration\n--page-size 2 --pages 2 --prompts 2,2 --faults none\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	code, out, _ := runCLI(t, "check", "--quiet", "--mutants", configs)
	if code != 1 || !strings.Contains(out, "eager-release                      NOTHING: FAIL") || !strings.Contains(out, "no-peer-cancel                     1: Termination") {
		t.Fatalf("exit %d, want 1 with eager-release uncaught and no-peer-cancel caught:\n%s", code, out)
	}
}

// A configuration line is check flags only: a switch or a mutation there
// would turn the gate's own question around.
func TestMutationGateRefusesASwitchInAConfiguration(t *testing.T) {
	configs := filepath.Join(t.TempDir(), "configs")
	if err := os.WriteFile(configs, []byte("--bug eager-release\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if code, _, errOut := runCLI(t, "check", "--mutants", configs); code != 2 || !strings.Contains(errOut, "bounds and faults only") {
		t.Fatalf("exit %d, want 2: %s", code, errOut)
	}
}

// Removing a configuration from CI makes the gate fail (issue 23): each of
// these mutants is caught by exactly one line of scripts/check-configs and
// is not listed as equivalent, so the gate without that line has a mutant
// that nothing catches. (The whole gate without a line takes minutes; this
// checks the one mutant against every line instead.)
func TestRemovingAConfigurationFailsTheGate(t *testing.T) {
	configs, err := readMutantConfigs(filepath.Join("..", "..", "scripts", "check-configs"))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ mutation, line string }{
		{"no-lost-decode-fence", "--page-size 2 --pages 2 --prompts 2 --faults partition"},
		{"decode-restart-same-incarnation", "--page-size 2 --pages 4 --prompts 2,2 --faults restart --decode-restarts"},
		{"no-router-leg-cancel", "--page-size 2 --pages 2 --prompts 2 --faults partition --static-peers"},
		{"unbounded-retry", "--page-size 2 --pages 2 --prompts 2 --faults partition --static-peers"},
	} {
		mu, err := spec.ParseMutation(c.mutation)
		if err != nil {
			t.Fatal(err)
		}
		if _, listed := spec.Equivalent[c.mutation]; listed {
			t.Fatalf("%s is listed as equivalent: the gate would accept it uncaught", c.mutation)
		}
		var by []string
		for _, mc := range configs {
			cfg := mc.cfg
			cfg.Mutation = mu
			r, err := explore.Check(cfg, explore.Options{Workers: 1})
			if err != nil {
				t.Fatal(err)
			}
			if !r.OK {
				by = append(by, mc.line)
			}
		}
		if len(by) != 1 || by[0] != c.line {
			t.Errorf("%s caught by %q, want by %q alone", c.mutation, by, c.line)
		}
	}
}
