package protocol

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol/checksum"
)

const (
	pageBytes  = 256
	pageTokens = 4
	prefill    = PeerID(1)
)

// memory is a node's pages: payloads and tag slots.
type memory struct{ payload, tags [][]byte }

// tenant is the request that used the decode pages before: every page starts
// with its KV and a valid tag record for it (pages are never zeroed).
const tenant = RequestID(999)

func newMemory(n int) *memory {
	m := &memory{}
	for i := 0; i < n; i++ {
		kv := bytes.Repeat([]byte{0xEE, byte(i)}, pageBytes/2)
		m.payload = append(m.payload, kv)
		m.tags = append(m.tags, Tag{Request: tenant, Index: uint32(i), Tokens: pageTokens, Sum: checksum.Sum(kv)}.Append(nil, testKey))
	}
	return m
}

func (m *memory) TagRecord(p uint32) []byte { return m.tags[p] }
func (m *memory) Payload(p uint32) []byte   { return m.payload[p] }
func (m *memory) Page(p uint32) []byte      { return m.payload[p] }

// link is one prefill node and one decode node joined by an in-memory queue
// pair. WRITEs and SENDs from the sender queue up in order; the test decides
// when they land, so every race can be staged.
type link struct {
	t        *testing.T
	s        *Sender
	r        *Receiver
	src, dst *memory
	wire     []Op // posted, not yet placed or delivered (RC order)
	back     []Send
	sOut     map[RequestID]error
	rOut     map[RequestID]error
	verified []RequestID
	now      time.Time
	// violations of the spec's properties seen by the link (docs/spec.md).
	violations []string
	// log is what happened, for the scenario files; lenient logs protocol
	// errors instead of failing (a scenario may stage them on purpose).
	log     []string
	lenient bool
}

func (l *link) logf(format string, a ...any) { l.log = append(l.log, fmt.Sprintf(format, a...)) }

// refuse reports an error a node returned: fatal, unless a scenario staged it.
func (l *link) refuse(who string, err error) {
	l.t.Helper()
	if !l.lenient {
		l.t.Fatalf("%s: %v", who, err)
	}
	l.logf("%s refuses: %v", who, err)
}

func (l *link) violate(format string, a ...any) {
	l.violations = append(l.violations, fmt.Sprintf(format, a...))
	l.logf("VIOLATION %s", fmt.Sprintf(format, a...))
}

func newLink(t *testing.T, decodePages int, bugs ...research.Switch) *link {
	t.Helper()
	l := &link{t: t, src: newMemory(8), dst: newMemory(decodePages), sOut: map[RequestID]error{}, rOut: map[RequestID]error{}, now: time.Unix(1000, 0)}
	var err error
	if l.s, err = NewSender(SenderConfig{Pages: 8, PageTokens: pageTokens, MaxInFlight: 2, Memory: l.src, TagKeys: testKeys, Research: research.On(bugs...)}); err != nil {
		t.Fatal(err)
	}
	if l.r, err = NewReceiver(ReceiverConfig{Pages: decodePages, PageTokens: pageTokens, Timeout: time.Second, Memory: l.dst, TagKeys: testKeys,
		Region:   func(p uint32) (uint64, uint32) { return 0x1000 * uint64(p), 7 },
		Research: research.On(bugs...)}); err != nil {
		t.Fatal(err)
	}
	return l
}

// collect moves both nodes' effects onto the wire and records outcomes.
func (l *link) collect() {
	se := l.s.Effects()
	l.wire = append(l.wire, se.Ops...)
	for _, op := range se.Ops {
		l.logf("prefill posts %s", opString(op))
	}
	for _, o := range se.Outcomes {
		l.logf("prefill outcome r%d: %v", o.Request, o.Err)
		if _, dup := l.sOut[o.Request]; dup {
			l.t.Fatalf("sender reported request %d twice", o.Request)
		}
		l.sOut[o.Request] = o.Err
	}
	re := l.r.Effects()
	l.back = append(l.back, re.Sends...)
	l.verified = append(l.verified, re.Verified...)
	for _, snd := range re.Sends {
		l.logf("decode sends %s", opString(Op{Msg: snd.Msg}))
	}
	for _, id := range re.Verified {
		l.logf("decode verified r%d", id)
	}
	for _, p := range re.Cuts {
		l.logf("decode cuts the queue pair to %d", p)
	}
	for _, o := range re.Outcomes {
		l.logf("decode outcome r%d: %v", o.Request, o.Err)
		if _, dup := l.rOut[o.Request]; dup {
			l.t.Fatalf("receiver reported request %d twice", o.Request)
		}
		l.rOut[o.Request] = o.Err
	}
	for _, p := range re.Cuts {
		l.wire, l.back = nil, nil // the queue pair is in error: everything in flight is flushed
		l.r.QueuePairFenced(p)
		l.s.Flushed(p)
		l.collect()
	}
}

// submit starts a request whose KV is a recognisable pattern per page.
func (l *link) submit(id RequestID, tokens int) {
	l.t.Helper()
	if err := l.trySubmit(id, tokens); err != nil {
		l.t.Fatalf("submit %d: %v", id, err)
	}
}

// trySubmit is submit for a request that intake may reject.
func (l *link) trySubmit(id RequestID, tokens int) error {
	l.t.Helper()
	pages, err := l.s.Submit(id, prefill, tokens)
	if err != nil {
		return err
	}
	for i, p := range pages {
		copy(l.src.payload[p], pattern(id, i))
	}
	if err := l.s.Computed(id); err != nil {
		l.t.Fatal(err)
	}
	l.collect()
	return nil
}

// opString describes an operation on the queue pair for logs and scenarios.
func opString(op Op) string {
	if w := op.Write; w != nil {
		return fmt.Sprintf("WRITE r%d[%d] -> page %d@%d", w.Request, w.Index, w.Remote.Page, w.Remote.Epoch)
	}
	switch m := op.Msg.(type) {
	case *Bootstrap:
		return fmt.Sprintf("Bootstrap r%d %d tokens", m.Request, m.Tokens)
	case *Grant:
		var pages []string
		for _, p := range m.Pages {
			pages = append(pages, fmt.Sprintf("%d@%d", p.Page, p.Epoch))
		}
		return fmt.Sprintf("Grant r%d %d tokens [%s]", m.Request, m.Tokens, strings.Join(pages, " "))
	case *Done:
		return fmt.Sprintf("Done r%d %d tokens %d pages", m.Request, m.Tokens, m.Pages)
	case *Abort:
		return fmt.Sprintf("Abort r%d reason %d", m.Request, m.Reason)
	case *AbortAck:
		return fmt.Sprintf("AbortAck r%d", m.Request)
	}
	return fmt.Sprint(op.Msg)
}

func pattern(id RequestID, i int) []byte {
	return bytes.Repeat([]byte{byte(id), byte(i), 0x5A, 0xA5}, pageBytes/4)
}

// deliverOne places or delivers the head of the prefill→decode direction.
func (l *link) deliverOne() Op {
	l.t.Helper()
	op := l.wire[0]
	l.wire = l.wire[1:]
	if w := op.Write; w != nil {
		// NoForeignWrite (docs/spec.md): a WRITE never lands in a page that
		// another request owns or has in quarantine.
		if pg := l.r.Pool().pages[w.Remote.Page]; pg.state != pageFree && pg.owner != w.Request {
			l.violate("NoForeignWrite: WRITE of request %d landed in page %d, which request %d holds", w.Request, w.Remote.Page, pg.owner)
		}
		copy(l.dst.payload[w.Remote.Page], l.src.payload[w.Source]) // the NIC reads the source now
		copy(l.dst.tags[w.Remote.Page], w.Tag)
		l.logf("placed %s", opString(op))
		if err := l.s.Completed(w.ID, nil); err != nil {
			l.refuse("prefill", err)
		}
	} else {
		l.logf("decode receives %s", opString(op))
		if err := l.r.Step(op.Peer, op.Msg, l.now); err != nil {
			l.refuse("decode", err)
		}
	}
	l.collect()
	return op
}

// backOne delivers the head of the decode→prefill direction.
func (l *link) backOne() {
	l.t.Helper()
	m := l.back[0]
	l.back = l.back[1:]
	l.logf("prefill receives %s", opString(Op{Msg: m.Msg}))
	if err := l.s.Step(prefill, m.Msg); err != nil {
		l.refuse("prefill", err)
	}
	l.collect()
}

// run delivers everything in both directions and reads every verified request.
func (l *link) run() {
	for len(l.wire)+len(l.back)+len(l.verified) > 0 {
		switch {
		case len(l.back) > 0:
			l.backOne()
		case len(l.wire) > 0:
			l.deliverOne()
		default:
			id := l.verified[0]
			l.verified = l.verified[1:]
			l.read(id)
		}
	}
}

// read is the decoder: acquire, check the bytes are the request's own, finish.
func (l *link) read(id RequestID) {
	l.t.Helper()
	refs, err := l.r.Acquire(id)
	if err != nil {
		l.logf("decode cannot read r%d: %v", id, err)
		return
	}
	l.logf("decode reads r%d: %d pages", id, len(refs))
	for i, ref := range refs {
		if !bytes.Equal(l.dst.payload[ref.Page], pattern(id, i)) {
			l.violate("Isolation: request %d page %d holds KV it did not write", id, i)
		}
	}
	if err := l.r.Finish(id); err != nil {
		l.t.Fatal(err)
	}
	l.collect()
}

func (l *link) assertAllFree() {
	l.t.Helper()
	if len(l.violations) > 0 {
		l.t.Fatalf("violations: %v", l.violations)
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
	for id := RequestID(1); id <= 3; id++ {
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
	_, err := l.s.Submit(1, prefill, 8*pageTokens+1)
	if !errors.Is(err, ErrRejected) || !errors.Is(err, ErrTooLong) {
		t.Fatalf("got %v", err)
	}
	l.collect()
	if len(l.wire) != 0 || l.s.Pool().Free() != 8 {
		t.Fatal("a rejected request must send nothing and hold nothing")
	}
}

func TestReceiverRejectsWhatItsPoolCannotHoldAndStopsTheSender(t *testing.T) {
	l := newLink(t, 2)
	l.submit(1, 3*pageTokens) // fits the prefill pool, not decode's
	l.run()
	if err := l.rOut[1]; !errors.Is(err, ErrRejected) || !errors.Is(err, ErrTooLong) {
		t.Fatalf("receiver: %v", err)
	}
	if err := l.sOut[1]; !errors.Is(err, ErrPeerFailed) {
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
	l.r.Cancel(1)
	l.s.Cancel(1)
	l.collect()
	if got := l.r.Pool().Quarantined(); got != 2 {
		t.Fatalf("%d pages quarantined, want 2", got)
	}
	l.deliverOne() // a WRITE lands: in the request's own quarantined page, harmlessly
	if l.r.Pool().Quarantined() != 2 {
		t.Fatal("pages must stay quarantined while a WRITE is in flight")
	}
	l.run() // the second WRITE, Done (a fence), then AbortAck (a second fence: no effect)
	if !errors.Is(l.rOut[1], ErrCancelled) || !errors.Is(l.sOut[1], ErrCancelled) {
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
	l.r.Tick(l.now.Add(2 * time.Second))
	l.collect()
	if !errors.Is(l.rOut[1], ErrTimedOut) {
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
	l.collect()
	if !errors.Is(l.rOut[2], ErrTimedOut) || l.r.Status(1) != StatusReserved || l.r.Status(2) != StatusQuarantine {
		t.Fatalf("r1 %s, r2 %s %v", l.r.Status(1), l.r.Status(2), l.rOut[2])
	}
	if err := l.r.Expire(2); !errors.Is(err, ErrNotReady) {
		t.Fatalf("expire twice: %v", err)
	}
	if err := l.r.Expire(9); !errors.Is(err, ErrUnknownRequest) {
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
	l.r.Cancel(1)
	l.collect()
	l.deliverOne() // WRITE
	l.deliverOne() // Done: request 1 is cancelled, so Done only fences it
	if len(l.verified) != 0 || l.r.Pool().Free() != 2 {
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
	if err := l.r.Step(prefill, done.Msg, l.now); !errors.Is(err, ErrDuplicate) {
		t.Fatalf("second Done: %v", err)
	}
}

func TestGrantForUnknownRequestIsAnsweredWithAbortAck(t *testing.T) {
	l := newLink(t, 2)
	err := l.s.Step(prefill, &Grant{Request: 99, Tokens: 4, Pages: []PageGrant{{Page: 0, Epoch: 1}}})
	l.collect()
	if !errors.Is(err, ErrUnknownRequest) || len(l.wire) != 1 || l.wire[0].Msg.Type() != TypeAbortAck {
		t.Fatalf("err %v, wire %v", err, l.wire)
	}
}

func TestDoneBeforeGrantIsRefused(t *testing.T) {
	l := newLink(t, 2)
	if err := l.r.Step(prefill, &Done{Request: 5, Tokens: 4, Pages: 1}, l.now); !errors.Is(err, ErrUnknownRequest) {
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
	w := l.wire[0].Write
	stale := Tag{Request: 1, Epoch: w.Remote.Epoch - 1, Index: 0, Tokens: 4, Sum: 0}
	w.Tag = stale.Append(nil, testKey)
	l.run()
	if !errors.Is(l.rOut[1], ErrTagMismatch) {
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
	l.wire[0].Msg.(*Done).Tokens = 1
	l.run()
	if !errors.Is(l.rOut[1], ErrTokenMismatch) {
		t.Fatalf("got %v", l.rOut[1])
	}
}

func TestCorruptPayloadFailsByChecksum(t *testing.T) {
	l := newLink(t, 2)
	l.submit(1, 4)
	l.deliverOne()
	l.backOne()
	l.deliverOne() // WRITE placed
	l.dst.payload[0][17] ^= 0xFF
	l.run()
	if !errors.Is(l.rOut[1], ErrChecksumMismatch) {
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
	l.collect() // the link applies the cut, then reports it
	if !errors.Is(l.rOut[1], ErrPeerFailed) || !errors.Is(l.sOut[1], ErrPeerFailed) {
		t.Fatalf("outcomes %v %v", l.rOut[1], l.sOut[1])
	}
	if len(l.wire) != 0 {
		t.Fatal("nothing may land after the cut")
	}
	l.assertAllFree()
}

func TestCancelBeforeBootstrapLeavesATombstone(t *testing.T) {
	l := newLink(t, 2)
	l.r.Cancel(1)
	l.s.Cancel(1)
	l.submit(1, 4)
	l.run()
	if l.r.Pool().Free() != 2 || !errors.Is(l.sOut[1], ErrPeerFailed) {
		t.Fatalf("a Bootstrap after the cancel must be refused: sender %v", l.sOut[1])
	}
	l.assertAllFree()
}

func TestWrongDirectionMessagesAreRefused(t *testing.T) {
	l := newLink(t, 2)
	if err := l.r.Step(prefill, &Grant{Request: 1, Tokens: 1, Pages: []PageGrant{{}}}, l.now); !errors.Is(err, ErrUnexpectedMessage) {
		t.Fatalf("receiver took a Grant: %v", err)
	}
	if err := l.s.Step(prefill, &Done{Request: 1, Tokens: 1, Pages: 1}); !errors.Is(err, ErrUnexpectedMessage) {
		t.Fatalf("sender took a Done: %v", err)
	}
}

// Malformed messages handed over in process meet the wire's limits too: an
// error, and nothing changes.
func TestMalformedMessagesAreRefusedWithoutEffect(t *testing.T) {
	l := newLink(t, 2)
	for _, m := range []Message{nil, &Bootstrap{Request: 1, Tokens: 0}, &Done{Request: 1, Tokens: 4, Pages: 0}, &Abort{Request: 1}} {
		if err := l.r.Step(prefill, m, l.now); !errors.Is(err, ErrMalformed) {
			t.Errorf("receiver took %#v: %v", m, err)
		}
	}
	for _, m := range []Message{nil, &Grant{Request: 1, Tokens: 4}, &Abort{Request: 1, Reason: 99}} {
		if err := l.s.Step(prefill, m); !errors.Is(err, ErrMalformed) {
			t.Errorf("sender took %#v: %v", m, err)
		}
	}
	l.collect()
	if len(l.wire)+len(l.back) != 0 || l.r.Status(1) != StatusNone || l.r.Pool().Free() != 2 {
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
	if len(l.wire) != 2 {
		t.Fatalf("%d ops posted, want 2", len(l.wire))
	}
	first := l.wire[0].Write
	if err := l.s.Completed(first.ID, errors.New("remote access error")); err != nil {
		t.Fatal(err)
	}
	l.collect()
	if len(l.wire) != 2 {
		t.Fatal("nothing more may be posted after a failed WRITE")
	}
	if err := l.s.Completed(l.wire[1].Write.ID, errors.New("flushed")); err != nil {
		t.Fatal(err)
	}
	l.collect()
	if !errors.Is(l.sOut[1], ErrPeerFailed) || l.s.Pool().Free() != 8 {
		t.Fatalf("outcome %v, %d source pages free", l.sOut[1], l.s.Pool().Free())
	}
}

// With a Horizon, Tick forgets a request that ended at least that long ago;
// a late message for it is then one for an unknown request and changes
// nothing, except that the sender answers a Grant with AbortAck.
func TestEndedRecordsAreForgottenAfterTheHorizon(t *testing.T) {
	l := newLink(t, 4)
	l.r.cfg.Horizon, l.s.cfg.Horizon = time.Minute, time.Minute
	l.submit(1, 4)
	l.run()
	if l.r.Status(1) != StatusFinished || l.s.Status(1) != SendStatusFinished {
		t.Fatalf("r1: %s / %s", l.r.Status(1), l.s.Status(1))
	}
	l.r.Tick(l.now) // the first Tick that sees it ended: its age starts here
	l.s.Tick(l.now)
	l.r.Tick(l.now.Add(time.Minute - time.Nanosecond))
	l.s.Tick(l.now.Add(time.Minute - time.Nanosecond))
	if l.r.Records() != 1 || l.s.Records() != 1 {
		t.Fatal("a record was forgotten before its horizon")
	}
	l.r.Tick(l.now.Add(time.Minute))
	l.s.Tick(l.now.Add(time.Minute))
	if l.r.Records() != 0 || l.s.Records() != 0 || l.r.Status(1) != StatusNone {
		t.Fatalf("after the horizon: %d decode records, %d prefill records", l.r.Records(), l.s.Records())
	}
	if err := l.r.Step(prefill, &Done{Request: 1, Tokens: 4, Pages: 1}, l.now); !errors.Is(err, ErrUnknownRequest) {
		t.Fatalf("a late Done for a forgotten request: %v", err)
	}
	if e := l.r.Effects(); len(e.Sends)+len(e.Outcomes)+len(e.Verified)+len(e.Cuts) != 0 {
		t.Fatalf("a late Done for a forgotten request had effects: %+v", e)
	}
	if err := l.s.Step(prefill, &Grant{Request: 1, Tokens: 4, Pages: []PageGrant{{Page: 0, Epoch: 1}}}); !errors.Is(err, ErrUnknownRequest) {
		t.Fatalf("a late Grant for a forgotten request: %v", err)
	}
	if e := l.s.Effects(); len(e.Ops) != 1 || e.Ops[0].Msg.Type() != TypeAbortAck || len(e.Outcomes) != 0 {
		t.Fatalf("a late Grant must be answered with AbortAck only: %+v", e)
	}
	l.assertAllFree()
}

// A record still at work is never forgotten: reserved, quarantined while its
// writer may write, or a sender with WRITEs outstanding. And with no Horizon,
// nothing is.
func TestRecordsAtWorkAreNeverForgotten(t *testing.T) {
	l := newLink(t, 4)
	l.r.cfg.Horizon, l.s.cfg.Horizon = time.Nanosecond, time.Nanosecond
	l.submit(1, 4)
	l.deliverOne() // Bootstrap
	l.backOne()    // Grant: WRITE and Done are on the wire, not yet placed
	l.r.Cancel(1)  // quarantined until the writer is fenced
	l.s.Cancel(1)  // aborting until its WRITE completes
	l.collect()
	for i := 1; i <= 3; i++ {
		l.r.Tick(l.now.Add(time.Duration(i) * time.Hour))
		l.s.Tick(l.now.Add(time.Duration(i) * time.Hour))
	}
	if l.r.Status(1) != StatusQuarantine || l.s.Status(1) != SendStatusAborting {
		t.Fatalf("records at work were forgotten: %q / %q", l.r.Status(1), l.s.Status(1))
	}
	l.run() // the WRITE completes, AbortAck fences the quarantine
	l.r.Tick(l.now.Add(4 * time.Hour))
	l.s.Tick(l.now.Add(4 * time.Hour))
	l.r.Tick(l.now.Add(5 * time.Hour))
	l.s.Tick(l.now.Add(5 * time.Hour))
	if l.r.Records() != 0 || l.s.Records() != 0 {
		t.Fatalf("ended records kept: %d / %d", l.r.Records(), l.s.Records())
	}
	l.assertAllFree()

	// A cut while a WRITE is posted: the flush ends the sender's request;
	// once forgotten, the WRITE's own late completion is refused, harmlessly.
	l.submit(2, 4)
	l.deliverOne() // Bootstrap
	l.backOne()    // Grant: the WRITE is posted
	write := l.wire[0].Write
	l.wire = nil
	l.s.Flushed(prefill)
	l.s.Tick(l.now.Add(6 * time.Hour))
	l.s.Tick(l.now.Add(7 * time.Hour))
	if err := l.s.Completed(write.ID, errors.New("flushed")); !errors.Is(err, ErrUnknownRequest) || l.s.Records() != 0 {
		t.Fatalf("a late completion after the horizon: %v, %d records", err, l.s.Records())
	}

	keep := newLink(t, 4) // no Horizon: kept forever
	keep.submit(1, 4)
	keep.run()
	keep.r.Tick(keep.now.Add(24 * time.Hour))
	keep.r.Tick(keep.now.Add(48 * time.Hour))
	keep.s.Tick(keep.now.Add(48 * time.Hour))
	if keep.r.Records() != 1 || keep.s.Records() != 1 {
		t.Fatal("with no Horizon a record was forgotten")
	}
}
