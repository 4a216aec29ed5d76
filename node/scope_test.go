package node

import (
	"slices"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// The scope rule: a request's scope is its authenticated tenant's (one
// tenant, one scope; two tenants, two), its chain the prompt's PrefixChain;
// a prompt starting with a declared public prefix is in the public scope,
// its chain PrefixChain's over the public pages (every tenant's alike) and
// salted with the tenant past them (only the tenant's own alike); a scope
// is never 0 with a key and always 0 without one.
func TestScopeIsTheTenantsAndAPublicPrefixSharesOnlyItsOwnPages(t *testing.T) {
	const pt = 16
	tok := llama.Bytes{}
	system := strings.Repeat("You are the deployment's assistant. ", 3) // 109 bytes: 6 full pages with BOS
	s, err := newScopes([]byte("key"), []PublicPrefix{{Name: "assistant", Text: system}}, tok)
	if err != nil {
		t.Fatal(err)
	}
	enc := func(text string) []int { return tok.Encode(text, true, false) }
	toU32 := func(p []int) []uint32 {
		out := make([]uint32, len(p))
		for i, x := range p {
			out[i] = uint32(x)
		}
		return out
	}
	plain := enc("A question of my own, long enough to fill a few pages of sixteen tokens each.")
	a1, chainA, la := s.of("tenant-a", plain, pt)
	a2, chainA2, _ := s.of("tenant-a", plain, pt)
	b, chainB, _ := s.of("tenant-b", plain, pt)
	if a1 == 0 || a1 != a2 || a1 == b || la != "tenant" {
		t.Fatalf("tenant scopes: a %#x, a again %#x, b %#x (%s)", a1, a2, b, la)
	}
	if want := protocol.PrefixChain(toU32(plain), pt); !slices.Equal(chainA, want) || !slices.Equal(chainA2, want) || !slices.Equal(chainB, want) {
		t.Fatal("a tenant's chain is not the prompt's PrefixChain")
	}
	pa := enc(system + "Tenant a's own question, which is theirs alone and long.")
	pb := enc(system + "Tenant a's own question, which is theirs alone and long.") // the same words, by tenant b
	sa, ca, label := s.of("tenant-a", pa, pt)
	sb, cb, _ := s.of("tenant-b", pb, pt)
	sa2, ca2, _ := s.of("tenant-a", pa, pt)
	if sa2 != sa {
		t.Fatal("one tenant, one public prompt, two scopes")
	}
	full := len(enc(system)) / pt
	if sa != sb || sa == a1 || label != "public:assistant" || s.label(sa) != "public:assistant" || s.label(a1) != "tenant" {
		t.Fatalf("public scope: a %#x b %#x (%s)", sa, sb, label)
	}
	if len(ca) != len(pa)/pt || len(ca) <= full || !slices.Equal(ca[:full], cb[:full]) || !slices.Equal(ca, ca2) {
		t.Fatalf("public chains: %d hashes, %d public pages", len(ca), full)
	}
	if !slices.Equal(ca[:full], protocol.PrefixChain(toU32(pa[:full*pt]), pt)) {
		t.Fatal("the public pages' chain is not PrefixChain's")
	}
	for i := full; i < len(ca); i++ {
		if ca[i] == cb[i] {
			t.Fatalf("page %d past the public prefix: tenant a's and b's chains agree", i)
		}
	}
	// Shorter than a page: no public page to share, the tenant's scope.
	tiny, err := newScopes([]byte("key"), []PublicPrefix{{Name: "hi", Text: "Hi."}}, tok)
	if err != nil {
		t.Fatal(err)
	}
	if sc, _, l := tiny.of("tenant-a", enc("Hi. And a question."), pt); sc != a1 || l != "tenant" {
		t.Fatalf("a public prefix shorter than a page: scope %#x %s", sc, l)
	}
	for _, bad := range [][]PublicPrefix{{{Name: "", Text: "x"}}, {{Name: "x", Text: ""}}, {{Name: "a b", Text: "x"}}, {{Name: "x", Text: "y"}, {Name: "x", Text: "z"}}} {
		if _, err := newScopes([]byte("key"), bad, tok); err == nil {
			t.Errorf("public prefixes %+v taken", bad)
		}
	}
	// The router: no key, no scope.
	rt := &Router{}
	if sc, chain, _ := rt.scopeOf(Completion{Tenant: "tenant-a"}, plain, pt); sc != 0 || chain != nil {
		t.Fatalf("without a key: scope %#x, %d hashes", sc, len(chain))
	}
}

// A request body naming a scope (vLLM's cache_salt, or scope) is refused
// with a 400 naming it, whatever it names; under client-scope the router
// takes it, and the request's scope is the named tenant's, not its own.
func TestARequestNamingItsScopeIsRefused(t *testing.T) {
	rt, api := frontDoor(t, HTTPLimits{}, 1024)
	base := "http://" + api
	for _, field := range scopeFields {
		for _, v := range []any{"tenant-1", 7, map[string]any{"x": 1}} {
			a := call(t, "POST", base+"/v1/completions", map[string]any{"prompt": "hi", field: v}, map[string]string{TenantHeader: "tenant-2"})
			e := errorOf(t, a)
			if a.code != 400 || e["param"] != field || e["code"] != "scope_not_allowed" {
				t.Errorf("%s %v: %d %q", field, v, a.code, a.raw)
			}
		}
		a := call(t, "POST", base+"/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "user", "content": "hi"}}, field: "tenant-1"}, nil)
		if e := errorOf(t, a); a.code != 400 || e["param"] != field {
			t.Errorf("chat %s: %d %q", field, a.code, a.raw)
		}
	}
	// client-scope: the body's word is taken.
	rt.cfg.Research = research.On(research.ClientScope)
	a := call(t, "POST", base+"/v1/completions", map[string]any{"prompt": "hi", "max_tokens": 1, "cache_salt": "tenant-1"}, map[string]string{TenantHeader: "tenant-2"})
	if e, _ := a.body["error"].(map[string]any); a.code == 400 && e["param"] == "cache_salt" {
		t.Fatalf("under client-scope the body's scope is refused: %q", a.raw)
	}
	// The scopes themselves, on routers of their own: the one above may
	// still be calling the nodes it dispatched that request to.
	scopes, err := newScopes([]byte("key"), nil, llama.Bytes{})
	if err != nil {
		t.Fatal(err)
	}
	buggy := &Router{cfg: RouterConfig{Research: research.On(research.ClientScope)}, scopes: scopes}
	fixed := &Router{scopes: scopes}
	prompt := llama.Bytes{}.Encode("a prompt of a few pages, a prompt of a few pages", true, false)
	victim, _, _ := buggy.scopeOf(Completion{Tenant: "tenant-1", Authenticated: true}, prompt, 16)
	hostile, _, _ := buggy.scopeOf(Completion{Tenant: "tenant-2", Authenticated: true, BodyScope: "tenant-1"}, prompt, 16)
	own, _, _ := fixed.scopeOf(Completion{Tenant: "tenant-2", Authenticated: true, BodyScope: "tenant-1"}, prompt, 16)
	if hostile != victim || own == victim {
		t.Fatalf("client-scope: the hostile request's scope %#x, the victim's %#x, without the bug %#x", hostile, victim, own)
	}
}
