package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/etcdtest"
	"github.com/kvhandoff/kvhandoff/node"
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

// preflight --etcd reads what the running nodes registered and names the
// short pool among them.
func TestPreflightReadsTheNodesRegisteredInEtcd(t *testing.T) {
	addr := etcdtest.Start(t)
	reg, err := node.NewEtcd([]string{addr}, "/kvhandoff/nodes/", 5*time.Second, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for _, m := range []node.Member{
		{Name: "prefill-0", Role: node.RolePrefill, Control: "127.0.0.1:1", PoolPages: 42580, PageTokens: 16, PageBytes: 4096, ContextTokens: 1048576, Model: "m"},
		{Name: "decode-0", Role: node.RoleDecode, Control: "127.0.0.1:2", Transfer: "127.0.0.1:3", PoolPages: 131072, PageTokens: 16, PageBytes: 4096, ContextTokens: 1048576, Model: "m"},
	} {
		if _, err := reg.Register(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	var out, errb bytes.Buffer
	if rc := run([]string{"preflight", "--etcd", addr}, &out, &errb); rc != 1 {
		t.Fatalf("exit %d, want 1; stdout %s stderr %s", rc, out.String(), errb.String())
	}
	if !strings.Contains(errb.String(), "prefill pool of prefill-0 holds 681,280 tokens, fewer than the context length of 1,048,576") || strings.Contains(errb.String(), "decode-0 holds") {
		t.Fatalf("stderr does not name exactly the short pool:\n%s", errb.String())
	}
}
