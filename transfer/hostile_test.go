package transfer

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma"
)

// rawSend posts a SEND of payload with immediate imm on prefill p's queue
// pair to peer, bypassing the endpoint: what a broken or hostile prefill
// node could put on the wire.
func rawSend(t *testing.T, p *Prefill, peer string, payload []byte, imm uint32) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	c := p.names[peer]
	copy(c.bufs.out.Bytes(), payload)
	if err := c.postSend(rdma.WorkRequest{Op: rdma.OpSend, Local: rdma.SGE{MR: c.bufs.out, Length: len(payload)}, Imm: imm, HasImm: true},
		wrKind{tag: -1, msg: -1}); err != nil {
		t.Fatal(err)
	}
	c.credits-- // it took one of the peer's buffers
}

// A prefill node that breaks the queue pair's own protocol (a frame that does
// not decode, bytes after a frame, credits it was never owed) loses its queue pair; the decode node
// keeps serving its other prefill peer.
func TestAPeerThatBreaksTheQueuePairLosesOnlyItsOwn(t *testing.T) {
	frame, err := protocol.AppendMessage(nil, &protocol.AbortAck{Request: 7})
	if err != nil {
		t.Fatal(err)
	}
	for name, attack := range map[string]struct {
		payload []byte
		imm     uint32
	}{
		"garbage frame":         {[]byte("\x01\x09garbage, not a frame"), 0},
		"frame of unknown type": {append([]byte{protocol.Version, 99}, frame[2:]...), 0},
		"credits never owed":    {frame, RecvSlots + 1},
		"bytes after a frame":   {append(append([]byte{}, frame...), "junk"...), 0},
	} {
		t.Run(name, func(t *testing.T) {
			for _, provider := range providerNames() {
				t.Run(provider, func(t *testing.T) {
					devs := devices(t, provider, "prefill-1", "prefill-2", "decode")
					d := newDecode(t, devs[2])
					good, bad := newPrefill(t, devs[0]), newPrefill(t, devs[1])
					for name, p := range map[string]*Prefill{"prefill-1": good, "prefill-2": bad} {
						if err := ConnectLocal(p, name, d, "decode"); err != nil {
							t.Fatal(err)
						}
					}
					rawSend(t, bad, "decode", attack.payload, attack.imm)
					if err := good.Submit(1, "decode", 100); err != nil {
						t.Fatal(err)
					}
					var verified bool
					now := time.Unix(1, 0)
					eventually(t, "decode cuts prefill-2 and serves prefill-1", func() bool {
						now = now.Add(time.Millisecond)
						good.Poll(now)
						bad.Poll(now)
						d.Poll(now)
						for _, ev := range d.Events() {
							if ev.Kind == Verified && ev.Request == 1 {
								pages, err := d.Acquire(1)
								verified = err == nil && len(pages) == 7
								d.Finish(1)
							}
						}
						peers := d.Peers()
						return verified && len(peers) == 1 && peers[0] == "prefill-1"
					})
				})
			}
		})
	}
}

// A Bootstrap whose Grant would not fit the prefill peer's receive buffers is
// refused by the decode node before its Receiver keeps anything for it, with
// an explicit Abort to the peer.
func TestBootstrapBeyondThePeersBuffersIsRefusedWithoutARecord(t *testing.T) {
	devs := devices(t, "inproc", "prefill", "decode")
	p, err := NewPrefill(devs[0], PrefillConfig{Pages: 64, PageTokens: pageTokens, PageBytes: pageBytes, MaxRequestPages: 4})
	if err != nil {
		t.Fatal(err)
	}
	d := newDecode(t, devs[1]) // takes requests of up to 256 pages
	if err := ConnectLocal(p, "prefill", d, "decode"); err != nil {
		t.Fatal(err)
	}
	b, err := protocol.AppendMessage(nil, &protocol.Bootstrap{Request: 9, Tokens: 5 * pageTokens}) // 5 pages: its Grant would not fit
	if err != nil {
		t.Fatal(err)
	}
	rawSend(t, p, "decode", b, 0)
	now := time.Unix(1, 0)
	eventually(t, "the Abort comes back to the prefill node", func() bool {
		now = now.Add(time.Millisecond)
		p.Poll(now)
		d.Poll(now)
		return p.Refused() == 1 // an Abort for a request it never submitted
	})
	d.mu.Lock()
	records := d.receiver.Records()
	d.mu.Unlock()
	if records != 0 || d.Refused() != 1 || d.Stats().PagesFree != 256 || len(d.Peers()) != 1 {
		t.Fatalf("decode: %d records, %d refused, %d pages free, peers %v", records, d.Refused(), d.Stats().PagesFree, d.Peers())
	}
	// The refusal is the decode node's own check, not the Receiver's intake.
	d.mu.Lock()
	c := d.names["prefill"]
	err = d.message(c, &protocol.Bootstrap{Request: 10, Tokens: 5 * pageTokens})
	d.mu.Unlock()
	if !errors.Is(err, protocol.ErrRejected) || !errors.Is(err, protocol.ErrTooLong) {
		t.Fatalf("a 5-page Bootstrap from a peer that takes 4: %v", err)
	}
}

// Tag records are MACed under the queue pair's key: a writer without it (here
// a prefill endpoint whose key for the queue pair differs from decode's, as
// a stranger's WRITE would be) fails verification with ErrTagMismatch, and
// the decode node reads nothing.
func TestTagRecordsUnderAnotherKeyFailVerification(t *testing.T) {
	overEachProvider(t, defaultLink(), func(t *testing.T, l *link) {
		stranger, err := protocol.NewTagKey(bytes.Repeat([]byte{0x5A}, protocol.TagKeySecretSize), protocol.SumXXH3)
		if err != nil {
			t.Fatal(err)
		}
		l.P.mu.Lock()
		l.P.names["decode"].tagKey = stranger
		l.P.mu.Unlock()
		if err := l.submit(1, 40); err != nil {
			t.Fatal(err)
		}
		l.pump()                                                           // a Verified event would be read and compared: there must be none
		if o := l.outcomes[1]; !errors.Is(o[1], protocol.ErrTagMismatch) { // the prefill leg ends on its own completions
			t.Fatalf("outcomes %v, want ErrTagMismatch on decode", o)
		}
		l.noLeak(t, 64, 32)
	})
}
