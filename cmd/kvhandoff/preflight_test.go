package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestPreflightExitsNonZeroNamingTheShortPool(t *testing.T) {
	var out, errb bytes.Buffer
	if rc := run([]string{"preflight", "--context-len", "1048576", "--pool-tokens", "681280"}, &out, &errb); rc != 1 {
		t.Fatalf("exit %d, want 1; stderr %s", rc, errb.String())
	}
	if !strings.Contains(errb.String(), "prefill pool of prefill-0 holds 681,280 tokens") {
		t.Fatalf("stderr does not name the short pool:\n%s", errb.String())
	}
	out.Reset()
	errb.Reset()
	if rc := run([]string{"preflight", "--context-len", "1048576", "--pool-tokens", "2097152"}, &out, &errb); rc != 0 {
		t.Fatalf("exit %d, want 0; stderr %s", rc, errb.String())
	}
	if !strings.Contains(out.String(), "RDMA devices") || !strings.Contains(out.String(), "preflight: ok") {
		t.Fatalf("stdout lacks the devices or the verdict:\n%s", out.String())
	}
}

func TestPreflightReadsAFileAndReportsJSON(t *testing.T) {
	path := filepath.Join(t.TempDir(), "d.yaml")
	y := "context_tokens: 64\nnodes:\n  - {name: p0, role: prefill, pool_tokens: 64, page_tokens: 16, model: a}\n  - {name: d0, role: decode, pool_tokens: 64, page_tokens: 8, model: a}\n"
	if err := os.WriteFile(path, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	if rc := run([]string{"preflight", "--file", path, "--json"}, &out, &errb); rc != 1 {
		t.Fatalf("exit %d, want 1", rc)
	}
	var got struct {
		OK       bool `json:"ok"`
		Problems []struct {
			Kind  string   `json:"kind"`
			Nodes []string `json:"nodes"`
		} `json:"problems"`
	}
	if err := json.Unmarshal(out.Bytes(), &got); err != nil {
		t.Fatalf("%v in %s", err, out.String())
	}
	if got.OK || len(got.Problems) != 1 || got.Problems[0].Kind != "page-size-mismatch" {
		t.Fatalf("got %+v, want one page-size mismatch", got)
	}
	if rc := run([]string{"preflight", "--file", filepath.Join(t.TempDir(), "none")}, &out, &errb); rc != 2 {
		t.Fatalf("missing file: exit %d, want 2", rc)
	}
}
