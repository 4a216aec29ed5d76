package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// kvhandoff trace check: the in-process demo's trace conforms (exit 0); a
// decode node's own sweep of a verified request's pages, inserted into it,
// is refused (exit 1; node's TestTraceCheckRefusesPagesHeldPastTheirRequestsEnd
// makes the real node do it); a trace with a node's event missing,
// unreadable, or no file at all is bad input (exit 2).
func TestTraceCheckExitsByTheVerdict(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the demo")
	}
	dir := t.TempDir()
	file := filepath.Join(dir, "t.jsonl")
	if code, out, errOut := runCLI(t, "demo", "--requests", "40", "--no-faults", "--trace", file); code != 0 {
		t.Fatalf("demo: exit %d\n%s%s", code, out, errOut)
	}
	code, out, errOut := runCLI(t, "trace", "check", file)
	if code != 0 || !strings.Contains(out, "conforms") || !strings.Contains(out, "replayed in the spec") {
		t.Fatalf("trace check of the demo: exit %d\n%s%s", code, out, errOut)
	}
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(data)), "\n")

	// The decode node's own sweep of a request's pages just after they
	// verified, its later events numbered on.
	var withSweep []string
	shift := 0
	for _, l := range lines {
		var ev map[string]any
		dec := json.NewDecoder(strings.NewReader(l))
		dec.UseNumber() // ids and clocks past 2^53
		if err := dec.Decode(&ev); err != nil {
			t.Fatal(err)
		}
		next := func(k string) json.Number {
			n, _ := ev[k].(json.Number).Int64()
			return json.Number(strconv.FormatInt(n+1, 10))
		}
		if ev["node"] == "decode-0" && shift > 0 {
			ev["seq"] = next("seq")
			b, _ := json.Marshal(ev)
			l = string(b)
		}
		withSweep = append(withSweep, l)
		if ev["node"] == "decode-0" && ev["ev"] == "verified" && shift == 0 {
			shift = 1
			sweep, _ := json.Marshal(map[string]any{"node": "decode-0", "seq": next("seq"), "t": next("t"),
				"ev": "cancel", "req": ev["req"], "cause": "sweep-no-call"})
			withSweep = append(withSweep, string(sweep))
		}
	}
	if shift == 0 {
		t.Fatal("no request verified on decode-0")
	}
	swept := filepath.Join(dir, "swept.jsonl")
	write(t, swept, withSweep)
	code, out, _ = runCLI(t, "trace", "check", swept)
	if code != 1 || !strings.Contains(out, "DOES NOT CONFORM") || !strings.Contains(out, "sweep-no-call") {
		t.Fatalf("the sweep of verified pages: exit %d\n%s", code, out)
	}

	gap := filepath.Join(dir, "gap.jsonl")
	var kept []string
	dropped := false
	for _, l := range lines {
		if !dropped && strings.Contains(l, `"node":"prefill-0"`) && strings.Contains(l, `"seq":3,`) {
			dropped = true
			continue
		}
		kept = append(kept, l)
	}
	write(t, gap, kept)
	garbage := filepath.Join(dir, "garbage.jsonl")
	write(t, garbage, []string{"not json", lines[0]})
	for _, args := range [][]string{{"trace", "check", gap}, {"trace", "check", garbage}, {"trace", "check", filepath.Join(dir, "none")}, {"trace", "check"}, {"trace"}} {
		if code, out, errOut := runCLI(t, args...); code != 2 || errOut == "" {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want 2 and a reason", args, code, out, errOut)
		}
	}
}

// Five page bugs of the implementation, run by the demo and traced, are
// refused at the event that shows them, where the per-request replay alone
// saw nothing (write-shared, leak-on-cancel, eager-release), only the Done
// after the misdirected WRITEs (prefix-count-mismatch) or only the read
// that failed after the eviction (evict-pinned): a Grant naming a page
// tenancy another request's Grant named, a WRITE to another page than its
// Grant put its index on, and, from the pool journal's events, a cancelled
// request whose pages were never freed, a pinned page freed, and a
// request's pages freed while a writer may still write them. The demo's
// own checks miss the last in most runs: they catch it only where a late
// WRITE lands on the page's next tenant and its read fails the tag check
// (1 run of 200 requests in 10 here). It shows only where a client's cancel
// reaches decode after its Grant and before its Done: half the clients
// disconnect in its runs, 6 to 11 such cancels a run of 200 requests on 2
// cores each busy with a spinning process too (6 runs); with the default 5%
// some runs had none, and CI's run of 3 once met none.
func TestTraceCheckRefusesTheDemosPageBugs(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the demo")
	}
	for _, tc := range []struct {
		bug, rule string // rule: the rule that refuses it, or several separated by |
		faults    bool   // the bug needs the demo's faults (a cancel)
		demoExit  int    // the demo's own checks: 1 if they catch it, anyExit if only some runs
		requests  string
		more      []string // more demo flags
	}{
		{"write-shared", "decode send Grant names page tenancies no other request's Grant named", false, 1, "80", nil},
		// The first misdirected WRITE, or, where the miscount leaves none
		// to post (about 1 run in 7), the Done's count.
		{"prefix-count-mismatch", "prefill post writes where the Grant put that page|prefill send Done names the Grant's pages", false, 1, "80", nil},
		// A leak needs a client's cancel after its request verified: with
		// the default 5% of clients disconnecting, 1 run in 8 here met none.
		{"leak-on-cancel", "end of trace: the pages the spec gave back were freed or cached", true, 1, "80", []string{"--disconnects", "0.2"}},
		{"evict-pinned", "decode free takes no pinned page", false, 1, "80", nil},
		{"eager-release", "decode free of the request's pages is the spec's release of them", true, anyExit, "200", []string{"--disconnects", "0.5"}},
	} {
		t.Run(tc.bug, func(t *testing.T) {
			// A run may meet its bug late or not at all: with faults
			// (eager-release), or as the schedule falls (evict-pinned met
			// nothing in 4 runs of 8 under GOMAXPROCS=1, every run on 2
			// cores): up to 3 runs, until the rule refuses one.
			runs := 3
			refusedBy := func(out string) bool {
				return strings.Contains(out, "DOES NOT CONFORM") &&
					slices.ContainsFunc(strings.Split(tc.rule, "|"), func(rule string) bool { return strings.Contains(out, "rule: "+rule) })
			}
			var code int
			var out, errOut string
			for run := range runs {
				file := filepath.Join(t.TempDir(), "t.jsonl")
				args := append([]string{"demo", "--requests", tc.requests, "--bug", tc.bug, "--trace", file}, tc.more...)
				if !tc.faults {
					args = append(args, "--no-faults")
				}
				demoCode, demoOut, demoErr := runCLI(t, args...)
				code, out, errOut = runCLI(t, "trace", "check", file)
				met := refusedBy(out)
				if !met && demoCode == 0 {
					// Neither the demo nor the check saw the bug: it
					// never happened this run.
					if run < runs-1 {
						continue
					}
					t.Fatalf("demo --bug %s: neither the demo (exit 0) nor the trace check (exit %d) met the bug in %d runs: it never happened\n%s%s", tc.bug, code, runs, out, errOut)
				}
				if demoCode != tc.demoExit && tc.demoExit != anyExit {
					t.Fatalf("demo --bug %s: exit %d, want %d (the demo's own checks)\n%s%s", tc.bug, demoCode, tc.demoExit, demoOut, demoErr)
				}
				if met {
					break
				}
			}
			if code != 1 || !refusedBy(out) {
				t.Fatalf("trace check of demo --bug %s: exit %d, want 1 at %q\n%s%s", tc.bug, code, tc.rule, out, errOut)
			}
		})
	}
}

// anyExit: the demo's own checks catch the bug in some runs only.
const anyExit = -1

func write(t *testing.T, name string, lines []string) {
	t.Helper()
	if err := os.WriteFile(name, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
}
