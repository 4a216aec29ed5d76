package protocol_test

import (
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/protocol/protocoltest"
)

// cached is one prefill node and one decode node of decodePages pages with
// the prefix cache on, on the shared harness, which checks the spec's
// properties as it goes (NoCrossScopeRead, PinnedNeverReallocated and
// PrefixExact among them) and audits the receiver (pool, cache index, pins)
// after every event.
func cached(t *testing.T, decodePages int, bugs ...research.Switch) *protocoltest.Network {
	t.Helper()
	n, err := protocoltest.New(protocoltest.Config{Research: research.On(bugs...), Start: time.Unix(1000, 0),
		Prefill: []protocoltest.NodeConfig{{Pages: 16, PageBytes: 128, Advertise: protocol.MaxGrantPages}},
		Decode:  []protocoltest.NodeConfig{{Pages: decodePages, PageBytes: 128, Advertise: protocol.MaxGrantPages, PrefixCache: true}}})
	if err != nil {
		t.Fatal(err)
	}
	n.ComputeAtIntake = true
	return n
}

// submitShared submits request id of scope with a prompt of tokens tokens
// whose first shared ones every such request shares, and delivers the
// router's dispatch.
func submitShared(t *testing.T, n *protocoltest.Network, id protocol.RequestID, scope protocol.Scope, tokens, shared int) {
	t.Helper()
	if err := n.SubmitPrompt(id, tokens, scope, protocoltest.SharedPrompt(id, tokens, shared)); err != nil {
		t.Fatalf("submit r%d: %v", id, err)
	}
	n.DeliverRouter(n.Prefill[0].ID)
}

func props(n *protocoltest.Network) []string {
	var out []string
	for _, v := range n.Violations {
		out = append(out, v.Property+": "+v.Detail)
	}
	return out
}

// Rule 21: with the prefix cache on, the receiver refuses to run without
// Authorize, since the scope must come authenticated.
func TestPrefixCacheNeedsAuthorize(t *testing.T) {
	mem := protocoltest.NewMemory(4, 64)
	cfg := protocol.ReceiverConfig{Pages: 4, PageTokens: 4, Memory: mem, PrefixCache: true,
		TagKeys: func(protocol.PeerID) *protocol.TagKey { return nil },
		Region:  func(uint32) (uint64, uint32) { return 0, 0 }}
	if _, err := protocol.NewReceiver(cfg); !errors.Is(err, protocol.ErrConfig) {
		t.Fatalf("PrefixCache without Authorize: %v, want ErrConfig", err)
	}
	cfg.Authorize = func(protocol.PeerID, *protocol.Bootstrap) error { return nil }
	if _, err := protocol.NewReceiver(cfg); err != nil {
		t.Fatal(err)
	}
}

// Rule 21: a Bootstrap whose chain is not one hash per full page, or has a
// chain without a scope, is refused at intake: the sender is told, nothing
// is reserved, no record is kept. The sender's own intake refuses the same.
func TestBootstrapChainMustFitTheRequest(t *testing.T) {
	l := newLink(t, 8)
	for i, b := range []*protocol.Bootstrap{
		{Request: 1, Tokens: 12, Scope: 1, Chain: make([]protocol.ChainHash, 2)},
		{Request: 2, Tokens: 12, Scope: 1, Chain: make([]protocol.ChainHash, 4)},
		{Request: 3, Tokens: 11, Scope: 1, Chain: make([]protocol.ChainHash, 3)},
	} {
		if err := l.r.Step(prefill, b, l.n.Now); err != nil {
			t.Fatalf("case %d: %v", i, err)
		}
		e := l.r.Effects()
		if len(e.Outcomes) != 1 || !errors.Is(e.Outcomes[0].Err, protocol.ErrRejected) || !errors.Is(e.Outcomes[0].Err, protocol.ErrBadChain) {
			t.Fatalf("case %d: outcomes %v", i, e.Outcomes)
		}
		if len(e.Sends) != 1 || e.Sends[0].Msg.(*protocol.Abort).Reason != protocol.AbortRejected {
			t.Fatalf("case %d: sends %v", i, e.Sends)
		}
		if l.r.Records() != 0 || l.r.Pool().Free() != 8 {
			t.Fatalf("case %d: %d records, %d free", i, l.r.Records(), l.r.Pool().Free())
		}
	}
	if _, err := l.s.SubmitWith(9, decode, 12, protocol.SubmitOptions{Scope: 1, Chain: make([]protocol.ChainHash, 2)}); !errors.Is(err, protocol.ErrBadChain) {
		t.Fatalf("the sender took a short chain: %v", err)
	}
	if _, err := l.s.SubmitWith(9, decode, 12, protocol.SubmitOptions{Chain: make([]protocol.ChainHash, 3)}); !errors.Is(err, protocol.ErrBadChain) {
		t.Fatalf("the sender took a chain without a scope: %v", err)
	}
}

// Rules 21 and 22: a hit pins the cached pages and grants only the rest;
// the sender writes pages k..n-1, each tagged with its index in the
// request, and Done says what it skipped; the read returns prefix then
// written pages, which make the prompt byte for byte (the harness checks).
func TestPrefixHitGrantsAndWritesOnlyThePagesPastIt(t *testing.T) {
	n := cached(t, 16)
	submitShared(t, n, 1, 7, 20, 16) // 5 pages of 4, all full
	n.Run()
	submitShared(t, n, 2, 7, 22, 16) // 6 pages: 4 cached, 2 fresh
	qp := n.QPs[0]
	n.Deliver(qp) // Bootstrap
	g := qp.Back[0].(*protocol.Grant)
	if g.Prefix != 16 || len(g.Pages) != 2 {
		t.Fatalf("Grant: prefix %d, %d pages; want 16 and 2", g.Prefix, len(g.Pages))
	}
	n.DeliverBack(qp)
	var indices []uint32
	for _, op := range qp.Fwd {
		if op.Write != nil {
			indices = append(indices, op.Write.Index)
		}
		if d, ok := op.Msg.(*protocol.Done); ok && (d.Prefix != 16 || d.Pages != 2) {
			t.Fatalf("Done: %+v", d)
		}
	}
	if !slices.Equal(indices, []uint32{4, 5}) {
		t.Fatalf("WRITE indices %v, want [4 5]", indices)
	}
	n.Run()
	if n.Quiescent(); len(n.Violations) != 0 {
		t.Fatal(props(n))
	}
	if !n.Request(2).Read || n.Request(2).Prefix != 4 {
		t.Fatalf("r2: read %v, prefix %d", n.Request(2).Read, n.Request(2).Prefix)
	}
	st := n.Decode[0].Receiver.Stats()
	if st.PrefixLookups != 2 || st.PrefixHits != 1 || st.PrefixHitPages != 4 || st.PrefixHitTokens != 16 || st.PrefixInsertions != 6 || st.PrefixCachedPages != 6 {
		t.Fatalf("stats %+v", st)
	}
}

// Rule 21, the scope rule: the same tokens in another scope get no hit,
// and a request with scope 0 neither hits nor is inserted.
func TestPrefixHitNeverCrossesScopes(t *testing.T) {
	n := cached(t, 16)
	submitShared(t, n, 1, 1, 12, 12)
	n.Run()
	submitShared(t, n, 2, 2, 12, 12)
	n.Run()
	if p := n.Request(2).Prefix; p != 0 {
		t.Fatalf("r2 of scope 2 reused %d pages of scope 1", p)
	}
	before := n.Decode[0].Receiver.Pool().Cached()
	if err := n.SubmitPrompt(3, 12, 0, protocoltest.SharedPrompt(3, 12, 12)); err != nil {
		t.Fatal(err)
	}
	n.Run()
	if p, c := n.Request(3).Prefix, n.Decode[0].Receiver.Pool().Cached(); p != 0 || c != before {
		t.Fatalf("r3 of scope 0: prefix %d, cached %d -> %d", p, before, c)
	}
	if n.Quiescent(); len(n.Violations) != 0 {
		t.Fatal(props(n))
	}
}

// Rule 4 with a prefix: the sender refuses a Grant whose prefix is not
// whole pages, claims one for a request that sent no chain, or grants other than the
// pages past it, with ErrBadGrant, answering AbortAck; nothing is written.
func TestSenderRefusesAGrantWhosePrefixDoesNotFit(t *testing.T) {
	chain := protocol.PrefixChain(make([]uint32, 12), pageTokens)
	for name, g := range map[string]protocol.Grant{
		"not whole pages":    {Tokens: 12, Prefix: 6, Pages: make([]protocol.PageGrant, 2)},
		"too few pages":      {Tokens: 12, Prefix: 4, Pages: make([]protocol.PageGrant, 1)},
		"too many pages":     {Tokens: 12, Prefix: 8, Pages: make([]protocol.PageGrant, 2)},
		"prefix without one": {Tokens: 12, Prefix: 4, Pages: make([]protocol.PageGrant, 2)},
	} {
		l := newLink(t, 8)
		o := protocol.SubmitOptions{Scope: 1, Chain: chain}
		if name == "prefix without one" {
			o = protocol.SubmitOptions{}
		}
		if _, err := l.s.SubmitWith(1, decode, 12, o); err != nil {
			t.Fatal(err)
		}
		l.s.Effects()
		for i := range g.Pages {
			g.Pages[i] = protocol.PageGrant{Page: uint32(i), Addr: uint64(i) << 20}
		}
		g.Request = 1
		if err := l.s.Step(decode, &g); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		e := l.s.Effects()
		if len(e.Outcomes) != 1 || !errors.Is(e.Outcomes[0].Err, protocol.ErrBadGrant) {
			t.Fatalf("%s: outcomes %v", name, e.Outcomes)
		}
		if len(e.Ops) != 1 || e.Ops[0].Msg == nil || e.Ops[0].Msg.Type() != protocol.TypeAbortAck {
			t.Fatalf("%s: ops %v", name, e.Ops)
		}
	}
}

// Rules 21 to 24 at a realistic size: 3,000 requests of 4 scopes over a
// decode pool of 400 pages, prompts of 8 to 40 pages sharing system
// prompts and earlier turns, arriving while others are reserved, read or
// aborted (cancels, corruption), so that eviction runs all the time. The
// harness checks every property at every event and audits the pool, its
// cache index and every pin after each; at the end every page is free or
// cached, none pinned.
func TestPrefixReuseAtScaleKeepsEveryProperty(t *testing.T) {
	requests := 3000
	if testing.Short() {
		requests = 600
	}
	n, err := protocoltest.New(protocoltest.Config{Start: time.Unix(1000, 0),
		Prefill: []protocoltest.NodeConfig{{Pages: 2048, PageTokens: 16, PageBytes: 64, Advertise: protocol.MaxGrantPages}},
		Decode:  []protocoltest.NodeConfig{{Pages: 400, PageTokens: 16, PageBytes: 64, Advertise: protocol.MaxGrantPages, PrefixCache: true, Timeout: time.Second}}})
	if err != nil {
		t.Fatal(err)
	}
	n.ComputeAtIntake = true
	rng := rand.New(rand.NewPCG(18, 75))
	// Each scope has a few conversations: a turn's prompt extends the last.
	type conv struct {
		scope  protocol.Scope
		prompt []uint32
	}
	var convs []*conv
	for s := range 4 {
		system := make([]uint32, 16*(4+rng.IntN(8)))
		for i := range system {
			system[i] = uint32(1000*s + i%7) // scopes share no system prompt
		}
		for range 6 {
			convs = append(convs, &conv{scope: protocol.Scope(s + 1), prompt: slices.Clone(system)})
		}
	}
	cancelled, corrupted := 0, 0
	type scoped struct {
		scope protocol.Scope
		chain []protocol.ChainHash
	}
	var chains []scoped // every prompt's, to look for pages eviction left unreachable
	pool := n.Decode[0].Receiver.Pool()
	for id := protocol.RequestID(1); int(id) <= requests; id++ {
		c := convs[rng.IntN(len(convs))]
		if len(c.prompt) > 16*30 {
			c.prompt = c.prompt[:16*(4+rng.IntN(8))] // a new conversation on the same system prompt
		}
		for range 1 + rng.IntN(40) { // the user's turn, of its own tokens
			c.prompt = append(c.prompt, uint32(id)<<8|uint32(rng.IntN(256)))
		}
		if err := n.SubmitPrompt(id, len(c.prompt), c.scope, slices.Clone(c.prompt)); err != nil {
			t.Fatalf("r%d: %v", id, err)
		}
		chains = append(chains, scoped{c.scope, protocol.PrefixChain(c.prompt, 16)})
		if id%50 == 0 {
			for _, c := range chains[max(0, len(chains)-200):] {
				if o := orphans(pool, c.scope, c.chain); o > 0 {
					t.Fatalf("after r%d (%d evictions): %d cached pages of a %d-page chain past its %d-page hit: eviction took a page before its descendants",
						id, pool.Evictions(), o, len(c.chain), pool.LookupPrefix(c.scope, c.chain))
				}
			}
		}
		for range 4 + rng.IntN(16) { // some events, not all: requests overlap
			switch evs, _ := n.Events(protocoltest.EventOptions{}); {
			case len(evs) == 0:
			case rng.IntN(60) == 0:
				n.Cancel(id - protocol.RequestID(rng.IntN(3)))
				cancelled++
			case int(id) > requests*9/10 && rng.IntN(80) == 0 && len(n.QPs[0].Fwd) > 0 && n.QPs[0].Fwd[0].Write != nil:
				n.CorruptNext(n.QPs[0])
				corrupted++
			default:
				evs[rng.IntN(len(evs))].Do()
			}
		}
		if len(n.Violations) > 0 {
			t.Fatalf("after r%d: %v", id, props(n))
		}
	}
	n.Run()
	n.Advance(2 * time.Second)
	n.Run()
	n.Quiescent()
	if len(n.Violations) > 0 {
		t.Fatal(props(n)[:min(5, len(n.Violations))])
	}
	st := n.Decode[0].Receiver.Stats()
	outcomes := map[string]int{}
	for _, q := range n.Requests() {
		why := "ok"
		if q.Outcome != nil {
			why = q.Outcome.Error()[:min(40, len(q.Outcome.Error()))]
		}
		outcomes[why]++
	}
	t.Logf("%d requests (%d cancels, %d corruptions): %+v; pool %d free, %d cached; outcomes %v", requests, cancelled, corrupted, st, pool.Free(), pool.Cached(), outcomes)
	if st.PrefixLookups < uint64(requests)/2 || st.PrefixHits*2 < st.PrefixLookups || st.PrefixEvictions == 0 || st.PrefixInsertions == 0 || pool.Pinned() != 0 {
		t.Fatalf("the run did not exercise the cache: %+v, %d pinned", st, pool.Pinned())
	}
	if pool.Free()+pool.Cached() != pool.Len() {
		t.Fatalf("%d free and %d cached of %d", pool.Free(), pool.Cached(), pool.Len())
	}
}

// Each prefix switch, staged the way the spec's matrix exposes it, breaks
// the property the catalogue predicts (the harness names it); the same
// staging with every defense on ends clean. client-scope is the router's
// (node's), not the protocol's: node's tests stage it.
func TestEachPrefixSwitchBreaksAProperty(t *testing.T) {
	type staging struct {
		name  string
		bugs  []research.Switch
		pages int
		stage func(n *protocoltest.Network)
		want  string
	}
	cases := []staging{
		{"scope-dropped", []research.Switch{research.ScopeDropped}, 8, func(n *protocoltest.Network) {
			submitShared(t, n, 1, 1, 12, 12)
			n.Run()
			submitShared(t, n, 2, 2, 12, 12) // another tenant, the same prompt
			n.Run()
		}, "NoCrossScopeRead"},
		{"evict-pinned", []research.Switch{research.EvictPinned}, 5, func(n *protocoltest.Network) {
			submitShared(t, n, 1, 1, 12, 8) // pages 0-2 cached
			n.Run()
			submitShared(t, n, 2, 1, 12, 8) // pins 0 and 1, writes one fresh page
			qp := n.QPs[0]
			n.Deliver(qp)
			n.DeliverBack(qp)
			n.Deliver(qp)
			n.Deliver(qp)
			n.Acquire(n.Decode[0]) // r2 reads its prefix ...
			// ... while r3 needs 3 pages: 1 free, 1 unpinned cached; the bug
			// evicts a pinned one too, and prefill writes it.
			submitShared(t, n, 3, 2, 12, 0)
			n.Run()
			n.Finish(n.Decode[0])
			n.Run()
		}, "PinnedNeverReallocated"},
		{"write-shared", []research.Switch{research.WriteShared}, 8, func(n *protocoltest.Network) {
			submitShared(t, n, 1, 1, 12, 8)
			n.Run()
			submitShared(t, n, 2, 1, 12, 8)
			n.Run()
		}, "PinnedNeverReallocated"},
		{"prefix-count-mismatch+no-token-check+no-tag-check+no-checksum",
			[]research.Switch{research.PrefixCountMismatch, research.NoTokenCheck, research.NoTagCheck, research.NoChecksum}, 8, func(n *protocoltest.Network) {
				submitShared(t, n, 1, 1, 16, 8)
				n.Run()
				submitShared(t, n, 2, 1, 16, 8) // a hit of 2 pages; the sender skips 3
				n.Run()
			}, "PrefixExact"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			bad := cached(t, c.pages, c.bugs...)
			c.stage(bad)
			found := false
			for _, v := range bad.Violations {
				found = found || v.Property == c.want
			}
			if !found {
				t.Fatalf("with %v: violations %v, want %s", c.bugs, props(bad), c.want)
			}
			t.Logf("%s", strings.Join(props(bad), "; "))
			good := cached(t, c.pages)
			c.stage(good)
			good.Run()
			good.Quiescent()
			if len(good.Violations) != 0 {
				t.Fatalf("with every defense on: %v", props(good))
			}
		})
	}
}

// orphans counts chain's pages cached under scope past the run LookupPrefix
// reaches: pages no request can hit any more, holding room until evicted.
func orphans(p *protocol.Pool, scope protocol.Scope, chain []protocol.ChainHash) int {
	n := 0
	for i := p.LookupPrefix(scope, chain) + 1; i < len(chain); i++ {
		n += p.LookupPrefix(scope, chain[i:i+1])
	}
	return n
}

// Rule 24: eviction takes a chain's leaf before its root. Pin (and Finish,
// through TouchChain) make a chain's pages recently used deepest first, so
// its root is its most recently used page; were page 0 the oldest, the
// first eviction would take it and leave pages 1..k-1 cached but
// unreachable (LookupPrefix needs a run from page 0): one evicted page
// would cost the whole prefix. Evicting one page of a 4-page chain must
// leave a 3-page hit.
func TestEvictionTakesAChainsLeafBeforeItsRoot(t *testing.T) {
	p := protocol.NewPool(6)
	prompt := make([]uint32, 4*pageTokens)
	for i := range prompt {
		prompt[i] = uint32(100 + i)
	}
	chain := protocol.PrefixChain(prompt, pageTokens)
	refs, err := p.Allocate(1, len(chain))
	if err != nil {
		t.Fatal(err)
	}
	for i, ref := range refs {
		if !p.Insert(1, ref, 7, chain[i]) {
			t.Fatalf("page %d not inserted", i)
		}
	}
	// A later request of the scope reads the whole chain (pins, unpins).
	if pinned := p.Pin(reader, 7, chain); len(pinned) != len(chain) || p.Unpin(reader, 7, pinned) != len(chain) {
		t.Fatalf("pinning the chain: %v", pinned)
	}
	// Another request needs one page more than is free: one cached page goes.
	if _, err := p.Allocate(2, p.Free()+1); err != nil {
		t.Fatal(err)
	}
	if err := p.Audit(); err != nil {
		t.Fatal(err)
	}
	if k := p.LookupPrefix(7, chain); k != len(chain)-1 {
		t.Fatalf("one page of a %d-page chain evicted: a hit of %d pages is left, %d pages still cached (want a hit of %d: evict the leaf, not the root)",
			len(chain), k, p.Cached(), len(chain)-1)
	}
}

// Rule 24, through the receiver: a request's pages inserted at Finish (one
// by one, so the deepest pushed last) are touched again root last, so the
// first eviction after it takes the chain's leaf and a 4-page hit is left.
func TestFinishLeavesAChainsRootTheMostRecentlyUsed(t *testing.T) {
	n := cached(t, 8)
	submitShared(t, n, 1, 7, 20, 16) // 5 pages, the 5 full inserted at Finish
	n.Run()
	pool := n.Decode[0].Receiver.Pool()
	if pool.Cached() != 5 {
		t.Fatalf("%d pages cached, want 5", pool.Cached())
	}
	if _, err := pool.Allocate(99, pool.Free()+1); err != nil { // one cached page evicted
		t.Fatal(err)
	}
	chain := protocol.PrefixChain(n.Request(1).Prompt, pageTokens)
	if k := pool.LookupPrefix(7, chain); k != 4 {
		t.Fatalf("one of 5 cached pages evicted leaves a %d-page hit, want 4 (its leaf evicted, not its root)", k)
	}
}

// Receiver.Audit compares the pool's pins with the requests that hold
// them even when the cache has emptied. Under evict-pinned, a Bootstrap
// that needs the whole pool evicts every cached page, the pinned ones with
// them, and leaves a request whose record says it holds pins on pages that
// are now another request's: the very state Audit exists to catch, which
// an early return on an empty cache missed.
func TestAuditSeesARequestsPinsOnAnEmptiedCache(t *testing.T) {
	n := cached(t, 8, research.EvictPinned)
	submitShared(t, n, 1, 7, 20, 16) // 5 full pages, all inserted at Finish
	n.Run()
	r := n.Decode[0].Receiver
	if c := r.Pool().Cached(); c != 5 {
		t.Fatalf("%d pages cached after r1, want 5", c)
	}
	qp := n.QPs[0]
	submitShared(t, n, 2, 7, 20, 16) // hits 4 pages, pins them, 1 fresh
	n.Deliver(qp)
	if r.Pool().Pinned() != 4 {
		t.Fatalf("r2 pinned %d pages, want 4", r.Pool().Pinned())
	}
	if err := r.Audit(); err != nil {
		t.Fatalf("before the eviction: %v", err)
	}
	submitShared(t, n, 3, 9, 28, 0) // 7 pages: 2 free, the 5 cached evicted, pinned or not
	n.Deliver(qp)
	if r.Pool().Cached() != 0 {
		t.Fatalf("the staging did not empty the cache: %d cached", r.Pool().Cached())
	}
	if err := r.Audit(); err == nil {
		t.Fatal("Audit passes while r2's record holds 4 pins on pages r3 now owns (evict-pinned)")
	} else {
		t.Log(err)
	}
}

// Rule 24: a request cancelled while being read inserts nothing at Finish:
// its pins go, its pages are released, its outcome stays the cancel. The
// router has told the client it failed, and a decoder cancelled before its
// first step has not written the last prompt position's KV.
func TestACancelledReadInsertsNothing(t *testing.T) {
	n := cached(t, 16)
	submitShared(t, n, 1, 7, 20, 16)
	r := n.Decode[0].Receiver
	qp := n.QPs[0]
	for i := 0; i < 100 && r.Status(1) != protocol.ReceiverReady; i++ {
		switch {
		case len(qp.Fwd) > 0:
			n.Deliver(qp)
		case len(qp.Back) > 0:
			n.DeliverBack(qp)
		}
	}
	if r.Status(1) != protocol.ReceiverReady {
		t.Fatalf("r1 is %v, not ready", r.Status(1))
	}
	if _, err := r.Acquire(1); err != nil {
		t.Fatal(err)
	}
	r.Cancel(1)
	if err := r.Finish(1); err != nil {
		t.Fatal(err)
	}
	if c := r.Pool().Cached(); c != 0 {
		t.Fatalf("a request cancelled while being read inserted %d pages into the cache", c)
	}
	if f := r.Pool().Free(); f != r.Pool().Len() {
		t.Fatalf("%d of %d pages free after the cancelled read's Finish", f, r.Pool().Len())
	}
	if err := r.Audit(); err != nil {
		t.Fatal(err)
	}
	var out []protocol.Outcome
	for _, o := range r.Effects().Outcomes {
		if o.Request == 1 {
			out = append(out, o)
		}
	}
	if len(out) != 1 || !errors.Is(out[0].Err, protocol.ErrCancelled) {
		t.Fatalf("r1's outcomes %v, want the one cancel", out)
	}
}

// The same read finished without a cancel inserts its 5 full pages: the
// staging above is one a cancel changes, not one that never inserts.
func TestAFinishedReadInsertsItsFullPages(t *testing.T) {
	n := cached(t, 16)
	submitShared(t, n, 1, 7, 20, 16)
	n.Run()
	if c := n.Decode[0].Receiver.Pool().Cached(); c != 5 {
		t.Fatalf("%d pages cached after a finished read, want 5", c)
	}
}

// rogueWrites stages review finding 3: r1's prefill node (listed, ticketed)
// writes KV other than its prompt's for page 0, correctly tagged (the
// sender sums what it posts), so r1 verifies and Finish inserts its pages.
func rogueWrites(t *testing.T) *protocoltest.Network {
	t.Helper()
	n := cached(t, 16)
	if err := n.SubmitPrompt(1, 20, 7, protocoltest.SharedPrompt(1, 20, 16)); err != nil {
		t.Fatal(err)
	}
	n.DeliverRouter(n.Prefill[0].ID) // computed at intake
	mem := n.Prefill[0].Mem
	for p := range mem.Len() {
		if protocoltest.HoldsPrompt(mem.Page(uint32(p)), n.Request(1).Prompt, 4, 0) {
			for i := range mem.Page(uint32(p)) {
				mem.Page(uint32(p))[i] ^= 0x5a
			}
		}
	}
	n.Run()
	if c := n.Decode[0].Receiver.Pool().Cached(); c != 5 {
		t.Fatalf("r1's pages: %d cached, want 5", c)
	}
	return n
}

// r2Reads submits r2, an honest request of r1's scope whose prompt starts
// with r1's, runs it, and returns the properties r2 broke and its prefix.
func r2Reads(t *testing.T, n *protocoltest.Network) (broken []string, prefix int) {
	t.Helper()
	before := len(n.Violations)
	submitShared(t, n, 2, 7, 22, 16)
	n.Run()
	for _, v := range n.Violations[before:] {
		if strings.Contains(v.Detail, "r2") {
			broken = append(broken, v.Property+": "+v.Detail)
		}
	}
	return broken, n.Request(2).Prefix
}

// The residual risk of docs/security.md, shown: verification proves who
// wrote a page, not that it is the prompt's KV, so a rogue prefill node
// not yet caught gets its KV cached, and a later honest request of the
// scope reads it (the harness's PrefixExact sees it). What bounds it is
// the next test: once its writer is caught, its pages leave the cache.
func TestARogueWritersKVReachesLaterHitsUntilItIsCaught(t *testing.T) {
	n := rogueWrites(t)
	broken, prefix := r2Reads(t, n)
	if prefix == 0 || len(broken) == 0 {
		t.Fatalf("r2 (prefix %d tokens) read no rogue KV (%v): the staging does not show the risk", prefix, broken)
	}
	t.Log(broken)
}

// A peer found failed or misbehaving takes what it wrote out of the cache
// (docs/security.md): after its queue pair is fenced (PeerFailed,
// QueuePairFenced), a verification failure of one of its requests, or an
// unauthorized Bootstrap, its unpinned cached pages are freed at once, so
// a later honest request of the scope hits none of them and reads only
// what was written for it.
func TestACaughtWritersCachedPagesLeaveTheCache(t *testing.T) {
	catch := map[string]func(n *protocoltest.Network){
		"queue pair fenced": func(n *protocoltest.Network) {
			n.Cut(n.QPs[0]) // the queue pair fenced (QueuePairFenced), as after PeerFailed
		},
		"an unauthorized Bootstrap": func(n *protocoltest.Network) {
			// A Bootstrap its router never dispatched (no ticket in a deployment).
			r := n.Decode[0].Receiver
			if err := r.Step(protocol.PeerID(n.Prefill[0].ID), &protocol.Bootstrap{Request: 99, Tokens: 8}, time.Unix(1000, 0)); err != nil {
				t.Fatal(err)
			}
			if out := r.Effects().Outcomes; len(out) != 1 || !errors.Is(out[0].Err, protocol.ErrUnauthorized) {
				t.Fatalf("the forged Bootstrap: %v, want ErrUnauthorized", out)
			}
		},
		"a verification failure": func(n *protocoltest.Network) {
			submitShared(t, n, 3, 9, 8, 0) // another scope's request, from the same node
			qp := n.QPs[0]
			for i := 0; i < 100 && !(len(qp.Fwd) > 0 && qp.Fwd[0].Write != nil); i++ {
				switch {
				case len(qp.Fwd) > 0:
					n.Deliver(qp)
				case len(qp.Back) > 0:
					n.DeliverBack(qp)
				}
			}
			n.CorruptNext(qp)
			n.Run()
			if n.Request(3).Outcome == nil {
				t.Fatal("r3's corrupted page verified")
			}
		},
	}
	for what, caught := range catch {
		t.Run(what, func(t *testing.T) {
			n := rogueWrites(t)
			pool := n.Decode[0].Receiver.Pool()
			caught(n)
			if pool.Cached() != 0 || pool.Purged() != 5 {
				t.Fatalf("after its writer was caught: %d of r1's pages cached, %d purged (want 0, 5)", pool.Cached(), pool.Purged())
			}
			if what != "a verification failure" {
				return // r2 runs only after the verification failure: a cut leaves no queue pair, and the hand-fed Bootstrap bypassed the harness
			}
			broken, prefix := r2Reads(t, n)
			if prefix != 0 || len(broken) > 0 {
				t.Fatalf("r2 hit %d tokens of the caught writer's pages: %v", prefix, broken)
			}
		})
	}
}

// A caught writer's pinned pages leave the index at once (no new hit) and
// are freed at their last unpin; the request reading them keeps its pins.
func TestACaughtWritersPinnedPagesAreFreedAtTheirLastUnpin(t *testing.T) {
	p := protocol.NewPool(8)
	prompt := make([]uint32, 4*pageTokens)
	for i := range prompt {
		prompt[i] = uint32(i)
	}
	chain := protocol.PrefixChain(prompt, pageTokens)
	refs, _ := p.Allocate(1, 4)
	for i, ref := range refs {
		if !p.InsertFrom(1, ref, 7, chain[i], 3) {
			t.Fatalf("page %d not inserted", i)
		}
	}
	pinned := p.Pin(reader, 7, chain[:2])
	if freed, doomed := p.PurgeWriter(3); freed != 2 || doomed != 2 {
		t.Fatalf("purge freed %d and doomed %d, want 2 and 2", freed, doomed)
	}
	if err := p.Audit(); err != nil {
		t.Fatal(err)
	}
	if k := p.LookupPrefix(7, chain); k != 0 {
		t.Fatalf("a purged chain still hits %d pages", k)
	}
	for _, ref := range pinned {
		if err := p.CheckShared(7, ref); err != nil {
			t.Fatalf("the reader lost its pinned page: %v", err)
		}
	}
	if p.Free() != 6 || p.Cached() != 2 {
		t.Fatalf("%d free, %d cached before the unpin, want 6 and 2", p.Free(), p.Cached())
	}
	p.Unpin(reader, 7, pinned)
	if err := p.Audit(); err != nil {
		t.Fatal(err)
	}
	if p.Free() != 8 || p.Cached() != 0 || p.Pinned() != 0 {
		t.Fatalf("%d free, %d cached, %d pinned after the last unpin, want 8, 0, 0", p.Free(), p.Cached(), p.Pinned())
	}
	if freed, doomed := p.PurgeWriter(4); freed+doomed != 0 {
		t.Fatal("another writer's purge took pages")
	}
}

// reader is the request that pins cached pages in the tests.
const reader protocol.RequestID = 99
