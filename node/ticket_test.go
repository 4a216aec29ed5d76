package node

import (
	"crypto/ed25519"
	"errors"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// A decode node's ticket check takes the router's ticket for this node,
// from the prefill node it was given to, for this request and token count,
// in the Bootstrap's scope with its chain, unexpired, once; and refuses
// each other kind with its own error, all wrapping ErrTicket: none,
// garbage, a truncated or bit-flipped ticket, one signed by another key,
// for another decode node, sent by another prefill node, for another
// request or token count, for another scope or chain (a prefill node
// claiming another tenant's cached pages), a KVT1 ticket, expired, replayed;
// a Bootstrap without scope and chain asks for no reuse and passes.
func TestTicketCheckRefusesEveryTicketButTheRoutersForThisBootstrap(t *testing.T) {
	pub, key, _ := pki.NewTicketKey()
	_, otherKey, _ := pki.NewTicketKey()
	now := time.Unix(1_800_000_000, 0)
	c := NewTicketChecker(pub, "decode-0")
	c.now = func() time.Time { return now }
	chain := protocol.PrefixChain(make([]uint32, 100), 16)
	valid := Ticket{Request: 7, Tokens: 100, Prefill: "prefill-0", Decode: "decode-0", Expires: now.Add(time.Minute), Scope: 0xa1, Chain: chainDigest(chain)}
	sign := func(k ed25519.PrivateKey, tk Ticket) []byte {
		b, err := SignTicket(k, tk)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	with := func(f func(*Ticket)) []byte { tk := valid; f(&tk); return sign(key, tk) }
	flipped := sign(key, valid)
	flipped[10] ^= 1
	boot := func(ticket []byte) *protocol.Bootstrap {
		return &protocol.Bootstrap{Request: 7, Tokens: 100, Scope: 0xa1, Chain: chain, Ticket: ticket}
	}
	otherChain := protocol.PrefixChain(append([]uint32{1}, make([]uint32, 99)...), 16)
	kvt1 := sign(key, valid)
	copy(kvt1, "KVT1")
	for what, c2 := range map[string]struct {
		peer   string
		b      *protocol.Bootstrap
		reason error
	}{
		"no ticket":             {"prefill-0", boot(nil), ErrNoTicket},
		"garbage":               {"prefill-0", boot([]byte("let me in")), ErrTicketForged},
		"truncated":             {"prefill-0", boot(sign(key, valid)[:40]), ErrTicketForged},
		"a bit flipped":         {"prefill-0", boot(flipped), ErrTicketForged},
		"another key's":         {"prefill-0", boot(sign(otherKey, valid)), ErrTicketForged},
		"for another decode":    {"prefill-0", boot(with(func(tk *Ticket) { tk.Decode = "decode-1" })), ErrTicketMisrouted},
		"from another prefill":  {"intruder", boot(sign(key, valid)), ErrTicketMisrouted},
		"for another request":   {"prefill-0", boot(with(func(tk *Ticket) { tk.Request = 8 })), ErrTicketMismatch},
		"another token count":   {"prefill-0", &protocol.Bootstrap{Request: 7, Tokens: 1000, Ticket: sign(key, valid)}, ErrTicketMismatch},
		"expired":               {"prefill-0", boot(with(func(tk *Ticket) { tk.Expires = now.Add(-DefaultTicketSkew - time.Second) })), ErrTicketExpired},
		"another request's, 8b": {"prefill-0", &protocol.Bootstrap{Request: 8, Tokens: 100, Ticket: sign(key, valid)}, ErrTicketMismatch},
		"another scope":         {"prefill-0", &protocol.Bootstrap{Request: 7, Tokens: 100, Scope: 0xb2, Chain: chain, Ticket: sign(key, valid)}, ErrTicketScope},
		"a chain, no scope":     {"prefill-0", &protocol.Bootstrap{Request: 7, Tokens: 100, Chain: chain, Ticket: sign(key, valid)}, ErrTicketScope},
		"another chain":         {"prefill-0", &protocol.Bootstrap{Request: 7, Tokens: 100, Scope: 0xa1, Chain: otherChain, Ticket: sign(key, valid)}, ErrTicketScope},
		"a chain cut short":     {"prefill-0", &protocol.Bootstrap{Request: 7, Tokens: 100, Scope: 0xa1, Chain: chain[:5], Ticket: sign(key, valid)}, ErrTicketScope},
		"a KVT1 ticket":         {"prefill-0", boot(kvt1), ErrTicketForged},
	} {
		err := c.Check(c2.peer, c2.b)
		if !errors.Is(err, c2.reason) || !errors.Is(err, ErrTicket) {
			t.Errorf("%s: %v, want %v", what, err, c2.reason)
		}
	}
	if err := c.Check("prefill-0", boot(sign(key, valid))); err != nil {
		t.Fatalf("the router's ticket: %v", err)
	}
	if tk, err := OpenTicket(pub, sign(key, valid)); err != nil || !tk.Expires.Equal(valid.Expires) || tk.Scope != valid.Scope || tk.Chain != valid.Chain || tk.Request != valid.Request {
		t.Fatalf("a ticket round trip: %+v, %v; signed %+v", tk, err, valid)
	}
	if err := c.Check("prefill-0", boot(sign(key, valid))); !errors.Is(err, ErrTicketReplayed) {
		t.Fatalf("the same request again: %v", err)
	}
	// A Bootstrap without a scope asks for no reuse: the ticket's scope
	// need not be claimed.
	noReuse := with(func(tk *Ticket) { tk.Request = 70 })
	if err := c.Check("prefill-0", &protocol.Bootstrap{Request: 70, Tokens: 100, Ticket: noReuse}); err != nil {
		t.Fatalf("a Bootstrap without scope or chain: %v", err)
	}
	// Within the clock skew a just-expired ticket is still taken; an id is
	// forgotten once its ticket expired, and the map does not grow with them.
	late := with(func(tk *Ticket) {
		tk.Request = 9
		tk.Expires = now.Add(-time.Second)
		tk.Scope, tk.Chain = 0, [32]byte{}
	})
	if err := c.Check("prefill-0", &protocol.Bootstrap{Request: 9, Tokens: 100, Ticket: late}); err != nil {
		t.Fatalf("a ticket a second past, within the skew: %v", err)
	}
	for i := range 5000 {
		id := protocol.RequestID(100 + i)
		tk := with(func(tk *Ticket) { tk.Request = id; tk.Expires = now.Add(time.Second) })
		if err := c.Check("prefill-0", &protocol.Bootstrap{Request: id, Tokens: 100, Scope: 0xa1, Chain: chain, Ticket: tk}); err != nil {
			t.Fatal(err)
		}
		now = now.Add(time.Millisecond)
	}
	now = now.Add(2 * time.Minute)
	tk := with(func(tk *Ticket) { tk.Request = 99999; tk.Expires = now.Add(time.Minute) })
	if err := c.Check("prefill-0", &protocol.Bootstrap{Request: 99999, Tokens: 100, Scope: 0xa1, Chain: chain, Ticket: tk}); err != nil {
		t.Fatal(err)
	}
	if len(c.seen) != 1 {
		t.Fatalf("%d request ids remembered after their tickets expired, want 1", len(c.seen))
	}
	if _, err := SignTicket(key, Ticket{Prefill: string(make([]byte, 300))}); err == nil {
		t.Fatal("a ticket with a 300-byte name was signed")
	}
}

// The ticket's cost per request: the router's signature, and the decode
// node's check (signature verification, the replay map).
func BenchmarkTicket(b *testing.B) {
	pub, key, _ := pki.NewTicketKey()
	tk := Ticket{Request: 1, Tokens: 1024, Prefill: "prefill-0", Decode: "decode-0", Expires: time.Now().Add(time.Hour)}
	b.Run("sign", func(b *testing.B) {
		for b.Loop() {
			if _, err := SignTicket(key, tk); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("check", func(b *testing.B) {
		c := NewTicketChecker(pub, "decode-0")
		var id protocol.RequestID
		for b.Loop() {
			b.StopTimer()
			id++
			t := tk
			t.Request = id
			sig, _ := SignTicket(key, t)
			boot := &protocol.Bootstrap{Request: id, Tokens: 1024, Ticket: sig}
			b.StartTimer()
			if err := c.Check("prefill-0", boot); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// OpenTicket never panics, and refuses with ErrTicketForged whatever is not
// a ticket the key signed: the fuzzer's bytes as they come (a signature it
// cannot forge) and, signed with the key, as a ticket's body (the parse
// behind the signature: signed by the router, yet not a ticket). A ticket
// it takes is the one SignTicket writes, byte for byte: nothing in it went
// unread. CI fuzzes it (.ci/run); go test runs the seeds.
func FuzzOpenTicket(f *testing.F) {
	pub, key, err := pki.NewTicketKey()
	if err != nil {
		f.Fatal(err)
	}
	valid, err := SignTicket(key, Ticket{Request: 7, Tokens: 100, Prefill: "prefill-0", Decode: "decode-0", Expires: time.Unix(1_800_000_000, 0), Scope: 0xa1})
	if err != nil {
		f.Fatal(err)
	}
	body := valid[:len(valid)-ed25519.SignatureSize]
	f.Add(valid, false)
	f.Add(body, true)
	f.Add(body[:len(body)-3], true)
	f.Add(append(append([]byte{}, body...), 0), true)
	f.Add([]byte("KVT2"), true)
	f.Fuzz(func(t *testing.T, b []byte, signIt bool) {
		if signIt {
			b = append(b[:len(b):len(b)], ed25519.Sign(key, b)...)
		}
		tk, err := OpenTicket(pub, b)
		if err != nil {
			if !errors.Is(err, ErrTicketForged) {
				t.Fatalf("refused with %v, want ErrTicketForged", err)
			}
			return
		}
		again, err := SignTicket(key, tk)
		if err != nil || string(again) != string(b) {
			t.Fatalf("took %x as %+v, which signs as %x (%v)", b, tk, again, err)
		}
	})
}
