package checker

import (
	"encoding/binary"
	"math"
	"math/bits"
	"unsafe"
)

// Bitstate mode (SPIN's -DBITSTATE, Holzmann's supertrace): instead of a
// table of fingerprints, the visited set is an array of bits, and a state is
// marked visited by setting Hashes bits that a hash of its canonical encoding
// selects. Memory is fixed, whatever the number of states; the price is that a
// new state whose bits happen to be all set already is taken for a visited
// one and not explored (nor what only it leads to). Safety and deadlocks are
// checked; liveness, which needs the graph, is not.
//
// Without state numbers, a frontier state carries its path: the index of its
// initial state and, per step, which of its parent's successors it is, as
// uvarints (a byte a step for fewer than 128 successors). A violation's trace
// is replayed from that path, so it is the one a breadth-first search meets
// first: the exhaustive search's shortest trace, unless a collision hid a
// state on it.

// BitstateStats describes a bitstate exploration; Bits is 0 for an exhaustive one.
type BitstateStats struct {
	Bits    uint64 // size of the bit array
	Hashes  int    // bits set per state
	BitsSet uint64 // bits set at the end
	// ExpectedMissed is the expected number of new states taken for visited
	// ones: the sum, over the states stored, of the probability that a new
	// state finds all its bits set already, (bits set / bits)^Hashes at the
	// time, within the state's shard of the array. It does not count what
	// only a missed state leads to.
	ExpectedMissed float64
}

// Coverage is the estimated fraction of the reachable states explored:
// states / (states + ExpectedMissed); 1 for an exhaustive exploration.
func (s Stats) Coverage() float64 {
	if s.Bitstate.Bits == 0 || s.States == 0 {
		return 1
	}
	return float64(s.States) / (float64(s.States) + s.Bitstate.ExpectedMissed)
}

// bitArray is the bitstate visited set, in numShards regions: the shard of a
// state's fingerprint picks the region and all its bits lie there, so that
// the deduplication phase's tasks, one per shard, never share a word.
type bitArray struct {
	words      []uint64
	regionBits uint // log2 of the bits per region
	hashes     int
	set        [numShards]uint64  // bits set, per region
	missed     [numShards]float64 // ExpectedMissed, per region
}

// newBitArray returns an array of the largest power of two of bytes not over
// size (at least 8 bytes per region).
func newBitArray(size uint64, hashes int) *bitArray {
	words := uint64(numShards)
	for words*2*8 <= size {
		words *= 2
	}
	return &bitArray{words: make([]uint64, words), regionBits: uint(bits.Len64(words/numShards*64) - 1), hashes: hashes}
}

// probe is where fp's bits are: the i-th at base | (h+i*step)&mask, double
// hashing (Kirsch and Mitzenmacher) within fp's region.
func (b *bitArray) probe(fp Fingerprint) (base, mask, h, step uint64) {
	return uint64(shardOf(fp)) << b.regionBits, uint64(1)<<b.regionBits - 1, fp[1], fp[0]<<shardBits | 1
}

// has reports whether all of fp's bits are set.
func (b *bitArray) has(fp Fingerprint) bool {
	base, mask, h, step := b.probe(fp)
	for range b.hashes {
		p := base | h&mask
		if b.words[p>>6]&(1<<(p&63)) == 0 {
			return false
		}
		h += step
	}
	return true
}

// prefetch starts loading the word of fp's first bit.
func (b *bitArray) prefetch(fp Fingerprint) {
	base, mask, h, _ := b.probe(fp)
	p := base | h&mask
	prefetch(uintptr(unsafe.Pointer(&b.words[p>>6])))
}

// add sets fp's bits and reports whether any was clear (the state is new),
// counting the expected misses. Only the task of fp's shard may call it.
func (b *bitArray) add(fp Fingerprint) bool {
	s := shardOf(fp)
	base, mask, h, step := b.probe(fp)
	fresh := false
	for range b.hashes {
		p := base | h&mask
		w := &b.words[p>>6]
		if *w&(1<<(p&63)) == 0 {
			*w |= 1 << (p & 63)
			b.set[s]++
			fresh = true
		}
		h += step
	}
	if fresh {
		b.missed[s] += math.Pow(float64(b.set[s])/float64(uint64(1)<<b.regionBits), float64(b.hashes))
	}
	return fresh
}

func (b *bitArray) stats() BitstateStats {
	st := BitstateStats{Bits: uint64(len(b.words)) * 64, Hashes: b.hashes}
	for s := range numShards {
		st.BitsSet += b.set[s]
		st.ExpectedMissed += b.missed[s]
	}
	return st
}

// seededHash is a 128-bit hash of b under seed, the same in every process (maphash's
// seeds are random per process): a bitstate run's collisions, and so its
// result, replay from its seed, and runs with different seeds collide on
// different states. Two lanes of 64-bit multiply-fold mixing (as wyhash).
func seededHash(seed uint64, b []byte) Fingerprint {
	const k0, k1, k2, k3 = 0xa0761d6478bd642f, 0xe7037ed1a0b428db, 0x8ebc6af09c88c6e3, 0x589965cc75374cc3
	h0, h1 := seed^k0, seed^k1^uint64(len(b))*k2
	for ; len(b) >= 8; b = b[8:] {
		w := binary.LittleEndian.Uint64(b)
		h0 = mum(h0^w, k2)
		h1 = mum(h1^w, k3)
	}
	var w uint64
	for i, c := range b {
		w |= uint64(c) << (8 * i)
	}
	h0, h1 = mum(h0^w^k3, k1), mum(h1^w^k0, k2)
	return Fingerprint{mum(h0^uint64(len(b)), k0^h1), mum(h1, k3^h0)}
}

func mum(a, b uint64) uint64 {
	hi, lo := bits.Mul64(a, b)
	return hi ^ lo
}

// pathOf returns path i of a bitstate block: its paths end at idx[i].
func (b *block[S]) pathOf(i int) []byte {
	start := int32(0)
	if i > 0 {
		start = b.idx[i-1]
	}
	return b.paths[start:b.idx[i]]
}
