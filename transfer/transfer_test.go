package transfer

import (
	"errors"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/protocol"
)

func TestManyRequestsMoveVerifiedBytesEndToEnd(t *testing.T) {
	overEachProvider(t, defaultLink(), func(t *testing.T, l *link) {
		for id := protocol.RequestID(1); id <= 20; id++ {
			if err := l.submit(id, int(id)*5); err != nil { // 1 to 7 pages
				t.Fatal(err)
			}
			l.pump()
		}
		for id := protocol.RequestID(1); id <= 20; id++ {
			if !l.succeeded(id) {
				t.Fatalf("request %d: outcomes %v", id, l.outcomes[id])
			}
		}
		l.noLeak(t, 64, 32)
	})
}

// A request cancelled while its WRITEs are held in the network keeps its pages
// quarantined until the sender's AbortAck, which follows those WRITEs.
func TestCancelledMidTransferIsFenced(t *testing.T) {
	overEachProvider(t, defaultLink(), func(t *testing.T, l *link) {
		if err := l.submit(1, 64); err != nil { // 4 pages
			t.Fatal(err)
		}
		l.P.Poll(l.now) // Bootstrap posted
		for l.D.Status(1) != protocol.ReceiverReserved {
			l.step(time.Millisecond)
			if l.P.Status(1) != protocol.SenderAwaitGrant {
				t.Fatalf("the prefill side moved on before the test held its WRITEs: %s", l.P.Status(1))
			}
		}
		qp := l.faults()
		qp.Pause() // the Grant is on its way; the WRITEs it starts wait in the network
		for l.P.Status(1) == protocol.SenderAwaitGrant {
			l.step(time.Millisecond)
		}
		l.D.Cancel(1)
		l.P.Cancel(1)
		l.settleFor(50 * time.Millisecond)
		if q := l.D.receiver.Pool().Quarantined(); q != 4 {
			t.Fatalf("%d pages quarantined while WRITEs are in flight, want 4", q)
		}
		qp.Resume()
		l.pump()
		if o := l.outcomes[1]; !errors.Is(o[0], protocol.ErrCancelled) || !errors.Is(o[1], protocol.ErrCancelled) {
			t.Fatalf("outcomes %v", o)
		}
		l.noLeak(t, 64, 32)
	})
}

func TestCorruptedPayloadFailsByChecksum(t *testing.T) {
	overEachProvider(t, defaultLink(), func(t *testing.T, l *link) {
		l.faults().CorruptNext()
		if err := l.submit(1, 16); err != nil {
			t.Fatal(err)
		}
		l.pump()
		if o := l.outcomes[1]; !errors.Is(o[1], protocol.ErrChecksumMismatch) {
			t.Fatalf("outcomes %v", o)
		}
		l.noLeak(t, 64, 32)
	})
}

// A cut on both ends, with WRITEs held in the network: both legs fail, and
// every page comes back once the flushes drain.
func TestCutFencesAndFailsBothLegs(t *testing.T) {
	overEachProvider(t, defaultLink(), func(t *testing.T, l *link) {
		if err := l.submit(1, 16); err != nil {
			t.Fatal(err)
		}
		for l.D.Status(1) != protocol.ReceiverReserved {
			l.step(time.Millisecond)
		}
		qp := l.faults()
		qp.Pause() // the WRITEs the Grant starts wait in the network
		l.settleFor(20 * time.Millisecond)
		if err := l.D.Cut("prefill"); err != nil {
			t.Fatal(err)
		}
		if err := l.P.Cut("decode"); err != nil {
			t.Fatal(err)
		}
		qp.Resume()
		l.pump()
		if o := l.outcomes[1]; !errors.Is(o[0], protocol.ErrPeerFailed) || !errors.Is(o[1], protocol.ErrPeerFailed) {
			t.Fatalf("outcomes %v", o)
		}
		l.noLeak(t, 64, 32)
		if err := l.submit(2, 16); !errors.Is(err, ErrNoPeer) {
			t.Fatalf("a request after the cut: %v, want ErrNoPeer", err)
		}
	})
}

// More work than the send queue holds: what the state machines emit waits in
// the backlog, in order, and every buffer a work request reads stays its own
// until it completes, so every request still arrives intact.
func TestBackpressureKeepsOrderAndBuffers(t *testing.T) {
	cfg := defaultLink()
	cfg.QueueDepth = 3
	overEachProvider(t, cfg, func(t *testing.T, l *link) {
		for id := protocol.RequestID(1); id <= 30; id++ { // 30 requests at once, one page each
			if err := l.submit(id, 16); err != nil {
				t.Fatal(err)
			}
		}
		l.pump()
		for id := protocol.RequestID(1); id <= 30; id++ {
			if !l.succeeded(id) {
				t.Fatalf("request %d: outcomes %v", id, l.outcomes[id])
			}
		}
		l.noLeak(t, 64, 32)
	})
	dev, _ := providers["inproc"](t)
	if _, err := NewPrefill(dev, PrefillConfig{Pages: 1, PageTokens: 1, PageBytes: 64, QueueDepth: 2}); err == nil {
		t.Fatal("a send queue too small for one page and Done must be refused")
	}
}

// More control messages at once than the peer has receive buffers, several
// times over: a SEND goes out only against a credit the peer advertised, so
// none finds the peer without a buffer (which breaks the queue pair).
func TestBurstBeyondTheReceiveQueueWaitsForCredits(t *testing.T) {
	cfg := linkConfig{DecodePages: 512, PrefillPages: 512, Timeout: time.Hour}
	overEachProvider(t, cfg, func(t *testing.T, l *link) {
		const n = 4 * RecvSlots                          // Bootstraps, then Grants, then Dones: each a burst
		for id := protocol.RequestID(1); id <= n; id++ { // all at once, before either side polls
			if err := l.submit(id, 16); err != nil {
				t.Fatal(err)
			}
		}
		l.pump()
		for id := protocol.RequestID(1); id <= n; id++ {
			if !l.succeeded(id) {
				t.Fatalf("request %d: outcomes %v", id, l.outcomes[id])
			}
		}
		l.noLeak(t, 512, 512)
		if len(l.P.Peers()) != 1 || len(l.D.Peers()) != 1 {
			t.Fatal("the burst broke the queue pair")
		}
	})
}

// A request of hundreds of pages gets a Grant far larger than a small fixed
// message buffer (a 512-byte buffer held 20 pages' grant, and the 21st page
// wedged the link for good: the Grant stayed at the head of the backlog and
// every later request waited behind it). Message buffers are sized for the
// largest request's Grant, so a 300-page request and the one after it both
// arrive, byte for byte.
func TestRequestOfHundredsOfPagesAndTheNextOneComplete(t *testing.T) {
	cfg := linkConfig{DecodePages: 320, PrefillPages: 320, Timeout: time.Hour}
	overEachProvider(t, cfg, func(t *testing.T, l *link) {
		if err := l.submit(1, 300*pageTokens); err != nil {
			t.Fatal(err)
		}
		if err := l.submit(2, 5*pageTokens-3); err != nil {
			t.Fatal(err)
		}
		l.pump() // reads every verified request and compares it with what was computed
		for id := protocol.RequestID(1); id <= 2; id++ {
			if !l.succeeded(id) {
				t.Fatalf("request %d: outcomes %v", id, l.outcomes[id])
			}
		}
		l.noLeak(t, 320, 320)
	})
}

// A request larger than the message buffers can carry the Grant of is refused
// at intake with an explicit error, and the link goes on.
func TestRequestBeyondTheLargestGrantIsRefusedAtIntake(t *testing.T) {
	cfg := linkConfig{DecodePages: 64, PrefillPages: 64, MaxRequestPages: 40, Timeout: time.Hour}
	overEachProvider(t, cfg, func(t *testing.T, l *link) {
		err := l.submit(1, 40*pageTokens+1)
		if !errors.Is(err, protocol.ErrRejected) || !errors.Is(err, protocol.ErrTooLong) {
			t.Fatalf("a 41-page request: %v, want ErrRejected and ErrTooLong", err)
		}
		if err := l.submit(2, 40*pageTokens); err != nil {
			t.Fatal(err)
		}
		l.pump()
		if !l.succeeded(2) {
			t.Fatalf("request 2: outcomes %v", l.outcomes[2])
		}
	})
	dev, _ := providers["inproc"](t)
	if _, err := NewPrefill(dev, PrefillConfig{Pages: 1, PageTokens: 1, PageBytes: 64, MaxRequestPages: 2}); err == nil {
		t.Fatal("a largest request beyond the pool must be refused")
	}
}

// MaxFrame follows the wire: a Grant of n pages, or a Bootstrap with a
// chain of n pages and the largest ticket, whichever is larger, encodes to
// exactly MaxFrame(n) bytes, and no other message is larger.
func TestMaxFrameIsTheLargestGrant(t *testing.T) {
	for _, n := range []int{1, 20, 21, 300, protocol.MaxGrantPages} {
		boot, err := protocol.AppendMessage(nil, &protocol.Bootstrap{Request: 9, Tokens: uint32(n), Scope: 1, Chain: make([]protocol.ChainHash, n), Ticket: make([]byte, protocol.MaxTicket)})
		if err != nil {
			t.Fatal(err)
		}
		frame, err := protocol.AppendMessage(nil, &protocol.Grant{Request: 9, Tokens: 1, Pages: make([]protocol.PageGrant, n)})
		if err != nil {
			t.Fatal(err)
		}
		if want := max(len(frame), len(boot)); MaxFrame(n) != want {
			t.Fatalf("MaxFrame(%d) = %d, a Grant of %d pages is %d bytes, a ticketed Bootstrap %d", n, MaxFrame(n), n, len(frame), len(boot))
		}
	}
	if MaxFrame(protocol.MaxGrantPages+5) != MaxFrame(protocol.MaxGrantPages) {
		t.Fatal("no frame exceeds the wire's page limit")
	}
}
