package transfer

import (
	"bytes"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma"
)

// rogueRig is a decode node with two prefill peers: prefill-1, well behaved,
// and rogue, an authenticated peer (a valid certificate, a queue pair of its
// own) that WRITEs where it likes with any key it has held.
type rogueRig struct {
	t           *testing.T
	d           *Decode
	good, rogue *Prefill
	now         time.Time
	mu          sync.Mutex
	grants      map[protocol.RequestID]protocol.Grant // as sent, with their keys
	verified    map[protocol.RequestID]bool
}

func newRogueRig(t *testing.T, provider string, sw research.Switches) *rogueRig {
	t.Helper()
	devs := devices(t, provider, "prefill-1", "rogue", "decode")
	d, err := NewDecode(devs[2], DecodeConfig{Pages: 256, PageTokens: pageTokens, PageBytes: pageBytes, Timeout: time.Minute, Research: sw})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Close)
	r := &rogueRig{t: t, d: d, good: newPrefill(t, devs[0]), rogue: newPrefill(t, devs[1]), now: time.Unix(1, 0),
		grants: map[protocol.RequestID]protocol.Grant{}, verified: map[protocol.RequestID]bool{}}
	for name, p := range map[string]*Prefill{"prefill-1": r.good, "rogue": r.rogue} {
		if err := ConnectLocal(p, name, d, "decode"); err != nil {
			t.Fatal(err)
		}
	}
	d.mu.Lock()
	for _, c := range d.names {
		c.sentHook = func(m protocol.Message) {
			if g, ok := m.(*protocol.Grant); ok {
				r.mu.Lock()
				r.grants[g.Request] = protocol.Grant{Request: g.Request, Tokens: g.Tokens, Pages: slices.Clone(g.Pages)}
				r.mu.Unlock()
			}
		}
	}
	d.mu.Unlock()
	return r
}

func (r *rogueRig) poll() {
	r.now = r.now.Add(time.Millisecond)
	r.good.Poll(r.now)
	r.rogue.Poll(r.now)
	r.d.Poll(r.now)
	for _, ev := range r.d.Events() {
		if ev.Kind == Verified {
			r.verified[ev.Request] = true
		}
	}
	r.good.Events()
	r.rogue.Events()
	time.Sleep(50 * time.Microsecond)
}

func (r *rogueRig) until(what string, cond func() bool) {
	r.t.Helper()
	eventually(r.t, what, func() bool { r.poll(); return cond() })
}

func (r *rogueRig) grant(id protocol.RequestID) (protocol.Grant, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	g, ok := r.grants[id]
	return g, ok
}

// verifiedRequest submits request id of 4 pages on prefill-1 and waits
// until decode has verified it (not yet read); it returns its Grant.
func (r *rogueRig) verifiedRequest(id protocol.RequestID) protocol.Grant {
	r.t.Helper()
	if err := r.good.Submit(id, "decode", 4*pageTokens); err != nil {
		r.t.Fatal(err)
	}
	r.until("request verified", func() bool { return r.verified[id] })
	g, _ := r.grant(id)
	return g
}

// reservedBy has p send a Bootstrap of its own making for request id (its
// endpoint never submitted it, so it will not write): decode grants it 2
// pages, whose windows stay bound on p's queue pair, and p holds the key.
func (r *rogueRig) reservedBy(p *Prefill, id protocol.RequestID) protocol.Grant {
	r.t.Helper()
	b, err := protocol.AppendMessage(nil, &protocol.Bootstrap{Request: id, Tokens: 2 * pageTokens})
	if err != nil {
		r.t.Fatal(err)
	}
	rawSend(r.t, p, "decode", b, 0)
	r.until("the Grant sent", func() bool { _, ok := r.grant(id); return ok })
	g, _ := r.grant(id)
	return g
}

var rogueBytes = bytes.Repeat([]byte{0xEE}, 64)

// rawWrite posts a WRITE of 64 bytes of 0xEE on p's queue pair to decode,
// at addr under key, bypassing the endpoint.
func rawWrite(t *testing.T, p *Prefill, addr uint64, key uint32) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	c := p.names["decode"]
	last := (p.cfg.Pages - 1) * p.cfg.PageBytes // a source page no request of these tests uses
	copy(p.src.Bytes()[last:], rogueBytes)
	if err := c.postSend(rdma.WorkRequest{Op: rdma.OpWrite, Local: rdma.SGE{MR: p.src, Offset: last, Length: 64},
		RemoteAddr: addr, RKey: key}, wrKind{tag: -1, msg: -1}); err != nil {
		t.Fatal(err)
	}
}

// at is the decode region's 64 bytes at addr.
func (r *rogueRig) at(addr uint64) []byte {
	off := addr - r.d.kv.Addr()
	return r.d.kv.Bytes()[off : off+64]
}

// refusedOrLanded waits for the WRITE from p at addr to be decided: its
// bytes landed, or p's queue pair to decode broke. It reports whether they
// landed, and checks that a refusal broke p's queue pair only.
func (r *rogueRig) refusedOrLanded(p *Prefill, offender string, addr uint64) bool {
	r.t.Helper()
	landed := func() bool { return bytes.Equal(r.at(addr), rogueBytes) }
	r.until("the WRITE landed or was refused", func() bool { return landed() || len(p.Peers()) == 0 })
	if landed() {
		return true
	}
	r.until("decode drops the offender's queue pair", func() bool { return !slices.Contains(r.d.Peers(), offender) })
	if offender == "rogue" && !slices.Contains(r.d.Peers(), "prefill-1") {
		r.t.Fatalf("a refused rogue WRITE broke the well-behaved peer's queue pair: peers %v", r.d.Peers())
	}
	return false
}

// answerIsOwn reads request id (verified) and reports whether every page is
// its own KV.
func (r *rogueRig) answerIsOwn(id protocol.RequestID) bool {
	r.t.Helper()
	pages, err := r.d.Acquire(id)
	if err != nil {
		r.t.Fatalf("request %d: %v", id, err)
	}
	defer r.d.Finish(id)
	for i, ref := range pages {
		if !bytes.Equal(r.d.Payload(ref.Page), kv(id, i)) {
			return false
		}
	}
	return true
}

func (r *rogueRig) pageAddr(page uint32) uint64 {
	return r.d.kv.Addr() + uint64(int(page)*r.d.slotBytes())
}

// The attacks on the decode pool, over every provider: an
// authenticated peer WRITEs 64 bytes into a page it was not granted, with a
// key it holds. With per-grant windows each is a remote access error that
// breaks the rogue's queue pair only; nothing lands and request 1's answer is
// its own. Under pool-wide-key (every Grant carries the region's key, never
// revoked) the same WRITEs land, and the verified KV changes.
func TestRogueWriteIsRefusedByPerGrantWindows(t *testing.T) {
	skipUnderRace(t)
	attacks := []struct {
		name string
		// aim returns where the rogue WRITEs and under which key, given
		// request 1's grant (verified, on prefill-1), the rogue's own
		// reservation, request 2, and prefill-1's reservation, request 3,
		// still waiting for its KV (its windows bound on prefill-1's queue
		// pair).
		aim func(r *rogueRig, g1, g2, g3 protocol.Grant) (addr uint64, key uint32)
		// poolKeyLands: under pool-wide-key the WRITE lands.
		poolKeyLands bool
	}{
		{"the region's key at request 1's page 0 (the issue's reproduction)", func(r *rogueRig, g1, _, _ protocol.Grant) (uint64, uint32) {
			return g1.Pages[0].Addr, r.d.kv.RKey()
		}, true},
		{"its own grant's key at another request's granted page", func(_ *rogueRig, g1, g2, _ protocol.Grant) (uint64, uint32) {
			return g1.Pages[0].Addr, g2.Pages[0].Key
		}, true},
		{"its own grant's key at an ungranted page", func(r *rogueRig, g1, g2, g3 protocol.Grant) (uint64, uint32) {
			return r.pageAddr(ungranted(g1, g2, g3)), g2.Pages[0].Key
		}, false},
		{"request 1's revoked key, from its own queue pair", func(_ *rogueRig, g1, _, _ protocol.Grant) (uint64, uint32) {
			return g1.Pages[0].Addr, g1.Pages[0].Key
		}, true},
		{"a live key of prefill-1's request 3, from its own queue pair", func(_ *rogueRig, _, _, g3 protocol.Grant) (uint64, uint32) {
			return g3.Pages[0].Addr, g3.Pages[0].Key
		}, true},
		{"a guessed key", func(_ *rogueRig, g1, g2, _ protocol.Grant) (uint64, uint32) {
			return g1.Pages[0].Addr, g2.Pages[0].Key ^ 0xFF
		}, false},
	}
	for _, provider := range providerNames() {
		t.Run(provider, func(t *testing.T) {
			for _, a := range attacks {
				for _, sw := range []research.Switches{{}, research.On(research.PoolWideKey)} {
					if sw.Any() && !a.poolKeyLands {
						continue
					}
					t.Run(a.name+"/"+sw.String(), func(t *testing.T) {
						r := newRogueRig(t, provider, sw)
						g2 := r.reservedBy(r.rogue, 2)
						g3 := r.reservedBy(r.good, 3)
						g1 := r.verifiedRequest(1)
						addr, key := a.aim(r, g1, g2, g3)
						rawWrite(t, r.rogue, addr, key)
						landed := r.refusedOrLanded(r.rogue, "rogue", addr)
						own := r.answerIsOwn(1)
						atRequest1 := addr == g1.Pages[0].Addr
						switch {
						case !sw.Any() && (landed || !own):
							t.Fatalf("with per-grant windows the rogue's WRITE landed (%v) or request 1's answer changed (own %v)", landed, own)
						case sw.Any() && (!landed || (atRequest1 && own)):
							t.Fatalf("under pool-wide-key the rogue's WRITE must land (landed %v), changing request 1's verified KV if aimed there (answer own %v)", landed, own)
						}
					})
				}
			}
		})
	}
}

// ungranted is a page in neither grant.
func ungranted(gs ...protocol.Grant) uint32 {
	used := map[uint32]bool{}
	for _, g := range gs {
		for _, p := range g.Pages {
			used[p.Page] = true
		}
	}
	for p := uint32(0); ; p++ {
		if !used[p] {
			return p
		}
	}
}

// A verified page cannot change until it is freed: request 1's own sender,
// which held the key of its Grant, WRITEs into page 0 after Done. Its
// windows were invalidated before verification, so the WRITE is a remote
// access error (the offender's queue pair breaks), and the answer is the KV
// that verified. Under verify-before-revoke (Done verified first, the windows
// revoked only at release) the WRITE lands in the verified page. And a key
// of a request already read opens nothing on the pages the next request is
// granted (a stale key).
func TestVerifiedPagesCannotChange(t *testing.T) {
	skipUnderRace(t)
	for _, provider := range providerNames() {
		t.Run(provider, func(t *testing.T) {
			for _, sw := range []research.Switches{{}, research.On(research.VerifyBeforeRevoke)} {
				t.Run("after Done/"+sw.String(), func(t *testing.T) {
					r := newRogueRig(t, provider, sw)
					g1 := r.verifiedRequest(1)
					rawWrite(t, r.good, g1.Pages[0].Addr, g1.Pages[0].Key)
					landed := r.refusedOrLanded(r.good, "prefill-1", g1.Pages[0].Addr)
					own := r.answerIsOwn(1)
					switch {
					case !sw.Any() && (landed || !own):
						t.Fatalf("a WRITE after Done landed in a verified page (landed %v, answer own %v)", landed, own)
					case sw.Any() && (!landed || own):
						t.Fatalf("under verify-before-revoke the sender's WRITE after Done must land in the verified page (landed %v, answer own %v)", landed, own)
					}
				})
			}
			for _, sw := range []research.Switches{{}, research.On(research.PoolWideKey)} {
				t.Run("stale key/"+sw.String(), func(t *testing.T) {
					r := newRogueRig(t, provider, sw)
					g1 := r.verifiedRequest(1)
					if !r.answerIsOwn(1) { // read and freed
						t.Fatal("request 1 read foreign KV")
					}
					g3 := r.verifiedRequest(3) // the freed pages again, most recently freed first
					target := g3.Pages[0].Addr
					rawWrite(t, r.good, target, g1.Pages[0].Key)
					landed := r.refusedOrLanded(r.good, "prefill-1", target)
					own := r.answerIsOwn(3)
					switch {
					case !sw.Any() && (landed || !own):
						t.Fatalf("a stale key wrote into the next request's page (landed %v, answer own %v)", landed, own)
					case sw.Any() && (!landed || own):
						t.Fatalf("under pool-wide-key the stale key must still open the pool (landed %v, answer own %v)", landed, own)
					}
				})
			}
		})
	}
}

// Windows are recycled: a thousand requests, of up to 7 pages, and one of
// 200, leave no more windows than the pool has pages, none of them bound.
func TestWindowsAreRecycledWithoutGrowth(t *testing.T) {
	cfg := defaultLink()
	cfg.DecodePages, cfg.PrefillPages = 256, 256
	overEachProvider(t, cfg, func(t *testing.T, l *link) {
		n := protocol.RequestID(1000)
		if testing.Short() || strings.HasSuffix(t.Name(), "/verbs") { // Soft-RoCE in QEMU: the VM's transfer stage has 300 s
			n = 200
		}
		for id := protocol.RequestID(1); id <= n; id++ {
			if err := l.submit(id, 1+int(id%7)*pageTokens); err != nil {
				t.Fatal(err)
			}
			if id%50 == 0 {
				l.pump()
			}
		}
		if err := l.submit(n+1, 200*pageTokens); err != nil {
			t.Fatal(err)
		}
		l.pump()
		for id := protocol.RequestID(1); id <= n+1; id++ {
			if !l.succeeded(id) {
				t.Fatalf("request %d: outcomes %v", id, l.outcomes[id])
			}
		}
		l.noLeak(t, 256, 256)
		l.D.mu.Lock()
		defer l.D.mu.Unlock()
		w := l.D.win
		if len(w.byReq) != 0 || w.live != len(w.free) || w.live > 256 {
			t.Fatalf("windows: %d requests still hold some, %d live, %d free (pool of 256 pages)", len(w.byReq), w.live, len(w.free))
		}
		t.Logf("%d windows for %d requests", w.live, n+1)
	})
}

// uncheckedDevice is a device whose protection domains declare window ranges
// unchecked (as rxe's do), so that decode binds one window per page, on a
// region of that page.
type uncheckedDevice struct{ rdma.Device }

type uncheckedPD struct{ rdma.ProtectionDomain }

func (d uncheckedDevice) AllocPD() (rdma.ProtectionDomain, error) {
	pd, err := d.Device.AllocPD()
	return uncheckedPD{pd}, err
}

func (p uncheckedPD) AllocWindow() (rdma.MemoryWindow, error) {
	return p.ProtectionDomain.(rdma.WindowDomain).AllocWindow()
}

func (uncheckedPD) WindowRangesUnchecked() bool { return true }

// Where a provider's windows do not check their range, decode binds each
// page's window on a region of that page alone: handoffs of many pages
// complete, and a request's window opens no byte past its own page.
func TestWindowsOnPageRegionsWhereRangesAreUnchecked(t *testing.T) {
	prefill, decode := providers["inproc"](t)
	l := newLink(t, defaultLink(), prefill, uncheckedDevice{decode})
	if l.D.win.pageRegions == nil {
		t.Fatal("decode did not register page regions for a provider with unchecked window ranges")
	}
	for id := protocol.RequestID(1); id <= 40; id++ {
		if err := l.submit(id, int(id)*5); err != nil {
			t.Fatal(err)
		}
		l.pump()
		if !l.succeeded(id) {
			t.Fatalf("request %d: outcomes %v", id, l.outcomes[id])
		}
	}
	l.noLeak(t, 64, 32)
	for p, m := range l.D.win.pageRegions {
		if m.Len() != l.D.slotBytes() || &m.Bytes()[0] != &l.D.kv.Bytes()[p*l.D.slotBytes()] {
			t.Fatalf("page %d's region is not its page and tag slot", p)
		}
	}
}

// A Grant whose SEND is posted again (refused once, its binds done) keeps
// the keys it was bound under; a Grant for a request whose pages went back
// before it could go names keys that open nothing.
func TestGrantPostedAgainKeepsItsKeys(t *testing.T) {
	r := newRogueRig(t, "inproc", research.Switches{})
	g := r.reservedBy(r.rogue, 5)
	r.d.mu.Lock()
	defer r.d.mu.Unlock()
	c := r.d.names["rogue"]
	again := protocol.Grant{Request: g.Request, Tokens: g.Tokens, Pages: slices.Clone(g.Pages)}
	if err := r.d.win.bind(c, &again); err != nil || !slices.Equal(again.Pages, g.Pages) {
		t.Fatalf("posted again: %v, pages %+v, first sent %+v", err, again.Pages, g.Pages)
	}
	ended := protocol.Grant{Request: 999, Tokens: g.Tokens, Pages: slices.Clone(g.Pages)}
	if err := r.d.win.bind(c, &ended); err != nil || ended.Pages[0].Key != 0 || r.d.win.byReq[999] != nil {
		t.Fatalf("a Grant of a request holding no pages: %v, key %#x", err, ended.Pages[0].Key)
	}
}

// An AbortAck is a fence like Done: the windows of the request it ends are
// revoked before its pages go back. The rogue's request is cancelled, it
// acknowledges, its pages go back and are granted to request 1 (prefill-1),
// verified; a WRITE under the rogue's old key at its old page is refused
// and request 1's answer stays its own.
func TestAbortAckRevokesWindowsBeforeThePagesGoBack(t *testing.T) {
	skipUnderRace(t)
	for _, provider := range providerNames() {
		t.Run(provider, func(t *testing.T) {
			r := newRogueRig(t, provider, research.Switches{})
			g2 := r.reservedBy(r.rogue, 2)
			r.d.Cancel(2)
			b, err := protocol.AppendMessage(nil, &protocol.AbortAck{Request: 2})
			if err != nil {
				t.Fatal(err)
			}
			rawSend(t, r.rogue, "decode", b, 0)
			r.until("request 2 closed", func() bool { return r.d.Status(2) == protocol.ReceiverClosed })
			g1 := r.verifiedRequest(1)
			reused := slices.ContainsFunc(g1.Pages, func(p protocol.PageGrant) bool { return p.Page == g2.Pages[0].Page })
			rawWrite(t, r.rogue, r.pageAddr(g2.Pages[0].Page), g2.Pages[0].Key)
			landed := r.refusedOrLanded(r.rogue, "rogue", r.pageAddr(g2.Pages[0].Page))
			if own := r.answerIsOwn(1); landed || !own {
				t.Fatalf("old key after AbortAck: landed %v, request 1 own %v (page reused %v)", landed, own, reused)
			}
		})
	}
}

// holdSends pauses p's queue pair to decode right after a Grant of a
// request p's endpoint never submitted went out: the AbortAck its Sender
// answers with waits in the network until the returned resume, so the
// request stays reserved, its windows bound on p's queue pair.
func holdSends(t *testing.T, p *Prefill) (resume func()) {
	t.Helper()
	p.mu.Lock()
	qp := p.names["decode"].qp.(rdma.Faults)
	p.mu.Unlock()
	qp.Pause()
	return qp.Resume
}

// A Done revokes only the windows of a request of its sender's: the rogue's
// Done for request 1, whose windows are bound on prefill-1's queue pair,
// neither revokes them nor reaches the Receiver as prefill-1's Done.
func TestDoneFromAnotherPeerRevokesNoWindow(t *testing.T) {
	for _, provider := range providerNames() {
		t.Run(provider, func(t *testing.T) {
			r := newRogueRig(t, provider, research.Switches{})
			g1 := r.reservedBy(r.good, 1)
			resume := holdSends(t, r.good)
			b, err := protocol.AppendMessage(nil, &protocol.Done{Request: 1, Tokens: g1.Tokens, Pages: uint32(len(g1.Pages))})
			if err != nil {
				t.Fatal(err)
			}
			rawSend(t, r.rogue, "decode", b, 0)
			r.until("the rogue's Done refused, or taken for a revocation", func() bool {
				r.d.mu.Lock()
				rw := r.d.win.byReq[1]
				judged := r.d.refused > 0 || rw == nil || rw.held != nil || rw.pending > 0
				r.d.mu.Unlock()
				return judged || !slices.Contains(r.d.Peers(), "rogue")
			})
			for range 20 {
				r.poll()
			}
			r.d.mu.Lock()
			rw := r.d.win.byReq[1]
			bound := rw != nil && len(rw.wins) > 0 && rw.pending == 0 && rw.held == nil
			r.d.mu.Unlock()
			if st := r.d.Status(1); !bound || st != protocol.ReceiverReserved {
				t.Fatalf("after the rogue's Done for prefill-1's request: windows still bound %v, status %v", bound, st)
			}
			resume() // prefill-1's own AbortAck ends it, windows and all
			r.until("request 1 closed by its own peer", func() bool { return r.d.Status(1) == protocol.ReceiverClosed })
			r.d.mu.Lock()
			defer r.d.mu.Unlock()
			if r.d.win.byReq[1] != nil {
				t.Fatal("request 1's windows outlived its own peer's AbortAck")
			}
		})
	}
}

// A queue pair that decode cuts takes its windows with it, closed (an
// invalidate cannot run there), before the Receiver hears of its fence and
// the request's pages go back.
func TestCutQueuePairsWindowsAreClosedBeforeItsFence(t *testing.T) {
	for _, provider := range providerNames() {
		t.Run(provider, func(t *testing.T) {
			r := newRogueRig(t, provider, research.Switches{})
			r.reservedBy(r.rogue, 2)
			defer holdSends(t, r.rogue)()
			r.d.mu.Lock()
			wins := slices.Clone(r.d.win.byReq[2].wins)
			r.d.cut(r.d.names["rogue"], protocol.ErrPeerFailed)
			r.d.mu.Unlock()
			r.until("request 2 ended by the fence", func() bool { return r.d.Status(2) != protocol.ReceiverReserved })
			r.d.mu.Lock()
			defer r.d.mu.Unlock()
			w := r.d.win
			bound := 0
			for _, rw := range w.byReq {
				bound += len(rw.wins)
			}
			if len(wins) == 0 || w.byReq[2] != nil || w.live != len(w.free)+bound || slices.ContainsFunc(w.free, func(f rdma.MemoryWindow) bool { return slices.Contains(wins, f) }) {
				t.Fatalf("after the fence: request 2 holds windows %v, %d live, %d free, %d bound", w.byReq[2] != nil, w.live, len(w.free), bound)
			}
		})
	}
}

// A Grant waiting at the head of the backlog, for a credit or for room in
// the send queue, costs a flush pass no allocation: its runs are computed
// once, after the cheap checks, and kept with it. 300 pages, every other
// one (300 runs).
func TestWaitingGrantIsSplitIntoRunsOnce(t *testing.T) {
	g := &protocol.Grant{Request: 1, Tokens: 300 * pageTokens}
	for i := range 300 {
		g.Pages = append(g.Pages, protocol.PageGrant{Page: uint32(2 * i)})
	}
	for name, block := range map[string]func(c *conn){
		"no credit":          func(c *conn) { c.credits = 1 },
		"send queue is full": func(c *conn) { c.wrs[1] = wrKind{tag: -1, msg: -1} },
	} {
		t.Run(name, func(t *testing.T) {
			c := newConn(1, "prefill-1", nil, &buffers{}, 64, 64, 8, 512)
			block(c)
			c.backlog = []protocol.Op{{Peer: 1, Msg: g}}
			w := &grantWindows{}
			flush := func() {
				if err := c.flush(nil, 0, w); err != nil || len(c.backlog) != 1 {
					t.Fatalf("the Grant did not wait: %v, backlog %d", err, len(c.backlog))
				}
			}
			flush()
			if a := testing.AllocsPerRun(100, flush); a != 0 {
				t.Fatalf("%v allocations per flush pass while a Grant of 300 runs waits", a)
			}
		})
	}
}

func (p uncheckedPD) Deregister(m rdma.MemoryRegion) error {
	return p.ProtectionDomain.(rdma.Deregistrar).Deregister(m)
}

// Close frees what the grant windows hold on the device: every window,
// free or bound (a request still reserved), closed; every page region,
// where ranges are unchecked, deregistered, so its key opens nothing and it
// cannot be deregistered twice.
func TestCloseFreesWindowsAndPageRegions(t *testing.T) {
	for _, unchecked := range []bool{false, true} {
		t.Run(map[bool]string{false: "runs", true: "page regions"}[unchecked], func(t *testing.T) {
			prefill, decode := providers["inproc"](t)
			if unchecked {
				decode = uncheckedDevice{decode}
			}
			l := newLink(t, defaultLink(), prefill, decode)
			for id := protocol.RequestID(1); id <= 20; id++ {
				if err := l.submit(id, int(id)*5); err != nil {
					t.Fatal(err)
				}
				l.pump()
			}
			l.D.mu.Lock()
			w := l.D.win
			pages := slices.Clone(w.pageRegions)
			wins := slices.Clone(w.free)
			l.D.mu.Unlock()
			if len(wins) == 0 || unchecked != (len(pages) > 0) {
				t.Fatalf("before Close: %d free windows, %d page regions", len(wins), len(pages))
			}
			l.D.Close()
			if err := l.D.CloseErr(); err != nil {
				t.Fatal(err)
			}
			if w.live != 0 || len(w.free) != 0 || len(w.byReq) != 0 {
				t.Fatalf("after Close: %d windows live, %d free, %d requests hold some", w.live, len(w.free), len(w.byReq))
			}
			for _, win := range wins {
				if !win.(interface{ Closed() bool }).Closed() {
					t.Fatal("a free window was left open by Close")
				}
			}
			for p, m := range pages {
				if err := l.D.pd.(rdma.Deregistrar).Deregister(m); !errors.Is(err, rdma.ErrBadRequest) {
					t.Fatalf("page %d's region was still registered after Close: %v", p, err)
				}
			}
		})
	}
}

// Done reaches the Receiver only once its request's windows are revoked:
// while decode's queue pair is paused (Pause holds its work requests, binds
// and invalidates included), the invalidates wait and so does Done; at
// Resume they run, and the request is verified.
func TestHeldInvalidateHoldsDoneBack(t *testing.T) {
	for _, provider := range providerNames() {
		t.Run(provider, func(t *testing.T) {
			r := newRogueRig(t, provider, research.Switches{})
			if err := r.good.Submit(1, "decode", 4*pageTokens); err != nil {
				t.Fatal(err)
			}
			r.good.Poll(r.now) // the Bootstrap
			r.d.mu.Lock()
			c := r.d.names["prefill-1"]
			r.d.mu.Unlock()
			// Decode alone runs until its Grant's SEND has completed; prefill-1
			// has not yet read it, so nothing of request 1 is written.
			eventually(t, "the Grant sent", func() bool {
				r.now = r.now.Add(time.Millisecond)
				r.d.Poll(r.now)
				_, sent := r.grant(1)
				r.d.mu.Lock()
				defer r.d.mu.Unlock()
				return sent && len(c.wrs) == 0
			})
			qp := c.qp.(rdma.Faults)
			qp.Pause()
			held := func() bool {
				r.d.mu.Lock()
				defer r.d.mu.Unlock()
				rw := r.d.win.byReq[1]
				return rw != nil && rw.held != nil
			}
			r.until("Done arrived", func() bool { return held() || r.verified[1] })
			for range 20 {
				r.poll()
			}
			if !held() || r.verified[1] {
				t.Fatalf("with its invalidates held, Done held %v, request verified %v", held(), r.verified[1])
			}
			qp.Resume()
			r.until("request 1 verified once its windows are revoked", func() bool { return r.verified[1] })
			if !r.answerIsOwn(1) {
				t.Fatal("request 1's answer is not its own")
			}
		})
	}
}

// skipUnderRace skips a test that reads decode pages while a peer's WRITE
// may be placing bytes in them: the foreign WRITE the test shows landing, or
// races to see refused, is memory written by the provider's goroutine with no
// Go synchronization the reader can share (a NIC's placement, over a socket
// for the socket provider), which the race detector rightly reports. These
// tests run in every run without -race.
func skipUnderRace(t *testing.T) {
	t.Helper()
	if raceDetector {
		t.Skip("reads pages a peer's WRITE may be placing at that moment: run without -race")
	}
}
