// Package tracecheck checks a running system's protocol traces against the
// spec (docs/trace.md): it merges the nodes' traces (internal/trace),
// respecting each node's order and message causality, maps each event to
// the spec's action, and replays them in the spec, one request at a time,
// resolving the spec's nondeterminism from the trace (which fault happened:
// every explanation the trace leaves open is kept until an event rules it
// out). It reports the first event no explanation can take, with the spec
// states and the events around it, or that the trace conforms; it checks
// the spec's invariants on every replayed state and, at the trace's end,
// that each request can still reach the spec's NoLeak by protocol actions.
// Which pages the events name is checked on the trace itself, for every
// request, replayed or too large for the spec: that a Grant arrives as it
// was sent, that a WRITE goes to the page and epoch its Grant put its index
// on, that a read hands the decoder the Grant's pages, and, across requests,
// which the per-request replay cannot see: that no two requests' Grants
// name one page tenancy (a decode page at one epoch), and that each
// tenancy ends once (a free or cache event, the decode pool's journal), by
// its own request or the cache, before its page is granted or read again,
// and, for a request whose pages the spec gave back, or whose decode
// node's own events say the protocol gave them back (any request, the one
// leak rule for those too large to replay), before the trace ends.
package tracecheck

import (
	"fmt"
	"io"
	"sort"
	"strings"

	"github.com/kvhandoff/kvhandoff/internal/trace"
	"github.com/kvhandoff/kvhandoff/spec"
)

// Report is a check's result.
type Report struct {
	Events   int
	Nodes    []string
	Requests int
	Replayed int // requests replayed in the spec
	// NotReplayed counts the requests checked only for their messages'
	// causality, by why (docs/trace.md).
	NotReplayed map[string]int
	// Ends counts the requests whose pages' return was checked at their
	// end on their decode node's own events (a read's Finish, a cancel of
	// a verified request, a failed verification, a fence), EndsNotReplayed
	// those of them the spec does not replay.
	Ends, EndsNotReplayed int
	// Stops counts the decode node incarnations whose graceful stop the
	// trace shows: every page their Grants named was checked to be freed
	// or cached by then.
	Stops int
	// Unmodelled counts events the spec has no action for, by kind: checked
	// for consistency or skipped (docs/trace.md).
	Unmodelled map[string]int
	Failure    *Failure
}

// Conforms reports whether every event was taken.
func (r *Report) Conforms() bool { return r.Failure == nil }

// Failure is the first event the spec cannot take.
type Failure struct {
	Event   trace.Event
	Request uint64
	Rule    string   // the mapping rule that refused it
	Why     string   // what the spec says
	States  []string // the spec's states of the request just before it
	Around  []trace.Event
}

// Check merges the events of every node and replays them in the spec.
func Check(events []trace.Event) (*Report, error) {
	merged, incs, roles, links, err := merge(events)
	if err != nil {
		return nil, err
	}
	rep := &Report{Events: len(merged), NotReplayed: map[string]int{}, Unmodelled: map[string]int{}}
	for n := range roles {
		rep.Nodes = append(rep.Nodes, n)
	}
	sort.Strings(rep.Nodes)
	c := newChecker(merged, incs, roles, links, rep)
	c.collect()
	first, firstReq := c.shared, c.sharedReq
	for _, id := range c.order {
		r := c.reqs[id]
		f := c.run(r)
		if f != nil && (first == nil || f.index < first.index) {
			first, firstReq = f, r
		}
	}
	rep.Requests = len(c.order)
	if first != nil {
		rep.Failure = c.failureOf(firstReq, first)
	}
	return rep, nil
}

func newChecker(merged []trace.Event, incs []int, roles map[string]string, links map[end]end, rep *Report) *checker {
	return &checker{merged: merged, roles: roles, links: links, reqs: map[uint64]*replay{}, writes: map[int]map[uint64]uint64{}, rep: rep,
		incs: incs, tenants: map[tenancy]uint64{}, stops: map[int]bool{}, freedAt: map[tenancy]int{}, cachedAt: map[tenancy]int{}, pins: map[tenancy]map[uint64]int{}, lastGrant: map[decodePage]uint64{}}
}

type checker struct {
	merged []trace.Event
	incs   []int // the node incarnation of each merged event
	roles  map[string]string
	links  map[end]end
	reqs   map[uint64]*replay
	order  []uint64
	// prefill node incarnation → WRITE id → request: a restarted node
	// numbers its WRITEs from 1 again, and the merge may place an old
	// incarnation's completion after its successor's posts.
	writes map[int]map[uint64]uint64
	rep    *Report
	// What crosses requests: each decode page tenancy a Grant named, the
	// first Grant that named one another request's Grant had named, and
	// the request whose events show it.
	tenants map[tenancy]uint64
	stops   map[int]bool // the decode node incarnations whose stop was judged
	// And each tenancy's end: where a free or a cache event named it (the
	// pool's journal), and the epoch of each page's last Grant.
	freedAt   map[tenancy]int
	cachedAt  map[tenancy]int
	pins      map[tenancy]map[uint64]int // a cached tenancy's pins, by request
	lastGrant map[decodePage]uint64
	shared    *failure
	sharedReq *replay
}

// decodePage is one page of one decode node incarnation, at any epoch.
type decodePage struct {
	inc  int
	page uint32
}

// tenancy is one page of one decode node incarnation at one epoch. The pool
// advances a page's epoch at every allocation (protocol.Pool.Allocate), so
// a Grant's page names one tenancy, and two requests' Grants never name the
// same one: that would be one page written with two tenants' KV, the bug
// kvhandoff exists to rule out (write-shared, say, grants a cached page
// other requests read). The spec replays one request at a time and cannot
// see it.
type tenancy struct {
	inc   int // the decode node incarnation (merge's numbering)
	page  uint32
	epoch uint64
}

// collect gives each request its events: its own, and the global events of
// its route (a node lost, a queue pair fenced or cut) from its first event on.
func (c *checker) collect() {
	get := func(ev *trace.Event) *replay {
		r := c.reqs[ev.Req]
		if r == nil {
			r = &replay{id: ev.Req}
			c.reqs[ev.Req] = r
			c.order = append(c.order, ev.Req)
		}
		return r
	}
	for i := range c.merged {
		ev := &c.merged[i]
		switch {
		case ev.Kind == trace.Start:
			continue
		case ev.Kind == trace.Stopped:
			if c.roles[ev.Node] == "decode" {
				c.stopped(i)
			}
			continue
		case ev.Kind == trace.Free, ev.Kind == trace.Cache, ev.Kind == trace.Pin, ev.Kind == trace.Unpin:
			c.poolChange(i) // the pool's: checked across requests
			// A request's own free or cache is also its own event: the
			// replay checks that the spec has given its pages back.
			if r := c.reqs[ev.Req]; r != nil && (ev.Kind == trace.Free || ev.Kind == trace.Cache) {
				r.events = append(r.events, i)
			}
			continue
		case ev.Kind == trace.Post:
			if c.writes[c.incs[i]] == nil {
				c.writes[c.incs[i]] = map[uint64]uint64{}
			}
			c.writes[c.incs[i]][ev.Write] = ev.Req
		case ev.Kind == trace.Complete:
			ev.Req = c.writes[c.incs[i]][ev.Write]
			if r := c.reqs[ev.Req]; r != nil {
				if r.late == nil {
					r.late = map[uint64]bool{}
				}
				r.late[ev.Write] = ev.Err != ""
				if ev.Err != "" && !mayHaveLanded(ev.Err) {
					if r.refusedWrites == nil {
						r.refusedWrites = map[uint64]bool{}
					}
					r.refusedWrites[ev.Write] = true
				}
			}
		}
		if ev.Req == 0 {
			for _, id := range c.order {
				r := c.reqs[id]
				if r.on(ev) && c.onQP(r, ev) {
					r.events = append(r.events, i)
				}
			}
			continue
		}
		r := get(ev)
		if ev.QP != 0 {
			if r.qp == nil {
				r.qp = map[string]uint32{}
			}
			if _, ok := r.qp[ev.Node]; !ok {
				r.qp[ev.Node] = ev.QP
			}
		}
		switch ev.Kind {
		case trace.Dispatch:
			r.prefill, r.decode, r.tokens, r.pt = ev.Peer, ev.Decode, ev.Tokens, ev.PageTokens
		case trace.Refuse:
			r.refused, r.tokens, r.pt = refusedByRouter, ev.Tokens, 1
		case trace.Submit:
			if r.prefill == "" { // no router in the trace
				r.prefill, r.decode, r.tokens = ev.Node, ev.Peer, ev.Tokens
			}
			r.pt = max(r.pt, ev.PageTokens)
			if ev.Err != "" && r.refused == "" {
				r.refused = "prefill intake: " + reasonOf(ev.Err)
				switch r.refused {
				case refusedNoPeer, refusedTooLong:
					r.intake = r.refused // replayed: the spec has the branch
					r.refused = ""
				}
			}
		case trace.Outcome, trace.ClientEnd:
			r.damaged = r.damaged || reasonIn(ev.Err) != spec.NoReason
		case trace.Send:
			if ev.Msg == "Abort" && ev.Reason == "verification failed" {
				r.damaged = true
			}
			if c.roles[ev.Node] == "decode" && ev.Msg == "Grant" {
				r.prefix = ev.Prefix
				c.grantTenancies(i, r)
			}
			if c.roles[ev.Node] == "decode" && ev.Msg == "Abort" && !r.granted(c) && r.refused == "" && ev.Reason != "timed out" && ev.Reason != "cancelled" {
				r.refused = "decode intake: " + ev.Reason
			}
		case trace.Acquire:
			if c.roles[ev.Node] == "decode" && ev.Err == "" {
				c.readTenancies(i, r)
			}
		}
		r.events = append(r.events, i)
	}
}

// tenanciesOf is the page tenancies the event at merged[i] names: its
// pages at their epochs, on the incarnation that wrote it (a page without
// an epoch, in a malformed event, names none).
func (c *checker) tenanciesOf(i int) []tenancy {
	ev := &c.merged[i]
	ts := make([]tenancy, min(len(ev.Pages), len(ev.Epochs)))
	for k := range ts {
		ts[k] = tenancy{inc: c.incs[i], page: ev.Pages[k], epoch: ev.Epochs[k]}
	}
	return ts
}

// grantTenancies files the page tenancies of the Grant at merged[i], sent
// for request r, and keeps the first Grant that names a tenancy another
// request's Grant named, or a page whose tenancy at its last Grant was
// never freed.
func (c *checker) grantTenancies(i int, r *replay) {
	ev := &c.merged[i]
	for _, t := range c.tenanciesOf(i) {
		page := t.page
		r.tenancies = append(r.tenancies, t)
		at := decodePage{inc: t.inc, page: page}
		if last, ok := c.lastGrant[at]; ok && last != t.epoch {
			prev := tenancy{inc: t.inc, page: page, epoch: last}
			switch _, freed := c.freedAt[prev]; {
			case last > t.epoch:
				c.fail(i, r, "decode send Grant names each page at a later epoch than its last Grant",
					fmt.Sprintf("page %d of %s is granted at epoch %d after its Grant at epoch %d to request %d: the pool advances a page's epoch at every allocation",
						page, ev.Node, t.epoch, last, c.tenants[prev]))
			case !freed:
				c.fail(i, r, "decode send Grant names pages whose earlier tenancy was freed",
					fmt.Sprintf("page %d of %s is granted at epoch %d while its tenancy at epoch %d, granted to request %d, was never freed: the pool reallocated a page a request held",
						page, ev.Node, t.epoch, last, c.tenants[prev]))
			}
		}
		if last, ok := c.lastGrant[at]; !ok || t.epoch > last {
			c.lastGrant[at] = t.epoch
		}
		other, named := c.tenants[t]
		if !named {
			c.tenants[t] = ev.Req
			continue
		}
		if other != ev.Req {
			c.fail(i, r, "decode send Grant names page tenancies no other request's Grant named",
				fmt.Sprintf("page %d at epoch %d of %s was granted to request %d already: one page would hold two requests' KV (the pool advances a page's epoch at every allocation)",
					page, t.epoch, ev.Node, other))
		}
	}
}

// poolChange files the tenancies an event of the decode pool's journal at
// merged[i] names: a free (its request the one that gave them back, 0 for
// cached pages the pool freed itself), a cache (the request whose pages
// moved into the prefix cache), a pin or an unpin (the request that reads
// them as its prefix). It keeps the first that ends a tenancy ended
// already, that a request makes of pages it does not hold, that pins a
// page the cache does not hold or drops a pin it never took, or that frees
// a page a request has pinned.
func (c *checker) poolChange(i int) {
	ev := &c.merged[i]
	if c.roles[ev.Node] != "decode" {
		return
	}
	r := c.reqs[ev.Req]
	if r == nil {
		r = &replay{id: ev.Req}
	}
	for _, t := range c.tenanciesOf(i) {
		page := t.page
		at, freed := c.freedAt[t]
		_, cached := c.cachedAt[t]
		switch ev.Kind {
		case trace.Pin:
			if !cached || freed {
				c.fail(i, r, "decode pin is of a page the cache holds",
					fmt.Sprintf("request %d pinned page %d at epoch %d of %s, which the prefix cache does not hold (cached: %t, freed: %t)", ev.Req, page, t.epoch, ev.Node, cached, freed))
			}
			if c.pins[t] == nil {
				c.pins[t] = map[uint64]int{}
			}
			c.pins[t][ev.Req]++
			continue
		case trace.Unpin:
			if c.pins[t][ev.Req] == 0 {
				c.fail(i, r, "decode unpin drops a pin the request took",
					fmt.Sprintf("request %d dropped a pin on page %d at epoch %d of %s that it had not taken", ev.Req, page, t.epoch, ev.Node))
				continue
			}
			c.pins[t][ev.Req]--
			continue
		}
		if freed {
			c.fail(i, r, "decode "+ev.Kind+" ends a tenancy once",
				fmt.Sprintf("page %d at epoch %d of %s was freed already (%s #%d): a double free", page, t.epoch, ev.Node, ev.Node, c.merged[at].Seq))
			continue
		}
		holder, granted := c.tenants[t]
		cache := ev.Kind == trace.Cache
		switch {
		case cache && cached:
			c.fail(i, r, "decode cache ends a tenancy once", fmt.Sprintf("page %d at epoch %d of %s is cached already", page, t.epoch, ev.Node))
		case ev.Req != 0 && cached:
			c.fail(i, r, "decode "+ev.Kind+" is of the request's own pages",
				fmt.Sprintf("request %d gave back page %d at epoch %d of %s, which the prefix cache holds", ev.Req, page, t.epoch, ev.Node))
		case ev.Req != 0 && granted && holder != ev.Req:
			c.fail(i, r, "decode "+ev.Kind+" is of the request's own pages",
				fmt.Sprintf("request %d gave back page %d at epoch %d of %s, granted to request %d: it ended a tenancy another request holds",
					ev.Req, page, t.epoch, ev.Node, holder))
		case ev.Req == 0 && !cached:
			c.fail(i, r, "decode "+ev.Kind+" with no request is of a cached page",
				fmt.Sprintf("page %d at epoch %d of %s was freed by the pool itself (no request), but the prefix cache never held it", page, t.epoch, ev.Node))
		case !cache:
			if reader, pinned := pinnedBy(c.pins[t]); pinned {
				if rr := c.reqs[reader]; rr != nil {
					r = rr // the report shows the reader's events
				}
				c.fail(i, r, "decode free takes no pinned page",
					fmt.Sprintf("page %d at epoch %d of %s was freed while request %d has it pinned as its prefix: the pool gave away a page a request reads",
						page, t.epoch, ev.Node, reader))
			}
		}
		if cache {
			c.cachedAt[t] = i
		} else {
			c.freedAt[t] = i
		}
	}
}

// stopped keeps the first tenancy a Grant of the decode node incarnation
// whose graceful stop ended at merged[i] named that no free or cache event
// ended before it: a page the node held past its stop, which only the
// process's exit gave back. (A node killed has no such event, and is not
// judged: its pages went with it. Nor is a Grant traced after the stop:
// the node's loop runs until its teardown, and takes what reaches it.)
func (c *checker) stopped(i int) {
	inc := c.incs[i]
	if c.stops[inc] {
		return // judged at its first stop event
	}
	c.stops[inc] = true
	c.rep.Stops++
	// collect is at merged[i]: the Grants, frees and caches so far are
	// those before the stop.
	for _, id := range c.order {
		r := c.reqs[id]
		if t, ok := c.unended(r, inc); ok {
			c.fail(i, r, "decode stopped holds no page a Grant named",
				fmt.Sprintf("%s ended its graceful stop holding page %d at epoch %d, granted to request %d: never freed nor moved into the prefix cache, it was held past the request's end",
					c.merged[i].Node, t.page, t.epoch, id))
			return
		}
	}
}

// pinnedBy returns the least request that holds a pin in pins, and false
// if none does (the least, so that a report names the same one every run).
func pinnedBy(pins map[uint64]int) (uint64, bool) {
	var least uint64
	found := false
	for reader, n := range pins {
		if n > 0 && (!found || reader < least) {
			least, found = reader, true
		}
	}
	return least, found
}

// leaked refuses a replayed request whose pages the spec gave back (every
// explanation released its record's pages: freed, or moved into the prefix
// cache) while the trace shows no free or cache event of one of the
// tenancies its Grant named: a page leaked (leak-on-cancel), which the spec
// replay alone cannot see, as the trace showed no page's end. nil if none.
func (c *checker) leaked(r *replay) *failure {
	if len(r.tenancies) == 0 || len(r.front) == 0 {
		return nil
	}
	for _, s := range r.front {
		if !s.Req[0].R.Released {
			return nil // an explanation still holds them (quarantined, say)
		}
	}
	t, ok := c.unended(r, anyIncarnation)
	if !ok {
		return nil
	}
	// At the request's last own event, not a global one of its route that
	// came later.
	last := r.events[len(r.events)-1]
	for _, i := range r.events {
		if c.merged[i].Req == r.id {
			last = i
		}
	}
	return &failure{index: last, rule: "end of trace: the pages the spec gave back were freed or cached",
		why: fmt.Sprintf("the spec gave back request %d's pages, and %s never freed page %d at epoch %d nor moved it into the prefix cache: it leaked",
			r.id, r.decode, t.page, t.epoch)}
}

// anyIncarnation is unended's inc for tenancies of every decode node
// incarnation.
const anyIncarnation = -1

// unended returns the first tenancy r's Grants named, on decode node
// incarnation inc (or any), that no free or cache event of the trace
// ended: a page r leaked, if its pages were due back.
func (c *checker) unended(r *replay, inc int) (tenancy, bool) {
	for _, t := range r.tenancies {
		if inc != anyIncarnation && t.inc != inc {
			continue
		}
		_, freed := c.freedAt[t]
		_, cached := c.cachedAt[t]
		if !freed && !cached {
			return t, true
		}
	}
	return tenancy{}, false
}

// readTenancies keeps the first read (an acquire at merged[i] for request
// r) that hands the decoder a tenancy freed before it, a page the pool may
// have reallocated, to be read as this request's KV; or, among its first
// pages, those under the Grant's prefix, a cached page it has not pinned.
func (c *checker) readTenancies(i int, r *replay) {
	ev := &c.merged[i]
	for k, t := range c.tenanciesOf(i) {
		page := t.page
		if int64(k) < r.prefixPages() && c.pins[t][r.id] == 0 {
			c.fail(i, r, "decode acquire reads prefix pages the request pinned",
				fmt.Sprintf("the read's page %d (page %d at epoch %d of %s) is under the Grant's prefix, and request %d holds no pin on it",
					k, page, t.epoch, ev.Node, r.id))
		}
		if at, freed := c.freedAt[t]; freed {
			c.fail(i, r, "decode acquire reads no page freed",
				fmt.Sprintf("page %d at epoch %d of %s was freed at %s #%d, before this read: the decoder would read whatever the page holds next",
					page, t.epoch, ev.Node, ev.Node, c.merged[at].Seq))
		}
	}
}

// fail keeps the first failure across requests (collect sees the events in
// merged order, so the first kept is the earliest).
func (c *checker) fail(i int, r *replay, rule, why string) {
	if c.shared == nil {
		c.shared, c.sharedReq = &failure{index: i, rule: rule, why: why}, r
	}
}

// granted reports whether decode sent the request a Grant before now.
func (r *replay) granted(c *checker) bool {
	for _, i := range r.events {
		if ev := &c.merged[i]; ev.Kind == trace.Send && ev.Msg == "Grant" {
			return true
		}
	}
	return false
}

// on reports whether a global event concerns the request's route.
func (r *replay) on(ev *trace.Event) bool {
	if r.prefill == "" {
		return false
	}
	switch ev.Kind {
	case trace.NodeLost:
		return ev.Peer == r.prefill || ev.Peer == r.decode
	case trace.Fenced, trace.Cut:
		return ev.Node == r.prefill && ev.Peer == r.decode || ev.Node == r.decode && ev.Peer == r.prefill
	}
	return false
}

// onQP reports whether a queue pair's fence or cut is of the queue pair
// the request is on: a node reconnects to a peer on a new queue pair, and
// a fence of an older one is not the request's. The request's queue pair at
// the event's node, or, before it has one there, the other end's, linked by
// a message that crossed it. An event naming no queue pair (the router's
// news of a lost node) is of every queue pair to that peer.
func (c *checker) onQP(r *replay, ev *trace.Event) bool {
	if ev.QP == 0 || ev.Kind == trace.NodeLost {
		return true
	}
	if qp, ok := r.qp[ev.Node]; ok {
		return qp == ev.QP
	}
	other := r.prefill
	if ev.Node == r.prefill {
		other = r.decode
	}
	qp, ok := r.qp[other]
	if !ok {
		return false // on neither end yet: the fence was of a queue pair before it
	}
	far, linked := c.links[end{ev.Node, ev.QP}]
	return linked && far == end{other, qp}
}

// reasonOf shortens an error's text to its kind for the report.
func reasonOf(err string) string {
	if strings.Contains(err, "no live queue pair") {
		return "no peer"
	}
	for _, k := range []string{"too long", "no capacity", "over quota", "unauthorized", "rejected"} {
		if strings.Contains(err, k) {
			return k
		}
	}
	return "other"
}

// landedThenFailed is why a request is not replayed when a WRITE of it
// completed in error although decode verified it, so every WRITE had
// landed: RC acknowledges a WRITE once placed, and a queue pair that breaks
// before the ACK arrives flushes it at the requester (a decode node that
// stops or crashes right after its read). The spec completes a WRITE where
// it places it, so its sender finished where the real one failed, and the
// router's reaction to that failure (a retry, an error to the client) has
// no spec step. The request's pages are still checked (checkPages).
const landedThenFailed = "a WRITE that landed completed in error (the spec completes a WRITE where it places it)"

// mayHaveLanded reports whether a WRITE whose completion failed with err
// may still have been placed: flushed (the queue pair broke before its
// ACK came back) or a transport error (its retries ran out, the ACK lost).
// Another error is the responder's refusal (a bad key, no room): nothing
// landed.
func mayHaveLanded(err string) bool {
	return strings.Contains(err, "flushed") || strings.Contains(err, "transport error")
}

// landedThenFailed reports whether a WRITE of r completed in error, one
// that may have landed, while decode verified r (landedThenFailed).
func (c *checker) landedThenFailed(r *replay) bool {
	failed := false
	for w, f := range r.late {
		failed = failed || f && !r.refusedWrites[w]
	}
	if !failed {
		return false
	}
	for _, i := range r.events {
		if c.merged[i].Kind == trace.Verified {
			return true
		}
	}
	return false
}

// run replays one request; nil if the spec takes every event.
func (c *checker) run(r *replay) *failure {
	if r.refused != "" && r.refused != refusedByRouter {
		c.rep.NotReplayed[r.refused]++
		return c.checkPages(r)
	}
	if c.landedThenFailed(r) {
		c.rep.NotReplayed[landedThenFailed]++
		return c.checkPages(r)
	}
	if err := r.start(); err != nil {
		c.rep.NotReplayed[err.Error()]++
		return c.checkPages(r)
	}
	c.rep.Replayed++
	for _, i := range r.events {
		ev := &c.merged[i]
		before := r.front
		rule, moves := c.rule(r, ev)
		if moves == nil {
			c.rep.Unmodelled[rule]++
			continue
		}
		if err := r.advance(moves); err != nil {
			f := &failure{index: i, rule: rule, why: err.Error()}
			if err == errNoMove && r.refusal != "" {
				f.why = r.refusal
			}
			if err == errNoMove && ev.Kind == trace.Cancel && (ev.Cause == "sweep-no-call" || ev.Cause == "shutdown") {
				f.why += ": the spec's decode releases a verified request's pages only at its read, which the router's call brings (or ends); " +
					"this node released them on its own, with no call: they were held past the request's end"
			}
			for _, s := range before {
				f.states = append(f.states, summary(s))
			}
			return f
		}
	}
	// At the end: from some explanation, the spec reaches NoLeak by
	// protocol actions alone.
	if !r.canQuiesce() {
		last := r.events[len(r.events)-1]
		f := &failure{index: last, rule: "end of trace", why: "no protocol action of the spec leads from here to NoLeak (every page, slot and record given back)"}
		for _, s := range r.front {
			f.states = append(f.states, summary(s))
		}
		return f
	}
	if f := c.leaked(r); f != nil {
		for _, s := range r.front {
			f.states = append(f.states, summary(s))
		}
		return f
	}
	// The spec-free leak rule too: where the spec still holds the pages
	// at the end (quarantined, in some explanation), the node's own
	// events may say they went back.
	f, _ := c.leakedAtItsEnd(r)
	return f
}

// checkPages applies the checks of which pages each event names to a request
// the spec does not replay, and then, with no spec state to say when its
// pages go back, the leak rule where its decode node's own events say it
// (leakedAtItsEnd); nil if every event passes.
func (c *checker) checkPages(r *replay) *failure {
	for _, i := range r.events {
		if rule := c.pageChecks(r, &c.merged[i]); rule != "" {
			return &failure{index: i, rule: rule, why: r.refusal}
		}
	}
	f, judged := c.leakedAtItsEnd(r)
	if judged {
		c.rep.EndsNotReplayed++
	}
	return f
}

// The decode record's phases as its node's own events show them
// (givenBack): the protocol's Receiver phases that decide when its pages
// go back.
const (
	recordNone        = iota
	recordReserved    // its Grant sent: waiting for Done
	recordDoneIn      // its Done received: verified, or held for the keys' revocation, or verified and not yet traced
	recordReady       // verified
	recordReading     // acquired by the decoder
	recordQuarantined // cancelled or timed out while reserved: its pages wait for the writer's fence
)

// givenBack returns the index of the event at which r's decode node, by
// its own events and the protocol's Receiver alone, gave back the pages of
// r's Grant, and the decode node incarnation that did; -1 if none. The
// Receiver gives them back, and its node traces their free or cache before
// any SEND after it:
//   - at a read's Finish (a release with no error);
//   - at a cancel while verified and not being read (Done fenced the
//     writer), or a refused acquire then (its read-time check failed);
//   - at a Done whose verification failed (decode's Abort "verification
//     failed");
//   - at a fence of its queue pair while reserved with no Done received,
//     or quarantined (a cancel or a timeout while reserved quarantines
//     the pages for that fence).
//
// An AbortAck also ends a quarantine, but the node takes it only once the
// Grant's keys are revoked, after its receipt is traced: a node killed in
// between traced the receipt and never freed the pages, so it is not
// judged here (nor is a late Done).
func (c *checker) givenBack(r *replay) (int, int) {
	phase, inc := recordNone, -1
	for _, i := range r.events {
		ev := &c.merged[i]
		if ev.Node != r.decode || c.roles[ev.Node] != "decode" {
			continue
		}
		if c.incs[i] != inc {
			if ev.Req != r.id {
				continue // a fence of another incarnation's queue pair
			}
			phase, inc = recordNone, c.incs[i] // a restarted node: a new record
		}
		if ev.Kind == trace.Fenced { // of r's queue pair (collect: onQP)
			// Not once its Done came: the batch of completions that steps
			// a Done held for the keys' revocation into the Receiver (now
			// ready, untouched by the fence) can fence the queue pair
			// before its end traces the verification.
			if phase == recordReserved || phase == recordQuarantined {
				return i, inc
			}
			continue
		}
		if ev.Req != r.id {
			continue
		}
		switch ev.Kind {
		case trace.Send:
			waiting := phase == recordReserved || phase == recordDoneIn // for Done, or for its verification
			switch {
			case ev.Msg == "Grant":
				phase = recordReserved
			case ev.Msg == "Abort" && waiting && ev.Reason == "verification failed":
				return i, inc
			case ev.Msg == "Abort" && waiting && ev.Reason == "timed out":
				phase = recordQuarantined
			}
		case trace.Recv:
			if ev.Msg == "Done" && phase == recordReserved {
				phase = recordDoneIn
			}
		case trace.Verified:
			phase = recordReady
		case trace.Acquire:
			switch {
			case ev.Err == "":
				phase = recordReading // its pages go back at Finish
			case phase == recordReady:
				return i, inc // the read-time check failed: the Receiver releases them (failRead)
			}
		case trace.Release:
			if ev.Err == "" {
				return i, inc
			}
		case trace.Cancel:
			// A cancel takes the node's lock between batches: the
			// Receiver's phase is the one traced (a held Done leaves it
			// reserved: quarantined now, freed when the Done comes).
			switch phase {
			case recordReady:
				return i, inc
			case recordReserved, recordDoneIn:
				phase = recordQuarantined
			}
		}
	}
	return -1, 0
}

// leakedAtItsEnd is the leak rule on the decode node's own events, for
// every request, replayed or not (the spec's own leak rule, leaked, needs
// its replay): once the node gave back its pages (givenBack), every
// tenancy its Grant named on that incarnation was freed or moved into the
// prefix cache by the trace's end. The node drains the pool's journal into
// the trace before any SEND after the end flushes it, so a node killed in
// between loses the end's event with the frees (unless the sink's buffer
// filled just between the two: a decode node killed at that instant would
// be refused wrongly). It reports whether it judged r (its node gave back
// pages of a Grant), and the leak if one did.
func (c *checker) leakedAtItsEnd(r *replay) (*failure, bool) {
	at, inc := c.givenBack(r)
	if at < 0 || len(r.tenancies) == 0 {
		return nil, false
	}
	c.rep.Ends++
	t, ok := c.unended(r, inc)
	if !ok {
		return nil, true
	}
	ev := &c.merged[at]
	return &failure{index: at, rule: "end of trace: a request's pages given back at its end were freed or cached",
		why: fmt.Sprintf("request %d's pages went back to %s's pool when %s (%s #%d), and %s never freed page %d at epoch %d nor moved it into the prefix cache: it leaked",
			r.id, ev.Node, givenBackWhen[ev.Kind], ev.Node, ev.Seq, ev.Node, t.page, t.epoch)}, true
}

// givenBackWhen says, by the kind of the event givenBack returns, what
// gave the pages back.
var givenBackWhen = map[string]string{trace.Release: "its read finished", trace.Cancel: "it was cancelled verified, before its read",
	trace.Send: "its verification failed", trace.Fenced: "its queue pair was fenced", trace.Acquire: "its read-time check failed"}

// canQuiesce searches, from each state of the frontier, the states protocol
// actions reach for one where NoLeak holds.
func (r *replay) canQuiesce() bool {
	noLeak := spec.Goals[len(spec.Goals)-1]
	seen := map[string]bool{}
	work := append([]*spec.State(nil), r.front...)
	for len(work) > 0 && len(seen) < 100000 {
		s := work[len(work)-1]
		work = work[:len(work)-1]
		if noLeak.Reached(r.m, s) {
			return true
		}
		r.m.Successors(s, func(a spec.Action, nx *spec.State) {
			if r.m.IsFault(a) {
				return
			}
			k := string(r.m.AppendFingerprint(nil, nx))
			if !seen[k] {
				seen[k] = true
				c := *nx
				work = append(work, &c)
			}
		})
	}
	return false
}

func (c *checker) failureOf(r *replay, f *failure) *Failure {
	out := &Failure{Event: c.merged[f.index], Request: r.id, Rule: f.rule, Why: f.why, States: f.states}
	// The request's events around it (or before it: an event of no
	// request, as a decode node's stop, is not among them).
	at := 0
	for k, i := range r.events {
		if i <= f.index {
			at = k
		}
	}
	for k := max(0, at-8); k < min(len(r.events), at+3); k++ {
		out.Around = append(out.Around, c.merged[r.events[k]])
	}
	return out
}

// Write prints the report for people.
func (r *Report) Write(w io.Writer) {
	fmt.Fprintf(w, "%d events of %d nodes (%s), %d requests: %d replayed in the spec\n", r.Events, len(r.Nodes), strings.Join(r.Nodes, ", "), r.Requests, r.Replayed)
	for _, k := range sortedKeys(r.NotReplayed) {
		fmt.Fprintf(w, "  not replayed (%s): %d\n", k, r.NotReplayed[k])
	}
	if r.Ends > 0 {
		fmt.Fprintf(w, "  pages' return checked at the request's end on decode's own events: %d (%d not replayed)\n", r.Ends, r.EndsNotReplayed)
	}
	if r.Stops > 0 {
		fmt.Fprintf(w, "  decode nodes' graceful stops checked for pages held: %d\n", r.Stops)
	}
	for _, k := range sortedKeys(r.Unmodelled) {
		fmt.Fprintf(w, "  not modelled (%s): %d\n", k, r.Unmodelled[k])
	}
	if r.Failure == nil {
		fmt.Fprintln(w, "conforms")
		return
	}
	f := r.Failure
	fmt.Fprintf(w, "DOES NOT CONFORM: request %d: %s #%d %s: the spec cannot take it\n  rule: %s\n  spec: %s\n", f.Request, f.Event.Node, f.Event.Seq, describe(f.Event), f.Rule, f.Why)
	seen := map[string]int{}
	var states []string
	for _, s := range f.States {
		if seen[s] == 0 {
			states = append(states, s)
		}
		seen[s]++
	}
	for _, s := range states {
		if seen[s] > 1 {
			fmt.Fprintf(w, "  spec state (%d explanations): %s\n", seen[s], s)
		} else {
			fmt.Fprintf(w, "  spec state: %s\n", s)
		}
	}
	fmt.Fprintln(w, "  the request's events around it:")
	for _, ev := range f.Around {
		mark := "   "
		if ev.Node == f.Event.Node && ev.Seq == f.Event.Seq {
			mark = ">>>"
		}
		fmt.Fprintf(w, "  %s %s #%d %s\n", mark, ev.Node, ev.Seq, describe(ev))
	}
}

func sortedKeys(m map[string]int) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

// describe is one event in words.
func describe(ev trace.Event) string {
	s := ev.Kind
	if ev.Msg != "" {
		s += " " + ev.Msg
	}
	if ev.Req != 0 {
		s += fmt.Sprintf(" req %d", ev.Req)
	}
	if ev.Peer != "" {
		s += " peer " + ev.Peer
	}
	if ev.Cause != "" {
		s += " (" + ev.Cause + ")"
	}
	if ev.Reason != "" {
		s += " reason " + ev.Reason
	}
	if len(ev.Pages) > 0 {
		s += fmt.Sprintf(" pages %v", ev.Pages)
	}
	if ev.Err != "" {
		s += fmt.Sprintf(" err %q", ev.Err)
	}
	return s
}
