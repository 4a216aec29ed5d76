package protocol

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"reflect"
	"runtime"
	"testing"
)

func sampleMessages() []Message {
	return []Message{
		&Bootstrap{Request: 7, Tokens: 1_048_576},
		&Grant{Request: 7, Tokens: 5, Pages: []PageGrant{{Page: 9, Epoch: 4, Addr: 0x7f00_0000_1000, Key: 0xabc}, {Page: 2, Epoch: 11, Addr: 0x7f00_0000_2000, Key: 0xabc}}},
		&Done{Request: 7, Tokens: 5, Pages: 2},
		&Abort{Request: 7, Reason: AbortTimedOut},
		&AbortAck{Request: 7},
		&Bootstrap{Request: 8, Tokens: 3, Ticket: []byte("the router's signed word")},
		&Bootstrap{Request: 9, Tokens: 40, Scope: 0xfeed, Chain: PrefixChain(make([]uint32, 40), 16), Ticket: []byte("ticket")},
		&Grant{Request: 9, Tokens: 40, Prefix: 32, Pages: []PageGrant{{Page: 3, Epoch: 2, Addr: 0x3000, Key: 7}}},
		&Done{Request: 9, Tokens: 40, Pages: 1, Prefix: 32},
	}
}

func TestEveryMessageRoundTrips(t *testing.T) {
	for _, m := range sampleMessages() {
		frame, err := AppendMessage(nil, m)
		if err != nil {
			t.Fatalf("%s: %v", m.Type(), err)
		}
		got, n, err := DecodeMessage(frame)
		if err != nil || n != len(frame) || !reflect.DeepEqual(got, m) {
			t.Fatalf("%s: got %+v, %d of %d bytes, %v", m.Type(), got, n, len(frame), err)
		}
	}
}

func TestStreamOfFramesDecodesInOrderAndPartialFrameAsksForMore(t *testing.T) {
	var stream []byte
	for _, m := range sampleMessages() {
		var err error
		if stream, err = AppendMessage(stream, m); err != nil {
			t.Fatal(err)
		}
	}
	// Every strict prefix of a frame is incomplete, never malformed.
	first, _ := AppendMessage(nil, sampleMessages()[1])
	for i := 0; i < len(first); i++ {
		if _, _, err := DecodeMessage(first[:i]); !errors.Is(err, ErrShortFrame) {
			t.Fatalf("prefix of %d bytes: %v, want ErrShortFrame", i, err)
		}
	}
	for i, want := range sampleMessages() {
		m, n, err := DecodeMessage(stream)
		if err != nil || m.Type() != want.Type() {
			t.Fatalf("frame %d: %v %v", i, m, err)
		}
		stream = stream[n:]
	}
	if len(stream) != 0 {
		t.Fatal("bytes left over")
	}
}

func TestDecoderRejectsBrokenFramesWithTypedErrors(t *testing.T) {
	good, _ := AppendMessage(nil, &Done{Request: 1, Tokens: 2, Pages: 1})
	mutate := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(good)) }
	cases := map[string]struct {
		frame []byte
		want  error
	}{
		"version 1":      {mutate(func(b []byte) []byte { b[0] = 1; return b }), ErrVersion}, // before tickets: refused, not misread
		"version 2":      {mutate(func(b []byte) []byte { b[0] = 2; return b }), ErrVersion}, // before prefixes: refused, not misread
		"version 3":      {mutate(func(b []byte) []byte { b[0] = 3; return b }), ErrVersion}, // its hello named no incarnation: refused at setup, and here too
		"a later one":    {mutate(func(b []byte) []byte { b[0] = Version + 1; return b }), ErrVersion},
		"unknown type":   {mutate(func(b []byte) []byte { b[1] = 99; return b }), ErrUnknownType},
		"too long":       {mutate(func(b []byte) []byte { binary.BigEndian.PutUint32(b[2:], MaxBody+1); return b }), ErrFrameTooLong},
		"trailing bytes": {mutate(func(b []byte) []byte { binary.BigEndian.PutUint32(b[2:], 21); return append(b, 0) }), ErrMalformed},
		"short body":     {mutate(func(b []byte) []byte { binary.BigEndian.PutUint32(b[2:], 19); return b[:len(b)-1] }), ErrMalformed},
		"zero tokens":    {mutate(func(b []byte) []byte { binary.BigEndian.PutUint32(b[14:], 0); return b }), ErrMalformed},
		"zero pages":     {mutate(func(b []byte) []byte { binary.BigEndian.PutUint32(b[18:], 0); return b }), ErrMalformed},
		"prefix of all":  {mutate(func(b []byte) []byte { binary.BigEndian.PutUint32(b[22:], 2); return b }), ErrMalformed},
	}
	for name, c := range cases {
		if _, _, err := DecodeMessage(c.frame); !errors.Is(err, c.want) {
			t.Errorf("%s: got %v, want %v", name, err, c.want)
		}
	}
}

func TestGrantPageCountMustMatchItsBytesBeforeAllocating(t *testing.T) {
	frame, _ := AppendMessage(nil, &Grant{Request: 1, Tokens: 2, Pages: []PageGrant{{Page: 1}}})
	// Claim 100000 pages in a body that holds one: refused, nothing allocated for them.
	binary.BigEndian.PutUint32(frame[HeaderSize+16:], 100000)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	const runs = 100
	for range runs {
		if _, _, err := DecodeMessage(frame); !errors.Is(err, ErrMalformed) {
			t.Fatalf("got %v", err)
		}
	}
	runtime.ReadMemStats(&after)
	// 100000 pages would be 2.4 MB a run; the message and its error are a few hundred bytes.
	if perRun := (after.TotalAlloc - before.TotalAlloc) / runs; perRun > 1024 {
		t.Fatalf("%d bytes allocated per decode of a lying page count", perRun)
	}
}

func TestEncoderRefusesWhatTheDecoderWould(t *testing.T) {
	for name, m := range map[string]Message{
		"grant without pages": &Grant{Request: 1, Tokens: 1},
		"too many pages":      &Grant{Request: 1, Tokens: 1, Pages: make([]PageGrant, MaxGrantPages+1)},
		"tokens over limit":   &Bootstrap{Request: 1, Tokens: MaxTokens + 1},
		"ticket over limit":   &Bootstrap{Request: 1, Tokens: 1, Ticket: make([]byte, MaxTicket+1)},
		"chain over limit":    &Bootstrap{Request: 1, Tokens: MaxTokens, Scope: 1, Chain: make([]ChainHash, MaxGrantPages+1)},
		"chain without scope": &Bootstrap{Request: 1, Tokens: 16, Chain: make([]ChainHash, 1)},
		"chain past tokens":   &Bootstrap{Request: 1, Tokens: 1, Scope: 1, Chain: make([]ChainHash, 2)},
		"prefix of all":       &Grant{Request: 1, Tokens: 4, Prefix: 4, Pages: make([]PageGrant, 1)},
		"done prefix of all":  &Done{Request: 1, Tokens: 4, Pages: 1, Prefix: 4},
		"abort without why":   &Abort{Request: 1},
		"nil":                 nil,
	} {
		if _, err := AppendMessage(nil, m); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: got %v, want ErrMalformed", name, err)
		}
	}
}

// FuzzDecodeMessage: any input yields a message or a typed error, never a panic;
// a decoded message re-encodes to exactly the bytes it came from (one encoding
// per message), and nothing beyond the limits is allocated.
func FuzzDecodeMessage(f *testing.F) {
	for _, m := range sampleMessages() {
		frame, _ := AppendMessage(nil, m)
		f.Add(frame)
		f.Add(frame[:len(frame)/2])
	}
	f.Add([]byte{1, 2, 0, 0, 0, 20})
	f.Add([]byte{1, 2, 0xff, 0xff, 0xff, 0xff})
	var d Decoder // reused across inputs, as a receive loop does
	f.Fuzz(func(t *testing.T, b []byte) {
		m, n, err := DecodeMessage(b)
		dm, dn, derr := d.Decode(b)
		if (err == nil) != (derr == nil) || n != dn || err == nil && !reflect.DeepEqual(m, dm) {
			t.Fatalf("the Decoder differs: %+v %d %v, DecodeMessage %+v %d %v", dm, dn, derr, m, n, err)
		}
		if err != nil {
			for _, known := range []error{ErrShortFrame, ErrVersion, ErrUnknownType, ErrFrameTooLong, ErrMalformed} {
				if errors.Is(err, known) {
					return
				}
			}
			t.Fatalf("untyped error %v", err)
		}
		if n < HeaderSize || n > len(b) || n > HeaderSize+MaxBody {
			t.Fatalf("consumed %d of %d bytes", n, len(b))
		}
		if g, ok := m.(*Grant); ok && len(g.Pages) > MaxGrantPages {
			t.Fatalf("%d pages", len(g.Pages))
		}
		if b, ok := m.(*Bootstrap); ok && len(b.Chain) > MaxGrantPages {
			t.Fatalf("%d chain hashes", len(b.Chain))
		}
		again, err := AppendMessage(nil, m)
		if err != nil || !bytes.Equal(again, b[:n]) {
			t.Fatalf("re-encoding differs: %v\n%x\n%x", err, again, b[:n])
		}
	})
}

// A Bootstrap's ticket length must match its bytes, and MaxTicket, before
// anything is allocated for it; a version-1 Bootstrap (no ticket field) is
// refused as another version, not read as a Bootstrap without a ticket.
func TestBootstrapTicketLengthMustMatchItsBytes(t *testing.T) {
	frame, _ := AppendMessage(nil, &Bootstrap{Request: 1, Tokens: 2, Ticket: []byte("abc")})
	for name, n := range map[string]uint16{"longer than the body": 4, "past MaxTicket": MaxTicket + 1, "shorter": 2} {
		f := bytes.Clone(frame)
		binary.BigEndian.PutUint16(f[HeaderSize+24:], n)
		if _, _, err := DecodeMessage(f); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: %v", name, err)
		}
	}
	old := []byte{1, byte(TypeBootstrap), 0, 0, 0, 12, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2}
	if _, _, err := DecodeMessage(old); !errors.Is(err, ErrVersion) {
		t.Fatalf("a version-1 Bootstrap: %v", err)
	}
	v2 := []byte{2, byte(TypeBootstrap), 0, 0, 0, 14, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0}
	if _, _, err := DecodeMessage(v2); !errors.Is(err, ErrVersion) {
		t.Fatalf("a version-2 Bootstrap: %v", err)
	}
	var d Decoder
	for _, ticket := range []string{"a longer ticket", "short", ""} {
		f, _ := AppendMessage(nil, &Bootstrap{Request: 1, Tokens: 2, Ticket: []byte(ticket)})
		m, _, err := d.Decode(f)
		if err != nil || string(m.(*Bootstrap).Ticket) != ticket {
			t.Fatalf("Decoder: %q, %v; want %q", m.(*Bootstrap).Ticket, err, ticket)
		}
	}
}

// A Bootstrap's chain length must fit in its bytes and in MaxGrantPages
// before anything is allocated for it (rule 17): a peer claiming 100,000
// hashes in a body of one gets ErrMalformed and costs a few hundred bytes.
func TestBootstrapChainLengthMustMatchItsBytesBeforeAllocating(t *testing.T) {
	frame, _ := AppendMessage(nil, &Bootstrap{Request: 1, Tokens: 32, Scope: 5, Chain: PrefixChain(make([]uint32, 32), 16)})
	for name, n := range map[string]uint32{"longer than the body": 3, "past MaxGrantPages": MaxGrantPages + 1, "lying": 100000} {
		f := bytes.Clone(frame)
		binary.BigEndian.PutUint32(f[HeaderSize+20:], n)
		if _, _, err := DecodeMessage(f); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: %v", name, err)
		}
	}
	binary.BigEndian.PutUint32(frame[HeaderSize+20:], 100000)
	var d Decoder
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	const runs = 100
	for range runs {
		if _, _, err := d.Decode(frame); !errors.Is(err, ErrMalformed) {
			t.Fatalf("got %v", err)
		}
	}
	runtime.ReadMemStats(&after)
	if perRun := (after.TotalAlloc - before.TotalAlloc) / runs; perRun > 1024 {
		t.Fatalf("%d bytes allocated per decode of a lying chain length", perRun)
	}
}

// PrefixChain: one hash per full page, each naming the whole prefix up to
// its page: prompts that agree on their first pages agree on those hashes
// and on no later one; the page size is part of the first hash.
func TestPrefixChainNamesWholePrefixes(t *testing.T) {
	a := make([]uint32, 50)
	for i := range a {
		a[i] = uint32(i)
	}
	c := append([]uint32(nil), a...)
	c[20] = 999 // page 1 of 16-token pages differs
	ca, cc := PrefixChain(a, 16), PrefixChain(c, 16)
	if len(ca) != 3 || len(PrefixChain(a[:15], 16)) != 0 || len(PrefixChain(a, 0)) != 0 {
		t.Fatalf("lengths %d, %d", len(ca), len(PrefixChain(a[:15], 16)))
	}
	if ca[0] != cc[0] || ca[1] == cc[1] || ca[2] == cc[2] {
		t.Fatalf("the chains of prompts differing in page 1: %x / %x", ca, cc)
	}
	if p8 := PrefixChain(a, 8); p8[0] == ca[0] || p8[1] == ca[0] {
		t.Fatal("the page size is not in the chain")
	}
	h := sha256.Sum256(append([]byte("kvhandoff/chain/v1"), be32(append([]uint32{16}, a[:16]...)...)...))
	if ca[0] != ChainHash(h[:16]) {
		t.Fatalf("h_0 is %x, want %x", ca[0], h[:16])
	}
	h = sha256.Sum256(append(ca[0][:], be32(a[16:32]...)...))
	if ca[1] != ChainHash(h[:16]) {
		t.Fatalf("h_1 is %x, want %x", ca[1], h[:16])
	}
}

func be32(v ...uint32) []byte {
	var out []byte
	for _, x := range v {
		out = binary.BigEndian.AppendUint32(out, x)
	}
	return out
}
