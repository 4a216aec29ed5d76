package checker

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"time"
)

// A level of the search is expanded in waves of frontier blocks, each wave in
// three parallel phases with nothing serial between them but loops over
// arrays and, when the index must grow, its rebuild (Stats.Phases times each
// part):
//
//  1. expand (a task per block): generate every successor, fingerprint it,
//     drop those seen earlier in the block and those already visited (the
//     index is only read; a successor not among the block's candidates
//     waits for its lookup until the next such one has been fingerprinted,
//     its slot prefetched meanwhile); the rest are candidates, grouped by
//     shard;
//  2. deduplicate (a task per shard): in block order, keep the first
//     occurrence of each candidate in the wave;
//  3. commit (a task per block, and one per shard): the first occurrences,
//     numbered in wave order by a serial loop, are recorded (with the goals
//     they reach), indexed in their shard and written to next level's
//     blocks; edges get their targets and go to the liveness analysis's
//     graph, at the places the serial loop reserved for each block.
//
// States are numbered in the order a sequential search numbers them, so the
// counterexample is the same on every run and every core count.

// candRef marks an edge whose target is a candidate of the same expansion,
// numbered when the wave is committed.
const candRef = 1 << 31

// candidate is a successor not in the visited set when it was generated.
type candidate struct {
	parent  int32
	succ    uint16
	fault   bool
	fp      Fingerprint
	badMask uint64 // invariants violated (bit i = invariant i)
	goals   uint64 // goals reached
}

// expansion is what a worker produced from one frontier block.
type expansion[S any] struct {
	src         []int32  // the block's states, in order
	edgeEnd     []int32  // per source, the end of its edges in edges
	edges       []uint32 // protocol edges: a state number, or candRef|candidate
	cands       []candidate
	states      []S     // the candidates' states, without an encoder
	data        []byte  // with an encoder: the candidates' encodings, each after its uvarint length
	deadlocks   []int32 // sources with no enabled action that are not finished (in bitstate mode, their positions in the block)
	transitions int
	err         error

	byShard  []int32 // candidate indices grouped by shard, in order within a shard
	shardEnd [numShards + 1]int32
	offset   int         // the index of its first candidate in the wave
	edgeAt   edgeBlock   // where its edges go in the liveness analysis's graph
	next     []*block[S] // its new states, for the next level's frontier
	bad      []badState  // its new states that violate an invariant
	block    *block[S]   // the block expanded (bitstate mode: the parents' paths)
	order    []int32     // bitstate mode: the first occurrences, in order
	encAt    []int32     // bitstate mode: per candidate, its encoding's start and end in data
}

// waveFirst is a candidate that first occurs in its wave.
type waveFirst struct {
	fp Fingerprint
	g  int32 // its index in the wave
}

// waveSet is one shard's set of the wave's candidates: an open-addressing
// table of indices into firsts.
type waveSet struct {
	slots  []int32 // index into firsts + 1; 0 is empty
	firsts []waveFirst
}

// wave expands blocks and commits their new states, in BFS order, to next.
func (c *run[S, A]) wave(blocks []*block[S], outs []*expansion[S], next *frontier[S], deadlocks *[]stateRef, newBad *[]badState) error {
	for len(c.scratch) < c.workers {
		c.scratch = append(c.scratch, newWorker(c))
	}
	ph := &c.res.Stats.Phases
	parallel(&ph.Expand, c.workers, len(blocks), func(k, i int) { c.scratch[k].expand(blocks[i], outs[i]) })
	serial := time.Now()
	total := 0
	for _, out := range outs {
		if out.err != nil {
			return out.err
		}
		out.offset = total
		total += len(out.cands)
	}
	if cap(c.ref) < total {
		c.ref, c.num = make([]int32, total), make([]int32, total)
	}
	ref, num := c.ref[:total], c.num[:total]

	ph.Number += time.Since(serial)

	// 2. deduplicate, by shard.
	parallel(&ph.Dedup, c.workers, numShards, func(_, s int) { c.dedup(s, outs, ref) })
	if c.bits != nil {
		for s := range numShards {
			c.stored += len(c.waves[s].firsts)
		}
		parallel(&ph.Commit, c.workers, len(outs), func(_, i int) { c.commitBitstate(outs[i], ref) })
		return c.collect(outs, ref, nil, next, deadlocks, newBad)
	}
	var more [numShards]int
	for s := range more {
		more[s] = len(c.waves[s].firsts)
	}
	serial = time.Now()
	c.seen.makeRoom(&more)
	ph.Grow += time.Since(serial)
	serial = time.Now()
	first := c.seen.len()
	n := int32(first)
	for g, r := range ref {
		if int(r) == g {
			num[g] = n
			n++
		}
	}
	c.seen.reserve(int(n))
	c.reserveRecords(int(n))
	if c.liveness {
		for _, out := range outs {
			var err error
			if out.edgeAt, err = c.edges.reserve(out.src, len(out.edges)); err != nil {
				return err
			}
		}
	}
	ph.Number += time.Since(serial)

	// 3. commit, by block and by shard.
	parallel(&ph.Commit, c.workers, len(outs)+numShards, func(_, i int) {
		if i < len(outs) {
			c.commit(outs[i], ref, num)
			return
		}
		s := i - len(outs)
		c.seen.placeAll(c.waves[s].firsts, num)
	})
	return c.collect(outs, ref, num, next, deadlocks, newBad)
}

// collect gathers the wave's results, in block order: the serial part
// (counts, deadlocks, violations, the next frontier's blocks).
func (c *run[S, A]) collect(outs []*expansion[S], ref, num []int32, next *frontier[S], deadlocks *[]stateRef, newBad *[]badState) error {
	start := time.Now()
	defer func() { c.res.Stats.Phases.Collect += time.Since(start) }()
	for _, out := range outs {
		if out.err != nil {
			return out.err
		}
		c.res.Stats.Transitions += out.transitions
		for _, d := range out.deadlocks {
			if c.bits != nil {
				*deadlocks = append(*deadlocks, stateRef{path: slices.Clone(out.block.pathOf(int(d)))})
			} else {
				*deadlocks = append(*deadlocks, stateRef{idx: d})
			}
		}
		*newBad = append(*newBad, out.bad...)
		for _, b := range out.next {
			if err := next.push(b); err != nil {
				return err
			}
		}
		out.next = out.next[:0]
	}
	return nil
}

// dedup marks, for shard s, each candidate of the wave with the index of its
// first occurrence (ref[g] == g for a first occurrence).
func (c *run[S, A]) dedup(s int, outs []*expansion[S], ref []int32) {
	ws := &c.waves[s]
	count := 0
	for _, out := range outs {
		count += int(out.shardEnd[s+1] - out.shardEnd[s])
	}
	size := 16
	for size < 2*count {
		size *= 2
	}
	if cap(ws.slots) < size {
		ws.slots = make([]int32, size)
	} else {
		ws.slots = ws.slots[:size]
		clear(ws.slots)
	}
	ws.firsts = ws.firsts[:0]
	if c.bits != nil {
		for _, out := range outs {
			for _, ci := range out.byShard[out.shardEnd[s]:out.shardEnd[s+1]] {
				g := int32(out.offset) + ci
				ref[g] = -1
				if fp := out.cands[ci].fp; c.bits.add(fp) {
					ref[g] = g
					ws.firsts = append(ws.firsts, waveFirst{fp, g})
				}
			}
		}
		return
	}
	mask := uint64(size - 1)
	for _, out := range outs {
		for _, ci := range out.byShard[out.shardEnd[s]:out.shardEnd[s+1]] {
			fp := out.cands[ci].fp
			g := int32(out.offset) + ci
			i := fp[1] & mask
			for {
				e := ws.slots[i]
				if e == 0 {
					ws.firsts = append(ws.firsts, waveFirst{fp, g})
					ws.slots[i] = int32(len(ws.firsts))
					ref[g] = g
					break
				}
				if f := ws.firsts[e-1]; f.fp == fp {
					ref[g] = f.g
					break
				}
				i = (i + 1) & mask
			}
		}
	}
}

// commit records the first occurrences of an expansion's candidates (numbered
// in num), writes them to blocks of the next frontier, and gives its edges
// their targets.
func (c *run[S, A]) commit(out *expansion[S], ref, num []int32) {
	out.bad = out.bad[:0]
	var b *block[S]
	data := out.data
	for ci := range out.cands {
		cd := &out.cands[ci]
		var enc []byte
		if c.enc != nil {
			l, k := binary.Uvarint(data)
			enc, data = data[k:k+int(l)], data[k+int(l):]
		}
		g := out.offset + ci
		if int(ref[g]) != g {
			continue
		}
		idx := num[g]
		c.seen.set(idx, cd.fp, cd.parent, cd.succ)
		if cd.goals|cd.badMask != 0 {
			c.record(idx, cd.goals, cd.badMask)
		}
		if cd.badMask != 0 {
			out.bad = append(out.bad, badState{stateRef{idx: idx}, cd.badMask})
			continue
		}
		if b == nil || b.len() == blockStates {
			b = c.blocks.get(c.enc != nil)
			out.next = append(out.next, b)
		}
		b.idx = append(b.idx, idx)
		if c.enc == nil {
			b.states = append(b.states, out.states[ci])
		} else {
			b.data = binary.AppendUvarint(b.data, uint64(len(enc)))
			b.data = append(b.data, enc...)
		}
	}
	if c.liveness {
		for i, e := range out.edges {
			if e&candRef != 0 {
				out.edges[i] = uint32(num[ref[out.offset+int(e&^candRef)]])
			}
		}
		c.edges.place(out.edgeAt, out.src, out.edgeEnd, out.edges)
	}
}

// commitBitstate writes an expansion's new states, with their paths, to
// blocks of the next frontier.
func (c *run[S, A]) commitBitstate(out *expansion[S], ref []int32) {
	out.bad = out.bad[:0]
	out.order = out.order[:0]
	out.encAt = out.encAt[:0]
	data := 0
	for ci := range out.cands {
		if c.enc != nil {
			l, k := binary.Uvarint(out.data[data:])
			out.encAt = append(out.encAt, int32(data+k), int32(data+k+int(l)))
			data += k + int(l)
		}
		if g := out.offset + ci; int(ref[g]) == g {
			out.order = append(out.order, int32(ci))
		}
	}
	// A swarm member's search order: each expansion's new states start at an
	// offset of its own, so the next level is expanded in another order (each
	// state stays at its depth, so traces stay shortest).
	rot := 0
	if c.opt.Shuffle != 0 && len(out.order) > 0 {
		rot = int(mum(c.opt.Shuffle^uint64(out.offset), 0x9e3779b97f4a7c15) % uint64(len(out.order)))
	}
	var b *block[S]
	for k := range out.order {
		ci := int(out.order[(k+rot)%len(out.order)])
		cd := &out.cands[ci]
		parent := out.block.pathOf(int(cd.parent))
		if cd.badMask != 0 {
			path := binary.AppendUvarint(slices.Clone(parent), uint64(cd.succ))
			out.bad = append(out.bad, badState{stateRef{path: path, fp: cd.fp}, cd.badMask})
			continue
		}
		if b == nil || b.len() == blockStates {
			b = c.blocks.get(c.enc != nil)
			out.next = append(out.next, b)
		}
		b.paths = append(b.paths, parent...)
		b.paths = binary.AppendUvarint(b.paths, uint64(cd.succ))
		b.idx = append(b.idx, int32(len(b.paths)))
		if c.enc == nil {
			b.states = append(b.states, out.states[ci])
		} else {
			enc := out.data[out.encAt[2*ci]:out.encAt[2*ci+1]]
			b.data = binary.AppendUvarint(b.data, uint64(len(enc)))
			b.data = append(b.data, enc...)
		}
	}
}

// worker is one goroutine's scratch space, kept for the whole run: expanding a
// state allocates nothing.
type worker[S any, A comparable] struct {
	c     *run[S, A]
	state S // the state being expanded
	fbuf  []byte
	ebuf  []byte
	emit  func(a A, succ *S) // looks at one successor of the state being expanded
	local []int32            // the block's candidates by fingerprint: an open-addressing table of index + 1
	count [numShards]int32

	out    *expansion[S] // where successors go
	cur    *S            // the state being expanded
	parent int32         // the number of the state being expanded
	n      int           // its successors so far

	// pend is the last successor not found among the block's candidates:
	// it is looked up in the visited set only when the next such successor
	// has been fingerprinted (or one equal to it, or the block ends, or a
	// Builder asks for the buffer it waits in), so that the cache miss of
	// its slot, prefetched, has had that time to arrive (a lookup on the
	// spot waited for memory, about a tenth of the run's time).
	pend      pendingSucc[S]
	pending   bool
	copyState func(dst, src *S)

	// With a Builder, the model builds each successor in one of bufs, in
	// turn (buffer): the pending successor stays where it was built until
	// the model asks for its buffer again.
	bufs   [2]S
	flip   int
	buffer func() *S
}

// pendingSucc is a successor whose lookup is deferred: its state (at: in
// one of the worker's buffers, or a copy in state), with what its
// candidate needs.
type pendingSucc[S any] struct {
	at     *S
	state  S
	fp     Fingerprint
	parent int32
	succ   uint16
	fault  bool
	edge   int // its protocol edge's place in out.edges, or -1
}

func newWorker[S any, A comparable](c *run[S, A]) *worker[S, A] {
	w := &worker[S, A]{c: c, local: make([]int32, 1024)}
	w.emit = w.successor
	w.buffer = w.nextBuffer
	w.copyState = func(dst, src *S) { *dst = *src }
	if cp, ok := c.m.(StateCopier[S]); ok {
		w.copyState = cp.CopyState
	}
	return w
}

// expand generates the successors of every state of b. It only reads the
// visited set, which nobody writes while workers run.
func (w *worker[S, A]) expand(b *block[S], out *expansion[S]) {
	c := w.c
	out.src = append(out.src[:0], b.idx...)
	out.edgeEnd, out.edges, out.cands = out.edgeEnd[:0], out.edges[:0], out.cands[:0]
	clear(out.states)
	out.states, out.data, out.deadlocks = out.states[:0], out.data[:0], out.deadlocks[:0]
	out.transitions, out.err = 0, nil
	clear(w.local)
	w.pending = false
	w.out = out
	out.block = b
	data := b.data
	for i, parent := range b.idx {
		var s *S
		if c.enc == nil {
			s = &b.states[i]
		} else {
			l, k := binary.Uvarint(data)
			if k <= 0 || uint64(len(data)-k) < l {
				out.err = errors.New("checker: corrupt frontier block")
				return
			}
			if err := c.enc.DecodeState(data[k:k+int(l)], &w.state); err != nil {
				out.err = fmt.Errorf("checker: DecodeState: %w", err)
				return
			}
			data = data[k+int(l):]
			s = &w.state
		}
		w.parent, w.n, w.cur = parent, 0, s
		if c.bits != nil {
			w.parent = int32(i)
		}
		if c.build != nil {
			c.build.SuccessorsIn(s, w.buffer, w.emit)
		} else {
			c.m.Successors(s, w.emit)
		}
		out.transitions += w.n
		out.edgeEnd = append(out.edgeEnd, int32(len(out.edges)))
		if w.n == 0 && !c.m.Finished(s) {
			out.deadlocks = append(out.deadlocks, w.parent)
		}
	}
	if w.pending {
		w.resolve()
	}
	w.out = nil
	// Group the candidates by shard (a counting sort, stable).
	clear(w.count[:])
	for i := range out.cands {
		w.count[shardOf(out.cands[i].fp)]++
	}
	out.shardEnd[0] = 0
	for s := range numShards {
		out.shardEnd[s+1] = out.shardEnd[s] + w.count[s]
		w.count[s] = out.shardEnd[s]
	}
	if cap(out.byShard) < len(out.cands) {
		out.byShard = make([]int32, len(out.cands), 2*len(out.cands))
	}
	out.byShard = out.byShard[:len(out.cands)]
	for i := range out.cands {
		s := shardOf(out.cands[i].fp)
		out.byShard[w.count[s]] = int32(i)
		w.count[s]++
	}
}

// successor looks at the next successor of the state being expanded.
func (w *worker[S, A]) successor(a A, next *S) {
	c, out := w.c, w.out
	k := w.n
	w.n++
	if k > maxSuccessors {
		out.err = fmt.Errorf("checker: a state has more than %d successors", maxSuccessors)
		return
	}
	if next == w.cur {
		// The model handed back the state being expanded (an action that
		// changes nothing): the successor is that state, known already.
		if c.liveness && c.bits == nil && !c.m.IsFault(a) {
			out.edges = append(out.edges, uint32(w.parent))
		}
		return
	}
	w.fbuf = c.m.AppendFingerprint(w.fbuf[:0], next)
	fp := c.fingerprint(w.fbuf)
	fault := c.m.IsFault(a)
	protocol := c.liveness && !fault
	if w.pending && w.pend.fp == fp {
		// The same state as the pending successor: decided first, so that
		// the block's table below has it if it is new (else it would be a
		// second candidate, encoded for the wave's deduplication to drop).
		w.resolve()
	}
	// The block's own candidates first: their table is small and in cache,
	// and a candidate is not in the visited set (nothing writes it while
	// blocks expand), so the order of the two lookups changes nothing but
	// the visited set's cache misses, saved for a state reached twice in
	// the block.
	mask := uint64(len(w.local) - 1)
	for i := fp[1] & mask; w.local[i] != 0; i = (i + 1) & mask {
		if ci := w.local[i] - 1; out.cands[ci].fp == fp {
			if protocol {
				out.edges = append(out.edges, candRef|uint32(ci))
			}
			return
		}
	}
	if c.bits != nil {
		c.bits.prefetch(fp)
	} else {
		c.seen.prefetch(fp)
	}
	if w.pending {
		w.resolve()
	}
	p := &w.pend
	p.fp, p.parent, p.succ, p.fault, p.edge = fp, w.parent, uint16(k), fault, -1
	if protocol {
		p.edge = len(out.edges)
		out.edges = append(out.edges, 0)
	}
	if next == &w.bufs[0] || next == &w.bufs[1] {
		p.at = next
	} else {
		w.copyState(&p.state, next)
		p.at = &p.state
	}
	w.pending = true
}

// nextBuffer returns the state the model is to build its next successor in
// (a Builder's next): the worker's two buffers in turn. The pending
// successor's buffer is handed out again only once it is decided.
func (w *worker[S, A]) nextBuffer() *S {
	b := &w.bufs[w.flip]
	if w.pending && w.pend.at == b {
		w.resolve()
	}
	w.flip ^= 1
	return b
}

// resolve decides the pending successor: a state visited before, or a new
// candidate.
func (w *worker[S, A]) resolve() {
	c, out, p := w.c, w.out, &w.pend
	w.pending = false
	fp := p.fp
	if c.bits != nil {
		if c.bits.has(fp) {
			return
		}
	} else if known := c.seen.lookup(fp); known >= 0 {
		if p.edge >= 0 {
			out.edges[p.edge] = uint32(known)
		}
		return
	}
	ci := int32(len(out.cands))
	w.addLocal(fp, ci)
	next := p.at
	out.cands = append(out.cands, candidate{parent: p.parent, succ: p.succ, fault: p.fault, fp: fp,
		badMask: c.evalInvs(next), goals: c.evalGoals(next)})
	if 2*len(out.cands) > len(w.local) {
		w.growLocal()
	}
	if p.edge >= 0 {
		out.edges[p.edge] = candRef | uint32(ci)
	}
	if c.enc == nil {
		out.states = append(out.states, *next)
	} else {
		w.ebuf = c.enc.AppendState(w.ebuf[:0], next)
		out.data = binary.AppendUvarint(out.data, uint64(len(w.ebuf)))
		out.data = append(out.data, w.ebuf...)
	}
}

// growLocal doubles the block's candidate table.
func (w *worker[S, A]) growLocal() {
	w.local = make([]int32, 2*len(w.local))
	for ci := range w.out.cands {
		w.addLocal(w.out.cands[ci].fp, int32(ci))
	}
}

// addLocal files candidate ci, absent from the block's table, under fp.
func (w *worker[S, A]) addLocal(fp Fingerprint, ci int32) {
	mask := uint64(len(w.local) - 1)
	i := fp[1] & mask
	for w.local[i] != 0 {
		i = (i + 1) & mask
	}
	w.local[i] = ci + 1
}
