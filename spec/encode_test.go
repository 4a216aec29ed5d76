package spec

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"
	"unsafe"
)

// plain reports whether t holds only numbers, booleans, arrays and structs of
// them: values whose bytes are the whole value, as the state encoding needs.
func plain(t reflect.Type) bool {
	switch t.Kind() {
	case reflect.Bool, reflect.Int8, reflect.Uint8, reflect.Int16, reflect.Uint16, reflect.Int32,
		reflect.Uint32, reflect.Int64, reflect.Uint64, reflect.Int, reflect.Uint:
		return true
	case reflect.Array:
		return plain(t.Elem())
	case reflect.Struct:
		for i := 0; i < t.NumField(); i++ {
			if !plain(t.Field(i).Type) {
				return false
			}
		}
		return true
	}
	return false
}

func TestStateIsPlainData(t *testing.T) {
	if !plain(reflect.TypeOf(State{})) {
		t.Fatal("State holds a pointer, slice, map, string or float: AppendState's byte encoding would be wrong")
	}
}

// reachable returns up to limit states reachable in cfg, breadth-first.
func reachable(tb testing.TB, cfg Config, limit int) (*Model, []State) {
	tb.Helper()
	m, err := New(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	return m, reachableBy(m, limit, func(s *State) string { return string(stateBytes(s)) })
}

// withEveryFault is c with a budget of one for every fault, and the corrupt
// fault free to damage tag records and SENDs too.
func withEveryFault(c Config) Config {
	for f := range NumFaults {
		c.Faults[f] = 1
	}
	c.Damage = DamageTag | DamageSend
	return c
}

// outsideSpans returns the first byte of s outside m's spans (a queue's
// past its messages) that differs from the encoding's base, or -1:
// AppendState would lose it.
func outsideSpans(m *Model, s *State) int {
	cur, base := stateArray(s), stateArray(&encodingBase)
	from := 0
	for _, sp := range append(m.spans(), span{from: stateSize, to: stateSize}) {
		for i := from; i < sp.from; i++ {
			if cur[i] != base[i] {
				return i
			}
		}
		for i := sp.end(cur); i < sp.to; i++ {
			if cur[i] != base[i] {
				return i
			}
		}
		from = sp.to
	}
	return -1
}

// walks returns the states of random walks of up to depth steps from the
// initial state: deeper than a breadth-first prefix reaches (full queues, the
// last pages and slots of the pools).
func walks(m *Model, n, depth int) []State {
	rng := rand.New(rand.NewPCG(3, 4))
	var out, next []State
	for range n {
		s := m.Initial()[0]
		for range depth {
			next = next[:0]
			m.Successors(&s, func(_ Action, n *State) { next = append(next, *n) })
			if len(next) == 0 {
				break
			}
			s = next[rng.IntN(len(next))]
			out = append(out, s)
		}
	}
	return out
}

// Every reachable state round-trips, and none differs from the base outside
// its model's spans: a step that writes where liveSpans says the
// configuration cannot fails here rather than losing state in the checker.
// The configurations reach every node, queue and pool array of State; each
// is looked at breadth-first and along random walks.
func TestEncodingRoundTripsReachableStates(t *testing.T) {
	all := withEveryFault
	twoPage := NewConfig(3, 6, 2)
	twoPage.Prompts, twoPage.PrefillPages = []int{4, 4, 9}, 4
	twoByTwo := all(NewConfig(4, 8, 2))
	twoByTwo.Prefills, twoByTwo.Decodes, twoByTwo.DecodeSlots = 2, 2, MaxSlots
	twoByTwo.DecodeRestarts = true
	shortQueues := all(NewConfig(3, 4, 2))
	shortQueues.MaxQueue = 2
	longQueues := NewConfig(3, 4, 2)
	longQueues.MaxQueue = QueueCapacity
	cache := NewConfig(3, 4, 2)
	cache.PrefixCache, cache.Scopes = 2, []int{1, 1, 2}
	oneByTwo := all(NewConfig(2, 4, 2))
	oneByTwo.Decodes = 2
	twoByOne := all(NewConfig(2, 4, 2))
	twoByOne.Prefills = 2
	for _, cfg := range []Config{NewConfig(3, 4, 2), twoPage, twoByTwo, shortQueues, longQueues, cache, oneByTwo, twoByOne} {
		m, states := reachable(t, cfg, 5000)
		states = append(states, walks(m, 300, 60)...)
		total := 0
		var buf []byte
		for i := range states {
			if at := outsideSpans(m, &states[i]); at >= 0 {
				t.Fatalf("%v: state %d differs from the base at byte %d, outside the spans %v: a step writes where liveSpans says the configuration cannot\n%+v", cfg.Prompts, i, at, m.spans(), states[i])
			}
			buf = m.AppendState(buf[:0], &states[i])
			total += len(buf)
			var got State
			if err := m.DecodeState(buf, &got); err != nil {
				t.Fatalf("state %d: %v", i, err)
			}
			if got != states[i] {
				t.Fatalf("state %d does not round-trip:\n%+v\n%+v", i, states[i], got)
			}
		}
		live := 0
		for _, sp := range m.spans() {
			live += sp.to - sp.from
		}
		t.Logf("%v: %d states, %d bytes per encoding on average (a State is %d, %d of them in %d spans)", cfg.Prompts, len(states), total/len(states), stateSize, live, len(m.spans()))
		if avg := total / len(states); avg > stateSize/4 {
			t.Errorf("%d bytes per encoded state on average, want well under the %d of a State", avg, stateSize)
		}
	}
}

// outsideSpans finds a byte changed in each stretch between spans, and none
// inside them, so the round-trip test would catch a step that wrote there.
func TestOutsideSpansFindsBytesBeyondTheConfiguration(t *testing.T) {
	m, err := New(NewConfig(3, 4, 2))
	if err != nil {
		t.Fatal(err)
	}
	sps := m.spans()
	if len(sps) < 2 {
		t.Fatalf("spans %v: the default bounds leave nothing out", sps)
	}
	if sps[0].from != 0 || sps[len(sps)-1].to != stateSize {
		t.Errorf("spans %v: want the first request's and the ghost's bytes in", sps)
	}
	queues := 0
	for k := range sps {
		s := encodingBase
		b := stateBytes(&s)
		if sps[k].queue {
			// A full queue's last slot is in; past one message, the
			// second slot is out.
			queues++
			b[sps[k].from] = MaxQueue
			b[sps[k].to-1] ^= 1
			if at := outsideSpans(m, &s); at >= 0 {
				t.Errorf("a full queue's last byte, in span %v, reported outside at %d", sps[k], at)
			}
			b[sps[k].from] = 1
			if at, want := outsideSpans(m, &s), sps[k].to-1; at != want {
				t.Errorf("a queue of one message, span %v: outsideSpans says %d, want %d", sps[k], at, want)
			}
			b[sps[k].to-1] ^= 1
			b[sps[k].from+1+msgSize] ^= 1
			if at, want := outsideSpans(m, &s), sps[k].from+1+msgSize; at != want {
				t.Errorf("a queue of one message, span %v: outsideSpans says %d, want %d", sps[k], at, want)
			}
		} else {
			b[sps[k].from] ^= 1
			b[sps[k].to-1] ^= 1
			if at := outsideSpans(m, &s); at >= 0 {
				t.Errorf("a byte in span %v reported outside at %d", sps[k], at)
			}
		}
		if k == len(sps)-1 {
			continue
		}
		for _, at := range []int{sps[k].to, sps[k+1].from - 1} {
			s := encodingBase
			stateBytes(&s)[at] ^= 1
			if got := outsideSpans(m, &s); got != at {
				t.Errorf("byte %d, between spans %v and %v: outsideSpans says %d", at, sps[k], sps[k+1], got)
			}
		}
	}
	if queues != 4 {
		t.Errorf("%d queue spans, want the one pair's 4", queues)
	}
	// The fourth request, the second decode node's pages and the third
	// queue slot past the bound are out of the default bounds' reach.
	var s State
	for _, p := range []unsafe.Pointer{unsafe.Pointer(&s.Req[3].R.Slot), unsafe.Pointer(&s.Pages[1][0].Epoch), unsafe.Pointer(&s.QP[0][0].Buf[MaxQueue+2].Tokens)} {
		at := int(uintptr(p) - uintptr(unsafe.Pointer(&s)))
		for _, sp := range sps {
			if at >= sp.from && at < sp.to {
				t.Errorf("byte %d is in span %v", at, sp)
			}
		}
	}
}

// appendStateByBytes is the encoding as its definition reads, a byte at a
// time: the model's words are the 8-byte words of State (the last one short
// where the State is) that overlap its spans; for each that differs from the
// base, in order, the bytes from its first differing one to its last, XORed,
// and a header (the equal bytes below them, and their count less 1 above
// that); then the headers, the bitmap of those words' numbers without its
// zero bytes, and the summary of which bitmap bytes those are. AppendState,
// which skips equal words 4 at a time and a queue's slots past its messages,
// must write exactly this for any state that equals the base outside them.
func appendStateByBytes(m *Model, dst []byte, s *State) []byte {
	cur, base := stateBytes(s), stateBytes(&encodingBase)
	var words []int
	for wd := 0; 8*wd < stateSize; wd++ {
		for _, sp := range m.spans() {
			if sp.from < 8*wd+8 && 8*wd < sp.to {
				words = append(words, wd)
				break
			}
		}
	}
	bitmap := make([]byte, (len(words)+7)/8)
	var hdrs []byte
	for k, wd := range words {
		from, to := 8*wd, min(8*wd+8, stateSize)
		first, last := -1, -1
		for i := from; i < to; i++ {
			if cur[i] != base[i] {
				last = i
				if first < 0 {
					first = i
				}
			}
		}
		if first < 0 {
			continue
		}
		bitmap[k/8] |= 1 << (k % 8)
		hdrs = append(hdrs, byte(first-from+(last-first)<<3))
		for i := first; i <= last; i++ {
			dst = append(dst, cur[i]^base[i])
		}
	}
	dst = append(dst, hdrs...)
	summary := make([]byte, (len(bitmap)+7)/8)
	for j, b := range bitmap {
		if b != 0 {
			dst = append(dst, b)
			summary[j/8] |= 1 << (j % 8)
		}
	}
	return append(dst, summary...)
}

// AppendState writes the byte-at-a-time definition's bytes,
// for reachable states and for states with differing bytes placed anywhere
// in the model's spans (runs ending at a span's last byte and at the State's,
// single equal bytes inside a run, runs crossing every word boundary), and
// they decode back. The models are the default bounds' and one whose spans
// are the whole State (a model made without New).
func TestAppendStateWritesTheDefinitionsBytes(t *testing.T) {
	def, states := reachable(t, NewConfig(3, 4, 2), 3000)
	rng := rand.New(rand.NewPCG(1, 2))
	for _, m := range []*Model{def, {}} {
		sps := m.spans()
		for range 3000 {
			s := encodingBase
			b := stateBytes(&s)
			for range 1 + rng.IntN(40) {
				sp := sps[rng.IntN(len(sps))]
				at := sp.from + rng.IntN(sp.to-sp.from)
				if rng.IntN(4) == 0 {
					at = max(sp.from, sp.to-1-rng.IntN(10))
				}
				for k := range 1 + rng.IntN(12) {
					if at+k < sp.to && rng.IntN(5) > 0 {
						b[at+k] ^= byte(1 + rng.IntN(255))
					}
				}
			}
			// A queue's slots past its messages stay empty.
			for _, sp := range sps {
				copy(b[sp.end(stateArray(&s)):sp.to], stateBytes(&encodingBase)[sp.end(stateArray(&s)):sp.to])
			}
			states = append(states, s)
		}
		for i := range states {
			if outsideSpans(m, &states[i]) >= 0 {
				t.Fatalf("state %d: the test wrote outside the spans", i)
			}
			want := appendStateByBytes(m, nil, &states[i])
			got := m.AppendState([]byte{0xee}, &states[i])
			if !bytes.Equal(got[1:], want) || got[0] != 0xee {
				t.Fatalf("state %d: AppendState wrote\n%x\nthe definition\n%x", i, got[1:], want)
			}
			var back State
			if err := m.DecodeState(want, &back); err != nil || back != states[i] {
				t.Fatalf("state %d does not decode back (%v)", i, err)
			}
		}
	}
}

// The encoding is exact: a state that differs from a reachable one in any
// single byte of the spans, to any of a few values, round-trips byte for
// byte, with each queue full so that every slot is in. A codec that drops or
// misplaces a byte (a word's first or last, the State's short last word, a
// queue's last slot) fails here.
func TestEncodingIsExact(t *testing.T) {
	def, states := reachable(t, NewConfig(3, 4, 2), 200)
	rng := rand.New(rand.NewPCG(5, 6))
	var buf []byte
	for _, m := range []*Model{def, {}} {
		for _, from := range []State{encodingBase, states[len(states)-1]} {
			full := from
			queueN := map[int]bool{}
			for _, sp := range m.spans() {
				if sp.queue {
					stateBytes(&full)[sp.from] = byte((sp.to - sp.from - 1) / msgSize)
					queueN[sp.from] = true
				}
			}
			for _, sp := range m.spans() {
				for at := sp.from; at < sp.to; at++ {
					if queueN[at] {
						continue
					}
					for _, v := range []byte{1, 0x80, 0xff, byte(1 + rng.IntN(255))} {
						s := full
						stateBytes(&s)[at] ^= v
						buf = m.AppendState(buf[:0], &s)
						var back State
						if err := m.DecodeState(buf, &back); err != nil {
							t.Fatalf("byte %d ^ %#x: %v", at, v, err)
						}
						if back != s {
							t.Fatalf("byte %d ^ %#x does not round-trip: %x", at, v, buf)
						}
					}
				}
			}
		}
	}
}

// DecodeState refuses what AppendState does not write: a truncated or
// extended encoding, a bitmap byte or bit past the model's words, a zero
// bitmap byte, a header past 63 or past its word, bytes past the State's
// short last word, too few or too many bytes for the headers. None of these
// panics or writes out of the State.
func TestDecodeRefusesMalformedEncodings(t *testing.T) {
	def, states := reachable(t, NewConfig(3, 4, 2), 2000)
	var s State
	bad := func(m *Model, name string, b []byte) {
		t.Helper()
		if err := m.DecodeState(b, &s); !errors.Is(err, ErrBadEncoding) {
			t.Errorf("%s: %x: got %v, want ErrBadEncoding", name, b, err)
		}
	}
	sw := def.words()
	// A state that differs in one byte of the first word: its byte, its
	// header, a bitmap byte of bit 0 and a summary of bit 0.
	one := encodingBase
	stateBytes(&one)[0] ^= 0x5a
	enc := def.AppendState(nil, &one)
	summary := func(bits uint64) []byte {
		return binary.LittleEndian.AppendUint64(nil, bits)[:sw.sumLen]
	}
	if want := append([]byte{0x5a, 0, 1}, summary(1)...); !bytes.Equal(enc, want) {
		t.Fatalf("one byte's encoding is %x, want %x", enc, want)
	}
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	bad(def, "empty", nil)
	bad(def, "a summary bit past the bitmap", cat([]byte{0x5a, 0, 1}, summary(1|1<<sw.mapLen)))
	bad(def, "a zero bitmap byte", cat([]byte{0x5a, 0, 0}, summary(1)))
	last := byte(1) << (sw.words % 8)
	if sw.words%8 == 0 {
		t.Fatalf("%d words: the last bitmap byte has no bit past them to test", sw.words)
	}
	bad(def, "a bitmap bit past the words", cat([]byte{0x5a, 0, last}, summary(1<<(sw.mapLen-1))))
	bad(def, "a header of 64", cat([]byte{0x5a, 64, 1}, summary(1)))
	bad(def, "bytes past the word", cat([]byte{0x5a, 0x5a, 7 | 1<<3, 1}, summary(1)))
	bad(def, "a byte short", cat([]byte{0x5a, 1 << 3, 1}, summary(1)))
	bad(def, "a byte over", cat([]byte{0x5a, 0x5a, 0, 1}, summary(1)))
	bad(def, "no header", cat([]byte{0x5a, 1}, summary(1)))
	// The whole State's model: its short last word holds stateSize%8 bytes.
	whole := &Model{}
	wsw := whole.words()
	tail := stateSize % 8
	if tail == 0 {
		t.Fatalf("a State of %d bytes has no short last word to test", stateSize)
	}
	k := wsw.words - 1
	tailEnc := func(h byte) []byte {
		return cat(bytes.Repeat([]byte{0x5a}, int(h>>3)+1), []byte{h, 1 << (k % 8)}, binary.LittleEndian.AppendUint64(nil, 1<<(k/8))[:wsw.sumLen])
	}
	var back State
	if err := whole.DecodeState(tailEnc(byte(tail-1)<<3), &back); err != nil {
		t.Fatalf("the short last word's %d bytes: %v", tail, err)
	}
	for i := stateSize - tail; i < stateSize; i++ {
		if got, want := stateBytes(&back)[i], stateBytes(&encodingBase)[i]^0x5a; got != want {
			t.Errorf("the short last word: byte %d decodes to %#x, want %#x", i, got, want)
		}
	}
	bad(whole, "bytes past the State", tailEnc(byte(tail)<<3))
	bad(whole, "bytes past the State, shifted", tailEnc(1|byte(tail-1)<<3))
	bad(def, "a byte appended", append(enc, 0))
	// Every truncation of reachable states' encodings decodes or is
	// refused, without a panic and only into the model's words.
	for i := range states[:200] {
		e := def.AppendState(nil, &states[len(states)-1-i])
		for n := range len(e) {
			if def.DecodeState(e[:n], &s) == nil {
				if at := outsideWords(def, &s); at >= 0 {
					t.Errorf("%x, a prefix of %x, decodes to a state that differs from the base at byte %d, outside the model's words", e[:n], e, at)
				}
			}
		}
	}
}

// FuzzDecodeState: any bytes decode without a panic, and change the State
// only in its model's words; and a state decoded that keeps its queues'
// slots past their messages empty encodes to bytes that decode to it.
func FuzzDecodeState(f *testing.F) {
	m, states := reachable(f, NewConfig(3, 4, 2), 300)
	for i := range states {
		f.Add(m.AppendState(nil, &states[i]))
	}
	f.Add([]byte{0x5a, 0, 1, 1, 0, 0})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		var s State
		if m.DecodeState(b, &s) != nil {
			return
		}
		if at := outsideWords(m, &s); at >= 0 {
			t.Fatalf("%x decodes to a state that differs from the base at byte %d, outside the model's words", b, at)
		}
		if outsideSpans(m, &s) >= 0 {
			return // a queue slot past its messages: no reachable state's
		}
		var back State
		if err := m.DecodeState(m.AppendState(nil, &s), &back); err != nil || back != s {
			t.Fatalf("%x: its state does not round-trip (%v)", b, err)
		}
	})
}

// outsideWords returns the first byte of s outside m's words that differs
// from the base, or -1.
func outsideWords(m *Model, s *State) int {
	in := make([]bool, stateSize)
	for _, sp := range m.spans() {
		for i := sp.from &^ 7; i < min((sp.to+7)&^7, stateSize); i++ {
			in[i] = true
		}
	}
	cur, base := stateBytes(s), stateBytes(&encodingBase)
	for i := range cur {
		if !in[i] && cur[i] != base[i] {
			return i
		}
	}
	return -1
}

// fullMinimum is the canonical form by definition: the smallest encoding over
// every request symmetry and node renaming. AppendFingerprint must identify exactly the states
// it identifies.
func fullMinimum(m *Model, s *State) string {
	var best []byte
	for i := range m.nodes {
		for j := range m.perms {
			if e := m.encode(nil, s, renaming{req: j, nodes: &m.nodes[i]}); best == nil || bytes.Compare(e, best) < 0 {
				best = e
			}
		}
	}
	return string(best)
}

func TestFingerprintIdentifiesExactlyTheSymmetricStates(t *testing.T) {
	faults := func(c Config, fs ...Fault) Config {
		c.Faults = Budget{}
		for _, f := range fs {
			c.Faults[f] = 1
		}
		return c
	}
	threeEqual := NewConfig(3, 4, 2)
	threeEqual.Prompts = []int{2, 2, 2}
	twoPage := NewConfig(3, 6, 2)
	twoPage.Prompts, twoPage.PrefillPages = []int{4, 4, 9}, 4
	twoByTwo := NewConfig(3, 4, 2)
	twoByTwo.Prefills, twoByTwo.Decodes = 2, 2
	distinct := NewConfig(3, 4, 2) // no two requests interchangeable: one renaming
	distinct.Prompts = []int{2, 4, 3}
	for _, cfg := range []Config{
		faults(NewConfig(3, 4, 2), FaultCancel, FaultCrash),
		faults(threeEqual, FaultCancel, FaultTimeout),
		faults(distinct, FaultCancel),
		faults(twoPage, FaultCancel),
		faults(twoByTwo, FaultCrash),
	} {
		m, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		// A breadth-first search reduced by the fingerprint, which compares it
		// with fullMinimum on every successor it generates.
		fpOf, fullOf := map[string]string{}, map[string]string{}
		queue := m.Initial()
		merged := 0
		see := func(s *State) bool {
			fp, full := string(m.AppendFingerprint(nil, s)), fullMinimum(m, s)
			prevFull, seen := fullOf[fp]
			if seen && prevFull != full {
				t.Fatalf("%v: two states of different symmetry classes share a fingerprint", cfg.Prompts)
			}
			if prevFP, ok := fpOf[full]; ok && prevFP != fp {
				t.Fatalf("%v: two symmetric states have different fingerprints", cfg.Prompts)
			}
			fullOf[fp], fpOf[full] = full, fp
			return !seen
		}
		see(&queue[0])
		for len(queue) > 0 {
			s := queue[0]
			queue = queue[1:]
			m.Successors(&s, func(_ Action, n *State) {
				if see(n) {
					queue = append(queue, *n)
				} else {
					merged++
				}
			})
		}
		t.Logf("%v: %d classes, %d successors reached a known one", cfg.Prompts, len(fpOf), merged)
	}
}

// A leaf is one field of State that holds neither a request nor a decode
// page: its bytes' place, and the request (Req[elem]) or decode pool
// (Pages[group-1][elem]) it belongs to, whose index renaming may change.
type leaf struct {
	off, size   uintptr
	group, elem int // group 0: part of request elem; d+1: of page elem of decode node d; -1: neither
	fence       bool
	path        string
}

// stateLeaves lists State's leaves. Fields that name a request or a decode
// page (a field ending in Req inside a record, Owner, Page and the slot
// table) are left out, since renaming changes them; the request records
// themselves (State.Req) are in, as rows of group 0.
func stateLeaves() []leaf {
	var out []leaf
	var walk func(t reflect.Type, off uintptr, group, elem int, fence bool, path string)
	walk = func(t reflect.Type, off uintptr, group, elem int, fence bool, path string) {
		switch t.Kind() {
		case reflect.Struct:
			for i := 0; i < t.NumField(); i++ {
				f := t.Field(i)
				// Dispatched too: no step reads it (only the fingerprint, to tell
				// a route from the zeros of none), so states that differ in it
				// alone may merge.
				if (strings.HasSuffix(f.Name, "Req") && path != "") || f.Name == "Owner" || f.Name == "Page" || f.Name == "Slots" || f.Name == "Dispatched" {
					continue
				}
				walk(f.Type, off+f.Offset, group, elem, fence || f.Name == "Fenced" || f.Name == "DecodeLost", path+"."+f.Name)
			}
		case reflect.Array:
			for i := 0; i < t.Len(); i++ {
				g, e := group, elem
				switch {
				case path == ".Req":
					g, e = 0, i
				case strings.HasPrefix(path, ".Pages["):
					g, e = group+1, i // group holds the decode node here
				case path == ".Pages":
					g = i
				}
				walk(t.Elem(), off+uintptr(i)*t.Elem().Size(), g, e, fence, fmt.Sprintf("%s[%d]", path, i))
			}
		default:
			out = append(out, leaf{off: off, size: t.Size(), group: group, elem: elem, fence: fence, path: path})
		}
	}
	walk(reflect.TypeOf(State{}), 0, -1, -1, false, "")
	return out
}

// contentOf is s without the names of requests and decode pages: its leaves'
// bytes, each request's and each page's in sorted order. Symmetric states have
// equal contents. fences says whether the fence fields count (encode leaves
// them out where they change nothing; docs/spec.md, Reductions).
func contentOf(leaves []leaf, s *State, fences bool) string {
	b := stateBytes(s)
	var fixed []byte
	rows := map[int][][]byte{}
	for _, l := range leaves {
		if l.fence && !fences {
			continue
		}
		v := b[l.off : l.off+l.size]
		if l.group < 0 {
			fixed = append(fixed, v...)
			continue
		}
		g := rows[l.group]
		for len(g) <= l.elem {
			g = append(g, nil)
		}
		g[l.elem] = append(g[l.elem], v...)
		rows[l.group] = g
	}
	for g := 0; g <= MaxDecodes; g++ {
		r := rows[g]
		slices.SortFunc(r, bytes.Compare)
		for _, row := range r {
			fixed = append(fixed, row...)
		}
	}
	return string(fixed)
}

// nodeContentOf is contentOf without the names of nodes either: the least
// content over every renaming of the nodes (permuteNodes).
func nodeContentOf(m *Model, leaves []leaf, s *State, fences bool) string {
	best := contentOf(leaves, s, fences)
	for i := 1; i < len(m.nodes); i++ {
		r := permuteNodes(s, &m.nodes[i])
		best = min(best, contentOf(leaves, &r, fences))
	}
	return best
}

// Two reachable states with one fingerprint have the same content: a field
// the fingerprint leaves out (one added to State and not to encode) merges
// states that differ in it. Leaving out a field the others determine merges
// nothing and passes: dropping the sender's completion count, the read
// history or the cancel budget from encode leaves the default bounds at
// 1,052,395 states (699,452 before streaming prefill's Compute), while
// dropping a WRITE's damage or a crash's detection fails here, and so does
// dropping a request's incarnation (PInc) under restarts. It looks at the first 10,000 states each configuration reaches
// breadth-first, not at every reachable state.
func TestFingerprintCoversEveryField(t *testing.T) {
	all := withEveryFault
	twoPage := NewConfig(3, 6, 2)
	twoPage.Prompts, twoPage.PrefillPages = []int{4, 4, 9}, 4
	twoByTwo := NewConfig(3, 4, 2)
	twoByTwo.Prefills, twoByTwo.Decodes = 2, 2
	decodeRestarts := all(twoByTwo)
	decodeRestarts.DecodeRestarts = true
	// One pair whose few states the limit covers: requests routed before and
	// after a decode restart, and queue pairs to both incarnations.
	decodeRestartsOnePair := NewConfig(2, 2, 2)
	decodeRestartsOnePair.Faults = Budget{}
	decodeRestartsOnePair.Faults[FaultRestart], decodeRestartsOnePair.Faults[FaultLate], decodeRestartsOnePair.Faults[FaultCancel] = 2, 1, 1
	decodeRestartsOnePair.DecodeRestarts = true
	// And one explored whole (142,335 states, unreduced; 86,529 before
	// streaming prefill's Compute): two requests of a
	// page each, crashes, restarts of either node, cancels and late
	// placements. The first 10,000 states of the others never restart a
	// decode node and then take the news of it, so they cannot tell a
	// fingerprint that drops a prefill node's queue-pair incarnation
	// (PQPInc) or a request's decode incarnation (Request.DInc); this one
	// does (each merges states when dropped: check --pages 2 --prompts 2,2
	// --faults crash,restart,cancel,late --decode-restarts explores 38,349
	// states, 36,931 and 37,993 without them; without the crash budget the
	// PQPInc drop goes unseen). Msg.DInc and State.DInc are determined by
	// the rest there: leaving either out changes no count of the checker's.
	decodeRestartsWhole := NewConfig(2, 2, 2)
	decodeRestartsWhole.Prompts = []int{2, 2}
	decodeRestartsWhole.Faults = Budget{}
	for _, f := range []Fault{FaultCrash, FaultRestart, FaultCancel, FaultLate} {
		decodeRestartsWhole.Faults[f] = 1
	}
	decodeRestartsWhole.DecodeRestarts = true
	leaves := stateLeaves()
	for _, cfg := range []Config{NewConfig(3, 4, 2), all(NewConfig(3, 4, 2)), all(twoPage), all(twoByTwo), decodeRestarts, decodeRestartsOnePair, decodeRestartsWhole} {
		limit := 10000
		if cfg.DecodeRestarts && len(cfg.Prompts) == 2 && cfg.Faults[FaultCrash] == 1 {
			limit = 200000
		}
		m, states := reachable(t, cfg, limit)
		if limit > 10000 && len(states) == limit {
			t.Fatalf("%v: more than %d states: not explored whole", cfg.Prompts, limit)
		}
		fences := cfg.NumPrefills()*cfg.NumDecodes() > 1 || cfg.Faults[FaultLease] > 0
		byFP := map[string]int{}
		merged := 0
		for i := range states {
			fp := string(m.AppendFingerprint(nil, &states[i]))
			prev, ok := byFP[fp]
			if !ok {
				byFP[fp] = i
				continue
			}
			merged++
			if nodeContentOf(m, leaves, &states[prev], fences) != nodeContentOf(m, leaves, &states[i], fences) {
				t.Fatalf("%v: states %d and %d have one fingerprint but differ beyond renaming:\n%+v\n%+v", cfg.Prompts, prev, i, states[prev], states[i])
			}
		}
		if merged == 0 {
			t.Fatalf("%v: no two of %d states share a fingerprint: the test shows nothing", cfg.Prompts, len(states))
		}
		t.Logf("%v: %d states, %d share a fingerprint with an earlier one", cfg.Prompts, len(states), merged)
	}
}
