package preflight

import (
	"errors"
	"strings"
	"testing"
)

func incident(pool int) Deployment {
	return Deployment{ContextTokens: 1048576, Nodes: []Node{
		{Name: "router", Role: RoleRouter},
		{Name: "prefill-0", Role: RolePrefill, PoolTokens: pool, PageTokens: 16, Model: "m"},
		{Name: "decode-0", Role: RoleDecode, PoolPages: 131072, PageTokens: 16, Model: "m"},
	}}
}

func TestAPoolShorterThanTheContextIsNamed(t *testing.T) {
	ps := Check(incident(681280))
	if len(ps) != 1 || ps[0].Kind != ShortPool || ps[0].Nodes[0] != "prefill-0" {
		t.Fatalf("problems %v, want the one short pool prefill-0", ps)
	}
	for _, want := range []string{"prefill-0", "681,280", "1,048,576"} {
		if !strings.Contains(ps[0].Message, want) {
			t.Errorf("message %q does not name %s", ps[0].Message, want)
		}
	}
	if ps := Check(incident(2097152)); len(ps) != 0 {
		t.Fatalf("a pool larger than the context: problems %v", ps)
	}
	if ps := Check(incident(1048576)); len(ps) != 0 {
		t.Fatalf("a pool exactly the context: problems %v", ps)
	}
}

func TestEveryPairWithADifferentPageSizeOrModelIsNamed(t *testing.T) {
	d := Deployment{ContextTokens: 64, Nodes: []Node{
		{Name: "p0", Role: RolePrefill, PoolTokens: 64, PageTokens: 16, PageBytes: 4096, Model: "a"},
		{Name: "p1", Role: RolePrefill, PoolTokens: 64, PageTokens: 16, PageBytes: 8192, Model: "a"},
		{Name: "d0", Role: RoleDecode, PoolTokens: 64, PageTokens: 16, Model: "b"},
	}}
	got := map[string]bool{}
	for _, p := range Check(d) {
		got[string(p.Kind)+":"+strings.Join(p.Nodes, ",")] = true
	}
	want := []string{"page-size-mismatch:p0,p1", "model-mismatch:p0,d0", "model-mismatch:p1,d0"}
	for _, w := range want {
		if !got[w] {
			t.Errorf("missing %s in %v", w, got)
		}
	}
	if len(got) != len(want) {
		t.Errorf("problems %v, want exactly %v (page bytes unknown on d0 are not compared)", got, want)
	}
}

func TestADeploymentWithoutBothRolesFails(t *testing.T) {
	ps := Check(Deployment{ContextTokens: 16, Nodes: []Node{{Name: "p", Role: RolePrefill, PoolTokens: 16, PageTokens: 16}}})
	if len(ps) != 1 || ps[0].Kind != MissingRole || !strings.Contains(ps[0].Message, "decode") {
		t.Fatalf("problems %v, want the missing decode role", ps)
	}
}

func TestParseReadsYAMLAndJSONAndRefusesUnknownFields(t *testing.T) {
	y := "context_tokens: 1048576\nnodes:\n  - {name: prefill-0, role: prefill, pool_tokens: 681280, page_tokens: 16, model: m}\n  - {name: decode-0, role: decode, pool_pages: 131072, page_tokens: 16, model: m}\n"
	d, err := Parse([]byte(y))
	if err != nil {
		t.Fatal(err)
	}
	if ps := Check(d); len(ps) != 1 || ps[0].Nodes[0] != "prefill-0" {
		t.Fatalf("YAML: problems %v", ps)
	}
	j := `{"context_tokens": 32, "nodes": [{"name": "p", "role": "prefill", "pool_tokens": 32, "page_tokens": 16, "model": "m"}, {"name": "d", "role": "decode", "pool_tokens": 32, "page_tokens": 16, "model": "m"}]}`
	if d, err := Parse([]byte(j)); err != nil || len(Check(d)) != 0 {
		t.Fatalf("JSON: %v, %v", err, Check(d))
	}
	for _, bad := range []string{
		"context_tokens: 8\nnodes:\n  - {name: p, role: prefill, pool_tokenz: 8, page_tokens: 4}\n",
		"nodes:\n  - {name: p, role: cook, pool_tokens: 8, page_tokens: 4}\n",
		"nodes:\n  - {name: p, role: prefill, pool_tokens: 8, page_tokens: 0}\n",
		"nodes:\n  - {name: p, role: prefill, pool_tokens: 8, page_tokens: 4}\n  - {name: p, role: decode, pool_tokens: 8, page_tokens: 4}\n",
		"{",
	} {
		if _, err := Parse([]byte(bad)); !errors.Is(err, ErrDeployment) {
			t.Errorf("Parse(%q) = %v, want ErrDeployment", bad, err)
		}
	}
}
