package spec

import (
	"encoding/binary"
	"errors"
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

// encodingBase is the base of every encoding: an initial state (that of a zero
// configuration; any fixed state would be exact, a close one is compact).
var encodingBase = (&Model{}).Initial()[0]

// AppendState appends the compact, lossless encoding of s to dst.
func (m *Model) AppendState(dst []byte, s *State) []byte {
	var x [stateSize]byte // s XOR the base, computed a word at a time
	cur, base := stateBytes(s), stateBytes(&encodingBase)
	w := 0
	for ; w+8 <= stateSize; w += 8 {
		binary.LittleEndian.PutUint64(x[w:], binary.LittleEndian.Uint64(cur[w:])^binary.LittleEndian.Uint64(base[w:]))
	}
	for ; w < stateSize; w++ {
		x[w] = cur[w] ^ base[w]
	}
	i := 0
	for i < stateSize {
		eq := i
		for eq+8 <= stateSize && binary.LittleEndian.Uint64(x[eq:]) == 0 {
			eq += 8
		}
		for eq < stateSize && x[eq] == 0 {
			eq++
		}
		if eq == stateSize {
			break
		}
		// A differing run ends at two equal bytes in a row: one equal byte costs
		// less as a literal than as a new run.
		diff := eq + 1
		for diff < stateSize && (x[diff] != 0 || diff+1 < stateSize && x[diff+1] != 0) {
			diff++
		}
		dst = binary.AppendUvarint(dst, uint64(eq-i))
		dst = binary.AppendUvarint(dst, uint64(diff-eq))
		dst = append(dst, x[eq:diff]...)
		i = diff
	}
	return dst
}

// DecodeState sets *s to the state src encodes.
func (m *Model) DecodeState(src []byte, s *State) error {
	*s = encodingBase
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
