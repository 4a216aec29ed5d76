package spec

import (
	"errors"
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
// cancel of the open prefill legs is redundant behind that fence with the
// registry (docs/spec.md, "The partition fault"; with static peers it is
// not: TestTheRouterLegCancelEndsALegAwaitingAGrantFromASilentNodeWithStaticPeers).
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

// dataplaneCut is the partitioned configuration with the dataplane-cut
// fault in place of the partition.
func dataplaneCut(t *testing.T) Config {
	t.Helper()
	cfg := partitioned(t)
	cfg.Prompts, cfg.PrefillPages = []int{2, 2}, 2
	cfg.Faults = Budget{}
	cfg.Faults[FaultDataplaneCut] = 1
	return cfg
}

// A data plane cut breaks every queue pair to the decode node at both ends:
// the leg on it fails and its source pages come back, decode's reservation
// fails and its pages come back; the router still routes to the node (the
// registry and its control API still answer), and a request routed to it
// then fails at prefill's intake, which finds no queue pair, before
// anything is reserved.
func TestADataplaneCutFailsEveryLegOnItsQueuePairsWhileTheNodeStaysListed(t *testing.T) {
	w := newTopologyWorld(t, dataplaneCut(t))
	w.do(Submit, 0, 0).do(PrefillRecv, 0, 0).do(DecodeRecvQP, 0, 0).do(PrefillRecvQP, 0, 0)
	if w.s.Req[0].S.Phase != SWriting || w.s.Req[0].R.Phase != RReserved {
		t.Fatalf("r0 before the cut: sender %v, receiver %v; want writing, reserved", w.s.Req[0].S.Phase, w.s.Req[0].R.Phase)
	}
	w.do(DataplaneCut, -1, DecodeNode)
	q := &w.s.Req[0]
	if q.Outcome != Failed || q.Reason != PeerFailed || q.S.Phase != SFailed || q.S.SrcHeld || q.R.Phase.Live() {
		t.Fatalf("r0 after the cut: %v (%v), sender %v (source held %v), receiver %v; want failed (peer failed), both ends ended",
			q.Outcome, q.Reason, q.S.Phase, q.S.SrcHeld, q.R.Phase)
	}
	for i := 0; i < w.m.cfg.DecodePages; i++ {
		if pg := w.s.Pages[0][i]; pg.Owner != Free {
			t.Fatalf("decode page %d after the cut: %+v; want free", i, pg)
		}
	}
	if w.enabled(DataplaneCut, -1) {
		t.Fatal("a second data plane cut of the same node is enabled")
	}
	w.do(Submit, 1, 0) // the registry and the router still list the node
	if w.s.Req[1].Outcome != Pending || w.s.ToPrefill[0].N != 1 {
		t.Fatalf("r1 routed to the cut node: %v, %d to prefill; want dispatched", w.s.Req[1].Outcome, w.s.ToPrefill[0].N)
	}
	w.do(PrefillRecv, 1, 0)
	if q := &w.s.Req[1]; q.Outcome != Failed || q.Reason != Flushed || q.S.SrcHeld || w.s.QP[0][0].N != 0 {
		t.Fatalf("r1 at prefill's intake: %v (%v), source held %v, %d on the queue pair; want failed (no queue pair), nothing held or sent",
			q.Outcome, q.Reason, q.S.SrcHeld, w.s.QP[0][0].N)
	}
	if !w.m.terminated(&w.s) || !noLeak(w.m, &w.s) {
		t.Fatal("after the cut every leg has ended and nothing is held")
	}
}

// Under the dataplane-cut fault every property holds, and neither lease
// defense is needed: the queue pairs' own error ends every leg on them, and
// the node is not lost, so neither fires. In 2x2 with the lease fault
// beside it, the same (with a partition too, the fence is needed as
// without the cut: TestTheLostDecodeFenceEndsTheLegsAPartitionStrands).
func TestTheLeaseDefensesAreNotNeededUnderADataplaneCut(t *testing.T) {
	one := dataplaneCut(t)
	one.Faults[FaultCancel], one.Faults[FaultTimeout], one.Faults[FaultLate] = 1, 1, 1
	twoByTwo := topology(t, FaultDataplaneCut, FaultLease)
	for _, cfg := range []Config{one, twoByTwo} {
		for _, mu := range []Mutation{NoMutation, NoLostDecodeFence, NoRouterLegCancel} {
			if got := explore(t, withMutation(t, cfg, mu)); len(got) > 0 {
				t.Fatalf("%d prefill x %d decode nodes, faults %v, mutation %v: violated %v, want nothing", cfg.NumPrefills(), cfg.NumDecodes(), cfg.Faults, mu, got)
			}
		}
	}
}

// staticPartition is the partitioned configuration in a deployment of
// static peers (static.go; scripts/check-configs).
func staticPartition(t *testing.T) Config {
	t.Helper()
	cfg := partitioned(t)
	cfg.StaticPeers = true
	return cfg
}

// With static peers no prefill node hears of a decode node's loss, so a leg
// whose Bootstrap the silent node took, waiting for a Grant the partition
// lost, has nothing outstanding for RC's retry limit to fail: the router's
// cancel, when its call to the node fails, is the only thing that ends it.
// Without the cancel (no-router-leg-cancel), Termination fails in 4 steps.
func TestTheRouterLegCancelEndsALegAwaitingAGrantFromASilentNodeWithStaticPeers(t *testing.T) {
	cfg := staticPartition(t)
	w := newTopologyWorld(t, cfg)
	w.do(Submit, 0, 0).do(PrefillRecv, 0, 0).do(DecodeRecvQP, 0, 0) // decode took the Bootstrap: the Grant is in flight
	w.do(Partition, -1, DecodeNode)
	if w.s.Req[0].S.Phase != SAwaitGrant || w.s.QPBack[0][0].N != 0 || w.s.Unacked[0][0] || w.enabled(RetryExceeded, -1) {
		t.Fatalf("after the partition: sender %v, %d on the way back, unacked %v; want awaiting a lost Grant, nothing outstanding",
			w.s.Req[0].S.Phase, w.s.QPBack[0][0].N, w.s.Unacked[0][0])
	}
	w.do(DetectCrash, -1, DecodeNode) // the router's call to it fails
	if q := &w.s.Req[0]; q.Outcome != Failed || q.Reason != PeerFailed || w.s.ToPrefill[0].N != 1 || w.s.ToPrefill[0].Head().Kind != MAbort {
		t.Fatalf("after the router's loss: %v (%v), %d to prefill; want failed (peer failed) and one cancel, no PeerFailed", q.Outcome, q.Reason, w.s.ToPrefill[0].N)
	}
	w.do(PrefillRecv, 0, 0)
	if snd := &w.s.Req[0].S; snd.Phase != SAborted || snd.SrcHeld || w.s.Fenced[0][0] {
		t.Fatalf("after the cancel: sender %v (source held %v), fenced %v; want aborted, freed, not fenced", snd.Phase, snd.SrcHeld, w.s.Fenced[0][0])
	}
	if !w.m.terminated(&w.s) || !noLeak(w.m, &w.s) {
		t.Fatal("after the cancel every leg has ended and nothing is held")
	}
	if got := explore(t, withMutation(t, cfg, NoMutation)); len(got) > 0 {
		t.Fatalf("the correct protocol with static peers violates %v", got)
	}
	if got := explore(t, withMutation(t, cfg, NoRouterLegCancel)); !slices.Contains(got, Termination) {
		t.Fatalf("without the router's leg cancel: violated %v, want Termination", got)
	}
	// With the registry the fence ends that leg too: the cancel is not needed.
	if got := explore(t, withMutation(t, partitioned(t), NoRouterLegCancel)); len(got) > 0 {
		t.Fatalf("with the registry, without the router's leg cancel: violated %v, want nothing", got)
	}
}

// With static peers a leg whose WRITE went into the silent node waits for a
// completion that only RC's retry limit gives: it errors prefill's end of
// the queue pair, which fails the leg and frees its source pages, and stays
// in error. The router's cancel alone leaves the leg aborting, waiting for
// that completion; with an unbounded retry (unbounded-retry), Termination
// fails in 7 steps.
func TestTheRetryLimitEndsALegWhoseWriteWentIntoASilentNodeWithStaticPeers(t *testing.T) {
	cfg := staticPartition(t)
	w := newTopologyWorld(t, cfg)
	w.do(Submit, 0, 0).do(PrefillRecv, 0, 0).do(DecodeRecvQP, 0, 0).do(PrefillRecvQP, 0, 0).do(Compute, 0, 0)
	w.do(Partition, -1, DecodeNode).do(PostWrite, 0, 0)
	if snd := &w.s.Req[0].S; snd.Phase != SSent || snd.Completed != 0 || !w.s.Unacked[0][0] {
		t.Fatalf("after the WRITE into the silent node: sender %+v, unacked %v; want sent, never completed, unacked", *snd, w.s.Unacked[0][0])
	}
	w.do(DetectCrash, -1, DecodeNode).do(PrefillRecv, 0, 0)
	if w.s.Req[0].S.Phase != SAborting {
		t.Fatalf("after the router's cancel: sender %v, want aborting (its WRITE has not completed)", w.s.Req[0].S.Phase)
	}
	w.do(RetryExceeded, -1, Route(0, 0))
	if snd := &w.s.Req[0].S; snd.Phase != SFailed || snd.SrcHeld || !w.s.Fenced[0][0] || w.s.Unacked[0][0] {
		t.Fatalf("after the retry limit: sender %v (source held %v), fenced %v; want failed, freed, cut for good", snd.Phase, snd.SrcHeld, w.s.Fenced[0][0])
	}
	if !w.m.terminated(&w.s) || !noLeak(w.m, &w.s) {
		t.Fatal("after the retry limit every leg has ended and nothing is held")
	}
	if got := explore(t, withMutation(t, cfg, UnboundedRetry)); !slices.Contains(got, Termination) {
		t.Fatalf("with an unbounded retry: violated %v, want Termination", got)
	}
}

// A static deployment has no leases and no registry news of a decode
// restart: a configuration asking for either is refused.
func TestStaticPeersRefuseTheLeaseFaultAndDecodeRestarts(t *testing.T) {
	lease := staticPartition(t)
	lease.Faults[FaultLease] = 1
	restarts := staticPartition(t)
	restarts.Faults[FaultRestart], restarts.DecodeRestarts = 1, true
	for _, cfg := range []Config{lease, restarts} {
		if _, err := New(cfg); !errors.Is(err, ErrBadConfig) {
			t.Fatalf("faults %v, decode restarts %v: %v, want ErrBadConfig", cfg.Faults, cfg.DecodeRestarts, err)
		}
	}
}
