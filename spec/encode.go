package spec

import (
	"encoding/binary"
	"errors"
	"math/bits"
	"slices"
	"unsafe"
)

// The model checker holds the states still to explore (its frontier) encoded:
// a State is about 3.4 KB (every node of the largest deployment), but a reachable state differs from the initial state in
// a few dozen. The encoding is the state's bytes XORed with the initial state's,
// as runs: a uvarint count of equal bytes, a uvarint count of differing bytes,
// then those bytes XORed; the trailing equal run is implied. It is exact, byte
// for byte, so it needs no update when State gains a field; State must stay
// free of pointers, slices and maps (TestStateIsPlainData).
//
// Most of a State is out of a configuration's reach: nodes past its
// deployment, requests past its prompts, pages past its pools, queue slots
// past its bound. Those bytes keep the initial state's value in every
// reachable state, so AppendState looks only at the model's spans, the bytes
// the configuration can change (about 1,000 of the 3,384 at the default
// bounds), and writes what a scan of the whole State would write.
// TestEncodingRoundTripsReachableStates checks, on the reachable states of
// several configurations, that no step writes outside them.

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

// span is the bytes [from, to) of a State. A queue's span starts at the
// queue (its N) and its bytes past the N messages equal the base: a queue
// keeps the slots past its messages empty (Queue.Push, Pop and Clear), so
// AppendState scans a queue's messages only.
type span struct {
	from, to int
	queue    bool
}

// msgSize is the size of a queue slot.
const msgSize = int(unsafe.Sizeof(Msg{}))

// end is where the bytes of sp that may differ from the base end in s.
func (sp span) end(s *[stateSize]byte) int {
	if !sp.queue {
		return sp.to
	}
	return min(sp.to, sp.from+1+int(s[sp.from])*msgSize)
}

// wholeState is the span of a model made without New: every byte.
var wholeState = []span{{from: 0, to: stateSize}}

// spanGap is the shortest stretch of unreachable bytes kept between two
// spans; shorter ones are scanned with their neighbours, which costs less
// than a span's bookkeeping.
const spanGap = 32

// liveSpans returns the bytes of State that cfg's steps can change, in order:
// every byte but those of the nodes, requests, pages, slots and queue slots
// beyond cfg, with each queue of the deployment a span of its own. A field
// State gains is in a span until it is listed here.
func liveSpans(cfg *Config) []span {
	var s State
	at := func(p unsafe.Pointer) int { return int(uintptr(p) - uintptr(unsafe.Pointer(&s))) }
	// What each byte is: 0 out of reach, 1 in reach, 2 in a queue of the
	// deployment, up to its bound.
	const deadByte, liveByte, queueByte = 0, 1, 2
	kind := make([]byte, stateSize)
	for i := range kind {
		kind[i] = liveByte
	}
	mark := func(k byte, from unsafe.Pointer, size uintptr) {
		for i := range int(size) {
			kind[at(from)+i] = k
		}
	}
	var queues []int
	np, nd := cfg.NumPrefills(), cfg.NumDecodes()
	nreq := len(cfg.Prompts)
	queue := func(q *Queue, live bool) {
		mark(deadByte, unsafe.Pointer(q), unsafe.Sizeof(*q))
		if live {
			queues = append(queues, at(unsafe.Pointer(q)))
			mark(queueByte, unsafe.Pointer(q), uintptr(1+min(cfg.QueueBound(), QueueCapacity)*msgSize))
		}
	}
	if nreq < MaxRequests {
		mark(deadByte, unsafe.Pointer(&s.Req[nreq]), uintptr(MaxRequests-nreq)*unsafe.Sizeof(s.Req[0]))
	}
	for d := range MaxDecodes {
		if d >= nd {
			mark(deadByte, unsafe.Pointer(&s.Pages[d]), unsafe.Sizeof(s.Pages[d]))
			mark(deadByte, unsafe.Pointer(&s.Slots[d]), unsafe.Sizeof(s.Slots[d]))
			continue
		}
		if n := cfg.DecodePages; n < MaxDecodePages {
			mark(deadByte, unsafe.Pointer(&s.Pages[d][n]), uintptr(MaxDecodePages-n)*unsafe.Sizeof(s.Pages[d][0]))
		}
		if n := cfg.DecodeSlots; n < MaxSlots {
			mark(deadByte, unsafe.Pointer(&s.Slots[d][n]), uintptr(MaxSlots-n)*unsafe.Sizeof(s.Slots[d][0]))
		}
	}
	for p := range MaxPrefills {
		switch n := cfg.PrefillPages; {
		case p >= np:
			mark(deadByte, unsafe.Pointer(&s.Src[p]), unsafe.Sizeof(s.Src[p]))
		case n < MaxPrefillPages:
			mark(deadByte, unsafe.Pointer(&s.Src[p][n]), uintptr(MaxPrefillPages-n)*unsafe.Sizeof(s.Src[p][0]))
		}
		queue(&s.ToPrefill[p], p < np)
		for d := range MaxDecodes {
			queue(&s.QP[p][d], p < np && d < nd)
			queue(&s.QPBack[p][d], p < np && d < nd)
		}
	}
	for d := range MaxDecodes {
		queue(&s.ToDecode[d], d < nd)
	}
	// The queues' spans, then the other live bytes', two of those merged
	// when only a few unreachable bytes lie between them.
	var out []span
	for _, q := range queues {
		out = append(out, span{from: q, to: q + 1 + min(cfg.QueueBound(), QueueCapacity)*msgSize, queue: true})
	}
	for i := 0; i < stateSize; {
		if kind[i] != liveByte {
			i++
			continue
		}
		j := i
		for j < stateSize && kind[j] == liveByte {
			j++
		}
		if n := len(out) - 1; n >= len(queues) && i-out[n].to < spanGap && !slices.Contains(kind[out[n].to:i], queueByte) {
			out[n].to = j
		} else {
			out = append(out, span{from: i, to: j})
		}
		i = j
	}
	slices.SortFunc(out, func(a, b span) int { return a.from - b.from })
	return out
}

// spans is the model's spans (every byte for a model made without New).
func (m *Model) spans() []span {
	if m.live == nil {
		return wholeState
	}
	return m.live
}

// AppendState appends the compact, lossless encoding of s to dst.
func (m *Model) AppendState(dst []byte, s *State) []byte {
	cur, base := stateArray(s), stateArray(&encodingBase)
	// Written in place (buf is dst up to its capacity, w its end), with a
	// word of slack past each run for putXOR.
	w, buf := len(dst), dst[:cap(dst)]
	i := 0 // the end of the last run written
	for _, sp := range m.spans() {
		end := sp.end(cur)
		for at := max(i, sp.from); at < end; {
			eq := firstDifference(cur, base, at, end)
			if eq == end {
				break
			}
			diff := runEnd(cur, base, eq)
			// Two counts below 2^14 take 4 bytes at most.
			if need := 4 + diff - eq + 8; len(buf)-w < need {
				buf = slices.Grow(buf[:w], need)
				buf = buf[:cap(buf)]
			}
			w = putCount(buf, w, eq-i)
			w = putCount(buf, w, diff-eq)
			w = putXOR(buf, w, cur, base, eq, diff)
			i, at = diff, diff
		}
	}
	return buf[:w]
}

// stateArray is s's bytes as an array, whose constant length lets the
// compiler prove the scans' indices in range.
func stateArray(s *State) *[stateSize]byte { return (*[stateSize]byte)(unsafe.Pointer(s)) }

// firstDifference returns the first index in [i, end) where a and b differ,
// or end. Most of a span equals the base (empty queues, free pages), so it
// compares 32 bytes at a time, four words and one branch, past end to the
// next multiple of 32 (what it finds there it reports as end).
func firstDifference(a, b *[stateSize]byte, i, end int) int {
	le := binary.LittleEndian
	for ; i < end && i <= stateSize-32; i += 32 {
		x0 := le.Uint64(a[i:]) ^ le.Uint64(b[i:])
		x1 := le.Uint64(a[i+8:]) ^ le.Uint64(b[i+8:])
		x2 := le.Uint64(a[i+16:]) ^ le.Uint64(b[i+16:])
		x3 := le.Uint64(a[i+24:]) ^ le.Uint64(b[i+24:])
		if x0|x1|x2|x3 == 0 {
			continue
		}
		switch {
		case x0 != 0:
			return min(end, i+bits.TrailingZeros64(x0)/8)
		case x1 != 0:
			return min(end, i+8+bits.TrailingZeros64(x1)/8)
		case x2 != 0:
			return min(end, i+16+bits.TrailingZeros64(x2)/8)
		}
		return min(end, i+24+bits.TrailingZeros64(x3)/8)
	}
	for ; i < end && i <= stateSize-8; i += 8 {
		if x := le.Uint64(a[i:]) ^ le.Uint64(b[i:]); x != 0 {
			return min(end, i+bits.TrailingZeros64(x)/8)
		}
	}
	for ; i < end && i < stateSize; i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return end
}

// runEnd returns the end of the differing run that starts at eq: the first
// index after eq that starts two equal bytes in a row (one equal byte costs
// less as a literal than as a new run), or where the state ends. It looks at
// 8 bytes at a time, stepping 7 so that each pair is inside one word.
func runEnd(a, b *[stateSize]byte, eq int) int {
	const lo7, hi = 0x7f7f7f7f7f7f7f7f, 0x8080808080808080
	le := binary.LittleEndian
	i := eq + 1
	for ; i <= stateSize-8; i += 7 {
		x := le.Uint64(a[i:]) ^ le.Uint64(b[i:])
		// The top bit of each zero byte of x (exact: nothing carries
		// between bytes), then of each that the next byte also is.
		z := ^((x&lo7 + lo7) | x) & hi
		if pair := z & (z >> 8); pair != 0 {
			return i + bits.TrailingZeros64(pair)/8
		}
	}
	for ; i < stateSize-1; i++ {
		if a[i] == b[i] && a[i+1] == b[i+1] {
			return i
		}
	}
	if i == stateSize-1 && a[i] == b[i] {
		return i
	}
	return stateSize
}

// putCount writes n as a uvarint at dst[w:] and returns where it ends. Most
// counts are under 128: one byte, without PutUvarint's loop.
func putCount(dst []byte, w, n int) int {
	if n < 0x80 {
		dst[w] = byte(n)
		return w + 1
	}
	return w + binary.PutUvarint(dst[w:], uint64(n))
}

// putXOR writes a[from:to] XOR b[from:to] at dst[w:], a word at a time
// (up to 7 bytes past them are overwritten), and returns where they end.
func putXOR(dst []byte, w int, a, b *[stateSize]byte, from, to int) int {
	if to > stateSize-8 {
		for j := from; j < to; j++ {
			dst[w] = a[j] ^ b[j]
			w++
		}
		return w
	}
	le := binary.LittleEndian
	for j := from; j < to; j += 8 {
		le.PutUint64(dst[w+j-from:], le.Uint64(a[j:])^le.Uint64(b[j:]))
	}
	return w + to - from
}

// DecodeState sets *s to the state src encodes.
func (m *Model) DecodeState(src []byte, s *State) error {
	copyState(s, &encodingBase)
	out := stateArray(s)
	le := binary.LittleEndian
	i := 0
	for len(src) > 0 {
		eq, rest, ok := count(src)
		if !ok {
			return ErrBadEncoding
		}
		n, rest, ok := count(rest)
		if !ok || eq > uint64(stateSize-i) || n > uint64(stateSize-i)-eq || n > uint64(len(rest)) {
			return ErrBadEncoding
		}
		i += int(eq)
		lit := rest[:n]
		src = rest[n:]
		// A word at a time, the last one masked where the state and the
		// literal's array have a word from there.
		for len(lit) >= 8 {
			le.PutUint64(out[i:], le.Uint64(out[i:])^le.Uint64(lit))
			i, lit = i+8, lit[8:]
		}
		if len(lit) > 0 && i <= stateSize-8 && cap(lit) >= 8 {
			mask := uint64(1)<<(8*len(lit)) - 1
			le.PutUint64(out[i:], le.Uint64(out[i:])^le.Uint64(lit[:8])&mask)
			i += len(lit)
			continue
		}
		for _, c := range lit {
			out[i] ^= c
			i++
		}
	}
	return nil
}

// count reads a uvarint count off src; ok is false when there is none.
func count(src []byte) (n uint64, rest []byte, ok bool) {
	if len(src) > 0 && src[0] < 0x80 {
		return uint64(src[0]), src[1:], true
	}
	n, k := binary.Uvarint(src)
	if k <= 0 {
		return 0, src, false
	}
	return n, src[k:], true
}
