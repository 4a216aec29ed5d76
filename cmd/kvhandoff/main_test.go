package main

import (
	"bytes"
	"encoding/json"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/spec"
)

func runCLI(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var o, e bytes.Buffer
	code = run(args, &o, &e)
	return code, o.String(), e.String()
}

func TestCheckJSONIsOneObjectWithTheDocumentedKeys(t *testing.T) {
	code, out, _ := runCLI(t, "check", "--json", "--bug", "admit-finished,no-token-check,no-tag-check")
	if code != 1 {
		t.Fatalf("exit %d, want 1 for a violation", code)
	}
	dec := json.NewDecoder(strings.NewReader(out))
	var obj map[string]json.RawMessage
	if err := dec.Decode(&obj); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, out)
	}
	if dec.More() {
		t.Fatal("more than one JSON value on stdout")
	}
	var keys []string
	for k := range obj {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	want := []string{"acyclic", "bugs", "depth", "heap_bytes", "phases", "property", "result", "seconds", "states", "trace", "transitions"}
	if !slices.Equal(keys, want) {
		t.Fatalf("keys %v, want %v", keys, want)
	}
	var r struct {
		Result, Property string
		Bugs             []string
		Trace            []struct {
			Step           int
			Action, Detail string
		}
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatal(err)
	}
	if r.Result != "violation" || r.Property != "Isolation" || len(r.Bugs) != 3 || len(r.Trace) == 0 || r.Trace[0].Step != 1 {
		t.Fatalf("got %+v", r)
	}
}

func TestCheckExitsZeroWhenEveryPropertyHolds(t *testing.T) {
	code, out, errOut := runCLI(t, "check", "--requests", "2", "--faults", "cancel,late", "--quiet")
	if code != 0 || !strings.HasPrefix(out, "ok: every property holds") {
		t.Fatalf("exit %d\n%s\n%s", code, out, errOut)
	}
}

func TestCheckPrintsNumberedTraceAndSummary(t *testing.T) {
	code, out, _ := runCLI(t, "check", "--bug", "eager-release", "--quiet")
	if code != 1 || !strings.Contains(out, "VIOLATION of NoForeignWrite") || !strings.Contains(out, "  1. ") {
		t.Fatalf("exit %d\n%s", code, out)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if last := lines[len(lines)-1]; !strings.HasPrefix(last, "violation of NoForeignWrite in ") {
		t.Fatalf("the last line is the one-line summary, got %q", last)
	}
}

// With --trace-format mermaid, stdout is one diagram: everything else is a
// Mermaid comment, so the output can go straight to a renderer. (The output of
// several switches was also checked with mermaid 11's parser; see docs/spec.md.)
func TestCheckMermaidOutputIsOnlyADiagram(t *testing.T) {
	code, out, _ := runCLI(t, "check", "--bug", "no-checksum", "--trace-format", "mermaid", "--quiet")
	if code != 1 {
		t.Fatalf("exit %d\n%s", code, out)
	}
	inDiagram := false
	for _, line := range strings.Split(strings.TrimRight(out, "\n"), "\n") {
		switch {
		case strings.HasPrefix(line, "%% "):
		case line == "sequenceDiagram":
			inDiagram = true
		case !inDiagram || !strings.HasPrefix(line, "    "):
			t.Fatalf("line is neither a comment nor part of the diagram: %q", line)
		}
	}
	if !inDiagram {
		t.Fatal("no sequenceDiagram")
	}
}

func TestCheckSimulate(t *testing.T) {
	code, out, _ := runCLI(t, "check", "--simulate", "--seed", "3", "--walks", "20000", "--bug", "double-free", "--quiet")
	if code != 1 || !strings.Contains(out, "of seed 3") {
		t.Fatalf("exit %d\n%s", code, out)
	}
}

func TestCheckRejectsBadInputWithExitTwo(t *testing.T) {
	for _, args := range [][]string{
		{"check", "--bug", "no-such-bug"},
		{"check", "--faults", "meteor"},
		{"check", "--requests", "9"},
		{"check", "--pages", "0"},
		{"check", "--trace-format", "svg"},
		{"check", "--max-faults", "-1"},
		{"check", "--prompts", "4,x"},
		{"check", "--prompts", "4,0"},
		{"check", "--restarts", "9"},
		{"check", "--faults", "restart"},                    // a restart without a crash to come back from
		{"check", "--decode-restarts", "--faults", "crash"}, // decode restarts with no restart budget
		{"check", "extra"},
		{"check", "--no-such-flag"},
		{"frobnicate"},
		{},
	} {
		code, out, errOut := runCLI(t, args...)
		if code != 2 || out != "" || errOut == "" {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want 2, nothing on stdout and a reason on stderr", args, code, out, errOut)
		}
	}
	_, _, errOut := runCLI(t, "check", "--bug", "no-such-bug")
	if !strings.Contains(errOut, "no-such-bug") || !strings.Contains(errOut, "admit-finished") {
		t.Errorf("the error should name the bad switch and list the known ones: %s", errOut)
	}
}

func TestMatrixJSON(t *testing.T) {
	code, out, _ := runCLI(t, "check", "--matrix", "--json", "--matrix-size", "1", "--max-faults", "1")
	if code != 1 { // some switches need partners, so size 1 cannot expose them all
		t.Fatalf("exit %d, want 1", code)
	}
	var m struct {
		Matrix []struct {
			Bug       string     `json:"bug"`
			ExposedBy [][]string `json:"exposed_by"`
			Violated  []string   `json:"violated"`
		} `json:"matrix"`
	}
	if err := json.Unmarshal([]byte(out), &m); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if len(m.Matrix) != len(spec.AllSwitches()) || m.Matrix[0].Bug != "admit-finished" || m.Matrix[0].ExposedBy == nil || m.Matrix[0].Violated == nil {
		t.Fatalf("got %+v", m.Matrix)
	}
}

func TestSimJSON(t *testing.T) {
	code, out, _ := runCLI(t, "sim", "--seeds", "50", "--json")
	if code != 0 {
		t.Fatalf("exit %d\n%s", code, out)
	}
	var r map[string]json.RawMessage
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatal(err)
	}
	var keys []string
	for k := range r {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	want := []string{"failures", "first_violation", "outcomes", "pages_leaked", "requests", "seconds", "seeds", "violations"}
	if !slices.Equal(keys, want) {
		t.Fatalf("keys %v, want %v", keys, want)
	}
}

func TestSimViolationPrintsSeedTraceAndReplay(t *testing.T) {
	code, out, _ := runCLI(t, "sim", "--seeds", "200", "--bug", "eager-release")
	if code != 1 || !strings.Contains(out, "VIOLATION of") || !strings.Contains(out, "event trace:") {
		t.Fatalf("exit %d\n%s", code, out)
	}
	i := strings.Index(out, "replay: kvhandoff ")
	if i < 0 {
		t.Fatal("no replay command")
	}
	replay := strings.Fields(strings.SplitN(out[i+len("replay: kvhandoff "):], "\n", 2)[0])
	code2, out2, _ := runCLI(t, replay...)
	first := func(s string) string { return strings.SplitN(s, "\n", 2)[0] }
	if code2 != 1 || first(out2) != first(out) {
		t.Fatalf("replay %v gave %q, want %q", replay, first(out2), first(out))
	}
}

func TestSimRejectsBadInput(t *testing.T) {
	for _, args := range [][]string{
		{"sim", "--bug", "done-unmatched"},
		{"sim", "--bug", "nonsense"},
		{"sim", "--seeds", "0"},
		{"sim", "extra"},
	} {
		if code, out, errOut := runCLI(t, args...); code != 2 || out != "" || errOut == "" {
			t.Errorf("%v: exit %d", args, code)
		}
	}
}

func TestLincheckJSON(t *testing.T) {
	code, out, _ := runCLI(t, "lincheck", "--clients", "4", "--ops", "2000", "--json")
	var r struct {
		Ops, Partitions int
		Result          string
		Visualization   string
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil || code != 0 || r.Result != "ok" || r.Ops < 2000 || r.Visualization != "" {
		t.Fatalf("exit %d, %+v, %v\n%s", code, r, err, out)
	}
	if code, _, errOut := runCLI(t, "lincheck", "--bug", "eager-release-ish"); code != 2 || errOut == "" {
		t.Fatalf("a bad switch: exit %d", code)
	}
	if code, _, errOut := runCLI(t, "lincheck", "--timeout", "0s"); code != 2 || !strings.Contains(errOut, "--timeout") {
		t.Fatalf("a zero timeout: exit %d, %q", code, errOut)
	}
}

func TestBenchTransferJSON(t *testing.T) {
	code, out, _ := runCLI(t, "bench", "transfer", "--json", "--bytes", "1048576", "--reps", "1")
	var r struct {
		Rows []struct {
			Provider     string  `json:"provider"`
			Baseline     string  `json:"baseline"`
			PageBytes    int     `json:"page_bytes"`
			Gbps         float64 `json:"gbps"`
			BaselineGbps float64 `json:"baseline_gbps"`
			Ratio        float64 `json:"ratio"`
		} `json:"rows"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil || code != 0 || len(r.Rows) != 12 {
		t.Fatalf("exit %d, %+v, %v\n%s", code, r, err, out)
	}
	for i, row := range r.Rows {
		provider := []string{"inproc", "socket"}[i/6]
		if row.Provider != provider || row.PageBytes != 4096<<(2*(i%6)) || row.Baseline != "memcpy" ||
			row.Gbps <= 0 || row.BaselineGbps <= 0 || math.Abs(row.Ratio-row.Gbps/row.BaselineGbps) > 1e-9*row.Ratio {
			t.Fatalf("row %d: %+v", i, row)
		}
	}
	if code, _, _ := runCLI(t, "bench"); code != 2 {
		t.Fatalf("bench without a target: exit %d", code)
	}
	if code, _, errOut := runCLI(t, "bench", "transfer", "--provider", "verbs"); code != 2 || !strings.Contains(errOut, "-tags verbs") {
		t.Fatalf("verbs in a plain build: exit %d, %q", code, errOut)
	}
}

// --coverage --json adds one row per action and branch; at the verification
// bounds of the CI gate every verification check fires.
func TestCheckCoverageJSON(t *testing.T) {
	code, out, errOut := runCLI(t, "check", "--json", "--coverage", "--page-size", "2", "--pages", "4", "--prefill-pages", "4",
		"--prompts", "4,4", "--faults", "corrupt", "--damage", "tag,send")
	if code != 0 {
		t.Fatalf("exit %d\n%s\n%s", code, out, errOut)
	}
	var r struct {
		Result   string
		Coverage []struct {
			Kind, Name string
			Count      uint64
		}
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	fired := map[string]uint64{}
	for _, row := range r.Coverage {
		fired[row.Kind+" "+row.Name] = row.Count
	}
	for _, d := range []string{"verify-tokens", "verify-pages", "verify-tag-request", "verify-tag-index", "verify-tag-epoch",
		"verify-checksum-first", "verify-checksum-later", "admit-grant-mismatch"} {
		if fired["defense "+d] == 0 {
			t.Errorf("defense %s: %d", d, fired["defense "+d])
		}
	}
	if fired["action Submit"] == 0 || fired["redundant read-epoch"] != 0 {
		t.Errorf("coverage %v", fired)
	}
	if code, _, _ := runCLI(t, "check", "--coverage", "--need-all", "--bug", "no-checksum", "--quiet"); code != 2 {
		t.Errorf("--coverage with --need-all: exit %d, want 2", code)
	}
}
