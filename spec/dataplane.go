package spec

// The dataplane-cut fault (issue 23; docs/spec.md, "The dataplane-cut
// fault"): the reverse of the partition. The network between a live decode
// node and every prefill node fails, while the registry (its lease is kept
// alive) and the router (its control API answers) still list the node.
//
// What the implementation does then, and the model with it: every queue
// pair to the node goes to the error state at both ends. A work request
// outstanding on it fails within the RC retry limit (rdma/verbs: retry_cnt
// 6, about half a second, bounded on purpose), and an idle one's control
// connection fails its keepalive (transfer/setup.go: about 20 s); either
// way each end cuts its queue pair (transfer: Sender.Flushed,
// Receiver.QueuePairFenced), so every prefill leg on it fails (peer
// failed), decode's reservations on it fail, and their pages come back once
// the flush has drained (nothing more can land on a queue pair in error).
// That is the cut fault's step on every queue pair to the node at once
// (cutQP): the ends learn of it one after the other in the system, but
// nothing either end does before it learns reaches the other, so the
// model's one step loses no outcome (docs/spec.md).
//
// It stays cut: each prefill node's dialer tries again every second and
// fails while the network is down, so a request routed to the node meets
// no queue pair at prefill's intake (transfer.ErrNoPeer) and fails there,
// before anything is reserved. The router does not take the node out of
// rotation (it loses a node only when the registry does, or when its
// control API stops answering, and both still work) and does not retry the
// request elsewhere (it retries only a request refused for capacity): it
// fails the request and cancels its decode leg, which holds nothing yet. A
// cut that heals is the cut fault on each queue pair: a new queue pair
// serves later requests.

// dataplaneCuts emits the data plane cut of each decode node whose queue
// pairs still work.
func (g *successors) dataplaneCuts() {
	s := g.s
	if s.Budget[FaultDataplaneCut] == 0 {
		return
	}
	for d := 0; d < g.c.NumDecodes(); d++ {
		if !s.Severed[d] && !s.Partitioned[d] { // a partitioned node is cut off already, and no end is told
			g.do(Action{DataplaneCut, -1, DecodeNode | uint16(d)}, 0, 0, d, 0, func(x *sys, _, _, d, _ int) { x.dataplaneCut(d) })
		}
	}
}

// dataplaneCut breaks every queue pair to decode node d for good: both ends
// flush what they hold and fail the requests on it.
func (x *sys) dataplaneCut(d int) {
	x.s.Budget[FaultDataplaneCut]--
	x.s.Severed[d] = true
	for p := 0; p < x.m.cfg.NumPrefills(); p++ {
		x.cutQP(p, d, PeerFailed)
	}
}
