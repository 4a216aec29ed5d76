package spec

import "testing"

// newStreamWorld is a world of two two-page requests (streaming matters
// when a request has more than one page to compute).
func newStreamWorld(t *testing.T, bugs Switches) *world {
	t.Helper()
	cfg := NewConfig(2, 4, 2)
	cfg.Prompts, cfg.PrefillPages, cfg.Bugs = []int{4, 4}, 4, bugs
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &world{t: t, m: m, s: m.Initial()[0]}
}

// The intake takes the source pages and sends the Bootstrap; the pages hold
// what was there before until each is computed, in order.
func TestIntakeComputesNothingAndComputePagesInOrder(t *testing.T) {
	w := newStreamWorld(t, 0)
	w.do(Submit, 0, 0).do(PrefillRecv, 0, 0)
	snd := &w.s.Req[0].S
	if snd.Phase != SAwaitGrant || snd.Computed != 0 || w.s.QP[0][0].Head().Kind != MBootstrap {
		t.Fatalf("the intake sends the Bootstrap and computes nothing: %+v", *snd)
	}
	for i := range 2 {
		if got := w.s.Src[0][snd.Src[i]].Data; got.Own(0, i) {
			t.Fatalf("source page of r0[%d] holds %v before it is computed", i, got)
		}
	}
	w.do(Compute, 0, 0)
	if !w.s.Src[0][snd.Src[0]].Data.Own(0, 0) || w.s.Src[0][snd.Src[1]].Data.Own(0, 1) || snd.Computed != 1 {
		t.Fatalf("the first Compute computes page 0 only: %+v", *snd)
	}
	w.do(Compute, 0, 0)
	if !w.s.Src[0][snd.Src[1]].Data.Own(0, 1) || w.enabled(Compute, 0) {
		t.Fatal("the second Compute computes page 1, and then nothing is left")
	}
}

// A WRITE of a granted page is posted only once the page is computed: the
// Grant may come first, and WRITEs then interleave with the computation;
// Done follows the last page's WRITE.
func TestAWriteWaitsForItsPageToBeComputed(t *testing.T) {
	w := newStreamWorld(t, 0)
	w.do(Submit, 0, 0).do(PrefillRecv, 0, 0).do(DecodeRecvQP, 0, 0).do(PrefillRecvQP, 0, 0)
	if w.s.Req[0].S.Phase != SWriting || w.enabled(PostWrite, 0) {
		t.Fatal("granted before any page is computed: no WRITE may be posted")
	}
	w.do(Compute, 0, 0).do(PostWrite, 0, 0)
	if w.s.Req[0].S.Posted != 1 || w.enabled(PostWrite, 0) || w.s.Req[0].S.Phase != SWriting {
		t.Fatalf("page 0 computed: its WRITE goes, page 1's waits, and no Done yet: %+v", w.s.Req[0].S)
	}
	w.do(Compute, 0, 0).do(PostWrite, 0, 0)
	if w.s.Req[0].S.Phase != SFinished || w.s.QP[0][0].Head().Kind != MDone {
		t.Fatalf("the last page's WRITE is followed by Done: %+v", w.s.Req[0].S)
	}
	w.do(DecodeRecvQP, 0, 0).do(DecodeRead, 0, 0)
	if w.s.Req[0].Outcome != OK || !w.holds(Isolation) {
		t.Fatalf("streamed: %v", w.s.Req[0].Outcome)
	}

	// write-uncomputed: once page 0 is computed, page 1's WRITE goes too
	// and ships whatever its source page held, under a checksum of those
	// very bytes; Done waits for page 1's computation, decode verifies the
	// stale page and reads another tenant's KV.
	w = newStreamWorld(t, Switches(WriteUncomputed))
	w.do(Submit, 0, 0).do(PrefillRecv, 0, 0).do(DecodeRecvQP, 0, 0).do(PrefillRecvQP, 0, 0)
	if w.enabled(PostWrite, 0) {
		t.Fatal("write-uncomputed: nothing goes before the first page is computed")
	}
	w.do(Compute, 0, 0).do(PostWrite, 0, 0).do(PostWrite, 0, 0)
	if w.s.Req[0].S.Phase != SWriting || w.s.QP[0][0].N != 0 {
		t.Fatalf("every WRITE is posted, and Done waits for the last page: %+v", w.s.Req[0].S)
	}
	w.do(Compute, 0, 0).do(DecodeRecvQP, 0, 0)
	if w.s.Req[0].R.Phase != RReady {
		t.Fatalf("stale KV under its own checksum verifies: %v (%v)", w.s.Req[0].R.Phase, w.s.Req[0].R.Reason)
	}
	w.do(DecodeRead, 0, 0)
	if w.holds(Isolation) || w.holds(HonestOutcome) {
		t.Fatal("write-uncomputed: Isolation and HonestOutcome must catch the stale KV read as r0's")
	}
}

// The computation stops when the leg ends: a Cancel mid-stream frees the
// source pages, and no later Compute writes them for the old request, even
// after another request took them. free-computing lets it go on.
func TestComputationStopsWhenTheLegEnds(t *testing.T) {
	cancelMidStream := func(bugs Switches) *world {
		w := newStreamWorld(t, bugs)
		w.do(Submit, 0, 0).do(PrefillRecv, 0, 0).do(Compute, 0, 0)
		w.do(Cancel, 0, 0).do(PrefillRecv, 0, 0) // the Abort, before the Grant
		return w
	}
	w := cancelMidStream(0)
	if q := &w.s.Req[0].S; q.Phase != SAborted || q.SrcHeld || w.enabled(Compute, 0) {
		t.Fatalf("a cancelled leg gives its source pages back and computes no more: %+v", *q)
	}

	w = cancelMidStream(Switches(FreeComputing))
	if !w.enabled(Compute, 0) {
		t.Fatal("free-computing: the cancelled leg's computation goes on")
	}
	w.do(Submit, 1, 0).do(PrefillRecv, 1, 0).computed(1) // r1 takes r0's source pages
	page := w.s.Req[1].S.Src[1]
	w.do(Compute, 0, 0)
	if got := w.s.Src[0][page].Data; !got.Own(0, 1) || w.s.Src[0][page].Owner != 1 {
		t.Fatalf("free-computing: r0's page 1 is computed into r1's source page: %v, owner %d", got, w.s.Src[0][page].Owner)
	}
}

// A crash stops the computation: the node's memory is gone.
func TestACrashStopsTheComputation(t *testing.T) {
	w := newStreamWorld(t, 0)
	w.do(Submit, 0, 0).do(PrefillRecv, 0, 0).do(Compute, 0, 0).do(Crash, -1, 0)
	if w.enabled(Compute, 0) {
		t.Fatal("a crashed node computes nothing")
	}
}

// A cut mid-stream (the queue pair's flush) ends the leg, and the
// computation with it.
func TestAFlushMidStreamStopsTheComputation(t *testing.T) {
	w := newStreamWorld(t, 0)
	w.do(Submit, 0, 0).do(PrefillRecv, 0, 0).do(DecodeRecvQP, 0, 0).do(PrefillRecvQP, 0, 0)
	w.do(Compute, 0, 0).do(PostWrite, 0, Late).do(Cut, -1, 0)
	if q := &w.s.Req[0]; q.S.Phase != SFailed || q.Reason != Flushed || w.enabled(Compute, 0) {
		t.Fatalf("a cut fails the leg and stops its computation: %+v", q.S)
	}
}

// With prefix reuse the pages under the Grant's prefix are computed (the
// prefill node computes the whole prompt) and never written: the first
// WRITE is of the first page past the prefix, once it is computed.
func TestPrefixPagesAreComputedAndNotWritten(t *testing.T) {
	m := mustNew(t, prefixConfig())
	w := &world{t: t, m: m, s: m.Initial()[0]}
	w.granted(0).do(PostWrite, 0, 0).do(PostWrite, 0, 0).do(DecodeRecvQP, 0, 0).do(DecodeRead, 0, 0) // r0's pages cached
	w.do(Submit, 2, 0).do(PrefillRecv, 2, 0).do(DecodeRecvQP, 2, 0).do(PrefillRecvQP, 2, 0)
	if snd := &w.s.Req[2].S; snd.Skip != 1 || snd.Posted != 1 || w.enabled(PostWrite, 2) {
		t.Fatalf("r2 hits one page and has computed none: nothing to post yet: %+v", *snd)
	}
	w.do(Compute, 2, 0)
	if w.enabled(PostWrite, 2) {
		t.Fatal("page 0 is under the prefix: computing it posts nothing")
	}
	w.do(Compute, 2, 0).do(PostWrite, 2, 0)
	if snd := &w.s.Req[2].S; snd.Phase != SFinished || w.s.QP[0][0].Head().Kind != MDone {
		t.Fatalf("page 1 computed: its WRITE, then Done: %+v", *snd)
	}
	w.do(DecodeRecvQP, 2, 0).do(DecodeRead, 2, 0)
	if w.s.Req[2].Outcome != OK || !w.holds(Isolation) || !w.holds(PrefixExact) {
		t.Fatalf("r2: %v", w.s.Req[2].Outcome)
	}
}

// write-uncomputed needs a request of two pages: StreamBounds gives the
// default bounds one, and leaves bounds that have one as they are.
func TestStreamBoundsGiveWriteUncomputedATwoPageRequest(t *testing.T) {
	if got := StreamBounds(DefaultConfig()).Prompts; len(got) != 3 || got[0] != 4 || got[1] != 2 || got[2] != 5 {
		t.Fatalf("default bounds widened to prompts %v, want 4,2,5", got)
	}
	def := DefaultConfig()
	if def.Prompts[0] != 2 {
		t.Fatal("StreamBounds changed its argument's prompts")
	}
	two := NewConfig(2, 4, 2)
	two.Prompts, two.PrefillPages = []int{4, 4}, 4
	if got := StreamBounds(two).Prompts; got[0] != 4 || got[1] != 4 {
		t.Fatalf("two-page bounds changed: %v", got)
	}
	if got := Switches(WriteUncomputed).Bounds(DefaultConfig()).Prompts; got[0] != 4 {
		t.Fatalf("Bounds of write-uncomputed: prompts %v", got)
	}
}
