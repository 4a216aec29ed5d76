package main

import (
	"bytes"
	"encoding/json"
	"testing"
)

type demoJSON struct {
	Requests     int     `json:"requests"`
	OK           int     `json:"ok"`
	Rejected     int     `json:"rejected"`
	Cancelled    int     `json:"cancelled"`
	Failed       int     `json:"failed"`
	Coherent     int     `json:"coherent"`
	Incoherent   int     `json:"incoherent"`
	Leaks        int     `json:"leaks"`
	PagesLeaked  int     `json:"pages_leaked"`
	Seconds      float64 `json:"seconds"`
	HandoffsPerS float64 `json:"handoffs_per_s"`
	LeakExamples []struct {
		Request       string `json:"request"`
		Tenant        string `json:"tenant"`
		ForeignTenant string `json:"foreign_tenant"`
		Text          string `json:"text"`
	} `json:"leak_examples"`
}

func runDemoJSON(t *testing.T, args ...string) (int, demoJSON) {
	t.Helper()
	var out, errb bytes.Buffer
	rc := run(append([]string{"demo", "--json"}, args...), &out, &errb)
	var got demoJSON
	if err := json.Unmarshal(out.Bytes(), &got); err != nil {
		t.Fatalf("demo %v: exit %d, %v in %q; stderr %s", args, rc, err, out.String(), errb.String())
	}
	return rc, got
}

// The default deployment under faults: every success is the colocated
// run's answer, every other outcome explicit, no leak, no page left, and
// the workload really has over-long prompts and clients that go away.
func TestDemoWithEveryDefenseOnLeaksNothingUnderFaults(t *testing.T) {
	n := 400
	if testing.Short() {
		n = 150
	}
	rc, got := runDemoJSON(t, "--requests", itoa(n))
	if rc != 0 || got.Leaks != 0 || got.Incoherent != 0 || got.PagesLeaked != 0 {
		t.Fatalf("exit %d: %+v", rc, got)
	}
	if got.Requests != n || got.Rejected == 0 || got.Cancelled == 0 || got.OK == 0 || got.Coherent != got.OK {
		t.Fatalf("the workload lacks an outcome: %+v", got)
	}
	if got.OK+got.Rejected+got.Cancelled+got.Failed != n {
		t.Fatalf("outcomes do not add up: %+v", got)
	}
}

func itoa(n int) string {
	b, _ := json.Marshal(n)
	return string(b)
}
