package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
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
