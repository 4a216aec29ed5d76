package checker

import (
	"errors"
	"math"
)

// graph holds the protocol (non-fault) transitions for the liveness analysis,
// in compressed sparse row form: the edges out of state i go to
// dst[start[i]:start[i+1]]. States are expanded in number order, so edges are
// appended source by source: 4 bytes per state and 4 per protocol edge.
type graph struct {
	start chunked[uint32]
	dst   chunked[uint32]
}

var errTooManyEdges = errors.New("checker: more than 2^32 protocol transitions; use SkipLiveness")

// open starts the edge list of state src; states skipped since the last one
// (not expanded) get none.
func (g *graph) open(src int32) {
	for g.start.len() <= int(src) {
		g.start.append(uint32(g.dst.len()))
	}
}

// addAll appends edges to the list of the state opened last.
func (g *graph) addAll(dst []uint32) error {
	if uint64(g.dst.len())+uint64(len(dst)) > math.MaxUint32 {
		return errTooManyEdges
	}
	g.dst.appendSlice(dst)
	return nil
}

// close ends the lists of n states.
func (g *graph) close(n int) {
	for g.start.len() <= n {
		g.start.append(uint32(g.dst.len()))
	}
}

// reverse is the graph with its edges reversed, in plain arrays: 4 bytes per
// state and per edge, allocated once at their final size.
type reverse struct {
	start []uint32 // the edges into d come from src[start[d]:start[d+1]]
	src   []uint32
}

func (g *graph) reverse(n int) *reverse {
	r := &reverse{start: make([]uint32, n+1), src: make([]uint32, g.dst.len())}
	for j := range g.dst.len() {
		r.start[g.dst.at(j)+1]++
	}
	for i := 1; i <= n; i++ {
		r.start[i] += r.start[i-1]
	}
	// Fill with start[d] as the cursor of d, then shift back: start[d] has then
	// advanced to start[d+1].
	for s := range n {
		for j, end := g.start.at(s), g.start.at(s+1); j < end; j++ {
			d := g.dst.at(int(j))
			r.src[r.start[d]] = uint32(s)
			r.start[d]++
		}
	}
	copy(r.start[1:], r.start[:n])
	r.start[0] = 0
	return r
}

// unreachableGoal returns up to limit states, lowest number (hence shallowest)
// first, from which no state in goal is reachable over protocol edges. States
// that violate a safety property were not expanded; they and the states that
// reach them are never reported (a liveness verdict there would be an artefact
// of stopping at the safety violation).
func unreachableGoal(n int, r *reverse, goal, bad bitset, limit int) []int32 {
	can := make(bitset, (n+63)/64)
	queue := make([]uint32, 0, 1024)
	for i := int32(0); i < int32(n); i++ {
		// A bad state was not expanded, so what it could reach is unknown: count
		// it as reaching the goal rather than blame its predecessors.
		if goal.has(i) || bad.has(i) {
			can.set(i)
			queue = append(queue, uint32(i))
		}
	}
	for len(queue) > 0 {
		d := queue[len(queue)-1]
		queue = queue[:len(queue)-1]
		for _, s := range r.src[r.start[d]:r.start[d+1]] {
			if !can.has(int32(s)) {
				can.set(int32(s))
				queue = append(queue, s)
			}
		}
	}
	var out []int32
	for i := int32(0); i < int32(n) && len(out) < limit; i++ {
		if !can.has(i) {
			out = append(out, i)
		}
	}
	return out
}

// acyclic reports whether the graph has no cycle (Kahn's algorithm, over the
// reverse graph's in-degrees).
func acyclic(n int, g *graph, r *reverse) bool {
	indeg := make([]uint32, n)
	selfLoop := false
	for d := range n {
		indeg[d] = r.start[d+1] - r.start[d]
		for _, s := range r.src[r.start[d]:r.start[d+1]] {
			selfLoop = selfLoop || int(s) == d
		}
	}
	if selfLoop {
		return false
	}
	queue := make([]uint32, 0, 1024)
	for i := range indeg {
		if indeg[i] == 0 {
			queue = append(queue, uint32(i))
		}
	}
	seen := 0
	for len(queue) > 0 {
		v := queue[len(queue)-1]
		queue = queue[:len(queue)-1]
		seen++
		for j, end := g.start.at(int(v)), g.start.at(int(v)+1); j < end; j++ {
			d := g.dst.at(int(j))
			indeg[d]--
			if indeg[d] == 0 {
				queue = append(queue, d)
			}
		}
	}
	return seen == n
}
