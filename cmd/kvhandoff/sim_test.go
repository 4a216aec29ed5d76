package main

import (
	"encoding/json"
	"strings"
	"testing"
)

// --each streams one result per seed as it completes, then the summary; with
// --json every line is an object and the last one is the summary.
func TestSimEachStreamsOneLinePerSeed(t *testing.T) {
	code, out, _ := runCLI(t, "sim", "--seeds", "40", "--each", "--json", "--bug", "eager-release")
	if code != 1 {
		t.Fatalf("exit %d, want 1 (eager-release fails some seeds)\n%s", code, out)
	}
	dec := json.NewDecoder(strings.NewReader(out))
	seeds := map[uint64]bool{}
	failed := 0
	var summary map[string]json.RawMessage
	for dec.More() {
		var line map[string]json.RawMessage
		if err := dec.Decode(&line); err != nil {
			t.Fatal(err)
		}
		if _, ok := line["first_violation"]; ok {
			summary = line
			break
		}
		var r struct {
			Seed      uint64
			Violation *struct{ Property string }
		}
		b, _ := json.Marshal(line)
		if err := json.Unmarshal(b, &r); err != nil {
			t.Fatal(err)
		}
		seeds[r.Seed] = true
		if r.Violation != nil {
			failed++
		}
	}
	if len(seeds) != 40 || summary == nil || dec.More() {
		t.Fatalf("%d seeds streamed, summary %v, more after it %v", len(seeds), summary != nil, dec.More())
	}
	var failures []struct{ Seed uint64 }
	if err := json.Unmarshal(summary["failures"], &failures); err != nil || len(failures) != failed || failed == 0 {
		t.Fatalf("summary lists %d failures (%v), the stream had %d", len(failures), err, failed)
	}
	code, out, _ = runCLI(t, "sim", "--seeds", "5", "--each")
	if code != 0 || strings.Count(out, ": ok (") != 5 {
		t.Fatalf("exit %d\n%s", code, out)
	}
}
