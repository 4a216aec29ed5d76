package protocol_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/protocol/protocoltest"
)

// The two nodes of a link: prefill and decode name the queue pair to each at
// the other end (the harness names it by the peer node's id), prefillNode and
// decodeNode the nodes at the router.
const (
	prefill = protocol.PeerID(prefillNode)
	// pageTokens is the tokens per page of both nodes (protocoltest's default).
	pageTokens  = 4
	decode      = protocol.PeerID(decodeNode)
	prefillNode = protocol.NodeID(1)   // protocoltest.PrefillID(0)
	decodeNode  = protocol.NodeID(101) // protocoltest.DecodeID(0)
)

// link is one prefill node (8 pages of 4 tokens) and one decode node, with
// the router in front, on the shared harness (protocoltest.Network): the
// test decides when each WRITE and message lands, so every race can be
// staged, and the network checks the spec's properties as it goes. Both
// nodes advertise as many pages as a grant can carry, so the router lets
// every prompt through and each node's own intake is what these tests test.
type link struct {
	t          *testing.T
	n          *protocoltest.Network
	s          *protocol.Sender
	r          *protocol.Receiver
	qp         *protocoltest.QueuePair
	dst        *protocoltest.Memory
	sOut, rOut map[protocol.RequestID]error // each node's outcomes
	extra      []string                     // violations a test found itself
}

func newLink(t *testing.T, decodePages int, bugs ...research.Switch) *link {
	t.Helper()
	return newLinkWith(t, decodePages, 0, bugs...)
}

// newLinkWith is newLink with a Horizon for ended records on both nodes.
func newLinkWith(t *testing.T, decodePages int, horizon time.Duration, bugs ...research.Switch) *link {
	t.Helper()
	n, err := protocoltest.New(protocoltest.Config{Research: research.On(bugs...), Start: time.Unix(1000, 0),
		Prefill: []protocoltest.NodeConfig{{Pages: 8, PageBytes: 256, Advertise: protocol.MaxGrantPages, Horizon: horizon}},
		Decode: []protocoltest.NodeConfig{{Pages: decodePages, PageBytes: 256, Advertise: protocol.MaxGrantPages,
			Timeout: time.Second, Horizon: horizon}}})
	if err != nil {
		t.Fatal(err)
	}
	n.ComputeAtIntake = true
	l := &link{t: t, n: n, s: n.Prefill[0].Sender, r: n.Decode[0].Receiver, qp: n.QPs[0], dst: n.Decode[0].Mem,
		sOut: map[protocol.RequestID]error{}, rOut: map[protocol.RequestID]error{}}
	n.OnOutcome = func(node protocol.NodeID, o protocol.Outcome) {
		out := l.sOut
		if node == decodeNode {
			out = l.rOut
		}
		if _, dup := out[o.Request]; dup {
			t.Errorf("node %d reported request %d twice", node, o.Request)
		}
		out[o.Request] = o.Err
	}
	return l
}

// submit sends a request through the router; the prefill node takes it and
// computes its KV (a recognisable pattern per page) at once.
func (l *link) submit(id protocol.RequestID, tokens int) {
	l.t.Helper()
	if err := l.trySubmit(id, tokens); err != nil {
		l.t.Fatalf("submit %d: %v", id, err)
	}
}

// trySubmit is submit for a request that an intake may refuse: it returns
// the refusal.
func (l *link) trySubmit(id protocol.RequestID, tokens int) error {
	l.t.Helper()
	if err := l.n.Submit(id, tokens); err != nil {
		return err
	}
	for len(l.n.Prefill[0].Inbox) > 0 {
		l.n.DeliverRouter(prefillNode)
	}
	if q := l.n.Request(id); q.Src == nil {
		return q.Outcome // the prefill node's intake refused it
	}
	return nil
}

// deliverOne places or delivers the head of the prefill→decode direction.
func (l *link) deliverOne() protocol.Op {
	l.t.Helper()
	if len(l.qp.Fwd) == 0 {
		l.t.Fatal("nothing to deliver")
	}
	return l.n.Deliver(l.qp)
}

// backOne delivers the head of the decode→prefill direction.
func (l *link) backOne() {
	l.t.Helper()
	if len(l.qp.Back) == 0 {
		l.t.Fatal("nothing to deliver back")
	}
	l.n.DeliverBack(l.qp)
}

// run delivers everything and reads every verified request.
func (l *link) run() { l.n.Run() }

// read is the decoder: acquire, check the bytes are the request's own, finish.
func (l *link) read(id protocol.RequestID) { l.n.Read(id) }

// cancel is the client going away: the router's cancels reach decode, then
// prefill.
func (l *link) cancel(id protocol.RequestID) {
	l.n.Cancel(id)
	for len(l.n.Decode[0].Inbox) > 0 {
		l.n.DeliverRouter(decodeNode)
	}
	for len(l.n.Prefill[0].Inbox) > 0 {
		l.n.DeliverRouter(prefillNode)
	}
}

// cancelDecode is the client going away with only the router's cancel to
// decode arrived; the one to prefill is still on its way (run delivers it).
func (l *link) cancelDecode(id protocol.RequestID) {
	l.n.Cancel(id)
	for len(l.n.Decode[0].Inbox) > 0 {
		l.n.DeliverRouter(decodeNode)
	}
}

func (l *link) violate(format string, a ...any) { l.extra = append(l.extra, fmt.Sprintf(format, a...)) }

// violations are the properties the network saw broken ("Property: detail"),
// then those the test found itself.
func (l *link) violations() []string {
	var out []string
	for _, v := range l.n.Violations {
		out = append(out, v.Property+": "+v.Detail)
	}
	return append(out, l.extra...)
}

func (l *link) assertAllFree() {
	l.t.Helper()
	if v := l.violations(); len(v) > 0 {
		l.t.Fatalf("violations: %v", v)
	}
	if l.r.Pool().Free() != l.r.Pool().Len() || l.s.Pool().Free() != l.s.Pool().Len() {
		l.t.Fatalf("leak: decode %d/%d free, prefill %d/%d free", l.r.Pool().Free(), l.r.Pool().Len(), l.s.Pool().Free(), l.s.Pool().Len())
	}
}

func TestHandoffDeliversVerifiedBytes(t *testing.T) {
	l := newLink(t, 8)
	l.submit(1, 10) // 3 pages, the last one partial
	l.submit(2, 4)
	l.submit(3, 7)
	l.run()
	for id := protocol.RequestID(1); id <= 3; id++ {
		if err, ok := l.rOut[id]; !ok || err != nil {
			t.Fatalf("request %d: receiver outcome %v (reported %v)", id, err, ok)
		}
		if err := l.sOut[id]; err != nil {
			t.Fatalf("request %d: sender outcome %v", id, err)
		}
	}
	l.assertAllFree()
}

func TestRejectedAtIntakeIsNeverBootstrapped(t *testing.T) {
	l := newLink(t, 8)
	_, err := l.s.Submit(1, decode, 8*pageTokens+1)
	if !errors.Is(err, protocol.ErrRejected) || !errors.Is(err, protocol.ErrTooLong) {
		t.Fatalf("got %v", err)
	}
	l.n.Settle()
	if len(l.qp.Fwd) != 0 || l.s.Pool().Free() != 8 {
		t.Fatal("a rejected request must send nothing and hold nothing")
	}
}

func TestReceiverRejectsWhatItsPoolCannotHoldAndStopsTheSender(t *testing.T) {
	l := newLink(t, 2)
	l.submit(1, 3*pageTokens) // fits the prefill pool, not decode's
	l.run()
	if err := l.rOut[1]; !errors.Is(err, protocol.ErrRejected) || !errors.Is(err, protocol.ErrTooLong) {
		t.Fatalf("receiver: %v", err)
	}
	if err := l.sOut[1]; !errors.Is(err, protocol.ErrPeerFailed) {
		t.Fatalf("sender must be stopped by the receiver's Abort: %v", err)
	}
	l.assertAllFree()
}

// Abort during WRITE: the receiver keeps the pages quarantined until the
// sender's AbortAck, which comes only after every posted WRITE completed.
func TestCancelDuringWritesQuarantinesUntilAbortAck(t *testing.T) {
	l := newLink(t, 4)
	l.submit(1, 8)
	l.deliverOne() // Bootstrap
	l.backOne()    // Grant: two WRITEs and Done are now on the wire
	l.cancel(1)
	if got := l.r.Pool().Quarantined(); got != 2 {
		t.Fatalf("%d pages quarantined, want 2", got)
	}
	l.deliverOne() // a WRITE lands: in the request's own quarantined page, harmlessly
	if l.r.Pool().Quarantined() != 2 {
		t.Fatal("pages must stay quarantined while a WRITE is in flight")
	}
	l.run() // the second WRITE, Done (a fence), then AbortAck (a second fence: no effect)
	if !errors.Is(l.rOut[1], protocol.ErrCancelled) || !errors.Is(l.sOut[1], protocol.ErrCancelled) {
		t.Fatalf("outcomes: receiver %v, sender %v", l.rOut[1], l.sOut[1])
	}
	l.assertAllFree()
}

// Timeout then late placement: the next request's Bootstrap is ahead of the
// timed-out request's WRITE on the queue pair, so the next request is reserved
// before that WRITE lands. The WRITE must land in its own quarantined page.
func TestTimeoutThenLatePlacementLandsOnlyInQuarantine(t *testing.T) {
	l := newLink(t, 2)
	l.submit(1, 4)
	l.deliverOne() // Bootstrap 1
	l.submit(2, 4) // Bootstrap 2 is now ahead of anything request 1 will post
	l.backOne()    // Grant 1: WRITE 1 and Done 1 queue behind Bootstrap 2
	l.r.Tick(l.n.Now.Add(2 * time.Second))
	l.n.Settle()
	if !errors.Is(l.rOut[1], protocol.ErrTimedOut) {
		t.Fatalf("got %v", l.rOut[1])
	}
	l.deliverOne() // Bootstrap 2: reserved while WRITE 1 is still in flight
	l.run()        // WRITE 1 lands (checked by the link), Done 1 fences 1, request 2 completes
	if err, ok := l.rOut[2]; !ok || err != nil {
		t.Fatalf("request 2: %v (reported %v)", err, ok)
	}
	l.assertAllFree()
}

// Expire times out one reserved request, whatever its deadline, and leaves
// the others alone; a request not waiting for Done cannot time out.
func TestExpireTimesOutOnlyThatRequest(t *testing.T) {
	l := newLink(t, 4)
	l.submit(1, 4)
	l.submit(2, 4)
	l.deliverOne() // Bootstrap 1
	l.deliverOne() // Bootstrap 2: both reserved
	if err := l.r.Expire(2); err != nil {
		t.Fatal(err)
	}
	l.n.Settle()
	if !errors.Is(l.rOut[2], protocol.ErrTimedOut) || l.r.Status(1) != protocol.ReceiverReserved || l.r.Status(2) != protocol.ReceiverQuarantine {
		t.Fatalf("r1 %s, r2 %s %v", l.r.Status(1), l.r.Status(2), l.rOut[2])
	}
	if err := l.r.Expire(2); !errors.Is(err, protocol.ErrNotReady) {
		t.Fatalf("expire twice: %v", err)
	}
	if err := l.r.Expire(9); !errors.Is(err, protocol.ErrUnknownRequest) {
		t.Fatalf("expire an unknown request: %v", err)
	}
	l.run() // r1 completes; r2's sender learns and its AbortAck fences the quarantine
	if err, ok := l.rOut[1]; !ok || err != nil {
		t.Fatalf("request 1: %v (reported %v)", err, ok)
	}
	l.assertAllFree()
}

func TestLateDoneAfterAbortIsOnlyAFence(t *testing.T) {
	l := newLink(t, 2)
	l.submit(1, 4)
	l.deliverOne() // Bootstrap
	l.backOne()    // Grant
	l.cancelDecode(1)
	l.deliverOne() // WRITE
	l.deliverOne() // Done: request 1 is cancelled, so Done only fences it
	if len(l.n.Decode[0].Verified) != 0 || l.r.Pool().Free() != 2 {
		t.Fatal("a Done after an abort must release, never verify")
	}
	l.run()
	l.assertAllFree()
}

func TestDuplicateDoneIsRefused(t *testing.T) {
	l := newLink(t, 2)
	l.submit(1, 4)
	l.deliverOne()
	l.backOne()
	l.deliverOne() // WRITE
	done := l.deliverOne()
	if err := l.r.Step(prefill, done.Msg, l.n.Now); !errors.Is(err, protocol.ErrDuplicate) {
		t.Fatalf("second Done: %v", err)
	}
}

func TestGrantForUnknownRequestIsAnsweredWithAbortAck(t *testing.T) {
	l := newLink(t, 2)
	err := l.s.Step(decode, &protocol.Grant{Request: 99, Tokens: 4, Pages: []protocol.PageGrant{{Page: 0, Epoch: 1}}})
	l.n.Settle()
	if !errors.Is(err, protocol.ErrUnknownRequest) || len(l.qp.Fwd) != 1 || l.qp.Fwd[0].Msg.Type() != protocol.TypeAbortAck {
		t.Fatalf("err %v, wire %v", err, l.qp.Fwd)
	}
}

func TestDoneBeforeGrantIsRefused(t *testing.T) {
	l := newLink(t, 2)
	if err := l.r.Step(prefill, &protocol.Done{Request: 5, Tokens: 4, Pages: 1}, l.n.Now); !errors.Is(err, protocol.ErrUnknownRequest) {
		t.Fatalf("got %v", err)
	}
}

// A page whose tag record carries an older epoch was written for an earlier
// tenancy: verification refuses it.
func TestStaleEpochFailsVerification(t *testing.T) {
	l := newLink(t, 1)
	l.submit(1, 4)
	l.deliverOne() // Bootstrap
	l.backOne()    // Grant
	w := l.qp.Fwd[0].Write
	stale := protocol.Tag{Request: 1, Epoch: w.Remote.Epoch - 1, Index: 0, Tokens: 4, Sum: 0}
	w.Tag = stale.Append(nil, l.qp.Key)
	l.run()
	if !errors.Is(l.rOut[1], protocol.ErrTagMismatch) {
		t.Fatalf("got %v", l.rOut[1])
	}
	l.assertAllFree()
}

func TestTokenMismatchFailsVerification(t *testing.T) {
	l := newLink(t, 2)
	l.submit(1, 4)
	l.deliverOne()
	l.backOne()
	l.deliverOne() // WRITE
	l.qp.Fwd[0].Msg.(*protocol.Done).Tokens = 1
	l.run()
	if !errors.Is(l.rOut[1], protocol.ErrTokenMismatch) {
		t.Fatalf("got %v", l.rOut[1])
	}
}

func TestCorruptPayloadFailsByChecksum(t *testing.T) {
	l := newLink(t, 2)
	l.submit(1, 4)
	l.deliverOne()
	l.backOne()
	l.deliverOne() // WRITE placed
	l.dst.Payload(0)[17] ^= 0xFF
	l.run()
	if !errors.Is(l.rOut[1], protocol.ErrChecksumMismatch) {
		t.Fatalf("got %v", l.rOut[1])
	}
}

// The source pages stay held until every WRITE that reads them completed (the
// defense against prefill-early-free).
func TestSourcePagesHeldUntilWritesComplete(t *testing.T) {
	l := newLink(t, 2)
	l.submit(1, 4)
	l.deliverOne()
	l.backOne() // WRITE and Done posted, not yet placed
	if l.s.Pool().Free() != 7 {
		t.Fatal("a posted, incomplete WRITE must keep its source page")
	}
	l.run()
	l.assertAllFree()
}

// A dead peer: the receiver asks for the cut, and only the cut frees the pages.
func TestPeerFailureIsFencedByACut(t *testing.T) {
	l := newLink(t, 2)
	l.submit(1, 4)
	l.deliverOne()
	l.backOne() // a WRITE is in flight
	l.r.PeerFailed(prefill)
	l.n.Settle() // the link applies the cut, then reports it
	if !errors.Is(l.rOut[1], protocol.ErrPeerFailed) || !errors.Is(l.sOut[1], protocol.ErrPeerFailed) {
		t.Fatalf("outcomes %v %v", l.rOut[1], l.sOut[1])
	}
	if len(l.qp.Fwd) != 0 {
		t.Fatal("nothing may land after the cut")
	}
	l.assertAllFree()
}

func TestCancelBeforeBootstrapLeavesATombstone(t *testing.T) {
	l := newLink(t, 2)
	l.r.Cancel(1) // both legs hear of a cancel before the request reaches them
	l.s.Cancel(1)
	l.submit(1, 4)
	l.run()
	if l.r.Pool().Free() != 2 || !errors.Is(l.sOut[1], protocol.ErrPeerFailed) {
		t.Fatalf("a Bootstrap after the cancel must be refused: sender %v", l.sOut[1])
	}
	l.assertAllFree()
}

func TestWrongDirectionMessagesAreRefused(t *testing.T) {
	l := newLink(t, 2)
	if err := l.r.Step(prefill, &protocol.Grant{Request: 1, Tokens: 1, Pages: []protocol.PageGrant{{}}}, l.n.Now); !errors.Is(err, protocol.ErrUnexpectedMessage) {
		t.Fatalf("receiver took a Grant: %v", err)
	}
	if err := l.s.Step(decode, &protocol.Done{Request: 1, Tokens: 1, Pages: 1}); !errors.Is(err, protocol.ErrUnexpectedMessage) {
		t.Fatalf("sender took a Done: %v", err)
	}
}

// Malformed messages handed over in process meet the wire's limits too: an
// error, and nothing changes.
func TestMalformedMessagesAreRefusedWithoutEffect(t *testing.T) {
	l := newLink(t, 2)
	for _, m := range []protocol.Message{nil, &protocol.Bootstrap{Request: 1, Tokens: 0}, &protocol.Done{Request: 1, Tokens: 4, Pages: 0}, &protocol.Abort{Request: 1}} {
		if err := l.r.Step(prefill, m, l.n.Now); !errors.Is(err, protocol.ErrMalformed) {
			t.Errorf("receiver took %#v: %v", m, err)
		}
	}
	for _, m := range []protocol.Message{nil, &protocol.Grant{Request: 1, Tokens: 4}, &protocol.Abort{Request: 1, Reason: 99}} {
		if err := l.s.Step(decode, m); !errors.Is(err, protocol.ErrMalformed) {
			t.Errorf("sender took %#v: %v", m, err)
		}
	}
	l.n.Settle()
	if len(l.qp.Fwd)+len(l.qp.Back) != 0 || l.r.Status(1) != protocol.ReceiverNone || l.r.Pool().Free() != 2 {
		t.Fatal("a refused message must change nothing")
	}
}

// A failed WRITE means the queue pair is broken: the sender posts nothing more
// on it, and fails the request once its posted WRITEs have completed.
func TestFailedWriteStopsPostingAndFailsTheRequest(t *testing.T) {
	l := newLink(t, 4)
	l.submit(1, 16) // 4 pages; 2 WRITEs in flight at a time
	l.deliverOne()  // Bootstrap
	l.backOne()     // Grant: WRITEs 0 and 1 posted
	if len(l.qp.Fwd) != 2 {
		t.Fatalf("%d ops posted, want 2", len(l.qp.Fwd))
	}
	first := l.qp.Fwd[0].Write
	if err := l.s.Completed(first.ID, errors.New("remote access error")); err != nil {
		t.Fatal(err)
	}
	l.n.Settle()
	if len(l.qp.Fwd) != 2 {
		t.Fatal("nothing more may be posted after a failed WRITE")
	}
	if err := l.s.Completed(l.qp.Fwd[1].Write.ID, errors.New("flushed")); err != nil {
		t.Fatal(err)
	}
	l.n.Settle()
	if !errors.Is(l.sOut[1], protocol.ErrPeerFailed) || l.s.Pool().Free() != 8 {
		t.Fatalf("outcome %v, %d source pages free", l.sOut[1], l.s.Pool().Free())
	}
}

// With a Horizon, Tick forgets a request that ended at least that long ago;
// a late message for it is then one for an unknown request and changes
// nothing, except that the sender answers a Grant with AbortAck.
func TestEndedRecordsAreForgottenAfterTheHorizon(t *testing.T) {
	l := newLinkWith(t, 4, time.Minute)
	l.submit(1, 4)
	l.run()
	if l.r.Status(1) != protocol.ReceiverFinished || l.s.Status(1) != protocol.SenderFinished {
		t.Fatalf("r1: %s / %s", l.r.Status(1), l.s.Status(1))
	}
	l.r.Tick(l.n.Now) // the first Tick that sees it ended: its age starts here
	l.s.Tick(l.n.Now)
	l.r.Tick(l.n.Now.Add(time.Minute - time.Nanosecond))
	l.s.Tick(l.n.Now.Add(time.Minute - time.Nanosecond))
	if l.r.Records() != 1 || l.s.Records() != 1 {
		t.Fatal("a record was forgotten before its horizon")
	}
	l.r.Tick(l.n.Now.Add(time.Minute))
	l.s.Tick(l.n.Now.Add(time.Minute))
	if l.r.Records() != 0 || l.s.Records() != 0 || l.r.Status(1) != protocol.ReceiverNone {
		t.Fatalf("after the horizon: %d decode records, %d prefill records", l.r.Records(), l.s.Records())
	}
	if err := l.r.Step(prefill, &protocol.Done{Request: 1, Tokens: 4, Pages: 1}, l.n.Now); !errors.Is(err, protocol.ErrUnknownRequest) {
		t.Fatalf("a late Done for a forgotten request: %v", err)
	}
	if e := l.r.Effects(); len(e.Sends)+len(e.Outcomes)+len(e.Verified)+len(e.Cuts) != 0 {
		t.Fatalf("a late Done for a forgotten request had effects: %+v", e)
	}
	if err := l.s.Step(decode, &protocol.Grant{Request: 1, Tokens: 4, Pages: []protocol.PageGrant{{Page: 0, Epoch: 1}}}); !errors.Is(err, protocol.ErrUnknownRequest) {
		t.Fatalf("a late Grant for a forgotten request: %v", err)
	}
	if e := l.s.Effects(); len(e.Ops) != 1 || e.Ops[0].Msg.Type() != protocol.TypeAbortAck || len(e.Outcomes) != 0 {
		t.Fatalf("a late Grant must be answered with AbortAck only: %+v", e)
	}
	l.assertAllFree()
}

// A record still at work is never forgotten: reserved, quarantined while its
// writer may write, or a sender with WRITEs outstanding. And with no Horizon,
// nothing is.
func TestRecordsAtWorkAreNeverForgotten(t *testing.T) {
	l := newLinkWith(t, 4, time.Nanosecond)
	l.submit(1, 4)
	l.deliverOne() // Bootstrap
	l.backOne()    // Grant: WRITE and Done are on the wire, not yet placed
	l.cancel(1)    // decode quarantines until the writer is fenced; prefill aborts until its WRITE completes
	for i := 1; i <= 3; i++ {
		l.r.Tick(l.n.Now.Add(time.Duration(i) * time.Hour))
		l.s.Tick(l.n.Now.Add(time.Duration(i) * time.Hour))
	}
	if l.r.Status(1) != protocol.ReceiverQuarantine || l.s.Status(1) != protocol.SenderAborting {
		t.Fatalf("records at work were forgotten: %q / %q", l.r.Status(1), l.s.Status(1))
	}
	l.run() // the WRITE completes, AbortAck fences the quarantine
	l.r.Tick(l.n.Now.Add(4 * time.Hour))
	l.s.Tick(l.n.Now.Add(4 * time.Hour))
	l.r.Tick(l.n.Now.Add(5 * time.Hour))
	l.s.Tick(l.n.Now.Add(5 * time.Hour))
	if l.r.Records() != 0 || l.s.Records() != 0 {
		t.Fatalf("ended records kept: %d / %d", l.r.Records(), l.s.Records())
	}
	l.assertAllFree()

	// A cut while a WRITE is posted: the flush ends the sender's request;
	// once forgotten, the WRITE's own late completion is refused, harmlessly.
	l.submit(2, 4)
	l.deliverOne() // Bootstrap
	l.backOne()    // Grant: the WRITE is posted
	write := l.qp.Fwd[0].Write
	l.qp.Fwd = nil
	l.s.Flushed(decode)
	l.s.Tick(l.n.Now.Add(6 * time.Hour))
	l.s.Tick(l.n.Now.Add(7 * time.Hour))
	if err := l.s.Completed(write.ID, errors.New("flushed")); !errors.Is(err, protocol.ErrUnknownRequest) || l.s.Records() != 0 {
		t.Fatalf("a late completion after the horizon: %v, %d records", err, l.s.Records())
	}

	keep := newLink(t, 4) // no Horizon: kept forever
	keep.submit(1, 4)
	keep.run()
	keep.r.Tick(keep.n.Now.Add(24 * time.Hour))
	keep.r.Tick(keep.n.Now.Add(48 * time.Hour))
	keep.s.Tick(keep.n.Now.Add(48 * time.Hour))
	if keep.r.Records() != 1 || keep.s.Records() != 1 {
		t.Fatal("with no Horizon a record was forgotten")
	}
}
