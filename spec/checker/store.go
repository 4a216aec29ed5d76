package checker

import (
	"math"
	"math/bits"
	"sync/atomic"
	"unsafe"

	"github.com/zeebo/xxh3"
)

// Fingerprint is the checker's name for a state: a 128-bit hash of its
// canonical encoding (AppendFingerprint). The checker takes two states with
// the same fingerprint to be the same state; a tool that remembers states by
// their fingerprints (the defense matrix's counterexample filter) takes
// that, and no more.
type Fingerprint [2]uint64

// FingerprintOf is the fingerprint of the state whose canonical encoding is
// encoding: XXH3's 128-bit hash, one pass over the bytes, where two 64-bit
// hashes took two (the checker hashes an encoding of about 150 bytes for
// every transition). Its values are the same in every run; state numbers,
// and so results, depend only on which fingerprints are equal.
func FingerprintOf(encoding []byte) Fingerprint {
	h := xxh3.Hash128(encoding)
	return Fingerprint{h.Lo, h.Hi}
}

// shardBits sets the number of shards of the visited set's index: 64, so that
// the workers inserting a wave's new states in parallel, one shard at a time,
// balance their loads.
const shardBits = 6

const numShards = 1 << shardBits

// visited is the set of visited states, numbered in discovery (BFS) order. Per
// state it keeps the fingerprint (16 bytes), the parent's number (4) and which
// of the parent's successors led here (2): a trace is rebuilt by replaying
// those choices from the initial state.
//
// The index is sharded by the fingerprint's top bits, so that workers insert
// into distinct shards at once. Each shard is an open-addressing table with
// linear probing, at most 3/4 full, of 4-byte slots; all shards have the same
// length and grow together. With numBits = log2(shards × slots per shard), a
// slot holds the state number + 1 in its low numBits bits (0 is an empty slot)
// and the top 32-numBits bits of the fingerprint above them, so that most
// probes that do not match are decided without reading the fingerprint array.
type visited struct {
	fps     chunked[Fingerprint]
	parents chunked[int32]  // -1 for an initial state
	succ    chunked[uint16] // index among the parent's successors; for an initial state, among Initial()
	shards  [numShards]shard
	mask    uint64 // slots per shard - 1
	numBits uint   // log2(numShards × slots per shard)
}

// shard is one part of the index.
type shard struct {
	table []uint32
	n     int // states in it
}

const maxSuccessors = 1<<16 - 1

func newVisited() *visited {
	v := &visited{}
	for i := range v.shards {
		v.shards[i].table = make([]uint32, 64)
	}
	v.setLen(64)
	return v
}

func (v *visited) setLen(slots int) {
	v.mask = uint64(slots - 1)
	v.numBits = uint(bits.Len64(v.mask)) + shardBits
}

func (v *visited) len() int { return v.fps.len() }

// shardOf is the shard that indexes fp: its top bits (the slot is its low bits).
func shardOf(fp Fingerprint) int { return int(fp[0] >> (64 - shardBits)) }

// tag is the part of fp stored in a slot beside the state number.
func (v *visited) tag(fp Fingerprint) uint32 {
	if v.numBits >= 32 {
		return 0
	}
	return uint32(fp[1] >> (64 - (32 - v.numBits)))
}

// lookup returns the number of the state with fingerprint fp, or -1. It only
// reads, so workers may call it concurrently while nobody inserts.
func (v *visited) lookup(fp Fingerprint) int32 {
	t := v.shards[shardOf(fp)].table
	tag, low := v.tag(fp), uint32(1)<<v.numBits-1
	for i := fp[0] & v.mask; ; i = (i + 1) & v.mask {
		e := t[i]
		if e == 0 {
			return -1
		}
		if e>>v.numBits == tag && *v.fps.ptr(int(e&low - 1)) == fp {
			return int32(e&low - 1)
		}
	}
}

// prefetch starts loading the slot where a lookup of fp begins.
func (v *visited) prefetch(fp Fingerprint) {
	t := v.shards[shardOf(fp)].table
	prefetch(uintptr(unsafe.Pointer(&t[fp[0]&v.mask])))
}

// place indexes state idx, which must be absent, under fp. Workers may place
// states of distinct shards at once.
func (v *visited) place(fp Fingerprint, idx int32) {
	s := &v.shards[shardOf(fp)]
	i := fp[0] & v.mask
	for s.table[i] != 0 {
		i = (i + 1) & v.mask
	}
	s.table[i] = uint32(idx) + 1 | v.tag(fp)<<v.numBits
	s.n++
}

// placeAhead is how many states ahead placeAll prefetches the slot where a
// state will probe: the loads of 8 places' slots are then in flight at once.
const placeAhead = 8

// placeAll places the wave's first occurrences firsts of one shard, each
// under its number num[f.g]. Placing one is a cache miss on its slot (the
// index is megabytes, and the slot is random): a state's slot is
// prefetched placeAhead states before it is placed, so that the misses
// overlap instead of coming one after the other (a loop that placed one
// state at a time spent about 100 ns a state, the memory's latency).
func (v *visited) placeAll(firsts []waveFirst, num []int32) {
	for k, f := range firsts {
		if k+placeAhead < len(firsts) {
			v.prefetch(firsts[k+placeAhead].fp)
		}
		v.place(f.fp, num[f.g])
	}
}

// reserve grows the arrays to hold n states, for workers to set at once.
func (v *visited) reserve(n int) {
	if n > math.MaxInt32 {
		panic("checker: more than 2^31 states")
	}
	v.fps.grow(n)
	v.parents.grow(n)
	v.succ.grow(n)
}

// set records state idx, reserved before.
func (v *visited) set(idx int32, fp Fingerprint, parent int32, succ uint16) {
	*v.fps.ptr(int(idx)) = fp
	*v.parents.ptr(int(idx)) = parent
	*v.succ.ptr(int(idx)) = succ
}

// insert returns the number of the state with fingerprint fp, adding it as a
// new state (reached from parent by successor succ) when absent; added reports
// which. It is the serial path, for initial states.
func (v *visited) insert(fp Fingerprint, parent int32, succ uint16) (idx int32, added bool) {
	if idx := v.lookup(fp); idx >= 0 {
		return idx, false
	}
	var more [numShards]int
	more[shardOf(fp)] = 1
	v.makeRoom(&more)
	idx = int32(v.len())
	v.reserve(v.len() + 1)
	v.set(idx, fp, parent, succ)
	v.place(fp, idx)
	return idx, true
}

// makeRoom grows every shard, together, until each holds its states and
// more[i] new ones at most 3/4 full, rebuilding the index on one goroutine:
// split by groups of shards over two (each group scanning every state, its
// tables' first writes faulting their pages in at once), the rebuild took
// 69–81 ms of wall time at the default bounds against 37–41 ms on one, and
// 134–153 ms of core time.
func (v *visited) makeRoom(more *[numShards]int) {
	slots := int(v.mask) + 1
	for i := range v.shards {
		for (v.shards[i].n+more[i])*4 > slots*3 {
			slots *= 2
		}
	}
	if slots == int(v.mask)+1 {
		return
	}
	v.setLen(slots)
	v.reindex()
}

// reindex rebuilds every shard at the current length from the fingerprints
// themselves, read in state order: a scan of the old tables read a
// fingerprint at a random place for each state (its number is all a slot
// holds), a cache miss each, and spent 3.7% of a run's CPU there
// (BenchmarkCheckDefaultBounds). A state's new slot is prefetched
// placeAhead states before it is written, as placeAll does.
func (v *visited) reindex() {
	for i := range v.shards {
		v.shards[i].table = make([]uint32, v.mask+1)
	}
	n := v.len()
	for c := 0; c*(1<<chunkBits) < n; c++ {
		chunk := v.fps.chunks[c][:min(1<<chunkBits, n-c*(1<<chunkBits))]
		for k := range chunk {
			if k+placeAhead < len(chunk) {
				v.prefetch(chunk[k+placeAhead])
			}
			fp := &chunk[k]
			t := v.shards[shardOf(*fp)].table
			j := fp[0] & v.mask
			for t[j] != 0 {
				j = (j + 1) & v.mask
			}
			t[j] = uint32(c<<chunkBits+k) + 1 | v.tag(*fp)<<v.numBits
		}
	}
}

// dropIndex frees the index once no more states will be added.
func (v *visited) dropIndex() {
	for i := range v.shards {
		v.shards[i].table = nil
	}
}

// appendPath appends the state numbers from an initial state to idx.
func (v *visited) appendPath(p []int32, idx int32) []int32 {
	base := len(p)
	for i := idx; i >= 0; i = v.parents.at(int(i)) {
		p = append(p, i)
	}
	for l, r := base, len(p)-1; l < r; l, r = l+1, r-1 {
		p[l], p[r] = p[r], p[l]
	}
	return p
}

// bitset is one bit per state.
type bitset []uint64

// grow makes room for n bits, so that goroutines may then set bits of the
// same words at once (set).
func (b *bitset) grow(n int) {
	if w := (n + 63) / 64; w > len(*b) {
		*b = append(*b, make([]uint64, w-len(*b))...)
	}
}

// set sets bit i, within the room grow made, while other goroutines may set
// other bits of its word.
func (b bitset) set(i int32) { atomic.OrUint64(&b[i>>6], 1<<(i&63)) }

func (b bitset) has(i int32) bool { return int(i)>>6 < len(b) && b[i>>6]&(1<<(i&63)) != 0 }
