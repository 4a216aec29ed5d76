package main

import (
	"strings"
	"testing"
)

// Each enforcement switch of issue 17 is found by `check --bug X` as a
// shortest counterexample, exit 1, of the property it breaks.
func TestCheckFindsEachEnforcementSwitch(t *testing.T) {
	for bug, want := range map[string]string{
		"pool-wide-key":        "VIOLATION of NoForeignWrite", // a WRITE into another request's page: with streaming prefill's Computes, shorter than a verified page's change (ReadAsVerified)
		"verify-before-revoke": "VIOLATION of ReadAsVerified",
		"unticketed-bootstrap": "VIOLATION of Ticketed",
	} {
		code, out, _ := runCLI(t, "check", "--bug", bug, "--quiet")
		if code != 1 || !strings.Contains(out, want) || !strings.Contains(out, "[FAULT rogue]") {
			t.Errorf("check --bug %s: exit %d, want 1 and %q through the rogue fault:\n%s", bug, code, want, out)
		}
	}
}
