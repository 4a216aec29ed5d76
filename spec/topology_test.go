package spec

import (
	"slices"
	"testing"
)

// topology is a 2x2 deployment of two one-page requests, each fault given
// budget 1 where named.
func topology(t *testing.T, faults ...Fault) Config {
	t.Helper()
	cfg := NewConfig(2, 2, 2)
	cfg.Prompts = []int{2, 2}
	cfg.Prefills, cfg.Decodes = 2, 2
	cfg.PrefillPages = 2
	cfg.Faults = Budget{}
	for _, f := range faults {
		cfg.Faults[f] = 1
	}
	return cfg
}

func newTopologyWorld(t *testing.T, cfg Config) *world {
	t.Helper()
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &world{t: t, m: m, s: m.Initial()[0]}
}

// submitRoutes lists the routes Submit offers for r.
func (w *world) submitRoutes(r int) []uint16 {
	var out []uint16
	cur := w.s
	w.m.Successors(&cur, func(a Action, _ *State) {
		if a.Kind == Submit && int(a.Req) == r {
			out = append(out, a.Arg)
		}
	})
	return out
}

// reserved takes r through the router (to prefill p and decode d), prefill's
// intake and computation and decode's reservation, with the grant still on
// its way back.
func (w *world) reserved(r, p, d int) *world {
	w.t.Helper()
	return w.do(Submit, r, Route(p, d)).do(PrefillRecv, r, uint16(p)).computed(r).do(DecodeRecvQP, r, 0)
}

func TestRouterChoosesAnyLiveNodeOfEachRole(t *testing.T) {
	w := newTopologyWorld(t, topology(t, FaultLease))
	if got, want := w.submitRoutes(0), []uint16{Route(0, 0), Route(0, 1), Route(1, 0), Route(1, 1)}; !slices.Equal(got, want) {
		t.Fatalf("routes %v, want every pair %v", got, want)
	}
	w.do(LeaseLost, -1, DecodeNode|1)
	if got, want := w.submitRoutes(0), []uint16{Route(0, 0), Route(1, 0)}; !slices.Equal(got, want) {
		t.Fatalf("after d1's lease expired: routes %v, want only those to d0 %v", got, want)
	}
}

func TestRouterFailsARequestWhenNoNodeOfARoleIsLive(t *testing.T) {
	cfg := topology(t, FaultLease)
	cfg.Faults[FaultLease] = 2
	w := newTopologyWorld(t, cfg)
	w.do(LeaseLost, -1, DecodeNode).do(LeaseLost, -1, DecodeNode|1)
	if got := w.submitRoutes(0); !slices.Equal(got, []uint16{0}) {
		t.Fatalf("routes %v, want the one refusal", got)
	}
	before := w.s
	w.do(Submit, 0, 0)
	if q := &w.s.Req[0]; q.Outcome != Failed || q.Reason != PeerFailed || w.s.ToPrefill != before.ToPrefill {
		t.Fatalf("outcome %v (%v), want failed (peer failed) and nothing dispatched", q.Outcome, q.Reason)
	}
}

func TestCutFailsOnlyItsQueuePairsRequests(t *testing.T) {
	w := newTopologyWorld(t, topology(t, FaultCut))
	w.reserved(0, 0, 0).reserved(1, 0, 1)
	w.do(Cut, -1, Route(0, 0))
	if q := &w.s.Req[0]; q.Outcome != Failed || q.Reason != Flushed || q.R.Phase != RClosed {
		t.Fatalf("r0 on the cut pair: %v (%v), decode %v; want failed (flushed), closed", q.Outcome, q.Reason, q.R.Phase)
	}
	if q := &w.s.Req[1]; q.Outcome != Pending || q.R.Phase != RReserved || w.s.QPBack[0][1].N != 1 {
		t.Fatalf("r1 on p0-d1 must be untouched by the cut of p0-d0: %v, decode %v", q.Outcome, q.R.Phase)
	}
	// r1 completes: its grant, WRITE, Done and read all go through p0-d1.
	w.do(PrefillRecvQP, 1, Route(0, 1)).do(PostWrite, 1, 0).do(DecodeRecvQP, 1, 0).do(DecodeRead, 1, 0)
	if q := &w.s.Req[1]; q.Outcome != OK {
		t.Fatalf("r1: %v, want ok", q.Outcome)
	}
}

// A decode node whose lease expired may live on: the router fails its
// requests and cancels their prefill legs, but decode's pages for them stay
// held until prefill, told of the loss, cuts the queue pair to it.
func TestLostDecodeNodesPagesStayHeldUntilTheQueuePairIsCut(t *testing.T) {
	w := newTopologyWorld(t, topology(t, FaultLease, FaultLate))
	w.reserved(0, 1, 0).do(PrefillRecvQP, 0, Route(1, 0)).do(PostWrite, 0, Late) // a WRITE still in the network
	page := w.s.Req[0].R.Pages[0].Page
	w.do(LeaseLost, -1, DecodeNode)
	if q := &w.s.Req[0]; q.Outcome != Failed || q.Reason != PeerFailed {
		t.Fatalf("r0: %v (%v), want failed (peer failed)", q.Outcome, q.Reason)
	}
	if w.s.ToDecode[0].N != 0 {
		t.Fatal("the router sent to a decode node it declared lost")
	}
	w.do(PrefillRecv, 0, 1) // the Abort of r0's prefill leg: it waits for the WRITE
	if pg := w.s.Pages[0][page]; pg.Owner != 0 || w.s.Req[0].S.Phase != SAborting {
		t.Fatalf("before the cut: page owner %d, sender %v; want r0's, aborting", pg.Owner, w.s.Req[0].S.Phase)
	}
	w.do(PrefillRecv, -1, 1) // PeerFailed(d0): the queue pair p1-d0 is cut for good
	if pg := w.s.Pages[0][page]; pg.Owner != Free || !w.s.Fenced[1][0] || w.s.QP[1][0].N != 0 {
		t.Fatalf("after the cut: page owner %d, fenced %v; want free, fenced, nothing in flight", pg.Owner, w.s.Fenced[1][0])
	}
	if !w.holds(NoForeignWrite) || !w.holds(Conservation) {
		t.Fatal("the cut must leave no WRITE to land")
	}
}

// A prefill node whose lease expired may live on, still taking the work the
// router sent before. The queue pairs to it are then cut for good: its
// Bootstrap is flushed and its leg fails, instead of reserving decode pages
// that nothing will ever fence (the checker found that wedge: a lost prefill
// reserved pages on d0 after d0 had cut it, then crashed).
func TestALostPrefillNodesLaterWorkIsFlushed(t *testing.T) {
	w := newTopologyWorld(t, topology(t, FaultLease))
	w.do(Submit, 0, Route(0, 0)).do(LeaseLost, -1, 0).do(DecodeRecv, -1, 0)
	w.do(PrefillRecv, 0, 0)
	if q := &w.s.Req[0]; q.S.Phase != SFailed || q.S.SrcHeld || w.s.QP[0][0].N != 0 {
		t.Fatalf("prefill leg %v (source held %v), %d on the queue pair; want failed, nothing sent", q.S.Phase, q.S.SrcHeld, w.s.QP[0][0].N)
	}
}

// The exhaustive check of a small 2x2 deployment with crashes and
// lease losses passes; without the permanent fence of a lost node's queue
// pairs (a test-only mutation), the wedge above is a Termination violation.
func TestLostNodesQueuePairsMustStayCut(t *testing.T) {
	cfg := topology(t, FaultCrash, FaultLease)
	m := mutant(t, cfg, func(_ Action, s *State, step func()) {
		step()
		s.Fenced = [MaxPrefills][MaxDecodes]bool{}
	})
	wantViolated(t, m, Termination)
}

// Requests on different pairs share a decode node's pool: a reservation on
// p1-d0 sees the pages p0-d0's request holds.
func TestDecodePoolIsSharedByEveryQueuePairToIt(t *testing.T) {
	cfg := topology(t)
	cfg.DecodePages = 1
	w := newTopologyWorld(t, cfg)
	w.reserved(0, 0, 0)
	w.do(Submit, 1, Route(1, 0)).do(PrefillRecv, 1, 1).do(DecodeRecvQP, 1, 0)
	if q := &w.s.Req[1]; q.Outcome != Failed || q.Reason != NoCapacity {
		t.Fatalf("r1: %v (%v), want failed (no capacity): d0's only page is r0's", q.Outcome, q.Reason)
	}
	if !w.holds(NoSpuriousFailure) {
		t.Fatal("a full pool is a reason")
	}
}
