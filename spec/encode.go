package spec

import (
	"encoding/binary"
	"errors"
	"math/bits"
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
	cur, base := stateBytes(s), stateBytes(&encodingBase)
	for i := 0; ; {
		eq := firstDifference(cur, base, i)
		if eq == stateSize {
			return dst
		}
		// A differing run ends at two equal bytes in a row: one equal byte costs
		// less as a literal than as a new run.
		diff := eq + 1
		for diff < stateSize && (cur[diff] != base[diff] || diff+1 < stateSize && cur[diff+1] != base[diff+1]) {
			diff++
		}
		dst = binary.AppendUvarint(dst, uint64(eq-i))
		dst = binary.AppendUvarint(dst, uint64(diff-eq))
		for j := eq; j < diff; j++ {
			dst = append(dst, cur[j]^base[j])
		}
		i = diff
	}
}

// firstDifference returns the first index at or after i where a and b (of
// equal length) differ, or len(a). Most of a state equals the base (empty
// queues, unused nodes), so it compares 64 bytes at a time, then words.
func firstDifference(a, b []byte, i int) int {
	b = b[:len(a)]
	le := binary.LittleEndian
	for ; i+64 <= len(a); i += 64 {
		x, y := a[i:i+64], b[i:i+64]
		if (le.Uint64(x)^le.Uint64(y))|(le.Uint64(x[8:])^le.Uint64(y[8:]))|
			(le.Uint64(x[16:])^le.Uint64(y[16:]))|(le.Uint64(x[24:])^le.Uint64(y[24:]))|
			(le.Uint64(x[32:])^le.Uint64(y[32:]))|(le.Uint64(x[40:])^le.Uint64(y[40:]))|
			(le.Uint64(x[48:])^le.Uint64(y[48:]))|(le.Uint64(x[56:])^le.Uint64(y[56:])) != 0 {
			break
		}
	}
	for ; i+8 <= len(a); i += 8 {
		if x := binary.LittleEndian.Uint64(a[i:]) ^ binary.LittleEndian.Uint64(b[i:]); x != 0 {
			return i + bits.TrailingZeros64(x)/8
		}
	}
	for ; i < len(a); i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return len(a)
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
