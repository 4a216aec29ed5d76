package tracecheck

import (
	"fmt"
	"slices"
	"strings"

	"github.com/kvhandoff/kvhandoff/internal/trace"
	"github.com/kvhandoff/kvhandoff/spec"
)

// The spec replays one request at a time (docs/trace.md, "What is
// checked"): request 0 of a one-pair deployment whose pools hold exactly
// its pages. Its page size is the largest the spec takes; a request of n
// pages is a prompt of n such pages.
const specPageSize = 16

// maxSilent bounds the unobservable steps the replay may take before an
// event: WRITEs placed (a decode node does not see them land) and the
// registry's news to a prefill node. A request has at most 8 WRITEs.
const maxSilent = 12

// budget is each replayed request's fault budget: what one request can meet
// in a run (a client cancel, a crash or lost lease of either node, a decode
// timeout, a cut of its queue pair, a corrupted WRITE, payload or tag).
var budget = func() spec.Budget {
	var b spec.Budget
	b[spec.FaultCancel], b[spec.FaultCrash], b[spec.FaultTimeout], b[spec.FaultCut] = 1, 1, 1, 1
	b[spec.FaultCorrupt], b[spec.FaultLease] = 1, 2
	b[spec.FaultLate] = spec.MaxDecodePages // decided per WRITE by its completion: no choice
	return b
}()

// replay is one request: its events as the merge ordered them (its own and
// the global ones of its route), then the spec states that explain them.
type replay struct {
	id              uint64
	prefill, decode string
	tokens, pt      uint32
	prefix          uint32 // the Grant's prefix, in tokens
	refused         string // why it is not replayed ("" if it is)
	events          []int  // indices into the merged trace
	m               *spec.Model
	front           []*spec.State
	pages           int  // pages the spec's request has: its written pages
	sized           bool // pages is known (start worked it out, replayed or too large for the spec)
	completes       int
	cutCall         bool
	reading         bool              // decode acquired the pages and has not finished
	readDone        bool              // decode finished reading it (Finish): the router's leg-end is its DecodeRead
	damaged         bool              // a verification of it failed: a corrupt WRITE explains it
	abortTo         map[string]bool   // nodes the replay queued an Abort for
	qp              map[string]uint32 // node → its id of the queue pair the request is on there
	late            map[uint64]bool   // WRITE id → its completion failed (placed, if at all, only as the spec's Late)
	refusedWrites   map[uint64]bool   // WRITE id → its completion failed as the responder's refusal: never placed
	refusedAt       map[int]bool      // the spec's page indices of those WRITEs
	intake          string            // a prefill intake refusal the spec replays (refusedNoPeer, refusedTooLong)
	refusal         string            // why the last rule refused its event outright (refuse)
	// The pages of the Grants, as the trace shows them: those each decode
	// node sent and the prefill node has not received yet, in order, and
	// the last one the prefill node received (its WRITEs go there) and the
	// last one decode sent (its read hands the decoder those).
	inFlight     map[string][]grantPages
	prefillGrant *grantPages
	decodeGrant  *grantPages
	// tenancies is the page tenancies its Grants named, as decode sent
	// them: at the end, those the spec gave back must have been freed.
	tenancies []tenancy
}

// grantPages is a Grant's pages (the written ones, past the prefix) and
// their epochs.
type grantPages struct {
	pages  []uint32
	epochs []uint64
}

// grantOf is the pages a Grant event names.
func grantOf(ev *trace.Event) *grantPages { return &grantPages{pages: ev.Pages, epochs: ev.Epochs} }

// equal reports whether g and h name the same pages at the same epochs.
func (g *grantPages) equal(h *grantPages) bool {
	return slices.Equal(g.pages, h.pages) && slices.Equal(g.epochs, h.epochs)
}

// at returns the page and epoch at index i, and false outside the Grant.
func (g *grantPages) at(i int64) (uint32, uint64, bool) {
	if i < 0 || i >= int64(len(g.pages)) || i >= int64(len(g.epochs)) {
		return 0, 0, false
	}
	return g.pages[i], g.epochs[i], true
}

// The prefill intake refusals the spec replays: over the node's limit (its
// pool one page short of the prompt), and no queue pair to the decode node
// (the spec's pair cut for good before the intake).
const (
	refusedNoPeer  = "prefill intake: no peer"
	refusedTooLong = "prefill intake: too long"
)

// move is what one spec state does for an event: stay as it is (keep), take
// an action the predicate accepts, or first have edit change it (a message
// of the router's the spec does not send, docs/trace.md) and then take one.
type move struct {
	keep bool
	act  func(a spec.Action, prev, next *spec.State) bool
	edit func(s *spec.State)
}

// failure is a request's first event the spec cannot take.
type failure struct {
	index  int // into the merged trace
	rule   string
	why    string
	states []string
}

func (r *replay) config() spec.Config {
	n := max(r.pages, 1)
	ts := min(n*specPageSize, 127)
	c := spec.Config{PageSize: specPageSize, Prompts: []int{ts}, ContextLimit: 127, PrefillPages: n, DecodePages: n,
		DecodeSlots: 1, MaxInFlight: n, Faults: budget, Damage: spec.DamageTag, LowestPages: true,
		MaxQueue: queueBound(n)}
	if !r.damaged {
		// No verification of it failed: no WRITE of it was damaged (a
		// damaged one fails verification, or the spec's properties).
		c.Faults[spec.FaultCorrupt] = 0
	}
	if r.refused == refusedByRouter {
		c.ContextLimit = ts - 1
	}
	if r.intake == refusedTooLong && n > 1 {
		c.PrefillPages = n - 1
	}
	return c
}

const refusedByRouter = "router"

// queueBound is the replay's bound on every channel for a request of n
// pages. Prefill→decode holds the most: every WRITE and the Done behind
// them, when the first WRITE is one whose completion failed (never placed,
// the spec's Late: nothing behind it lands). The sender posts its last
// WRITE and its Done in one step, so a request of 8 pages puts 9 messages
// there; the spec's default bound (spec.MaxQueue, 8) would refuse a correct
// run's trace as a WithinBounds violation.
func queueBound(n int) int { return max(spec.MaxQueue, min(n+1, spec.QueueCapacity)) }

// start builds the request's spec from what its events say: its pages
// (tokens over the decode pool's page size, less the Grant's prefix).
func (r *replay) start() error {
	if r.pt == 0 {
		r.pt = 1
	}
	n := int((uint64(r.tokens) + uint64(r.pt) - 1) / uint64(r.pt)) // in 64 bits: 2^32-1 tokens do not wrap to 0 pages
	r.pages, r.sized = n-int(r.prefixPages()), true
	if r.refused == refusedByRouter {
		r.pages = max(1, min(r.pages, spec.MaxDecodePages))
	}
	if r.pages > spec.MaxDecodePages {
		return fmt.Errorf("%d pages, over the spec's %d", r.pages, spec.MaxDecodePages)
	}
	m, err := spec.New(r.config())
	if err != nil {
		return err
	}
	r.m = m
	s := m.Initial()[0]
	r.front = []*spec.State{&s}
	r.abortTo = map[string]bool{}
	return nil
}

// silent reports whether a step is one the trace cannot show: a WRITE
// placed at decode (the NIC's, no CPU sees it) or the registry's news at a
// prefill node.
func (r *replay) silent(a spec.Action, s *spec.State) bool {
	switch a.Kind {
	case spec.DecodeRecvQP:
		// A WRITE whose completion was flushed too: it may have landed
		// before its queue pair broke (RC acknowledges a WRITE after
		// placing it, and the break flushes what is unacknowledged).
		// Placed only where a later event needs it: the Done behind it
		// received. Not one the responder refused: it never landed.
		return s.QP[0][0].N > 0 && s.QP[0][0].Head().Kind == spec.MWrite && !r.refusedAt[int(s.QP[0][0].Head().Index)]
	case spec.PrefillRecv:
		return s.ToPrefill[0].N > 0 && s.ToPrefill[0].Head().Req < 0
	}
	return false
}

// advance applies an event: each state's moves, after as few silent steps
// as any state needs (0, then 1, ...). The new frontier is every state a
// move reached, less those that break a property of the spec; none left is
// a failure.
func (r *replay) advance(moves func(s *spec.State) []move) error {
	seen := map[string]bool{}
	var next []*spec.State
	violated := ""
	add := func(s *spec.State) {
		for _, inv := range spec.Invariants {
			if !inv.Holds(r.m, s) {
				violated = inv.Name
				return
			}
		}
		k := string(r.m.AppendFingerprint(nil, s))
		if !seen[k] {
			seen[k] = true
			c := *s
			next = append(next, &c)
		}
	}
	level := r.front
	for depth := 0; depth <= maxSilent && len(level) > 0; depth++ {
		var deeper []*spec.State
		deeperSeen := map[string]bool{}
		for _, s := range level {
			for _, mv := range moves(s) {
				switch {
				case mv.keep:
					add(s)
				default:
					base := s
					if mv.edit != nil {
						c := *s
						mv.edit(&c)
						base = &c
					}
					r.m.Successors(base, func(a spec.Action, nx *spec.State) {
						if mv.act(a, base, nx) {
							add(nx)
						}
					})
				}
			}
		}
		if len(next) > 0 {
			r.front = next
			return nil
		}
		for _, s := range level {
			r.m.Successors(s, func(a spec.Action, nx *spec.State) {
				if r.silent(a, s) {
					k := string(r.m.AppendFingerprint(nil, nx))
					if !deeperSeen[k] {
						deeperSeen[k] = true
						c := *nx
						deeper = append(deeper, &c)
					}
				}
			})
		}
		level = deeper
	}
	if violated != "" {
		return fmt.Errorf("every explanation breaks the spec's %s", violated)
	}
	return errNoMove
}

var errNoMove = fmt.Errorf("no enabled action of the spec matches it")

// kind matches an action of kind k.
func kind(k spec.ActionKind) func(a spec.Action, _, _ *spec.State) bool {
	return func(a spec.Action, _, _ *spec.State) bool { return a.Kind == k }
}

// headIs matches an action of kind k taking a message of kind mk of the
// request from the queue q picks.
func headIs(k spec.ActionKind, q func(s *spec.State) *spec.Queue, mk spec.MsgKind) func(a spec.Action, prev, _ *spec.State) bool {
	return func(a spec.Action, prev, _ *spec.State) bool {
		qu := q(prev)
		return a.Kind == k && qu.N > 0 && qu.Head().Kind == mk && qu.Head().Req == 0
	}
}

func qp(s *spec.State) *spec.Queue        { return &s.QP[0][0] }
func qpBack(s *spec.State) *spec.Queue    { return &s.QPBack[0][0] }
func toPrefill(s *spec.State) *spec.Queue { return &s.ToPrefill[0] }
func toDecode(s *spec.State) *spec.Queue  { return &s.ToDecode[0] }

// holds reports whether q holds a message of kind mk of the request.
func holds(q *spec.Queue, mk spec.MsgKind) bool {
	for _, m := range q.Items() {
		if m.Kind == mk && m.Req == 0 {
			return true
		}
	}
	return false
}

// toFront moves the first message of kind mk of the request in q to its
// head: the router's messages to a node are separate calls in the
// implementation, not one FIFO (docs/trace.md).
func toFront(q *spec.Queue, mk spec.MsgKind, req int8) {
	items := q.Items()
	for i, m := range items {
		if m.Kind == mk && m.Req == req {
			copy(items[1:i+1], items[:i])
			items[0] = m
			return
		}
	}
}

// require keeps the states where ok holds (after silent steps if needed).
func require(ok func(s *spec.State) bool) func(s *spec.State) []move {
	return func(s *spec.State) []move {
		if ok(s) {
			return []move{{keep: true}}
		}
		return nil
	}
}

// summary describes a spec state of the replayed request.
func summary(s *spec.State) string {
	q := &s.Req[0]
	var b strings.Builder
	fmt.Fprintf(&b, "outcome %v", q.Outcome)
	if q.Reason != spec.NoReason {
		fmt.Fprintf(&b, " (%v)", q.Reason)
	}
	fmt.Fprintf(&b, "; prefill %v (posted %d, completed %d of %d); decode %v", q.S.Phase, q.S.Posted, q.S.Completed, q.S.Pages, q.R.Phase)
	if q.R.N > 0 {
		fmt.Fprintf(&b, " holding %d pages", q.R.N)
		if q.R.Released {
			b.WriteString(" (released)")
		}
	}
	for _, x := range []struct {
		name string
		q    *spec.Queue
	}{{"router→prefill", &s.ToPrefill[0]}, {"router→decode", &s.ToDecode[0]}, {"prefill→decode", &s.QP[0][0]}, {"decode→prefill", &s.QPBack[0][0]}} {
		if x.q.N == 0 {
			continue
		}
		var ms []string
		for _, m := range x.q.Items() {
			ms = append(ms, m.Kind.String())
		}
		fmt.Fprintf(&b, "; %s [%s]", x.name, strings.Join(ms, " "))
	}
	return b.String()
}
