package spec

import (
	"encoding/binary"
	"errors"
	"math/bits"
	"slices"
	"unsafe"
)

// The model checker holds the states still to explore (its frontier) encoded:
// a State is about 3.4 KB (every node of the largest deployment), but a
// reachable state differs from the initial state in a few dozen bytes. The
// encoding is the state XORed with a fixed base, word by word over the
// model's words (the 8-byte words of State that overlap its spans, below,
// numbered in address order): for each word that differs from the base, the
// bytes from its first differing one to its last, XORed; then a header byte
// per such word (how many equal bytes are below those, and their count less
// 1); then the bitmap of the differing words' numbers without its zero
// bytes; then the summary, a bit per bitmap byte, of which those are. It is
// exact, byte for byte, so it needs no update when State gains a field; State
// must stay free of pointers, slices and maps (TestStateIsPlainData).
//
// Words, not runs of bytes, because the per-run bookkeeping was the cost (a
// search for each run's start and one for its end): AppendState skips equal
// words 32 bytes at a time and spends a few operations on each differing one
// (its header from the XOR's trailing and leading zeros, its bytes one word
// store), and DecodeState reads the headers apart from the bytes, so that
// one word's loads need not wait for the one before. At the default bounds a
// frontier state has 23 differing words of the 132, 3.9 bytes each with
// its header, and 102 bytes in all, where the runs took 106 (docs/spec.md,
// Word-granular frontier encoding).
//
// Most of a State is out of a configuration's reach: nodes past its
// deployment, requests past its prompts, pages past its pools, queue slots
// past its bound. Those bytes keep the initial state's value in every
// reachable state, so the model's words are those of its spans, the bytes
// the configuration can change (about 1,000 of the 3,388 at the default
// bounds), and AppendState scans a queue's only up to its messages.
// TestEncodingRoundTripsReachableStates checks, on the reachable states of
// several configurations, that no step writes outside them.

// ErrBadEncoding is returned by DecodeState for bytes that are no encoding
// for its model: cut short or run on, a bitmap bit past its words, a header
// past its word. (It does not check that a word's bytes are nonzero at both
// ends, as AppendState writes them: such bytes still decode to one state,
// changed in the model's words only.)
var ErrBadEncoding = errors.New("spec: malformed state encoding")

const stateSize = int(unsafe.Sizeof(State{}))

func stateBytes(s *State) []byte { return unsafe.Slice((*byte)(unsafe.Pointer(s)), stateSize) }

// copyState sets *dst to *src. The checker copies a State for every
// transition; for a struct over 1 KB the compiler emits REP MOVSQ, which
// measured 4x slower than the runtime's vectorized memmove (86 ns against 20
// on the State of the time, 2 KB, BenchmarkCopyState).
func copyState(dst, src *State) { copy(stateBytes(dst), stateBytes(src)) }

// CopyState sets *dst to *src (the checker's StateCopier).
func (m *Model) CopyState(dst, src *State) { copyState(dst, src) }

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

// spanWords is the encoding's view of a model's spans, computed once at New:
// the 8-byte words of State that overlap them, numbered in address order
// (a word's number is its bit in the encoding's bitmap), as ranges of
// consecutive words that AppendState scans in one loop.
type spanWords struct {
	ranges  []wordRange
	offsets [512]uint16 // the State offset of each word, by number (512: a mask bounds the index)
	words   int         // how many there are
	mapLen  int         // the bitmap's length in bytes
	sumLen  int         // the summary's: a bit per bitmap byte
}

// wordRange is the words [from, to) of State (byte offsets, multiples of 8
// but for the State's end: its last word is short where its size is not a
// multiple of 8), the first of them numbered first. A queue's range is the
// words that hold its bytes alone; AppendState scans it only up to the N
// messages, the rest equalling the base.
type wordRange struct {
	from, to, first int
	queue           int // the offset of the queue's N; -1 for bytes always scanned
}

// wholeWords is the words of a model made without New.
var wholeWords = newSpanWords(wholeState)

// newSpanWords returns the words of sps. A word that holds bytes of an
// ordinary span, or of two spans, is always scanned; one that holds bytes of
// a single queue span only is scanned while the queue's messages reach it.
func newSpanWords(sps []span) *spanWords {
	const dead, always = -2, -1
	kind := make([]int, (stateSize+7)/8) // dead, always, or the offset of a queue's N
	for i := range kind {
		kind[i] = dead
	}
	for _, sp := range sps {
		k := always
		if sp.queue {
			k = sp.from
		}
		for wd := sp.from / 8; wd < (sp.to+7)/8; wd++ {
			if kind[wd] == dead {
				kind[wd] = k
			} else {
				kind[wd] = always
			}
		}
	}
	sw := &spanWords{}
	for wd := 0; wd < len(kind); wd++ {
		if kind[wd] == dead {
			continue
		}
		n := len(sw.ranges) - 1
		if n >= 0 && sw.ranges[n].to == 8*wd && sw.ranges[n].queue == kind[wd] {
			sw.ranges[n].to = min(8*wd+8, stateSize)
		} else {
			sw.ranges = append(sw.ranges, wordRange{from: 8 * wd, to: min(8*wd+8, stateSize), first: sw.words, queue: kind[wd]})
		}
		sw.offsets[sw.words] = uint16(8 * wd)
		sw.words++
	}
	sw.mapLen = (sw.words + 7) / 8
	sw.sumLen = (sw.mapLen + 7) / 8
	return sw
}

// words is the model's span words.
func (m *Model) words() *spanWords {
	if m.enc == nil {
		return wholeWords
	}
	return m.enc
}

// Constants of the SWAR byte tests: the low 7 bits and the top bit of every byte.
const lo7, hi = 0x7f7f7f7f7f7f7f7f, 0x8080808080808080

// nonzeroBytes returns a bit per byte of x, bit i set when byte i (the i-th
// in memory) is not zero.
func nonzeroBytes(x uint64) byte {
	// The top bit of each nonzero byte (exact: nothing carries between
	// bytes), then those 8 bits gathered into the top byte by one multiply
	// (each lands on its own bit, so no two products carry into each other).
	t := (x&lo7 + lo7 | x) & hi
	return byte((t >> 7) * 0x0102040810204080 >> 56)
}

// maxWordBytes is the most one differing word's bytes take, and what put
// writes for it: a word store.
const maxWordBytes = 8

// maxWords is how many words a State has: the most a model's spans can
// have.
const maxWords = (stateSize + 7) / 8

// The bitmap's bytes are at most 64, so the summary of which are not zero
// is one uint64; and the words fit spanWords.offsets.
var _ = [1]int{}[(maxWords+7)/8/65+maxWords/513]

// wordSet is the differing words AppendState has found: their bits, and
// their headers in order.
type wordSet struct {
	bits [(maxWords + 63) / 64]uint64
	hdr  [maxWords]byte
	n    int
}

// AppendState appends the compact, lossless encoding of s to dst.
func (m *Model) AppendState(dst []byte, s *State) []byte {
	sw := m.words()
	cur, base := stateArray(s), stateArray(&encodingBase)
	// Written in place: buf is dst up to its capacity, w its end. Room for
	// a block of 4 words is made before each; the headers and the bitmap
	// are kept in set until the end.
	w := len(dst)
	buf := slices.Grow(dst, 4*maxWordBytes)
	buf = buf[:cap(buf)]
	var set wordSet
	le := binary.LittleEndian
	for _, r := range sw.ranges {
		to := r.to
		if r.queue >= 0 {
			to = min(to, (r.queue+1+int(cur[r.queue])*msgSize+7)&^7)
		}
		at, k := r.from, r.first
		// 32 bytes at a time, one branch for the four words: most of the
		// spans equal the base (empty queues, free pages).
		for ; at+32 <= to; at, k = at+32, k+4 {
			c, b := bytesAt[[32]byte](cur, at), bytesAt[[32]byte](base, at)
			x0 := le.Uint64(c[0:]) ^ le.Uint64(b[0:])
			x1 := le.Uint64(c[8:]) ^ le.Uint64(b[8:])
			x2 := le.Uint64(c[16:]) ^ le.Uint64(b[16:])
			x3 := le.Uint64(c[24:]) ^ le.Uint64(b[24:])
			if x0|x1|x2|x3 == 0 {
				continue
			}
			if len(buf)-w < 4*maxWordBytes {
				buf = slices.Grow(buf[:w], 4*maxWordBytes)
				buf = buf[:cap(buf)]
			}
			w = set.put(buf, w, k, x0)
			w = set.put(buf, w, k+1, x1)
			w = set.put(buf, w, k+2, x2)
			w = set.put(buf, w, k+3, x3)
		}
		for ; at < to; at, k = at+8, k+1 {
			var x uint64
			if at <= stateSize-8 {
				x = le.Uint64(bytesAt[[8]byte](cur, at)[:]) ^ le.Uint64(bytesAt[[8]byte](base, at)[:])
			} else {
				// The State's short last word, its bytes as the low
				// ones of a word.
				x = (le.Uint64(cur[stateSize-8:]) ^ le.Uint64(base[stateSize-8:])) >> (8 * (at - (stateSize - 8)))
			}
			if x == 0 {
				continue
			}
			if len(buf)-w < maxWordBytes {
				buf = slices.Grow(buf[:w], 4*maxWordBytes)
				buf = buf[:cap(buf)]
			}
			w = set.put(buf, w, k, x)
		}
	}
	// The headers, the bitmap's nonzero bytes, then the summary: a bit per
	// bitmap byte, set for those written.
	if need := set.n + len(set.bits)*8 + 8; len(buf)-w < need {
		buf = slices.Grow(buf[:w], need)
		buf = buf[:cap(buf)]
	}
	w += copy(buf[w:], set.hdr[:set.n])
	var sum uint64
	for i, b := range set.bits {
		for nz := nonzeroBytes(b); nz != 0; nz &= nz - 1 {
			j := bits.TrailingZeros8(nz)
			buf[w] = byte(b >> (8 * j))
			w++
			sum |= 1 << (8*i + j)
		}
	}
	le.PutUint64(buf[w:], sum)
	return buf[:w+sw.sumLen]
}

// bytesAt is the bytes of s from at, as an array B, which must end within
// s: AppendState's ranges end within the State (newSpanWords), so its
// loads need no bounds check each.
func bytesAt[B [8]byte | [32]byte](s *[stateSize]byte, at int) *B {
	return (*B)(unsafe.Add(unsafe.Pointer(s), at))
}

// put writes word k's XOR x at buf[w:], if it is not zero: the bytes from
// its first nonzero one to its last (a word store: up to 7 bytes past them
// are overwritten). It sets k's bit and adds its header: how many zero bytes
// are below those written, and how many those are, less 1. It returns where
// they end.
func (set *wordSet) put(buf []byte, w, k int, x uint64) int {
	if x == 0 {
		return w
	}
	set.bits[k>>6] |= 1 << (k & 63)
	low := bits.TrailingZeros64(x) >> 3
	n := 8 - low - bits.LeadingZeros64(x)>>3
	set.hdr[set.n] = byte(low | (n-1)<<3)
	set.n++
	binary.LittleEndian.PutUint64(buf[w:], x>>(8*low&63))
	return w + n
}

// header is what a word's header byte says: which bytes of the word are
// written (keep: the n written, from its low end) and where they go (shift:
// past the low zero bytes). bad is 1 for a byte AppendState never writes as a
// header: 64 or more, or bytes past the word's end.
type header struct {
	keep, shift uint64
	low, n      uint8
	bad         uint8
}

// headers is every header byte's meaning.
var headers = func() (hs [256]header) {
	for h := range hs {
		low, n := h&7, h>>3+1
		if n > 8 || low+n > 8 {
			hs[h] = header{bad: 1}
			continue
		}
		hs[h] = header{keep: ^uint64(0) >> (64 - 8*n), shift: uint64(8 * low), low: uint8(low), n: uint8(n)}
	}
	return hs
}()

// DecodeState sets *s to the state src encodes. src may be any bytes (the
// frontier is spilled to disk and read back): it writes only the words its
// model numbers, reads only src, and returns ErrBadEncoding for bytes that are
// no encoding for the model.
func (m *Model) DecodeState(src []byte, s *State) error {
	sw := m.words()
	copyState(s, &encodingBase)
	out := stateArray(s)
	if len(src) < sw.sumLen {
		return ErrBadEncoding
	}
	var sum uint64
	for j, b := range src[len(src)-sw.sumLen:] {
		sum |= uint64(b) << (8 * j)
	}
	data := src[:len(src)-sw.sumLen]
	n := bits.OnesCount64(sum)
	if sum>>sw.mapLen != 0 || n > len(data) {
		return ErrBadEncoding
	}
	data, bm := data[:len(data)-n], data[len(data)-n:]
	// The bitmap whole first: one loop over its set bits after, instead
	// of one per byte (each loop's exit is a mispredicted branch).
	var set [(maxWords + 63) / 64]uint64
	words := 0
	for i := 0; sum != 0; sum, i = sum&(sum-1), i+1 {
		if bm[i] == 0 {
			return ErrBadEncoding // AppendState writes only nonzero bitmap bytes
		}
		j := bits.TrailingZeros64(sum)
		set[j>>3] |= uint64(bm[i]) << (8 * (j & 7))
		words += bits.OnesCount8(bm[i])
	}
	if set[sw.words/64]>>(sw.words%64) != 0 || words > len(data) {
		return ErrBadEncoding // a word past the model's, or too few headers
	}
	data, hdr := data[:len(data)-words], data[len(data)-words:]
	le := binary.LittleEndian
	// The headers are apart from the bytes, so that the loads of one word
	// do not wait for the one before (only the bytes' position does, an
	// add). A word's bytes are read at once where 8 are left in src (those
	// past data are the headers', masked off), and its checks collected in
	// bad, one branch at the end: none of them guards a write, which goes
	// to one of the model's words whatever the bytes say, nor a read, which
	// stays in src.
	r, bad := 0, uint64(0)
	hp := unsafe.Pointer(unsafe.SliceData(hdr))
	sp := unsafe.Pointer(unsafe.SliceData(src))
	op := unsafe.Pointer(out)
	for i, word := range set[:(sw.words+63)/64] {
		for ; word != 0; word &= word - 1 {
			off := int(sw.offsets[(64*i+bits.TrailingZeros64(word))&511])
			e := &headers[*(*byte)(hp)]
			hp = unsafe.Add(hp, 1)
			var v uint64
			if r <= len(src)-8 {
				v = le.Uint64((*[8]byte)(unsafe.Add(sp, r))[:])
			} else {
				for j, c := range src[min(r, len(src)):] {
					v |= uint64(c) << (8 * j)
				}
			}
			v &= e.keep
			r += int(e.n)
			bad |= uint64(e.bad)
			x := v << (e.shift & 63)
			if off > stateSize-8 {
				// The State's short last word: bytes past the State
				// are malformed.
				bad |= (uint64(stateSize-off) - uint64(e.low) - uint64(e.n)) >> 63
				x <<= (8 * (off - (stateSize - 8))) & 63
				off = stateSize - 8
			}
			o := (*[8]byte)(unsafe.Add(op, off))
			le.PutUint64(o[:], le.Uint64(o[:])^x)
		}
	}
	if bad != 0 || r != len(data) {
		return ErrBadEncoding
	}
	return nil
}

// stateArray is s's bytes as an array, whose constant length lets the
// compiler prove the scans' indices in range.
func stateArray(s *State) *[stateSize]byte { return (*[stateSize]byte)(unsafe.Pointer(s)) }
