package checker

import (
	"encoding/binary"
	"slices"
	"testing"
)

// twins is a chain 0 → 1 → … → limit in which every step is taken by two
// actions in a row (0 and 1) that lead to the same state, and a third
// (2) skips a state.
type twins struct{ limit uint64 }

func (twins) Initial() []uint64 { return []uint64{0} }

func (m twins) Successors(s *uint64, emit func(a int, next *uint64)) {
	if *s >= m.limit {
		return
	}
	n := *s + 1
	emit(0, &n)
	emit(1, &n)
	if *s+2 <= m.limit {
		k := *s + 2
		emit(2, &k)
	}
}

func (twins) AppendFingerprint(dst []byte, s *uint64) []byte { return binary.AppendUvarint(dst, *s) }
func (twins) IsFault(int) bool                               { return false }
func (m twins) Finished(s *uint64) bool                      { return *s == m.limit }

// expandOne expands one block of states (numbered from 0) with a fresh run
// of m, whose visited set is empty.
func expandOne(t *testing.T, m twins, states ...uint64) *expansion[uint64] {
	t.Helper()
	done := Goal[uint64]{Name: "done", Reached: func(s *uint64) bool { return *s == m.limit }}
	c, err := newRun(Model[uint64, int](m), Properties[uint64]{Goals: []Goal[uint64]{done}}, Options{Workers: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	b := c.blocks.get(false)
	for i, s := range states {
		b.idx, b.states = append(b.idx, int32(i)), append(b.states, s)
	}
	out := &expansion[uint64]{}
	newWorker(c).expand(b, out)
	if out.err != nil {
		t.Fatal(out.err)
	}
	return out
}

// A successor's lookup in the visited set waits until the next successor
// has been fingerprinted (the pending one). A successor equal to the
// pending one must find it, not become a second candidate: the deferral
// must leave a block's candidates as distinct as a lookup on the spot did,
// and each protocol edge must name its target.
func TestADeferredLookupFindsTheSuccessorPendingBeforeIt(t *testing.T) {
	out := expandOne(t, twins{limit: 5}, 2)
	if len(out.cands) != 2 || out.cands[0].fp == out.cands[1].fp {
		t.Fatalf("candidates %+v, want two distinct (states 3 and 4)", out.cands)
	}
	if want := []uint32{candRef, candRef, candRef | 1}; !slices.Equal(out.edges, want) {
		t.Fatalf("edges %x, want %x", out.edges, want)
	}
	if out.cands[0].succ != 0 || out.cands[1].succ != 2 {
		t.Fatalf("candidates come from successors %d and %d, want 0 and 2", out.cands[0].succ, out.cands[1].succ)
	}
}

// A pending successor outlives the state it came from: it is decided
// while the next state of the block is expanded, or after the block's
// last, under its own parent and successor index, its edge where that
// parent's edges are.
func TestADeferredLookupKeepsItsParentAcrossStates(t *testing.T) {
	out := expandOne(t, twins{limit: 5}, 2, 3) // 3, 3, 4; then 4, 4, 5
	type cand struct {
		parent int32
		succ   uint16
	}
	want := []cand{{0, 0}, {0, 2}, {1, 2}} // states 3, 4 and 5
	if len(out.cands) != len(want) {
		t.Fatalf("candidates %+v, want %v", out.cands, want)
	}
	for i, w := range want {
		if got := (cand{out.cands[i].parent, out.cands[i].succ}); got != w {
			t.Fatalf("candidate %d comes from %+v, want %+v", i, got, w)
		}
	}
	wantEdges := []uint32{candRef, candRef, candRef | 1, candRef | 1, candRef | 1, candRef | 2}
	if !slices.Equal(out.edges, wantEdges) || !slices.Equal(out.edgeEnd, []int32{3, 6}) {
		t.Fatalf("edges %x ending at %v, want %x ending at [3 6]", out.edges, out.edgeEnd, wantEdges)
	}
}
