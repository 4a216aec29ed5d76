package node

import (
	"crypto/ed25519"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// The prefix cache's scope (docs/nodes.md, "Prefix reuse"): a decode node
// shares cached prompt pages only between requests of one scope, and the
// router alone sets a request's scope, from the tenant the client API
// authenticated (tenant.go: an API key, or a trusted front proxy's X-Tenant),
// never from the request: a body naming one is refused, and a tenant the
// router did not authenticate gets no scope at all.

// PublicPrefix is a prompt prefix every tenant may share (a system prompt
// the deployment declares): its pages are cached under a scope of their
// own, "public:"+Name.
type PublicPrefix struct {
	Name string
	Text string
}

// ErrScopeInBody: a request body names a cache scope (the router sets it
// from the authenticated tenant; taking it from the body is the
// client-scope bug).
var ErrScopeInBody = errors.New("node: a request never names its cache scope")

// scopeFields are the body fields that would name a request's cache scope
// (vLLM's cache_salt among them): each is refused with a 400.
var scopeFields = []string{"cache_salt", "scope"}

// ScopeKeyFromTicketKey derives a router's scope key from its ticket key:
// every router of a deployment shares the ticket key, so they give a tenant
// the same scope, and no other secret is to be distributed.
func ScopeKeyFromTicketKey(key ed25519.PrivateKey) []byte {
	m := hmac.New(sha256.New, key.Seed())
	m.Write([]byte("kvhandoff/scope-key/v1"))
	return m.Sum(nil)
}

// scopeOf is the first 8 bytes of HMAC-SHA256(key, kind+":"+name): a
// scope no one without the key can compute or aim at. Never 0 (0 is "no
// reuse").
func scopeOf(key []byte, kind, name string) protocol.Scope {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(kind + ":" + name))
	s := protocol.Scope(binary.BigEndian.Uint64(m.Sum(nil)))
	if s == 0 {
		s = 1
	}
	return s
}

// scopes is the router's scope rule: a key and the declared public
// prefixes, as tokens.
type scopes struct {
	key    []byte
	public []publicScope // longest first
}

type publicScope struct {
	name   string
	tokens []int // BOS first
	scope  protocol.Scope
}

func newScopes(key []byte, public []PublicPrefix, tok llama.Tokenizer) (*scopes, error) {
	s := &scopes{key: key}
	seen := map[string]bool{}
	for _, p := range public {
		if p.Name == "" || p.Text == "" || seen[p.Name] {
			return nil, fmt.Errorf("node: a public prefix needs a name of its own and a text (got %q)", p.Name)
		}
		if err := checkTenant(p.Name); err != nil {
			return nil, fmt.Errorf("node: public prefix %q: a name of letters, digits and . _ - : only, at most %d bytes", p.Name, maxTenantLen)
		}
		if err := tok.Check(p.Text); err != nil {
			return nil, fmt.Errorf("node: public prefix %q: %w", p.Name, err)
		}
		seen[p.Name] = true
		s.public = append(s.public, publicScope{name: p.Name, tokens: tok.Encode(p.Text, true, false), scope: scopeOf(key, "public", p.Name)})
	}
	slices.SortStableFunc(s.public, func(a, b publicScope) int { return len(b.tokens) - len(a.tokens) })
	return s, nil
}

// label is a scope's name in metrics: "public:NAME" for a declared public
// scope, "tenant" for any other (a closed label set: never a tenant's name
// or hash).
func (s *scopes) label(sc protocol.Scope) string {
	for _, p := range s.public {
		if p.scope == sc {
			return "public:" + p.name
		}
	}
	return "tenant"
}

// publicPages is how many full pages the public prefix labelled label
// covers (0 for "tenant", or no scopes).
func (s *scopes) publicPages(label string, pageTokens int) int {
	if s == nil || pageTokens < 1 {
		return 0
	}
	for _, p := range s.public {
		if label == "public:"+p.name {
			return len(p.tokens) / pageTokens
		}
	}
	return 0
}

// of is a request's scope and chain: tenant's scope and the prompt's
// protocol.PrefixChain, or, for a prompt that starts with a declared public
// prefix covering at least one full page, that prefix's public scope and a
// chain that is PrefixChain's over the prefix's full pages and, past them,
// salted with the tenant's scope: every tenant's requests share the public
// pages, and only the tenant's own share the pages past them.
func (s *scopes) of(tenant string, prompt []int, pageTokens int) (protocol.Scope, []protocol.ChainHash, string) {
	tenantScope := scopeOf(s.key, "tenant", tenant)
	toks := make([]uint32, len(prompt))
	for i, t := range prompt {
		toks[i] = uint32(t)
	}
	for _, p := range s.public {
		full := len(p.tokens) / pageTokens
		if full == 0 || len(prompt) < len(p.tokens) || !slices.Equal(prompt[:len(p.tokens)], p.tokens) {
			continue
		}
		chain := protocol.PrefixChain(toks[:full*pageTokens], pageTokens)
		return p.scope, saltedChain(chain, toks, pageTokens, tenantScope), "public:" + p.name
	}
	return tenantScope, protocol.PrefixChain(toks, pageTokens), "tenant"
}

// saltedChain continues chain (the hashes of the first len(chain) pages)
// over the rest of toks' full pages, each hash over the one before, salt,
// and the page's tokens (as 4-byte big-endian, as PrefixChain's): pages
// past a public prefix are keyed by their tenant too.
func saltedChain(chain []protocol.ChainHash, toks []uint32, pageTokens int, salt protocol.Scope) []protocol.ChainHash {
	n := len(toks) / pageTokens
	buf := make([]byte, 0, len(protocol.ChainHash{})+8+4*pageTokens)
	for i := len(chain); i < n; i++ {
		buf = append(buf[:0], chain[i-1][:]...)
		buf = binary.BigEndian.AppendUint64(buf, uint64(salt))
		for _, t := range toks[i*pageTokens : (i+1)*pageTokens] {
			buf = binary.BigEndian.AppendUint32(buf, t)
		}
		sum := sha256.Sum256(buf)
		chain = append(chain, protocol.ChainHash(sum[:len(protocol.ChainHash{})]))
	}
	return chain
}

// chainDigest is what a ticket binds of a chain: SHA-256 over its hashes,
// concatenated; zero for no chain (a request of scope 0).
func chainDigest(chain []protocol.ChainHash) [32]byte {
	if len(chain) == 0 {
		return [32]byte{}
	}
	h := sha256.New()
	for _, c := range chain {
		h.Write(c[:])
	}
	var d [32]byte
	h.Sum(d[:0])
	return d
}

// scopeParam refuses a body field naming a scope.
func scopeParam(name string) *RequestError {
	return &RequestError{Param: name, Code: "scope_not_allowed", Err: ErrScopeInBody,
		Message: strings.Join([]string{name, ": a request never names its cache scope; the deployment sets it from the authenticated tenant"}, "")}
}
