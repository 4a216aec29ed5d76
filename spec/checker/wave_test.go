package checker

import (
	"encoding/binary"
	"slices"
	"testing"
)

// table is a model given by its successor lists: state s's successors are
// table[s], in order, each by the action of its index.
type table map[uint64][]uint64

func (table) Initial() []uint64 { return []uint64{0} }

func (t table) Successors(s *uint64, emit func(a int, next *uint64)) {
	for a, n := range t[*s] {
		emit(a, &n)
	}
}

func (table) AppendFingerprint(dst []byte, s *uint64) []byte { return binary.AppendUvarint(dst, *s) }
func (table) IsFault(int) bool                               { return false }
func (t table) Finished(s *uint64) bool                      { return len(t[*s]) == 0 }

// expandOne expands one block of states (numbered from 0) with a fresh run
// of m whose visited set holds known, numbered from 0.
func expandOne(t *testing.T, m Model[uint64, int], known []uint64, states ...uint64) *expansion[uint64] {
	t.Helper()
	done := Goal[uint64]{Name: "done", Reached: func(s *uint64) bool { return m.Finished(s) }}
	c, err := newRun(m, Properties[uint64]{Goals: []Goal[uint64]{done}}, Options{Workers: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i, s := range known {
		if idx, added := c.seen.insert(c.fingerprint(m.AppendFingerprint(nil, &s)), -1, uint16(i)); !added || int(idx) != i {
			t.Fatalf("state %d: numbered %d, added %v", s, idx, added)
		}
	}
	b := c.blocks.get(false)
	for i, s := range states {
		b.idx, b.states = append(b.idx, int32(len(known)+i)), append(b.states, s)
	}
	out := &expansion[uint64]{}
	newWorker(c).expand(b, out)
	if out.err != nil {
		t.Fatal(out.err)
	}
	return out
}

// candidateAt is where a candidate came from, and its state.
type candidateAt struct {
	parent int32
	succ   uint16
	state  uint64
}

func candidatesOf(out *expansion[uint64]) []candidateAt {
	var cs []candidateAt
	for i, cd := range out.cands {
		cs = append(cs, candidateAt{cd.parent, cd.succ, out.states[i]})
	}
	return cs
}

// A successor's lookup in the visited set waits until the next successor
// not among the block's candidates has been fingerprinted (the pending
// one). That next one must not overwrite the pending one's state, and one
// equal to the pending one must find it, not become a second candidate: the
// deferral must leave a block's candidates as a lookup on the spot did, and
// each protocol edge must name its target.
func TestADeferredLookupFindsTheSuccessorPendingBeforeIt(t *testing.T) {
	out := expandOne(t, table{10: {11, 12, 11, 12}}, nil, 10)
	if got, want := candidatesOf(out), []candidateAt{{0, 0, 11}, {0, 1, 12}}; !slices.Equal(got, want) {
		t.Fatalf("candidates %+v, want %+v", got, want)
	}
	if want := []uint32{candRef, candRef | 1, candRef, candRef | 1}; !slices.Equal(out.edges, want) {
		t.Fatalf("edges %x, want %x", out.edges, want)
	}
}

// A pending successor outlives the state it came from: it is decided
// while the next state of the block is expanded, or after the block's
// last, under its own parent and successor index, its edge where that
// parent's edges are; one already visited gets its number as its edge.
func TestADeferredLookupKeepsItsParentAcrossStates(t *testing.T) {
	// States 99 and 21 visited before (numbers 0 and 1); the block is 10
	// and 20 (numbers 2 and 3).
	out := expandOne(t, table{10: {11, 12, 11}, 20: {12, 21, 22}}, []uint64{99, 21}, 10, 20)
	if got, want := candidatesOf(out), []candidateAt{{2, 0, 11}, {2, 1, 12}, {3, 2, 22}}; !slices.Equal(got, want) {
		t.Fatalf("candidates %+v, want %+v", got, want)
	}
	wantEdges := []uint32{candRef, candRef | 1, candRef, candRef | 1, 1, candRef | 2}
	if !slices.Equal(out.edges, wantEdges) || !slices.Equal(out.edgeEnd, []int32{3, 6}) {
		t.Fatalf("edges %x ending at %v, want %x ending at [3 6]", out.edges, out.edgeEnd, wantEdges)
	}
}

// built is table as a Builder: it builds each successor in the state the
// checker hands out.
type built struct{ table }

func (b built) SuccessorsIn(s *uint64, next func() *uint64, emit func(a int, next *uint64)) {
	for a, n := range b.table[*s] {
		at := next()
		*at = n
		emit(a, at)
	}
}

// A Builder's successor pending its lookup stays in the buffer it was built
// in, and the worker hands out its two buffers in turn: a successor found
// among the block's candidates (the second 11) leaves the pending one (12)
// in its buffer, which the next successor (13) asks for, so the pending one
// must be decided first, or its candidate would carry 13's state. The
// candidates and edges are those of the same model copying its successors.
func TestABuiltSuccessorIsDecidedBeforeItsBufferIsReused(t *testing.T) {
	m := table{10: {11, 12, 11, 13}, 20: {12, 21, 22}}
	copied := expandOne(t, m, []uint64{99, 21}, 10, 20)
	out := expandOne(t, built{m}, []uint64{99, 21}, 10, 20)
	want := []candidateAt{{2, 0, 11}, {2, 1, 12}, {2, 3, 13}, {3, 2, 22}}
	for _, e := range []struct {
		name string
		out  *expansion[uint64]
	}{{"copied", copied}, {"built", out}} {
		if got := candidatesOf(e.out); !slices.Equal(got, want) {
			t.Fatalf("%s: candidates %+v, want %+v", e.name, got, want)
		}
	}
	if !slices.Equal(out.edges, copied.edges) || !slices.Equal(out.edgeEnd, copied.edgeEnd) {
		t.Fatalf("built: edges %x ending at %v, copied: %x ending at %v", out.edges, out.edgeEnd, copied.edges, copied.edgeEnd)
	}
}
