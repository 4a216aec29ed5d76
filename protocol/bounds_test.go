package protocol

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
)

// lazyMemory is page memory for tests at scale: a page's bytes exist only once
// something touches them, so a pool of a million pages costs nothing.
type lazyMemory struct {
	size          int
	payload, tags map[uint32][]byte
}

func newLazyMemory(size int) *lazyMemory {
	return &lazyMemory{size: size, payload: map[uint32][]byte{}, tags: map[uint32][]byte{}}
}

func (m *lazyMemory) get(in map[uint32][]byte, p uint32, n int) []byte {
	if in[p] == nil {
		in[p] = make([]byte, n)
	}
	return in[p]
}

func (m *lazyMemory) Page(p uint32) []byte      { return m.get(m.payload, p, m.size) }
func (m *lazyMemory) Payload(p uint32) []byte   { return m.get(m.payload, p, m.size) }
func (m *lazyMemory) TagRecord(p uint32) []byte { return m.get(m.tags, p, TagSize) }

func boundsReceiver(t testing.TB, cfg ReceiverConfig) *Receiver {
	t.Helper()
	if cfg.Memory == nil {
		cfg.Memory = newLazyMemory(16)
	}
	cfg.Region = func(p uint32) (uint64, uint32) { return uint64(p) << 12, 7 }
	if cfg.TagKeys == nil {
		cfg.TagKeys = testKeys
	}
	r, err := NewReceiver(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func boundsSender(t testing.TB, cfg SenderConfig) *Sender {
	t.Helper()
	if cfg.Memory == nil {
		cfg.Memory = newLazyMemory(16)
	}
	if cfg.TagKeys == nil {
		cfg.TagKeys = testKeys
	}
	s, err := NewSender(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// A request of more pages than one Grant can carry is refused at the sender's
// intake, before it holds a page: reserved, it could never be granted.
func TestSenderIntakeRefusesMorePagesThanAGrantCarries(t *testing.T) {
	s := boundsSender(t, SenderConfig{Pages: MaxGrantPages + 1, PageTokens: 1})
	_, err := s.Submit(1, 2, MaxGrantPages+1)
	if !errors.Is(err, ErrTooManyPages) || !errors.Is(err, ErrRejected) {
		t.Fatalf("Submit of %d pages: %v, want ErrRejected and ErrTooManyPages", MaxGrantPages+1, err)
	}
	if s.Pool().Free() != MaxGrantPages+1 || s.Records() != 0 || len(s.Effects().Ops) != 0 {
		t.Fatalf("a refused request changed state: %d pages free, %d records", s.Pool().Free(), s.Records())
	}
	// The largest request a Grant carries is admitted, and its Bootstrap encodes.
	if _, err := s.Submit(2, 2, MaxGrantPages); err != nil {
		t.Fatal(err)
	}
	for _, op := range s.Effects().Ops {
		if _, err := AppendMessage(nil, op.Msg); err != nil {
			t.Fatal(err)
		}
	}
}

// The receiver's intake refuses the same way, whatever its pool would hold:
// otherwise it reserves pages for a Grant it cannot encode and holds them
// until a timeout.
func TestReceiverIntakeRefusesMorePagesThanAGrantCarries(t *testing.T) {
	r := boundsReceiver(t, ReceiverConfig{Pages: MaxGrantPages + 1, PageTokens: 1})
	if err := r.Step(1, &Bootstrap{Request: 1, Tokens: MaxGrantPages + 1}, time.Unix(0, 0)); err != nil {
		t.Fatal(err)
	}
	e := r.Effects()
	if len(e.Outcomes) != 1 || !errors.Is(e.Outcomes[0].Err, ErrTooManyPages) || !errors.Is(e.Outcomes[0].Err, ErrRejected) {
		t.Fatalf("outcomes %v, want one wrapping ErrRejected and ErrTooManyPages", e.Outcomes)
	}
	if len(e.Sends) != 1 {
		t.Fatalf("sends %v, want one Abort", e.Sends)
	}
	if a, ok := e.Sends[0].Msg.(*Abort); !ok || a.Reason != AbortRejected {
		t.Fatalf("sent %v, want Abort(rejected)", e.Sends[0].Msg)
	}
	if r.Pool().Free() != MaxGrantPages+1 {
		t.Fatalf("%d pages free of %d: a refused request holds pages", r.Pool().Free(), MaxGrantPages+1)
	}
	// The largest request a Grant carries is granted, and the Grant encodes.
	if err := r.Step(1, &Bootstrap{Request: 2, Tokens: MaxGrantPages}, time.Unix(0, 0)); err != nil {
		t.Fatal(err)
	}
	e = r.Effects()
	if len(e.Sends) != 1 {
		t.Fatalf("sends %v", e.Sends)
	}
	if _, err := AppendMessage(nil, e.Sends[0].Msg); err != nil {
		t.Fatalf("the Grant does not encode: %v", err)
	}
}

// Nothing is kept on a peer's word: a Bootstrap the receiver refuses (over its
// limit, or with every slot or page taken) leaves no record, so a peer that
// floods refused Bootstraps grows nothing.
func TestRefusedBootstrapsLeaveNoRecord(t *testing.T) {
	n := 500_000
	if testing.Short() {
		n = 20_000
	}
	r := boundsReceiver(t, ReceiverConfig{Pages: 4, PageTokens: 4, Slots: 1, MaxTokens: 16})
	now := time.Unix(0, 0)
	if err := r.Step(1, &Bootstrap{Request: 1, Tokens: 4}, now); err != nil { // holds the only slot
		t.Fatal(err)
	}
	r.Effects()
	for i := range n {
		tokens := uint32(17) // over the limit
		if i%2 == 1 {
			tokens = 4 // no slot left
		}
		if err := r.Step(1, &Bootstrap{Request: RequestID(i + 2), Tokens: tokens}, now); err != nil {
			t.Fatal(err)
		}
		if e := r.Effects(); len(e.Outcomes) != 1 || !errors.Is(e.Outcomes[0].Err, ErrRejected) && !errors.Is(e.Outcomes[0].Err, ErrNoCapacity) {
			t.Fatalf("Bootstrap %d: outcomes %v", i, e.Outcomes)
		}
	}
	if got := r.Records(); got != 1 {
		t.Fatalf("%d refused Bootstraps left %d records, want only the reserved one", n, got)
	}
	// A refused request can be asked about and is unknown: a late message for it
	// is refused without effect.
	if st := r.Status(2); st != ReceiverNone {
		t.Fatalf("status of a refused request: %v", st)
	}
	if err := r.Step(1, &Done{Request: 2, Tokens: 17, Pages: 5}, now); !errors.Is(err, ErrUnknownRequest) {
		t.Fatalf("Done for a refused request: %v", err)
	}
}

// Every reserved request times out once, at its deadline, in deadline order
// and by request within one deadline, however many records the receiver holds
// and whichever way they ended.
func TestTimersFireOnceAtTheirDeadlines(t *testing.T) {
	const n = 300
	r := boundsReceiver(t, ReceiverConfig{Pages: n, PageTokens: 1, Timeout: 10 * time.Second, Horizon: time.Minute})
	start := time.Unix(1000, 0)
	// Bootstraps at start+0s, +1s, +2s, ...: three requests per second, the
	// highest request id first so that id order and arrival order differ.
	for i := range n {
		id := RequestID(n - i)
		if err := r.Step(1, &Bootstrap{Request: id, Tokens: 1}, start.Add(time.Duration(i/3)*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	r.Effects()
	// Request 1 (the last bootstrapped) is timed out early by the engine; it
	// must not time out a second time at its deadline.
	if err := r.Expire(1); err != nil {
		t.Fatal(err)
	}
	if e := r.Effects(); len(e.Outcomes) != 1 {
		t.Fatalf("Expire: %v", e.Outcomes)
	}
	var order []RequestID
	for s := 0; s <= n/3+12; s++ {
		r.Tick(start.Add(time.Duration(s) * time.Second))
		e := r.Effects()
		for _, o := range e.Outcomes {
			if !errors.Is(o.Err, ErrTimedOut) {
				t.Fatalf("second %d: %v", s, o)
			}
			order = append(order, o.Request)
			if due := 10 + (n-int(o.Request))/3; s != due {
				t.Fatalf("request %d timed out at second %d, its deadline is second %d", o.Request, s, due)
			}
		}
	}
	if len(order) != n-1 {
		t.Fatalf("%d timeouts, want %d", len(order), n-1)
	}
	for i := 1; i < len(order); i++ {
		same := (n-int(order[i]))/3 == (n-int(order[i-1]))/3
		if same && order[i] < order[i-1] {
			t.Fatalf("timeouts of one deadline out of request order: %v", order[i-1:i+1])
		}
	}
	// Every record ended; the horizon forgets them all, a minute after the
	// first Tick that saw each ended.
	r.QueuePairFenced(1) // release the quarantined pages: every record is closed now
	last := start.Add(time.Duration(n/3+12) * time.Second)
	r.Tick(last)
	r.Tick(last.Add(time.Minute - time.Nanosecond))
	if r.Records() == 0 {
		t.Fatal("records forgotten before their horizon")
	}
	r.Tick(last.Add(time.Minute))
	if got := r.Records(); got != 0 {
		t.Fatalf("%d records left after the horizon", got)
	}
	if r.Pool().Free() != n {
		t.Fatalf("%d pages free of %d", r.Pool().Free(), n)
	}
}

// The sender's horizon forgets ended records without visiting live ones.
func TestSenderForgetsEndedRecordsAfterTheHorizon(t *testing.T) {
	s := boundsSender(t, SenderConfig{Pages: 100, PageTokens: 1, Horizon: time.Minute})
	for i := range 100 {
		if _, err := s.Submit(RequestID(i+1), 2, 1); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 50 {
		s.Cancel(RequestID(i + 1)) // ended: no grant, nothing posted
	}
	t0 := time.Unix(0, 0)
	s.Tick(t0)
	s.Tick(t0.Add(time.Minute - 1))
	if s.Records() != 100 {
		t.Fatalf("%d records before the horizon", s.Records())
	}
	s.Tick(t0.Add(time.Minute))
	if s.Records() != 50 {
		t.Fatalf("%d records after the horizon, want the 50 live ones", s.Records())
	}
	for i := 50; i < 100; i++ {
		if st := s.Status(RequestID(i + 1)); st != SenderAwaitGrant {
			t.Fatalf("request %d: %v", i+1, st)
		}
	}
}

// A Grant that names one page twice would have two WRITEs land on one page:
// the sender refuses it, ends its leg with ErrBadGrant, and fences the
// receiver's (AbortAck: nothing was posted), which fails there too.
func TestGrantNamingAPageTwiceIsRefused(t *testing.T) {
	for name, pages := range map[string][]PageGrant{
		"same page":    {{Page: 3, Epoch: 1, Addr: 0x3000, Key: 7}, {Page: 3, Epoch: 1, Addr: 0x3000, Key: 7}},
		"same address": {{Page: 3, Epoch: 1, Addr: 0x3000, Key: 7}, {Page: 4, Epoch: 1, Addr: 0x3000, Key: 7}},
	} {
		t.Run(name, func(t *testing.T) {
			s := boundsSender(t, SenderConfig{Pages: 4, PageTokens: 1})
			if _, err := s.Submit(1, 2, 2); err != nil {
				t.Fatal(err)
			}
			s.Computed(1)
			s.Effects()
			if err := s.Step(2, &Grant{Request: 1, Tokens: 2, Pages: pages}); err != nil {
				t.Fatal(err)
			}
			e := s.Effects()
			if len(e.Outcomes) != 1 || !errors.Is(e.Outcomes[0].Err, ErrBadGrant) {
				t.Fatalf("outcomes %v, want ErrBadGrant", e.Outcomes)
			}
			if len(e.Ops) != 1 || e.Ops[0].Write != nil {
				t.Fatalf("ops %v, want only an AbortAck", e.Ops)
			}
			if _, ok := e.Ops[0].Msg.(*AbortAck); !ok {
				t.Fatalf("sent %v, want AbortAck", e.Ops[0].Msg)
			}
			if s.Pool().Free() != 4 {
				t.Fatalf("%d source pages free of 4", s.Pool().Free())
			}
		})
	}
}

// A typed nil message is refused with an error by every entry point, never a
// panic.
func TestTypedNilMessagesAreRefused(t *testing.T) {
	nils := []Message{(*Bootstrap)(nil), (*Grant)(nil), (*Done)(nil), (*Abort)(nil), (*AbortAck)(nil), nil}
	r := boundsReceiver(t, ReceiverConfig{Pages: 4, PageTokens: 1})
	s := boundsSender(t, SenderConfig{Pages: 4, PageTokens: 1})
	sr, err := NewSharedReceiver(ReceiverConfig{Pages: 4, PageTokens: 1, Memory: newLazyMemory(1), TagKeys: testKeys,
		Region: func(uint32) (uint64, uint32) { return 0, 0 }})
	if err != nil {
		t.Fatal(err)
	}
	ss, err := NewSharedSender(SenderConfig{Pages: 4, PageTokens: 1, Memory: newLazyMemory(1), TagKeys: testKeys})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range nils {
		name := fmt.Sprintf("%T", m)
		calls := map[string]func() error{
			"Receiver.Step":       func() error { return r.Step(1, m, time.Unix(0, 0)) },
			"Sender.Step":         func() error { return s.Step(1, m) },
			"SharedReceiver.Step": func() error { return sr.Step(1, m, time.Unix(0, 0)) },
			"SharedSender.Step":   func() error { return ss.Step(1, m) },
			"AppendMessage":       func() error { _, err := AppendMessage(nil, m); return err },
		}
		for call, f := range calls {
			func() {
				defer func() {
					if p := recover(); p != nil {
						t.Errorf("%s(%s) panics: %v", call, name, p)
					}
				}()
				if err := f(); !errors.Is(err, ErrMalformed) {
					t.Errorf("%s(%s) = %v, want ErrMalformed", call, name, err)
				}
			}()
		}
		if got := RequestOf(m); got != 0 {
			t.Errorf("RequestOf(%s) = %d", name, got)
		}
	}
	if len(r.Effects().Sends) != 0 || len(s.Effects().Ops) != 0 {
		t.Fatal("a refused message had effects")
	}
}

// BenchmarkTick is one Tick of a receiver holding 500,000 reserved requests
// (none due) and 500,000 ended ones (tombstones inside their horizon).
func BenchmarkTick(b *testing.B) {
	const n = 500_000
	r := boundsReceiver(b, ReceiverConfig{Pages: n, PageTokens: 1, Timeout: time.Hour, Horizon: time.Hour})
	now := time.Unix(0, 0)
	for i := range n {
		if err := r.Step(1, &Bootstrap{Request: RequestID(i + 1), Tokens: 1}, now); err != nil {
			b.Fatal(err)
		}
		r.Cancel(RequestID(n + i + 1)) // a tombstone: an ended record
		r.Effects()
	}
	r.Tick(now)
	if r.Records() != 2*n {
		b.Fatalf("%d records", r.Records())
	}
	b.ResetTimer()
	for i := range b.N {
		r.Tick(now.Add(time.Duration(i+1) * time.Millisecond))
	}
	b.ReportMetric(float64(r.Records()), "records")
}

// The horizon queue pops in order, never early: a timer pushed earlier than
// the last (a Tick whose clock went back) waits for the last one's time, and
// the queue reclaims what it popped.
func TestHorizonQueueNeverForgetsEarly(t *testing.T) {
	var q queue[int]
	t0 := time.Unix(100, 0)
	q.push(timer[int]{at: t0.Add(10 * time.Second), id: 1})
	q.push(timer[int]{at: t0.Add(5 * time.Second), id: 2}) // behind the first: moved to its time
	if _, ok := q.popDue(t0.Add(9 * time.Second)); ok {
		t.Fatal("popped before its time")
	}
	for _, id := range []RequestID{1, 2} {
		if got, ok := q.popDue(t0.Add(10 * time.Second)); !ok || got.id != id {
			t.Fatalf("got %v %v, want %d", got.id, ok, id)
		}
	}
	for i := range 5000 {
		q.push(timer[int]{at: t0.Add(time.Duration(20+i) * time.Second), id: RequestID(i)})
		if i%2 == 1 {
			if got, ok := q.popDue(t0.Add(time.Hour)); !ok || got.id != RequestID(i/2) {
				t.Fatalf("got %v %v, want %d", got.id, ok, i/2)
			}
		}
	}
	if len(q.items)-q.head != 2500 || cap(q.items) > 8192 {
		t.Fatalf("%d queued (want 2500), capacity %d", len(q.items)-q.head, cap(q.items))
	}
}

// A cut fails exactly the requests on its queue pair, in request order, and
// costs one pass over the records and WRITEs, not a pass per request.
func TestFlushFailsOnlyThatQueuePairsRequests(t *testing.T) {
	const n = 2000
	s := boundsSender(t, SenderConfig{Pages: 2 * n, PageTokens: 1, MaxInFlight: 1})
	for i := range n {
		peer := PeerID(1 + i%2)
		if _, err := s.Submit(RequestID(i+1), peer, 2); err != nil {
			t.Fatal(err)
		}
		s.Computed(RequestID(i + 1))
		if err := s.Step(peer, &Grant{Request: RequestID(i + 1), Tokens: 2, Pages: []PageGrant{{Page: 0, Addr: 1}, {Page: 1, Addr: 2}}}); err != nil {
			t.Fatal(err)
		}
	}
	s.Effects()
	s.Flushed(2)
	e := s.Effects()
	if len(e.Outcomes) != n/2 {
		t.Fatalf("%d outcomes, want %d", len(e.Outcomes), n/2)
	}
	for i, o := range e.Outcomes {
		if o.Request != RequestID(2*i+2) || !errors.Is(o.Err, ErrPeerFailed) {
			t.Fatalf("outcome %d: %v", i, o)
		}
	}
	if len(s.writes) != n/2 || s.Pool().Free() != n {
		t.Fatalf("%d WRITEs outstanding (want %d), %d pages free (want %d)", len(s.writes), n/2, s.Pool().Free(), n)
	}
	if st := s.Status(1); st != SenderWriting {
		t.Fatalf("a request on the other queue pair: %v", st)
	}
}

// A cut fences the requests on its queue pair that a writer may still
// write (reserved and quarantined ones); records that have ended are left
// alone, as the spec's cut leaves them. Under double-free a fence of an ended
// record releases its pages again, and a cut that fenced one freed the page
// another request, on another queue pair, had been granted since.
func TestCutLeavesEndedRecordsAlone(t *testing.T) {
	r := boundsReceiver(t, ReceiverConfig{Pages: 1, PageTokens: 1, Research: research.On(research.DoubleFree)})
	mustStep := func(peer PeerID, m Message) {
		t.Helper()
		if err := r.Step(peer, m, testNow); err != nil {
			t.Fatal(err)
		}
	}
	mustStep(1, &Bootstrap{Request: 1, Tokens: 1})
	mustStep(1, &AbortAck{Request: 1}) // the sender gave up: closed, page 0 back
	mustStep(2, &Bootstrap{Request: 2, Tokens: 1})
	var ref PageRef
	for _, s := range r.Effects().Sends {
		if g, ok := s.Msg.(*Grant); ok && g.Request == 2 {
			ref = PageRef{Page: g.Pages[0].Page, Epoch: g.Pages[0].Epoch}
		}
	}
	if err := r.Pool().Check(2, ref); err != nil {
		t.Fatalf("request 2's grant: %v", err)
	}
	r.QueuePairFenced(1)
	if err := r.Pool().Check(2, ref); err != nil {
		t.Fatalf("after the cut of request 1's queue pair, request 2's page: %v", err)
	}
	if st := r.Status(2); st != ReceiverReserved {
		t.Fatalf("request 2, on the other queue pair, is %v", st)
	}
}

// Records of requests that ran are bounded too, with no Horizon: past
// MaxRecords the oldest ended record is forgotten (a late message for it is
// then one for an unknown request), and records at work never are.
func TestRecordsStayUnderMaxRecordsWithoutAHorizon(t *testing.T) {
	const max = 100
	r := boundsReceiver(t, ReceiverConfig{Pages: 8, PageTokens: 1, MaxRecords: max})
	for i := range 4 { // at work throughout: reserved, never Done
		if err := r.Step(1, &Bootstrap{Request: RequestID(1_000_000 + i), Tokens: 1}, testNow); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 10_000 { // each ends: granted, then the sender gives up
		id := RequestID(i + 1)
		if err := r.Step(1, &Bootstrap{Request: id, Tokens: 1}, testNow); err != nil {
			t.Fatal(err)
		}
		if err := r.Step(1, &AbortAck{Request: id}, testNow); err != nil {
			t.Fatal(err)
		}
		if i%7 == 0 {
			r.Cancel(RequestID(2_000_000 + i)) // a tombstone
		}
		r.Effects()
		if r.Records() > max {
			t.Fatalf("%d records after %d requests", r.Records(), i+1)
		}
	}
	for i := range 4 {
		if st := r.Status(RequestID(1_000_000 + i)); st != ReceiverReserved {
			t.Fatalf("a record at work was forgotten: %v", st)
		}
	}
	if err := r.Step(1, &Done{Request: 1, Tokens: 1, Pages: 1}, testNow); !errors.Is(err, ErrUnknownRequest) {
		t.Fatalf("a late Done for a forgotten request: %v", err)
	}
	if st := r.Status(10_000); st != ReceiverClosed {
		t.Fatalf("the newest ended record: %v", st)
	}
	if r.Pool().Free() != 4 {
		t.Fatalf("%d pages free, want 4", r.Pool().Free())
	}
}
