package protocol

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
)

var errNotTheRouters = errors.New("not the router's")

// ticketed is an Authorize that takes a Bootstrap whose ticket reads
// "ok <request>": the protocol's half of the router's tickets, whose
// cryptography is the node's (node.TicketChecker).
func ticketed(peer PeerID, b *Bootstrap) error {
	if string(b.Ticket) != fmt.Sprintf("ok %d", b.Request) {
		return fmt.Errorf("%w: %q", errNotTheRouters, b.Ticket)
	}
	return nil
}

// A Bootstrap Authorize refuses reserves nothing and leaves no record: its
// outcome wraps ErrUnauthorized and Authorize's reason, and its sender gets
// an Abort of its own reason, AbortUnauthorized, which the sender's outcome
// matches. 1,000 such Bootstraps of the whole pool each take nothing; the
// ticketed one is granted. With unticketed-bootstrap on (Authorize never
// asked), the first unticketed Bootstrap takes the whole pool.
func TestBootstrapWithoutAValidTicketReservesNothing(t *testing.T) {
	for _, bug := range []bool{false, true} {
		t.Run(fmt.Sprintf("unticketed-bootstrap=%v", bug), func(t *testing.T) {
			var sw research.Switches
			if bug {
				sw = research.On(research.UnticketedBootstrap)
			}
			r := boundsReceiver(t, ReceiverConfig{Pages: 64, PageTokens: 16, Authorize: ticketed, Research: sw})
			now := time.Unix(0, 0)
			for i := range 1000 {
				id := RequestID(i + 1)
				ticket := []byte(nil)
				if i%2 == 1 {
					ticket = []byte("ok 12345") // another request's
				}
				if err := r.Step(3, &Bootstrap{Request: id, Tokens: 64 * 16, Ticket: ticket}, now); err != nil {
					t.Fatal(err)
				}
				e := r.Effects()
				if bug {
					if i == 0 && (len(e.Sends) != 1 || e.Sends[0].Msg.Type() != TypeGrant) {
						t.Fatalf("with the defense off the first Bootstrap should be granted the pool: %+v", e)
					}
					continue
				}
				if len(e.Outcomes) != 1 || !errors.Is(e.Outcomes[0].Err, ErrUnauthorized) || !errors.Is(e.Outcomes[0].Err, errNotTheRouters) {
					t.Fatalf("Bootstrap %d: outcomes %v", id, e.Outcomes)
				}
				if len(e.Sends) != 1 || *e.Sends[0].Msg.(*Abort) != (Abort{Request: id, Reason: AbortUnauthorized}) {
					t.Fatalf("Bootstrap %d: sends %+v", id, e.Sends)
				}
			}
			if bug {
				if r.Pool().Free() != 0 {
					t.Fatalf("the defense off: %d pages free, want the pool taken", r.Pool().Free())
				}
				return
			}
			if r.Records() != 0 || r.Pool().Free() != 64 {
				t.Fatalf("refused Bootstraps left %d records, %d of 64 pages free", r.Records(), r.Pool().Free())
			}
			if err := r.Step(3, &Bootstrap{Request: 5000, Tokens: 64 * 16, Ticket: []byte("ok 5000")}, now); err != nil {
				t.Fatal(err)
			}
			if e := r.Effects(); len(e.Sends) != 1 || e.Sends[0].Msg.Type() != TypeGrant {
				t.Fatalf("the ticketed Bootstrap: %+v", e)
			}
		})
	}
	// The sender's side of the refusal.
	s := boundsSender(t, SenderConfig{Pages: 8, PageTokens: 1})
	if _, err := s.SubmitTicket(1, 2, 1, []byte("forged")); err != nil {
		t.Fatal(err)
	}
	r := boundsReceiver(t, ReceiverConfig{Pages: 4, PageTokens: 1, Authorize: ticketed})
	for _, op := range s.Effects().Ops {
		if b := op.Msg.(*Bootstrap); string(b.Ticket) != "forged" {
			t.Fatalf("the Bootstrap carries %q", b.Ticket)
		}
		if err := r.Step(1, op.Msg, testNow); err != nil {
			t.Fatal(err)
		}
	}
	for _, snd := range r.Effects().Sends {
		if err := s.Step(2, snd.Msg); err != nil {
			t.Fatal(err)
		}
	}
	if e := s.Effects(); len(e.Outcomes) != 1 || !errors.Is(e.Outcomes[0].Err, AbortUnauthorized) || !errors.Is(e.Outcomes[0].Err, ErrPeerFailed) {
		t.Fatalf("the prefill side's outcome: %v", e.Outcomes)
	}
	if _, err := s.SubmitTicket(2, 2, 1, make([]byte, MaxTicket+1)); !errors.Is(err, ErrRejected) {
		t.Fatalf("a ticket over MaxTicket: %v", err)
	}
}

// One peer holds at most PeerRequests open requests and PeerPages pages
// (reserved, verified, quarantined: not yet back in the pool): past either
// a Bootstrap is refused with ErrOverQuota and AbortOverQuota and takes
// nothing, while another peer is still granted; pages a peer's requests
// hold in quarantine count until their fence, and the quota frees when
// they are back. With no quota (0) one peer takes the pool.
func TestOnePeerHoldsNoMoreThanItsQuota(t *testing.T) {
	r := boundsReceiver(t, ReceiverConfig{Pages: 64, PageTokens: 1, PeerRequests: 3, PeerPages: 10})
	now := time.Unix(0, 0)
	boot := func(peer PeerID, id RequestID, tokens uint32) ReceiverEffects {
		t.Helper()
		if err := r.Step(peer, &Bootstrap{Request: id, Tokens: tokens}, now); err != nil {
			t.Fatal(err)
		}
		return r.Effects()
	}
	granted := func(e ReceiverEffects) bool { return len(e.Sends) == 1 && e.Sends[0].Msg.Type() == TypeGrant }
	refused := func(e ReceiverEffects, what string) {
		t.Helper()
		if len(e.Outcomes) != 1 || !errors.Is(e.Outcomes[0].Err, ErrOverQuota) || len(e.Sends) != 1 || e.Sends[0].Msg.(*Abort).Reason != AbortOverQuota {
			t.Fatalf("%s: %+v", what, e)
		}
	}
	if !granted(boot(1, 1, 4)) || !granted(boot(1, 2, 4)) {
		t.Fatal("within the quota")
	}
	refused(boot(1, 3, 3), "8 pages held, 3 more pass 10")
	if !granted(boot(1, 4, 2)) {
		t.Fatal("exactly 10 pages")
	}
	refused(boot(1, 5, 1), "a fourth open request")
	if q, p := r.PeerUse(1); q != 3 || p != 10 {
		t.Fatalf("peer 1 holds %d requests, %d pages", q, p)
	}
	if !granted(boot(2, 6, 10)) {
		t.Fatal("another peer is not bounded by peer 1's use")
	}
	// Cancelled while reserved: the slot comes back at once, the pages at the
	// fence (they may still be written), and the quota with them.
	r.Cancel(1)
	r.Effects()
	if q, p := r.PeerUse(1); q != 2 || p != 10 {
		t.Fatalf("after the cancel, peer 1 holds %d requests, %d pages; want 2 and the quarantined 10", q, p)
	}
	refused(boot(1, 7, 1), "quarantined pages still count")
	r.QueuePairFenced(1)
	r.Effects()
	if q, p := r.PeerUse(1); q != 0 || p != 0 {
		t.Fatalf("after the fence peer 1 holds %d requests, %d pages", q, p)
	}
	if !granted(boot(1, 8, 10)) {
		t.Fatal("after the fence the quota is free")
	}
	// No quota: one peer takes the pool.
	open := boundsReceiver(t, ReceiverConfig{Pages: 64, PageTokens: 1})
	for i := range 64 {
		if err := open.Step(1, &Bootstrap{Request: RequestID(i + 1), Tokens: 1}, now); err != nil {
			t.Fatal(err)
		}
	}
	if open.Pool().Free() != 0 {
		t.Fatalf("without a quota one peer took %d of 64 pages", 64-open.Pool().Free())
	}
}
