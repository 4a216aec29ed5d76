package protocol

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
)

// Errors of the router.
var (
	// ErrNoNode: no live node of a role can take the request now (none is
	// registered, or every one that could is lost).
	ErrNoNode = errors.New("protocol: no live node can take the request")
	// ErrNodeLost: a node the request was on was lost (its registry lease
	// expired, or the operator removed it). Always with ErrPeerFailed.
	ErrNodeLost = errors.New("protocol: node lost")
	// ErrBadNode: a node's advertisement is not one the router can use.
	ErrBadNode = errors.New("protocol: invalid node advertisement")
	// ErrUnknownNode: an event names a node the router never registered.
	ErrUnknownNode = errors.New("protocol: unknown node")
)

// NodeLostError is the ErrNodeLost of one node: which node, of which role, so
// that a caller tells a lost decode node from a lost prefill node with
// errors.As instead of by the message. errors.Is(err, ErrNodeLost) holds.
type NodeLostError struct {
	Role Role
	Node NodeID
}

func (e *NodeLostError) Error() string {
	return fmt.Sprintf("%v: %v node %d", ErrNodeLost, e.Role, e.Node)
}

// Is makes a NodeLostError an ErrNodeLost.
func (e *NodeLostError) Is(target error) bool { return target == ErrNodeLost }

// NodeID names a node, as the router and the registry know it: one per node
// name, the same across the node's incarnations. It is not a PeerID, which
// names one queue pair at a Sender or Receiver (a node's endpoint has one per
// peer node, and a new one on every reconnect): the driver that wires the
// router to the endpoints maps a node to its current queue pair
// (docs/protocol.md, "Node and queue pair names").
type NodeID uint32

// Role is what a node does in the handoff.
type Role uint8

// The roles a router routes to.
const (
	RolePrefill Role = 1 + iota // computes the prompt's KV and writes it (a Sender)
	RoleDecode                  // reserves pages, verifies, generates (a Receiver)
)

func (r Role) String() string {
	switch r {
	case RolePrefill:
		return "prefill"
	case RoleDecode:
		return "decode"
	}
	return fmt.Sprintf("Role(%d)", uint8(r))
}

// NodeInfo is what a node advertises (through the registry) about itself. The
// router's intake trusts none of it alone: a request must fit every limit.
type NodeInfo struct {
	ID   NodeID // the node's name, the same its peers use for it
	Role Role
	// ContextTokens is the longest prompt the node's model takes; 0 means no
	// limit of its own.
	ContextTokens int
	// PoolPages and PageTokens are the node's page pool: PoolPages*PageTokens
	// tokens is the longest prompt one request can hold there.
	PoolPages  int
	PageTokens int
	// MaxTokens is the node's own intake limit (SenderConfig.MaxTokens,
	// ReceiverConfig.MaxTokens); 0 means its pool.
	MaxTokens int
	// Incarnation tells the node's lives apart: a node that restarts
	// registers again under the same ID with a larger one (its start time,
	// say). Its old incarnation's memory and records are gone, so AddNode
	// treats the new registration as the loss of the old one.
	Incarnation uint64
}

// Limit is the longest prompt, in tokens, that this node takes: the smallest
// of its context length, its intake limit, its pool, and what one Grant can
// carry on the wire (MaxGrantPages pages).
func (n NodeInfo) Limit() int {
	limit := min(n.PoolPages*n.PageTokens, MaxGrantPages*n.PageTokens, MaxTokens)
	if n.ContextTokens > 0 {
		limit = min(limit, n.ContextTokens)
	}
	if n.MaxTokens > 0 {
		limit = min(limit, n.MaxTokens)
	}
	return limit
}

func (n NodeInfo) validate() error {
	switch {
	case n.Role != RolePrefill && n.Role != RoleDecode:
		return fmt.Errorf("%w: node %d has role %v", ErrBadNode, n.ID, n.Role)
	case n.PoolPages < 1 || n.PageTokens < 1 || n.PageTokens > MaxTokens:
		return fmt.Errorf("%w: node %d advertises %d pages of %d tokens", ErrBadNode, n.ID, n.PoolPages, n.PageTokens)
	case n.PoolPages > MaxTokens/n.PageTokens:
		return fmt.Errorf("%w: node %d advertises %d pages of %d tokens, more than a request can name", ErrBadNode, n.ID, n.PoolPages, n.PageTokens)
	case n.ContextTokens < 0 || n.MaxTokens < 0:
		return fmt.Errorf("%w: node %d advertises a negative limit", ErrBadNode, n.ID)
	}
	return nil
}

// NodeLoad is a node as a Policy sees it: its advertisement and the router's
// own count of what it has sent there and not yet seen end.
type NodeLoad struct {
	Info       NodeInfo
	PagesInUse int // pages of the requests on this node whose leg has not ended
	Requests   int // those requests
}

// Policy chooses the node of a role for a request. Candidates are the live
// nodes of that role whose limits admit the request, in ID order, never
// empty; Choose returns an index into it.
type Policy interface {
	Choose(role Role, tokens int, candidates []NodeLoad) int
}

// LeastPagesInUse is the default Policy: the candidate with the fewest pages
// in use (ties to the lowest ID, so choices are deterministic).
type LeastPagesInUse struct{}

// Choose implements Policy.
func (LeastPagesInUse) Choose(_ Role, _ int, candidates []NodeLoad) int {
	best := 0
	for i, c := range candidates {
		if c.PagesInUse < candidates[best].PagesInUse {
			best = i
		}
	}
	return best
}

// RouterConfig configures a Router.
type RouterConfig struct {
	// Policy chooses nodes; nil means LeastPagesInUse.
	Policy Policy
	// Timeout fails a request that has no outcome this long after Submit
	// (ErrTimedOut) and cancels both legs; 0 means never.
	Timeout time.Duration
	// Horizon is how long a request's record is kept after it ended (its
	// outcome decided and both legs ended, or refused at intake), so that a
	// late report finds it; Tick forgets older ones. 0 keeps every record.
	Horizon time.Duration
	// Research turns bugs of the catalogue on (only no-peer-cancel concerns
	// the router). Only code inside this module can set it.
	Research research.Switches
}

// Dispatch sends a request the router accepted to its prefill node, which
// runs it against Decode: Sender.Submit(Request, Decode, Tokens).
type Dispatch struct {
	Request RequestID
	Tokens  int
	Prefill NodeID
	Decode  NodeID
}

// CancelLeg asks Node to stop working on Request (Sender.Cancel or
// Receiver.Cancel). A node must take it for a request it has not seen yet,
// or one that ended: the Receiver then keeps a tombstone, the Sender ignores it.
type CancelLeg struct {
	Node    NodeID
	Request RequestID
}

// PeerLost tells decode node Node that prefill node Lost is lost: the decode
// node calls Receiver.PeerFailed on its queue pair to Lost, so that it cuts
// the queue pair and the pages Lost may still write stay quarantined until
// then.
type PeerLost struct {
	Node NodeID
	Lost NodeID
}

// RouterEffects are what the caller must do after feeding events in.
type RouterEffects struct {
	Dispatches []Dispatch
	Cancels    []CancelLeg
	PeerLost   []PeerLost
	// Outcomes are client-visible results of accepted requests, each request
	// once (a request Submit refused gets Submit's error instead).
	Outcomes []Outcome
}

// RouteStatus is a request's state at the router.
type RouteStatus uint8

// The router's request states.
const (
	RouteNone    RouteStatus = iota // never seen, or forgotten
	RouteRefused                    // refused at intake: Submit's error is its outcome
	RouteRunning                    // dispatched, no outcome yet
	RouteDecided                    // the client has its outcome; a leg is still open
	RouteEnded                      // outcome decided and both legs ended
)

func (s RouteStatus) String() string {
	switch s {
	case RouteNone:
		return "none"
	case RouteRefused:
		return "refused"
	case RouteRunning:
		return "running"
	case RouteDecided:
		return "decided"
	case RouteEnded:
		return "ended"
	}
	return fmt.Sprintf("RouteStatus(%d)", uint8(s))
}

type legState uint8

const (
	legOpen     legState = iota
	legReported          // the node reported its outcome
	legLost              // the node was lost: it will never report
	// legCancelled: the router cancelled it. The node may never report (a
	// Receiver cancelled before the Bootstrap came keeps only a tombstone),
	// so the leg ends here; a report that still comes is expected.
	legCancelled
)

type route struct {
	tokens           int
	prefill, decode  NodeID
	pLeg, dLeg       legState
	pPages, dPages   int // pages counted in each node's PagesInUse while its leg is open
	status           RouteStatus
	err              error // the client's outcome once decided
	deadline, ending time.Time
}

type routerNode struct {
	info     NodeInfo
	lost     bool
	stopping time.Time // Stopping's: no new request until then
	pages    int
	requests map[RequestID]struct{} // open legs on this node
}

type timed struct {
	id RequestID
	at time.Time
}

// Router is the router's side of the handoff, for every request of a
// deployment: intake against each node's advertised limits, the choice of a
// prefill and a decode node, relaying the legs' outcomes to the client, and
// cancelling both legs on a client disconnect, a failed leg, a timeout or a
// lost node. Every request it accepts gets exactly one client-visible
// Outcome: the first one decided; later reports change nothing.
//
// It is sans-I/O like Sender and Receiver: methods take events (with the
// current time where it matters) and accumulate effects, which Effects hands
// over. It is not safe for concurrent use.
type Router struct {
	cfg      RouterConfig
	nodes    map[NodeID]*routerNode
	reqs     map[RequestID]*route
	deadline []timed // running requests in Submit order: deadlines are monotone
	ended    []timed // ended records in the order they ended
	now      time.Time
	effects  RouterEffects
}

// NewRouter returns a router with no nodes.
func NewRouter(cfg RouterConfig) *Router {
	if cfg.Policy == nil {
		cfg.Policy = LeastPagesInUse{}
	}
	return &Router{cfg: cfg, nodes: map[NodeID]*routerNode{}, reqs: map[RequestID]*route{}}
}

// Effects returns the effects accumulated since the last call and clears them.
func (r *Router) Effects() RouterEffects {
	e := r.effects
	r.effects = RouterEffects{}
	return e
}

// AddNode registers a node, or updates its advertisement (limits may change
// at run time; requests already on it stay). A lost node added again is live
// again, with nothing on it. A live node registered again under a larger
// Incarnation has restarted (before its lease expired): its old incarnation
// is lost, as NodeLost says, and the node is live again with nothing on it.
// A smaller Incarnation than the one known is a stale registration: refused.
func (r *Router) AddNode(info NodeInfo) error {
	if err := info.validate(); err != nil {
		return err
	}
	if n := r.nodes[info.ID]; n != nil {
		switch {
		case n.info.Role != info.Role:
			return fmt.Errorf("%w: node %d is %v, advertised now as %v", ErrBadNode, info.ID, n.info.Role, info.Role)
		case info.Incarnation < n.info.Incarnation && !r.cfg.Research.Has(research.PeerByName):
			return fmt.Errorf("%w: node %d registered as incarnation %d, after incarnation %d", ErrBadNode, info.ID, info.Incarnation, n.info.Incarnation)
		case !n.lost && (info.Incarnation == n.info.Incarnation || r.cfg.Research.Has(research.PeerByName)):
			n.info = info // the same life: an advertisement update (peer-by-name: any life of that name)
			return nil
		case !n.lost:
			if err := r.NodeLost(info.ID); err != nil {
				return err
			}
		}
	}
	r.nodes[info.ID] = &routerNode{info: info, requests: map[RequestID]struct{}{}}
	return nil
}

// NodeLost says a node is gone (its registry lease expired, or it stopped
// answering; docs/protocol.md rule 14): every request dispatched to it that
// has no outcome yet fails (ErrPeerFailed with a NodeLostError, an
// ErrNodeLost). For a lost
// decode node the prefill legs are cancelled; for a lost prefill node each
// decode node is told (PeerLost), so that it cuts its queue pair to it:
// the cut is the fence for the pages it may still write, and fails each of
// its requests there. The node's advertisement still counts for intake
// limits, until RemoveNode or AddNode.
func (r *Router) NodeLost(id NodeID) error {
	n := r.nodes[id]
	if n == nil {
		return fmt.Errorf("%w: %d", ErrUnknownNode, id)
	}
	if n.lost {
		return nil
	}
	n.lost = true
	why := fmt.Errorf("%w: %w", ErrPeerFailed, &NodeLostError{Role: n.info.Role, Node: id})
	// Every request dispatched to it and still without an outcome fails,
	// even one whose leg there has ended: the spec's router fails them all.
	for _, rid := range slices.Sorted(maps.Keys(r.reqs)) {
		q := r.reqs[rid]
		if q.status == RouteRefused || q.prefill != id && q.decode != id {
			continue
		}
		if q.prefill == id {
			// Decode hears of it through PeerLost and the cut that follows,
			// which fails each request on the queue pair with its own
			// reason; one it never saw needs nothing. So the decode leg ends
			// here without a cancel of its own.
			r.endLeg(q, rid, RolePrefill, legLost)
			r.endLeg(q, rid, RoleDecode, legCancelled)
		} else {
			r.endLeg(q, rid, RoleDecode, legLost)
			// The router stops the prefill leg itself, as the spec's does:
			// this is not a failure told from one leg to the other, so it
			// happens under no-peer-cancel too.
			if q.status == RouteRunning && q.pLeg == legOpen {
				r.effects.Cancels = append(r.effects.Cancels, CancelLeg{Node: q.prefill, Request: rid})
				r.endLeg(q, rid, RolePrefill, legCancelled)
			}
		}
		r.decide(rid, q, why)
	}
	if n.info.Role == RolePrefill && !r.cfg.Research.Has(research.NoPeerCancel) {
		for _, d := range r.sortedNodes() {
			if dn := r.nodes[d]; dn.info.Role == RoleDecode && !dn.lost {
				r.effects.PeerLost = append(r.effects.PeerLost, PeerLost{Node: d, Lost: id})
			}
		}
	}
	return nil
}

// RemoveNode forgets a node: after NodeLost, or instead of it (its live
// requests fail the same way).
func (r *Router) RemoveNode(id NodeID) error {
	if err := r.NodeLost(id); err != nil {
		return err
	}
	delete(r.nodes, id)
	return nil
}

// Stopping says a node refused a leg because it is stopping (a graceful
// stop: it finishes what it holds, and takes nothing new): no new request
// goes to it until until, though its requests run on. A node stops for
// seconds, and the registry says so only at its end; meanwhile each leg a
// router sends it is refused, and its client would get an error another
// node could have spared it. A window rather than for good: the same
// name may come back (a restart) without the router being told, and if
// it is still stopping at the window's end, its next refusal opens
// another. AddNode under a larger Incarnation (the restart, registered)
// ends it, as a new life has nothing of the old one's.
func (r *Router) Stopping(id NodeID, until time.Time) error {
	n := r.nodes[id]
	if n == nil {
		return fmt.Errorf("%w: %d", ErrUnknownNode, id)
	}
	if until.After(n.stopping) {
		n.stopping = until
	}
	return nil
}

// Available reports whether a request of tokens would find a node of role
// at now: a live one, not stopping, whose limits take it.
func (r *Router) Available(role Role, tokens int, now time.Time) bool {
	for _, n := range r.nodes {
		if r.candidate(n, role, tokens, now) {
			return true
		}
	}
	return false
}

// Undecided is how many requests dispatched to node have no outcome yet,
// whether or not its own leg has ended: those NodeLost would fail.
func (r *Router) Undecided(node NodeID) int {
	n := 0
	for _, q := range r.reqs {
		if q.status == RouteRunning && (q.prefill == node || q.decode == node) {
			n++
		}
	}
	return n
}

// candidate reports whether n may be chosen for a request of tokens.
func (r *Router) candidate(n *routerNode, role Role, tokens int, now time.Time) bool {
	return n.info.Role == role && !n.lost && !now.Before(n.stopping) && tokens <= n.info.Limit()
}

func (r *Router) sortedNodes() []NodeID { return slices.Sorted(maps.Keys(r.nodes)) }

// Nodes is every registered node with its load, in ID order; lost ones are
// left out.
func (r *Router) Nodes() []NodeLoad {
	var out []NodeLoad
	for _, id := range r.sortedNodes() {
		if n := r.nodes[id]; !n.lost {
			out = append(out, NodeLoad{Info: n.info, PagesInUse: n.pages, Requests: len(n.requests)})
		}
	}
	return out
}

// Limit is the longest prompt the deployment takes now: a prompt must fit
// some prefill node and some decode node (lost nodes count until removed:
// their limits are the deployment's, not its health). 0 without both roles.
func (r *Router) Limit() int {
	var pre, dec int
	for _, n := range r.nodes {
		if n.info.Role == RolePrefill {
			pre = max(pre, n.info.Limit())
		} else {
			dec = max(dec, n.info.Limit())
		}
	}
	return min(pre, dec)
}

// Submit is the router's intake (docs/protocol.md rule 1): a prompt of
// tokens must fit the limits some prefill node and some decode node
// advertise, or it is refused for good (ErrRejected with ErrTooLong, the
// limit named). Then the Policy picks a live node of each role among those
// that fit (none live: ErrNoNode), and a Dispatch goes to the prefill node.
// A refused request gets Submit's error as its client-visible outcome and
// no Outcome effect; an accepted one gets exactly one Outcome later.
func (r *Router) Submit(id RequestID, tokens int, now time.Time) (Dispatch, error) {
	return r.SubmitBy(id, tokens, now, time.Time{})
}

// SubmitBy is Submit with a deadline of the caller's: the request fails
// with ErrTimedOut at the earlier of by and now+Timeout (a zero by: now+
// Timeout, as Submit). A client's request that the caller retries as new
// requests (a full pool) keeps one deadline across its attempts, so the
// client waits at most Timeout, not Timeout an attempt.
func (r *Router) SubmitBy(id RequestID, tokens int, now, by time.Time) (Dispatch, error) {
	r.now = now
	if q := r.reqs[id]; q != nil {
		return Dispatch{}, fmt.Errorf("%w: request %d", ErrDuplicate, id)
	}
	if limit := r.Limit(); tokens < 1 || tokens > limit {
		err := fmt.Errorf("%w: %w: %d tokens, the deployment takes 1..%d", ErrRejected, ErrTooLong, tokens, limit)
		return Dispatch{}, r.refuse(id, tokens, err)
	}
	pre, err := r.choose(RolePrefill, tokens, now)
	if err != nil {
		return Dispatch{}, r.refuse(id, tokens, err)
	}
	dec, err := r.choose(RoleDecode, tokens, now)
	if err != nil {
		return Dispatch{}, r.refuse(id, tokens, err)
	}
	q := &route{tokens: tokens, prefill: pre.info.ID, decode: dec.info.ID, status: RouteRunning,
		pPages: PagesFor(uint32(tokens), pre.info.PageTokens), dPages: PagesFor(uint32(tokens), dec.info.PageTokens)}
	r.reqs[id] = q
	for _, leg := range [...]struct {
		n     *routerNode
		pages int
	}{{pre, q.pPages}, {dec, q.dPages}} {
		leg.n.pages += leg.pages
		leg.n.requests[id] = struct{}{}
	}
	if r.cfg.Timeout > 0 || !by.IsZero() {
		q.deadline = by
		if r.cfg.Timeout > 0 && (by.IsZero() || now.Add(r.cfg.Timeout).Before(by)) {
			q.deadline = now.Add(r.cfg.Timeout)
		}
		// The queue stays in time order: a deadline of the caller's may
		// come before those of requests submitted earlier.
		i := len(r.deadline)
		for i > 0 && q.deadline.Before(r.deadline[i-1].at) {
			i--
		}
		r.deadline = slices.Insert(r.deadline, i, timed{id, q.deadline})
	}
	d := Dispatch{Request: id, Tokens: tokens, Prefill: q.prefill, Decode: q.decode}
	r.effects.Dispatches = append(r.effects.Dispatches, d)
	return d, nil
}

// refuse keeps a record of a refused request (until the horizon), so that a
// second Submit of its ID is a duplicate and Status can say why.
func (r *Router) refuse(id RequestID, tokens int, err error) error {
	q := &route{tokens: tokens, status: RouteRefused, err: err, pLeg: legReported, dLeg: legReported}
	r.reqs[id] = q
	r.retire(id, q)
	return err
}

func (r *Router) choose(role Role, tokens int, now time.Time) (*routerNode, error) {
	var cands []NodeLoad
	for _, id := range r.sortedNodes() {
		n := r.nodes[id]
		if r.candidate(n, role, tokens, now) {
			cands = append(cands, NodeLoad{Info: n.info, PagesInUse: n.pages, Requests: len(n.requests)})
		}
	}
	if len(cands) == 0 {
		for _, n := range r.nodes {
			if n.info.Role == role && !n.lost && tokens <= n.info.Limit() {
				return nil, fmt.Errorf("%w: every live %v node that takes %d tokens is stopping", ErrNoNode, role, tokens)
			}
		}
		return nil, fmt.Errorf("%w: no live %v node takes %d tokens", ErrNoNode, role, tokens)
	}
	i := r.cfg.Policy.Choose(role, tokens, cands)
	if i < 0 || i >= len(cands) {
		i = 0 // a policy out of range does not get to break intake
	}
	return r.nodes[cands[i].Info.ID], nil
}

// LegEnded relays node's Outcome for a request (rules 9 and 15) (Sender or Receiver
// Effects().Outcomes, or the error of Sender.Submit). Decode's success is
// the client's success; prefill's success only ends its leg. A failure
// decides the client's outcome (if nothing did before) and cancels the other
// leg. A report for an unknown request, from a node the request is not on,
// or a second one, returns an error and changes nothing; one for a leg the
// router cancelled, or from a node declared lost, is expected and ignored.
//
// A leg ends when its node reports, when the router cancels it, or when its
// node is lost: a node need not report on a request it never saw, so the
// router's count of pages in use on a node is an estimate (a cancelled
// leg's pages may stay quarantined there a while); the node's own intake is
// the authority.
func (r *Router) LegEnded(node NodeID, id RequestID, err error) error {
	q := r.reqs[id]
	if q == nil || q.status == RouteRefused {
		return fmt.Errorf("%w: %d", ErrUnknownRequest, id)
	}
	var role Role
	var leg legState
	switch node {
	case q.prefill:
		role, leg = RolePrefill, q.pLeg
	case q.decode:
		role, leg = RoleDecode, q.dLeg
	default:
		return fmt.Errorf("%w: request %d is on nodes %d and %d, not %d", ErrWrongPeer, id, q.prefill, q.decode, node)
	}
	switch leg {
	case legLost, legCancelled:
		return nil
	case legReported:
		return fmt.Errorf("%w: a second outcome from node %d for request %d", ErrDuplicate, node, id)
	}
	r.endLeg(q, id, role, legReported)
	switch {
	case err != nil:
		r.decide(id, q, err)
	case role == RoleDecode:
		r.decide(id, q, nil)
	}
	return nil
}

// endLeg closes one leg and gives back what it counted against its node.
func (r *Router) endLeg(q *route, id RequestID, role Role, how legState) {
	leg, node, pages := &q.pLeg, q.prefill, q.pPages
	if role == RoleDecode {
		leg, node, pages = &q.dLeg, q.decode, q.dPages
	}
	if *leg != legOpen {
		return
	}
	*leg = how
	if n := r.nodes[node]; n != nil {
		if _, ok := n.requests[id]; ok {
			delete(n.requests, id)
			n.pages -= pages
		}
	}
	r.settle(id, q)
}

// decide gives the client its outcome, once (rule 9): a failure cancels every leg
// still open (not under no-peer-cancel: the bug is exactly that a failure on
// one leg is not propagated to the other). Later decisions change nothing.
func (r *Router) decide(id RequestID, q *route, err error) {
	if q.status != RouteRunning {
		return
	}
	q.status, q.err = RouteDecided, err
	r.effects.Outcomes = append(r.effects.Outcomes, Outcome{Request: id, Err: err})
	if err != nil && !r.cfg.Research.Has(research.NoPeerCancel) {
		r.cancelOpenLegs(id, q)
	}
	r.settle(id, q)
}

func (r *Router) cancelOpenLegs(id RequestID, q *route) {
	if q.pLeg == legOpen {
		r.effects.Cancels = append(r.effects.Cancels, CancelLeg{Node: q.prefill, Request: id})
		r.endLeg(q, id, RolePrefill, legCancelled)
	}
	if q.dLeg == legOpen {
		r.effects.Cancels = append(r.effects.Cancels, CancelLeg{Node: q.decode, Request: id})
		r.endLeg(q, id, RoleDecode, legCancelled)
	}
}

// settle ends a decided request once both legs have ended.
func (r *Router) settle(id RequestID, q *route) {
	if q.status == RouteDecided && q.pLeg != legOpen && q.dLeg != legOpen {
		q.status = RouteEnded
		r.retire(id, q)
	}
}

func (r *Router) retire(id RequestID, q *route) {
	q.ending = r.now
	if r.cfg.Horizon > 0 {
		r.ended = append(r.ended, timed{id, r.now})
	}
}

// Cancel is the client's disconnect (rule 10): the request ends ErrCancelled (unless
// it already has an outcome) and both legs are cancelled, whatever state
// they are in (a node that has not seen the request yet must still take it).
// A request the router does not know returns ErrUnknownRequest.
func (r *Router) Cancel(id RequestID) error {
	q := r.reqs[id]
	if q == nil || q.status == RouteRefused {
		return fmt.Errorf("%w: %d", ErrUnknownRequest, id)
	}
	if q.status != RouteRunning {
		return nil
	}
	q.status, q.err = RouteDecided, fmt.Errorf("%w: the client went away", ErrCancelled)
	r.effects.Outcomes = append(r.effects.Outcomes, Outcome{Request: id, Err: q.err})
	if q.pLeg != legLost {
		r.effects.Cancels = append(r.effects.Cancels, CancelLeg{Node: q.prefill, Request: id})
		r.endLeg(q, id, RolePrefill, legCancelled)
	}
	if q.dLeg != legLost {
		r.effects.Cancels = append(r.effects.Cancels, CancelLeg{Node: q.decode, Request: id})
		r.endLeg(q, id, RoleDecode, legCancelled)
	}
	r.settle(id, q)
	return nil
}

// Tick fails (rule 12), with a Timeout, every request still without an outcome at its
// deadline, and forgets, with a Horizon, records that ended at least that
// long before now. Both are queues in time order: a Tick costs what it
// expires, not what the router holds.
func (r *Router) Tick(now time.Time) {
	r.now = now
	for len(r.deadline) > 0 && !now.Before(r.deadline[0].at) {
		t := r.deadline[0]
		r.deadline = r.deadline[1:]
		if q := r.reqs[t.id]; q != nil && q.status == RouteRunning && q.deadline.Equal(t.at) {
			r.decide(t.id, q, fmt.Errorf("%w: no outcome by its deadline (timeout %v)", ErrTimedOut, r.cfg.Timeout))
		}
	}
	for len(r.ended) > 0 && now.Sub(r.ended[0].at) >= r.cfg.Horizon {
		t := r.ended[0]
		r.ended = r.ended[1:]
		if q := r.reqs[t.id]; q != nil && q.ending.Equal(t.at) && (q.status == RouteEnded || q.status == RouteRefused) {
			delete(r.reqs, t.id)
		}
	}
}

// Records is the number of request records the router keeps, live and ended.
func (r *Router) Records() int { return len(r.reqs) }

// RouteInfo is a request as the router sees it.
type RouteInfo struct {
	Status          RouteStatus
	Tokens          int
	Prefill, Decode NodeID // the nodes chosen (for an accepted request)
	// PrefillOpen and DecodeOpen say the leg has not ended (no outcome from
	// the node, and the node not lost).
	PrefillOpen, DecodeOpen bool
	// Err is the client's outcome once decided (nil is success), or Submit's
	// error for a refused request.
	Err error
}

// Request is request id's state at the router (Status RouteNone if it never
// saw it, or forgot it).
func (r *Router) Request(id RequestID) RouteInfo {
	q := r.reqs[id]
	if q == nil {
		return RouteInfo{}
	}
	return RouteInfo{Status: q.status, Tokens: q.tokens, Prefill: q.prefill, Decode: q.decode,
		PrefillOpen: q.pLeg == legOpen, DecodeOpen: q.dLeg == legOpen, Err: q.err}
}
