package checker

import (
	"hash/maphash"
	"math"
	"math/bits"
)

// fingerprint is a 128-bit hash of a state's canonical encoding.
type fingerprint [2]uint64

// Fixed seeds make fingerprints stable within a run. State indices, and so
// results, depend only on which fingerprints are equal, never on their values.
var seedA, seedB = maphash.MakeSeed(), maphash.MakeSeed()

func fingerprintOf(b []byte) fingerprint {
	return fingerprint{maphash.Bytes(seedA, b), maphash.Bytes(seedB, b)}
}

// visited is the set of visited states, numbered in discovery (BFS) order. Per
// state it keeps the fingerprint (16 bytes), the parent's number (4) and which
// of the parent's successors led here (2): a trace is rebuilt by replaying
// those choices from the initial state. The index is an open-addressing table
// with linear probing, at most 3/4 full, of 4-byte slots: a table of 2^k slots
// holds the state number + 1 in the low k bits (0 is an empty slot) and the top
// 32-k bits of the fingerprint above them, so that most probes that do not
// match are decided without reading the fingerprint array.
type visited struct {
	fps     chunked[fingerprint]
	parents chunked[int32]  // -1 for an initial state
	succ    chunked[uint16] // index among the parent's successors; for an initial state, among Initial()
	table   []uint32
	mask    uint64 // len(table) - 1
	idxBits uint   // log2(len(table))
}

const maxSuccessors = 1<<16 - 1

func newVisited() *visited {
	v := &visited{}
	v.setTable(make([]uint32, 1024))
	return v
}

func (v *visited) setTable(t []uint32) {
	v.table, v.mask = t, uint64(len(t)-1)
	v.idxBits = uint(bits.Len64(v.mask))
}

func (v *visited) len() int { return v.fps.len() }

// tag is the part of fp stored in a slot beside the state number.
func (v *visited) tag(fp fingerprint) uint32 {
	if v.idxBits >= 32 {
		return 0
	}
	return uint32(fp[1] >> (64 - (32 - v.idxBits)))
}

// lookup returns the number of the state with fingerprint fp, or -1. It only
// reads, so workers may call it concurrently while nobody inserts.
func (v *visited) lookup(fp fingerprint) int32 {
	tag, low := v.tag(fp), uint32(1)<<v.idxBits-1
	for i := fp[0] & v.mask; ; i = (i + 1) & v.mask {
		e := v.table[i]
		if e == 0 {
			return -1
		}
		if e>>v.idxBits == tag && *v.fps.ptr(int(e&low - 1)) == fp {
			return int32(e&low - 1)
		}
	}
}

// insert returns the number of the state with fingerprint fp, adding it as a
// new state (reached from parent by successor succ) when absent; added reports which.
func (v *visited) insert(fp fingerprint, parent int32, succ uint16) (idx int32, added bool) {
	tag, low := v.tag(fp), uint32(1)<<v.idxBits-1
	i := fp[0] & v.mask
	for ; ; i = (i + 1) & v.mask {
		e := v.table[i]
		if e == 0 {
			break
		}
		if e>>v.idxBits == tag && *v.fps.ptr(int(e&low - 1)) == fp {
			return int32(e&low - 1), false
		}
	}
	if v.fps.len() >= math.MaxInt32 {
		panic("checker: more than 2^31 states")
	}
	idx = int32(v.fps.len())
	v.fps.append(fp)
	v.parents.append(parent)
	v.succ.append(succ)
	v.table[i] = uint32(idx) + 1 | tag<<v.idxBits
	if uint64(v.fps.len())*4 > uint64(len(v.table))*3 {
		v.grow()
	}
	return idx, true
}

func (v *visited) grow() {
	old, low := v.table, uint32(1)<<v.idxBits-1
	v.setTable(make([]uint32, 2*len(old)))
	for _, e := range old {
		if e == 0 {
			continue
		}
		n := e & low
		fp := v.fps.ptr(int(n - 1))
		i := fp[0] & v.mask
		for v.table[i] != 0 {
			i = (i + 1) & v.mask
		}
		v.table[i] = n | v.tag(*fp)<<v.idxBits
	}
}

// dropIndex frees the table once no more states will be added.
func (v *visited) dropIndex() { v.table, v.mask, v.idxBits = nil, 0, 0 }

// path returns the state numbers from an initial state to idx.
func (v *visited) path(idx int32) []int32 {
	var p []int32
	for i := idx; i >= 0; i = v.parents.at(int(i)) {
		p = append(p, i)
	}
	for l, r := 0, len(p)-1; l < r; l, r = l+1, r-1 {
		p[l], p[r] = p[r], p[l]
	}
	return p
}

// bitset is one bit per state.
type bitset []uint64

func (b *bitset) set(i int32) {
	for int(i)>>6 >= len(*b) {
		*b = append(*b, 0)
	}
	(*b)[i>>6] |= 1 << (i & 63)
}

func (b bitset) has(i int32) bool { return int(i)>>6 < len(b) && b[i>>6]&(1<<(i&63)) != 0 }
