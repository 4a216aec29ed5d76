package checker

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// graphOf builds the liveness analysis's graph from edge lists.
func graphOf(edges [][]uint32) (*graph, *reverse) {
	// In blocks of up to 3 states, leaving out every fifth (a state not
	// expanded, whose list is empty). The blocks are reserved in order, as
	// a wave does, and placed last first: a block's place must not depend
	// on its neighbours being placed.
	var g graph
	type block struct {
		eb   edgeBlock
		srcs []int32
		ends []int32
		all  []uint32
	}
	var blocks []block
	var b block
	flush := func() {
		eb, err := g.reserve(b.srcs, len(b.all))
		if err != nil {
			panic(err)
		}
		b.eb = eb
		blocks = append(blocks, b)
		b = block{}
	}
	for s, out := range edges {
		if s%5 == 4 && len(out) == 0 {
			continue
		}
		b.srcs = append(b.srcs, int32(s))
		b.all = append(b.all, out...)
		b.ends = append(b.ends, int32(len(b.all)))
		if len(b.srcs) == 3 {
			flush()
		}
	}
	flush()
	for _, b := range slices.Backward(blocks) {
		g.place(b.eb, b.srcs, b.ends, b.all)
	}
	g.close(len(edges))
	return &g, g.reverse(len(edges))
}

// acyclicByDFS and reachesByDFS are the definitions, state by state.
func acyclicByDFS(edges [][]uint32) bool {
	color := make([]int, len(edges)) // 0 new, 1 on the stack, 2 done
	var visit func(s uint32) bool
	visit = func(s uint32) bool {
		color[s] = 1
		for _, d := range edges[s] {
			if color[d] == 1 || color[d] == 0 && !visit(d) {
				return false
			}
		}
		color[s] = 2
		return true
	}
	for s := range edges {
		if color[s] == 0 && !visit(uint32(s)) {
			return false
		}
	}
	return true
}

func reachesByDFS(edges [][]uint32, s int, target func(int) bool) bool {
	seen := make([]bool, len(edges))
	stack := []int{s}
	seen[s] = true
	for len(stack) > 0 {
		v := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		if target(v) {
			return true
		}
		for _, d := range edges[v] {
			if !seen[d] {
				seen[d] = true
				stack = append(stack, int(d))
			}
		}
	}
	return false
}

// acyclic and unreachableGoals agree with their definitions on random graphs
// (sizes around multiples of 64, self loops, goal and bad sets shorter than
// the graph, which the analysis reads as unset past their end), and on a
// self loop.
func TestLivenessAnalysisMatchesTheDefinitions(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	if g, r := graphOf([][]uint32{{1}, {1}}); acyclic(2, g, r) {
		t.Fatal("a self loop: acyclic says no cycle")
	}
	for trial := range 400 {
		n := 1 + rng.IntN(200)
		forward := trial%2 == 0 // edges only to higher states: acyclic
		edges := make([][]uint32, n)
		for s := range edges {
			for range rng.IntN(4) {
				d := rng.IntN(n)
				if forward && d <= s {
					continue
				}
				edges[s] = append(edges[s], uint32(d))
			}
		}
		g, r := graphOf(edges)
		if got, want := acyclic(n, g, r), acyclicByDFS(edges); got != want {
			t.Fatalf("trial %d: acyclic = %v, want %v", trial, got, want)
		}
		// 1 to 2*goalsPerSearch+1 goals: one search, several, a last one
		// with fewer goals.
		goals := make([]bitset, 1+trial%(2*goalsPerSearch+1))
		var bad bitset
		for s := range n - rng.IntN(n) {
			switch k := rng.IntN(4 + 2*len(goals)); {
			case k < len(goals):
				goals[k].grow(s + 1)
				goals[k].set(int32(s))
			case k == len(goals):
				bad.grow(s + 1)
				bad.set(int32(s))
			}
		}
		limit := 1 + rng.IntN(n)
		want := make([][]int32, len(goals))
		for i, goal := range goals {
			for s := 0; s < n && len(want[i]) < limit; s++ {
				if !reachesByDFS(edges, s, func(v int) bool { return goal.has(int32(v)) || bad.has(int32(v)) }) {
					want[i] = append(want[i], int32(s))
				}
			}
		}
		if got := unreachableGoals(n, r, goals, bad, limit); !slices.EqualFunc(got, want, slices.Equal) {
			t.Fatalf("trial %d: unreachableGoals = %v, want %v", trial, got, want)
		}
	}
}
