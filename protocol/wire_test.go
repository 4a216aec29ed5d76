package protocol

import (
	"bytes"
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
		"a later one":    {mutate(func(b []byte) []byte { b[0] = Version + 1; return b }), ErrVersion},
		"unknown type":   {mutate(func(b []byte) []byte { b[1] = 99; return b }), ErrUnknownType},
		"too long":       {mutate(func(b []byte) []byte { binary.BigEndian.PutUint32(b[2:], MaxBody+1); return b }), ErrFrameTooLong},
		"trailing bytes": {mutate(func(b []byte) []byte { binary.BigEndian.PutUint32(b[2:], 17); return append(b, 0) }), ErrMalformed},
		"short body":     {mutate(func(b []byte) []byte { binary.BigEndian.PutUint32(b[2:], 15); return b[:len(b)-1] }), ErrMalformed},
		"zero tokens":    {mutate(func(b []byte) []byte { binary.BigEndian.PutUint32(b[14:], 0); return b }), ErrMalformed},
		"zero pages":     {mutate(func(b []byte) []byte { binary.BigEndian.PutUint32(b[18:], 0); return b }), ErrMalformed},
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
	binary.BigEndian.PutUint32(frame[HeaderSize+12:], 100000)
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
		binary.BigEndian.PutUint16(f[HeaderSize+12:], n)
		if _, _, err := DecodeMessage(f); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: %v", name, err)
		}
	}
	old := []byte{1, byte(TypeBootstrap), 0, 0, 0, 12, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2}
	if _, _, err := DecodeMessage(old); !errors.Is(err, ErrVersion) {
		t.Fatalf("a version-1 Bootstrap: %v", err)
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
