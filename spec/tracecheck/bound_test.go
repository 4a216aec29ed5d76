package tracecheck

import (
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/trace"
)

// eightPagesCut is a correct run's request of 8 pages (the most the spec
// replays) whose queue pair breaks once prefill has posted every WRITE and
// its Done, before any WRITE landed: every completion comes back flushed,
// both ends see the fence, decode frees the reservation. The spec explains
// the first WRITE as Late and never placed, so the other seven and the
// Done queue behind it: 9 messages on prefill→decode.
func eightPagesCut() []trace.Event {
	const n = 8
	tok := uint32(n * 16)
	pages, epochs := make([]uint32, n), make([]uint64, n)
	for i := range pages {
		pages[i], epochs[i] = uint32(10+i), 1
	}
	evs := []trace.Event{
		{Node: "router", Kind: trace.Dispatch, Req: req, Peer: "p", Decode: "d", Tokens: tok, PageTokens: 16},
		{Node: "p", Kind: trace.Submit, Req: req, Peer: "d", Tokens: tok, PageTokens: 16, Pages: []uint32{0, 1, 2, 3, 4, 5, 6, 7}},
		{Node: "p", Kind: trace.Send, Msg: "Bootstrap", Req: req, Peer: "d", Tokens: tok},
		{Node: "d", Kind: trace.Recv, Msg: "Bootstrap", Req: req, Peer: "p", Tokens: tok},
		{Node: "d", Kind: trace.Send, Msg: "Grant", Req: req, Peer: "p", Tokens: tok, Pages: pages, Epochs: epochs},
		{Node: "p", Kind: trace.Recv, Msg: "Grant", Req: req, Peer: "d", Tokens: tok, Pages: pages, Epochs: epochs},
	}
	for i := range n {
		evs = append(evs,
			trace.Event{Node: "p", Kind: trace.Computed, Req: req, NPages: uint32(i + 1)},
			trace.Event{Node: "p", Kind: trace.Post, Req: req, Peer: "d", Write: uint64(i + 1), Index: uint32(i), Pages: []uint32{pages[i]}, Epochs: []uint64{1}})
	}
	evs = append(evs, trace.Event{Node: "p", Kind: trace.Send, Msg: "Done", Req: req, Peer: "d", Tokens: tok, NPages: n})
	for i := range n {
		evs = append(evs, trace.Event{Node: "p", Kind: trace.Complete, Peer: "d", Write: uint64(i + 1), Err: "rdma: WRITE completion: flushed"})
	}
	const peerFailed = "protocol: peer failed: WRITE of page 0: rdma: WRITE completion: flushed"
	return append(evs,
		trace.Event{Node: "p", Kind: trace.Fenced, Peer: "d"},
		trace.Event{Node: "p", Kind: trace.Outcome, Req: req, Peer: "d", Err: peerFailed},
		trace.Event{Node: "d", Kind: trace.Fenced, Peer: "p"},
		trace.Event{Node: "d", Kind: trace.Free, Req: req, Pages: pages, Epochs: epochs},
		trace.Event{Node: "d", Kind: trace.Outcome, Req: req, Peer: "p", Err: "protocol: peer failed"},
		trace.Event{Node: "router", Kind: trace.LegEnd, Req: req, Peer: "p", Err: peerFailed},
		trace.Event{Node: "router", Kind: trace.LegEnd, Req: req, Peer: "d", Err: "protocol: peer failed"},
		trace.Event{Node: "router", Kind: trace.ClientEnd, Req: req, Err: "protocol: peer failed"})
}

// A request of the most pages the spec replays, its WRITEs and Done all on
// the queue pair behind a first WRITE that never lands, is within the
// replay's queue bound: the bound is the request's pages and its Done, not
// the spec's default of 8 a channel.
func TestEightWritesAndTheirDoneFitTheReplaysQueueBound(t *testing.T) {
	rep := check(t, eightPagesCut())
	if f := rep.Failure; f != nil {
		if strings.Contains(f.Why, "WithinBounds") {
			t.Fatalf("the replay's queue bound is too small for 8 WRITEs and a Done:\n%s", report(rep))
		}
		t.Fatalf("a queue pair cut under an 8-page request's WRITEs:\n%s", report(rep))
	}
	if rep.Replayed != 1 {
		t.Fatalf("replayed %d requests, want 1:\n%s", rep.Replayed, report(rep))
	}
}
