package node

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/llama"
)

// cachedAnswer is a completion's text and the prompt tokens its usage says
// came from the prefix cache.
type cachedAnswer struct {
	code   int
	text   string
	cached int
}

func completeCached(t *testing.T, api, tenant, prompt string, maxTokens int) cachedAnswer {
	t.Helper()
	a := call(t, "POST", "http://"+api+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": maxTokens}, map[string]string{TenantHeader: tenant})
	out := cachedAnswer{code: a.code}
	if choices, _ := a.body["choices"].([]any); len(choices) == 1 {
		out.text, _ = choices[0].(map[string]any)["text"].(string)
	}
	if u, _ := a.body["usage"].(map[string]any); u != nil {
		if d, _ := u["prompt_tokens_details"].(map[string]any); d != nil {
			c, _ := d["cached_tokens"].(float64)
			out.cached = int(c)
		}
	}
	if a.code != http.StatusOK {
		t.Fatalf("tenant %s: %d %q", tenant, a.code, a.raw)
	}
	return out
}

// Prefix reuse end to end, over the handoff, with the model: a tenant's
// second request whose prompt starts with its first's pages reads them from
// the decode node's cache (its usage says how many tokens); another tenant
// with the very same prompt gets none of them (its own scope); a declared
// public prefix is shared by every tenant, its pages only: a tenant whose
// whole prompt is another's gets the public pages and not the rest, and
// past them only pages of its own requests. Every
// answer equals the colocated run's, and the decode node's metrics count
// the hits by scope label (public:NAME, tenant), never by tenant: the
// public pages' tokens under public:NAME, a tenant's own pages past them
// under tenant (they are cached under the public scope, salted with the
// tenant's: counted as public they would say 176 tokens where 96 were).
func TestPrefixReuseStaysWithinTheTenantsScope(t *testing.T) {
	const pageTokens = 16
	m := llama.Builtin(1)
	public := "System: answer with the key, exactly as it was given to you, and nothing more than the key. "
	l, err := StartLocal(LocalConfig{Decodes: 1, PrefillPages: 64, DecodePages: 64, PageTokens: pageTokens, Model: m, Timeout: time.Minute, Log: quietLog(),
		PrefixCache: true, TrustTenantHeader: true, PublicPrefixes: []PublicPrefix{{Name: "desk", Text: public}}})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	system := "Key is Q 7hXk-29Lm-pqRz. Account of the archive, kept for years. The notes are in order. "
	first := system + "First visit. Later: the key is Q "
	second := system + "Second visit, other words. Later: the key is Q "
	full := func(text string) int { return (1 + len(text)) / pageTokens * pageTokens } // BOS and bytes, whole pages
	check := func(who, tenant, prompt string, want int) {
		t.Helper()
		a := completeCached(t, l.API, tenant, prompt, 12)
		if a.cached != want {
			t.Errorf("%s: %d prompt tokens from the cache, want %d", who, a.cached, want)
		}
		if w := colocated(t, m, pageTokens, prompt, 12); a.text != w {
			t.Errorf("%s: %q over the handoff, %q colocated", who, a.text, w)
		}
	}
	check("tenant a's first request", "tenant-a", first, 0)
	check("tenant a's second request", "tenant-a", second, full(system))
	check("tenant b, tenant a's very prompt", "tenant-b", second, 0)
	again := full(second) - pageTokens*boolInt((1+len(second))%pageTokens == 0)
	check("tenant b again", "tenant-b", second, again)
	check("tenant a, the public prefix", "tenant-a", public+first, 0)
	check("tenant b, the public prefix and tenant a's words", "tenant-b", public+first, full(public))
	check("tenant b, the public prefix and its own second visit", "tenant-b", public+second, full(public+system)) // its own pages past the public ones
	dec := l.Decodes[0].Metrics()
	rec := httptest.NewRecorder()
	dec.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	scrape := rec.Body.String()
	// The public pages' tokens under public:desk, a tenant's own past them
	// under tenant (with the hit: its last reused page is the tenant's).
	publicTok := 2 * full(public)
	tenantTok := full(system) + again + full(public+system) - full(public)
	for _, want := range []string{`kvhandoff_prefix_hits_total{role="decode",scope="public:desk"} 1`, `kvhandoff_prefix_hits_total{role="decode",scope="tenant"} 3`,
		fmt.Sprintf(`kvhandoff_prefix_hit_tokens_total{role="decode",scope="public:desk"} %d`, publicTok),
		fmt.Sprintf(`kvhandoff_prefix_hit_tokens_total{role="decode",scope="tenant"} %d`, tenantTok),
		`kvhandoff_prefix_cached_pages{role="decode",scope="public:desk"}`, `kvhandoff_prefix_cached_pages{role="decode",scope="tenant"}`, `kvhandoff_prefix_evictions_total{role="decode"} 0`,
		`kvhandoff_prefix_purged_pages_total{role="decode"} 0`} {
		if !strings.Contains(scrape, want) {
			t.Errorf("the decode node's /metrics has no %s", want)
		}
	}
	if strings.Contains(scrape, "tenant-a") || strings.Contains(scrape, "tenant-b") {
		t.Error("a tenant's name is a metrics label")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if !waitPagesBack(ctx, l.Decodes[0].Endpoint().Gauges) {
		t.Fatalf("pages still owned: %+v", l.Decodes[0].Endpoint().Gauges())
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}
