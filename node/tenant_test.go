package node

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// cachedTokens is usage.prompt_tokens_details.cached_tokens of an answer.
func cachedTokens(a apiAnswer) int {
	if u, _ := a.body["usage"].(map[string]any); u != nil {
		if d, _ := u["prompt_tokens_details"].(map[string]any); d != nil {
			c, _ := d["cached_tokens"].(float64)
			return int(c)
		}
	}
	return 0
}

// A tenant the router did not authenticate gets no cache scope: a client
// that names another tenant in X-Tenant (nothing else of the victim's)
// reads none of its cached prefix, and is not told whether it exists
// (cached_tokens would be an exact oracle of another tenant's prompts,
// CVE-2025-46570's without the timing). Without an API key or a trusted
// front proxy, the header is a label for the logs.
func TestAClientNamingAnotherTenantGetsNoneOfItsCachedPrefix(t *testing.T) {
	const pageTokens = 16
	l, err := StartLocal(LocalConfig{Decodes: 1, PrefillPages: 64, DecodePages: 64, PageTokens: pageTokens, Model: llama.Builtin(1), Timeout: time.Minute, Log: quietLog(),
		PrefixCache: true})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	secret := "Patient 4411: diagnosis confidential, reference HX-22-981, seen by the clinic on the day. "
	completeCached(t, l.API, "victim", secret+"Summary:", 4)
	a := call(t, "POST", "http://"+l.API+"/v1/completions", map[string]any{"prompt": secret + "Guess:", "max_tokens": 4},
		map[string]string{TenantHeader: "victim"})
	if a.code != http.StatusOK {
		t.Fatalf("%d %s", a.code, a.raw)
	}
	if c := cachedTokens(a); c != 0 {
		t.Fatalf("a client that only set %s: victim read %d of the victim's cached prompt tokens", TenantHeader, c)
	}
}

// With API keys the key names the tenant: a request without one, or with
// a key not on the list, is a 401 in the OpenAI shape; a header naming
// another tenant than the key's is a 400; a tenant's second request reuses
// its first's pages, and another key's tenant with the very same prompt
// reuses none.
func TestAPIKeysNameTheTenant(t *testing.T) {
	const pageTokens = 16
	keys, err := ParseAPIKeys(strings.NewReader("# the deployment's keys\nkey-of-alice-0123456789 alice\nkey-of-bob-0123456789ab bob\n"))
	if err != nil {
		t.Fatal(err)
	}
	l, err := StartLocal(LocalConfig{Decodes: 1, PrefillPages: 64, DecodePages: 64, PageTokens: pageTokens, Model: llama.Builtin(1), Timeout: time.Minute, Log: quietLog(),
		PrefixCache: true, APIKeys: keys})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	url := "http://" + l.API + "/v1/completions"
	prompt := "Alice's notes: the meeting moved to Thursday, room 4, bring the quarterly figures. "
	ask := func(header map[string]string, suffix string) apiAnswer {
		return call(t, "POST", url, map[string]any{"prompt": prompt + suffix, "max_tokens": 4}, header)
	}
	for _, c := range []struct {
		name   string
		header map[string]string
	}{
		{"no key", nil},
		{"a key not on the list", map[string]string{"Authorization": "Bearer key-of-mallory-0123456"}},
		{"not a bearer key", map[string]string{"Authorization": "Basic a2V5LW9mLWFsaWNl"}},
	} {
		a := ask(c.header, "First.")
		e, _ := a.body["error"].(map[string]any)
		if a.code != http.StatusUnauthorized || e == nil || e["code"] != "invalid_api_key" {
			t.Errorf("%s: %d %s, want 401 invalid_api_key", c.name, a.code, a.raw)
		}
	}
	alice := map[string]string{"Authorization": "Bearer key-of-alice-0123456789"}
	if a := ask(alice, "First."); a.code != http.StatusOK || cachedTokens(a) != 0 {
		t.Fatalf("alice's first request: %d %s", a.code, a.raw)
	}
	a := ask(alice, "Second, in other words.")
	if a.code != http.StatusOK || cachedTokens(a) == 0 {
		t.Fatalf("alice's second request reused nothing of her first: %d %s", a.code, a.raw)
	}
	bob := map[string]string{"Authorization": "Bearer key-of-bob-0123456789ab"}
	if a := ask(bob, "Second, in other words."); a.code != http.StatusOK || cachedTokens(a) != 0 {
		t.Fatalf("bob, alice's very prompt: %d, %d cached tokens, want 200 and 0", a.code, cachedTokens(a))
	}
	bob[TenantHeader] = "alice"
	if a := ask(bob, "Second, in other words."); a.code != http.StatusBadRequest {
		t.Fatalf("bob's key with X-Tenant alice: %d %s, want 400", a.code, a.raw)
	}
}

func TestParseAPIKeysRefusesWhatItCannotTrust(t *testing.T) {
	for _, c := range []struct{ name, file string }{
		{"no key at all", "# nothing\n\n"},
		{"a key too short to be a secret", "short alice\n"},
		{"a key listed twice", "key-of-alice-0123456789 alice\nkey-of-alice-0123456789 bob\n"},
		{"a tenant the header could not carry", "key-of-alice-0123456789 al/ice\n"},
		{"three fields", "key-of-alice-0123456789 alice extra\n"},
	} {
		if _, err := ParseAPIKeys(strings.NewReader(c.file)); err == nil {
			t.Errorf("%s: accepted", c.name)
		}
	}
	k, err := ParseAPIKeys(strings.NewReader("  key-of-alice-0123456789   alice  \n"))
	if err != nil || k.Len() != 1 {
		t.Fatalf("%v, %v", k, err)
	}
	if tenant, ok := k.tenant("key-of-alice-0123456789"); !ok || tenant != "alice" {
		t.Fatalf("the key names %q, %v", tenant, ok)
	}
}

// A read that fails after Acquire (here: the node's own pages for the
// generated tokens are all taken) ends at Finish like any other: its fresh
// pages go back and its prefix pins are dropped. Without, every retry of
// the 503 leaked again, and the pinned cached pages could never be evicted.
func TestAFailedReadGivesBackItsPagesAndPins(t *testing.T) {
	const pageTokens = 16
	l, err := StartLocal(LocalConfig{Decodes: 1, PrefillPages: 64, DecodePages: 64, PageTokens: pageTokens, Model: llama.Builtin(1), Timeout: 10 * time.Second, Log: quietLog(),
		PrefixCache: true, TrustTenantHeader: true})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	system := "Key is Q 7hXk-29Lm-pqRz. Account of the archive, kept for years. The notes are in order. "
	completeCached(t, l.API, "tenant-a", system+"First visit. Later: the key is Q ", 4)
	dec := l.Decodes[0]
	hog := protocol.RequestID(1 << 62)
	table, err := dec.pool.Table(hog, nil, dec.pool.OwnFree()*pageTokens)
	if err != nil {
		t.Fatal(err)
	}
	a := call(t, "POST", "http://"+l.API+"/v1/completions", map[string]any{"prompt": system + "Second visit. Later: the key is Q ", "max_tokens": 40},
		map[string]string{TenantHeader: "tenant-a"})
	if a.code == http.StatusOK {
		t.Fatalf("the staging failed: the request succeeded with the node's own pages taken")
	}
	dec.pool.Release(hog, table)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if !waitPagesBack(ctx, dec.Endpoint().Gauges) {
		g := dec.Endpoint().Gauges()
		t.Fatalf("a read that failed after Acquire never gave its pages back: %d pages, %d free, %d cached", g.Pages, g.PagesFree, g.PagesCached)
	}
}
