package node

import (
	"bufio"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
)

// The client API's tenant (docs/nodes.md, "Tenants"): who the caller is,
// and whether the router knows it. Only an authenticated tenant gets a
// prefix cache scope (scope.go): a name any client can put in a header is a
// label for the logs, never a key to another tenant's cached prompts
// (a cross-tenant prefix hit is a side channel, and with cached_tokens in
// the usage an exact one). A tenant is authenticated by an API key
// (RouterConfig.APIKeys), or by the X-Tenant header where every client
// comes through a front proxy that authenticates and sets it
// (RouterConfig.TrustTenantHeader).

// ErrUnauthenticated: the router has API keys and the request carries none
// of them (401).
var ErrUnauthenticated = errors.New("node: no valid API key")

// minAPIKeyLen is the shortest API key a key file may hold: a key is the
// whole credential, so one short enough to guess is refused at start.
const minAPIKeyLen = 16

// APIKeys are the client API's bearer keys, each naming its tenant. Keys are
// kept as their SHA-256, so the lookup's time says nothing of how much of a
// guess matched.
type APIKeys struct {
	tenants map[[32]byte]string
}

// ParseAPIKeys reads a key file: one "KEY TENANT" a line, blank lines and
// lines starting with # ignored. A key is at least 16 bytes and appears
// once; a tenant is a valid X-Tenant value (letters, digits and . _ - :).
func ParseAPIKeys(r io.Reader) (*APIKeys, error) {
	k := &APIKeys{tenants: map[[32]byte]string{}}
	sc := bufio.NewScanner(r)
	for line := 1; sc.Scan(); line++ {
		text := strings.TrimSpace(sc.Text())
		if text == "" || strings.HasPrefix(text, "#") {
			continue
		}
		f := strings.Fields(text)
		if len(f) != 2 {
			return nil, fmt.Errorf("node: API keys, line %d: want \"KEY TENANT\", got %d fields", line, len(f))
		}
		if len(f[0]) < minAPIKeyLen {
			return nil, fmt.Errorf("node: API keys, line %d: a key of %d bytes, at least %d", line, len(f[0]), minAPIKeyLen)
		}
		if f[1] == "" || checkTenant(f[1]) != nil {
			return nil, fmt.Errorf("node: API keys, line %d: tenant %q: letters, digits and . _ - : only, at most %d bytes", line, f[1], maxTenantLen)
		}
		h := sha256.Sum256([]byte(f[0]))
		if _, dup := k.tenants[h]; dup {
			return nil, fmt.Errorf("node: API keys, line %d: a key listed twice", line)
		}
		k.tenants[h] = f[1]
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("node: API keys: %w", err)
	}
	if len(k.tenants) == 0 {
		return nil, errors.New("node: API keys: no key in the file")
	}
	return k, nil
}

// Len is the number of keys.
func (k *APIKeys) Len() int { return len(k.tenants) }

func (k *APIKeys) tenant(key string) (string, bool) {
	t, ok := k.tenants[sha256.Sum256([]byte(key))]
	return t, ok
}

// clientTenant is a request's tenant: its name (for the logs, and the scope
// when authenticated) and whether the router authenticated it.
type clientTenant struct {
	name          string
	authenticated bool
}

// tenantOf is the request's tenant. With API keys, the request's bearer key
// names it (no key or an unknown one: ErrUnauthenticated; an X-Tenant that
// names another tenant: a 400). Without, X-Tenant names it, authenticated
// only under TrustTenantHeader; no header is the tenant "default".
func (rt *Router) tenantOf(r *http.Request) (clientTenant, error) {
	header := r.Header.Get(TenantHeader)
	if err := checkTenant(header); err != nil {
		return clientTenant{}, &RequestError{Param: TenantHeader, Code: "invalid_tenant", Message: strings.TrimPrefix(err.Error(), ErrBadRequest.Error()+": "), Err: err}
	}
	if keys := rt.cfg.APIKeys; keys != nil {
		auth := r.Header.Get("Authorization")
		key, ok := strings.CutPrefix(auth, "Bearer ")
		if !ok {
			return clientTenant{}, fmt.Errorf("%w: the request carries no bearer key (Authorization: Bearer KEY)", ErrUnauthenticated)
		}
		t, ok := keys.tenant(strings.TrimSpace(key))
		if !ok {
			return clientTenant{}, fmt.Errorf("%w: the bearer key is not one of this deployment's", ErrUnauthenticated)
		}
		if header != "" && header != t {
			return clientTenant{}, &RequestError{Param: TenantHeader, Code: "invalid_tenant", Err: ErrBadRequest,
				Message: "the " + TenantHeader + " header names another tenant than the API key's"}
		}
		return clientTenant{name: t, authenticated: true}, nil
	}
	if header == "" {
		header = "default"
	}
	return clientTenant{name: header, authenticated: rt.cfg.TrustTenantHeader}, nil
}
