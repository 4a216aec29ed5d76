package spec

import (
	"slices"
	"testing"
)

// partitioned is the smallest configuration that catches a prefill node
// without its fence on a lost decode node: one one-page request, a 2-page
// pool, the partition fault (scripts/check-configs).
func partitioned(t *testing.T) Config {
	t.Helper()
	cfg := NewConfig(1, 2, 2)
	cfg.Prompts = []int{2}
	cfg.Faults = Budget{}
	cfg.Faults[FaultPartition] = 1
	return cfg
}

func withMutation(t *testing.T, cfg Config, mu Mutation) *Model {
	t.Helper()
	cfg.Mutation = mu
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// A partitioned decode node is silent: a WRITE posted to it after the
// partition is neither placed nor completed nor flushed, the router still
// routes to it until its lease expires, a Bootstrap to it is lost, and only
// the fence ends the leg whose WRITE went into it.
func TestAPartitionedDecodeNodeIsSilentUntilItsLeaseExpires(t *testing.T) {
	cfg := partitioned(t)
	cfg.Prompts, cfg.PrefillPages = []int{2, 2}, 2
	w := newTopologyWorld(t, cfg)
	w.do(Submit, 0, 0).do(PrefillRecv, 0, 0).do(DecodeRecvQP, 0, 0).do(PrefillRecvQP, 0, 0)
	w.do(Partition, -1, DecodeNode)
	for i := 0; i < cfg.DecodePages; i++ {
		if pg := w.s.Pages[0][i]; pg.Owner != Free || w.s.Req[0].R.Phase.Live() {
			t.Fatalf("the partitioned node's page %d: %+v, record %v; want dropped", i, pg, w.s.Req[0].R.Phase)
		}
	}
	w.do(Compute, 0, 0).do(PostWrite, 0, 0)
	if snd := &w.s.Req[0].S; snd.Completed != 0 || snd.Phase != SSent || w.s.QP[0][0].N != 0 || !snd.SrcHeld {
		t.Fatalf("sender %+v, %d on the queue pair: want the WRITE and Done posted, lost, never completed", *snd, w.s.QP[0][0].N)
	}
	w.do(Submit, 1, 0) // the registry still lists the node: the router routes to it
	if q := &w.s.Req[1]; q.Outcome != Pending || w.s.ToPrefill[0].N != 1 {
		t.Fatalf("r1 submitted to the partitioned node: %v, %d to prefill; want dispatched", q.Outcome, w.s.ToPrefill[0].N)
	}
	w.do(DetectCrash, -1, DecodeNode)
	for r := range 2 {
		if q := &w.s.Req[r]; q.Outcome != Failed || q.Reason != PeerFailed {
			t.Fatalf("r%d after the lease expired: %v (%v), want failed (peer failed)", r, q.Outcome, q.Reason)
		}
	}
	w.do(PrefillRecv, 1, 0) // r1's intake: its Bootstrap is lost
	if q := &w.s.Req[1]; q.S.Phase != SAwaitGrant || w.s.QP[0][0].N != 0 {
		t.Fatalf("r1's prefill leg %v, %d on the queue pair; want awaiting a grant that cannot come", q.S.Phase, w.s.QP[0][0].N)
	}
	w.do(PrefillRecv, 0, 0) // the router's cancel of r0: the leg waits for a WRITE that will never complete
	if w.s.Req[0].S.Phase != SAborting {
		t.Fatalf("prefill r0 after the cancel: %v, want aborting", w.s.Req[0].S.Phase)
	}
	w.do(PrefillRecv, 1, 0)  // the router's cancel of r1
	w.do(PrefillRecv, -1, 0) // PeerFailed(d0): the fence
	if snd := &w.s.Req[0].S; snd.Phase != SFailed || snd.SrcHeld || !w.s.Fenced[0][0] {
		t.Fatalf("after the fence: sender %v (source held %v), fenced %v; want failed, freed, fenced", snd.Phase, snd.SrcHeld, w.s.Fenced[0][0])
	}
	if !w.m.terminated(&w.s) || !noLeak(w.m, &w.s) {
		t.Fatal("after the fence every leg has ended and nothing is held")
	}
}

// Each lease defense under the partition fault: prefill's fence on a lost
// decode node is the only thing that ends a leg whose WRITE went into the
// silent node (without it, Termination fails in 6 steps); the router's
// cancel of the open prefill legs is redundant behind that fence (docs/spec.md,
// "The partition fault").
func TestTheLostDecodeFenceEndsTheLegsAPartitionStrands(t *testing.T) {
	cfg := partitioned(t)
	if got := explore(t, withMutation(t, cfg, NoMutation)); len(got) > 0 {
		t.Fatalf("the correct protocol under a partition violates %v", got)
	}
	if got := explore(t, withMutation(t, cfg, NoLostDecodeFence)); !slices.Contains(got, Termination) {
		t.Fatalf("without the fence on a lost decode node: violated %v, want Termination", got)
	}
	if got := explore(t, withMutation(t, cfg, NoRouterLegCancel)); len(got) > 0 {
		t.Fatalf("without the router's leg cancel: violated %v, want nothing (the fence ends those legs)", got)
	}
	// Without the partition, the lost decode node's queue pairs still
	// deliver, and its legs end through the protocol: the fence is not
	// needed (which is why the lease fault alone could not show it).
	lease := cfg
	lease.Faults = Budget{}
	lease.Faults[FaultLease] = 1
	if got := explore(t, withMutation(t, lease, NoLostDecodeFence)); len(got) > 0 {
		t.Fatalf("under the lease fault alone, without the fence: violated %v, want nothing", got)
	}
}

// The partition fault keeps every property of the correct protocol in a
// 2x2 deployment with a prefill node's crash beside it, and the router routes no
// request to a partitioned node once its lease has expired.
func TestTheCorrectProtocolHoldsUnderPartitionsIn2x2(t *testing.T) {
	cfg := topology(t, FaultPartition, FaultCrash)
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if got := explore(t, m); len(got) > 0 {
		t.Fatalf("violated %v", got)
	}
	w := newTopologyWorld(t, cfg)
	w.do(Partition, -1, DecodeNode|1).do(DetectCrash, -1, DecodeNode|1)
	for _, r := range w.submitRoutes(0) {
		if r&15 == 1 {
			t.Fatalf("routes %v include the lost node d1", w.submitRoutes(0))
		}
	}
}

// A partition drops the node's pool with its prefix cache: a page pinned by
// a request of the partitioned node is no longer anyone's, so dropping it is
// no reallocation (PinnedNeverReallocated judges a decode restart the same
// way; without that, this configuration failed it in 12 steps).
func TestAPartitionDropsAPinnedPrefixWithTheNode(t *testing.T) {
	cfg := NewConfig(2, 3, 2)
	cfg.Prompts, cfg.PrefillPages = []int{4, 4}, 2
	cfg.PrefixCache, cfg.Scopes, cfg.Contents = 2, []int{1, 1}, []string{"aa", "aa"}
	cfg.Faults = Budget{}
	cfg.Faults[FaultPartition] = 1
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if got := explore(t, m); len(got) > 0 {
		t.Fatalf("violated %v", got)
	}
}
