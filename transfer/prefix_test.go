package transfer

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// promptKV is a KVSource whose KV depends on the prompt's tokens alone, as
// a model's does: page i's bytes are a function of the tokens up to the end
// of page i, so requests sharing a prefix compute the same bytes for it.
type promptKV struct {
	mu      sync.Mutex
	prompts map[protocol.RequestID][]uint32
}

func (k *promptKV) FillKV(id protocol.RequestID, _ int, _ []uint32, memory [][]byte) error {
	k.mu.Lock()
	prompt := k.prompts[id]
	k.mu.Unlock()
	for i, p := range memory {
		promptPageKV(prompt, i, p)
	}
	return nil
}

// promptPageKV writes page i of prompt's KV into page.
func promptPageKV(prompt []uint32, i int, page []byte) {
	h := sha256.New()
	for _, t := range prompt[:min(len(prompt), (i+1)*pageTokens)] {
		h.Write(binary.BigEndian.AppendUint32(nil, t))
	}
	GenerateKV(protocol.RequestID(binary.BigEndian.Uint64(h.Sum(nil))), i, pageTokens, page)
}

// prefixRig is a prefill and a decode endpoint with the prefix cache on
// (or off), the decode side's Authorize admitting a Bootstrap only with the
// scope and chain the test dispatched (the router's ticket's job), driven
// by Poll; every verified request is read, checked against its prompt's
// KV, and its bytes kept.
type prefixRig struct {
	t        *testing.T
	P        *Prefill
	D        *Decode
	kv       *promptKV
	scopes   map[protocol.RequestID]protocol.Scope
	now      time.Time
	read     map[protocol.RequestID][][]byte
	pages    map[protocol.RequestID][]protocol.PageRef
	outcomes map[protocol.RequestID]error // decode's
	mu       sync.Mutex
	grants   map[protocol.RequestID]protocol.Grant // as sent, with their keys
	hold     bool                                  // read verified requests only when told
}

func newPrefixRig(t *testing.T, provider string, cache bool, sw research.Switches) *prefixRig {
	t.Helper()
	devs := devices(t, provider, "prefill", "decode")
	r := &prefixRig{t: t, kv: &promptKV{prompts: map[protocol.RequestID][]uint32{}}, scopes: map[protocol.RequestID]protocol.Scope{},
		now: time.Unix(1, 0), read: map[protocol.RequestID][][]byte{}, pages: map[protocol.RequestID][]protocol.PageRef{},
		outcomes: map[protocol.RequestID]error{}, grants: map[protocol.RequestID]protocol.Grant{}}
	p, err := NewPrefill(devs[0], PrefillConfig{Pages: 64, PageTokens: pageTokens, PageBytes: pageBytes, KV: r.kv})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	d, err := NewDecode(devs[1], DecodeConfig{Pages: 64, PageTokens: pageTokens, PageBytes: pageBytes, Timeout: time.Minute,
		PrefixCache: cache, Research: sw, Admission: Admission{Authorize: r.authorize}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Close)
	r.P, r.D = p, d
	if err := ConnectLocal(p, "prefill", d, "decode"); err != nil {
		t.Fatal(err)
	}
	d.mu.Lock()
	for _, c := range d.names {
		c.sentHook = func(m protocol.Message) {
			if g, ok := m.(*protocol.Grant); ok {
				r.mu.Lock()
				r.grants[g.Request] = protocol.Grant{Request: g.Request, Tokens: g.Tokens, Prefix: g.Prefix, Pages: slices.Clone(g.Pages)}
				r.mu.Unlock()
			}
		}
	}
	d.mu.Unlock()
	return r
}

func (r *prefixRig) authorize(_ string, b *protocol.Bootstrap) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	prompt, ok := r.kv.prompts[b.Request]
	if !ok || b.Scope != r.scopes[b.Request] || !slices.Equal(b.Chain, protocol.PrefixChain(prompt, pageTokens)) && b.Scope != 0 {
		return fmt.Errorf("request %d: not the scope and chain dispatched", b.Request)
	}
	return nil
}

func (r *prefixRig) dispatch(id protocol.RequestID, scope protocol.Scope, prompt []uint32) protocol.SubmitOptions {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.kv.mu.Lock()
	r.kv.prompts[id] = prompt
	r.kv.mu.Unlock()
	r.scopes[id] = scope
	if scope == 0 {
		return protocol.SubmitOptions{}
	}
	return protocol.SubmitOptions{Scope: scope, Chain: protocol.PrefixChain(prompt, pageTokens)}
}

// submit hands request id of scope to the prefill endpoint and runs the
// link until it settles; it returns the pages the prefill node wrote for it.
func (r *prefixRig) submit(id protocol.RequestID, scope protocol.Scope, prompt []uint32) uint64 {
	r.t.Helper()
	before := r.P.Stats().PagesWritten
	if err := r.P.SubmitWith(id, "decode", len(prompt), r.dispatch(id, scope, prompt)); err != nil {
		r.t.Fatal(err)
	}
	r.pump(func() bool { _, ok := r.outcomes[id]; return ok })
	if err := r.outcomes[id]; err != nil {
		r.t.Fatalf("request %d: %v", id, err)
	}
	return r.P.Stats().PagesWritten - before
}

func (r *prefixRig) poll() {
	r.now = r.now.Add(time.Millisecond)
	r.P.Poll(r.now)
	r.D.Poll(r.now)
	r.P.Events()
	for _, ev := range r.D.Events() {
		switch ev.Kind {
		case Outcome:
			r.outcomes[ev.Request] = ev.Err
		case Verified:
			if !r.hold {
				r.readAndFinish(ev.Request)
			}
		}
	}
	time.Sleep(50 * time.Microsecond)
}

// readAndFinish reads a verified request through the endpoint, as a decoder
// does: the pages Acquire gives (prefix, then written), each the request's
// prompt's KV.
func (r *prefixRig) readAndFinish(id protocol.RequestID) {
	r.t.Helper()
	refs, err := r.D.Acquire(id)
	if err != nil {
		r.t.Fatalf("request %d: %v", id, err)
	}
	r.kv.mu.Lock()
	prompt := r.kv.prompts[id]
	r.kv.mu.Unlock()
	want := make([]byte, pageBytes)
	for i, ref := range refs {
		got := bytes.Clone(r.D.Payload(ref.Page))
		promptPageKV(prompt, i, want)
		if !bytes.Equal(got, want) {
			r.t.Fatalf("request %d page %d (decode page %d): not its prompt's KV", id, i, ref.Page)
		}
		r.read[id] = append(r.read[id], got)
	}
	r.pages[id] = refs
	if err := r.D.Finish(id); err != nil {
		r.t.Fatal(err)
	}
}

func (r *prefixRig) pump(done func() bool) {
	r.t.Helper()
	eventually(r.t, "the request ended", func() bool { r.poll(); return done() })
}

func (r *prefixRig) grant(id protocol.RequestID) (protocol.Grant, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	g, ok := r.grants[id]
	return g, ok
}

// prompt is n tokens: the first shared ones common to every prompt of
// base, the rest of request id's own.
func prompt(base uint32, id protocol.RequestID, n, shared int) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = base<<20 | uint32(i)
		if i >= shared {
			p[i] = uint32(id)<<20 | 1<<19 | uint32(i)
		}
	}
	return p
}

// Issue 18's transfer figure, over inproc and socket: two requests of one
// scope sharing 75% of a 16-page prompt. The second transfers only the 4
// pages past the prefix, and decode reads, through Acquire, exactly the
// bytes a run without reuse reads. The same tokens in another scope get no
// hit and transfer all 16 pages. Every page comes back: free or cached.
func TestSharedPrefixTransfersOnlyThePagesPastIt(t *testing.T) {
	const pages, shared = 16, 12
	for _, provider := range []string{"inproc", "socket"} {
		t.Run(provider, func(t *testing.T) {
			r := newPrefixRig(t, provider, true, research.Switches{})
			first, second := prompt(1, 1, pages*pageTokens, pages*pageTokens), prompt(1, 2, pages*pageTokens, shared*pageTokens)
			if n := r.submit(1, 7, first); n != pages {
				t.Fatalf("the first request wrote %d pages, want %d", n, pages)
			}
			if n := r.submit(2, 7, second); n != pages-shared {
				t.Fatalf("the second request of the scope wrote %d pages, want %d", n, pages-shared)
			}
			if g, _ := r.grant(2); g.Prefix != shared*pageTokens || len(g.Pages) != pages-shared {
				t.Fatalf("Grant: prefix %d, %d pages", g.Prefix, len(g.Pages))
			}
			for i := range shared { // its prefix is the first request's pages, read in place
				if r.pages[2][i] != r.pages[1][i] {
					t.Fatalf("page %d: %v, the first request's was %v", i, r.pages[2][i], r.pages[1][i])
				}
			}
			if n := r.submit(3, 8, first); n != pages {
				t.Fatalf("another scope's request of the same tokens wrote %d pages, want %d: a cross-scope hit", n, pages)
			}
			plain := newPrefixRig(t, provider, false, research.Switches{})
			plain.submit(2, 0, second)
			if !slices.EqualFunc(r.read[2], plain.read[2], bytes.Equal) || len(r.read[2]) != pages {
				t.Fatal("the bytes read with reuse differ from those read without")
			}
			st := r.D.Stats()
			if st.Prefix.PrefixHits != 1 || st.Prefix.PrefixHitPages != shared || st.PagesFree+st.Prefix.PrefixCachedPages != 64 {
				t.Fatalf("decode: %+v", st)
			}
		})
	}
}

// A pinned page is in no Grant, so no window opens it: a WRITE aimed at one
// with the key of the same request's Grant is refused, and only the
// writer's queue pair breaks. Under write-shared (the pinned pages granted
// too) the same WRITE lands on a page other requests read.
func TestWriteToAPinnedPageIsRefusedUnlessGranted(t *testing.T) {
	skipUnderRace(t)
	for _, sw := range []research.Switches{{}, research.On(research.WriteShared)} {
		t.Run(sw.String(), func(t *testing.T) {
			r := newPrefixRig(t, "inproc", true, sw)
			r.submit(1, 7, prompt(1, 1, 8*pageTokens, 8*pageTokens))
			pinned := r.pages[1][0]
			// Request 2 shares 4 pages; a Bootstrap of the test's own
			// making, so the endpoint never writes it: decode pins and grants.
			p2 := prompt(1, 2, 8*pageTokens, 4*pageTokens)
			o := r.dispatch(2, 7, p2)
			b, err := protocol.AppendMessage(nil, &protocol.Bootstrap{Request: 2, Tokens: uint32(len(p2)), Scope: o.Scope, Chain: o.Chain})
			if err != nil {
				t.Fatal(err)
			}
			rawSend(t, r.P, "decode", b, 0)
			eventually(t, "the Grant sent", func() bool { r.poll(); _, ok := r.grant(2); return ok })
			g, _ := r.grant(2)
			addr := r.D.kv.Addr() + uint64(int(pinned.Page)*r.D.slotBytes())
			if sw.Any() {
				if g.Pages[0].Page != pinned.Page {
					t.Fatalf("under write-shared the Grant starts %v, not the pinned page %d", g.Pages[0], pinned.Page)
				}
				addr = g.Pages[0].Addr
			} else if g.Prefix != 4*pageTokens || slices.ContainsFunc(g.Pages, func(p protocol.PageGrant) bool { return p.Page == pinned.Page }) {
				t.Fatalf("the Grant names the pinned page or no prefix: %+v", g)
			}
			rawWrite(t, r.P, addr, g.Pages[0].Key)
			at := func() []byte { off := addr - r.D.kv.Addr(); return r.D.kv.Bytes()[off : off+64] }
			landed := func() bool { return bytes.Equal(at(), rogueBytes) }
			eventually(t, "the WRITE landed or was refused", func() bool { r.poll(); return landed() || len(r.P.Peers()) == 0 })
			switch {
			case sw.Any() && !landed():
				t.Fatal("under write-shared the WRITE to the pinned page did not land")
			case !sw.Any() && landed():
				t.Fatal("a WRITE landed on a pinned page no Grant names")
			}
			if !sw.Any() { // the refused WRITE changed nothing: the page is still cached, at its epoch, in its scope
				r.D.mu.Lock()
				scope, _, cached := r.D.receiver.Pool().Shared(pinned.Page)
				epoch := r.D.receiver.Pool().Epoch(pinned.Page)
				r.D.mu.Unlock()
				if !cached || scope != 7 || epoch != pinned.Epoch {
					t.Fatalf("the pinned page: cached %v, scope %d, epoch %d (pinned at %d)", cached, scope, epoch, pinned.Epoch)
				}
			}
		})
	}
}

// A Bootstrap carries one chain hash a page and the ticket: the decode
// node's receive buffers (and the prefill node's send buffers) hold one of
// its largest request with the largest ticket, so a chained request of 200
// pages with a ticket of protocol.MaxTicket bytes goes through; a chained
// request over the decode peer's largest is refused at the prefill node,
// before its Bootstrap could overflow the peer's buffers.
func TestLargestChainedBootstrapFitsTheDecodeNodesBuffers(t *testing.T) {
	for _, provider := range []string{"inproc", "socket"} {
		t.Run(provider, func(t *testing.T) {
			devs := devices(t, provider, "prefill", "decode")
			kv := &promptKV{prompts: map[protocol.RequestID][]uint32{}}
			p, err := NewPrefill(devs[0], PrefillConfig{Pages: 256, PageTokens: pageTokens, PageBytes: 256, KV: kv})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(p.Close)
			d, err := NewDecode(devs[1], DecodeConfig{Pages: 200, PageTokens: pageTokens, PageBytes: 256, Timeout: time.Minute, PrefixCache: true,
				Admission: Admission{Authorize: func(string, *protocol.Bootstrap) error { return nil }}})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(d.Close)
			if err := ConnectLocal(p, "prefill", d, "decode"); err != nil {
				t.Fatal(err)
			}
			big := prompt(1, 1, 200*pageTokens, 0)
			kv.prompts[1] = big
			o := protocol.SubmitOptions{Ticket: make([]byte, protocol.MaxTicket), Scope: 3, Chain: protocol.PrefixChain(big, pageTokens)}
			if err := p.SubmitWith(1, "decode", len(big), o); err != nil {
				t.Fatal(err)
			}
			now, verified := time.Unix(1, 0), false
			eventually(t, "the 200-page request verified", func() bool {
				now = now.Add(time.Millisecond)
				p.Poll(now)
				d.Poll(now)
				p.Events()
				for _, ev := range d.Events() {
					if ev.Kind == Outcome && ev.Err != nil {
						t.Fatalf("request 1: %v", ev.Err)
					}
					verified = verified || ev.Kind == Verified
				}
				return verified
			})
			over := prompt(1, 2, 201*pageTokens, 0)
			o.Chain = protocol.PrefixChain(over, pageTokens)
			if err := p.SubmitWith(2, "decode", len(over), o); !errors.Is(err, protocol.ErrTooLong) {
				t.Fatalf("a chained request over the decode peer's largest: %v", err)
			}
		})
	}
}
