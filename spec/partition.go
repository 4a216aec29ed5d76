package spec

// The partition fault (issue 23; docs/spec.md, "The partition fault"): a
// live decode node cut off from the rest of the deployment. The lease fault
// covers a node the registry loses while its queue pairs still deliver, and
// the cut fault a queue pair that breaks with both ends told; neither
// silences a live node. A partitioned decode node is silent: nothing more
// reaches it or comes from it on its queue pairs or from the router, what was
// in flight to or from it is lost, and no end of its queue pairs learns of
// it (no flush, no error, no completion: a WRITE posted to it never
// completes). The registry still lists it, so the router may still route to
// it, until its lease expires (DetectCrash of the decode node, a protocol
// step: a lease always runs out), which is the router's loss of it as a
// lease fault's (decodeLoss). It never comes back: a partition that heals
// before the lease runs out is a late delivery or a cut, one that heals
// after it is the lease fault (the node lost while its queue pairs work).
//
// What the partitioned node still does reaches no one, and its registration
// lost, it stops (node/common.go, waitForStop): the model drops its records,
// pages and slots at the partition, as a decode restart does (a free pool,
// epochs from zero: none of it is seen again), so what is left is what the rest of the deployment holds on its behalf: prefill legs
// waiting on it, source pages its WRITEs read. Ending those is the lease
// defenses' work: the router's cancel of the open prefill legs of its
// requests, and each prefill node's fence (the cut of its queue pair to it,
// on PeerFailed).
//
// RC's retry limit would error a queue-pair end that posts to an
// unreachable peer, but it is a timer like decode's reservation timeout,
// which the spec takes as a fault: liveness does not rest on it here either.

// partitions emits the partition of each decode node not yet partitioned.
func (g *successors) partitions() {
	s := g.s
	if s.Budget[FaultPartition] == 0 {
		return
	}
	for d := 0; d < g.c.NumDecodes(); d++ {
		if !s.Partitioned[d] {
			g.do(Action{Partition, -1, DecodeNode | uint16(d)}, 0, 0, d, 0, func(x *sys, _, _, d, _ int) { x.partition(d) })
		}
	}
}

// detectPartitions emits the expiry of each partitioned decode node's
// lease that the router has not yet seen: its loss at the router.
func (g *successors) detectPartitions() {
	s := g.s
	for d := 0; d < g.c.NumDecodes(); d++ {
		if s.Partitioned[d] && !s.DecodeLost[d] {
			g.do(Action{DetectCrash, -1, DecodeNode | uint16(d)}, 0, 0, d, 0, func(x *sys, _, _, d, _ int) {
				x.hit(PartitionLoss)
				x.decodeLoss(d)
			})
		}
	}
}

// partition cuts decode node d off for good: what is in flight to or from
// it is lost without a word to either end, and its own state, which no one
// will hear of again, is dropped (see the file's comment).
func (x *sys) partition(d int) {
	x.s.Budget[FaultPartition]--
	x.s.Partitioned[d] = true
	x.dropDecode(d)
	for p := 0; p < x.m.cfg.NumPrefills(); p++ {
		if x.s.QP[p][d].N > 0 {
			x.postedIntoSilence(p, d) // in flight when it fell silent: never acknowledged
		}
		x.s.QP[p][d].Clear()
		x.s.QPBack[p][d].Clear()
	}
}

// toDecode sends msg from the router to decode node d: lost if d is
// partitioned.
func (x *sys) toDecode(d int, msg Msg) {
	if !x.s.Partitioned[d] {
		x.push(&x.s.ToDecode[d], msg)
	}
}
