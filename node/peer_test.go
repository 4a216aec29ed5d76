package node

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// rogue is a prefill endpoint of the test's own on a deployment's fabric:
// a process holding a certificate the deployment's authority signed.
type rogue struct {
	t   *testing.T
	ep  *transfer.Prefill
	out map[protocol.RequestID]error
}

func newRogue(t *testing.T, ctx context.Context, l *Local, name string) *rogue {
	t.Helper()
	ep, err := transfer.NewPrefill(l.fabric.Device(name), transfer.PrefillConfig{Pages: 2048, PageTokens: l.cfg.PageTokens, PageBytes: l.cfg.PageBytes})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ep.Close)
	go ep.Run(ctx)
	return &rogue{t: t, ep: ep, out: map[protocol.RequestID]error{}}
}

// dial connects the rogue to decode-0 as name, with a certificate of role.
func (r *rogue) dial(ctx context.Context, l *Local, name string, role pki.Role) error {
	tc, err := l.ca.ConfigAs(name, role)
	if err != nil {
		r.t.Fatal(err)
	}
	d := l.Decodes[0]
	d.mu.Lock()
	addr := d.self.Transfer
	d.mu.Unlock()
	return r.ep.Dial(ctx, "decode-0", addr, transfer.SetupConfig{Name: name, TLS: tc, Timeout: 5 * time.Second, Log: quietLog()})
}

// wait collects the outcomes of ids.
func (r *rogue) wait(ids ...protocol.RequestID) {
	r.t.Helper()
	deadline := time.After(30 * time.Second)
	for {
		missing := 0
		for _, id := range ids {
			if _, ok := r.out[id]; !ok {
				missing++
			}
		}
		if missing == 0 {
			return
		}
		select {
		case <-r.ep.Notify():
			for _, ev := range r.ep.Events() {
				if ev.Kind == transfer.Outcome {
					r.out[ev.Request] = ev.Err
				}
			}
		case <-deadline:
			r.t.Fatalf("%d outcomes missing after 30 s", missing)
		}
	}
}

// floodDeployment is the issue's: one decode node of 1,024 pages of 16
// tokens, which 16 Bootstraps of 1,024 tokens fill.
func floodDeployment(t *testing.T, cfg LocalConfig) *Local {
	t.Helper()
	cfg.DecodePages, cfg.PageTokens, cfg.Timeout, cfg.Log = 1024, 16, 20*time.Second, quietLog()
	l, err := StartLocal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Stop)
	return l
}

// The issue's flood: 16 Bootstraps of 1,024 tokens. From a certificate
// named intruder (a prefill certificate the authority signed, a name the
// registry does not list) it never gets a queue pair; from a prefill node
// the registry lists (prefill-9: a compromised node, or a leaked key)
// without tickets, or with tickets forged, expired, for another decode
// node, given to another prefill node, for other token counts, or
// replayed, each Bootstrap is refused with AbortUnauthorized and the
// decode node's 1,024 pages stay free. With unticketed-bootstrap on the
// same flood reserves the whole pool.
func TestUnticketedFloodFromAnIntruderReservesNothing(t *testing.T) {
	for _, bug := range []bool{false, true} {
		t.Run(fmt.Sprintf("unticketed-bootstrap=%v", bug), func(t *testing.T) {
			var sw research.Switches
			if bug {
				sw = research.On(research.UnticketedBootstrap)
			}
			l := floodDeployment(t, LocalConfig{Research: sw})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if err := newRogue(t, ctx, l, "intruder").dial(ctx, l, "intruder", pki.RolePrefill); !errors.Is(err, transfer.ErrSetup) {
				t.Fatalf("intruder connected a queue pair: %v", err)
			}
			if err := newRogue(t, ctx, l, "decode-7").dial(ctx, l, "prefill-0", pki.RoleDecode); !errors.Is(err, transfer.ErrSetup) {
				t.Fatalf("a decode certificate connected as prefill-0: %v", err)
			}
			// A prefill node the registry lists.
			if _, err := l.Registry.Register(ctx, Member{Name: "prefill-9", Role: RolePrefill, PoolPages: 2048, PageTokens: 16, PageBytes: l.cfg.PageBytes,
				Model: "other-model"}); err != nil { // another model: the router sends it nothing of its own
				t.Fatal(err)
			}
			r := newRogue(t, ctx, l, "prefill-9")
			if err := r.dial(ctx, l, "prefill-9", pki.RolePrefill); err != nil {
				t.Fatal(err)
			}
			_, otherKey, _ := pki.NewTicketKey()
			now := time.Now()
			ticket := func(i int) []byte {
				tk := Ticket{Request: protocol.RequestID(1000 + i), Tokens: 1024, Prefill: "prefill-9", Decode: "decode-0", Expires: now.Add(time.Minute)}
				key := l.ticketKey
				switch i % 7 {
				case 0:
					return nil
				case 1:
					key = otherKey
				case 2:
					tk.Expires = now.Add(-time.Minute)
				case 3:
					tk.Decode = "decode-1"
				case 4:
					tk.Prefill = "prefill-0"
				case 5:
					tk.Tokens = 16
				case 6:
					tk.Request = 999 // request 999's: replayed below for 1006, 1013
				}
				b, err := SignTicket(key, tk)
				if err != nil {
					t.Fatal(err)
				}
				return b
			}
			var ids []protocol.RequestID
			for i := range 16 {
				id := protocol.RequestID(1000 + i)
				ids = append(ids, id)
				if err := r.ep.SubmitTicket(id, "decode-0", 1024, ticket(i)); err != nil {
					t.Fatal(err)
				}
			}
			r.wait(ids...)
			free := l.Decodes[0].Endpoint().Stats().PagesFree
			if bug {
				if free != 0 {
					t.Fatalf("with the defense off the flood left %d of 1,024 pages free; the attack should hold them all", free)
				}
				return
			}
			for _, id := range ids {
				if err := r.out[id]; !errors.Is(err, protocol.AbortUnauthorized) {
					t.Errorf("request %d: %v, want AbortUnauthorized", id, err)
				}
			}
			if free != 1024 {
				t.Fatalf("the flood reserved %d of 1,024 pages", 1024-free)
			}
			// The deployment serves on.
			res, err := l.Router.Complete(ctx, Completion{Prompt: "still serving", MaxTokens: 4})
			if err != nil {
				t.Fatalf("after the flood: %v", err)
			}
			t.Logf("after the flood: %q from %s to %s", res.Text, res.Prefill, res.Decode)
		})
	}
}

// A prefill node the registry lists, holding valid tickets (the router's
// key), holds no more than its quota: with PeerRequests 2, two requests of
// 64 pages each are granted and held (verified, no router call for them),
// the third is refused with AbortOverQuota and reserves nothing; with
// PeerPages 100 a second request of 64 pages is refused instead. Another
// prefill node is served meanwhile.
func TestAPeerWithValidTicketsHoldsNoMoreThanItsQuota(t *testing.T) {
	for _, c := range []struct {
		name            string
		requests, pages int
		granted         int
	}{
		{"open requests", 2, 0, 2},
		{"pages", 0, 100, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			l := floodDeployment(t, LocalConfig{PeerRequests: c.requests, PeerPages: c.pages})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if _, err := l.Registry.Register(ctx, Member{Name: "prefill-9", Role: RolePrefill, PoolPages: 2048, PageTokens: 16, PageBytes: l.cfg.PageBytes,
				Model: "other-model"}); err != nil {
				t.Fatal(err)
			}
			r := newRogue(t, ctx, l, "prefill-9")
			if err := r.dial(ctx, l, "prefill-9", pki.RolePrefill); err != nil {
				t.Fatal(err)
			}
			var ids []protocol.RequestID
			for i := range 3 {
				id := protocol.RequestID(2000 + i)
				ids = append(ids, id)
				tk, err := SignTicket(l.ticketKey, Ticket{Request: id, Tokens: 1024, Prefill: "prefill-9", Decode: "decode-0", Expires: time.Now().Add(time.Minute)})
				if err != nil {
					t.Fatal(err)
				}
				if err := r.ep.SubmitTicket(id, "decode-0", 1024, tk); err != nil {
					t.Fatal(err)
				}
				r.wait(id)
			}
			for i, id := range ids {
				err := r.out[id]
				if i < c.granted && err != nil {
					t.Fatalf("request %d within the quota: %v", id, err)
				}
				if i >= c.granted && !errors.Is(err, protocol.AbortOverQuota) {
					t.Fatalf("request %d past the quota: %v, want AbortOverQuota", id, err)
				}
			}
			held, pages := l.Decodes[0].Endpoint().PeerUse("prefill-9")
			if held != c.granted || pages != 64*c.granted || l.Decodes[0].Endpoint().Stats().PagesFree != 1024-64*c.granted {
				t.Fatalf("prefill-9 holds %d requests, %d pages; %d free", held, pages, l.Decodes[0].Endpoint().Stats().PagesFree)
			}
			if _, err := l.Router.Complete(ctx, Completion{Prompt: "another peer is served", MaxTokens: 4}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// The control API's handshake takes the router (an allowed caller's name,
// the router role) and the nodes the registry lists, in their roles; an
// unknown name, a certificate without a role, or a router name in another
// role is refused before any call is read; a listed prefill node may read
// the node's record, never call it as the router does.
func TestControlAPIRefusesUnknownNamesAndWrongRolesAtTheHandshake(t *testing.T) {
	l, err := StartLocal(LocalConfig{Log: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	d := l.Decodes[0]
	d.mu.Lock()
	addr := d.self.Control
	d.mu.Unlock()
	call := func(name string, role pki.Role, path string, in any) error {
		tc, err := l.ca.ConfigAs(name, role)
		if err != nil {
			t.Fatal(err)
		}
		c := newControlClient(Security{TLS: tc})
		defer c.close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var m Member
		return c.call(ctx, "decode-0", addr, path, in, &m)
	}
	if err := call("router", pki.RoleRouter, pathInfo, nil); err != nil {
		t.Fatalf("the router: %v", err)
	}
	if err := call("prefill-0", pki.RolePrefill, pathInfo, nil); err != nil {
		t.Fatalf("a listed prefill node reading the record: %v", err)
	}
	for what, c := range map[string]struct {
		name string
		role pki.Role
		path string
		in   any
	}{
		"an unknown name":                     {"intruder", pki.RolePrefill, pathInfo, nil},
		"a certificate without a role":        {"prefill-0", "", pathInfo, nil},
		"the router's name in a prefill role": {"router", pki.RolePrefill, pathInfo, nil},
		"a listed prefill node as the router": {"prefill-0", pki.RolePrefill, pathCancel, cancelCall{ID: 1}},
		"a decode certificate as prefill-0":   {"prefill-0", pki.RoleDecode, pathInfo, nil},
	} {
		if err := call(c.name, c.role, c.path, c.in); err == nil {
			t.Errorf("%s: answered", what)
		} else {
			t.Logf("%s: %v", what, err)
		}
	}
	// The node's side of the refusal, with its errors.Is-matchable reason
	// (the caller sees a TLS alert).
	for what, c := range map[string]struct {
		name string
		role pki.Role
		want error
	}{
		"an unknown name":                   {"intruder", pki.RolePrefill, pki.ErrUnknownPeer},
		"a certificate without a role":      {"prefill-0", "", pki.ErrNoRole},
		"a router of another name":          {"router-2", pki.RoleRouter, pki.ErrUnknownPeer},
		"a decode certificate as prefill-0": {"prefill-0", pki.RoleDecode, pki.ErrUnknownPeer},
	} {
		cert, err := l.ca.IssueAs(c.name, c.role)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.ctl.verifyPeer(tls.ConnectionState{PeerCertificates: []*x509.Certificate{cert.Leaf}}); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", what, err, c.want)
		}
	}
}
