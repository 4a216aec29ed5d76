package transfer

import (
	"bytes"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/inproc"
	"github.com/kvhandoff/kvhandoff/rdma/socket"
)

const (
	pageBytes  = 4096
	pageTokens = 16
)

// providers are the transports every handoff test runs over: each makes a
// prefill device and a decode device. verbs_test.go adds verbs under its tag.
var providers = map[string]func(t *testing.T) (prefill, decode rdma.Device){
	"inproc": func(t *testing.T) (rdma.Device, rdma.Device) {
		f := inproc.NewFabric(t.Name())
		return f.Device("prefill"), f.Device("decode")
	},
	"socket": func(t *testing.T) (rdma.Device, rdma.Device) {
		return listenSocket(t, "prefill"), listenSocket(t, "decode")
	},
}

// socketCA is the authority of the socket devices' certificates.
var socketCA = sync.OnceValues(func() (*pki.CA, error) { return pki.NewCA("transfer-test") })

// listenSocket opens a socket device authenticating as node name.
func listenSocket(t *testing.T, name string) rdma.Device {
	ca, err := socketCA()
	if err != nil {
		t.Fatal(err)
	}
	tc, err := ca.Config(name)
	if err != nil {
		t.Fatal(err)
	}
	d, err := socket.Listen("tcp", "127.0.0.1:0", socket.Config{TLS: tc})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// link is the test fixture: one Prefill and one Decode endpoint joined by one
// queue pair (ConnectLocal), driven by Poll from the test's goroutine, with
// every event collected and every verified request read and compared with
// the KV that was computed for it.
type link struct {
	t        *testing.T
	P        *Prefill
	D        *Decode
	outcomes map[protocol.RequestID][2]error // [prefill, decode]
	reported map[protocol.RequestID][2]bool
	now      time.Time
}

type linkConfig struct {
	DecodePages, PrefillPages int
	MaxRequestPages           int
	QueueDepth                int
	Timeout                   time.Duration
}

func defaultLink() linkConfig {
	return linkConfig{DecodePages: 64, PrefillPages: 32, Timeout: time.Hour}
}

func newLink(t *testing.T, cfg linkConfig, prefill, decode rdma.Device) *link {
	t.Helper()
	p, err := NewPrefill(prefill, PrefillConfig{Pages: cfg.PrefillPages, PageTokens: pageTokens, PageBytes: pageBytes,
		MaxRequestPages: cfg.MaxRequestPages, QueueDepth: cfg.QueueDepth})
	if err != nil {
		t.Fatal(err)
	}
	d, err := NewDecode(decode, DecodeConfig{Pages: cfg.DecodePages, PageTokens: pageTokens, PageBytes: pageBytes,
		QueueDepth: cfg.QueueDepth, Timeout: cfg.Timeout})
	if err != nil {
		t.Fatal(err)
	}
	if err := ConnectLocal(p, "prefill", d, "decode"); err != nil {
		t.Fatal(err)
	}
	return &link{t: t, P: p, D: d, outcomes: map[protocol.RequestID][2]error{}, reported: map[protocol.RequestID][2]bool{}, now: time.Unix(1, 0)}
}

// overEachProvider runs test once per provider.
func overEachProvider(t *testing.T, cfg linkConfig, test func(t *testing.T, l *link)) {
	for _, name := range slices.Sorted(maps.Keys(providers)) {
		t.Run(name, func(t *testing.T) {
			prefill, decode := providers[name](t)
			test(t, newLink(t, cfg, prefill, decode))
		})
	}
}

// faults are the prefill side's queue pair's fault hooks.
func (l *link) faults() rdma.Faults {
	l.P.mu.Lock()
	defer l.P.mu.Unlock()
	return l.P.names["decode"].qp.(rdma.Faults)
}

func (l *link) submit(id protocol.RequestID, tokens int) error {
	return l.P.Submit(id, "decode", tokens)
}

// kv is the KV request id's page i must hold: every page of every request differs.
func kv(id protocol.RequestID, i int) []byte {
	page := make([]byte, pageBytes)
	GenerateKV(id, i, pageTokens, page)
	return page
}

// busy says whether either endpoint has work requests outstanding or waiting.
func busy(e *endpoint) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, c := range e.conns {
		if len(c.wrs) > 0 || len(c.backlog) > 0 && !c.broken {
			return true
		}
	}
	return false
}

// step polls both endpoints once, waiting up to wait for a completion when
// neither had one, and handles their events. It returns what happened.
func (l *link) step(wait time.Duration) int {
	l.now = l.now.Add(time.Millisecond)
	n := l.P.Poll(l.now) + l.D.Poll(l.now)
	if n == 0 && wait > 0 {
		if wcs := l.P.cq.Wait(256, wait/2); len(wcs) > 0 {
			n += l.P.handle(l.now, wcs)
		}
		if wcs := l.D.cq.Wait(256, wait/2); len(wcs) > 0 {
			n += l.D.handle(l.now, wcs)
		}
	}
	return n + l.events()
}

func (l *link) events() int {
	n := 0
	for side, e := range []*endpoint{&l.P.endpoint, &l.D.endpoint} {
		for _, ev := range e.Events() {
			n++
			switch ev.Kind {
			case Outcome:
				o, r := l.outcomes[ev.Request], l.reported[ev.Request]
				o[side], r[side] = ev.Err, true
				l.outcomes[ev.Request], l.reported[ev.Request] = o, r
			case Verified:
				pages, err := l.D.Acquire(ev.Request)
				if err != nil {
					continue
				}
				for i, ref := range pages {
					if !bytes.Equal(l.D.Payload(ref.Page), kv(ev.Request, i)) {
						l.t.Fatalf("request %d page %d: decode would read foreign KV", ev.Request, i)
					}
				}
				if err := l.D.Finish(ev.Request); err != nil {
					l.t.Fatal(err)
				}
			}
		}
	}
	return n
}

// pump runs the link until it settles: nothing outstanding, nothing happening.
func (l *link) pump() {
	l.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if l.step(2*time.Millisecond) == 0 && !busy(&l.P.endpoint) && !busy(&l.D.endpoint) {
			return
		}
	}
	l.t.Fatal("the link did not settle in 20 s")
}

// settleFor runs the link for about d of wall time (for work held in the network).
func (l *link) settleFor(d time.Duration) {
	for end := time.Now().Add(d); time.Now().Before(end); {
		l.step(time.Millisecond)
	}
}

func (l *link) succeeded(id protocol.RequestID) bool {
	o, r := l.outcomes[id], l.reported[id]
	return r[0] && r[1] && o[0] == nil && o[1] == nil
}

func (l *link) noLeak(t *testing.T, decodePages, prefillPages int) {
	t.Helper()
	if d, p := l.D.Stats().PagesFree, l.P.Stats().PagesFree; d != decodePages || p != prefillPages {
		t.Fatalf("pages free: decode %d of %d, prefill %d of %d", d, decodePages, p, prefillPages)
	}
}

// A decode node whose stop has ended (TraceStopped, every page back) takes
// no message after it: a Bootstrap that reaches it before its queue pairs
// close is dropped, not granted. Granted, its pages were taken after the
// stop that said none was held, and the trace check refused the node's
// trace (a mid-traffic stop under GOMAXPROCS=1, about 1 run in 7).
func TestADecodeNodeWhoseStopEndedGrantsNoBootstrap(t *testing.T) {
	overEachProvider(t, defaultLink(), func(t *testing.T, l *link) {
		if !l.D.TraceStopped(false) {
			t.Fatal("a decode endpoint that took no request holds pages")
		}
		free := l.D.Stats().PagesFree
		if err := l.submit(1, 3*pageTokens); err != nil {
			t.Fatal(err)
		}
		for range 20 {
			l.step(time.Millisecond)
		}
		if st := l.D.Status(1); st != protocol.ReceiverNone {
			t.Fatalf("the request is %v on the decode node whose stop ended, want unknown there", st)
		}
		if got := l.D.Stats().PagesFree; got != free {
			t.Fatalf("%d pages free after a Bootstrap reached the stopped node, want %d", got, free)
		}
		if l.D.Refused() == 0 {
			t.Fatal("the Bootstrap was not counted as refused")
		}
	})
}
