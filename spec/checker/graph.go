package checker

import (
	"errors"
	"math"
	"math/bits"
)

// graph holds the protocol (non-fault) transitions for the liveness analysis,
// in compressed sparse row form: the edges out of state i go to
// dst[start[i]:start[i+1]]. States are expanded in number order, so a
// wave's blocks take consecutive ranges, reserved in order and filled by
// the commit's tasks at once: 4 bytes per state and 4 per protocol edge.
type graph struct {
	start chunked[uint32]
	dst   chunked[uint32]
}

var errTooManyEdges = errors.New("checker: more than 2^32 protocol transitions; use SkipLiveness")

// edgeBlock is where one expanded block's edge lists go in a graph: the
// lists of its states srcs (in increasing order, after those of the blocks
// before it), whose edges are edges, the list of srcs[i] ending at ends[i].
// The wave's blocks are reserved in order by one goroutine (reserve), then
// placed by several at once (place): each writes only its own range of
// start and of dst.
type edgeBlock struct {
	from int    // the first state whose list start it sets: those skipped since the block before (not expanded) get empty lists
	at   uint32 // where its edges start in dst
}

// reserve makes room for a block's edge lists after those reserved before,
// and says where they go.
func (g *graph) reserve(srcs []int32, edges int) (edgeBlock, error) {
	if uint64(g.dst.len())+uint64(edges) > math.MaxUint32 {
		return edgeBlock{}, errTooManyEdges
	}
	eb := edgeBlock{from: g.start.len(), at: uint32(g.dst.len())}
	if len(srcs) > 0 {
		g.start.grow(int(srcs[len(srcs)-1]) + 1)
	}
	g.dst.grow(g.dst.len() + edges)
	return eb, nil
}

// place writes a block's edge lists where reserve put them. Blocks reserved
// apart may be placed at once. A block's edges are copied at once: a call
// per state cost more than the copy.
func (g *graph) place(eb edgeBlock, srcs, ends []int32, edges []uint32) {
	k, from := eb.from, uint32(0)
	for i, src := range srcs {
		for ; k <= int(src); k++ {
			*g.start.ptr(k) = eb.at + from
		}
		from = uint32(ends[i])
	}
	g.dst.copyAt(int(eb.at), edges)
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

// unreachableGoals returns, for each goal, up to limit states, lowest number
// (hence shallowest) first, from which no state in the goal is reachable over
// protocol edges. States that violate a safety property were not expanded;
// they and the states that reach them are never reported (a liveness verdict
// there would be an artefact of stopping at the safety violation).
//
// One backward search serves up to goalsPerSearch goals: a byte per state
// holds the goals it reaches, and a state is searched from again each time
// it gains one. A search per goal read every reverse edge once per goal; the
// spec's two goals mostly reach the same states, so this reads most edges
// once.
func unreachableGoals(n int, r *reverse, goals []bitset, bad bitset, limit int) [][]int32 {
	out := make([][]int32, len(goals))
	words := (n + 63) / 64
	reach := make([]uint8, n)
	queue := make([]uint32, 0, 1024)
	word := func(b bitset, w int) uint64 {
		if w < len(b) {
			return b[w]
		}
		return 0
	}
	for from := 0; from < len(goals); from += goalsPerSearch {
		group := goals[from:min(from+goalsPerSearch, len(goals))]
		all := uint8(uint16(1)<<len(group) - 1)
		clear(reach)
		// The search starts from the states of the goals and the bad ones,
		// found a word at a time.
		var goalWords [goalsPerSearch]uint64
		for w := range words {
			badWord := word(bad, w)
			seeds := badWord
			for i, g := range group {
				goalWords[i] = word(g, w)
				seeds |= goalWords[i]
			}
			for x := seeds; x != 0; x &= x - 1 {
				s := w*64 + bits.TrailingZeros64(x)
				b := uint64(1) << (s & 63)
				m := uint8(0)
				if badWord&b != 0 {
					m = all
				}
				for i := range group {
					if goalWords[i]&b != 0 {
						m |= 1 << i
					}
				}
				reach[s] = m
				queue = append(queue, uint32(s))
			}
		}
		for len(queue) > 0 {
			d := queue[len(queue)-1]
			queue = queue[:len(queue)-1]
			m := reach[d]
			for _, s := range r.src[r.start[d]:r.start[d+1]] {
				if add := m &^ reach[s]; add != 0 {
					reach[s] |= add
					queue = append(queue, s)
				}
			}
		}
		for i := range group {
			for s := 0; s < n && len(out[from+i]) < limit; s++ {
				if reach[s]&(1<<i) == 0 {
					out[from+i] = append(out[from+i], int32(s))
				}
			}
		}
	}
	return out
}

// goalsPerSearch is how many goals one backward search of unreachableGoals
// follows: the bits of a byte.
const goalsPerSearch = 8

// acyclic reports whether the graph has no cycle (Kahn's algorithm). It runs
// on the reverse graph, which has a cycle exactly when the graph has, and
// whose plain arrays cost less to walk than the graph's chunks; a state's
// in-degree there is its out-degree in the graph.
func acyclic(n int, g *graph, r *reverse) bool {
	indeg := make([]uint32, n)
	for s := range n {
		indeg[s] = g.start.at(s+1) - g.start.at(s)
	}
	queue := make([]uint32, 0, 1024)
	for i, d := range indeg {
		if d == 0 {
			queue = append(queue, uint32(i))
		}
	}
	seen := 0
	for len(queue) > 0 {
		v := queue[len(queue)-1]
		queue = queue[:len(queue)-1]
		seen++
		for _, s := range r.src[r.start[v]:r.start[v+1]] {
			indeg[s]--
			if indeg[s] == 0 {
				queue = append(queue, s)
			}
		}
	}
	return seen == n
}
