package main

import (
	"encoding/json"
	"strings"
	"testing"
)

// decodeOne decodes stdout as exactly one JSON object.
func decodeOne(t *testing.T, out string) map[string]any {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(out))
	var obj map[string]any
	if err := dec.Decode(&obj); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, out)
	}
	if dec.More() {
		t.Fatalf("more than one JSON value on stdout:\n%s", out)
	}
	return obj
}

func TestCheckJSONOnEveryExit(t *testing.T) {
	for _, c := range []struct {
		args   []string
		code   int
		result string
	}{
		{[]string{"--requests", "2", "--faults", "cancel"}, 0, "ok"},
		{[]string{"--bug", "eager-release"}, 1, "violation"},
		{[]string{"--max-states", "1000"}, 3, "incomplete"},
		{[]string{"--max-memory", "40MB", "--prompts", "4,4,9", "--pages", "6", "--prefill-pages", "4"}, 3, "incomplete"},
		{[]string{"--max-memory", "lots"}, 2, "error"},
		{[]string{"--bug", "no-such-bug"}, 2, "error"},
		{[]string{"--pages", "0"}, 2, "error"},
		{[]string{"--no-such-flag"}, 2, "error"},
	} {
		args := append([]string{"check", "--json", "--quiet"}, c.args...)
		code, out, _ := runCLI(t, args...)
		obj := decodeOne(t, out)
		if code != c.code || obj["result"] != c.result {
			t.Errorf("%v: exit %d, result %v; want %d, %s", c.args, code, obj["result"], c.code, c.result)
		}
		// How far a memory-limited run gets depends on what the test binary
		// already holds; it has always explored something.
		if c.code == 3 && (obj["states"].(float64) < 1 || obj["error"] == "" || obj["heap_bytes"].(float64) == 0) {
			t.Errorf("%v: an incomplete run reports how far it got: %v", c.args, obj)
		}
	}
}

func TestCheckReportsAcyclicity(t *testing.T) {
	_, out, _ := runCLI(t, "check", "--json", "--quiet", "--requests", "2", "--faults", "cancel")
	if obj := decodeOne(t, out); obj["acyclic"] != true {
		t.Fatalf("acyclic = %v, want true for the correct protocol", obj["acyclic"])
	}
	// A violation stops the exploration before the graph is complete: unknown.
	_, out, _ = runCLI(t, "check", "--json", "--quiet", "--bug", "eager-release")
	if obj := decodeOne(t, out); obj["acyclic"] != nil {
		t.Fatalf("acyclic = %v, want null when not computed", obj["acyclic"])
	}
	_, out, _ = runCLI(t, "check", "--quiet", "--requests", "2", "--faults", "cancel")
	if !strings.Contains(out, "protocol transitions acyclic") {
		t.Fatalf("summary does not state acyclicity:\n%s", out)
	}
	_, out, _ = runCLI(t, "check", "--quiet", "--bug", "eager-release")
	if !strings.Contains(out, "acyclicity not computed") {
		t.Fatalf("summary of a violation does not say acyclicity is unknown:\n%s", out)
	}
}

func TestMaxMemoryParsesSizes(t *testing.T) {
	for in, want := range map[string]uint64{"1024": 1024, "16GiB": 16 << 30, "16G": 16 << 30, "500MB": 500e6, "1.5KiB": 1536, "2 TB": 2e12} {
		if got, err := maxMemory(in); err != nil || got != want {
			t.Errorf("%q: got %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"lots", "-1G", "0", "1e30T"} {
		if _, err := maxMemory(in); err == nil {
			t.Errorf("%q: accepted", in)
		}
	}
	if got, _ := maxMemory(""); got == 0 || got > totalMemory() {
		t.Errorf("default %d, want 3/4 of %d", got, totalMemory())
	}
}

// A prefix switch named without --prefix-cache runs under the bounds that
// expose it (spec.PrefixBounds), never passing silently on a cacheless
// model; scopes or contents without a cache are bad usage.
func TestCheckPrefixSwitchWithoutACacheRunsUnderItsBounds(t *testing.T) {
	for _, c := range []struct {
		args     []string
		code     int
		property string
	}{
		{[]string{"--bug", "scope-dropped"}, 1, "NoCrossScopeRead"},
		{[]string{"--bug", "write-shared"}, 1, "PinnedNeverReallocated"},
		{[]string{"--bug", "prefix-count-mismatch"}, 1, "PrefixExact"},
		{[]string{"--prompts", "4,4", "--scopes", "1,2"}, 2, ""},
		{[]string{"--prompts", "4,4", "--prefix-cache", "2", "--contents", "aa,a"}, 2, ""},
		{[]string{"--prompts", "4,4", "--pages", "3", "--prefix-cache", "2", "--scopes", "1,1", "--faults", "none"}, 0, ""},
	} {
		args := append([]string{"check", "--json", "--quiet"}, c.args...)
		code, out, _ := runCLI(t, args...)
		obj := decodeOne(t, out)
		if code != c.code || obj["property"] != c.property && c.property != "" {
			t.Errorf("%v: exit %d, property %v; want %d, %q", c.args, code, obj["property"], c.code, c.property)
		}
	}
}

// check --phases prints where the exploration's time went, and --json always
// carries it (but not for a simulation, which has no waves).
func TestCheckReportsItsPhases(t *testing.T) {
	_, out, _ := runCLI(t, "check", "--quiet", "--phases", "--workers", "2", "--requests", "2", "--faults", "cancel")
	for _, want := range []string{"of 2 workers' time", "\nexpand ", "\ncommit ", "\ncollect ", "serial", "idle core time"} {
		if !strings.Contains(out, want) {
			t.Errorf("--phases: no %q in\n%s", want, out)
		}
	}
	_, out, _ = runCLI(t, "check", "--quiet", "--requests", "2", "--faults", "cancel")
	if strings.Contains(out, "idle core time") {
		t.Errorf("the phases without --phases:\n%s", out)
	}
	_, out, _ = runCLI(t, "check", "--json", "--quiet", "--workers", "2", "--requests", "2", "--faults", "cancel")
	ph, ok := decodeOne(t, out)["phases"].(map[string]any)
	if !ok || ph["workers"] != 2.0 {
		t.Fatalf("--json: phases %v, want an object with workers 2", ph)
	}
	expand, _ := ph["expand"].(map[string]any)
	if w, _ := expand["wall_seconds"].(float64); w <= 0 {
		t.Errorf("--json: phases.expand %v, want a wall time", expand)
	}
	_, out, _ = runCLI(t, "check", "--json", "--quiet", "--simulate", "--walks", "10")
	if obj := decodeOne(t, out); obj["phases"] != nil {
		t.Errorf("a simulation reports phases: %v", obj["phases"])
	}
}
