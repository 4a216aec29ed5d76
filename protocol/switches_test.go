package protocol_test

import (
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// Each implementation switch, staged the way the spec's defense matrix exposes
// it, breaks the property the catalogue predicts; the same staging with every
// defense on ends clean. This is the implementation's side of "prove the
// checker can fail".
func TestEachSwitchBreaksAProperty(t *testing.T) {
	type staging struct {
		name        string
		bugs        []research.Switch
		decodePages int
		stage       func(l *link)
		want        string // the property the violation names
	}
	cases := []staging{
		{"eager-release", []research.Switch{research.EagerRelease}, 1, func(l *link) {
			l.submit(1, 4)
			l.deliverOne()    // Bootstrap 1
			l.submit(2, 4)    // Bootstrap 2 ahead of request 1's WRITE
			l.backOne()       // Grant 1
			l.cancelDecode(1) // the router's cancel reaches decode; the sender has not heard yet
			l.run()
		}, "NoForeignWrite"},
		{"timeout-free", []research.Switch{research.TimeoutFree}, 1, func(l *link) {
			l.submit(1, 4)
			l.deliverOne()
			l.submit(2, 4)
			l.backOne()
			l.r.Tick(l.n.Now.Add(time.Hour))
			l.n.Settle()
			l.deliverOne() // Bootstrap 2 before the Abort reaches the sender
			l.run()
		}, "NoForeignWrite"},
		{"no-checksum", []research.Switch{research.NoChecksum}, 2, func(l *link) {
			l.submit(1, 4)
			l.deliverOne()
			l.backOne()
			l.deliverOne() // WRITE placed
			l.dst.Payload(0)[3] ^= 0xFF
			l.run()
		}, "Isolation"},
		{"abort-still-sends+no-tag-check", []research.Switch{research.AbortStillSends, research.NoTagCheck}, 4, func(l *link) {
			l.submit(1, 12) // 3 pages; at most 2 WRITEs in flight
			l.deliverOne()
			l.backOne()   // WRITEs 0 and 1 posted, 2 waits for a completion
			l.s.Cancel(1) // stops writing, but sends Done for all 3 pages
			l.n.Settle()
			l.run()
		}, "Isolation"},
		{"admit-finished+no-token-check+no-tag-check", []research.Switch{research.AdmitFinished, research.NoTokenCheck, research.NoTagCheck}, 16, func(l *link) {
			// Over the prefill pool of 32 tokens, within decode's 64. With every
			// defense on, intake rejects it and nothing else happens.
			if l.trySubmit(1, 40) == nil {
				l.run()
			}
		}, "Isolation"},
		{"prefill-early-free+no-checksum", []research.Switch{research.PrefillEarlyFree, research.NoChecksum}, 4, func(l *link) {
			l.submit(1, 4)
			l.deliverOne()
			l.backOne()    // WRITE 1 and Done posted; the source page is freed early
			l.submit(2, 4) // reuses it: the KV of request 2 overwrites it
			l.run()        // WRITE 1 ships request 2's KV
		}, "Isolation"},
		{"leak-on-cancel", []research.Switch{research.LeakOnCancel}, 2, func(l *link) {
			l.submit(1, 4)
			l.deliverOne()
			l.cancel(1)
			l.run()
			if l.r.Pool().Free() != l.r.Pool().Len() {
				l.violate("NoLeak: %d of %d decode pages never came back", l.r.Pool().Len()-l.r.Pool().Free(), l.r.Pool().Len())
			}
		}, "NoLeak"},
		{"no-peer-cancel", []research.Switch{research.NoPeerCancel}, 2, func(l *link) {
			l.submit(1, 4)
			l.deliverOne() // reserved; the prefill node then dies
			l.r.PeerFailed(prefill)
			l.n.Settle()
			if _, ok := l.rOut[1]; !ok {
				l.violate("Termination: request 1 waits on decode for a Done that cannot come")
			}
		}, "Termination"},
		{"double-free", []research.Switch{research.DoubleFree}, 1, func(l *link) {
			l.submit(1, 4)
			l.deliverOne()
			l.backOne()
			l.deliverOne() // WRITE
			l.deliverOne() // Done: verified
			l.read(1)      // released
			l.submit(2, 4)
			l.deliverOne() // request 2 gets the same page
			l.s.Cancel(1)  // the finished sender acks the abort ...
			l.n.Settle()
			l.deliverOne() // ... and the AbortAck frees request 2's page
			if err := l.r.Pool().Check(2, protocol.PageRef{Page: 0, Epoch: 2}); err != nil {
				l.violate("Conservation: request 2 lost its page: %v", err)
			}
		}, "Conservation"},
		{"abort-frees-source+no-checksum", []research.Switch{research.AbortFreesSource, research.NoChecksum}, 4, func(l *link) {
			l.submit(1, 4)
			l.deliverOne()
			l.backOne()    // WRITE 1 and Done posted, the WRITE not yet executed
			l.s.Cancel(1)  // the producer gives up: with the bug its source page goes back now
			l.submit(2, 4) // reuses it: the KV of request 2 overwrites it
			l.deliverOne() // WRITE 1 ships request 2's KV
			l.deliverOne() // Done: verified without a checksum
			l.deliverOne() // Bootstrap 2
			l.read(1)      // decode attends over request 2's KV as request 1's
			l.n.Settle()
		}, "Isolation"},
		{"checksum-hangs", []research.Switch{research.ChecksumHangs}, 2, func(l *link) {
			l.submit(1, 4)
			l.deliverOne()
			l.backOne()
			l.n.CorruptNext(l.qp) // the WRITE is damaged in transit
			l.run()               // the mismatch at Done fails nothing
			l.n.Quiescent()       // nothing is left to happen, and request 1 has no outcome
		}, "Termination"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			bad := newLink(t, c.decodePages, c.bugs...)
			c.stage(bad)
			if len(bad.violations()) == 0 || !strings.HasPrefix(bad.violations()[0], c.want) {
				t.Fatalf("with %v: violations %v, want %s", c.bugs, bad.violations(), c.want)
			}
			good := newLink(t, c.decodePages)
			c.stage(good)
			good.run()
			if len(good.violations()) != 0 {
				t.Fatalf("with every defense on: %v", good.violations())
			}
		})
	}
}
