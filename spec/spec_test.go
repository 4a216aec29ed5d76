package spec

import (
	"bytes"
	"errors"
	"slices"
	"testing"
)

// world drives a model by hand: each step picks the enabled action it names.
type world struct {
	t *testing.T
	m *Model
	s State
}

func newWorld(t *testing.T, bugs Switches) *world {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Bugs = bugs
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &world{t: t, m: m, s: m.Initial()[0]}
}

// do applies the first enabled action of kind k for request r with argument arg.
func (w *world) do(k ActionKind, r int, arg uint16) *world {
	w.t.Helper()
	found := false
	cur := w.s
	w.m.Successors(&cur, func(a Action, n *State) {
		if !found && a.Kind == k && int(a.Req) == r && a.Arg == arg {
			w.s, found = *n, true
		}
	})
	if !found {
		w.t.Fatalf("%v(r%d, %d) is not enabled", k, r, arg)
	}
	return w
}

func (w *world) enabled(k ActionKind, r int) bool {
	ok := false
	cur := w.s
	w.m.Successors(&cur, func(a Action, _ *State) { ok = ok || a.Kind == k && int(a.Req) == r })
	return ok
}

func (w *world) holds(name string) bool {
	for _, inv := range Invariants {
		if inv.Name == name {
			return inv.Holds(w.m, &w.s)
		}
	}
	w.t.Fatalf("no invariant %s", name)
	return false
}

// granted takes r to the point where prefill holds decode's grant, with
// every page of r computed.
func (w *world) granted(r int) *world {
	return w.do(Submit, r, 0).do(PrefillRecv, r, 0).computed(r).do(DecodeRecvQP, r, 0).do(PrefillRecvQP, r, 0)
}

// computed computes r's pages that are left (streaming prefill, stream.go).
func (w *world) computed(r int) *world {
	w.t.Helper()
	for w.enabled(Compute, r) {
		w.do(Compute, r, 0)
	}
	return w
}

func TestRouterAdmitsByAdvertisedContextAndPrefillRejectsOverLong(t *testing.T) {
	w := newWorld(t, 0)
	w.do(Submit, 2, 0)
	if w.s.Req[2].Outcome != Pending || w.s.ToPrefill[0].N != 1 {
		t.Fatal("the router checks only the advertised context: the over-long prompt must pass it")
	}
	w.do(PrefillRecv, 2, 0)
	q := &w.s.Req[2]
	if q.Outcome != Rejected || q.Reason != OverLimit || q.S.Phase != SRejected || w.s.QP[0][0].N != 0 {
		t.Fatalf("prefill intake must reject explicitly and never bootstrap: %+v", q)
	}
	for p := range w.s.Src[0] {
		if w.s.Src[0][p].Owner != Free {
			t.Fatal("a rejected request must hold no source pages")
		}
	}
}

func TestAdmitFinishedHandsOffPlaceholder(t *testing.T) {
	w := newWorld(t, Switches(AdmitFinished))
	w.do(Submit, 2, 0).do(PrefillRecv, 2, 0)
	q := &w.s.Req[2]
	if q.Outcome != Pending || !q.S.Placeholder || q.S.Pages != 1 || w.s.QP[0][0].Head().Kind != MBootstrap {
		t.Fatalf("admit-finished must keep the rejected request alive as a 1-page placeholder: %+v", q.S)
	}
}

func TestReserveAdvancesEveryEpoch(t *testing.T) {
	w := newWorld(t, 0)
	w.do(Submit, 0, 0).do(PrefillRecv, 0, 0).do(DecodeRecvQP, 0, 2)
	rec := &w.s.Req[0].R
	pg := &w.s.Pages[0][rec.Pages[0].Page]
	if rec.Phase != RReserved || rec.N != 1 || pg.Epoch != 1 || pg.Owner != 0 || rec.Pages[0].Epoch != 1 {
		t.Fatalf("reservation: %+v page %+v", rec, pg)
	}
	if w.s.QPBack[0][0].Head().Kind != MGrant {
		t.Fatal("decode must grant the reserved pages")
	}
}

func TestHandoffWithoutFaultsEndsOK(t *testing.T) {
	w := newWorld(t, 0).granted(0)
	w.do(PostWrite, 0, 0)
	if w.s.Req[0].S.Phase != SFinished || w.s.QP[0][0].Head().Kind != MDone {
		t.Fatal("the last WRITE is followed by Done on the same queue pair")
	}
	w.do(DecodeRecvQP, 0, 0).do(DecodeRead, 0, 0)
	q := &w.s.Req[0]
	if q.Outcome != OK || !q.ReadData[0].Own(0, 0) || !w.m.terminated(&w.s) == (w.s.Req[1].Submitted) {
		t.Fatalf("outcome %v read %v", q.Outcome, q.ReadData[0])
	}
	for p := 0; p < w.m.cfg.DecodePages; p++ {
		if w.s.Pages[0][p].Owner != Free {
			t.Fatal("decode must release pages after reading")
		}
	}
}

func TestDoneVerifiesTagRecordsAndChecksums(t *testing.T) {
	// A late WRITE is still behind Done? No: RC order puts Done after it. So use
	// corruption for the checksum, and abort-still-sends for a missing tag.
	w := newWorld(t, 0).granted(0)
	w.do(PostWrite, 0, Corrupt).do(DecodeRecvQP, 0, 0)
	if q := &w.s.Req[0]; q.Outcome != Failed || q.Reason != ChecksumMismatch || q.R.Phase != RClosed {
		t.Fatalf("a corrupted payload must fail by checksum: %+v", q)
	}

	w = newWorld(t, Switches(AbortStillSends)).granted(0)
	w.do(Cancel, 0, 0).do(PrefillRecv, 0, 0) // prefill aborts before writing, but still sends Done
	w.do(DecodeRecvQP, 0, 0)                 // Done arrives before the router's Abort
	if q := &w.s.Req[0]; q.R.Reason != TagMismatch {
		t.Fatalf("an unwritten page's stale tag record must fail verification: %+v", q.R)
	}
}

func TestAbortQuarantinesUntilAbortAck(t *testing.T) {
	w := newWorld(t, 0).granted(0)
	w.do(PostWrite, 0, Late) // the WRITE stays in the network
	w.do(Cancel, 0, 0).do(DecodeRecv, 0, 0)
	page := w.s.Req[0].R.Pages[0].Page
	if w.s.Req[0].R.Phase != RQuarantine || !w.s.Pages[0][page].Quarantined {
		t.Fatal("an abort with a WRITE in flight must quarantine the pages")
	}
	w.do(PrefillRecv, 0, 0) // prefill learns; its WRITE has not completed, so no AbortAck yet
	if w.s.Req[0].S.Phase != SAborting {
		t.Fatalf("sender must wait for its WRITE: %v", w.s.Req[0].S.Phase)
	}
	w.do(DecodeRecvQP, 0, 0) // the late WRITE lands in the quarantined page: harmless
	if !w.holds(NoForeignWrite) || w.s.Req[0].S.Phase != SAborted {
		t.Fatal("the WRITE lands in r0's own quarantined page, then the sender acks")
	}
	w.do(DecodeRecvQP, 0, 0) // Done (sent before the abort) fences r0
	if w.s.Pages[0][page].Owner != Free || w.s.Req[0].R.Phase != RClosed {
		t.Fatal("the fence must free the quarantined pages")
	}
	w.do(DecodeRecvQP, 0, 0) // AbortAck: a second fence changes nothing
	if w.s.Pages[0][page].Owner != Free || !w.holds(Conservation) {
		t.Fatal("a second fence must be idempotent")
	}
}

func TestEagerReleaseFreesBeforeTheFence(t *testing.T) {
	w := newWorld(t, Switches(EagerRelease)).granted(0)
	w.do(PostWrite, 0, Late).do(Cancel, 0, 0).do(DecodeRecv, 0, 0)
	if page := w.s.Req[0].R.Pages[0].Page; w.s.Pages[0][page].Owner != Free {
		t.Fatal("eager-release must free the page while the WRITE is in flight")
	}
}

func TestDoubleFreeFreesAnotherRequestsPage(t *testing.T) {
	w := newWorld(t, Switches(DoubleFree)).granted(0)
	w.do(PostWrite, 0, 0).do(DecodeRecvQP, 0, 0).do(DecodeRead, 0, 0) // r0 done, page released
	w.do(Submit, 1, 0).do(PrefillRecv, 1, 0)
	page := w.s.Req[0].R.Pages[0].Page
	// Give r1 the page r0 had.
	for c := uint16(0); ; c++ {
		n := w.s
		(&sys{m: w.m, s: &n}).decodeRecvQP(0, 0, int(c))
		if n.Req[1].R.Pages[0].Page == page {
			w.do(DecodeRecvQP, 1, c)
			break
		}
	}
	w.s.Req[0].Outcome = Pending // let the client still cancel r0
	w.do(Cancel, 0, 0).do(PrefillRecv, 0, 0)
	if w.s.QP[0][0].Head().Kind != MAbortAck {
		t.Fatal("a finished sender acks an abort")
	}
	w.do(DecodeRecvQP, 0, 0)
	if w.holds(Conservation) {
		t.Fatal("the second release must free r1's page and break Conservation")
	}
}

func TestCutFlushesAndFences(t *testing.T) {
	w := newWorld(t, 0).granted(0)
	w.do(PostWrite, 0, Late).do(Cut, -1, 0)
	q := &w.s.Req[0]
	if w.s.QP[0][0].N != 0 || q.Outcome != Failed || q.Reason != Flushed || q.R.Phase != RClosed || q.S.Phase != SFailed {
		t.Fatalf("a cut flushes and fails both legs: %+v", q)
	}
	if w.s.Pages[0][q.R.Pages[0].Page].Owner != Free {
		t.Fatal("nothing can land after a cut, so the pages are free at once")
	}
}

func TestCrashIsFencedByCutAfterDetection(t *testing.T) {
	w := newWorld(t, 0).granted(0)
	w.do(Crash, -1, 0)
	if w.enabled(PrefillRecvQP, 0) || w.enabled(PostWrite, 0) {
		t.Fatal("a crashed node does nothing")
	}
	w.do(DetectCrash, -1, 0)
	if w.s.Req[0].Outcome != Failed || w.s.ToDecode[0].Head().Kind != MPeerFailed {
		t.Fatal("the router fails the request and tells decode")
	}
	w.do(DecodeRecv, -1, 0)
	if !w.m.terminated(&w.s) && w.s.Req[0].R.Phase != RClosed {
		t.Fatalf("decode must fence by cutting the queue pair: %v", w.s.Req[0].R.Phase)
	}

	w = newWorld(t, Switches(NoPeerCancel)).granted(0)
	w.do(Crash, -1, 0).do(DetectCrash, -1, 0)
	if w.s.ToDecode[0].N != 0 {
		t.Fatal("no-peer-cancel: decode is never told")
	}
}

func TestTimeoutSendsPeerCancel(t *testing.T) {
	w := newWorld(t, 0).granted(0)
	w.do(Timeout, 0, 0)
	if q := &w.s.Req[0]; q.Outcome != Failed || q.Reason != TimedOut || q.R.Phase != RQuarantine || w.s.QPBack[0][0].Head().Kind != MAbort {
		t.Fatalf("timeout: %+v", q)
	}
	w = newWorld(t, Switches(NoPeerCancel)).granted(0)
	w.do(Timeout, 0, 0)
	if w.s.QPBack[0][0].N != 0 {
		t.Fatal("no-peer-cancel: the sender is not told")
	}
}

func TestTombstoneRefusesLateBootstrap(t *testing.T) {
	w := newWorld(t, 0)
	w.do(Submit, 0, 0).do(PrefillRecv, 0, 0).do(Cancel, 0, 0).do(DecodeRecv, 0, 0)
	if w.s.Req[0].R.Phase != RTombstone {
		t.Fatal("an abort for an unknown request leaves a tombstone")
	}
	w.do(DecodeRecvQP, 0, 0)
	if w.s.Req[0].R.Phase != RTombstone || w.s.QPBack[0][0].Head().Kind != MAbort {
		t.Fatal("a Bootstrap after the tombstone is refused, never reserved")
	}
}

func TestFingerprintIsCanonical(t *testing.T) {
	w := newWorld(t, 0)
	w.do(Submit, 0, 0).do(PrefillRecv, 0, 0)
	a := w.s
	w2 := newWorld(t, 0)
	w2.do(Submit, 1, 0).do(PrefillRecv, 1, 0)
	b := w2.s
	if !bytes.Equal(w.m.AppendFingerprint(nil, &a), w.m.AppendFingerprint(nil, &b)) {
		t.Fatal("r0 and r1 have equal prompts: swapping them must not change the fingerprint")
	}
	// Reserving page 0 or page 3 is the same up to relabelling pages.
	x, y := a, a
	(&sys{m: w.m, s: &x}).decodeRecvQP(0, 0, 0)
	(&sys{m: w.m, s: &y}).decodeRecvQP(0, 0, 3)
	if x.Req[0].R.Pages[0].Page == y.Req[0].R.Pages[0].Page {
		t.Fatal("choices 0 and 3 should pick different pages")
	}
	if !bytes.Equal(w.m.AppendFingerprint(nil, &x), w.m.AppendFingerprint(nil, &y)) {
		t.Fatal("interchangeable pages must give one fingerprint")
	}
	// But r2 (over-long) is not interchangeable with r0.
	w3 := newWorld(t, 0)
	w3.do(Submit, 2, 0)
	w4 := newWorld(t, 0)
	w4.do(Submit, 0, 0)
	if bytes.Equal(w.m.AppendFingerprint(nil, &w3.s), w.m.AppendFingerprint(nil, &w4.s)) {
		t.Fatal("requests of different lengths must stay distinct")
	}
}

// Every invariant can fail: each case builds a state that breaks exactly it.
func TestEveryInvariantCanFail(t *testing.T) {
	w := newWorld(t, 0).granted(0)
	w.do(PostWrite, 0, 0).do(DecodeRecvQP, 0, 0)
	ready := w.s
	cases := map[string]func(s *State){
		Isolation:         func(s *State) { s.Req[0].Read, s.Req[0].ReadN, s.Req[0].ReadData[0] = true, 1, Label{Req: Tenant} },
		HonestOutcome:     func(s *State) { s.Req[0].Outcome = OK },
		NoForeignWrite:    func(s *State) { s.Foreign = ForeignWrite{Happened: true, Req: 1, Page: 0, Owner: 0} },
		RejectedStaysOut:  func(s *State) { s.Req[0].Outcome, s.Req[0].Reason = Rejected, OverLimit },
		Conservation:      func(s *State) { s.Pages[0][s.Req[0].R.Pages[0].Page].Owner = Free },
		WithinBounds:      func(s *State) { s.Overflow = true },
		OutcomeFinal:      func(s *State) { s.Ghost.Changed, s.Ghost.ChangedReq, s.Ghost.ChangedFrom = true, 0, OK },
		NoSpuriousFailure: func(s *State) { s.Ghost.Spurious, s.Ghost.SpuriousReq = true, 0 },
		NoOldIncarnation:  func(s *State) { s.Ghost.OldInc, s.Ghost.OldIncReq, s.Ghost.OldIncWhat = true, 0, OldIncPlaced },
		ReadAsVerified:    func(s *State) { s.Ghost.Tampered, s.Ghost.TamperedReq = true, 0 },
		Ticketed:          func(s *State) { s.Req[1].R.Slot = 1 }, // r1 was never dispatched
	}
	for _, inv := range Invariants {
		if !inv.Holds(w.m, &ready) {
			t.Fatalf("%s fails on a correct state", inv.Name)
		}
		if prefixProperty(inv.Name) {
			continue // they judge the prefix cache: TestEveryPrefixInvariantCanFail
		}
		breakIt, ok := cases[inv.Name]
		if !ok {
			t.Fatalf("no failing case for %s", inv.Name)
		}
		s := ready
		breakIt(&s)
		for _, other := range Invariants {
			if got := other.Holds(w.m, &s); got == (other.Name == inv.Name) {
				t.Errorf("breaking %s: %s holds=%v", inv.Name, other.Name, got)
			}
		}
	}
}

func TestParseSwitchesAndFaults(t *testing.T) {
	s, err := ParseSwitches("admit-finished,no-tag-check")
	if err != nil || !s.Has(AdmitFinished) || !s.Has(NoTagCheck) || s.Has(NoChecksum) || s.String() != "admit-finished,no-tag-check" {
		t.Fatalf("%v %v", s, err)
	}
	if _, err := ParseSwitches("admit-finishd"); !errors.Is(err, ErrUnknownSwitch) {
		t.Fatalf("want ErrUnknownSwitch, got %v", err)
	}
	if len(AllSwitches()) != 25 {
		t.Fatal("the catalogue has 25 switches (with streaming's write-uncomputed and free-computing)")
	}
	b, err := ParseFaults("cancel=2,late")
	if err != nil || b[FaultCancel] != 2 || b[FaultLate] != 1 || b[FaultCrash] != 0 {
		t.Fatalf("%v %v", b, err)
	}
	// "all" in a list is the one-pair faults once, beside the others named.
	b, err = ParseFaults("all,restart=2")
	if err != nil || b[FaultCrash] != 1 || b[FaultCorrupt] != 1 || b[FaultLease] != 0 || b[FaultRestart] != 2 || b.String() != "cancel=1,crash=1,timeout=1,cut=1,late=1,corrupt=1,rogue=1,restart=2" {
		t.Fatalf("%v %v", b, err)
	}
	if all, _ := ParseFaults("all"); all[FaultRestart] != 0 || all[FaultLease] != 0 {
		t.Fatalf("all is the one-pair faults, not restart or lease: %v", all)
	}
	// peer-by-name acts only at a restart: a check of it gets a crash and a restart.
	if w := (Switches(0).With(PeerByName)).Faults(Budget{}); w[FaultCrash] != 1 || w[FaultRestart] != 1 {
		t.Fatalf("peer-by-name's budget: %v", w)
	}
	if w := (Switches(0).With(NoChecksum)).Faults(Budget{}); w != (Budget{}) {
		t.Fatalf("no-checksum needs no fault of its own: %v", w)
	}
	for _, bad := range []string{"cancel=x", "cancel=9", "meteor"} {
		if _, err := ParseFaults(bad); !errors.Is(err, ErrBadFaults) {
			t.Errorf("%q: want ErrBadFaults, got %v", bad, err)
		}
	}
}

func TestValidateRejectsConfigsOutsideTheEncoding(t *testing.T) {
	for name, mutate := range map[string]func(*Config){
		"no requests":   func(c *Config) { c.Prompts = nil },
		"too many":      func(c *Config) { c.Prompts = []int{1, 1, 1, 1, 1} },
		"pages":         func(c *Config) { c.DecodePages = 9 },
		"page size":     func(c *Config) { c.PageSize = 0 },
		"empty prompt":  func(c *Config) { c.Prompts[0] = 0 },
		"slots":         func(c *Config) { c.DecodeSlots = 0 },
		"prefill pages": func(c *Config) { c.PrefillPages = 0 },
		"restart without a crash": func(c *Config) {
			c.Faults[FaultCrash], c.Faults[FaultRestart] = 0, 1
		},
		// 8·7·6·5·4 = 6,720 orders of a 5-page intake: past the 4,096 an
		// action names.
		"source choices": func(c *Config) {
			c.AnySourcePages, c.PrefillPages, c.Prompts = true, 8, []int{10, 2, 2}
		},
	} {
		c := DefaultConfig()
		mutate(&c)
		if _, err := New(c); !errors.Is(err, ErrBadConfig) {
			t.Errorf("%s: want ErrBadConfig, got %v", name, err)
		}
	}
}

// Under AnySourcePages every choice of an intake is an action of its own,
// up to the most Validate allows (8·7·6·5 = 1,680 orders of a 4-page intake
// from 8 pages, 8·7·6 = 336 of a 3-page one, 7·6·5 = 210 from 7): distinct
// actions, one per choice. (When the choice had 8 bits of the argument,
// choice 256 printed as choice 0; the refinement harness, which draws pools
// of up to 6 pages, needs 720.)
func TestAnySourcePagesNamesEveryChoiceApart(t *testing.T) {
	for _, shape := range []struct{ pool, tokens, want int }{{8, 8, 1680}, {8, 6, 336}, {7, 6, 210}} {
		cfg := DefaultConfig()
		cfg.AnySourcePages, cfg.PrefillPages, cfg.DecodePages, cfg.Prompts, cfg.ContextLimit = true, shape.pool, 8, []int{shape.tokens}, 16
		m, after := afterFirstSubmit(t, cfg)
		seen := map[Action][]int8{}
		m.Successors(&after, func(a Action, n *State) {
			if a.Kind == PrefillRecv {
				if prev, dup := seen[a]; dup {
					t.Fatalf("pool %d: %v names two choices, %v and %v", shape.pool, a, prev, n.Req[0].S.Src[:n.Req[0].S.Pages])
				}
				seen[a] = slices.Clone(n.Req[0].S.Src[:n.Req[0].S.Pages])
			}
		})
		if len(seen) != shape.want {
			t.Errorf("pool %d, %d tokens: %d choices, want %d", shape.pool, shape.tokens, len(seen), shape.want)
		}
	}
}

// With AnySourcePages a prefill node's intake may take any free source
// pages, in any order: every choice is a successor. Without it, the lowest.
func TestAnySourcePagesExploresEveryChoice(t *testing.T) {
	for _, anySrc := range []bool{false, true} {
		cfg := DefaultConfig()
		cfg.AnySourcePages = anySrc
		m, after := afterFirstSubmit(t, cfg)
		took := map[int8]bool{}
		m.Successors(&after, func(a Action, n *State) {
			if a.Kind == PrefillRecv {
				took[n.Req[0].S.Src[0]] = true
			}
		})
		if want := map[bool]int{false: 1, true: cfg.PrefillPages}[anySrc]; len(took) != want || !took[0] {
			t.Errorf("AnySourcePages %v: r0's intake took source pages %v, want %d choices including page 0", anySrc, took, want)
		}
	}
}

// afterFirstSubmit is cfg's model and the state after r0's Submit, its
// first action.
func afterFirstSubmit(t *testing.T, cfg Config) (*Model, State) {
	t.Helper()
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	s := m.Initial()[0]
	var after State
	found := false
	m.Successors(&s, func(a Action, n *State) {
		if a.Kind == Submit && a.Req == 0 {
			after, found = *n, true
		}
	})
	if !found {
		t.Fatal("r0's Submit is not enabled in the initial state")
	}
	return m, after
}

func TestMaxQueueBoundsEveryChannel(t *testing.T) {
	var q Queue
	for i := 0; i < 3; i++ {
		if !q.Push(Msg{Kind: MAbort}, 3) {
			t.Fatalf("push %d refused under a bound of 3", i)
		}
	}
	if q.Push(Msg{Kind: MAbort}, 3) {
		t.Fatal("a fourth message fits a bound of 3")
	}
	if q.Push(Msg{}, QueueCapacity+5); q.N != 4 {
		t.Fatal("a bound past the capacity must not grow the queue past it")
	}
	cfg := DefaultConfig()
	cfg.MaxQueue = QueueCapacity + 1
	if _, err := New(cfg); err == nil {
		t.Fatal("a queue bound past QueueCapacity must be refused")
	}
	cfg.MaxQueue = 1 // a cancel's Abort behind the Prefill on the router's queue overflows it
	w := &world{t: t}
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	w.m, w.s = m, m.Initial()[0]
	w.do(Submit, 0, 0).do(Cancel, 0, 0)
	if w.holds(WithinBounds) {
		t.Fatal("a bound of 1 must overflow with two messages to one node")
	}
}

func TestParseMutation(t *testing.T) {
	for _, mu := range AllMutations() {
		if got, err := ParseMutation(mu.String()); err != nil || got != mu {
			t.Errorf("%v: %v %v", mu, got, err)
		}
	}
	if _, err := ParseMutation("no-such-rule"); !errors.Is(err, ErrUnknownMutation) {
		t.Fatalf("want ErrUnknownMutation, got %v", err)
	}
	for name := range Equivalent {
		_, errM := ParseMutation(name)
		_, errS := ParseSwitches(name)
		if errM != nil && errS != nil {
			t.Errorf("Equivalent lists %q, which is neither a mutation nor a switch", name)
		}
	}
	cfg := DefaultConfig()
	cfg.Mutation = NumMutations
	if _, err := New(cfg); !errors.Is(err, ErrBadConfig) {
		t.Fatalf("an unknown mutation must be refused: %v", err)
	}
}

// A mutation changes the model: key-outlives-record lets a rogue WRITE with
// the key of a cancelled request's Grant land in its released page.
func TestKeyOutlivesRecordLetsARevokedKeyLand(t *testing.T) {
	w := newWorld(t, 0).granted(0)
	w.m.cfg.Mutation = KeyOutlivesRecord
	w.do(PostWrite, 0, Late).do(Cancel, 0, 0).do(DecodeRecv, 0, 0) // quarantined
	page := int(w.s.Req[0].R.Pages[0].Page)
	if n := w.tryRogue(0, page); n.Pages[0][page].Data.Req != Rogue {
		t.Fatal("with key-outlives-record the quarantined page's key must still let the WRITE land")
	}
}

// SuccessorsIn (the checker's Builder) emits what Successors emits, in the
// same order, each successor built in the state next handed out for it,
// next called once per successor built (a step that changes nothing hands
// the state itself back, built nowhere), and Successors later writes in
// none of those states; and neither allocates, as the checker
// calls them for every state it explores. Tried on reachable states of the
// default bounds with every fault, and with coverage counted (the steps'
// hooked path).
func TestSuccessorsInBuildsWhereItIsTold(t *testing.T) {
	for _, coverage := range []bool{false, true} {
		m, err := New(NewConfig(3, 4, 2))
		if err != nil {
			t.Fatal(err)
		}
		if coverage {
			m = m.WithCoverage(new(Coverage))
		}
		states := reachableBy(m, 2000, func(s *State) string { return string(m.AppendFingerprint(nil, s)) })
		var bufs [2]State
		flip, handed := 0, 0
		next := func() *State {
			b := &bufs[flip]
			flip ^= 1
			handed++
			return b
		}
		for i := range states {
			type succ struct {
				a Action
				s State
			}
			var want, got []succ
			before := bufs
			m.Successors(&states[i], func(a Action, s *State) { want = append(want, succ{a, *s}) })
			if bufs != before {
				t.Fatalf("state %d: Successors wrote in a state SuccessorsIn was handed before", i)
			}
			handed = 0
			back := 0
			m.SuccessorsIn(&states[i], next, func(a Action, s *State) {
				switch s {
				case &states[i]: // a step that changes nothing hands the state back
					back++
				case &bufs[flip^1]:
				default:
					t.Fatalf("state %d: successor %d (%v) not built in the state last handed out", i, len(got), a)
				}
				got = append(got, succ{a, *s})
			})
			if !slices.Equal(got, want) || handed+back != len(want) {
				t.Fatalf("state %d: SuccessorsIn emitted %d successors (%d handed back) from %d states handed out, Successors %d, or they differ", i, len(got), back, handed, len(want))
			}
		}
		if coverage {
			continue
		}
		emit := func(Action, *State) {}
		if a := testing.AllocsPerRun(3, func() {
			for i := range states {
				m.SuccessorsIn(&states[i], next, emit)
				m.Successors(&states[i], emit)
			}
		}); a != 0 {
			t.Errorf("%.0f allocations expanding %d states", a, len(states))
		}
	}
}
