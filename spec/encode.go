package spec

import (
	"encoding/binary"
	"errors"
	"math/bits"
	"slices"
	"unsafe"
)

// The model checker holds the states still to explore (its frontier) encoded:
// a State is about 2 KB (every node of the largest deployment), but a reachable state differs from the initial state in
// a few dozen. The encoding is the state's bytes XORed with the initial state's,
// as runs: a uvarint count of equal bytes, a uvarint count of differing bytes,
// then those bytes XORed; the trailing equal run is implied. It is exact, byte
// for byte, so it needs no update when State gains a field; State must stay
// free of pointers, slices and maps (TestStateIsPlainData).

// ErrBadEncoding is returned by DecodeState for bytes AppendState did not write.
var ErrBadEncoding = errors.New("spec: malformed state encoding")

const stateSize = int(unsafe.Sizeof(State{}))

func stateBytes(s *State) []byte { return unsafe.Slice((*byte)(unsafe.Pointer(s)), stateSize) }

// copyState sets *dst to *src. The checker copies a State for every
// transition; for a struct over 1 KB the compiler emits REP MOVSQ, which
// measured 4x slower than the runtime's vectorized memmove (86 ns against 20
// on the 2 KB State, BenchmarkCopyState).
func copyState(dst, src *State) { copy(stateBytes(dst), stateBytes(src)) }

// encodingBase is the base of every encoding: an initial state (that of a zero
// configuration; any fixed state would be exact, a close one is compact).
var encodingBase = (&Model{}).Initial()[0]

// AppendState appends the compact, lossless encoding of s to dst.
func (m *Model) AppendState(dst []byte, s *State) []byte {
	cur, base := stateArray(s), stateArray(&encodingBase)
	for i := 0; ; {
		eq := firstDifference(cur, base, i)
		if eq == stateSize {
			return dst
		}
		// A differing run ends at two equal bytes in a row: one equal byte costs
		// less as a literal than as a new run.
		diff := eq + 1
		for diff < stateSize-1 && (cur[diff] != base[diff] || cur[diff+1] != base[diff+1]) {
			diff++
		}
		if diff == stateSize-1 && cur[diff] != base[diff] {
			diff++
		}
		dst = binary.AppendUvarint(dst, uint64(eq-i))
		dst = binary.AppendUvarint(dst, uint64(diff-eq))
		n := len(dst)
		dst = slices.Grow(dst, diff-eq)[:n+diff-eq]
		lit := dst[n:]
		for j := range lit {
			lit[j] = cur[eq+j] ^ base[eq+j]
		}
		i = diff
	}
}

// stateArray is s's bytes as an array, whose constant length lets the
// compiler prove the scans' indices in range.
func stateArray(s *State) *[stateSize]byte { return (*[stateSize]byte)(unsafe.Pointer(s)) }

// firstDifference returns the first index at or after i where a and b differ,
// or stateSize. Most of a state equals the base (empty queues, unused nodes),
// so it compares 32 bytes at a time: four words, one branch.
func firstDifference(a, b *[stateSize]byte, i int) int {
	le := binary.LittleEndian
	for ; i <= stateSize-32; i += 32 {
		x0 := le.Uint64(a[i:]) ^ le.Uint64(b[i:])
		x1 := le.Uint64(a[i+8:]) ^ le.Uint64(b[i+8:])
		x2 := le.Uint64(a[i+16:]) ^ le.Uint64(b[i+16:])
		x3 := le.Uint64(a[i+24:]) ^ le.Uint64(b[i+24:])
		if x0|x1|x2|x3 == 0 {
			continue
		}
		switch {
		case x0 != 0:
			return i + bits.TrailingZeros64(x0)/8
		case x1 != 0:
			return i + 8 + bits.TrailingZeros64(x1)/8
		case x2 != 0:
			return i + 16 + bits.TrailingZeros64(x2)/8
		}
		return i + 24 + bits.TrailingZeros64(x3)/8
	}
	for ; i <= stateSize-8; i += 8 {
		if x := le.Uint64(a[i:]) ^ le.Uint64(b[i:]); x != 0 {
			return i + bits.TrailingZeros64(x)/8
		}
	}
	for ; i < stateSize; i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return stateSize
}

// DecodeState sets *s to the state src encodes.
func (m *Model) DecodeState(src []byte, s *State) error {
	copyState(s, &encodingBase)
	out := stateBytes(s)
	i := 0
	for len(src) > 0 {
		eq, k := binary.Uvarint(src)
		if k <= 0 {
			return ErrBadEncoding
		}
		src = src[k:]
		n, k := binary.Uvarint(src)
		if k <= 0 {
			return ErrBadEncoding
		}
		src = src[k:]
		if eq > uint64(stateSize-i) || n > uint64(stateSize-i)-eq || n > uint64(len(src)) {
			return ErrBadEncoding
		}
		i += int(eq)
		for j := range int(n) {
			out[i+j] ^= src[j]
		}
		i += int(n)
		src = src[n:]
	}
	return nil
}
