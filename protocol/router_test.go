package protocol

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
)

var t0 = time.Unix(1_000_000, 0)

const pageTokens = 4 // tokens per page of the nodes these tests advertise

func prefillNode(id NodeID, pages int) NodeInfo {
	return NodeInfo{ID: id, Role: RolePrefill, PoolPages: pages, PageTokens: pageTokens}
}

func decodeNode(id NodeID, pages int) NodeInfo {
	return NodeInfo{ID: id, Role: RoleDecode, PoolPages: pages, PageTokens: pageTokens}
}

func newTestRouter(t *testing.T, cfg RouterConfig, nodes ...NodeInfo) *Router {
	t.Helper()
	r := NewRouter(cfg)
	for _, n := range nodes {
		if err := r.AddNode(n); err != nil {
			t.Fatal(err)
		}
	}
	return r
}

// Rule 1 (intake): the limit is the smallest of what the nodes advertise:
// context length, pool, intake limit and the wire's MaxGrantPages, over the
// best node of each role; a prompt over it is rejected with the limit named
// and never dispatched.
func TestRouterIntakeRejectsOverEachNodesLimit(t *testing.T) {
	for _, c := range []struct {
		name  string
		nodes []NodeInfo
		limit int
	}{
		{"prefill pool smaller than context", []NodeInfo{
			{ID: 1, Role: RolePrefill, ContextTokens: 4096, PoolPages: 8, PageTokens: 16},
			{ID: 2, Role: RoleDecode, ContextTokens: 4096, PoolPages: 1024, PageTokens: 16}}, 128},
		{"decode context smallest", []NodeInfo{
			{ID: 1, Role: RolePrefill, PoolPages: 1024, PageTokens: 16},
			{ID: 2, Role: RoleDecode, ContextTokens: 300, PoolPages: 1024, PageTokens: 16}}, 300},
		{"node intake limit", []NodeInfo{
			{ID: 1, Role: RolePrefill, PoolPages: 1024, PageTokens: 16, MaxTokens: 1000},
			{ID: 2, Role: RoleDecode, PoolPages: 1024, PageTokens: 16}}, 1000},
		{"a grant carries at most MaxGrantPages", []NodeInfo{
			{ID: 1, Role: RolePrefill, PoolPages: 4 * MaxGrantPages, PageTokens: 1},
			{ID: 2, Role: RoleDecode, PoolPages: 4 * MaxGrantPages, PageTokens: 1}}, MaxGrantPages},
		{"the largest node of each role", []NodeInfo{
			prefillNode(1, 4), prefillNode(2, 64), decodeNode(3, 16), decodeNode(4, 8)}, 16 * pageTokens},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := newTestRouter(t, RouterConfig{}, c.nodes...)
			if got := r.Limit(); got != c.limit {
				t.Fatalf("Limit() = %d, want %d", got, c.limit)
			}
			if _, err := r.Submit(1, c.limit, t0); err != nil {
				t.Fatalf("a prompt at the limit: %v", err)
			}
			_, err := r.Submit(2, c.limit+1, t0)
			if !errors.Is(err, ErrRejected) || !errors.Is(err, ErrTooLong) || !strings.Contains(err.Error(), fmt.Sprint(c.limit)) {
				t.Fatalf("a prompt over the limit: %v, want ErrRejected, ErrTooLong and the limit %d named", err, c.limit)
			}
			if _, err := r.Submit(3, 0, t0); !errors.Is(err, ErrRejected) {
				t.Fatalf("an empty prompt: %v, want ErrRejected", err)
			}
			e := r.Effects()
			if len(e.Dispatches) != 1 || e.Dispatches[0].Request != 1 || len(e.Outcomes) != 0 {
				t.Fatalf("effects %+v: want only request 1 dispatched, no Outcome for the refused ones", e)
			}
			if st := r.Request(2); st.Status != RouteRefused || !errors.Is(st.Err, ErrTooLong) {
				t.Fatalf("request 2 at the router: %+v", st)
			}
			if _, err := r.Submit(2, 1, t0); !errors.Is(err, ErrDuplicate) {
				t.Fatalf("a refused ID submitted again: %v, want ErrDuplicate", err)
			}
		})
	}
}

// Rule 1: a request goes only to nodes whose own limits admit it, even when
// the deployment's limit (another node's) does.
func TestRouterDispatchesOnlyToNodesThatFit(t *testing.T) {
	r := newTestRouter(t, RouterConfig{}, prefillNode(1, 4), prefillNode(2, 64), decodeNode(3, 8), decodeNode(4, 64))
	d, err := r.Submit(1, 10*pageTokens, t0)
	if err != nil {
		t.Fatal(err)
	}
	if d.Prefill != 2 || d.Decode != 4 {
		t.Fatalf("a 10-page prompt went to prefill %d, decode %d; only 2 and 4 hold 10 pages", d.Prefill, d.Decode)
	}
}

// The default policy: least pages in use among the nodes that fit; pages
// come back when a leg ends.
func TestRouterChoosesLeastPagesInUse(t *testing.T) {
	r := newTestRouter(t, RouterConfig{}, prefillNode(1, 64), prefillNode(2, 64), decodeNode(3, 64), decodeNode(4, 64))
	d1, _ := r.Submit(1, 8*pageTokens, t0) // 8 pages on 1 and 3 (ties to the lowest ID)
	d2, _ := r.Submit(2, 2*pageTokens, t0) // 2 pages on 2 and 4
	d3, _ := r.Submit(3, 1, t0)            // 1 page on 2 and 4: still the least
	if d1.Prefill != 1 || d1.Decode != 3 || d2.Prefill != 2 || d2.Decode != 4 || d3.Prefill != 2 || d3.Decode != 4 {
		t.Fatalf("dispatches %+v %+v %+v", d1, d2, d3)
	}
	if err := r.LegEnded(1, 1, nil); err != nil {
		t.Fatal(err)
	}
	if err := r.LegEnded(3, 1, nil); err != nil {
		t.Fatal(err)
	}
	load := r.Nodes()
	if load[0].PagesInUse != 0 || load[1].PagesInUse != 3 || load[2].PagesInUse != 0 || load[3].PagesInUse != 3 {
		t.Fatalf("pages in use after request 1 ended: %+v", load)
	}
	if d4, _ := r.Submit(4, 1, t0); d4.Prefill != 1 || d4.Decode != 3 {
		t.Fatalf("after request 1 ended, request 4 went to %+v", d4)
	}
}

type lastPolicy struct{ seen [][]NodeLoad }

func (p *lastPolicy) Choose(_ Role, _ int, c []NodeLoad) int {
	p.seen = append(p.seen, c)
	return len(c) - 1
}

// A Policy sees only the live nodes that fit, and its choice is the one taken.
func TestRouterPolicyChoosesAmongFittingLiveNodes(t *testing.T) {
	p := &lastPolicy{}
	r := newTestRouter(t, RouterConfig{Policy: p}, prefillNode(1, 64), prefillNode(2, 1), prefillNode(5, 64), decodeNode(3, 64), decodeNode(4, 64))
	if err := r.NodeLost(5); err != nil {
		t.Fatal(err)
	}
	d, err := r.Submit(1, 2*pageTokens, t0)
	if err != nil {
		t.Fatal(err)
	}
	if d.Prefill != 1 || d.Decode != 4 {
		t.Fatalf("dispatch %+v: want prefill 1 (2 is too small, 5 is lost) and decode 4", d)
	}
	if len(p.seen) != 2 || len(p.seen[0]) != 1 || len(p.seen[1]) != 2 {
		t.Fatalf("the policy saw %+v", p.seen)
	}
}

// Rule 9 (one outcome): the first outcome wins; later ones change nothing.
func TestRouterFirstOutcomeWins(t *testing.T) {
	r := newTestRouter(t, RouterConfig{}, prefillNode(1, 64), decodeNode(2, 64))
	r.Submit(1, 4, t0)
	r.Submit(2, 4, t0)
	r.Effects()
	// Request 1: decode succeeds, then the prefill leg reports a failure.
	mustNil(t, r.LegEnded(2, 1, nil))
	mustNil(t, r.LegEnded(1, 1, fmt.Errorf("%w: late", ErrPeerFailed)))
	mustNil(t, r.Cancel(1))
	// Request 2: prefill fails first; decode's later success is not the client's.
	mustNil(t, r.LegEnded(1, 2, fmt.Errorf("%w: grant", ErrTokenMismatch)))
	mustNil(t, r.LegEnded(2, 2, nil))
	e := r.Effects()
	if len(e.Outcomes) != 2 || e.Outcomes[0].Err != nil || !errors.Is(e.Outcomes[1].Err, ErrTokenMismatch) {
		t.Fatalf("outcomes %+v: want r1 ok, r2 token mismatch, nothing else", e.Outcomes)
	}
	if st := r.Request(1); st.Status != RouteEnded || st.Err != nil {
		t.Fatalf("r1: %+v", st)
	}
}

// Rule 9: a client disconnect cancels both legs, in whatever state they are.
func TestRouterCancelsBothLegsOnClientDisconnect(t *testing.T) {
	r := newTestRouter(t, RouterConfig{}, prefillNode(1, 64), decodeNode(2, 64))
	r.Submit(1, 4, t0)
	mustNil(t, r.LegEnded(1, 1, nil)) // the prefill leg already finished: it is cancelled anyway
	r.Effects()
	mustNil(t, r.Cancel(1))
	e := r.Effects()
	want := []CancelLeg{{1, 1}, {2, 1}}
	if fmt.Sprint(e.Cancels) != fmt.Sprint(want) || len(e.Outcomes) != 1 || !errors.Is(e.Outcomes[0].Err, ErrCancelled) {
		t.Fatalf("effects %+v, want cancels %v and one ErrCancelled", e, want)
	}
	mustNil(t, r.Cancel(1)) // a second cancel changes nothing
	if e := r.Effects(); len(e.Cancels)+len(e.Outcomes) != 0 {
		t.Fatalf("a second cancel: %+v", e)
	}
	if err := r.Cancel(99); !errors.Is(err, ErrUnknownRequest) {
		t.Fatalf("cancel of an unknown request: %v", err)
	}
}

// Rule 9: a failed leg cancels the other leg (and only an open one).
func TestRouterCancelsOtherLegOnFailedLeg(t *testing.T) {
	r := newTestRouter(t, RouterConfig{}, prefillNode(1, 64), decodeNode(2, 64))
	r.Submit(1, 4, t0)
	r.Submit(2, 4, t0)
	r.Effects()
	mustNil(t, r.LegEnded(2, 1, fmt.Errorf("%w: page 0", ErrChecksumMismatch)))
	mustNil(t, r.LegEnded(1, 2, nil))
	mustNil(t, r.LegEnded(2, 2, fmt.Errorf("%w", ErrTimedOut)))
	e := r.Effects()
	if want := []CancelLeg{{1, 1}}; fmt.Sprint(e.Cancels) != fmt.Sprint(want) {
		t.Fatalf("cancels %v, want %v (r2's prefill leg had ended)", e.Cancels, want)
	}
	// Under no-peer-cancel the router does not propagate it either.
	bug := research.On(research.NoPeerCancel)
	r = newTestRouter(t, RouterConfig{Research: bug}, prefillNode(1, 64), decodeNode(2, 64))
	r.Submit(1, 4, t0)
	mustNil(t, r.LegEnded(2, 1, fmt.Errorf("%w", ErrChecksumMismatch)))
	if e := r.Effects(); len(e.Cancels) != 0 {
		t.Fatalf("no-peer-cancel: cancels %v", e.Cancels)
	}
}

// Rule 9: a lost node fails every request on it, cancels their other legs,
// tells every decode node to cut a lost prefill node, and gets no new
// requests until it is added again.
func TestRouterNodeLostFailsEveryLegOnIt(t *testing.T) {
	r := newTestRouter(t, RouterConfig{}, prefillNode(1, 64), prefillNode(2, 64), decodeNode(3, 64), decodeNode(4, 64))
	for id := RequestID(1); id <= 8; id++ {
		r.Submit(id, 4, t0) // alternating 1/3 and 2/4 by load
	}
	r.Effects()
	mustNil(t, r.NodeLost(1))
	e := r.Effects()
	if len(e.Outcomes) != 4 {
		t.Fatalf("outcomes %+v: want the 4 requests on prefill 1", e.Outcomes)
	}
	for _, o := range e.Outcomes {
		var lost *NodeLostError
		if !errors.Is(o.Err, ErrPeerFailed) || !errors.Is(o.Err, ErrNodeLost) || r.Request(o.Request).Prefill != 1 ||
			!errors.As(o.Err, &lost) || *lost != (NodeLostError{Role: RolePrefill, Node: 1}) {
			t.Fatalf("outcome %+v: want ErrPeerFailed and the NodeLostError of prefill node 1", o)
		}
	}
	// No per-request cancel to decode: PeerLost makes it cut the queue pair,
	// which fences and fails each request there with its own reason.
	if len(e.Cancels) != 0 || fmt.Sprint(e.PeerLost) != fmt.Sprint([]PeerLost{{3, 1}, {4, 1}}) {
		t.Fatalf("cancels %v, peer lost %v", e.Cancels, e.PeerLost)
	}
	for _, l := range r.Nodes() {
		if l.Info.ID == 3 && l.Requests != 0 {
			t.Fatalf("decode 3 still counts %d requests of the lost node", l.Requests)
		}
	}
	// The lost node's late report is expected and ignored.
	mustNil(t, r.LegEnded(1, e.Outcomes[0].Request, nil))
	for id := RequestID(9); id <= 12; id++ {
		if d, err := r.Submit(id, 4, t0); err != nil || d.Prefill != 2 {
			t.Fatalf("after the loss: %+v %v", d, err)
		}
	}
	mustNil(t, r.NodeLost(2))
	if _, err := r.Submit(13, 4, t0); !errors.Is(err, ErrNoNode) {
		t.Fatalf("with every prefill node lost: %v, want ErrNoNode", err)
	}
	// Lost nodes still count for the limit: an over-long prompt is rejected, not ErrNoNode.
	if _, err := r.Submit(14, 65*pageTokens, t0); !errors.Is(err, ErrRejected) {
		t.Fatalf("over-long with every prefill node lost: %v", err)
	}
	mustNil(t, r.AddNode(prefillNode(1, 64)))
	if d, err := r.Submit(15, 4, t0); err != nil || d.Prefill != 1 {
		t.Fatalf("after prefill 1 came back: %+v %v", d, err)
	}
	if err := r.NodeLost(77); !errors.Is(err, ErrUnknownNode) {
		t.Fatalf("NodeLost of an unknown node: %v", err)
	}
}

// A decode node lost cancels the prefill legs of its requests and fails them.
func TestRouterDecodeLostCancelsPrefillLegs(t *testing.T) {
	r := newTestRouter(t, RouterConfig{}, prefillNode(1, 64), decodeNode(2, 64), decodeNode(3, 64))
	r.Submit(1, 4, t0) // 1, 2
	r.Submit(2, 4, t0) // 1, 3
	r.Effects()
	mustNil(t, r.RemoveNode(2))
	e := r.Effects()
	if fmt.Sprint(e.Cancels) != fmt.Sprint([]CancelLeg{{1, 1}}) || len(e.Outcomes) != 1 || len(e.PeerLost) != 0 {
		t.Fatalf("effects %+v", e)
	}
	if d, err := r.Submit(3, 4, t0); err != nil || d.Decode != 3 {
		t.Fatalf("after removing decode 2: %+v %v", d, err)
	}
}

// A lost decode node's open prefill legs are stopped by the router's own
// decision, not told from one leg to the other, so they are cancelled under
// no-peer-cancel too, as the spec's router does (the refinement parted ways
// there); a prefill leg that has ended gets no cancel.
func TestRouterDecodeLostCancelsPrefillLegsUnderNoPeerCancel(t *testing.T) {
	r := newTestRouter(t, RouterConfig{Research: research.On(research.NoPeerCancel)}, prefillNode(1, 64), decodeNode(2, 64))
	r.Submit(1, 4, t0)
	r.Submit(2, 4, t0)
	mustNil(t, r.LegEnded(1, 2, nil)) // request 2's prefill leg has ended
	r.Effects()
	mustNil(t, r.RemoveNode(2))
	e := r.Effects()
	if fmt.Sprint(e.Cancels) != fmt.Sprint([]CancelLeg{{1, 1}}) || len(e.Outcomes) != 2 || len(e.PeerLost) != 0 {
		t.Fatalf("effects %+v, want request 1's prefill leg cancelled and both requests failed", e)
	}
}

// Reports that break the protocol return an error and change nothing.
func TestRouterRefusesBadReports(t *testing.T) {
	r := newTestRouter(t, RouterConfig{}, prefillNode(1, 64), decodeNode(2, 64), decodeNode(3, 64))
	r.Submit(1, 4, t0)
	r.Effects()
	if err := r.LegEnded(2, 9, nil); !errors.Is(err, ErrUnknownRequest) {
		t.Fatalf("unknown request: %v", err)
	}
	if err := r.LegEnded(3, 1, nil); !errors.Is(err, ErrWrongPeer) {
		t.Fatalf("a node the request is not on: %v", err)
	}
	mustNil(t, r.LegEnded(1, 1, nil))
	if err := r.LegEnded(1, 1, fmt.Errorf("%w", ErrPeerFailed)); !errors.Is(err, ErrDuplicate) {
		t.Fatalf("a second report: %v", err)
	}
	if e := r.Effects(); len(e.Outcomes)+len(e.Cancels) != 0 || r.Request(1).Status != RouteRunning {
		t.Fatalf("bad reports changed something: %+v %+v", e, r.Request(1))
	}
	if _, err := r.Submit(1, 4, t0); !errors.Is(err, ErrDuplicate) {
		t.Fatalf("a running ID submitted again: %v", err)
	}
	for _, bad := range []NodeInfo{{ID: 5, Role: 0, PoolPages: 1, PageTokens: 1}, {ID: 5, Role: RoleDecode, PageTokens: 1},
		{ID: 5, Role: RoleDecode, PoolPages: 1 << 30, PageTokens: 1 << 10}, {ID: 5, Role: RoleDecode, PoolPages: 1, PageTokens: 1, ContextTokens: -1},
		{ID: 5, Role: RoleDecode, PoolPages: 1, PageTokens: MaxTokens + 1},
		{ID: 1, Role: RoleDecode, PoolPages: 1, PageTokens: 1}} {
		if err := r.AddNode(bad); !errors.Is(err, ErrBadNode) {
			t.Fatalf("AddNode(%+v): %v, want ErrBadNode", bad, err)
		}
	}
}

// A request without an outcome at its deadline fails and both legs are cancelled.
func TestRouterTimeoutFailsAndCancelsBothLegs(t *testing.T) {
	r := newTestRouter(t, RouterConfig{Timeout: time.Second}, prefillNode(1, 64), decodeNode(2, 64))
	r.Submit(1, 4, t0)
	r.Submit(2, 4, t0.Add(500*time.Millisecond))
	mustNil(t, r.LegEnded(2, 1, nil)) // r1 decided before its deadline
	r.Effects()
	r.Tick(t0.Add(time.Second))
	if e := r.Effects(); len(e.Outcomes) != 0 {
		t.Fatalf("at r1's deadline: %+v", e)
	}
	r.Tick(t0.Add(1500 * time.Millisecond))
	e := r.Effects()
	if len(e.Outcomes) != 1 || e.Outcomes[0].Request != 2 || !errors.Is(e.Outcomes[0].Err, ErrTimedOut) || len(e.Cancels) != 2 {
		t.Fatalf("at r2's deadline: %+v", e)
	}
}

// A request submitted with a deadline of the caller's (a retried client
// request's, the same for each attempt) fails at that deadline when it comes
// before now+Timeout, even after requests submitted earlier with later
// deadlines, and at now+Timeout when it comes after.
func TestRouterSubmitByKeepsTheCallersEarlierDeadline(t *testing.T) {
	r := newTestRouter(t, RouterConfig{Timeout: 10 * time.Second}, prefillNode(1, 64), decodeNode(2, 64))
	r.Submit(1, 4, t0)                                             // by t0+10s
	r.SubmitBy(2, 4, t0.Add(time.Second), t0.Add(3*time.Second))   // the retry of a request that began at t0-7s
	r.SubmitBy(3, 4, t0.Add(time.Second), t0.Add(time.Minute))     // by t0+11s: the Timeout is the bound
	r.SubmitBy(4, 4, t0.Add(2*time.Second), t0.Add(2*time.Second)) // due at once
	r.Effects()
	outcomes := func(at time.Duration) (ids []RequestID) {
		r.Tick(t0.Add(at))
		for _, o := range r.Effects().Outcomes {
			if !errors.Is(o.Err, ErrTimedOut) {
				t.Fatalf("at t0+%v: r%d %v, want a timeout", at, o.Request, o.Err)
			}
			ids = append(ids, o.Request)
		}
		return ids
	}
	for _, step := range []struct {
		at   time.Duration
		want []RequestID
	}{{2 * time.Second, []RequestID{4}}, {3 * time.Second, []RequestID{2}}, {10 * time.Second, []RequestID{1}}, {11 * time.Second, []RequestID{3}}} {
		if got := outcomes(step.at); !slices.Equal(got, step.want) {
			t.Fatalf("at t0+%v: timed out %v, want %v", step.at, got, step.want)
		}
	}
}

// With a Horizon, ended records are forgotten; running ones never are.
func TestRouterHorizonForgetsEndedRecords(t *testing.T) {
	r := newTestRouter(t, RouterConfig{Horizon: time.Minute}, prefillNode(1, 64), decodeNode(2, 64))
	r.Submit(1, 4, t0)
	r.Submit(2, 4, t0)
	r.Submit(3, 1000, t0) // refused
	r.LegEnded(1, 1, nil)
	r.Tick(t0.Add(10 * time.Second))
	r.LegEnded(2, 1, nil)
	r.Tick(t0.Add(time.Minute))
	if r.Records() != 2 || r.Request(3).Status != RouteNone {
		t.Fatalf("records %d, r3 %v: want r3 forgotten, r1 and r2 kept", r.Records(), r.Request(3).Status)
	}
	r.Tick(t0.Add(time.Hour))
	if r.Records() != 1 || r.Request(2).Status != RouteRunning {
		t.Fatalf("records %d, r2 %v: want only running r2", r.Records(), r.Request(2).Status)
	}
	if err := r.LegEnded(1, 1, nil); !errors.Is(err, ErrUnknownRequest) {
		t.Fatalf("a report for a forgotten request: %v", err)
	}
}

// At scale: 32 nodes, 20,000 requests, a seeded mix of successes, failures,
// cancels, timeouts, losses and nodes joining; after every event the
// router's per-node accounting equals the open legs, and every accepted
// request ends with exactly one outcome.
func TestRouterOneOutcomePerRequestAtScale(t *testing.T) {
	n := 20000
	if testing.Short() {
		n = 4000
	}
	rng := rand.New(rand.NewPCG(7, 9))
	r := NewRouter(RouterConfig{Timeout: time.Minute, Horizon: time.Hour})
	var nodes []NodeInfo
	for i := range 32 {
		info := NodeInfo{ID: NodeID(i + 1), Role: Role(1 + i%2), PoolPages: 64 << (i % 5), PageTokens: 16, ContextTokens: 8192}
		nodes = append(nodes, info)
		mustNil(t, r.AddNode(info))
	}
	outcomes := map[RequestID]int{}
	accepted := map[RequestID]bool{}
	var open []RequestID
	now := t0
	check := func() {
		e := r.Effects()
		for _, o := range e.Outcomes {
			outcomes[o.Request]++
			if outcomes[o.Request] > 1 {
				t.Fatalf("request %d got a second outcome %v", o.Request, o.Err)
			}
		}
		for _, c := range e.Cancels {
			if st := r.Request(c.Request); st.Prefill != c.Node && st.Decode != c.Node {
				t.Fatalf("cancel %v names a node the request is not on", c)
			}
		}
	}
	for id := RequestID(1); int(id) <= n; id++ {
		now = now.Add(time.Duration(rng.IntN(50)) * time.Millisecond)
		tokens := 1 + rng.IntN(2048)
		if rng.IntN(50) == 0 {
			tokens = 1 + 64<<4*16 + rng.IntN(1000) // over every pool
		}
		if _, err := r.Submit(id, tokens, now); err == nil {
			accepted[id] = true
			open = append(open, id)
		} else if !errors.Is(err, ErrRejected) && !errors.Is(err, ErrNoNode) {
			t.Fatalf("submit %d (%d tokens): %v", id, tokens, err)
		}
		check()
		// Some open requests progress.
		for range 2 {
			if len(open) == 0 {
				break
			}
			i := rng.IntN(len(open))
			q := open[i]
			st := r.Request(q)
			switch x := rng.IntN(20); {
			case x < 12:
				if st.PrefillOpen {
					r.LegEnded(st.Prefill, q, nil)
				}
				if st.DecodeOpen {
					r.LegEnded(st.Decode, q, nil)
				}
			case x < 15:
				if st.DecodeOpen {
					r.LegEnded(st.Decode, q, fmt.Errorf("%w", ErrChecksumMismatch))
				}
				if st.PrefillOpen {
					r.LegEnded(st.Prefill, q, fmt.Errorf("%w", ErrCancelled))
				}
			default:
				r.Cancel(q)
				if st.PrefillOpen {
					r.LegEnded(st.Prefill, q, fmt.Errorf("%w", ErrCancelled))
				}
				if st.DecodeOpen {
					r.LegEnded(st.Decode, q, fmt.Errorf("%w", ErrCancelled))
				}
			}
			open[i] = open[len(open)-1]
			open = open[:len(open)-1]
			check()
		}
		if rng.IntN(1000) == 0 { // a node is lost, and comes back
			k := nodes[rng.IntN(len(nodes))]
			mustNil(t, r.NodeLost(k.ID))
			check()
			mustNil(t, r.AddNode(k))
		}
		r.Tick(now)
		check()
		if id%997 == 0 {
			auditRouter(t, r)
		}
	}
	// Whatever is still open ends now (some timed out already).
	for _, q := range open {
		st := r.Request(q)
		if st.PrefillOpen {
			r.LegEnded(st.Prefill, q, nil)
		}
		if st.DecodeOpen {
			r.LegEnded(st.Decode, q, nil)
		}
	}
	check()
	for id := range accepted {
		if outcomes[id] != 1 {
			t.Fatalf("request %d: %d outcomes", id, outcomes[id])
		}
	}
	for _, l := range r.Nodes() {
		if l.PagesInUse != 0 || l.Requests != 0 {
			t.Fatalf("node %d still counts %d pages in %d requests", l.Info.ID, l.PagesInUse, l.Requests)
		}
	}
	r.Tick(now.Add(2 * time.Hour))
	if r.Records() != 0 {
		t.Fatalf("%d records past the horizon", r.Records())
	}
	t.Logf("%d requests, %d accepted", n, len(accepted))
}

// auditRouter checks that each node's counts are the sum of its open legs.
func auditRouter(t *testing.T, r *Router) {
	t.Helper()
	pages := map[NodeID]int{}
	reqs := map[NodeID]int{}
	for id, q := range r.reqs {
		if q.pLeg == legOpen && q.status != RouteRefused {
			pages[q.prefill] += q.pPages
			reqs[q.prefill]++
		}
		if q.dLeg == legOpen && q.status != RouteRefused {
			pages[q.decode] += q.dPages
			reqs[q.decode]++
		}
		if q.status == RouteEnded && (q.pLeg == legOpen || q.dLeg == legOpen) {
			t.Fatalf("request %d ended with a leg open", id)
		}
	}
	for _, l := range r.Nodes() {
		if l.PagesInUse != pages[l.Info.ID] || l.Requests != reqs[l.Info.ID] {
			t.Fatalf("node %d counts %d pages in %d requests; its open legs hold %d in %d",
				l.Info.ID, l.PagesInUse, l.Requests, pages[l.Info.ID], reqs[l.Info.ID])
		}
	}
}

func mustNil(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// A leg the router cancelled has ended: a node need not report on a request
// it never saw (a Receiver cancelled before the Bootstrap keeps only a
// tombstone), and a report that still comes changes nothing.
func TestRouterCancelledLegNeedNotReport(t *testing.T) {
	r := newTestRouter(t, RouterConfig{}, prefillNode(1, 64), decodeNode(2, 64))
	r.Submit(1, 4, t0)
	r.Effects()
	// The prefill node's own intake refuses it: decode never hears of it.
	mustNil(t, r.LegEnded(1, 1, fmt.Errorf("%w: %w", ErrRejected, ErrTooLong)))
	e := r.Effects()
	if st := r.Request(1); st.Status != RouteEnded || st.DecodeOpen || fmt.Sprint(e.Cancels) != fmt.Sprint([]CancelLeg{{2, 1}}) {
		t.Fatalf("after the prefill leg's refusal: %+v, cancels %v", st, e.Cancels)
	}
	if l := r.Nodes(); l[1].PagesInUse != 0 || l[1].Requests != 0 {
		t.Fatalf("decode still counts the request: %+v", l[1])
	}
	mustNil(t, r.LegEnded(2, 1, fmt.Errorf("%w", ErrCancelled))) // a late report is expected
	if e := r.Effects(); len(e.Outcomes)+len(e.Cancels) != 0 {
		t.Fatalf("a late report had effects: %+v", e)
	}
}

// A node that restarts before its lease expired registers again under its
// ID with a larger incarnation: that is the loss of the old incarnation,
// whose requests fail on every leg, and the node is live again with nothing
// on it. A smaller incarnation is a stale registration, refused. With
// peer-by-name the router knows the node by its ID only: the old
// incarnation's requests carry on.
func TestRouterNewIncarnationIsTheLossOfTheOld(t *testing.T) {
	restarted := func(n NodeInfo, inc uint64) NodeInfo { n.Incarnation = inc; return n }
	for _, sw := range []research.Switches{{}, research.On(research.PeerByName)} {
		r := newTestRouter(t, RouterConfig{Research: sw}, prefillNode(1, 64), decodeNode(3, 64))
		for id := RequestID(1); id <= 3; id++ {
			r.Submit(id, 4, t0)
		}
		r.Effects()
		mustNil(t, r.AddNode(prefillNode(1, 64))) // the same life advertising again: nothing happens
		if e := r.Effects(); len(e.Outcomes) != 0 {
			t.Fatalf("%v: an advertisement update decided %+v", sw, e.Outcomes)
		}
		mustNil(t, r.AddNode(restarted(prefillNode(1, 64), 1)))
		e := r.Effects()
		if sw.Has(research.PeerByName) {
			if len(e.Outcomes) != 0 || r.Request(1).Status != RouteRunning {
				t.Fatalf("peer-by-name: the restart decided %+v; the old requests should carry on", e.Outcomes)
			}
			continue
		}
		if len(e.Outcomes) != 3 || fmt.Sprint(e.PeerLost) != fmt.Sprint([]PeerLost{{3, 1}}) {
			t.Fatalf("outcomes %+v, peer lost %v: want the 3 requests failed and decode told", e.Outcomes, e.PeerLost)
		}
		for _, o := range e.Outcomes {
			if !errors.Is(o.Err, ErrNodeLost) {
				t.Fatalf("outcome %+v, want ErrNodeLost", o)
			}
		}
		if d, err := r.Submit(4, 4, t0); err != nil || d.Prefill != 1 {
			t.Fatalf("the new incarnation takes requests: %+v %v", d, err)
		}
		if err := r.AddNode(prefillNode(1, 64)); !errors.Is(err, ErrBadNode) {
			t.Fatalf("a registration of incarnation 0 after 1: %v, want ErrBadNode", err)
		}
		if st := r.Request(4); st.Status != RouteRunning {
			t.Fatalf("the stale registration changed request 4: %+v", st)
		}
	}
}

// A node that said it is stopping gets no new request until its window
// ends, while its requests run on to their outcomes; with every node of a
// role stopping a request is refused (ErrNoNode, saying so), and a
// registration under a larger incarnation (the node restarted) takes
// requests at once.
func TestRouterSendsNoNewRequestToAStoppingNode(t *testing.T) {
	r := newTestRouter(t, RouterConfig{}, prefillNode(1, 64), prefillNode(2, 64), decodeNode(3, 64), decodeNode(4, 64))
	d1, _ := r.Submit(1, 4, t0) // on 1 and 3, the least loaded by ID
	if d1.Prefill != 1 || d1.Decode != 3 {
		t.Fatalf("dispatch %+v", d1)
	}
	mustNil(t, r.Stopping(3, t0.Add(time.Second)))
	if err := r.Stopping(9, t0); !errors.Is(err, ErrUnknownNode) {
		t.Fatalf("Stopping of an unknown node: %v, want ErrUnknownNode", err)
	}
	for id := RequestID(2); id <= 20; id++ {
		if d, err := r.Submit(id, 4, t0.Add(time.Duration(id)*time.Millisecond)); err != nil || d.Decode != 4 {
			t.Fatalf("request %d while decode 3 stops: %+v %v, want decode 4", id, d, err)
		}
	}
	if !r.Available(RoleDecode, 4, t0) || !r.Available(RolePrefill, 4, t0) {
		t.Fatal("decode 4 and both prefill nodes are available")
	}
	// Its request runs on: decode's success is the client's.
	mustNil(t, r.LegEnded(1, 1, nil))
	mustNil(t, r.LegEnded(3, 1, nil))
	if o := r.Effects().Outcomes; len(o) != 1 || o[0].Request != 1 || o[0].Err != nil {
		t.Fatalf("outcomes %+v: want request 1's success", o)
	}
	// Every decode node stopping: refused, saying so.
	mustNil(t, r.Stopping(4, t0.Add(time.Second)))
	if r.Available(RoleDecode, 4, t0) {
		t.Fatal("no decode node is available while both stop")
	}
	if _, err := r.Submit(21, 4, t0); !errors.Is(err, ErrNoNode) || !strings.Contains(err.Error(), "stopping") {
		t.Fatalf("a request while every decode node stops: %v, want ErrNoNode saying they stop", err)
	}
	// The window ends: decode 3 (fewer pages in use) takes requests again.
	if d, err := r.Submit(22, 4, t0.Add(time.Second)); err != nil || d.Decode != 3 {
		t.Fatalf("after the window: %+v %v, want decode 3", d, err)
	}
	// A restart registered under a larger incarnation ends a window at once.
	mustNil(t, r.Stopping(4, t0.Add(time.Hour)))
	restarted := decodeNode(4, 64)
	restarted.Incarnation = 1
	mustNil(t, r.AddNode(restarted))
	mustNil(t, r.Stopping(3, t0.Add(time.Hour)))
	if d, err := r.Submit(23, 4, t0.Add(time.Second)); err != nil || d.Decode != 4 {
		t.Fatalf("after decode 4's restart: %+v %v, want decode 4", d, err)
	}
	// An advertisement update of the same life keeps it.
	mustNil(t, r.AddNode(decodeNode(3, 64)))
	mustNil(t, r.Stopping(3, t0))
	if !r.Available(RoleDecode, 4, t0.Add(time.Minute)) {
		t.Fatal("decode 4 is available")
	}
	mustNil(t, r.Stopping(4, t0.Add(time.Hour)))
	if r.Available(RoleDecode, 4, t0.Add(time.Minute)) {
		t.Fatal("decode 3's window survives an advertisement of the same life")
	}
}
