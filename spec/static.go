package spec

// Static peers (issue 23; docs/spec.md, "Static peers: the router's leg
// cancel"): a deployment whose registry never loses a node (node.Static,
// the in-process registry: "It never loses a member by itself"). A prefill node
// hears of no decode node's loss, so it never fences one (no PeerFailed);
// the router loses a decode node when its control API stops answering
// (node/router.go, suspectLocked: protocol.Router.NodeLost, whose cancels
// of the open prefill legs are the only word a prefill node gets). With
// Config.StaticPeers the router's loss of a partitioned decode node
// (DetectCrash@d, a protocol step: a call to a silent node always fails in
// the end) and a lost live one (the lease fault) send no PeerFailed.
//
// What ends a prefill leg stranded on a queue pair to a silent node then:
// its RC retry limit, for a queue pair that holds work outstanding (a WRITE
// or SEND no one acknowledges fails after retry_cnt tries, bounded on
// purpose in rdma/verbs: about half a second), which errors prefill's end:
// every leg on it fails, and no new queue pair to the silent node can be
// set up (the dial fails), so it stays cut (RetryExceeded, a protocol step
// here). A leg with nothing outstanding (its Bootstrap taken, waiting for a
// Grant that the partition lost) is ended by the router's cancel alone: so
// the cancel is necessary here (no-router-leg-cancel: Termination).
//
// With the registry (the default) the spec claims termination without the
// retry limit, which some providers do not bound (rxe reads retry_cnt 7 as
// for ever), since prefill's fence ends every stranded leg; with static
// peers nothing fences, and termination rests on the bounded retry. The
// control connection's keepalive (transfer/setup.go) would cut an idle queue
// pair too, but the control connection may cross another network than the
// queue pair's, so the model does not count on it.

// staticLegCancel is the router's cancel of r's prefill leg when r fails
// elsewhere (protocol.Router.decide, rule 15: the open legs of a failed
// request are cancelled; NodeLost's cancel of a lost decode node's legs is
// the same rule), modelled with static peers only. With the registry the
// spec leaves a failure at decode to decode's Abort on the queue pair and a
// lost node to prefill's fence, as it always has (every earlier state count
// stays); with static peers a partition can lose that Abort and nothing
// fences, so the router's cancel is the prefill leg's only word. A prefill
// node the router lost gets none (the router ends that leg as lost), nor
// does a leg that has ended. Under no-peer-cancel the router tells no leg
// of the other's failure, but still cancels a lost decode node's prefill
// legs (NodeLost's own branch).
func (x *sys) staticLegCancel(r int) {
	q := &x.s.Req[r]
	if !x.m.cfg.StaticPeers || x.mut(NoRouterLegCancel) || x.s.CrashDetected[q.P] || !(q.S.Phase == SNone || q.S.Phase.Live()) {
		return
	}
	if x.bug(NoPeerCancel) && !x.s.DecodeLost[q.D] {
		return
	}
	x.toPrefill(int(q.P), &x.s.ToPrefill[q.P], Msg{Kind: MAbort, Req: int8(r)})
}

// retriesExceeded emits the error of each queue pair's prefill end whose
// work to a partitioned decode node will never be acknowledged.
func (g *successors) retriesExceeded() {
	s := g.s
	if !g.c.StaticPeers || g.c.Mutation == UnboundedRetry {
		return
	}
	for p := 0; p < g.c.NumPrefills(); p++ {
		for d := 0; d < g.c.NumDecodes(); d++ {
			if s.Unacked[p][d] && !s.Fenced[p][d] && !s.PrefillCrashed[p] {
				g.do(Action{RetryExceeded, -1, Route(p, d)}, 0, p, d, 0, func(x *sys, _, p, d, _ int) {
					x.hit(RetryLimit)
					x.s.Unacked[p][d] = false
					x.fenceQP(p, d)
				})
			}
		}
	}
}

// postedIntoSilence records that prefill node p posted work on its queue
// pair to decode node d that no one will acknowledge: d is partitioned.
// Only static peers need it (nothing else ends such a queue pair there).
func (x *sys) postedIntoSilence(p, d int) {
	if x.m.cfg.StaticPeers && x.s.Partitioned[d] && !x.s.Fenced[p][d] && !x.s.PrefillCrashed[p] {
		x.s.Unacked[p][d] = true
	}
}
