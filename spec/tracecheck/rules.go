package tracecheck

import (
	"fmt"
	"slices"
	"strings"

	"github.com/kvhandoff/kvhandoff/internal/trace"
	"github.com/kvhandoff/kvhandoff/spec"
)

// The mapping from events to the spec's actions, one rule per event kind
// and role (docs/trace.md, "The mapping"). A rule returns its name and the
// moves of each spec state, or nil moves for an event the spec does not
// model (counted in the report).
type moves = func(s *spec.State) []move

func one(m move) []move { return []move{m} }

var keep = []move{{keep: true}}

func (c *checker) rule(r *replay, ev *trace.Event) (string, moves) {
	if rule := c.pageChecks(r, ev); rule != "" {
		return rule, refuse
	}
	role := c.roles[ev.Node]
	switch role {
	case "router":
		return c.routerRule(r, ev)
	case "prefill":
		return c.prefillRule(r, ev)
	case "decode":
		return c.decodeRule(r, ev)
	}
	return "event of a node of unknown role " + ev.Kind, nil
}

func (c *checker) routerRule(r *replay, ev *trace.Event) (string, moves) {
	switch ev.Kind {
	case trace.Dispatch, trace.Refuse:
		return "router " + ev.Kind + " is Submit", func(*spec.State) []move { return one(move{act: kind(spec.Submit)}) }
	case trace.CancelLegs:
		// The client went away: the spec's Cancel, unless the request has
		// its outcome already (the Router then does nothing).
		return "router cancel is Cancel", func(s *spec.State) []move {
			if s.Req[0].Outcome != spec.Pending {
				return keep
			}
			return one(move{act: kind(spec.Cancel)})
		}
	case trace.CancelLeg:
		// A leg's cancel call: the Abort the spec's Cancel queued for the
		// node, or, for a request that has failed, the Router's second path
		// the spec does not have (it ends a failed request's other leg by
		// the queue pair's messages): an Abort queued for the node.
		decode := ev.Peer == r.decode
		already := r.abortTo[ev.Peer]
		r.abortTo[ev.Peer] = true
		return "router cancel-leg is the Abort of Cancel, or of a failed request", require(func(s *spec.State) bool {
			q := toPrefill(s)
			if decode {
				q = toDecode(s)
			}
			return already || holds(q, spec.MAbort) || s.Req[0].Outcome != spec.Pending
		})
	case trace.CutCall:
		r.cutCall = true
		return "router cut-call ends a request with an outcome", require(func(s *spec.State) bool { return s.Req[0].Outcome != spec.Pending })
	case trace.NodeLost:
		lost := uint16(0)
		if ev.Peer == r.decode {
			lost = spec.DecodeNode
		}
		return "router node-lost is LeaseLost", func(s *spec.State) []move {
			if lost == 0 && (s.CrashDetected[0] || s.PrefillCrashed[0]) || lost != 0 && s.DecodeLost[0] || finished(r, s) {
				return keep
			}
			return one(move{act: func(a spec.Action, _, _ *spec.State) bool { return a.Kind == spec.LeaseLost && a.Arg == lost }})
		}
	case trace.LegEnd:
		if strings.Contains(ev.Err, refusedAsItStops) {
			// The node refused the leg's call as it stops. The spec has no
			// node stop: the router ends the request as for the client's
			// cancel, the spec's Cancel (an Abort for each leg; the real
			// router's, a cancel call for the other leg if still open, and
			// for a decode leg whose call the node refused, which may hold
			// verified pages waiting for it, a cut-call's).
			return "router leg-end of a call refused as its node stops is Cancel", func(s *spec.State) []move {
				if s.Req[0].Outcome != spec.Pending {
					return keep
				}
				return one(move{act: kind(spec.Cancel)})
			}
		}
		if ev.Peer != r.decode || ev.Err != "" {
			return "router leg-end of a prefill leg or a failed decode leg", nil
		}
		// The decode leg's answer: the spec's DecodeRead, whose reply is
		// the router's (a read the router's Abort ended already stays so).
		return "router leg-end of the decode leg is DecodeRead", func(s *spec.State) []move {
			if s.Req[0].R.Phase != spec.RReady {
				return keep
			}
			return one(move{act: kind(spec.DecodeRead)})
		}
	case trace.ClientEnd:
		ok, why := ev.Err == "", reasonIn(ev.Err)
		return "router client-end is the spec's outcome", require(func(s *spec.State) bool {
			o := s.Req[0].Outcome
			return ok && o == spec.OK || !ok && o != spec.OK && o != spec.Pending && (why == spec.NoReason || why == s.Req[0].Reason)
		})
	}
	return "router " + ev.Kind, nil
}

// refusedAsItStops is in the error of a call a node refused as it stops
// (node.ErrShuttingDown's text; node's trace tests fail if it changes).
const refusedAsItStops = "node: shutting down"

// finished reports whether the request has ended everywhere in s, with
// nothing of it in flight: a global event changes nothing of it any more.
func finished(r *replay, s *spec.State) bool {
	return r.m.Finished(s) && s.QP[0][0].N == 0 && s.QPBack[0][0].N == 0 && s.ToPrefill[0].N == 0 && s.ToDecode[0].N == 0
}

func (c *checker) prefillRule(r *replay, ev *trace.Event) (string, moves) {
	switch ev.Kind {
	case trace.Submit:
		if ev.Err != "" && r.intake == refusedNoPeer {
			// No live queue pair to the decode node: the spec's intake on a
			// pair cut for good, whose Bootstrap is flushed.
			return "prefill submit with no queue pair is PrefillRecv on a cut pair", func(s *spec.State) []move {
				return one(move{edit: cutBefore, act: headIs(spec.PrefillRecv, toPrefill, spec.MPrefill)})
			}
		}
		return "prefill submit is PrefillRecv of Prefill", func(s *spec.State) []move {
			return one(move{act: headIs(spec.PrefillRecv, toPrefill, spec.MPrefill)})
		}
	case trace.Recv:
		mk, ok := map[string]spec.MsgKind{"Grant": spec.MGrant, "Abort": spec.MAbort}[ev.Msg]
		if !ok {
			return "prefill recv " + ev.Msg, func(*spec.State) []move { return nil }
		}
		if c.fencedFirst(r, ev) {
			return "prefill recv " + ev.Msg + " before its pair's fence is nothing (the fence took it)", func(*spec.State) []move { return keep }
		}
		return "prefill recv " + ev.Msg + " is PrefillRecvQP", func(s *spec.State) []move {
			return lateOnCut(s, move{act: headIs(spec.PrefillRecvQP, qpBack, mk)})
		}
	case trace.Send:
		return c.sendRule(ev, qp, map[string]spec.MsgKind{"Bootstrap": spec.MBootstrap, "Done": spec.MDone, "AbortAck": spec.MAbortAck})
	case trace.Computed:
		// A page computed on a live leg: the spec's Compute of that page.
		// A leg the spec has ended (a flush, a cut) computes no more.
		// The spec's request has only the pages written: a page under
		// the Grant's prefix (cached at decode, computed all the same) is
		// none of its.
		k := int64(ev.NPages) - r.prefixPages()
		if k <= 0 {
			return "prefill computed of a page under the prefix", nil
		}
		n := uint8(k)
		return "prefill computed is Compute", func(s *spec.State) []move {
			if s.Req[0].S.Computed >= n || flushed(s) {
				return keep
			}
			return one(move{act: func(a spec.Action, _, nx *spec.State) bool {
				return a.Kind == spec.Compute && nx.Req[0].S.Computed == n
			}})
		}
	case trace.Post:
		// The spec's request has the written pages only, so the WRITE's
		// index in it is j (pageChecks checked where the WRITE goes), and
		// the spec posts them in order.
		j := r.writeIndex(ev)
		// A WRITE whose completion failed may not have been placed, which
		// the spec's PostWrite says with its Late variant (else it places
		// a WRITE posted on an empty queue pair at once): queued, placed
		// only if a later event needs it (replay.silent). One that
		// completed was placed, at once or later (both are kept until an
		// event tells them apart).
		neverPlaced := r.late[ev.Write]
		if r.refusedWrites[ev.Write] {
			if r.refusedAt == nil {
				r.refusedAt = map[int]bool{}
			}
			r.refusedAt[int(j)] = true
		}
		return "prefill post is PostWrite of that page", func(s *spec.State) []move {
			if flushed(s) {
				return keep // posted on a queue pair the spec has cut: flushed
			}
			return one(move{act: func(a spec.Action, _, nx *spec.State) bool {
				return a.Kind == spec.PostWrite && (!neverPlaced || a.Arg&spec.Late != 0) && int64(nx.Req[0].S.Posted) == j+1
			}})
		}
	case trace.Complete:
		if ev.Err != "" {
			return "prefill complete with an error (a flushed WRITE)", nil
		}
		r.completes++
		n := r.completes
		return "prefill complete is a WRITE placed", require(func(s *spec.State) bool { return int(s.Req[0].S.Completed) >= n || flushed(s) })
	case trace.Cancel:
		return "prefill cancel is PrefillRecv of Abort", c.cancelMoves(r, ev, true)
	case trace.Outcome:
		// A success comes once every WRITE posted has completed (the spec's
		// senderProgress), which the trace's completions say.
		ok := ev.Err == ""
		allDone := r.completes >= r.pages
		return "prefill outcome is the sender's end", require(func(s *spec.State) bool {
			p := s.Req[0].S.Phase
			// A cancelled leg's outcome comes at the cancel, its AbortAck
			// once its WRITEs complete (the spec's aborting phase). The
			// spec completes a WRITE where it is placed; a real completion
			// comes back later: a sender the spec has finished may still
			// wait for completions the trace has not shown, and be
			// cancelled meanwhile.
			return ok && p == spec.SFinished && allDone ||
				!ok && (p == spec.SAborting || p == spec.SFinished && !allDone || !p.Live() && p != spec.SFinished && p != spec.SNone)
		})
	case trace.Fenced:
		return "prefill fenced is Cut", onWire(cutMoves(r), qp)
	}
	return "prefill " + ev.Kind, nil
}

// onWire: prefill's end of a queue pair fenced is the spec's Cut, or, once
// the request's sender has finished while its messages (its Done) are
// still on the wire, not yet: the spec's cut is one step that flushes both
// directions, but a real queue pair breaks at each end when that end sees
// it, and what prefill sent before it broke the pair may still reach
// decode, which takes it as delivered. A prefill node whose stop ends right
// after its last leg's outcome closes its queue pairs with that leg's Done
// on the wire: decode receives it, verifies and reads the request, and then
// sees the break (its own fenced event, the Cut then if the request still
// needs one). Refused otherwise, as a rolling restart's trace showed. Not
// at decode's end: nothing lands on decode after its own fence, and a
// receipt after it stays refused.
func onWire(m moves, q func(*spec.State) *spec.Queue) moves {
	return func(s *spec.State) []move {
		mv := m(s)
		if s.Req[0].S.Phase == spec.SFinished && q(s).N > 0 && !slices.ContainsFunc(mv, func(x move) bool { return x.keep }) {
			mv = append(mv, move{keep: true})
		}
		return mv
	}
}

// lateOnCut: a message received is the spec's receipt of it; or, once the
// spec has cut the request's queue pair, one that was on the wire when one
// end broke it and reached the other end before that end saw the break. The
// spec's cut flushes both directions at once; a real queue pair breaks at
// one end first (decode's cut on the router's news, say), and a SEND it had
// sent may still arrive. Its receiver's state machine then takes it for a
// request whose leg the spec has ended: nothing the spec must follow.
func lateOnCut(s *spec.State, m move) []move {
	if cutPair(s) {
		return []move{m, {keep: true}}
	}
	return one(m)
}

// fencedFirst reports whether the next event of r at ev's node, after ev,
// is a fence of the request's queue pair there. A receipt is traced as the
// message arrives, before the state machine takes it, and the pair's break
// in the same batch of completions can reach the state machine first: it
// then fails the request, and the message is never taken (a decode node
// whose prefill peer stopped right after sending a Done fenced the request
// before verifying it). The spec's Cut, at that fence, flushes it.
func (c *checker) fencedFirst(r *replay, ev *trace.Event) bool {
	after := false
	for _, i := range r.events {
		e := &c.merged[i]
		if e == ev {
			after = true
			continue
		}
		if after && e.Node == ev.Node {
			return e.Kind == trace.Fenced
		}
	}
	return false
}

// cutPair reports whether the spec has cut the request's queue pair: a Cut
// fault, or the fence of a lost node's.
func cutPair(s *spec.State) bool {
	return s.Fenced[0][0] || s.Budget[spec.FaultCut] < budget[spec.FaultCut]
}

// flushed reports whether the request's queue pair is cut in s, or its
// sender has ended: what the implementation still posts is flushed.
func flushed(s *spec.State) bool {
	return s.Fenced[0][0] || !s.Req[0].S.Phase.Live() || s.Budget[spec.FaultCut] < budget[spec.FaultCut]
}

// sendRule: a SEND is the message the spec's last action queued.
func (c *checker) sendRule(ev *trace.Event, q func(*spec.State) *spec.Queue, kinds map[string]spec.MsgKind) (string, moves) {
	mk, ok := kinds[ev.Msg]
	if !ok {
		return "send " + ev.Msg, nil
	}
	return "send " + ev.Msg + " is queued by the spec", func(s *spec.State) []move {
		if holds(q(s), mk) || flushed(s) {
			return keep
		}
		if ev.Msg == "Abort" && ev.Reason == "timed out" {
			return one(move{act: kind(spec.Timeout)})
		}
		return nil
	}
}

func (c *checker) decodeRule(r *replay, ev *trace.Event) (string, moves) {
	switch ev.Kind {
	case trace.Recv:
		mk, ok := map[string]spec.MsgKind{"Bootstrap": spec.MBootstrap, "Done": spec.MDone, "AbortAck": spec.MAbortAck}[ev.Msg]
		if !ok {
			return "decode recv " + ev.Msg, func(*spec.State) []move { return nil }
		}
		if c.fencedFirst(r, ev) {
			return "decode recv " + ev.Msg + " before its pair's fence is nothing (the fence took it)", func(*spec.State) []move { return keep }
		}
		return "decode recv " + ev.Msg + " is DecodeRecvQP", func(s *spec.State) []move {
			return lateOnCut(s, move{act: headIs(spec.DecodeRecvQP, qp, mk)})
		}
	case trace.Send:
		return c.sendRule(ev, qpBack, map[string]spec.MsgKind{"Grant": spec.MGrant, "Abort": spec.MAbort})
	case trace.Verified:
		return "decode verified is a receiver ready", require(func(s *spec.State) bool { return s.Req[0].R.Phase == spec.RReady })
	case trace.Acquire:
		if ev.Err != "" {
			return "decode acquire refused", nil
		}
		r.reading = true
		return "decode acquire reads a ready request", require(func(s *spec.State) bool { return s.Req[0].R.Phase == spec.RReady })
	case trace.Release:
		if ev.Err != "" {
			return "decode release refused", nil
		}
		// The read, from Acquire to Finish, is the spec's DecodeRead; its
		// reply reaches the client at the router, which the spec's
		// DecodeRead does in the same step: it is taken at the router's
		// leg-end of the decode leg (or, for a call the router ended, at
		// the cancel that ends it). Here the request is ready, or ended by
		// an Abort while it was read.
		reading := r.reading
		r.reading, r.readDone = false, true
		return "decode release ends a read", require(func(s *spec.State) bool {
			p := s.Req[0].R.Phase
			return p == spec.RReady || reading && !p.Live()
		})
	case trace.Free, trace.Cache:
		// The pool gives back (or caches) a request's pages when the spec
		// releases them, or at the Finish of its read, whose DecodeRead the
		// replay takes later, at the router's leg-end. Earlier, a writer
		// may still write them (eager-release).
		read := r.readDone
		return "decode " + ev.Kind + " of the request's pages is the spec's release of them", require(func(s *spec.State) bool {
			return read || s.Req[0].R.Released
		})
	case trace.Cancel:
		return "decode cancel (" + ev.Cause + ")", c.cancelMoves(r, ev, false)
	case trace.Outcome:
		ok, reading, read := ev.Err == "", r.reading, r.readDone
		// A read cancelled while it runs has its outcome at the cancel and
		// its end, the spec's DecodeRead, at Finish.
		return "decode outcome is the receiver's end", require(func(s *spec.State) bool {
			p := s.Req[0].R.Phase
			return ok && (p == spec.RFinished || p == spec.RReady && read) || !ok && p != spec.RReserved && (p != spec.RReady || reading) && p != spec.RNone
		})
	case trace.Cut:
		if ev.Cause != "peer-lost" {
			return "decode cut asked by the receiver (part of the step that asked)", nil
		}
		return "decode cut (peer-lost) is DecodeRecv of PeerFailed", func(s *spec.State) []move {
			if holds(toDecode(s), spec.MPeerFailed) || s.ToDecode[0].N > 0 && s.ToDecode[0].Head().Kind == spec.MPeerFailed {
				return one(move{edit: func(s *spec.State) { toFront(toDecode(s), spec.MPeerFailed, -1) }, act: headIs2(spec.DecodeRecv, toDecode, spec.MPeerFailed)})
			}
			return keep
		}
	case trace.Fenced:
		return "decode fenced is Cut or PeerFailed", cutMoves(r)
	}
	return "decode " + ev.Kind, nil
}

// headIs2 is headIs for a message of no request (PeerFailed).
func headIs2(k spec.ActionKind, q func(s *spec.State) *spec.Queue, mk spec.MsgKind) func(a spec.Action, prev, _ *spec.State) bool {
	return func(a spec.Action, prev, _ *spec.State) bool {
		qu := q(prev)
		return a.Kind == k && qu.N > 0 && qu.Head().Kind == mk
	}
}

// cutMoves: a queue pair fenced is the spec's DecodeRecv of the router's
// PeerFailed if one is queued, else its Cut if it matters to the request;
// otherwise it changes nothing of it.
func cutMoves(r *replay) moves {
	return func(s *spec.State) []move {
		if finished(r, s) {
			return keep
		}
		if holds(toDecode(s), spec.MPeerFailed) {
			return one(move{edit: func(s *spec.State) { toFront(toDecode(s), spec.MPeerFailed, -1) }, act: headIs2(spec.DecodeRecv, toDecode, spec.MPeerFailed)})
		}
		var cut bool
		r.m.Successors(s, func(a spec.Action, _ *spec.State) { cut = cut || a.Kind == spec.Cut })
		if cut {
			return one(move{act: kind(spec.Cut)})
		}
		return keep
	}
}

// cancelMoves maps a node's Cancel of the request. With an Abort of the
// router's queued for the node (the client's cancel, or a failed request's
// other leg), it is the spec's receipt of it. At decode, for a verified
// request whose call the router ended (cut, failed, or the client gone,
// the outcome settled), it is the read's end: DecodeRead, which the spec's
// decode call is; for a reserved one whose transfer never came (the node's
// sweep), decode's Timeout. A node's stop that cancels a request still
// pending (at either node) ends it as the router's cancel does: Cancel,
// then the node's receipt of its Abort. A verified request's pages
// released by the node's own sweep, or by its stop once the request has
// its outcome, with no call, is no action of the spec: its decode holds
// verified pages until the read the router's call brings.
func (c *checker) cancelMoves(r *replay, ev *trace.Event, prefill bool) moves {
	node := r.decode
	recv, q := spec.DecodeRecv, toDecode
	if prefill {
		node, recv, q = r.prefill, spec.PrefillRecv, toPrefill
	}
	return func(s *spec.State) []move {
		rq := &s.Req[0]
		if holds(q(s), spec.MAbort) {
			return one(move{edit: func(s *spec.State) { toFront(q(s), spec.MAbort, 0) }, act: headIs(recv, q, spec.MAbort)})
		}
		inject := func(s *spec.State) {
			qu := q(s)
			qu.Push(spec.Msg{Kind: spec.MAbort, Req: 0}, spec.QueueCapacity)
			toFront(qu, spec.MAbort, 0)
		}
		// The node's own leg not ended: a read finished, or a prefill leg
		// ended, the cancel changes nothing (the cases below).
		ownLive := !r.readDone
		if prefill {
			ownLive = rq.S.Phase.Live() || rq.S.Phase == spec.SNone
		}
		if ev.Cause == "shutdown" && rq.Outcome == spec.Pending && ownLive {
			// The node's stop, once calls outlived its grace, cancels what it
			// holds, the request's call on its way or in flight (it then
			// fails), a read under way too. The spec has no node stop: the
			// request ends as by the router's cancel, the spec's Cancel,
			// whose Abort the node takes. (Once the request has its
			// outcome, the cases below: a ready request's pages held past
			// it are refused.)
			return one(move{edit: func(s *spec.State) { cancelled(r, s, q) }, act: headIs(recv, q, spec.MAbort)})
		}
		if prefill {
			// The spec's prefill takes an Abort in every phase (a finished
			// leg that was granted acks it again, as the Sender does).
			if rq.Outcome != spec.Pending || r.abortTo[node] {
				return one(move{edit: inject, act: headIs(recv, q, spec.MAbort)})
			}
			if !rq.S.Phase.Live() && rq.S.Phase != spec.SNone {
				return keep // an ended leg: Cancel changes nothing
			}
			return nil
		}
		switch rq.R.Phase {
		case spec.RReady:
			if r.reading || r.readDone {
				return keep // read: the router's leg-end is its DecodeRead
			}
			switch ev.Cause {
			case "", "call", "call-ended", "failed":
				if rq.Outcome != spec.Pending || r.cutCall || ev.Cause == "failed" {
					return one(move{act: kind(spec.DecodeRead)})
				}
			}
			return nil // sweep-no-call, shutdown: pages held past the request's end
		case spec.RReserved:
			if ev.Cause == "sweep-no-transfer" {
				return one(move{act: kind(spec.Timeout)})
			}
			if rq.Outcome != spec.Pending || r.abortTo[node] {
				return one(move{edit: inject, act: headIs(recv, q, spec.MAbort)})
			}
			return nil
		case spec.RNone:
			if rq.Outcome != spec.Pending || r.abortTo[node] || ev.Cause == "sweep-no-transfer" {
				return one(move{edit: inject, act: headIs(recv, q, spec.MAbort)})
			}
			return nil
		}
		return keep // an ended record: Cancel changes nothing
	}
}

// cancelled applies the spec's Cancel of the request to s, its Abort for
// the node of q at that queue's head; s is left as it is if Cancel is not
// enabled (its budget spent), which no move then explains.
func cancelled(r *replay, s *spec.State, q func(s *spec.State) *spec.Queue) {
	var after spec.State
	found := false
	r.m.Successors(s, func(a spec.Action, next *spec.State) {
		if a.Kind == spec.Cancel && !found {
			after, found = *next, true
		}
	})
	if found {
		*s = after
		toFront(q(s), spec.MAbort, 0)
	}
}

// reasonIn is the spec's reason for a verification failure's error text,
// NoReason for any other: those the trace tells apart, which rules out the
// explanations that damaged another field.
func reasonIn(err string) spec.Reason {
	switch {
	case strings.Contains(err, "checksum mismatch"):
		return spec.ChecksumMismatch
	case strings.Contains(err, "tag mismatch"):
		return spec.TagMismatch
	}
	return spec.NoReason
}

// cutBefore is a queue pair cut before the request reached it: the spec's
// Cut fault (its budget spent) leaving the pair cut, which a Cut of no
// matter to any request does not take.
func cutBefore(s *spec.State) {
	s.Fenced[0][0] = true
	if s.Budget[spec.FaultCut] > 0 {
		s.Budget[spec.FaultCut]--
	}
}

// refuse is the moves of an event that no spec state can take: it breaks a
// check of the trace's own (a page named where the Grant put another), whose
// reason the rule put in replay.refusal.
func refuse(*spec.State) []move { return nil }

// pageChecks applies to an event the checks of which pages it names, which
// need no spec state, so that a request the spec cannot replay (more pages
// than its bound) is checked too: it returns the rule the event breaks, or
// "" (its reason in r.refusal).
func (c *checker) pageChecks(r *replay, ev *trace.Event) string {
	switch role := c.roles[ev.Node]; {
	case role == "decode" && ev.Kind == trace.Send && ev.Msg == "Grant":
		r.sendGrant(ev)
		if r.sized && (len(ev.Pages) != r.pages || ev.Prefix != r.prefix) {
			r.refusal = fmt.Sprintf("the Grant names %d pages past a prefix of %d tokens; the request's %d tokens in pages of %d leave %d to write past the prefix of %d",
				len(ev.Pages), ev.Prefix, r.tokens, r.pt, r.pages, r.prefix)
			return "decode send Grant names the request's pages"
		}
	case role == "prefill" && ev.Kind == trace.Send && ev.Msg == "Done" && r.sized && (int(ev.NPages) != r.pages || ev.Prefix != r.prefix):
		r.refusal = fmt.Sprintf("Done says %d pages written past a prefix of %d tokens; the Grant's are %d past %d", ev.NPages, ev.Prefix, r.pages, r.prefix)
		return "prefill send Done names the Grant's pages"
	case role == "decode" && ev.Kind == trace.Acquire && ev.Err == "":
		return r.readPages(ev)
	case role == "prefill" && ev.Kind == trace.Recv && ev.Msg == "Grant":
		return r.receiveGrant(ev)
	case role == "prefill" && ev.Kind == trace.Post:
		return r.postTarget(ev, r.writeIndex(ev))
	}
	return ""
}

// prefixPages is how many of the request's pages are under the Grant's
// prefix: cached at decode, not written.
func (r *replay) prefixPages() int64 { return int64(r.prefix / max(r.pt, 1)) }

// writeIndex is the index of a WRITE among the pages the Grant gives, the
// written ones: the request's page index less the prefix's pages.
func (r *replay) writeIndex(ev *trace.Event) int64 { return int64(ev.Index) - r.prefixPages() }

// sendGrant records the pages of a Grant decode sent: the read hands the
// decoder those, and the prefill node is to receive them.
func (r *replay) sendGrant(ev *trace.Event) {
	g := grantOf(ev)
	r.decodeGrant = g
	if r.inFlight == nil {
		r.inFlight = map[string][]grantPages{}
	}
	r.inFlight[ev.Node] = append(r.inFlight[ev.Node], *g)
}

// receiveGrant records the pages of a Grant the prefill node received, and
// refuses a Grant that names other pages or epochs than the one decode sent
// (the merge pairs the k-th receipt with the k-th send): the rule it
// breaks, or "".
func (r *replay) receiveGrant(ev *trace.Event) string {
	got := grantOf(ev)
	r.prefillGrant = got
	sent := r.inFlight[ev.Peer]
	if len(sent) == 0 {
		return ""
	}
	r.inFlight[ev.Peer] = sent[1:]
	if sent[0].equal(got) {
		return ""
	}
	r.refusal = fmt.Sprintf("received pages %v at epochs %v; %s sent pages %v at epochs %v", got.pages, got.epochs, ev.Peer, sent[0].pages, sent[0].epochs)
	return "prefill recv Grant names the pages decode sent"
}

// postTarget refuses a WRITE that does not go where the Grant the prefill
// node received put its page, the j-th page past the prefix, at its epoch:
// the rule it breaks, or "". A post before any Grant passes here: the
// spec's PostWrite refuses it (for a request the spec replays).
func (r *replay) postTarget(ev *trace.Event, j int64) string {
	g := r.prefillGrant
	if g == nil {
		return ""
	}
	page, epoch, ok := g.at(j)
	switch {
	case !ok:
		r.refusal = fmt.Sprintf("the WRITE of page index %d would be the Grant's page %d past a prefix of %d pages; the Grant %s received has %d",
			ev.Index, j, r.prefixPages(), ev.Node, len(g.pages))
		return "prefill post writes a page of the Grant"
	case len(ev.Pages) != 1 || len(ev.Epochs) != 1 || ev.Pages[0] != page || ev.Epochs[0] != epoch:
		r.refusal = fmt.Sprintf("the WRITE of page index %d goes to pages %v at epochs %v; the Grant %s received puts that index on page %d at epoch %d",
			ev.Index, ev.Pages, ev.Epochs, ev.Node, page, epoch)
		return "prefill post writes where the Grant put that page"
	}
	return ""
}

// readPages refuses a read that hands the decoder other pages than the
// request's: those under the prefix (cached, not in the Grant), then the
// Grant's, at their epochs. It returns the rule broken, or "".
func (r *replay) readPages(ev *trace.Event) string {
	g := r.decodeGrant
	if g == nil {
		return ""
	}
	skip := int(r.prefixPages())
	if len(ev.Pages) == skip+len(g.pages) && len(ev.Epochs) == len(ev.Pages) &&
		(&grantPages{pages: ev.Pages[skip:], epochs: ev.Epochs[skip:]}).equal(g) {
		return ""
	}
	r.refusal = fmt.Sprintf("the decoder was handed pages %v at epochs %v; the request's are %d prefix pages, then the Grant's %v at epochs %v",
		ev.Pages, ev.Epochs, skip, g.pages, g.epochs)
	return "decode acquire reads the pages it granted"
}
