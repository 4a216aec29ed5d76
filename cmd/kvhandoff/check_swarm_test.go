package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// swarm runs the members of a bitstate swarm of count over args and writes
// their --json reports to dir, returning the files.
func swarm(t *testing.T, dir string, count int, args ...string) []string {
	t.Helper()
	var files []string
	for i := range count {
		code, out, errOut := runCLI(t, append([]string{"check", "--json", "--quiet", "--bitstate", "--swarm-count", itoa(count), "--swarm-index", itoa(i)}, args...)...)
		if code != 0 && code != 1 {
			t.Fatalf("member %d: exit %d\n%s%s", i, code, out, errOut)
		}
		obj := decodeOne(t, out)
		if obj["bitstate"] == nil || obj["swarm"] == nil || obj["bounds"] == "" {
			t.Fatalf("member %d's report lacks bitstate, swarm or bounds: %s", i, out)
		}
		name := filepath.Join(dir, "member-"+itoa(i)+".json")
		if err := os.WriteFile(name, []byte(out), 0o644); err != nil {
			t.Fatal(err)
		}
		files = append(files, name)
	}
	return files
}

// TestSwarmMergeCombinesMembers: members of a swarm in a too-small bit array
// each estimate their coverage; merge reports the union's estimate, above
// each member's; a missing member makes it incomplete (exit 3), a report of
// other bounds is refused (exit 2), and a swarm over a bug reports the
// shortest trace any member found (exit 1).
func TestSwarmMergeCombinesMembers(t *testing.T) {
	dir := t.TempDir()
	files := swarm(t, dir, 3, "--requests", "2", "--bitstate-size", "512B")
	code, out, errOut := runCLI(t, append([]string{"check", "merge", "--json"}, files...)...)
	obj := decodeOne(t, out)
	if code != 0 || obj["result"] != "ok" || obj["coverage"].(float64) >= 1 || obj["coverage"].(float64) <= 0.9 {
		t.Fatalf("merge: exit %d\n%s%s", code, out, errOut)
	}
	if code, out, _ = runCLI(t, append([]string{"check", "merge", "--json"}, files[:2]...)...); code != 3 || decodeOne(t, out)["result"] != "incomplete" {
		t.Fatalf("merge without member 2: exit %d\n%s", code, out)
	}
	other := swarm(t, t.TempDir(), 3, "--requests", "1", "--bitstate-size", "512B")
	if code, _, errOut = runCLI(t, "check", "merge", files[0], files[1], other[2]); code != 2 || !strings.Contains(errOut, "another swarm") {
		t.Fatalf("merge across bounds: exit %d, %s", code, errOut)
	}
	if code, _, errOut = runCLI(t, "check", "merge", files[0], files[0]); code != 2 || !strings.Contains(errOut, "twice") {
		t.Fatalf("merge of one member twice: exit %d, %s", code, errOut)
	}
	bug := swarm(t, t.TempDir(), 2, "--bug", "eager-release", "--bitstate-size", "1MiB")
	code, out, _ = runCLI(t, append([]string{"check", "merge", "--json"}, bug...)...)
	obj = decodeOne(t, out)
	_, exhaustive, _ := runCLI(t, "check", "--json", "--quiet", "--bug", "eager-release")
	shortest := len(decodeOne(t, exhaustive)["trace"].([]any))
	if code != 1 || obj["result"] != "violation" || obj["property"] != "NoForeignWrite" || len(obj["trace"].([]any)) != shortest {
		t.Fatalf("merge of a bug's swarm: exit %d, want the exhaustive run's %d-step trace\n%s", code, shortest, out)
	}
	for _, bad := range [][]string{
		{"check", "--swarm-count", "2"},                                     // no --bitstate
		{"check", "--bitstate", "--swarm-count", "2", "--swarm-index", "2"}, // out of range
		{"check", "--bitstate", "--hashes", "0"},
		{"check", "--bitstate", "--bitstate-size", "much"},
	} {
		if code, _, _ := runCLI(t, bad...); code != 2 {
			t.Fatalf("%v: exit %d, want 2", bad, code)
		}
	}
}
