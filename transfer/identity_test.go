package transfer

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/pki"
)

// refusals is a log handler that keeps the error of every record: Serve
// logs each refused peer with its error, which the tests match with
// errors.Is.
type refusals struct {
	mu   sync.Mutex
	errs []error
}

func (r *refusals) Enabled(context.Context, slog.Level) bool { return true }
func (r *refusals) WithAttrs([]slog.Attr) slog.Handler       { return r }
func (r *refusals) WithGroup(string) slog.Handler            { return r }
func (r *refusals) Handle(_ context.Context, rec slog.Record) error {
	rec.Attrs(func(a slog.Attr) bool {
		if err, ok := a.Value.Any().(error); ok {
			r.mu.Lock()
			r.errs = append(r.errs, err)
			r.mu.Unlock()
		}
		return true
	})
	return nil
}

func (r *refusals) reset() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs = nil
}

// waitFor waits until an error matching target has been logged.
func (r *refusals) waitFor(t *testing.T, target error) error {
	t.Helper()
	var found error
	eventually(t, fmt.Sprintf("a refusal matching %v", target), func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, e := range r.errs {
			if errors.Is(e, target) {
				found = e
				return true
			}
		}
		return false
	})
	return found
}

// listed is a registry's word as SetupConfig.Admit takes it: the names
// listed in each role.
func listed(names map[string]pki.Role) func(string, pki.Role, uint64) error {
	return func(name string, role pki.Role, _ uint64) error {
		if r, ok := names[name]; !ok || r != role {
			return fmt.Errorf("%w: %q as %s", pki.ErrUnknownPeer, name, role)
		}
		return nil
	}
}

// A node is a peer only in the role and under the name the registry lists
// for it: a decode certificate acting as a prefill node, a certificate
// without a role, and a prefill certificate under a name the registry does
// not list (intruder, prefill-9) are refused at the handshake, each with
// its errors.Is-matchable reason, and get no queue pair; the listed
// prefill node connects. A prefill node refuses a "decode node" whose
// certificate is of another role. With the registry's check off (no
// Admit: main before roles were checked), intruder gets its queue pair.
func TestHandshakeAcceptsOnlyTheRoleAndNameTheRegistryLists(t *testing.T) {
	for _, provider := range providerNames() {
		t.Run(provider, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			ca := newTestCA(t)
			as := func(name string, role pki.Role) *tls.Config {
				tc, err := ca.ca.ConfigAs(name, role)
				if err != nil {
					t.Fatal(err)
				}
				return tc
			}
			devs := devices(t, provider, "prefill-1", "decode-1", "intruder", "decode-1", "decode-3")
			d := newDecode(t, devs[1])
			ln := listen(t)
			log := &refusals{}
			admit := listed(map[string]pki.Role{"prefill-1": pki.RolePrefill, "decode-2": pki.RoleDecode})
			go d.Serve(ctx, ln, SetupConfig{Name: "decode-1", TLS: ca.config(t, "decode-1"), Admit: admit, Log: slog.New(log)})
			runNode(t, ctx, d, d)
			dial := func(name string, tc *tls.Config) error {
				m := newPrefill(t, devs[2])
				return m.Dial(ctx, "decode-1", ln.Addr().String(), SetupConfig{Name: name, TLS: tc, Timeout: 2 * time.Second, Log: quiet})
			}
			for _, c := range []struct {
				what string
				name string
				tc   *tls.Config
				want error
			}{
				{"a decode certificate acting as a prefill node", "decode-2", as("decode-2", pki.RoleDecode), pki.ErrWrongRole},
				{"a certificate without a role", "prefill-1", as("prefill-1", ""), pki.ErrNoRole},
				{"an unknown name (intruder)", "intruder", as("intruder", pki.RolePrefill), pki.ErrUnknownPeer},
				{"an unknown name (prefill-9)", "prefill-9", as("prefill-9", pki.RolePrefill), pki.ErrUnknownPeer},
			} {
				log.reset()
				if err := dial(c.name, c.tc); err == nil {
					t.Fatalf("%s: connected", c.what)
				}
				err := log.waitFor(t, c.want)
				if !errors.Is(err, ErrSetup) || !errors.Is(err, pki.ErrPeerRefused) {
					t.Fatalf("%s: refused with %v", c.what, err)
				}
				t.Logf("%s: %v", c.what, err)
			}
			d.Poll(time.Now())
			if s := d.Stats(); s.Peers != 0 || len(d.conns) != 0 {
				t.Fatalf("refused peers got %d live and %d other queue pairs", s.Peers, len(d.conns))
			}

			// A prefill node dialling a "decode node" whose certificate is a
			// prefill node's refuses it, before any hello of its own goes on.
			imp := newDecode(t, devs[3])
			impLn := listen(t)
			go imp.Serve(ctx, impLn, SetupConfig{Name: "decode-1", TLS: as("decode-1", pki.RolePrefill), Log: quiet})
			p := newPrefill(t, devs[0])
			err := p.Dial(ctx, "decode-1", impLn.Addr().String(), SetupConfig{Name: "prefill-1", TLS: ca.config(t, "prefill-1"), Timeout: 2 * time.Second, Log: quiet})
			if !errors.Is(err, ErrSetup) || !errors.Is(err, pki.ErrWrongRole) {
				t.Fatalf("dialling a decode node certified as prefill: %v", err)
			}

			// The listed prefill node connects.
			if err := p.Dial(ctx, "decode-1", ln.Addr().String(), SetupConfig{Name: "prefill-1", TLS: ca.config(t, "prefill-1"), Log: quiet}); err != nil {
				t.Fatal(err)
			}

			// The defense off: a decode node that admits any name.
			open := newDecode(t, devs[4])
			openLn := listen(t)
			go open.Serve(ctx, openLn, SetupConfig{Name: "decode-3", TLS: ca.config(t, "decode-3"), Log: quiet})
			m := newPrefill(t, devs[2])
			if err := m.Dial(ctx, "decode-3", openLn.Addr().String(), SetupConfig{Name: "intruder", TLS: as("intruder", pki.RolePrefill), Log: quiet}); err != nil {
				t.Fatalf("without the registry's check intruder should connect (the attack): %v", err)
			}
		})
	}
}

// Over each software provider, a decode endpoint whose Authorize refuses
// a Bootstrap reserves nothing for it: the flood, 16 Bootstraps of
// 1,024 tokens on a pool of 1,024 pages of 16, ends in 16 outcomes of
// protocol.AbortUnauthorized at the sender and every page free, and the
// queue pair still carries an authorized request. With unticketed-bootstrap
// on, the same flood takes the whole pool.
func TestUnauthorizedBootstrapsReserveNothingOverEachProvider(t *testing.T) {
	for _, provider := range providerNames() {
		for _, bug := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/unticketed-bootstrap=%v", provider, bug), func(t *testing.T) {
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				ca := newTestCA(t)
				devs := devices(t, provider, "prefill-1", "decode-1")
				p, err := NewPrefill(devs[0], PrefillConfig{Pages: 2048, PageTokens: 16, PageBytes: pageBytes})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(p.Close)
				cfg := DecodeConfig{Pages: 1024, PageTokens: 16, PageBytes: pageBytes, Timeout: time.Minute,
					Admission: Admission{Authorize: func(peer string, b *protocol.Bootstrap) error {
						if peer != "prefill-1" || string(b.Ticket) != "ok" {
							return errors.New("no ticket of the router's")
						}
						return nil
					}}}
				if bug {
					cfg.Research = research.On(research.UnticketedBootstrap)
				}
				d, err := NewDecode(devs[1], cfg)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(d.Close)
				ln := listen(t)
				go d.Serve(ctx, ln, SetupConfig{Name: "decode-1", TLS: ca.config(t, "decode-1"), Log: quiet})
				pn := runNode(t, ctx, p, nil)
				go d.Run(ctx) // verified requests stay held: nothing reads them
				if err := p.Dial(ctx, "decode-1", ln.Addr().String(), SetupConfig{Name: "prefill-1", TLS: ca.config(t, "prefill-1"), Log: quiet}); err != nil {
					t.Fatal(err)
				}
				var ids []protocol.RequestID
				for id := protocol.RequestID(1); id <= 16; id++ {
					if err := p.SubmitTicket(id, "decode-1", 1024, []byte("forged")); err != nil {
						t.Fatal(err)
					}
					ids = append(ids, id)
				}
				outcomes := pn.wait(ids...)
				if bug {
					if free := d.Stats().PagesFree; free != 0 {
						t.Fatalf("with the defense off the flood left %d of 1,024 pages free", free)
					}
					return
				}
				for id, err := range outcomes {
					if !errors.Is(err, protocol.AbortUnauthorized) {
						t.Fatalf("request %d: %v, want AbortUnauthorized", id, err)
					}
				}
				if s := d.Stats(); s.PagesFree != 1024 || s.Records != 0 {
					t.Fatalf("the flood left %d of 1,024 pages free, %d records", s.PagesFree, s.Records)
				}
				if err := p.SubmitTicket(100, "decode-1", 100, []byte("ok")); err != nil {
					t.Fatal(err)
				}
				if err := pn.wait(100)[100]; err != nil {
					t.Fatalf("the authorized request: %v", err)
				}
			})
		}
	}
}
