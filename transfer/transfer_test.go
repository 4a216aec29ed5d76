package transfer

import (
	"bytes"
	"errors"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/inproc"
	"github.com/kvhandoff/kvhandoff/rdma/socket"
)

const pageBytes = 4096

// providers are the transports every handoff test runs over: each makes a
// prefill device and a decode device. verbs_test.go adds verbs under its tag.
var providers = map[string]func(t *testing.T) (prefill, decode rdma.Device){
	"inproc": func(t *testing.T) (rdma.Device, rdma.Device) {
		f := inproc.NewFabric(t.Name())
		return f.Device("prefill"), f.Device("decode")
	},
	"socket": func(t *testing.T) (rdma.Device, rdma.Device) {
		listen := func() rdma.Device {
			d, err := socket.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { d.Close() })
			return d
		}
		return listen(), listen()
	},
}

// overEachProvider runs test once per provider.
func overEachProvider(t *testing.T, test func(t *testing.T, l *Link, faults rdma.Faults)) {
	overEachProviderWith(t, Config{DecodePages: 64, PrefillPages: 32, PageTokens: pageTokens, PageBytes: pageBytes, Timeout: time.Hour}, test)
}

func overEachProviderWith(t *testing.T, cfg Config, test func(t *testing.T, l *Link, faults rdma.Faults)) {
	for _, name := range slices.Sorted(maps.Keys(providers)) {
		t.Run(name, func(t *testing.T) {
			prefill, decode := providers[name](t)
			l, err := New(cfg, prefill, decode)
			if err != nil {
				t.Fatal(err)
			}
			test(t, l, l.qpP.(rdma.Faults))
		})
	}
}

const pageTokens = 16

// kv is the KV request id's page i must hold: every page of every request differs.
func kv(id protocol.RequestID, i int) []byte {
	page := make([]byte, pageBytes)
	GenerateKV(id, i, pageTokens, page)
	return page
}

func compute(id protocol.RequestID) func(int, []byte) {
	return func(i int, page []byte) { GenerateKV(id, i, pageTokens, page) }
}

// pump runs the link until it settles, and reads every verified request the
// way the engine would: acquire, compare the bytes with what was computed, finish.
func pump(t *testing.T, l *Link) {
	t.Helper()
	for {
		n, err := l.Pump(10 * time.Second)
		if err != nil {
			t.Fatal(err)
		}
		read := len(l.Verified)
		for _, id := range l.Verified {
			refs, err := l.Receiver.Acquire(id)
			if err != nil {
				continue
			}
			for i, ref := range refs {
				if !bytes.Equal(l.DecodePage(ref.Page), kv(id, i)) {
					t.Fatalf("request %d page %d: decode would read foreign KV", id, i)
				}
			}
			l.Receiver.Finish(id)
		}
		l.Verified = nil
		if n == 0 && read == 0 {
			return
		}
	}
}

func TestManyRequestsMoveVerifiedBytesEndToEnd(t *testing.T) { overEachProvider(t, manyRequests) }

func manyRequests(t *testing.T, l *Link, _ rdma.Faults) {
	for id := protocol.RequestID(1); id <= 20; id++ {
		if err := l.Submit(id, int(id)*5, compute(id)); err != nil { // 1 to 7 pages
			t.Fatal(err)
		}
		pump(t, l)
	}
	for id := protocol.RequestID(1); id <= 20; id++ {
		if o := l.Outcomes[id]; !l.Reported(id) || o[0] != nil || o[1] != nil {
			t.Fatalf("request %d: outcomes %v", id, o)
		}
	}
	if l.Receiver.Pool().Free() != 64 || l.Sender.Pool().Free() != 32 {
		t.Fatal("pages leaked")
	}
}

// A request cancelled while its WRITEs are held in the network keeps its pages
// quarantined until the sender's AbortAck, which follows those WRITEs.
func TestCancelledMidTransferIsFenced(t *testing.T) { overEachProvider(t, cancelledMidTransfer) }

func cancelledMidTransfer(t *testing.T, l *Link, qp rdma.Faults) {
	pages, err := l.Sender.Submit(1, decodePeer, 64) // 4 pages; the KV is not computed yet
	if err != nil {
		t.Fatal(err)
	}
	pump(t, l) // Bootstrap, Grant: the sender waits for the KV
	qp.Pause() // WRITEs posted from now on wait in the network
	for i, p := range pages {
		compute(1)(i, l.SourcePage(p))
	}
	l.Sender.Computed(1)
	l.Pump(50 * time.Millisecond)
	l.Receiver.Cancel(1)
	l.Sender.Cancel(1)
	l.Pump(50 * time.Millisecond)
	if l.Receiver.Pool().Quarantined() != 4 {
		t.Fatalf("%d pages quarantined while WRITEs are in flight, want 4", l.Receiver.Pool().Quarantined())
	}
	qp.Resume()
	pump(t, l)
	o := l.Outcomes[1]
	if !errors.Is(o[0], protocol.ErrCancelled) || !errors.Is(o[1], protocol.ErrCancelled) {
		t.Fatalf("outcomes %v", o)
	}
	if l.Receiver.Pool().Free() != 64 || l.Sender.Pool().Free() != 32 {
		t.Fatal("the fence must release every page")
	}
}

func TestCorruptedPayloadFailsByChecksum(t *testing.T) { overEachProvider(t, corruptedPayload) }

func corruptedPayload(t *testing.T, l *Link, qp rdma.Faults) {
	qp.CorruptNext()
	if err := l.Submit(1, 16, compute(1)); err != nil {
		t.Fatal(err)
	}
	pump(t, l)
	if o := l.Outcomes[1]; !errors.Is(o[1], protocol.ErrChecksumMismatch) {
		t.Fatalf("outcomes %v", o)
	}
	if l.Receiver.Pool().Free() != 64 {
		t.Fatal("a failed request must release its pages")
	}
}

func TestCutFencesAndFailsBothLegs(t *testing.T) { overEachProvider(t, cutFences) }

func cutFences(t *testing.T, l *Link, qp rdma.Faults) {
	if err := l.Submit(1, 16, compute(1)); err != nil {
		t.Fatal(err)
	}
	qp.Pause()
	l.Pump(50 * time.Millisecond)
	l.Cut()
	qp.Resume()
	pump(t, l)
	o := l.Outcomes[1]
	if !errors.Is(o[0], protocol.ErrPeerFailed) {
		t.Fatalf("outcomes %v", o)
	}
	if l.Receiver.Pool().Free() != 64 || l.Sender.Pool().Free() != 32 {
		t.Fatal("pages leaked after the cut")
	}
}

// More work than the send queue holds: what the state machines emit waits in
// the link's backlog, in order, and every buffer a work request reads stays
// its own until it completes, so every request still arrives intact.
func TestBackpressureKeepsOrderAndBuffers(t *testing.T) {
	cfg := Config{DecodePages: 64, PrefillPages: 32, PageTokens: pageTokens, PageBytes: pageBytes, Timeout: time.Hour, QueueDepth: 3}
	overEachProviderWith(t, cfg, func(t *testing.T, l *Link, _ rdma.Faults) {
		for id := protocol.RequestID(1); id <= 30; id++ { // 30 requests at once, one page each
			if err := l.Submit(id, 16, compute(id)); err != nil {
				t.Fatal(err)
			}
		}
		pump(t, l)
		for id := protocol.RequestID(1); id <= 30; id++ {
			if o := l.Outcomes[id]; !l.Reported(id) || o[0] != nil || o[1] != nil {
				t.Fatalf("request %d: outcomes %v", id, o)
			}
		}
		if l.Receiver.Pool().Free() != 64 || l.Sender.Pool().Free() != 32 {
			t.Fatal("pages leaked")
		}
	})
	if _, err := New(Config{DecodePages: 1, PrefillPages: 1, PageTokens: 1, PageBytes: 64, QueueDepth: 2}, nil, nil); err == nil {
		t.Fatal("a send queue too small for one page and Done must be refused")
	}
}

// More control messages at once than the peer has receive buffers: a SEND
// waits for a credit (a buffer the peer reposted) instead of finding none,
// which would break the queue pair.
func TestMoreMessagesThanReceiveBuffersWaitForCredits(t *testing.T) {
	cfg := Config{DecodePages: 128, PrefillPages: 128, PageTokens: pageTokens, PageBytes: pageBytes, Timeout: time.Hour}
	overEachProviderWith(t, cfg, func(t *testing.T, l *Link, _ rdma.Faults) {
		const n = 2*recvSlots - 8                        // more than the receive buffers, fewer than the pages
		for id := protocol.RequestID(1); id <= n; id++ { // a Bootstrap each, all at once
			if err := l.Submit(id, 16, compute(id)); err != nil {
				t.Fatal(err)
			}
		}
		pump(t, l)
		for id := protocol.RequestID(1); id <= n; id++ {
			if o := l.Outcomes[id]; !l.Reported(id) || o[0] != nil || o[1] != nil {
				t.Fatalf("request %d: outcomes %v", id, o)
			}
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
	cfg := Config{DecodePages: 320, PrefillPages: 320, PageTokens: pageTokens, PageBytes: pageBytes, Timeout: time.Hour}
	overEachProviderWith(t, cfg, func(t *testing.T, l *Link, _ rdma.Faults) {
		if err := l.Submit(1, 300*pageTokens, compute(1)); err != nil {
			t.Fatal(err)
		}
		if err := l.Submit(2, 5*pageTokens-3, compute(2)); err != nil {
			t.Fatal(err)
		}
		pump(t, l) // reads every verified request and compares it with what was computed
		for id := protocol.RequestID(1); id <= 2; id++ {
			if o := l.Outcomes[id]; !l.Reported(id) || o[0] != nil || o[1] != nil {
				t.Fatalf("request %d: outcomes %v", id, o)
			}
		}
		if l.Receiver.Pool().Free() != 320 || l.Sender.Pool().Free() != 320 {
			t.Fatal("pages leaked")
		}
	})
}

// A request larger than the message buffers can carry the Grant of is refused
// at intake with an explicit error, and the link goes on.
func TestRequestBeyondTheLargestGrantIsRefusedAtIntake(t *testing.T) {
	cfg := Config{DecodePages: 64, PrefillPages: 64, PageTokens: pageTokens, PageBytes: pageBytes, Timeout: time.Hour, MaxRequestPages: 40}
	overEachProviderWith(t, cfg, func(t *testing.T, l *Link, _ rdma.Faults) {
		err := l.Submit(1, 40*pageTokens+1, compute(1))
		if !errors.Is(err, protocol.ErrRejected) || !errors.Is(err, protocol.ErrTooLong) {
			t.Fatalf("a 41-page request: %v, want ErrRejected and ErrTooLong", err)
		}
		if err := l.Submit(2, 40*pageTokens, compute(2)); err != nil {
			t.Fatal(err)
		}
		pump(t, l)
		if o := l.Outcomes[2]; !l.Reported(2) || o[0] != nil || o[1] != nil {
			t.Fatalf("request 2: outcomes %v", o)
		}
	})
	if _, err := New(Config{DecodePages: 1, PrefillPages: 1, PageTokens: 1, PageBytes: 64, MaxRequestPages: protocol.MaxGrantPages + 1}, nil, nil); err == nil {
		t.Fatal("a largest request beyond the wire's MaxGrantPages must be refused")
	}
}

// MaxFrame follows the wire: a Grant of n pages encodes to exactly MaxFrame(n)
// bytes, and no other message is larger.
func TestMaxFrameIsTheLargestGrant(t *testing.T) {
	for _, n := range []int{1, 20, 21, 300, protocol.MaxGrantPages} {
		frame, err := protocol.AppendMessage(nil, &protocol.Grant{Request: 9, Tokens: 1, Pages: make([]protocol.PageGrant, n)})
		if err != nil {
			t.Fatal(err)
		}
		if MaxFrame(n) != len(frame) {
			t.Fatalf("MaxFrame(%d) = %d, a Grant of %d pages is %d bytes", n, MaxFrame(n), n, len(frame))
		}
	}
	if MaxFrame(protocol.MaxGrantPages+5) != MaxFrame(protocol.MaxGrantPages) {
		t.Fatal("no frame exceeds the wire's page limit")
	}
}
