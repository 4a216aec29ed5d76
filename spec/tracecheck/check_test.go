package tracecheck

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/trace"
)

// tb builds a hand-written trace: each event gets its node's next sequence
// number and the next tick of one clock, in the order written.
type tb struct {
	evs []trace.Event
	seq map[string]uint64
	t   int64
}

func newTB() *tb {
	b := &tb{seq: map[string]uint64{}}
	b.add(trace.Event{Node: "router", Kind: trace.Start, Role: "router", Inc: "r1"})
	b.add(trace.Event{Node: "p", Kind: trace.Start, Role: "prefill", Inc: "p1"})
	b.add(trace.Event{Node: "d", Kind: trace.Start, Role: "decode", Inc: "d1"})
	return b
}

func (b *tb) add(ev trace.Event) *tb {
	b.seq[ev.Node]++
	b.t++
	ev.Seq, ev.T = b.seq[ev.Node], b.t
	b.evs = append(b.evs, ev)
	return b
}

const req = 7

// The events of a request of 2 pages, step by step (the happy path).
var (
	dispatch  = trace.Event{Node: "router", Kind: trace.Dispatch, Req: req, Peer: "p", Decode: "d", Tokens: 32, PageTokens: 16}
	submit    = trace.Event{Node: "p", Kind: trace.Submit, Req: req, Peer: "d", Tokens: 32, PageTokens: 16, Pages: []uint32{0, 1}}
	bootstrap = trace.Event{Node: "p", Kind: trace.Send, Msg: "Bootstrap", Req: req, Peer: "d", Tokens: 32}
	bootRecv  = trace.Event{Node: "d", Kind: trace.Recv, Msg: "Bootstrap", Req: req, Peer: "p", Tokens: 32}
	grant     = trace.Event{Node: "d", Kind: trace.Send, Msg: "Grant", Req: req, Peer: "p", Tokens: 32, Pages: []uint32{3, 4}, Epochs: []uint64{1, 1}}
	grantRecv = trace.Event{Node: "p", Kind: trace.Recv, Msg: "Grant", Req: req, Peer: "d", Tokens: 32, Pages: []uint32{3, 4}, Epochs: []uint64{1, 1}}
	computed1 = trace.Event{Node: "p", Kind: trace.Computed, Req: req, NPages: 1}
	computed2 = trace.Event{Node: "p", Kind: trace.Computed, Req: req, NPages: 2}
	post1     = trace.Event{Node: "p", Kind: trace.Post, Req: req, Peer: "d", Write: 1, Index: 0, Pages: []uint32{3}, Epochs: []uint64{1}}
	post2     = trace.Event{Node: "p", Kind: trace.Post, Req: req, Peer: "d", Write: 2, Index: 1, Pages: []uint32{4}, Epochs: []uint64{1}}
	done      = trace.Event{Node: "p", Kind: trace.Send, Msg: "Done", Req: req, Peer: "d", Tokens: 32, NPages: 2}
	complete1 = trace.Event{Node: "p", Kind: trace.Complete, Peer: "d", Write: 1}
	complete2 = trace.Event{Node: "p", Kind: trace.Complete, Peer: "d", Write: 2}
	prefOK    = trace.Event{Node: "p", Kind: trace.Outcome, Req: req, Peer: "d"}
	doneRecv  = trace.Event{Node: "d", Kind: trace.Recv, Msg: "Done", Req: req, Peer: "p", Tokens: 32, NPages: 2}
	verified  = trace.Event{Node: "d", Kind: trace.Verified, Req: req, Peer: "p"}
	acquire   = trace.Event{Node: "d", Kind: trace.Acquire, Req: req, Pages: []uint32{3, 4}, Epochs: []uint64{1, 1}}
	release   = trace.Event{Node: "d", Kind: trace.Release, Req: req}
	freed     = trace.Event{Node: "d", Kind: trace.Free, Req: req, Pages: []uint32{3, 4}, Epochs: []uint64{1, 1}}
	decOK     = trace.Event{Node: "d", Kind: trace.Outcome, Req: req, Peer: "p"}
	legP      = trace.Event{Node: "router", Kind: trace.LegEnd, Req: req, Peer: "p"}
	legD      = trace.Event{Node: "router", Kind: trace.LegEnd, Req: req, Peer: "d"}
	clientOK  = trace.Event{Node: "router", Kind: trace.ClientEnd, Req: req}
)

func happy() []trace.Event {
	return []trace.Event{dispatch, submit, bootstrap, computed1, computed2, bootRecv, grant, grantRecv, post1, post2, done, complete1, complete2, prefOK,
		doneRecv, verified, acquire, release, freed, decOK, legP, legD, clientOK}
}

func build(evs []trace.Event) []trace.Event {
	b := newTB()
	for _, ev := range evs {
		b.add(ev)
	}
	return b.evs
}

func check(t *testing.T, evs []trace.Event) *Report {
	t.Helper()
	rep, err := Check(build(evs))
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

func report(rep *Report) string {
	var b strings.Builder
	rep.Write(&b)
	return b.String()
}

func TestAHandoffAsTheSpecRunsItConforms(t *testing.T) {
	rep := check(t, happy())
	if !rep.Conforms() || rep.Replayed != 1 {
		t.Fatalf("the happy path:\n%s", report(rep))
	}
	// The files in any order: the merge follows each node's order and the
	// messages, not the input's.
	evs := build(happy())
	slices.Reverse(evs)
	byNode := map[string][]trace.Event{}
	for _, ev := range evs {
		byNode[ev.Node] = append([]trace.Event{ev}, byNode[ev.Node]...)
	}
	mixed := append(append(byNode["d"], byNode["p"]...), byNode["router"]...)
	if rep, err := Check(mixed); err != nil || !rep.Conforms() {
		t.Fatalf("the happy path, node by node: %v", err)
	}
}

// without returns evs without the events equal to any of drop.
func without(evs []trace.Event, drop ...trace.Event) []trace.Event {
	var out []trace.Event
	for _, ev := range evs {
		if !slices.ContainsFunc(drop, func(d trace.Event) bool { return eq(d, ev) }) {
			out = append(out, ev)
		}
	}
	return out
}

// moved returns evs with ev moved to just before the event before.
func moved(evs []trace.Event, ev, before trace.Event) []trace.Event {
	out := without(evs, ev)
	i := slices.IndexFunc(out, func(x trace.Event) bool { return eq(x, before) })
	return slices.Insert(out, i, ev)
}

func eq(a, b trace.Event) bool {
	return a.Node == b.Node && a.Kind == b.Kind && a.Msg == b.Msg && a.Write == b.Write && a.Req == b.Req && a.Cause == b.Cause && a.NPages == b.NPages
}

// Each rule of the mapping refuses a trace that breaks it, at the event
// that breaks it.
func TestEachMappingRuleRefusesATraceThatBreaksIt(t *testing.T) {
	bad := []struct {
		rule  string
		evs   []trace.Event
		at    trace.Event
		field string // in the failure's rule
	}{
		{"Done is sent only once every WRITE is posted", moved(happy(), done, post2), done, "send Done"},
		{"a WRITE is posted only under a Grant", moved(happy(), post1, grantRecv), post1, "post"},
		{"a WRITE is posted only once its page is computed", moved(moved(happy(), computed2, done), computed1, post2), post2, "post"},
		{"pages are computed in order", moved(happy(), computed1, post1), computed2, "computed"},
		{"a Grant names the request's pages", replace(happy(), grant, withPages(grant, 3)), withPages(grant, 3), "Grant"},
		{"a Grant arrives with the pages decode sent", replace(happy(), grantRecv, withPages(grantRecv, 4, 3)), grantRecv, "recv Grant names the pages decode sent"},
		{"a WRITE goes where the Grant put its page", replace(happy(), post2, withEpochs(withPages(post2, 3), 1)), post2, "post writes where the Grant put that page"},
		{"a WRITE carries its page's epoch", replace(happy(), post1, withEpochs(withPages(post1, 3), 2)), post1, "post writes where the Grant put that page"},
		{"a WRITE writes a page of the Grant", replace(happy(), post2, withIndex(post2, 2)), post2, "post writes a page of the Grant"},
		{"WRITEs are posted in the Grant's order", replace(replace(happy(), post1, withIndex(withEpochs(withPages(post1, 4), 1), 1)), post2, withIndex(withEpochs(withPages(post2, 3), 1), 0)), post1, "PostWrite of that page"},
		{"decode reads the pages it granted", replace(happy(), acquire, withEpochs(withPages(acquire, 4, 3), 1, 1)), acquire, "acquire reads the pages it granted"},
		{"decode reads only a verified request", moved(happy(), acquire, doneRecv), acquire, "acquire"},
		{"verification follows Done", moved(happy(), verified, doneRecv), verified, "verified"},
		{"the client's ok is a read's reply", moved(happy(), clientOK, legP), clientOK, "client-end"},
		{"a success at prefill has its WRITEs completed", moved(happy(), prefOK, complete1), prefOK, "outcome"},
		{"a decode node's own sweep does not end a verified request", append(happy()[:16], trace.Event{Node: "d", Kind: trace.Cancel, Req: req, Cause: "sweep-no-call"}), trace.Event{Node: "d", Kind: trace.Cancel, Req: req, Cause: "sweep-no-call"}, "sweep-no-call"},
		{"a leg is cancelled only for a request that ended", moved(happy(), trace.Event{Node: "router", Kind: trace.CancelLeg, Req: req, Peer: "d"}, bootRecv), trace.Event{Node: "router", Kind: trace.CancelLeg, Req: req}, "cancel-leg"},
	}
	for _, tc := range bad {
		t.Run(tc.rule, func(t *testing.T) {
			rep := check(t, tc.evs)
			f := rep.Failure
			if f == nil {
				t.Fatalf("conforms:\n%s", report(rep))
			}
			if !eq(f.Event, tc.at) && !(f.Event.Kind == tc.at.Kind && f.Event.Node == tc.at.Node) || !strings.Contains(f.Rule, tc.field) {
				t.Fatalf("refused at %s (rule %q), want at %s:\n%s", describe(f.Event), f.Rule, describe(tc.at), report(rep))
			}
		})
	}
}

func replace(evs []trace.Event, old, nw trace.Event) []trace.Event {
	out := slices.Clone(evs)
	for i := range out {
		if eq(out[i], old) {
			out[i] = nw
		}
	}
	return out
}

func withPages(ev trace.Event, pages ...uint32) trace.Event {
	ev.Pages = pages
	ev.Epochs = make([]uint64, len(pages))
	return ev
}

func withEpochs(ev trace.Event, epochs ...uint64) trace.Event {
	ev.Epochs = epochs
	return ev
}

// insertedAfter returns evs with ev inserted just after the event after.
func insertedAfter(evs []trace.Event, after, ev trace.Event) []trace.Event {
	i := slices.IndexFunc(evs, func(x trace.Event) bool { return eq(x, after) })
	return slices.Insert(slices.Clone(evs), i+1, ev)
}

// atEpoch returns evs with every epoch they name set to epoch.
func atEpoch(evs []trace.Event, epoch uint64) []trace.Event {
	out := slices.Clone(evs)
	for i := range out {
		if out[i].Epochs != nil {
			out[i].Epochs = slices.Repeat([]uint64{epoch}, len(out[i].Epochs))
		}
	}
	return out
}

func withIndex(ev trace.Event, i uint32) trace.Event {
	ev.Index = i
	return ev
}

// The spec's nondeterminism is resolved from the trace: a Done whose
// verification failed is explained by a corrupted WRITE, a reservation
// that timed out by decode's timer; both conform.
func TestTheTraceResolvesWhichFaultHappened(t *testing.T) {
	abort := trace.Event{Node: "d", Kind: trace.Send, Msg: "Abort", Req: req, Peer: "p", Reason: "verification failed"}
	corrupt := append(happy()[:15:15],
		trace.Event{Node: "d", Kind: trace.Outcome, Req: req, Peer: "p", Err: "protocol: checksum mismatch: page 1"},
		abort,
		trace.Event{Node: "p", Kind: trace.Recv, Msg: "Abort", Req: req, Peer: "d", Reason: "verification failed"},
		trace.Event{Node: "p", Kind: trace.Send, Msg: "AbortAck", Req: req, Peer: "d"},
		trace.Event{Node: "d", Kind: trace.Recv, Msg: "AbortAck", Req: req, Peer: "p"},
		freed, // the writer fenced: the quarantined pages go back
		trace.Event{Node: "router", Kind: trace.ClientEnd, Req: req, Err: "protocol: checksum mismatch: page 1"})
	if rep := check(t, corrupt); !rep.Conforms() {
		t.Fatalf("a corrupted WRITE:\n%s", report(rep))
	}
	timeout := append(happy()[:8:8],
		trace.Event{Node: "d", Kind: trace.Send, Msg: "Abort", Req: req, Peer: "p", Reason: "timed out"},
		trace.Event{Node: "d", Kind: trace.Outcome, Req: req, Peer: "p", Err: "protocol: timed out"},
		trace.Event{Node: "p", Kind: trace.Recv, Msg: "Abort", Req: req, Peer: "d", Reason: "timed out"},
		trace.Event{Node: "p", Kind: trace.Outcome, Req: req, Peer: "d", Err: "protocol: aborted"},
		trace.Event{Node: "router", Kind: trace.ClientEnd, Req: req, Err: "protocol: timed out"})
	if rep := check(t, timeout); !rep.Conforms() {
		t.Fatalf("a reservation timed out:\n%s", report(rep))
	}
}

// A trace that cannot be merged is refused as such: a receive whose send no
// trace holds, a node's events missing.
func TestATraceThatCannotBeMergedIsRefused(t *testing.T) {
	if _, err := Check(build(without(happy(), grant))); !errors.Is(err, ErrTrace) {
		t.Fatalf("a Grant received and never sent: %v", err)
	}
	evs := build(happy())
	evs = slices.DeleteFunc(evs, func(ev trace.Event) bool { return ev.Node == "p" && ev.Seq == 4 })
	if _, err := Check(evs); !errors.Is(err, ErrTrace) {
		t.Fatalf("prefill's fourth event missing: %v", err)
	}
}

// A page tenancy (a decode page at one epoch) is one request's: a Grant that
// names one another request's Grant named is refused there, as one page
// written with two requests' KV. A later epoch of the page, or the same one
// after the decode node restarted (its pool starts over), is another
// tenancy.
func TestTwoRequestsNeverShareAPageTenancy(t *testing.T) {
	second := func(epoch uint64, restart bool) []trace.Event {
		b := newTB()
		for _, ev := range happy() {
			b.add(ev)
		}
		if restart {
			b.add(trace.Event{Node: "d", Kind: trace.Start, Role: "decode", Inc: "d2"})
		}
		const other = req + 1
		g := withEpochs(withPages(grant, 4, 5), epoch, 1)
		g.Req = other
		for _, ev := range []trace.Event{dispatch, submit, bootstrap, bootRecv, g} {
			ev.Req = other
			b.add(ev)
		}
		return b.evs
	}
	rep, err := Check(second(1, false))
	if err != nil {
		t.Fatal(err)
	}
	if f := rep.Failure; f == nil || f.Request != req+1 || f.Event.Msg != "Grant" || !strings.Contains(f.Rule, "tenancies") || !strings.Contains(f.Why, "page 4 at epoch 1") {
		t.Fatalf("page 4 at epoch 1 granted to two requests:\n%s", report(rep))
	}
	for _, tc := range []struct {
		name    string
		epoch   uint64
		restart bool
	}{{"a later epoch", 2, false}, {"a restarted decode node", 1, true}} {
		rep, err := Check(second(tc.epoch, tc.restart))
		if err != nil {
			t.Fatal(err)
		}
		if f := rep.Failure; f != nil {
			t.Errorf("%s: refused:\n%s", tc.name, report(rep))
		}
	}
}

// prefixHappy is happy() for a request of 3 pages whose first the decode
// node has cached: the Grant's prefix is 16 tokens, its pages the other two,
// and the WRITEs carry the request's page indices 1 and 2.
func prefixHappy() []trace.Event {
	evs := happy()
	for i := range evs {
		ev := &evs[i]
		if ev.Tokens != 0 {
			ev.Tokens = 48
		}
		switch {
		case ev.Kind == trace.Submit:
			ev.Pages = []uint32{0, 1, 2}
		case ev.Msg == "Grant" || ev.Msg == "Done":
			ev.Prefix = 16
		case ev.Kind == trace.Post:
			ev.Index++
		case ev.Kind == trace.Acquire:
			*ev = withEpochs(withPages(*ev, 9, 3, 4), 1, 1, 1)
		}
	}
	computed3 := trace.Event{Node: "p", Kind: trace.Computed, Req: req, NPages: 3}
	evs = slices.Insert(evs, slices.IndexFunc(evs, func(ev trace.Event) bool { return eq(ev, computed2) })+1, computed3)
	// The prefix's page 9, cached by an earlier request, pinned at the
	// Bootstrap and unpinned at the end.
	evs = insertedAfter(evs, dispatch, prefixCached)
	evs = insertedAfter(evs, bootRecv, prefixPin)
	return insertedAfter(evs, freed, prefixUnpin)
}

// The journal's events of prefixHappy's cached page 9.
var (
	prefixCached = trace.Event{Node: "d", Kind: trace.Cache, Req: 3, Pages: []uint32{9}, Epochs: []uint64{1}}
	prefixPin    = trace.Event{Node: "d", Kind: trace.Pin, Req: req, Pages: []uint32{9}, Epochs: []uint64{1}}
	prefixUnpin  = trace.Event{Node: "d", Kind: trace.Unpin, Req: req, Pages: []uint32{9}, Epochs: []uint64{1}}
	prefixEvict  = trace.Event{Node: "d", Kind: trace.Free, Pages: []uint32{9}, Epochs: []uint64{1}}
)

// A WRITE whose completion failed may have landed: RC acknowledges a WRITE
// once it is placed, and a queue pair that breaks flushes what is not
// acknowledged yet. A decode node whose stop ended right after its last
// request's read closed its queue pairs before the ACKs went out (the
// socket provider now sends them before it delivers the SEND behind them,
// but a crash can still do it): that request's WRITEs, placed and
// verified, completed flushed at prefill, whose leg failed. The spec
// completes a WRITE where it places it, so such a request is not replayed
// (its pages are checked); a rolling restart's trace was refused before.
// With no Done received, the replay keeps the WRITE unplaced (the spec's
// Late) and follows the request's failure.
func TestAWriteWhoseCompletionFailedMayHaveLanded(t *testing.T) {
	flushed := trace.Event{Node: "p", Kind: trace.Complete, Peer: "d", Write: 2, Err: "flushed"}
	dFence := trace.Event{Node: "d", Kind: trace.Fenced, Peer: "p"}
	pFence := trace.Event{Node: "p", Kind: trace.Fenced, Peer: "d"}
	pFailed := trace.Event{Node: "p", Kind: trace.Outcome, Req: req, Peer: "d", Err: "protocol: peer failed: WRITE of page 1: flushed"}
	legPFailed := trace.Event{Node: "router", Kind: trace.LegEnd, Req: req, Peer: "p", Err: "protocol: peer failed: WRITE of page 1: flushed"}
	evs := slices.Concat(happy()[:12], []trace.Event{doneRecv, verified, acquire, release, freed, decOK, dFence, flushed, pFence, pFailed, legD, clientOK, legPFailed})
	if rep := check(t, evs); !rep.Conforms() || rep.Replayed != 0 || rep.NotReplayed[landedThenFailed] != 1 {
		t.Fatalf("decode read the request, then its stop broke the queue pair under the last WRITE's acknowledgement:\n%s", report(rep))
	}
	// The same failed completion with no Done received: the request fails
	// at decode (the transfer cut short), which the replay explains with the
	// WRITE unplaced.
	cut := slices.Concat(happy()[:12], []trace.Event{flushed, pFence, pFailed, legPFailed, dFence, freed,
		{Node: "d", Kind: trace.Outcome, Req: req, Peer: "p", Err: "protocol: peer failed: flushed"},
		{Node: "router", Kind: trace.LegEnd, Req: req, Peer: "d", Err: "protocol: peer failed: flushed"},
		{Node: "router", Kind: trace.ClientEnd, Req: req, Err: "protocol: peer failed: flushed"}})
	if rep := check(t, cut); !rep.Conforms() || rep.Replayed != 1 {
		t.Fatalf("the queue pair broke under the last WRITE, no Done received:\n%s", report(rep))
	}
}

// A decode node's incarnation is the one that wrote the event, not the last
// Start the merge placed before it: with the prefill node's clock ahead, the
// old incarnation's Grant, which waits for a Bootstrap, is merged after its
// successor's Start, and both pools grant page 0 at epoch 1.
func TestAGrantMergedAfterItsNodesRestartIsOfTheOldIncarnation(t *testing.T) {
	at := func(node string, seq uint64, clock int64, ev trace.Event) trace.Event {
		ev.Node, ev.Seq, ev.T = node, seq, clock
		return ev
	}
	one := func(r uint64, peer string) trace.Event {
		return trace.Event{Req: r, Peer: peer, Tokens: 16}
	}
	with := func(ev trace.Event, kind, msg string) trace.Event {
		ev.Kind, ev.Msg = kind, msg
		return ev
	}
	grantFor := func(r uint64) trace.Event {
		g := with(one(r, "p"), trace.Send, "Grant")
		g.Pages, g.Epochs = []uint32{0}, []uint64{1}
		return g
	}
	dispatchOf := func(r uint64) trace.Event {
		return trace.Event{Kind: trace.Dispatch, Req: r, Peer: "p", Decode: "d", Tokens: 16, PageTokens: 16}
	}
	submitOf := func(r uint64, page uint32) trace.Event {
		return trace.Event{Kind: trace.Submit, Req: r, Peer: "d", Tokens: 16, PageTokens: 16, Pages: []uint32{page}}
	}
	evs := []trace.Event{
		at("router", 1, 0, trace.Event{Kind: trace.Start, Role: "router", Inc: "r1"}),
		at("router", 2, 148, dispatchOf(1)),
		at("router", 3, 158, dispatchOf(2)),
		at("p", 1, 0, trace.Event{Kind: trace.Start, Role: "prefill", Inc: "p1"}),
		at("p", 2, 149, submitOf(1, 0)),
		at("p", 3, 150, with(one(1, "d"), trace.Send, "Bootstrap")),
		at("p", 4, 159, submitOf(2, 1)),
		at("p", 5, 160, with(one(2, "d"), trace.Send, "Bootstrap")),
		at("d", 1, 1, trace.Event{Kind: trace.Start, Role: "decode", Inc: "d1"}),
		at("d", 2, 100, with(one(1, "p"), trace.Recv, "Bootstrap")),
		at("d", 3, 101, grantFor(1)),
		at("d", 1, 130, trace.Event{Kind: trace.Start, Role: "decode", Inc: "d2"}),
		at("d", 2, 200, with(one(2, "p"), trace.Recv, "Bootstrap")),
		at("d", 3, 201, grantFor(2)),
	}
	rep, err := Check(evs)
	if err != nil {
		t.Fatal(err)
	}
	if f := rep.Failure; f != nil && strings.Contains(f.Rule, "tenancies") {
		t.Fatalf("the old incarnation's Grant taken for the new one's:\n%s", report(rep))
	}
}

// A request of more pages than the spec's bound is not replayed, but which
// pages its events name needs no spec: a WRITE to another page than its
// Grant put its index on is refused there too.
func TestARequestOverTheSpecsBoundHasItsPagesChecked(t *testing.T) {
	big := func(target uint32, granted int) []trace.Event {
		const n = 10
		pages, epochs := make([]uint32, granted), make([]uint64, granted)
		for i := range pages {
			pages[i], epochs[i] = uint32(10+i), 1
		}
		g, gr := withEpochs(withPages(grant, pages...), epochs...), withEpochs(withPages(grantRecv, pages...), epochs...)
		evs := []trace.Event{dispatch, submit, bootstrap, bootRecv, g, gr, computed1, withEpochs(withPages(post1, target), 1)}
		for i := range evs {
			evs[i].Tokens = min(evs[i].Tokens, 1) * n * 16
		}
		return evs
	}
	rep := check(t, big(10, 10))
	if !rep.Conforms() || rep.Replayed != 0 {
		t.Fatalf("a request of 10 pages, its first WRITE where its Grant put it:\n%s", report(rep))
	}
	rep = check(t, big(11, 10))
	if f := rep.Failure; f == nil || f.Event.Kind != trace.Post || !strings.Contains(f.Rule, "post writes where the Grant put that page") {
		t.Fatalf("a request of 10 pages, its first WRITE to the Grant's second page:\n%s", report(rep))
	}
	rep = check(t, big(10, 9))
	if f := rep.Failure; f == nil || f.Event.Msg != "Grant" || !strings.Contains(f.Rule, "Grant names the request's pages") {
		t.Fatalf("a request of 10 pages granted 9:\n%s", report(rep))
	}
}

// overTheBound is a request of 10 pages (over the spec's bound of 8: not
// replayed, so only the checks that need no spec state apply), verified,
// whose pages are freed and then read.
func overTheBound() []trace.Event {
	const n = 10
	pages, epochs := make([]uint32, n), make([]uint64, n)
	for i := range pages {
		pages[i], epochs[i] = uint32(10+i), 1
	}
	evs := []trace.Event{dispatch, submit, bootstrap, bootRecv, withEpochs(withPages(grant, pages...), epochs...), verified,
		withEpochs(withPages(freed, pages...), epochs...), withEpochs(withPages(acquire, pages...), epochs...)}
	for i := range evs {
		evs[i].Tokens = min(evs[i].Tokens, 1) * n * 16
	}
	return evs
}

// The pool's journal events (docs/trace.md) end tenancies and pin them: a
// page is granted again only once its last tenancy was freed, at a later
// epoch; a tenancy ends once, by the request it was granted to, once the
// spec has released it (or by the pool itself, for a cached page); a
// request's released pages are freed or cached by the trace's end; no read
// hands the decoder a tenancy freed before it, or a prefix page it has not
// pinned; a pin is of a cached page, an unpin of a pin taken, and no pinned
// page is freed. Each case breaks one rule in a trace that conforms
// otherwise, or keeps to them all.
func TestATenancyEndsAtOneFreeBeforeThePageIsGrantedOrReadAgain(t *testing.T) {
	const other = req + 1
	// A second request granted page 4 at epoch, after evs.
	second := func(epoch uint64, evs []trace.Event) []trace.Event {
		g := withEpochs(withPages(grant, 4, 5), epoch, 1)
		for _, ev := range []trace.Event{dispatch, submit, bootstrap, bootRecv, g} {
			ev.Req = other
			evs = append(evs, ev)
		}
		return evs
	}
	// The same, while the first request is read, and the rest of it after.
	during := func(epoch uint64, first []trace.Event) []trace.Event {
		i := slices.IndexFunc(first, func(x trace.Event) bool { return eq(x, verified) }) + 1
		return append(second(epoch, slices.Clone(first[:i])), first[i:]...)
	}
	cached := freed
	cached.Kind = trace.Cache
	cachedBy := func(r uint64) trace.Event {
		c := cached
		c.Req = r
		return c
	}
	freedBy := func(r uint64) trace.Event {
		f := freed
		f.Req = r
		return f
	}
	for _, tc := range []struct {
		name string
		evs  []trace.Event
		rule string // "" conforms
	}{
		{"freed, then granted again at a later epoch", second(2, happy()), ""},
		{"granted again without the free", during(2, happy()), "earlier tenancy was freed"},
		{"never freed (leak-on-cancel)", without(happy(), freed), "were freed or cached"},
		{"cached instead of freed", replace(happy(), freed, cached), ""},
		{"cached by another request", replace(happy(), freed, cachedBy(other)), "the request's own pages"},
		{"freed after it was cached", insertedAfter(replace(happy(), freed, cached), cached, freed), "the request's own pages"},
		{"the cache's own free after", insertedAfter(replace(happy(), freed, cached), cached, freedBy(0)), ""},
		{"granted again at an earlier epoch", second(1, atEpoch(happy(), 2)), "later epoch"},
		{"freed by another request", replace(happy(), freed, freedBy(other)), "the request's own pages"},
		{"freed twice", insertedAfter(happy(), freed, freed), "ends a tenancy once"},
		{"freed before the spec gave it back (eager-release)", insertedAfter(without(happy(), freed), verified, freed), "is the spec's release of them"},
		{"read after its free, a request too large to replay", overTheBound(), "reads no page freed"},
		{"a prefix pinned, read, unpinned, then evicted", append(prefixHappy(), prefixEvict), ""},
		{"freed by the pool, never cached", replace(happy(), freed, freedBy(0)), "with no request is of a cached page"},
		{"a pinned page evicted (evict-pinned)", insertedAfter(prefixHappy(), verified, prefixEvict), "takes no pinned page"},
		{"a prefix read without its pin", without(prefixHappy(), prefixPin, prefixUnpin), "prefix pages the request pinned"},
		{"a pin of a page never cached", without(prefixHappy(), prefixCached), "pin is of a page the cache holds"},
		{"an unpin with no pin", insertedAfter(prefixHappy(), prefixUnpin, prefixUnpin), "unpin drops a pin the request took"},
	} {
		rep := check(t, tc.evs)
		switch f := rep.Failure; {
		case tc.rule == "" && f != nil:
			t.Errorf("%s: refused:\n%s", tc.name, report(rep))
		case tc.rule != "" && (f == nil || !strings.Contains(f.Rule, tc.rule)):
			t.Errorf("%s: want refused by the rule %q:\n%s", tc.name, tc.rule, report(rep))
		}
	}
}

// A request the spec does not replay (10 pages, over its 8) has no spec
// state to say when its pages are due back; its decode node's own events
// say it where the protocol's Receiver gives them back at once: a read's
// Finish, a cancel while verified and not being read (or a refused read:
// its read-time check failed), a failed
// verification, a fence of its queue pair while reserved or quarantined (a
// cancel or a timeout while reserved quarantines them until that fence),
// not once its Done came (a fence may be traced before the verification).
// From there, every tenancy its Grant named must be freed or cached by the
// trace's end. An AbortAck's end of a quarantine is not judged: the node
// takes it only after the Grant's keys are revoked; the node's graceful
// stop judges it (a node killed has no stop).
func TestARequestTooLargeToReplayFreesItsPagesAtItsEnd(t *testing.T) {
	const n = 10
	pages, epochs := make([]uint32, n), make([]uint64, n)
	for i := range pages {
		pages[i], epochs[i] = uint32(10+i), 1
	}
	cancel := trace.Event{Node: "d", Kind: trace.Cancel, Req: req, Cause: "call"}
	free := withEpochs(withPages(freed, pages...), epochs...)
	cache := free
	cache.Kind = trace.Cache
	partial := withEpochs(withPages(freed, pages[:n-1]...), epochs[:n-1]...)
	restart := trace.Event{Node: "d", Kind: trace.Start, Role: "decode", Inc: "d2"}
	read := withEpochs(withPages(acquire, pages...), epochs...)
	fence := trace.Event{Node: "d", Kind: trace.Fenced, Peer: "p"}
	timedOut := trace.Event{Node: "d", Kind: trace.Send, Msg: "Abort", Req: req, Peer: "p", Reason: "timed out"}
	verifyFailed := trace.Event{Node: "d", Kind: trace.Send, Msg: "Abort", Req: req, Peer: "p", Reason: "verification failed"}
	abortAck := []trace.Event{{Node: "p", Kind: trace.Send, Msg: "AbortAck", Req: req, Peer: "d"}, {Node: "d", Kind: trace.Recv, Msg: "AbortAck", Req: req, Peer: "p"}}
	stopped := trace.Event{Node: "d", Kind: trace.Stopped}
	// Every WRITE posted, then Done sent and received.
	var doneIn []trace.Event
	for i := range n {
		doneIn = append(doneIn, trace.Event{Node: "p", Kind: trace.Computed, Req: req, NPages: uint32(i + 1)},
			trace.Event{Node: "p", Kind: trace.Post, Req: req, Peer: "d", Write: uint64(i + 1), Index: uint32(i), Pages: pages[i : i+1], Epochs: epochs[i : i+1]})
	}
	sent, got := done, doneRecv
	sent.NPages, got.NPages = n, n
	doneIn = append(doneIn, sent, got)
	// reserved is the request granted, then end; afterVerified, the same
	// with its pages verified first.
	reserved := func(end ...trace.Event) []trace.Event {
		evs := append([]trace.Event{dispatch, submit, bootstrap, bootRecv, withEpochs(withPages(grant, pages...), epochs...)}, end...)
		for i := range evs {
			evs[i].Tokens = min(evs[i].Tokens, 1) * n * 16
		}
		return evs
	}
	afterVerified := func(end ...trace.Event) []trace.Event { return reserved(append([]trace.Event{verified}, end...)...) }
	refusedRead := read
	refusedRead.Pages, refusedRead.Epochs, refusedRead.Err = nil, nil, "protocol: tag mismatch: page 3 of request 7"
	// onQP numbers the decode node's queue pair of the request 1; ownFence
	// and otherFence fence that one and another.
	ownFence, otherFence := fence, fence
	ownFence.QP, otherFence.QP = 1, 2
	onQP := func(evs []trace.Event) []trace.Event {
		for i := range evs {
			if evs[i].Node == "d" && evs[i].Req == req {
				evs[i].QP = 1
			}
		}
		return evs
	}
	const leak = "given back at its end were freed or cached"
	for _, tc := range []struct {
		name   string
		evs    []trace.Event
		rule   string // "" conforms
		at     string // the event refused
		judged bool   // the rule applies: the pages went back
	}{
		{"read, then freed", afterVerified(read, release, free), "", "", true},
		{"read, then cached", afterVerified(read, release, cache), "", "", true},
		{"read, never freed", afterVerified(read, release), leak, trace.Release, true},
		{"read, one page of ten never freed", afterVerified(read, release, partial), leak, trace.Release, true},
		{"cancelled verified, then freed", afterVerified(cancel, free), "", "", true},
		{"cancelled verified, never freed (leak-on-cancel)", afterVerified(cancel), leak, trace.Cancel, true},
		{"cancelled while read, freed at its Finish", afterVerified(read, cancel, release, free), "", "", true},
		{"cancelled while read, never freed", afterVerified(read, cancel, release), leak, trace.Release, true},
		{"cancelled while read, not yet finished", afterVerified(read, cancel), "", "", false},
		{"verified, not yet read", afterVerified(), "", "", false},
		{"cancelled after its node restarted: the old pool is gone", afterVerified(restart, cancel), "", "", false},
		{"verified, then its queue pair fenced: a ready record stays", afterVerified(fence), "", "", false},
		{"its read-time check failed, freed", afterVerified(refusedRead, free), "", "", true},
		{"its read-time check failed, never freed", afterVerified(refusedRead), leak, trace.Acquire, true},
		{"cancelled reserved, another queue pair of its node fenced: not its fence", onQP(reserved(cancel, otherFence)), "", "", false},
		{"cancelled reserved, its own queue pair fenced, never freed", onQP(reserved(cancel, ownFence)), leak, trace.Fenced, true},
		{"cancelled reserved, fenced, freed", reserved(cancel, fence, free), "", "", true},
		{"cancelled reserved, fenced, never freed (leak-on-cancel)", reserved(cancel, fence), leak, trace.Fenced, true},
		{"fenced reserved, never freed", reserved(fence), leak, trace.Fenced, true},
		{"timed out, fenced, never freed", reserved(timedOut, fence), leak, trace.Fenced, true},
		{"timed out, freed at once (timeout-free), then fenced", reserved(timedOut, free, fence), "", "", true},
		{"verification failed, freed", reserved(slices.Concat(doneIn, []trace.Event{verifyFailed, free})...), "", "", true},
		{"verification failed, never freed", reserved(slices.Concat(doneIn, []trace.Event{verifyFailed})...), leak, trace.Send, true},
		{"cancelled reserved, its AbortAck taken, never freed: not judged", reserved(append([]trace.Event{cancel}, abortAck...)...), "", "", false},
		// Its decode node's graceful stop judges it, whatever ended it.
		{"cancelled reserved, its AbortAck taken, freed, the node stopped", reserved(slices.Concat([]trace.Event{cancel}, abortAck, []trace.Event{free, stopped})...), "", "", false},
		{"cancelled reserved, its AbortAck taken, never freed, the node stopped", reserved(slices.Concat([]trace.Event{cancel}, abortAck, []trace.Event{stopped})...), stopRule, trace.Stopped, false},
		{"cancelled reserved, no fence yet", reserved(cancel), "", "", false},
		// One batch of completions steps a Done held for the keys'
		// revocation (verified: ready, which a fence leaves alone), then
		// fences the queue pair, and only then traces the verification.
		{"Done in, fenced, then verified: not due at the fence", reserved(slices.Concat(doneIn, []trace.Event{fence, verified})...), "", "", false},
		{"Done in, fenced, verified, cancelled, freed", reserved(slices.Concat(doneIn, []trace.Event{fence, verified, cancel, free})...), "", "", true},
		{"Done in, fenced, verified, cancelled, never freed", reserved(slices.Concat(doneIn, []trace.Event{fence, verified, cancel})...), leak, trace.Cancel, true},
		{"Done in, cancelled while held, fenced, never freed", reserved(slices.Concat(doneIn, []trace.Event{cancel, fence})...), leak, trace.Fenced, true},
	} {
		rep := check(t, tc.evs)
		if rep.Replayed != 0 {
			t.Fatalf("%s: %d requests replayed, want none:\n%s", tc.name, rep.Replayed, report(rep))
		}
		if tc.judged != (rep.EndsNotReplayed == 1) {
			t.Errorf("%s: %d requests checked at their end, want the rule applied: %t", tc.name, rep.EndsNotReplayed, tc.judged)
		}
		switch f := rep.Failure; {
		case tc.rule == "" && f != nil:
			t.Errorf("%s: refused:\n%s", tc.name, report(rep))
		case tc.rule != "" && (f == nil || !strings.Contains(f.Rule, tc.rule) || f.Event.Kind != tc.at):
			t.Errorf("%s: want refused at its %s by the rule %q:\n%s", tc.name, tc.at, tc.rule, report(rep))
		}
	}
}

// A restarted prefill node numbers its WRITEs from 1 again, and with its
// old incarnation's clock ahead, the merge places the old incarnation's
// completion of its WRITE 1 (flushed: the node died) after the new one's
// post of its own WRITE 1. The completion is the old request's: taken for
// the new one's, it would mark that WRITE never placed.
func TestAWritesCompletionIsOfTheIncarnationThatPostedIt(t *testing.T) {
	const a, b = 1, 2
	at := func(node string, seq uint64, clock int64, ev trace.Event) trace.Event {
		ev.Node, ev.Seq, ev.T = node, seq, clock
		return ev
	}
	postOf := func(r uint64) trace.Event {
		return trace.Event{Kind: trace.Post, Req: r, Peer: "d", Write: 1, Pages: []uint32{0}, Epochs: []uint64{1}}
	}
	evs := []trace.Event{
		at("p", 1, 0, trace.Event{Kind: trace.Start, Role: "prefill", Inc: "p1"}),
		at("p", 2, 10, postOf(a)),
		at("p", 3, 300, trace.Event{Kind: trace.Complete, Peer: "d", Write: 1, Err: "flushed"}),
		at("p", 1, 200, trace.Event{Kind: trace.Start, Role: "prefill", Inc: "p2"}),
		at("p", 2, 210, postOf(b)),
		at("p", 3, 220, trace.Event{Kind: trace.Complete, Peer: "d", Write: 1}),
	}
	merged, incs, roles, links, err := merge(evs)
	if err != nil {
		t.Fatal(err)
	}
	if merged[len(merged)-1].Kind != trace.Complete || merged[len(merged)-1].Err == "" {
		t.Fatalf("the merge placed the old incarnation's completion elsewhere than last: %+v", merged)
	}
	c := newChecker(merged, incs, roles, links, &Report{NotReplayed: map[string]int{}, Unmodelled: map[string]int{}})
	c.collect()
	if late := c.reqs[a].late; !late[1] {
		t.Errorf("request %d's WRITE 1, flushed: late %v, want it never placed", a, late)
	}
	if late := c.reqs[b].late; late[1] {
		t.Errorf("request %d's WRITE 1, completed: late %v, want it placed", b, late)
	}
}

// stopRule is the rule of a decode node's graceful stop.
const stopRule = "decode stopped holds no page a Grant named"

// A decode node's graceful stop ends with every page its Grants named freed
// or cached: a verified request whose call never came holds its pages, which
// a trace that merely ends may still give back, but one whose node says it
// stopped may not. A node that refused the call as it stops ends the
// request as the router's cancel does (the spec's Cancel): with the
// router's cancel call, the pages come back before the stop; without, the
// stop is refused. A prefill node's refusal ends the request alike. The
// stop of a restarted node judges only its own incarnation's Grants.
func TestADecodeNodesStopHoldsNoPageAGrantNamed(t *testing.T) {
	stopped := trace.Event{Node: "d", Kind: trace.Stopped}
	const refusal = `node: shutting down: decode node "d"`
	legRefused := trace.Event{Node: "router", Kind: trace.LegEnd, Req: req, Peer: "d", Err: refusal}
	clientRefused := trace.Event{Node: "router", Kind: trace.ClientEnd, Req: req, Err: refusal}
	cutCall := trace.Event{Node: "router", Kind: trace.CutCall, Req: req, Peer: "d"}
	cancel := trace.Event{Node: "d", Kind: trace.Cancel, Req: req, Cause: "call"}
	upToVerified := happy()[:slices.IndexFunc(happy(), func(ev trace.Event) bool { return eq(ev, verified) })+1]
	restart := trace.Event{Node: "d", Kind: trace.Start, Role: "decode", Inc: "d2"}
	for _, tc := range []struct {
		name   string
		evs    []trace.Event
		refuse bool
	}{
		{"read and freed, then stopped", append(happy(), stopped), false},
		{"verified, the trace ends", upToVerified, false},
		{"verified, then stopped", append(slices.Clone(upToVerified), stopped), true},
		{"verified, stopped, then freed", append(slices.Clone(upToVerified), stopped, freed), true},
		{"verified, stopped twice", append(slices.Clone(upToVerified), stopped, stopped), true},
		{"the call refused, cancelled, freed, then stopped",
			append(slices.Clone(upToVerified), legP, legRefused, clientRefused, cutCall, cancel, freed, stopped), false},
		{"the call refused, no cancel, then stopped",
			append(slices.Clone(upToVerified), legP, legRefused, clientRefused, stopped), true},
		{"verified, the node restarted, its successor stopped", append(slices.Clone(upToVerified), restart, stopped), false},
		{"the prefill call refused, the decode leg cancelled, then stopped", []trace.Event{dispatch,
			{Node: "router", Kind: trace.LegEnd, Req: req, Peer: "p", Err: `node: shutting down: prefill node "p"`},
			{Node: "router", Kind: trace.CancelLeg, Req: req, Peer: "d"},
			cancel,
			{Node: "router", Kind: trace.LegEnd, Req: req, Peer: "d", Err: "cancelled: by the router before the transfer began"},
			{Node: "router", Kind: trace.ClientEnd, Req: req, Err: `node: shutting down: prefill node "p"`},
			stopped}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := check(t, tc.evs)
			wantStops := 0
			if slices.ContainsFunc(tc.evs, func(ev trace.Event) bool { return eq(ev, stopped) }) {
				wantStops = 1 // an incarnation's, however many events
			}
			if rep.Stops != wantStops {
				t.Fatalf("%d stops checked, want %d:\n%s", rep.Stops, wantStops, report(rep))
			}
			if !tc.refuse {
				if !rep.Conforms() {
					t.Fatalf("want it to conform:\n%s", report(rep))
				}
				return
			}
			f := rep.Failure
			if f == nil || f.Event.Kind != trace.Stopped || f.Rule != stopRule || f.Request != req ||
				!strings.Contains(f.Why, "holding page 3 at epoch 1, granted to request 7") {
				t.Fatalf("want it refused at the stop, holding page 3 at epoch 1:\n%s", report(rep))
			}
		})
	}
}

// A node's stop cancels what it holds once calls outlive its grace. The
// spec has no node stop: a request still pending ends as by the router's
// cancel (Cancel, then the node's receipt of its Abort), at either node.
// Once the request has its outcome, a decode node's stop that releases its
// verified pages released them past its end: refused, as the sweep's.
func TestANodesStopCancelsWhatItHoldsAsTheRoutersCancel(t *testing.T) {
	upToVerified := happy()[:slices.IndexFunc(happy(), func(ev trace.Event) bool { return eq(ev, verified) })+1]
	stopCancel := trace.Event{Node: "d", Kind: trace.Cancel, Req: req, Cause: "shutdown"}
	decodeErr := trace.Event{Node: "d", Kind: trace.Outcome, Req: req, Peer: "p", Err: "protocol: cancelled"}
	legErr := trace.Event{Node: "router", Kind: trace.LegEnd, Req: req, Peer: "d", Err: "protocol: cancelled: the decode node stops"}
	clientErr := trace.Event{Node: "router", Kind: trace.ClientEnd, Req: req, Err: "protocol: cancelled: the decode node stops"}
	lost := trace.Event{Node: "router", Kind: trace.NodeLost, Peer: "p", Role: "prefill", Cause: "registry"}
	lostEnd := trace.Event{Node: "router", Kind: trace.ClientEnd, Req: req, Err: "protocol: peer failed: protocol: node lost"}
	for _, tc := range []struct {
		name   string
		evs    []trace.Event
		refuse bool
	}{
		{"verified, the decode node's stop cancels it, frees its pages", append(slices.Clone(upToVerified), stopCancel, freed, decodeErr, legP, legErr, clientErr), false},
		{"reserved, the decode node's stop cancels it", []trace.Event{dispatch, submit, bootstrap, bootRecv, grant, stopCancel}, false},
		{"read under way, the decode node's stop cancels it, the read ends failed", append(slices.Clone(upToVerified), legP, acquire, stopCancel, decodeErr,
			trace.Event{Node: "d", Kind: trace.Cancel, Req: req, Cause: "failed"}, release, freed, legErr, clientErr), false},
		{"awaiting its Grant, the prefill node's stop cancels it", []trace.Event{dispatch, submit, bootstrap, {Node: "p", Kind: trace.Cancel, Req: req, Cause: "shutdown"}}, false},
		{"verified, failed by its prefill node's loss, then the decode node's stop frees its pages", append(slices.Clone(upToVerified), legP, lost, lostEnd, stopCancel, freed), true},
		// The stop's cancel came after the read, the answer still on its
		// way to the router: it changes nothing (a run with the model's
		// generations, the router's leg-end 200 ms behind).
		{"read, its answer on its way, the decode node's stop cancels it: nothing, the router's success follows", append(slices.Clone(upToVerified), acquire, release, freed, decOK, legP, stopCancel, legD, clientOK), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := check(t, tc.evs)
			if rep.Replayed != 1 {
				t.Fatalf("%d replayed, want 1:\n%s", rep.Replayed, report(rep))
			}
			if !tc.refuse {
				if !rep.Conforms() {
					t.Fatalf("want it to conform:\n%s", report(rep))
				}
				return
			}
			if f := rep.Failure; f == nil || !eq(f.Event, stopCancel) || !strings.Contains(f.Why, "held past the request's end") {
				t.Fatalf("want it refused at the stop's cancel:\n%s", report(rep))
			}
		})
	}
}

// A queue pair breaks at each end when that end sees it: what prefill sent
// before its end broke (its stop ends right after its last leg's outcome,
// closing its queue pairs) may still reach decode, which verifies and
// reads the request and only then sees the break. The spec's Cut flushes
// both directions in one step, so an end's fenced event is the Cut or,
// while that end's messages are on the wire, not yet (a rolling restart's
// trace was refused so). What decode takes after its own end broke is
// still refused: nothing reaches a receiver past its own fence.
func TestAQueuePairBreaksAtEachEndWhenThatEndSeesIt(t *testing.T) {
	pFence := trace.Event{Node: "p", Kind: trace.Fenced, Peer: "d"}
	dFence := trace.Event{Node: "d", Kind: trace.Fenced, Peer: "p"}
	evs := insertedAfter(insertedAfter(happy(), prefOK, pFence), decOK, dFence)
	if rep := check(t, evs); !rep.Conforms() {
		t.Fatalf("prefill's end broke with its Done on the wire, decode read the request, then saw the break:\n%s", report(rep))
	}
	late := insertedAfter(insertedAfter(happy(), prefOK, pFence), pFence, dFence)
	rep := check(t, late)
	if rep.Conforms() || rep.Failure == nil || rep.Failure.Event.Node != "d" {
		t.Fatalf("decode took the Done after its own end broke:\n%s", report(rep))
	}
}

// A receipt is traced as the message arrives, before the state machine
// takes it; the queue pair's break in the same batch can reach the state
// machine first, which fails the request instead. Decode's fence right
// after its receipt of the Done (no verification between) is that: the
// spec's Cut flushes the Done, and the pages freed at the fence are the
// spec's release of them (a rolling restart's trace was refused so). A
// fence later than the verification leaves the request verified.
func TestAReceiptTheFenceOvertookIsNotTaken(t *testing.T) {
	dFence := trace.Event{Node: "d", Kind: trace.Fenced, Peer: "p"}
	failed := "protocol: peer failed: queue pair to peer 1 fenced"
	evs := slices.Concat(happy()[:14], []trace.Event{doneRecv, dFence, freed,
		{Node: "d", Kind: trace.Outcome, Req: req, Peer: "p", Err: failed},
		legP,
		{Node: "router", Kind: trace.LegEnd, Req: req, Peer: "d", Err: failed},
		{Node: "router", Kind: trace.ClientEnd, Req: req, Err: failed}})
	if rep := check(t, evs); !rep.Conforms() {
		t.Fatalf("decode's fence overtook the Done it had received:\n%s", report(rep))
	}
	late := insertedAfter(evs, doneRecv, verified)
	if rep := check(t, late); rep.Conforms() {
		t.Fatalf("decode verified the request, then freed its pages at a fence, no read:\n%s", report(rep))
	}
}

// Nothing lands on decode after its own end of the queue pair broke, even
// with its Grant still on the wire: prefill may take the Grant and post,
// but a Done decode receives and verifies after its own fence is refused.
func TestNothingReachesDecodePastItsOwnFence(t *testing.T) {
	dFence := trace.Event{Node: "d", Kind: trace.Fenced, Peer: "p"}
	rep := check(t, insertedAfter(without(happy(), complete1, complete2, prefOK, legP), grant, dFence))
	if rep.Conforms() || rep.Failure == nil || rep.Failure.Event.Node != "d" {
		t.Fatalf("decode took a Done after its own fence:\n%s", report(rep))
	}
}

// A WRITE the responder refused (a bad key, a region without room) never
// landed, whatever its queue pair did next: a Done received and verified
// behind it is refused, not taken for a WRITE that landed and lost its ACK.
func TestAWriteTheResponderRefusedNeverLanded(t *testing.T) {
	refused := trace.Event{Node: "p", Kind: trace.Complete, Peer: "d", Write: 2, Err: "rdma: WRITE completion: remote access error"}
	evs := slices.Concat(happy()[:12], []trace.Event{refused, doneRecv, verified, acquire, release, freed, decOK, legD, clientOK})
	rep := check(t, evs)
	if rep.Conforms() || rep.Replayed != 1 {
		t.Fatalf("a Done behind a refused WRITE was received and verified:\n%s", report(rep))
	}
}
