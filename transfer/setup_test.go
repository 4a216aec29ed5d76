package transfer

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/inproc"
)

// testCA is a throwaway authority in memory (internal/pki).
type testCA struct{ ca *pki.CA }

func newTestCA(t *testing.T) *testCA {
	t.Helper()
	ca, err := pki.NewCA("transfer-setup-test")
	if err != nil {
		t.Fatal(err)
	}
	return &testCA{ca}
}

// config is node name's mutual TLS configuration under this authority.
func (c *testCA) config(t *testing.T, name string) *tls.Config {
	t.Helper()
	tc, err := c.ca.Config(name)
	if err != nil {
		t.Fatal(err)
	}
	return tc
}

func (c *testCA) pool() *x509.CertPool { return c.ca.Pool() }

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// node is an endpoint run by its own Run loop, as a process would, with a
// goroutine that handles its events: decode reads and checks every verified
// request, then finishes it.
type node struct {
	t        *testing.T
	mu       sync.Mutex
	outcomes map[protocol.RequestID]error
	peerOf   map[protocol.RequestID]string
	foreign  []string
}

func runNode(t *testing.T, ctx context.Context, e interface {
	Run(context.Context) error
	Notify() <-chan struct{}
	Events() []Event
}, d *Decode) *node {
	n := &node{t: t, outcomes: map[protocol.RequestID]error{}, peerOf: map[protocol.RequestID]string{}}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); e.Run(ctx) }()
	go func() {
		defer wg.Done()
		for {
			select {
			case <-ctx.Done():
				return
			case <-e.Notify():
			}
			for _, ev := range e.Events() {
				n.handle(ev, d)
			}
		}
	}()
	t.Cleanup(wg.Wait)
	return n
}

func (n *node) handle(ev Event, d *Decode) {
	switch ev.Kind {
	case Verified:
		pages, err := d.Acquire(ev.Request)
		if err != nil {
			return
		}
		for i, ref := range pages {
			if !bytes.Equal(d.Payload(ref.Page), kv(ev.Request, i)) {
				n.mu.Lock()
				n.foreign = append(n.foreign, fmt.Sprintf("request %d page %d", ev.Request, i))
				n.mu.Unlock()
			}
		}
		d.Finish(ev.Request)
	case Outcome:
		n.mu.Lock()
		n.outcomes[ev.Request], n.peerOf[ev.Request] = ev.Err, ev.Peer
		n.mu.Unlock()
	}
}

// ended reports whether request id has an outcome.
func (n *node) ended(id protocol.RequestID) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	_, ok := n.outcomes[id]
	return ok
}

// wait waits until every request in ids has an outcome, and returns them.
func (n *node) wait(ids ...protocol.RequestID) map[protocol.RequestID]error {
	n.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		n.mu.Lock()
		done := 0
		for _, id := range ids {
			if _, ok := n.outcomes[id]; ok {
				done++
			}
		}
		out := map[protocol.RequestID]error{}
		for _, id := range ids {
			out[id] = n.outcomes[id]
		}
		foreign := n.foreign
		n.mu.Unlock()
		if len(foreign) > 0 {
			n.t.Fatalf("decode would read foreign KV: %v", foreign)
		}
		if done == len(ids) {
			return out
		}
		if time.Now().After(deadline) {
			var missing []string
			for _, id := range ids {
				if !n.ended(id) {
					missing = append(missing, fmt.Sprint(id))
				}
			}
			n.t.Fatalf("%d of %d requests have no outcome after 20 s: %v", len(ids)-done, len(ids), missing)
		}
		time.Sleep(time.Millisecond)
	}
}

// eventually waits for cond, which must hold within 20 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not after 20 s", what)
		}
	}
}

func listen(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// devices are a provider's devices for named nodes: inproc devices carry the
// node's name (a queue pair accepts a peer only under it), socket devices
// listen on loopback.
func devices(t *testing.T, provider string, names ...string) []rdma.Device {
	var out []rdma.Device
	f := inproc.NewFabric(t.Name())
	for _, n := range names {
		switch provider {
		case "inproc":
			out = append(out, f.Device(n))
		case "socket":
			out = append(out, listenSocket(t, n))
		default:
			prefill, _ := providers[provider](t)
			out = append(out, prefill)
		}
	}
	return out
}

func newPrefill(t *testing.T, dev rdma.Device) *Prefill {
	t.Helper()
	p, err := NewPrefill(dev, PrefillConfig{Pages: 128, PageTokens: pageTokens, PageBytes: pageBytes})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

func newDecode(t *testing.T, dev rdma.Device) *Decode {
	t.Helper()
	d, err := NewDecode(dev, DecodeConfig{Pages: 256, PageTokens: pageTokens, PageBytes: pageBytes, Timeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Close)
	return d
}

func providerNames() []string {
	var names []string
	for name := range providers {
		names = append(names, name)
	}
	return names
}

// Two nodes set up their queue pair over a mutually authenticated control
// connection, then move verified KV through it, driven by their own run loops.
func TestSetupOverTLSConnectsAndMovesVerifiedBytes(t *testing.T) {
	for _, provider := range providerNames() {
		t.Run(provider, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			ca := newTestCA(t)
			devs := devices(t, provider, "prefill-1", "decode-1")
			p, d := newPrefill(t, devs[0]), newDecode(t, devs[1])
			ln := listen(t)
			go d.Serve(ctx, ln, SetupConfig{Name: "decode-1", TLS: ca.config(t, "decode-1"), Log: quiet})
			pn, dn := runNode(t, ctx, p, nil), runNode(t, ctx, d, d)
			if err := p.Dial(ctx, "decode-1", ln.Addr().String(), SetupConfig{Name: "prefill-1", TLS: ca.config(t, "prefill-1"), Log: quiet}); err != nil {
				t.Fatal(err)
			}
			eventually(t, "decode sees the queue pair live", func() bool { return len(d.Peers()) == 1 })
			var ids []protocol.RequestID
			for id := protocol.RequestID(1); id <= 30; id++ {
				if err := p.Submit(id, "decode-1", int(id%4+1)*pageTokens-int(id%3)); err != nil { // 1 to 4 pages
					t.Fatal(err)
				}
				ids = append(ids, id)
			}
			for id, err := range pn.wait(ids...) {
				if err != nil {
					t.Fatalf("prefill: request %d: %v", id, err)
				}
			}
			for id, err := range dn.wait(ids...) {
				if err != nil || dn.peerOf[id] != "prefill-1" {
					t.Fatalf("decode: request %d from %q: %v", id, dn.peerOf[id], err)
				}
			}
			eventually(t, "every page free", func() bool { return d.Stats().PagesFree == 256 && p.Stats().PagesFree == 128 })
		})
	}
}

// Plaintext needs saying so.
func TestSetupRefusesPlaintextUnlessInsecure(t *testing.T) {
	devs := devices(t, "inproc", "p", "d")
	p, d := newPrefill(t, devs[0]), newDecode(t, devs[1])
	if err := p.Dial(context.Background(), "d", "127.0.0.1:1", SetupConfig{Name: "p"}); !errors.Is(err, ErrSetup) || !strings.Contains(err.Error(), "Insecure") {
		t.Fatalf("Dial without TLS: %v", err)
	}
	if err := d.Serve(context.Background(), listen(t), SetupConfig{Name: "d"}); !errors.Is(err, ErrSetup) {
		t.Fatalf("Serve without TLS: %v", err)
	}
}

// A decode node that accepts and never answers, or answers garbage: Dial
// fails with ErrSetup within its timeout and keeps no queue pair.
func TestSetupWithAPeerThatIsSilentOrTalksGarbageTimesOut(t *testing.T) {
	for name, answer := range map[string][]byte{
		"silent":          nil,
		"garbage":         []byte("\x00\x10HTTP/1.1 200 OK\r\n\r\n"),
		"huge hello":      {0xFF, 0xFF},
		"wrong role":      append([]byte{0, 0}, (&hello{role: 'P', name: "d", pageTokens: pageTokens, pageBytes: pageBytes, maxRequestPages: 1, recvSlots: RecvSlots}).encode()...),
		"the magic alone": append([]byte{0, 0}, helloMagic...), // decodeHello read past it, and the process died
	} {
		t.Run(name, func(t *testing.T) {
			if len(answer) > 4 && answer[0] == 0 && answer[1] == 0 { // fill in the hello's length
				answer[1] = byte(len(answer) - 2)
			}
			ln := listen(t)
			go func() {
				for {
					c, err := ln.Accept()
					if err != nil {
						return
					}
					c.Write(answer)
					defer c.Close() // hold it open and say nothing more
				}
			}()
			devs := devices(t, "inproc", "p")
			p := newPrefill(t, devs[0])
			start := time.Now()
			err := p.Dial(context.Background(), "d", ln.Addr().String(), SetupConfig{Name: "p", Insecure: true, Timeout: 200 * time.Millisecond, Log: quiet})
			if !errors.Is(err, ErrSetup) {
				t.Fatalf("Dial: %v, want ErrSetup", err)
			}
			if time.Since(start) > 5*time.Second {
				t.Fatalf("Dial took %v with a timeout of 200 ms", time.Since(start))
			}
			t.Log(err)
			p.Poll(time.Now())
			if s := p.Stats(); s.Peers != 0 || len(p.conns) != 0 {
				t.Fatalf("a failed setup left %d live and %d draining queue pairs", s.Peers, len(p.conns))
			}
		})
	}
}

// A hello cut short right after its magic ("KVHS", format 2, no version
// byte) is refused as malformed on the decode side too: decodeHello read
// past it, and a peer's seven bytes ended the decode node's process. The
// node drops the connection and takes a real prefill node after it.
func TestADecodeNodeRefusesAHelloCutShortAfterItsMagic(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	devs := devices(t, "inproc", "p", "d")
	p, d := newPrefill(t, devs[0]), newDecode(t, devs[1])
	ln := listen(t)
	go d.Serve(ctx, ln, SetupConfig{Name: "d", Insecure: true, Timeout: time.Second, Log: quiet})
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write(append([]byte{0, byte(len(helloMagic))}, helloMagic...))
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil {
		t.Fatalf("the connection was not dropped: %v", err)
	}
	runNode(t, ctx, d, d)
	pn := runNode(t, ctx, p, nil)
	if err := p.Dial(ctx, "d", ln.Addr().String(), SetupConfig{Name: "p", Insecure: true, Log: quiet}); err != nil {
		t.Fatal(err)
	}
	if err := p.Submit(1, "d", 100); err != nil {
		t.Fatal(err)
	}
	if err := pn.wait(1)[1]; err != nil {
		t.Fatal(err)
	}
}

// A stranger (no certificate, a certificate from another CA, or a valid one
// that names another node than its hello does) and a client that stalls or
// talks garbage never get a queue pair; a real prefill node connects after
// them all.
func TestSetupAllocatesNothingForStrangers(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ca, other := newTestCA(t), newTestCA(t)
	devs := devices(t, "inproc", "prefill-1", "decode-1", "prefill-1") // the stranger's device claims the name too
	d := newDecode(t, devs[1])
	ln := listen(t)
	// The decode side's Timeout bounds the real peer's handshake at the end
	// too: a sub-second one failed it on a loaded machine under -race.
	const timeout = 2 * time.Second
	go d.Serve(ctx, ln, SetupConfig{Name: "decode-1", TLS: ca.config(t, "decode-1"), Timeout: timeout, Log: quiet})
	dial := func(name string, tc *tls.Config) error {
		m := newPrefill(t, devs[2])
		return m.Dial(ctx, "decode-1", ln.Addr().String(), SetupConfig{Name: name, TLS: tc, Insecure: tc == nil, Timeout: 500 * time.Millisecond, Log: quiet})
	}
	noCert := &tls.Config{RootCAs: ca.pool()}
	foreignCA := other.config(t, "prefill-1")
	foreignCA.RootCAs = ca.pool()
	for what, err := range map[string]error{
		"no certificate":            dial("prefill-1", noCert),
		"another CA's certificate":  dial("prefill-1", foreignCA),
		"a certificate for mallory": dial("prefill-1", ca.config(t, "mallory")),
		"plaintext":                 dial("prefill-1", nil),
	} {
		if err == nil {
			t.Fatalf("%s: connected", what)
		}
	}
	for _, junk := range [][]byte{nil, []byte("GET / HTTP/1.1\r\n\r\n")} { // stall; garbage
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		c.Write(junk)
		c.SetReadDeadline(time.Now().Add(timeout + 10*time.Second))
		if _, err := io.Copy(io.Discard, c); err != nil { // decode drops it after its Timeout: EOF, well before this guard
			t.Fatalf("a client sending %q was not dropped: %v", junk, err)
		}
		c.Close()
	}
	d.Poll(time.Now())
	if s := d.Stats(); s.Peers != 0 || len(d.conns) != 0 {
		t.Fatalf("strangers got %d live and %d other queue pairs", s.Peers, len(d.conns))
	}
	p := newPrefill(t, devs[0])
	runNode(t, ctx, d, d)
	pn := runNode(t, ctx, p, nil)
	if err := p.Dial(ctx, "decode-1", ln.Addr().String(), SetupConfig{Name: "prefill-1", TLS: ca.config(t, "prefill-1"), Log: quiet}); err != nil {
		t.Fatal(err)
	}
	if err := p.Submit(1, "decode-1", 100); err != nil {
		t.Fatal(err)
	}
	if err := pn.wait(1)[1]; err != nil {
		t.Fatal(err)
	}
}

// After a cut (the control connection closes) every request on the old queue
// pair fails on both nodes; a reconnect makes a new queue pair with fresh
// credits, under a new peer id, on which the old requests cannot complete,
// and new requests flow.
func TestReconnectAfterACutStartsAFreshQueuePair(t *testing.T) {
	for _, provider := range providerNames() {
		t.Run(provider, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			ca := newTestCA(t)
			devs := devices(t, provider, "prefill-1", "decode-1")
			p, d := newPrefill(t, devs[0]), newDecode(t, devs[1])
			ln := listen(t)
			go d.Serve(ctx, ln, SetupConfig{Name: "decode-1", TLS: ca.config(t, "decode-1"), Log: quiet})
			pn, dn := runNode(t, ctx, p, nil), runNode(t, ctx, d, d)
			pcfg := SetupConfig{Name: "prefill-1", TLS: ca.config(t, "prefill-1"), Log: quiet}
			if err := p.Dial(ctx, "decode-1", ln.Addr().String(), pcfg); err != nil {
				t.Fatal(err)
			}
			eventually(t, "decode sees the queue pair live", func() bool { return len(d.Peers()) == 1 })
			p.mu.Lock()
			old := p.names["decode-1"]
			oldPeer := old.peer
			p.mu.Unlock()
			d.mu.Lock()
			var dold *conn
			for _, c := range d.conns {
				dold = c
			}
			d.mu.Unlock()
			dold.qp.(rdma.Faults).Pause() // decode will reserve request 1, its Grant held in the network
			if err := p.Submit(1, "decode-1", 64); err != nil {
				t.Fatal(err)
			}
			eventually(t, "decode reserves request 1", func() bool { return d.Status(1) == protocol.ReceiverReserved })
			p.mu.Lock()
			old.ctl.Close() // the control connection drops: both nodes cut
			p.mu.Unlock()
			if err := pn.wait(1)[1]; !errors.Is(err, protocol.ErrPeerFailed) {
				t.Fatalf("prefill: request 1 on the cut queue pair: %v", err)
			}
			dold.qp.(rdma.Faults).Resume() // the held Grant, on a queue pair in the error state, is flushed
			if err := dn.wait(1)[1]; !errors.Is(err, protocol.ErrPeerFailed) {
				t.Fatalf("decode: request 1 on the cut queue pair: %v", err)
			}
			eventually(t, "decode forgets the cut queue pair", func() bool { return len(d.Peers()) == 0 })
			if err := p.Dial(ctx, "decode-1", ln.Addr().String(), pcfg); err != nil {
				t.Fatal(err)
			}
			p.mu.Lock()
			fresh := p.names["decode-1"]
			credits, peer := fresh.credits, fresh.peer
			p.mu.Unlock()
			if credits != RecvSlots || peer == oldPeer {
				t.Fatalf("new queue pair: %d credits (want %d), peer %d (old %d)", credits, RecvSlots, peer, oldPeer)
			}
			// A message of request 1 cannot complete it on the new queue pair:
			// decode refuses a Done from another peer than the request's.
			d.mu.Lock()
			var dfresh *conn
			for _, c := range d.conns {
				dfresh = c
			}
			before := d.refused
			err := d.message(dfresh, &protocol.Done{Request: 1, Tokens: 64, Pages: 4})
			d.mu.Unlock()
			if !errors.Is(err, protocol.ErrWrongPeer) || d.refused != before || d.Status(1) != protocol.ReceiverClosed {
				t.Fatalf("a Done for the cut queue pair's request on the new one: %v, status %s", err, d.Status(1))
			}
			if err := p.Submit(2, "decode-1", 64); err != nil {
				t.Fatal(err)
			}
			if err := pn.wait(2)[2]; err != nil {
				t.Fatal(err)
			}
			if err := dn.wait(2)[2]; err != nil {
				t.Fatal(err)
			}
			eventually(t, "every page free", func() bool { return d.Stats().PagesFree == 256 && p.Stats().PagesFree == 128 })
		})
	}
}

// A cut of a lost life (CutIncarnation, the router's PeerLost) cuts that
// life's queue pair, or an earlier life's (a registry's loss names its
// newest record), and spares a later life's: a next life that connected
// before the loss is told (a crash and a quick restart) keeps its queue
// pair, which takes requests, where a cut by name would fail them. A life
// that lives on when the next connects (it hung, and was taken for lost)
// is fenced by the replacement itself; the same life coming back connects
// anew. The hello carries each life's incarnation.
func TestACutOfALostLifeSparesTheNextLifesQueuePair(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ca := newTestCA(t)
	devs := devices(t, "inproc", "prefill-1", "prefill-1", "decode-1")
	d := newDecode(t, devs[2])
	ln := listen(t)
	go d.Serve(ctx, ln, SetupConfig{Name: "decode-1", Incarnation: 9, TLS: ca.config(t, "decode-1"), Log: quiet})
	dn := runNode(t, ctx, d, d)
	live := func(incarnation uint64) bool {
		d.mu.Lock()
		defer d.mu.Unlock()
		c := d.names["prefill-1"]
		return c != nil && c.incarnation == incarnation
	}
	dial := func(p *Prefill, incarnation uint64) {
		t.Helper()
		if err := p.Dial(ctx, "decode-1", ln.Addr().String(), SetupConfig{Name: "prefill-1", Incarnation: incarnation, TLS: ca.config(t, "prefill-1"), Log: quiet}); err != nil {
			t.Fatal(err)
		}
		eventually(t, "decode sees the life's queue pair live", func() bool { return live(incarnation) })
		p.mu.Lock()
		defer p.mu.Unlock()
		if got := p.names["decode-1"].incarnation; got != 9 {
			t.Fatalf("prefill read decode's incarnation as %d, want 9", got)
		}
	}
	p1, p2 := newPrefill(t, devs[0]), newPrefill(t, devs[1])
	runNode(t, ctx, p1, nil)
	pn2 := runNode(t, ctx, p2, nil)

	// The lost life's queue pair is the fence's: it is cut. The same life
	// may come back (a node the router suspected answers again), and
	// connects anew.
	dial(p1, 1)
	if err := d.CutIncarnation("prefill-1", 1); err != nil {
		t.Fatalf("a cut of life 1 with life 1 live: %v", err)
	}
	eventually(t, "life 1's queue pair gone", func() bool { return len(d.Peers()) == 0 })
	dial(p1, 1)
	if err := d.CutIncarnation("prefill-1", 1); err != nil {
		t.Fatalf("a cut of life 1 back: %v", err)
	}
	eventually(t, "life 1's queue pair gone", func() bool { return len(d.Peers()) == 0 })
	// An earlier life's queue pair goes when a later one is named lost
	// (a registry's loss names its newest record).
	dial(p1, 2)
	if err := d.CutIncarnation("prefill-1", 3); err != nil {
		t.Fatalf("a cut of life 3 with life 2 live: %v", err)
	}
	eventually(t, "life 2's queue pair gone", func() bool { return len(d.Peers()) == 0 })

	// Life 4 lives on as life 5 connects: the replacement cuts life 4's
	// queue pair, which drains and goes.
	dial(p1, 4)
	dial(p2, 5)
	eventually(t, "life 4's queue pair fenced by its replacement", func() bool {
		d.mu.Lock()
		defer d.mu.Unlock()
		return len(d.conns) == 1
	})
	// The loss of life 4, told late, spares life 5's queue pair.
	if err := d.CutIncarnation("prefill-1", 4); !errors.Is(err, ErrOtherIncarnation) {
		t.Fatalf("a late cut of life 4 with life 5 live: %v, want ErrOtherIncarnation", err)
	}
	if err := p2.Submit(1, "decode-1", 3*pageTokens); err != nil {
		t.Fatal(err)
	}
	if err := pn2.wait(1)[1]; err != nil {
		t.Fatalf("prefill: a request of the new life: %v", err)
	}
	if err := dn.wait(1)[1]; err != nil || dn.peerOf[1] != "prefill-1" {
		t.Fatalf("decode: a request of the new life: %v", err)
	}
	// Life 5's own loss, or a loss whose life is not said, cuts it.
	if err := d.CutIncarnation("prefill-1", 5); err != nil || len(d.Peers()) != 0 {
		t.Fatalf("a cut of the live life 5: %v, peers %v", err, d.Peers())
	}
	if err := d.CutIncarnation("prefill-1", 0); !errors.Is(err, ErrNoPeer) {
		t.Fatalf("a cut with no queue pair left: %v, want ErrNoPeer", err)
	}
}

// A queue pair being set up as its life's loss is told never goes live:
// its setup fails (so that the dialer backs off), at both ends, and the
// same life dialling again connects. Here the prefill node's registry
// loses decode-1's life 9 while its Dial waits for decode-1's hello.
func TestAQueuePairSetUpAsItsLifeIsLostNeverGoesLive(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ca := newTestCA(t)
	devs := devices(t, "inproc", "prefill-1", "decode-1")
	p, d := newPrefill(t, devs[0]), newDecode(t, devs[1])
	ln := listen(t)
	held, release := make(chan struct{}, 1), make(chan struct{})
	var once sync.Once
	admit := func(string, pki.Role, uint64) error {
		once.Do(func() { held <- struct{}{}; <-release })
		return nil
	}
	go d.Serve(ctx, ln, SetupConfig{Name: "decode-1", Incarnation: 9, TLS: ca.config(t, "decode-1"), Admit: admit, Log: quiet})
	runNode(t, ctx, p, nil)
	runNode(t, ctx, d, d)
	cfg := SetupConfig{Name: "prefill-1", Incarnation: 1, PeerIncarnation: 9, TLS: ca.config(t, "prefill-1"), Log: quiet}
	dialled := make(chan error, 1)
	go func() { dialled <- p.Dial(ctx, "decode-1", ln.Addr().String(), cfg) }()
	<-held // decode-1 has prefill-1's hello; prefill-1 waits for decode-1's
	if err := p.CutIncarnation("decode-1", 9); !errors.Is(err, ErrNoPeer) {
		t.Fatalf("a cut with the queue pair not live yet: %v, want ErrNoPeer", err)
	}
	close(release)
	if err := <-dialled; !errors.Is(err, ErrSetup) || !errors.Is(err, protocol.ErrPeerFailed) {
		t.Fatalf("the Dial of a life lost as it was set up: %v, want ErrSetup and ErrPeerFailed", err)
	}
	eventually(t, "both ends' queue pairs drained", func() bool {
		p.mu.Lock()
		np := len(p.conns)
		p.mu.Unlock()
		d.mu.Lock()
		defer d.mu.Unlock()
		return np == 0 && len(d.conns) == 0
	})
	if err := p.Dial(ctx, "decode-1", ln.Addr().String(), cfg); err != nil {
		t.Fatalf("the same life dialled again: %v", err)
	}
	eventually(t, "decode sees the queue pair live", func() bool { return len(d.Peers()) == 1 })
}

// The life a hello names is checked where it matters: a decode node takes
// a prefill node only as the life its registry lists (SetupConfig.Admit
// gets the hello's incarnation), and a prefill node dials only the life
// its registry names (SetupConfig.PeerIncarnation). A life the registry
// does not name gets no queue pair, on either side: a peer cannot claim a
// later life to keep its queue pair past its own life's loss.
func TestASetupIsRefusedForALifeTheRegistryDoesNotName(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ca := newTestCA(t)
	devs := devices(t, "inproc", "prefill-1", "decode-1")
	p, d := newPrefill(t, devs[0]), newDecode(t, devs[1])
	ln := listen(t)
	registered := func(name string, role pki.Role, incarnation uint64) error {
		if name != "prefill-1" || role != pki.RolePrefill || incarnation != 7 {
			return fmt.Errorf("%w: %q life %d", pki.ErrUnknownPeer, name, incarnation)
		}
		return nil
	}
	go d.Serve(ctx, ln, SetupConfig{Name: "decode-1", Incarnation: 9, TLS: ca.config(t, "decode-1"), Admit: registered, Log: quiet})
	runNode(t, ctx, p, nil)
	runNode(t, ctx, d, d)
	cfg := func(own, peer uint64) SetupConfig {
		return SetupConfig{Name: "prefill-1", Incarnation: own, PeerIncarnation: peer, TLS: ca.config(t, "prefill-1"), Log: quiet, Timeout: 5 * time.Second}
	}
	if err := p.Dial(ctx, "decode-1", ln.Addr().String(), cfg(8, 9)); !errors.Is(err, ErrSetup) {
		t.Fatalf("a life decode's registry does not list: Dial %v, want ErrSetup", err)
	}
	if err := p.Dial(ctx, "decode-1", ln.Addr().String(), cfg(7, 10)); !errors.Is(err, ErrSetup) || !errors.Is(err, pki.ErrUnknownPeer) {
		t.Fatalf("a decode life prefill's registry does not name: Dial %v, want ErrSetup and pki.ErrUnknownPeer", err)
	}
	d.Poll(time.Now())
	if len(p.Peers()) != 0 || len(d.Peers()) != 0 {
		t.Fatalf("refused lives got queue pairs: prefill %v, decode %v", p.Peers(), d.Peers())
	}
	if err := p.Dial(ctx, "decode-1", ln.Addr().String(), cfg(7, 9)); err != nil {
		t.Fatalf("the lives both registries name: %v", err)
	}
	eventually(t, "decode sees the queue pair live", func() bool { return len(d.Peers()) == 1 })
}

// A flood of connections that never finish their handshake holds no more
// than MaxHandshakes goroutines, and a real prefill node that connects while
// they all stay open is served at once, not after their Timeout (a minute):
// each new connection evicts the oldest unfinished one of its address.
func TestSetupUnderAFloodOfIdleConnectionsServesARealPeer(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ca := newTestCA(t)
	devs := devices(t, "inproc", "prefill-1", "decode-1")
	p, d := newPrefill(t, devs[0]), newDecode(t, devs[1])
	ln := listen(t)
	const maxHandshakes = 8
	before := runtime.NumGoroutine()
	go d.Serve(ctx, ln, SetupConfig{Name: "decode-1", TLS: ca.config(t, "decode-1"), MaxHandshakes: maxHandshakes, Timeout: time.Minute, Log: quiet})
	var flood []net.Conn
	defer func() {
		for _, c := range flood {
			c.Close()
		}
	}()
	// The server side holds at most maxHandshakes pending handshakes (plus the
	// accept loop and evicted ones on their way out). An evicted one exits
	// when it sees its connection closed, which on a loaded machine under the
	// race detector can take a while: each sample waits up to 5 s for the
	// count to come within the bound. Without the bound it never would: the
	// flood's 200 connections would each hold one.
	const bound = 3*maxHandshakes + 8
	most := 0
	for i := 0; i < 200; i++ { // idle: they never send a byte, and the timeout is a minute
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		flood = append(flood, c)
		if i%20 == 19 {
			time.Sleep(5 * time.Millisecond) // let the accept loop catch up
			held := runtime.NumGoroutine() - before
			for settle := time.Now().Add(5 * time.Second); held > bound && time.Now().Before(settle); held = runtime.NumGoroutine() - before {
				time.Sleep(10 * time.Millisecond)
			}
			most = max(most, held)
		}
	}
	start := time.Now()
	if err := p.Dial(ctx, "decode-1", ln.Addr().String(), SetupConfig{Name: "prefill-1", TLS: ca.config(t, "prefill-1"), Log: quiet}); err != nil {
		t.Fatalf("a real prefill node after the flood: %v", err)
	}
	if waited := time.Since(start); waited > 30*time.Second {
		t.Fatalf("the real prefill node waited %v behind idle connections", waited)
	}
	if most > bound {
		t.Fatalf("%d goroutines more than before the flood of 200 connections, with MaxHandshakes %d", most, maxHandshakes)
	}
	// Evicted ones read EOF at once; a read timing out (a connection still
	// pending, or a reader stalled past its short deadline on a loaded
	// machine) is tried again, until enough are seen dropped or 10 s pass.
	evicted := 0
	dropped := make([]bool, len(flood))
	for guard := time.Now().Add(10 * time.Second); evicted < 200-2*maxHandshakes && time.Now().Before(guard); {
		for i, c := range flood {
			if dropped[i] {
				continue
			}
			c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
			if _, err := c.Read(make([]byte, 1)); errors.Is(err, io.EOF) {
				dropped[i] = true
				evicted++
			}
		}
	}
	if evicted < 200-2*maxHandshakes {
		t.Fatalf("only %d of the first 200 idle connections were dropped", evicted)
	}
	eventually(t, "decode sees the real peer", func() bool { return len(d.Peers()) == 1 })
}

// The hello carries the wire version (protocol.Version), so a node of
// another version is refused at setup with ErrWireVersion (which wraps
// protocol.ErrVersion) instead of connecting and breaking the queue pair
// with its first Bootstrap. A version-2 node's hello (format 1: "KVHS\x01",
// no version byte), a version-3 node's (no incarnation) and a later
// version's are refused; this version's own is accepted.
func TestAHelloFromAnotherWireVersionIsRefusedAtSetup(t *testing.T) {
	h := &hello{role: 'P', name: "prefill-v2", incarnation: 7, pageTokens: 16, pageBytes: 4096, maxRequestPages: 8, recvSlots: RecvSlots}
	now := h.encode()
	v2 := append([]byte(helloFormat1), now[len(helloMagic)+1:]...) // as a version-2 node sends it
	v3 := bytes.Clone(now)
	v3[len(helloMagic)] = 3
	later := bytes.Clone(now)
	later[len(helloMagic)] = protocol.Version + 1
	format3 := bytes.Clone(now)
	format3[4] = 3
	for what, b := range map[string][]byte{"version 2": v2, "version 3": v3, "a later version": later, "hello format 3": format3} {
		_, err := decodeHello(b)
		if !errors.Is(err, ErrWireVersion) || !errors.Is(err, protocol.ErrVersion) {
			t.Fatalf("%s: %v, want ErrWireVersion", what, err)
		}
		t.Logf("%s: %v", what, err)
	}
	if got, err := decodeHello(now); err != nil || got.name != h.name || got.incarnation != h.incarnation {
		t.Fatalf("this version's own hello: %+v, %v", got, err)
	}
	if _, err := decodeHello([]byte("HTTP/1.1 200 OK")); !errors.Is(err, errHello) || errors.Is(err, ErrWireVersion) {
		t.Fatalf("garbage: %v, want a malformed hello, not a version", err)
	}
}

// Both sides of a setup with a node of another wire version refuse it,
// each saying so (ErrWireVersion), and neither lists it as a peer: a
// prefill node dialling a decode node of another version fails Dial; a
// decode node answers another version's hello with its own version before
// closing (so a prefill node of that version can say why), and logs the
// refusal.
func TestSetupRefusesAPeerOfAnotherWireVersionOnBothSides(t *testing.T) {
	frame := func(b []byte) []byte { return append(binary.BigEndian.AppendUint16(nil, uint16(len(b))), b...) }
	decodeHi := (&hello{role: 'D', name: "d", pageTokens: pageTokens, pageBytes: pageBytes, maxRequestPages: 1, recvSlots: RecvSlots}).encode()
	v2 := append([]byte(helloFormat1), decodeHi[len(helloMagic)+1:]...)
	later := bytes.Clone(decodeHi)
	later[len(helloMagic)] = protocol.Version + 1
	for what, answer := range map[string][]byte{"version 2": v2, "a later version": later} {
		ln := listen(t)
		go func() {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
			readHello(c, 5*time.Second) // the prefill node's, this version's
			c.Write(frame(answer))
			io.Copy(io.Discard, c)
		}()
		p := newPrefill(t, devices(t, "inproc", "p")[0])
		err := p.Dial(context.Background(), "d", ln.Addr().String(), SetupConfig{Name: "p", Insecure: true, Timeout: 5 * time.Second, Log: quiet})
		if !errors.Is(err, ErrSetup) || !errors.Is(err, ErrWireVersion) {
			t.Fatalf("a decode node of %s: Dial %v, want ErrSetup and ErrWireVersion", what, err)
		}
		t.Logf("prefill side, a decode node of %s: %v", what, err)
		if s := p.Stats(); s.Peers != 0 {
			t.Fatalf("%d peers after refusing a decode node of %s", s.Peers, what)
		}
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d := newDecode(t, devices(t, "inproc", "d")[0])
	var logged strings.Builder
	var mu sync.Mutex
	log := slog.New(slog.NewTextHandler(writerFunc(func(b []byte) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		return logged.Write(b)
	}), nil))
	ln := listen(t)
	go d.Serve(ctx, ln, SetupConfig{Name: "d", Insecure: true, Timeout: 5 * time.Second, Log: log})
	prefillHi := (&hello{role: 'P', name: "p", pageTokens: pageTokens, pageBytes: pageBytes, maxRequestPages: 1, recvSlots: RecvSlots}).encode()
	v2 = append([]byte(helloFormat1), prefillHi[len(helloMagic)+1:]...)
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write(frame(v2))
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var n [2]byte
	if _, err := io.ReadFull(c, n[:]); err != nil {
		t.Fatalf("the decode node did not answer a version-2 hello with its version: %v", err)
	}
	got := make([]byte, binary.BigEndian.Uint16(n[:]))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, versionHello()) {
		t.Fatalf("the decode node answered %q (%v), want its version %q", got, err, versionHello())
	}
	if _, err := io.Copy(io.Discard, c); err != nil {
		t.Fatalf("the decode node did not close the connection: %v", err)
	}
	eventually(t, "the refusal logged", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return strings.Contains(logged.String(), fmt.Sprintf("wire version 2 or earlier, this node speaks version %d", protocol.Version))
	})
	d.Poll(time.Now())
	if s := d.Stats(); s.Peers != 0 || len(d.conns) != 0 {
		t.Fatalf("a prefill node of version 2 got %d live and %d other queue pairs", s.Peers, len(d.conns))
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }

// A queue pair whose setup fails after it connected (the dialer refuses
// the hello's life, and goes away) can break twice over: its provider
// flushes it as the peer's end goes, which settles it, and the setup then
// abandons it, or makes it live. Settled twice, its buffers went back to
// the spares twice, the next two queue pairs shared them, and one's SEND
// carried the other's Grant (a rolling restart's request waited 10 s for a
// Grant that had gone to another prefill node). Made live, a dead queue
// pair replaced the peer's live one. A queue pair is settled once, and one
// that broke as it was set up never goes live.
func TestAQueuePairBrokenAsItIsSetUpIsSettledOnceAndNeverGoesLive(t *testing.T) {
	devs := devices(t, "inproc", "decode-1")
	d := newDecode(t, devs[0])
	settled := func(c *conn) {
		t.Helper()
		eventually(t, "the broken queue pair settled", func() bool {
			d.Poll(time.Now())
			d.mu.Lock()
			defer d.mu.Unlock()
			return d.conns[c.peer] == nil
		})
	}
	broken := func() *conn {
		t.Helper()
		d.mu.Lock()
		c, err := d.newConn("prefill-1", 8)
		if err == nil {
			d.cut(c, fmt.Errorf("%w: its peer's end went", protocol.ErrPeerFailed))
		}
		d.mu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		settled(c)
		return c
	}
	c := broken()
	d.abandon(c, errors.New("the setup's ready: EOF"))
	if err := d.attach(broken(), nil); err == nil {
		t.Fatal("a queue pair broken as it was set up went live")
	}
	d.mu.Lock()
	spared := map[*buffers]int{}
	for _, b := range d.spare {
		spared[b]++
	}
	d.mu.Unlock()
	if len(spared) != len(d.spare) {
		t.Fatalf("%d spares of %d buffers: a queue pair's buffers were spared twice", len(d.spare), len(spared))
	}
	// Two queue pairs from the spares get buffers of their own.
	d.mu.Lock()
	defer d.mu.Unlock()
	a, err := d.newConn("prefill-1", 8)
	if err != nil {
		t.Fatal(err)
	}
	b, err := d.newConn("prefill-2", 8)
	if err != nil {
		t.Fatal(err)
	}
	if a.bufs == b.bufs {
		t.Fatal("two queue pairs share their buffers")
	}
}

// decodeHello never panics on a peer's bytes, refuses them with errHello or
// ErrWireVersion (the setup says which), and takes only what encode
// writes, byte for byte: no field is read past, none left unread. CI
// fuzzes it (.ci/run); go test runs the seeds.
func FuzzDecodeHello(f *testing.F) {
	h := &hello{role: 'P', name: "prefill-0", incarnation: 7, pageTokens: 16, pageBytes: 4096, maxRequestPages: 8, recvSlots: RecvSlots}
	h.info.Fabric, h.info.Node = "inproc", "n"
	now := h.encode()
	f.Add(now)
	f.Add(now[:len(now)-1])
	f.Add(append(bytes.Clone(now), 0))
	f.Add(append([]byte(helloFormat1), now[len(helloMagic)+1:]...))
	f.Add(versionHello())
	f.Add([]byte("KVHS"))
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := decodeHello(b)
		if err != nil {
			if !errors.Is(err, errHello) && !errors.Is(err, ErrWireVersion) {
				t.Fatalf("refused with %v, want errHello or ErrWireVersion", err)
			}
			return
		}
		if again := got.encode(); !bytes.Equal(again, b) {
			t.Fatalf("took %x as %+v, which encodes as %x", b, got, again)
		}
	})
}
