package model

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/protocol/checksum"
	"github.com/kvhandoff/kvhandoff/protocol/protocoltest"
	"github.com/kvhandoff/kvhandoff/spec"
)

// Refinement runs the implementation beside the spec, one spec action at a
// time: the real protocol.Router, a protocol.Sender per prefill node and a
// protocol.Receiver per decode node of the spec's deployment
// (Config.Prefills × Config.Decodes), over an in-memory queue pair per
// (prefill, decode) pair and in-memory RDMA whose every placement the
// harness performs, and in-memory queues from the router to each node.
// After every step it maps the implementation's state to the spec's (View)
// and fails on any difference; the spec's properties are then evaluated on
// the spec state, which the mapping has just shown equal.
//
// The router's part of the view is each request's client-visible outcome
// and reason (Router.Request) and the router's messages to each node in
// order (Dispatch as the spec's Prefill, CancelLeg as Abort, PeerLost as
// PeerFailed). The spec's router checks only the advertised context length,
// so the harness advertises every node as taking ContextLimit tokens: the
// Router's intake then decides exactly what the spec's does, and each node's
// own intake is exercised as in the incident. The spec's router may route a
// request to any live pair; the Router's policy picks one, and the harness
// takes the spec's Submit for that route (one the spec does not allow parts
// ways). One thing the Router does that the spec's router does not: on a
// failed leg (or a lost node) it also cancels the other leg, a second path
// beside the legs' own Abort and AbortAck. The harness checks that each such
// cancel names a leg of a request that has just failed, and does not deliver
// it (the spec has no action for it; with static peers, those of prefill
// legs are the spec's, below); the simulation delivers them.
//
// The correspondence, action by action:
//
//	Submit        Router.Submit; its Dispatch on the router→prefill queue of the node it chose
//	PrefillRecv   Sender.Submit (or Sender.Cancel for an Abort);
//	              for the news of a decode node's restart, the cut of the queue pair to the
//	              old incarnation (Sender.Flushed) before one to the new is held
//	PrefillRecvQP Sender.Step with the Grant or Abort at the head of the pair's decode→prefill
//	Compute       the request's next page computed into its source page (the engine's
//	              chunk of one page), then Sender.ComputedPages with the pages computed
//	PostWrite     the next WRITE of the request the sender emitted is handed to the wire
//	DecodeRecvQP  the head of the pair's wire: a WRITE placed (payload, then tag record) and
//	              Sender.Completed, or a SEND given to Receiver.Step
//	DecodeRecv    Receiver.Cancel; Receiver.PeerFailed and the cut it asks for; or, for
//	              the news of a restart, the cut of the old incarnation's queue pair
//	DecodeRead    Receiver.Acquire, the pages read and checked, Receiver.Finish
//	DetectCrash   Router.NodeLost; its PeerLost on the router→decode queues
//	LeaseLost     Router.NodeLost, the node living on: for a prefill node as
//	              DetectCrash; for a decode node its prefill legs' cancels
//	              delivered as the spec's Aborts, and the registry's news
//	              (PeerFailed) to every prefill node
//	Cancel        Router.Cancel; its CancelLegs on both queues
//	Timeout       Receiver.Expire
//	Cut           both ends fenced: Receiver.QueuePairFenced, Sender.Flushed
//	Crash         the sender is dropped: it is never called again
//	Restart       a new Sender over the same source memory; Router.AddNode with the
//	              next Incarnation; the registry's news on every router→decode queue.
//	              Of a decode node (Config.DecodeRestarts): a new Receiver over the same
//	              page memory (fresh pool, epochs from zero), the wire to it flushed,
//	              Router.AddNode with the next Incarnation (its prefill legs' cancels
//	              delivered as the spec's Aborts), and the registry's news (PeerFailed,
//	              PeerRestarted) on every router→prefill queue
//	Partition     decode node d cut off: its Receiver is never called again (a fresh one
//	              over the same page memory stands for it in the view), what is on the
//	              wire to it or back from it is lost without a word to either end, and
//	              what is sent to it later is lost too; the Router lists it until the
//	              spec's DetectCrash of it, its lease's expiry (as LeaseLost of a decode node)
//	DataplaneCut  every queue pair to decode node d cut as by Cut, and none set up again:
//	              a later intake over one fails as over a fenced one (no queue pair);
//	              the Router still lists d
//	RetryExceeded (static peers) RC's retry limit errors prefill p's end of its queue pair
//	              to partitioned decode node d: Sender.Flushed, as a cut's at prefill's
//	              end (transfer: the failed completion breaks the queue pair, and once
//	              its flush drains, Prefill.fenced calls Flushed); the silent end hears
//	              nothing, and the queue pair stays cut (no new one to a silent node can
//	              be set up). Only where prefill posted work on it that no one
//	              acknowledged: a WRITE or SEND the harness lost to the partition
//
// A queue pair is live while each end is the other's current incarnation;
// what is posted on one that is not is flushed: a SEND at once, a WRITE at
// the spec's PostWrite, which flushes it too (it is never placed and never
// completes). The view shows both incarnations of each pair, each message's
// decode incarnation, each decode node's, and the decode incarnation each
// request was routed to (the one the Router had registered).
//
// The news of a node's loss that the Router leaves to the registry, the
// harness delivers as the registry would: to every prefill node when a
// decode node is lost (the Router cancels legs; each prefill node's own
// registry watch makes it cut its queue pair), and to a lost decode node,
// which may live on, when a prefill node is lost (the Router tells only the
// live ones).
//
// With static peers (spec.Config.StaticPeers: serve --peers, a registry
// that never loses a node) the registry tells no prefill node of a decode
// node's loss, and the harness delivers no PeerFailed for it. The Router's
// cancels of a failed request's open prefill leg (Router.decide's rule 15,
// and NodeLost's own cancel of a lost decode node's legs) are then the
// spec's (its staticLegCancel): the harness delivers each as an Abort on the
// router→prefill queue, where the view compares them with the spec's. Its
// cancels of a decode leg stay checked and undelivered, as without static
// peers: the spec's router sends decode none. The view also shows, per
// queue pair, whether prefill posted work on it that no one will acknowledge
// (the spec's Unacked): the harness's own record of what it lost to a
// partition, against the spec's.
//
// Two differences of granularity are mapped, not hidden. A Sender emits a
// whole window of WRITEs (and Done behind them) in one step, where the spec
// posts one WRITE per PostWrite: the harness keeps what each Sender emitted as
// its send backlog and hands each operation to the wire when the spec posts
// it, failing if the spec posts something the Sender did not emit, or if the
// Sender emitted a message (not a WRITE, nor what queues behind one) that the
// spec did not send. And the spec lets a reservation take any free pages in
// any order, where the pool takes the most recently freed: the harness picks
// the spec successor whose reservation equals the pool's.
//
// Source pages too: the spec (with Config.AnySourcePages, which the harness
// turns on) lets an intake take any free source pages, where the Sender's
// pool takes the most recently freed, and the harness takes the spec
// successor with the pool's.
type Refinement struct {
	m      *spec.Model
	cfg    spec.Config
	s      spec.State
	router *protocol.Router
	bugs   research.Switches
	pre    []*prefillEnd
	dec    []*decodeEnd
	pairs  [][]*pairEnd // [prefill][decode]
	size   int

	// step's look at the spec's successors that match its action (see
	// step), with a closure made once: how many there are, and the first,
	// or with matchKeep set the first that matchKeep accepts.
	matchAction  spec.Action
	matches      int
	matchKeep    func(r int, n *spec.State) bool
	matchFound   bool
	match        spec.State
	collectMatch func(b spec.Action, n *spec.State)

	srcPages [spec.MaxRequests][]uint32
	// computed is how many of each request's pages its engine has computed
	// (the Sender was told, ComputedPages).
	computed   [spec.MaxRequests]int
	granted    [spec.MaxRequests][]protocol.PageRef
	readLabels [spec.MaxRequests][]string
	// gone is the sender's phase of a request whose prefill node crashed,
	// as it stood then: no Sender holds it any more.
	gone [spec.MaxRequests]string
	// refused: decode's intake refused the request, which leaves no record there.
	refused [spec.MaxRequests]bool
	// routedInc is the incarnation of its decode node that the Router had
	// registered when it dispatched the request.
	routedInc [spec.MaxRequests]uint64
	sums      map[uint64]spec.Label
	// With the prefix cache: each request's chain hashes (from its
	// prompt's tokens, as the router computes them), and the spec's chain
	// id of each hash.
	chain   [spec.MaxRequests][]protocol.ChainHash
	chainID map[protocol.ChainHash]uint8

	// keepQueuePairAtDecodeRestart is a test-only mutation: a prefill node
	// that takes the news of a decode node's restart moves its queue pair
	// to the new incarnation without cutting the old one (its legs live on).
	keepQueuePairAtDecodeRestart bool
	// With static peers, the Router's cancels of prefill legs the harness
	// delivered: of a request that failed (rule 15, from decide), and of a
	// lost decode node's requests (NodeLost's own), for the tests' figures.
	failCancels, lossCancels int

	// rogueIgnoresKeys is a test-only mutation: every rogue WRITE lands,
	// whatever its key (a pool-wide key, never revoked).
	rogueIgnoresKeys bool

	// Faults picks the fault variant (spec.Late, spec.Corrupt bits) of each
	// WRITE the Sender posts, for request r; nil posts every WRITE cleanly.
	// A variant the spec does not allow now (no budget left) is ignored.
	Faults func(r int) uint16

	// Trace is every step taken, for a failure report.
	Trace []string
}

// prefillEnd is one prefill node: its Sender (replaced at a restart), its
// source memory, and what is addressed to it.
type prefillEnd struct {
	snd       *protocol.Sender
	cfg       protocol.SenderConfig
	src       *protocoltest.Memory
	crashed   bool
	inc       uint64        // its incarnation: restarts so far
	staged    []protocol.Op // emitted by the Sender, not yet on the wire
	toPrefill []spec.Msg    // the router's messages, as the spec's
}

// decodeEnd is one decode node: its Receiver (replaced at a restart) over
// its page memory (never zeroed), and what is addressed to it.
// unstage drops what the Sender emitted for decode node d and the wire has
// not taken: the queue pair to d is gone.
func (pe *prefillEnd) unstage(d int) {
	kept := pe.staged[:0]
	for _, op := range pe.staged {
		if op.Peer != qpTo(decodeID(d)) {
			kept = append(kept, op)
		}
	}
	pe.staged = kept
}

type decodeEnd struct {
	recv     *protocol.Receiver
	cfg      protocol.ReceiverConfig
	dst      *protocoltest.Memory
	inc      uint64 // its incarnation: restarts so far
	toDecode []spec.Msg
	// partitioned: cut off for good (the spec's partition fault): what is
	// sent to it or by it is lost, and it is never called again.
	partitioned bool
	// severed: the data plane to it is cut for good (the spec's
	// dataplane-cut fault): no queue pair to it can be set up.
	severed bool
}

// pairEnd is the queue pair between a prefill and a decode node.
type pairEnd struct {
	wire   []wireOp // prefill→decode: the spec's QP
	back   []backMsg
	inc    uint64 // the incarnation of the prefill node decode holds it for
	dinc   uint64 // the incarnation of the decode node prefill holds it to
	fenced bool   // cut for good: one end was declared lost
	// unacked: with static peers, prefill posted work on it (a WRITE or a
	// SEND) to a partitioned decode node, which no one will acknowledge:
	// RC's retry limit will error prefill's end (the spec's Unacked).
	unacked bool
}

type wireOp struct {
	op     protocol.Op
	damage uint8  // what the corrupt fault damages in transit: spec.DamagedPayload, a tag field, or 0
	inc    uint64 // the incarnation of the prefill node that posted it
	dinc   uint64 // the incarnation of the decode node it was posted to
}

// backMsg is a SEND decode→prefill, with the decode incarnation that sent it.
type backMsg struct {
	msg  protocol.Message
	dinc uint64
}

// writeDamage is what a PostWrite variant damages (spec.Msg.Damage).
func writeDamage(variant uint16) uint8 {
	if variant&spec.Corrupt == 0 {
		return 0
	}
	return uint8(variant>>2&3) + 1 // the two bits above Corrupt: payload, tag request, index, epoch
}

// ErrRefinement says the implementation and the spec parted ways.
var ErrRefinement = errors.New("refinement mapping differs")

// ErrAudit says a Receiver's own audit (Receiver.Audit: the pool's
// bookkeeping, every pin held on a page still cached) failed while the
// views were equal. A bug the spec also has can do that in the very step
// where the spec's property breaks: the driver reports the property first.
var ErrAudit = errors.New("a receiver's audit failed")

// ErrOutOfBounds says the run left the spec's bounds: a queue of the spec
// reached spec.MaxQueue, where the spec drops the message and flags
// WithinBounds. It is a limit of the model, not a difference: the run ends.
var ErrOutOfBounds = errors.New("the spec's queue bound was reached")

// The nodes' names at the Router. Prefill node p is prefillID(p), decode
// node d decodeID(d).
const (
	prefillPeer = protocol.NodeID(1)
	decodePeer  = protocol.NodeID(11)
)

func prefillID(p int) protocol.NodeID  { return prefillPeer + protocol.NodeID(p) }
func decodeID(d int) protocol.NodeID   { return decodePeer + protocol.NodeID(d) }
func prefillOf(id protocol.NodeID) int { return int(id - prefillPeer) }
func decodeOf(id protocol.NodeID) int  { return int(id - decodePeer) }

// At a Sender or Receiver, the queue pair to a node is named by that node's
// NodeID: the mapping has one queue pair per pair of nodes and replaces it
// only with a node's incarnation, when the old one's end is gone.
func qpTo(n protocol.NodeID) protocol.PeerID { return protocol.PeerID(n) }

// nodeAt is the node at the other end of a queue pair.
func nodeAt(qp protocol.PeerID) protocol.NodeID { return protocol.NodeID(qp) }

// id maps a spec request to the implementation's request ID.
func id(r int) protocol.RequestID { return protocol.RequestID(r + 1) }

// NewRefinement builds the implementation for cfg, with the implementation
// switches named like the spec's switches that cfg turns on.
func NewRefinement(cfg spec.Config) (*Refinement, error) {
	bugs, err := research.Parse(strings.Join(cfg.Bugs.Names(), ","))
	if err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	return NewRefinementWith(cfg, bugs)
}

// NewRefinementWith runs an implementation with its own switches, bugs,
// beside the spec of cfg: with a switch on in the implementation alone, the
// mapping must part ways (how the harness shows it can fail).
func NewRefinementWith(cfg spec.Config, bugs research.Switches) (*Refinement, error) {
	// The Sender's pool takes the most recently freed source pages: the spec
	// explores every choice, and the harness takes the Sender's.
	cfg.AnySourcePages = true
	m, err := spec.New(cfg)
	if err != nil {
		return nil, err
	}
	if cfg.PrefixCache > 0 && cfg.PrefixCache < cfg.DecodePages {
		// The Receiver's cache is bounded by its pool alone: the spec's
		// must never be the one that stops an insertion.
		return nil, fmt.Errorf("model: the refinement maps a prefix cache as large as the pool (%d pages), not %d", cfg.DecodePages, cfg.PrefixCache)
	}
	const size = 64
	h := &Refinement{m: m, cfg: cfg, s: m.Initial()[0], size: size, sums: map[uint64]spec.Label{}, bugs: bugs}
	h.collectMatch = func(b spec.Action, n *spec.State) {
		// The action itself, or any of the spec's choices that the
		// implementation makes itself (a reservation's pages, an intake's
		// source pages).
		a := h.matchAction
		if !(b == a || a.Kind == spec.DecodeRecvQP && b.Kind == spec.DecodeRecvQP && b.Req == a.Req ||
			a.Kind == spec.PrefillRecv && b.Kind == spec.PrefillRecv && b.Arg&15 == a.Arg) {
			return
		}
		switch {
		case h.matchKeep == nil:
			if h.matches == 0 {
				h.match = *n
			}
			h.matches++
		case !h.matchFound && h.matchKeep(int(a.Req), n):
			h.match, h.matchFound = *n, true
		}
	}
	if err := h.chains(); err != nil {
		return nil, err
	}
	// Every node advertises what the spec's router trusts: ContextLimit tokens.
	h.router = protocol.NewRouter(protocol.RouterConfig{Research: bugs})
	for p := 0; p < cfg.NumPrefills(); p++ {
		if err := h.router.AddNode(h.nodeInfo(prefillID(p), protocol.RolePrefill, 0)); err != nil {
			return nil, err
		}
		src := protocoltest.NewMemory(cfg.PrefillPages, size)
		for pg := 0; pg < cfg.PrefillPages; pg++ { // an earlier tenant's KV: source pages are never zeroed either
			h.fill(src.Payload(uint32(pg)), spec.Label{Req: spec.Tenant})
		}
		sc := protocol.SenderConfig{Pages: cfg.PrefillPages, PageTokens: cfg.PageSize,
			MaxInFlight: cfg.MaxInFlight, Memory: src, TagKeys: refKeys, Research: bugs}
		snd, err := protocol.NewSender(sc)
		if err != nil {
			return nil, err
		}
		h.pre = append(h.pre, &prefillEnd{snd: snd, cfg: sc, src: src})
		h.pairs = append(h.pairs, make([]*pairEnd, cfg.NumDecodes()))
		for d := range h.pairs[p] {
			h.pairs[p][d] = &pairEnd{}
		}
	}
	tenant := spec.Label{Req: spec.Tenant}
	for d := 0; d < cfg.NumDecodes(); d++ {
		if err := h.router.AddNode(h.nodeInfo(decodeID(d), protocol.RoleDecode, 0)); err != nil {
			return nil, err
		}
		dst := protocoltest.NewMemory(cfg.DecodePages, size)
		for p := 0; p < cfg.DecodePages; p++ { // an earlier tenant's KV and tag record: pages are never zeroed
			h.fill(dst.Payload(uint32(p)), tenant)
			copy(dst.TagRecord(uint32(p)), protocol.Tag{Request: tenantID, Tokens: 1, Sum: checksum.Sum(dst.Payload(uint32(p)))}.Append(nil, refKey))
		}
		rc := protocol.ReceiverConfig{Pages: cfg.DecodePages, PageTokens: cfg.PageSize,
			MaxTokens: cfg.DecodeLimit(), Slots: cfg.DecodeSlots, Memory: dst, TagKeys: refKeys,
			Region: func(p uint32) (uint64, uint32) { return uint64(p) << 20, 0x1000 }, Research: bugs}
		if cfg.PrefixCache > 0 {
			// The scope comes authenticated: the router's ticket binds it
			// (node's Authorize, tested there); the model's peers are
			// honest, each Bootstrap the one the router dispatched.
			rc.PrefixCache = true
			rc.Authorize = func(protocol.PeerID, *protocol.Bootstrap) error { return nil }
		}
		recv, err := protocol.NewReceiver(rc)
		if err != nil {
			return nil, err
		}
		h.dec = append(h.dec, &decodeEnd{recv: recv, cfg: rc, dst: dst})
	}
	return h, h.compare("initial state")
}

// chains works out each request's prompt tokens and chain hashes with the
// prefix cache: page i of request r holds tokens named by the letter of its
// contents (spec.Config.Contents), so two prompts agree up to a page
// exactly when the spec's chains do; past the pages of a declared public
// prefix a public request's tokens also carry its tenant, as the node's
// router salts the chain there with it (so only the tenant's own requests
// share those pages). It names each hash by the spec's chain id, failing
// if the two disagree.
func (h *Refinement) chains() error {
	if h.cfg.PrefixCache == 0 {
		return nil
	}
	h.chainID = map[protocol.ChainHash]uint8{}
	for r, t := range h.cfg.Prompts {
		if h.scopeOf(r) == 0 {
			continue
		}
		tokens := make([]uint32, t)
		for j := range tokens {
			letter := uint32('a')
			if i := j / h.cfg.PageSize; len(h.cfg.Contents) > 0 && i < len(h.cfg.Contents[r]) {
				letter = uint32(h.cfg.Contents[r][i])
			}
			tokens[j] = letter<<8 | uint32(j%h.cfg.PageSize)
			if pub := h.cfg.PublicPages(r); pub > 0 && j/h.cfg.PageSize >= pub {
				tokens[j] |= uint32(h.cfg.Scopes[r]) << 16 // the tenant's salt
			}
		}
		h.chain[r] = protocol.PrefixChain(tokens, h.cfg.PageSize)
		if t > h.cfg.ContextLimit {
			continue // the router refuses it: no decode node sees its chain
		}
		for i, c := range h.chain[r] {
			id := h.m.Chain(r, i)
			if old, ok := h.chainID[c]; ok && old != id || id == 0 {
				return fmt.Errorf("model: r%d's chain hash at page %d is the spec's chain %d and %d", r, i, old, id)
			}
			h.chainID[c] = id
		}
	}
	return nil
}

// scopeOf is the scope the router gives request r: its authenticated
// tenant's (spec.Config.Scopes), or the public scope for a request that
// starts with the declared public prefix; never one its client names.
func (h *Refinement) scopeOf(r int) protocol.Scope {
	switch {
	case h.cfg.PrefixCache == 0 || len(h.cfg.Scopes) == 0:
		return 0
	case h.cfg.PublicPages(r) > 0:
		return spec.PublicScope
	}
	return protocol.Scope(h.cfg.Scopes[r])
}

// nodeInfo is node id's registration in role as its incarnation inc:
// every node advertises what the spec's router trusts, ContextLimit tokens.
func (h *Refinement) nodeInfo(id protocol.NodeID, role protocol.Role, inc uint64) protocol.NodeInfo {
	return protocol.NodeInfo{ID: id, Role: role, ContextTokens: h.cfg.ContextLimit,
		PoolPages: protocol.PagesFor(uint32(h.cfg.ContextLimit), h.cfg.PageSize), PageTokens: h.cfg.PageSize, Incarnation: inc}
}

// registered reports whether the Router lists node id as live, and under
// which incarnation: the registry's view, which a restarted node's new
// incarnation takes its queue pairs from.
func (h *Refinement) registered(id protocol.NodeID) (bool, uint64) {
	for _, n := range h.router.Nodes() {
		if n.Info.ID == id {
			return true, n.Info.Incarnation
		}
	}
	return false, 0
}

// live reports whether queue pair (p, d) joins the live incarnations of
// both nodes: not fenced, and each end the one the other holds. What is
// posted on one that is not is flushed: its other end is gone, or has not
// accepted this one yet.
func (h *Refinement) live(p, d int) bool {
	pr := h.pairs[p][d]
	return !pr.fenced && pr.inc == h.pre[p].inc && pr.dinc == h.dec[d].inc && !h.dec[d].partitioned && !h.dec[d].severed
}

// postedIntoSilence records that prefill node p's work on its queue pair to
// decode node d was lost to d's partition (in flight at it, or posted into
// it): nothing will acknowledge it, so RC's retry limit will error prefill's
// end. Only static peers need it (spec: postedIntoSilence); on a fenced
// queue pair a post fails at once, and a crashed node posts nothing.
func (h *Refinement) postedIntoSilence(p, d int) {
	if pr := h.pairs[p][d]; h.cfg.StaticPeers && h.dec[d].partitioned && !pr.fenced && !h.pre[p].crashed {
		pr.unacked = true
	}
}

// tellDecode is a message of the router or the registry to decode node d:
// lost if d is partitioned.
func (h *Refinement) tellDecode(d int, m spec.Msg) {
	if de := h.dec[d]; !de.partitioned {
		de.toDecode = append(de.toDecode, m)
	}
}

const tenantID = protocol.RequestID(1 << 40)

// fill writes the payload label l names into dst, and remembers its
// checksum, so that a tag record's sum reads back as the label it covers.
func (h *Refinement) fill(dst []byte, l spec.Label) {
	b := h.bytesOf(l)
	h.sums[checksum.Sum(b)] = l
	copy(dst, b)
}

// bytesOf is the payload a label names: the first bytes say whose KV it is.
func (h *Refinement) bytesOf(l spec.Label) []byte {
	b := make([]byte, h.size)
	for j := range b {
		b[j] = payloadByte(l, j, len(b))
	}
	return b
}

// payloadByte is byte j of the size bytes bytesOf writes for l.
func payloadByte(l spec.Label, j, size int) byte {
	v := byte(int(l.Req)*31 + int(l.Index)*7 + j)
	switch j {
	case 0:
		v = byte(l.Req)
	case 1:
		v = byte(l.Index)
	}
	if l.Corrupt && j == size/2 {
		v ^= 0x40
	}
	return v
}

// holdsLabel reports whether b is the payload of l, as bytesOf writes it,
// without writing it: views read every page at every step.
func (h *Refinement) holdsLabel(b []byte, l spec.Label) bool {
	if len(b) != h.size {
		return false
	}
	for j, v := range b {
		if v != payloadByte(l, j, len(b)) {
			return false
		}
	}
	return true
}

// labelOf reads a payload back as a label.
func (h *Refinement) labelOf(b []byte) string {
	l := spec.Label{Req: int8(b[0]), Index: int8(b[1])}
	if h.holdsLabel(b, l) {
		return l.String()
	}
	l.Corrupt = true
	if h.holdsLabel(b, l) {
		return l.String()
	}
	return fmt.Sprintf("bytes %x...", b[:4])
}

// State is the spec state the implementation is at.
func (h *Refinement) State() *spec.State { return &h.s }

// Model is the spec model.
func (h *Refinement) Model() *spec.Model { return h.m }

// The nodes of request r's route (the spec's, set at Submit).
func (h *Refinement) routeOf(r int) (p, d int) { return int(h.s.Req[r].P), int(h.s.Req[r].D) }

// Enabled lists the spec's enabled actions that a driver chooses: not
// PostWrite, which follows the Sender (see Step); for a Submit, an intake and
// a reservation one action only, since the Router chooses the route and the
// pools the pages.
func (h *Refinement) Enabled() []spec.Action {
	var out []spec.Action
	seen := map[spec.Action]bool{}
	h.m.Successors(&h.s, func(a spec.Action, _ *spec.State) {
		switch {
		case a.Kind == spec.PostWrite:
			return
		case a.Kind == spec.DecodeRecvQP, a.Kind == spec.Submit:
			a.Arg = 0
		case a.Kind == spec.PrefillRecv:
			a.Arg &= 15 // the node; the Sender's pool chooses the source pages
		}
		if !seen[a] {
			seen[a] = true
			out = append(out, a)
		}
	})
	return out
}

// Step applies a to both the spec and the implementation and compares them;
// then, for every WRITE a Sender emitted, it takes the spec's PostWrite
// (with the fault variant Faults picks) and compares again. A Sender posts
// eagerly, as soon as its window allows: that is one of the schedules the
// spec allows, so refinement holds if every such step is a spec step.
func (h *Refinement) Step(a spec.Action) error {
	switch a.Kind {
	case spec.PostWrite:
		return fmt.Errorf("model: PostWrite follows the sender; drive the other actions")
	case spec.Submit:
		// The Router chooses the route; the spec's Submit is the one for it.
		r := int(a.Req)
		d, err := h.router.Submit(id(r), h.cfg.Prompts[r], time.Unix(0, 0)) // a refusal is the request's state at the router
		a.Arg = 0
		if err == nil {
			a.Arg = spec.Route(prefillOf(d.Prefill), decodeOf(d.Decode))
			_, h.routedInc[r] = h.registered(d.Decode)
		}
		enabled := false
		h.m.Successors(&h.s, func(b spec.Action, _ *spec.State) { enabled = enabled || b == a })
		if !enabled {
			return fmt.Errorf("%w: the router's intake of r%d (%+v, %v) is no Submit the spec allows now", ErrRefinement, r, d, err)
		}
	}
	if err := h.step(a); err != nil {
		return err
	}
	if err := h.postBacklog(a); err != nil {
		return err
	}
	// A Sender posts as soon as it may: a WRITE the spec could post now and
	// the Sender has not emitted is a sender that lags behind the spec.
	posts := h.postsEnabled()
	for r := range h.cfg.Prompts {
		if posts[spec.Action{Kind: spec.PostWrite, Req: int8(r)}] {
			return fmt.Errorf("%w after %v: the spec posts r%d's next WRITE now; the sender has not", ErrRefinement, a, r)
		}
	}
	return nil
}

// postBacklog takes the spec's PostWrite for every WRITE a Sender emitted.
func (h *Refinement) postBacklog(a spec.Action) error {
	for p, pe := range h.pre {
		for len(pe.staged) > 0 {
			op := pe.staged[0]
			if op.Write == nil {
				return fmt.Errorf("%w after %v: the sender sent %s, which the spec did not", ErrRefinement, a, h.describe(op))
			}
			r := int(op.Write.Request) - 1
			enabled := h.postsEnabled()
			post := spec.Action{Kind: spec.PostWrite, Req: int8(r)}
			if h.Faults != nil {
				if v := h.Faults(r); enabled[spec.Action{Kind: spec.PostWrite, Req: int8(r), Arg: v}] {
					post.Arg = v
				}
			}
			if !enabled[post] {
				return fmt.Errorf("%w after %v: the sender posted %s, which the spec does not allow now", ErrRefinement, a, h.describe(op))
			}
			if d := decodeOf(nodeAt(op.Peer)); !h.live(p, d) {
				// Posted on a queue pair that is not live (fenced, or an end
				// of it is a replaced incarnation): flushed, never placed,
				// never completed; the spec's PostWrite flushes it too. Into
				// a partitioned node it is lost instead, unacknowledged.
				pe.staged = pe.staged[1:]
				h.postedIntoSilence(p, d)
			}
			if err := h.step(post); err != nil {
				return err
			}
		}
	}
	return nil
}

// postsEnabled is the set of PostWrite actions (every variant) the spec
// enables now.
func (h *Refinement) postsEnabled() map[spec.Action]bool {
	out := map[spec.Action]bool{}
	h.m.Successors(&h.s, func(b spec.Action, _ *spec.State) {
		if b.Kind == spec.PostWrite {
			out[b] = true
		}
	})
	return out
}

// step is one spec step beside its implementation part: the successor taken
// is the one the implementation's choice matches, the messages the spec sent
// are handed from the Senders' backlogs to the wires, and the views compared.
func (h *Refinement) step(a spec.Action) error {
	// The spec's successors that match a are counted, and the first kept,
	// before the implementation acts. Where there are several (the pages
	// of a reservation, the source pages of an intake: choices the pools
	// make), the one that matches the implementation's choice is found
	// after it acted, by a second look: copying every choice (up to 120
	// States of 3.4 KB for 3 pages of 6) was a tenth of a walk's CPU.
	h.matchAction, h.matches, h.matchKeep = a, 0, nil
	h.m.Successors(&h.s, h.collectMatch)
	if h.matches == 0 {
		return fmt.Errorf("model: %v is not enabled", a)
	}
	h.Trace = append(h.Trace, a.String())
	var before [spec.MaxPrefills][spec.MaxDecodes][]spec.Msg
	for p := range h.pre {
		for d := range h.dec {
			before[p][d] = append([]spec.Msg(nil), h.s.QP[p][d].Items()...)
		}
	}
	var popped [spec.MaxPrefills][spec.MaxDecodes]int
	if err := h.apply(a, &popped); err != nil {
		return err
	}
	if h.matches > 1 {
		r := int(a.Req)
		h.matchKeep = h.grantMatches // a reservation: the spec state whose pages are the pool's
		if a.Kind == spec.PrefillRecv {
			h.matchKeep = h.sourceMatches // an intake: the spec state whose source pages are the pool's
		}
		h.matchFound = false
		h.m.Successors(&h.s, h.collectMatch)
		h.matchKeep = nil
		if !h.matchFound {
			h.match = spec.State{}
		}
		switch {
		case a.Kind == spec.PrefillRecv && !h.match.Req[r].S.SrcHeld:
			return fmt.Errorf("%w after %v: the pool took source pages %v, which no spec choice takes", ErrRefinement, a, h.srcPages[r])
		case a.Kind != spec.PrefillRecv && !h.match.Req[r].R.Phase.Live():
			return fmt.Errorf("%w after %v: the pool reserved pages no spec choice reserves: %v", ErrRefinement, a, h.grantOf(r))
		}
	}
	h.s = h.match
	if h.s.Overflow {
		return fmt.Errorf("%w after %v (queue bound %d)", ErrOutOfBounds, a, h.cfg.QueueBound())
	}
	// Whatever the spec put on a queue pair in this step, the harness hands
	// from the Sender's backlog to the wire, in the same order. A queue
	// that no longer starts with what was left of it was cleared (a cut).
	for p := range h.pre {
		for d := range h.dec {
			after, left := h.s.QP[p][d].Items(), before[p][d][popped[p][d]:]
			sent := after
			if len(after) >= len(left) && slices.Equal(after[:len(left)], left) {
				sent = after[len(left):]
			}
			for _, msg := range sent {
				if err := h.release(p, msg, msg.Damage); err != nil {
					return fmt.Errorf("%w after %v: %v", ErrRefinement, a, err)
				}
			}
		}
	}
	for _, pe := range h.pre {
		if len(pe.staged) > 0 {
			return nil // a Sender ran ahead: compared once the spec has posted what it emitted
		}
	}
	return h.compare(a.String())
}

// apply does a's part on the implementation's side. popped counts what it
// took off the head of each pair's wire.
func (h *Refinement) apply(a spec.Action, popped *[spec.MaxPrefills][spec.MaxDecodes]int) error {
	r := int(a.Req)
	var err error
	switch a.Kind {
	case spec.Submit:
		// Router.Submit ran in Step, which chose this action by its route.
		err = h.routerEffects(a, false)
	case spec.PrefillRecv:
		err = h.applyPrefillRecv(a)
	case spec.PrefillRecvQP:
		err = h.applyPrefillRecvQP(a)
	case spec.PostWrite:
		err = h.applyPostWrite(a)
	case spec.Compute:
		if err := h.compute(r); err != nil {
			return fmt.Errorf("%w after %v: %v", ErrRefinement, a, err)
		}
	case spec.DecodeRecvQP:
		p, d := h.routeOf(r)
		popped[p][d] = 1
		h.deliver(p, d)
	case spec.DecodeRecv:
		h.applyDecodeRecv(a)
	case spec.DecodeRead:
		if err := h.read(r); err != nil {
			return fmt.Errorf("%w after %v: %v", ErrRefinement, a, err)
		}
	case spec.DetectCrash, spec.LeaseLost:
		err = h.applyLoss(a)
	case spec.Cancel:
		err = h.applyCancel(a)
	case spec.Crash:
		h.applyCrash(a)
	case spec.Restart:
		err = h.applyRestart(a)
	case spec.Timeout:
		_, d := h.routeOf(r)
		if err := h.dec[d].recv.Expire(id(r)); err != nil {
			return fmt.Errorf("%w after %v: %v", ErrRefinement, a, err)
		}
	case spec.Cut:
		ap, ad := int(a.Arg>>4), int(a.Arg&15) // the pair of the actions that name one
		h.cut(ap, ad)
	case spec.RetryExceeded:
		err = h.retryExceeded(int(a.Arg>>4), int(a.Arg&15))
	case spec.RogueWrite:
		h.rogueWrite(r, int(a.Arg))
	case spec.RogueBootstrap:
		// A Bootstrap without the router's ticket: decode's refusal of it
		// is the implementation side of unticketed-bootstrap, which lands
		// with branch mw/peer; the harness delivers none until then (the
		// spec's correct protocol refuses it, and nothing changes).
	case spec.CorruptSend:
		err = h.applyCorruptSend(a, popped)
	case spec.Partition:
		err = h.applyPartition(a)
	case spec.DataplaneCut:
		// Every queue pair to the node breaks at both ends, and stays
		// broken: the Router still lists the node.
		d := int(a.Arg & 15)
		h.dec[d].severed = true
		for p := range h.pre {
			h.cut(p, d)
		}
	}
	if err != nil {
		return err
	}
	return h.collect(a)
}

// applyPrefillRecv hands the head of the router's queue to prefill node
// a.Arg: a cancel, a decode node's loss or restart, or a request's intake.
func (h *Refinement) applyPrefillRecv(a spec.Action) error {
	pe := h.pre[a.Arg]
	msg := pe.toPrefill[0]
	pe.toPrefill = pe.toPrefill[1:]
	switch msg.Kind {
	case spec.MAbort:
		pe.snd.Cancel(id(int(msg.Req)))
	case spec.MPeerFailed: // a lost decode node: the fence is the cut, for good
		h.pairs[a.Arg][msg.Peer].fenced = true
		h.cut(int(a.Arg), int(msg.Peer))
	case spec.MPeerRestarted:
		// A decode node is back under a new incarnation: the queue pair
		// to the old one is cut (its legs fail, what the old one sent is
		// flushed) before one to the new one is held.
		p, d := int(a.Arg), int(msg.Peer)
		if !h.keepQueuePairAtDecodeRestart {
			h.cut(p, d)
		}
		listed, _ := h.registered(prefillID(p))
		h.pairs[p][d].dinc, h.pairs[p][d].fenced = uint64(msg.DInc), !listed
	default:
		if err := h.intake(int(a.Arg), int(msg.Req)); err != nil {
			return fmt.Errorf("%w after %v: %v", ErrRefinement, a, err)
		}
	}
	return nil
}

// applyPrefillRecvQP feeds the head of a queue pair's back channel to its
// prefill node's Sender.
func (h *Refinement) applyPrefillRecvQP(a spec.Action) error {
	ap, ad := int(a.Arg>>4), int(a.Arg&15)
	pr := h.pairs[ap][ad]
	msg := pr.back[0].msg
	pr.back = pr.back[1:]
	if err := h.pre[ap].snd.Step(qpTo(decodeID(ad)), msg); err != nil && !errors.Is(err, protocol.ErrUnknownRequest) {
		return fmt.Errorf("%w after %v: the sender refused %s: %v", ErrRefinement, a, msg.Type(), err)
	}
	return nil
}

// applyPostWrite places a WRITE the spec posts on time onto an empty, live
// queue pair; a late one, or one behind others, waits on the wire.
func (h *Refinement) applyPostWrite(a spec.Action) error {
	r := int(a.Req)
	p, d := h.routeOf(r)
	if a.Arg&spec.Late == 0 && len(h.pairs[p][d].wire) == 0 && h.live(p, d) {
		// Nothing ahead of it on the queue pair: the spec places it at once.
		msg := spec.Msg{Kind: spec.MWrite, Req: a.Req, Index: int8(h.s.Req[r].S.Posted)}
		if err := h.release(p, msg, writeDamage(a.Arg)); err != nil {
			return fmt.Errorf("%w after %v: %v", ErrRefinement, a, err)
		}
		h.deliver(p, d)
	}
	return nil
}

// applyDecodeRecv hands the head of the router's queue to decode node a.Arg:
// a cancel, or a prefill node's loss or restart.
func (h *Refinement) applyDecodeRecv(a spec.Action) {
	de := h.dec[a.Arg]
	msg := de.toDecode[0]
	de.toDecode = de.toDecode[1:]
	switch msg.Kind {
	case spec.MAbort:
		de.recv.Cancel(id(int(msg.Req)))
	case spec.MPeerFailed:
		de.recv.PeerFailed(qpTo(prefillID(int(msg.Peer))))
	case spec.MPeerRestarted:
		// The old incarnation's queue pair is cut before the new one's
		// is accepted (a reconnect is a new queue pair in transfer).
		p, d := int(msg.Peer), int(a.Arg)
		h.cut(p, d)
		h.pairs[p][d].inc, h.pairs[p][d].fenced = uint64(msg.Inc), false
	}
}

// applyLoss is the Router's loss of a node, detected or by its lease.
func (h *Refinement) applyLoss(a spec.Action) error {
	if a.Arg&spec.DecodeNode == 0 { // a prefill node's loss: the same whether detected or its lease expired
		if err := h.router.NodeLost(prefillID(int(a.Arg))); err != nil {
			return fmt.Errorf("%w after %v: %v", ErrRefinement, a, err)
		}
		if err := h.routerEffects(a, false); err != nil {
			return err
		}
		h.tellLostDecodes(int(a.Arg))
		return nil
	}
	// A decode node's lease: the Router fails its requests and cancels
	// their prefill legs (delivered: the spec's Aborts), and the registry
	// tells every prefill node, which cuts its queue pair to it. A static
	// registry never loses a node: with static peers the Router's loss of
	// a partitioned decode node (its calls to the node fail) tells no
	// prefill node, and its cancels are the only word they get.
	d := int(a.Arg & 15)
	if err := h.router.NodeLost(decodeID(d)); err != nil {
		return fmt.Errorf("%w after %v: %v", ErrRefinement, a, err)
	}
	if err := h.routerEffects(a, true); err != nil {
		return err
	}
	if !h.bugs.Has(research.NoPeerCancel) && !h.cfg.StaticPeers {
		h.tellPrefills(spec.Msg{Kind: spec.MPeerFailed, Req: -1, Peer: int8(d)})
	}
	return nil
}

// applyCancel is the client's cancel of a request, through the Router.
func (h *Refinement) applyCancel(a spec.Action) error {
	if err := h.router.Cancel(id(int(a.Req))); err != nil {
		return fmt.Errorf("%w after %v: the router refused it: %v", ErrRefinement, a, err)
	}
	return h.routerEffects(a, true)
}

// applyCrash is prefill node a.Arg's crash: its records, staged messages and
// queues die with it.
func (h *Refinement) applyCrash(a spec.Action) {
	p := int(a.Arg)
	pe := h.pre[p]
	for q := range h.cfg.Prompts {
		if h.s.Req[q].Submitted && int(h.s.Req[q].P) == p && h.gone[q] == "" {
			h.gone[q] = h.senderView(q) // the records die with the node
			if st := h.gone[q]; st != "finished" && st != "aborted" && st != "-" {
				h.gone[q] = "failed"
			}
		}
	}
	pe.crashed = true
	pe.staged, pe.toPrefill = nil, nil
	for _, pr := range h.pairs[p] {
		pr.back = nil
	}
}

// applyRestart restarts a node under a new incarnation: a decode node (see
// restartDecode) or a prefill node, with a fresh Sender registered anew.
func (h *Refinement) applyRestart(a spec.Action) error {
	if a.Arg&spec.DecodeNode != 0 {
		return h.restartDecode(a)
	}
	p := int(a.Arg)
	pe := h.pre[p]
	snd, err := protocol.NewSender(pe.cfg) // fresh pools and records, over the same memory
	if err != nil {
		return err
	}
	pe.snd, pe.crashed = snd, false
	pe.inc++
	for d, pr := range h.pairs[p] { // its new queue pairs are to each decode node's live incarnation
		pr.dinc = h.dec[d].inc
	}
	if err := h.router.AddNode(h.nodeInfo(prefillID(p), protocol.RolePrefill, pe.inc)); err != nil {
		return fmt.Errorf("%w after %v: the router refused the new incarnation: %v", ErrRefinement, a, err)
	}
	if err := h.routerEffects(a, false); err != nil {
		return err
	}
	if !h.s.CrashDetected[p] && !h.bugs.Has(research.PeerByName) {
		h.tellLostDecodes(p) // the restart was the loss of the old incarnation
	}
	for d := range h.dec { // the registry's news, to every decode node
		h.tellDecode(d, spec.Msg{Kind: spec.MPeerRestarted, Req: -1, Peer: int8(p), Inc: uint8(pe.inc)})
	}
	return nil
}

// applyCorruptSend feeds a damaged copy of the head of a queue pair (a Done)
// or of its back channel (a Grant) to the end that takes it.
func (h *Refinement) applyCorruptSend(a spec.Action, popped *[spec.MaxPrefills][spec.MaxDecodes]int) error {
	p, d := h.routeOf(int(a.Req))
	pr := h.pairs[p][d]
	if a.Arg&spec.SendBack != 0 {
		g, ok := pr.back[0].msg.(*protocol.Grant)
		if !ok {
			return fmt.Errorf("%w after %v: the head of decode→prefill is %s, not a Grant", ErrRefinement, a, pr.back[0].msg.Type())
		}
		pr.back = pr.back[1:]
		if err := h.pre[p].snd.Step(qpTo(decodeID(d)), damageGrant(g, a.Arg)); err != nil && !errors.Is(err, protocol.ErrUnknownRequest) {
			return fmt.Errorf("%w after %v: the sender refused the damaged Grant: %v", ErrRefinement, a, err)
		}
		return nil
	}
	popped[p][d] = 1
	w := pr.wire[0]
	dn, ok := w.op.Msg.(*protocol.Done)
	if !ok {
		return fmt.Errorf("%w after %v: the head of the queue pair is %s, not a Done", ErrRefinement, a, h.describe(w.op))
	}
	pr.wire = pr.wire[1:]
	damaged := *dn
	if a.Arg&spec.SendPages != 0 {
		damaged.Pages++
	} else {
		damaged.Tokens++
	}
	h.dec[d].recv.Step(qpTo(prefillID(p)), &damaged, time.Unix(0, 0)) // refusals come back as effects or are no-ops
	return nil
}

// rogueWrite is a peer's WRITE of page of r's decode node with the key of
// r's Grant (the spec's rogue fault). The remote key per grant (a memory
// window bound to the grant's pages on its queue pair, revoked before Done
// is fed to the Receiver) is the implementation side, which lands with
// branch mw/peer; until then the harness applies the rule the windows
// enforce, reading the key's liveness off the implementation's state: the
// key of r's Grant is live while the Receiver's record of r waits for Done,
// covers the pages of r's grant, and is valid only on r's queue pair while
// it joins the incarnations the grant was made between. A WRITE it lets
// through writes the rogue's bytes over the payload; a refused one changes
// nothing (the queue pair it breaks is the Cut fault's step).
func (h *Refinement) rogueWrite(r, page int) {
	p, d := h.routeOf(r)
	de := h.dec[d]
	if h.rogueIgnoresKeys {
		copy(de.dst.Payload(uint32(page)), h.bytesOf(spec.Label{Req: spec.Rogue}))
		return
	}
	if de.recv.Status(id(r)) != protocol.ReceiverReserved || h.pre[p].crashed || !h.live(p, d) {
		return
	}
	for _, ref := range h.granted[r] {
		if int(ref.Page) == page {
			copy(de.dst.Payload(uint32(page)), h.bytesOf(spec.Label{Req: spec.Rogue}))
			return
		}
	}
}

// routerEffects carries the router's effects: its messages onto the queues
// to the nodes (a crashed node's are dropped, as the spec drops them).
// Cancels count as the spec's Aborts after a client's Cancel (client set),
// and with static peers a cancel of a failed request's prefill leg (rule 15,
// the spec's staticLegCancel); any other is the Router's second path on a
// failed leg, checked and not delivered (see Refinement).
func (h *Refinement) routerEffects(a spec.Action, client bool) error {
	e := h.router.Effects()
	for _, d := range e.Dispatches {
		p, dn := prefillOf(d.Prefill), decodeOf(d.Decode)
		if a.Kind != spec.Submit || a.Arg != spec.Route(p, dn) {
			return fmt.Errorf("%w after %v: the router dispatched r%d to nodes %d and %d", ErrRefinement, a, int(d.Request)-1, d.Prefill, d.Decode)
		}
		if !h.pre[p].crashed {
			h.pre[p].toPrefill = append(h.pre[p].toPrefill, spec.Msg{Kind: spec.MPrefill, Req: int8(d.Request - 1)})
		}
	}
	for _, c := range e.Cancels {
		msg := spec.Msg{Kind: spec.MAbort, Req: int8(c.Request - 1)}
		switch {
		case !client:
			if st := h.router.Request(c.Request); st.Status == protocol.RouteRunning || st.Err == nil {
				return fmt.Errorf("%w after %v: the router cancelled a leg of r%d, which has not failed (%v)", ErrRefinement, a, msg.Req, st.Status)
			}
			if h.cfg.StaticPeers && c.Node < decodePeer && !h.pre[prefillOf(c.Node)].crashed {
				h.pre[prefillOf(c.Node)].toPrefill = append(h.pre[prefillOf(c.Node)].toPrefill, msg)
				h.failCancels++
			}
		case c.Node >= decodePeer:
			h.tellDecode(decodeOf(c.Node), msg)
		case !h.pre[prefillOf(c.Node)].crashed:
			h.pre[prefillOf(c.Node)].toPrefill = append(h.pre[prefillOf(c.Node)].toPrefill, msg)
			if h.cfg.StaticPeers && a.Kind == spec.DetectCrash {
				h.lossCancels++
			}
		}
	}
	for _, l := range e.PeerLost {
		if l.Node < decodePeer || l.Lost >= decodePeer {
			return fmt.Errorf("%w after %v: the router told node %d that %d is lost", ErrRefinement, a, l.Node, l.Lost)
		}
		h.tellDecode(decodeOf(l.Node), spec.Msg{Kind: spec.MPeerFailed, Req: -1, Peer: int8(prefillOf(l.Lost))})
	}
	return nil // outcomes are the router's state, compared in the view
}

// restartDecode is decode node a.Arg crashing and coming back at once as
// its next incarnation: a new Receiver (fresh pool, epochs from zero, no
// records, free slots) over the same page memory, which is not zeroed.
// What was in flight to the old incarnation is flushed; what it sent may
// still reach prefill. Its queue pairs are for the live incarnation of each
// prefill node the registry lists. It registers with the Router under the
// next Incarnation (the loss of the old one, unless the Router had already
// lost it: its requests fail, their open prefill legs are cancelled), and
// the registry tells every prefill node: PeerFailed for the loss (as a
// lease's), then PeerRestarted, on which each cuts its queue pair to the
// old incarnation before it holds one to the new.
func (h *Refinement) restartDecode(a spec.Action) error {
	d := int(a.Arg & 15)
	de := h.dec[d]
	recv, err := protocol.NewReceiver(de.cfg)
	if err != nil {
		return err
	}
	de.recv, de.toDecode = recv, nil
	de.inc++
	for r := range h.cfg.Prompts {
		if q := &h.s.Req[r]; q.Submitted && int(q.D) == d {
			h.refused[r] = false // the new incarnation has refused nothing
		}
	}
	for p, pe := range h.pre {
		pr := h.pairs[p][d]
		listed, _ := h.registered(prefillID(p))
		pr.wire, pr.inc, pr.fenced = nil, pe.inc, !listed
	}
	wasLive, _ := h.registered(decodeID(d))
	if err := h.router.AddNode(h.nodeInfo(decodeID(d), protocol.RoleDecode, de.inc)); err != nil {
		return fmt.Errorf("%w after %v: the router refused the new incarnation: %v", ErrRefinement, a, err)
	}
	if err := h.routerEffects(a, true); err != nil { // the Router's cancels of open prefill legs: the spec's Aborts
		return err
	}
	if wasLive && !h.bugs.Has(research.PeerByName) && !h.bugs.Has(research.NoPeerCancel) {
		h.tellPrefills(spec.Msg{Kind: spec.MPeerFailed, Req: -1, Peer: int8(d)})
	}
	h.tellPrefills(spec.Msg{Kind: spec.MPeerRestarted, Req: -1, Peer: int8(d), DInc: uint8(de.inc)})
	return nil
}

// applyPartition cuts decode node a.Arg off for good (the spec's partition
// fault): what is on the wire to it or back from it is lost without a word
// to either end (no Sender.Flushed, no completion), what the router and the
// registry send it from now on is lost, and its Receiver, whose doings reach
// no one, is never called again: a fresh one over the same page memory
// stands for it in the view (no records, a free pool, epochs from zero), as
// the spec drops the node's state. The Router still lists it until the
// spec's DetectCrash of it (applyLoss), its lease's expiry.
func (h *Refinement) applyPartition(a spec.Action) error {
	d := int(a.Arg & 15)
	de := h.dec[d]
	recv, err := protocol.NewReceiver(de.cfg)
	if err != nil {
		return err
	}
	de.recv, de.toDecode, de.partitioned = recv, nil, true
	for r := range h.cfg.Prompts {
		if q := &h.s.Req[r]; q.Submitted && int(q.D) == d {
			h.refused[r] = false
		}
	}
	for p := range h.pre {
		pr := h.pairs[p][d]
		if len(pr.wire) > 0 {
			h.postedIntoSilence(p, d) // in flight when it fell silent: never acknowledged
		}
		pr.wire, pr.back = nil, nil
	}
	return nil
}

// retryExceeded is RC's retry limit erroring prefill p's end of its queue
// pair to partitioned decode node d (the spec's RetryExceeded, with static
// peers). In transfer the work request that no one acknowledged completes
// in error, the queue pair breaks (conn.fail), the rest of its work
// requests flush, and once the flush has drained Prefill.fenced calls
// Sender.Flushed: every leg on it fails (peer failed) and frees its source
// pages. That is Flushed here, after the flush, as a cut's prefill end. The
// decode end is silent and hears nothing (its Receiver stand-in is not
// called), and the queue pair stays cut: the dialer's new one to a silent
// node is never set up, so a later intake over it finds no queue pair.
// The spec takes the step only where prefill posted work that no one
// acknowledged; the harness's own record of that must agree.
func (h *Refinement) retryExceeded(p, d int) error {
	pr, pe := h.pairs[p][d], h.pre[p]
	if !pr.unacked || !h.dec[d].partitioned || pe.crashed {
		return fmt.Errorf("%w: RC's retry limit on queue pair p%d-d%d, where prefill has no work outstanding to a silent node (unacked %v, partitioned %v, crashed %v)",
			ErrRefinement, p, d, pr.unacked, h.dec[d].partitioned, pe.crashed)
	}
	pr.unacked, pr.fenced = false, true
	pr.wire, pr.back = nil, nil
	pe.unstage(d)
	pe.snd.Flushed(qpTo(decodeID(d)))
	return nil
}

// tellPrefills is the registry's news m to every prefill node; a crashed
// node drops what it is sent.
func (h *Refinement) tellPrefills(m spec.Msg) {
	for _, pe := range h.pre {
		if !pe.crashed {
			pe.toPrefill = append(pe.toPrefill, m)
		}
	}
}

// tellLostDecodes is the registry's news of prefill node p's loss to each
// decode node the router has declared lost: the Router tells only the live
// ones (PeerLost), but a lost decode node may live on, and its own registry
// watch tells it, as the spec's router does.
func (h *Refinement) tellLostDecodes(p int) {
	if h.bugs.Has(research.NoPeerCancel) {
		return
	}
	for d := range h.dec {
		if h.s.DecodeLost[d] {
			h.tellDecode(d, spec.Msg{Kind: spec.MPeerFailed, Req: -1, Peer: int8(p)})
		}
	}
}

// intake is prefill node p taking request r: admission; its pages are
// computed later, one Compute each.
// Its refusal is its leg's outcome, relayed to the router. Over a queue pair
// fenced for good, or one decode holds for another incarnation, there is no
// queue pair to send on: the leg fails there (transfer refuses the Submit),
// and over one to a decode node whose data plane is cut none can be set up.
func (h *Refinement) intake(p, r int) error {
	pe := h.pre[p]
	_, d := h.routeOf(r)
	if pr := h.pairs[p][d]; pr.fenced || pr.inc != pe.inc || h.dec[d].severed {
		if h.cfg.Prompts[r] > h.cfg.PrefillLimit() && !h.cfg.Bugs.Has(spec.AdmitFinished) {
			// The node's own intake refuses it first.
			_, err := pe.snd.Submit(id(r), qpTo(decodeID(d)), h.cfg.Prompts[r])
			return h.router.LegEnded(prefillID(p), id(r), err)
		}
		return h.router.LegEnded(prefillID(p), id(r), fmt.Errorf("%w: no queue pair to decode node %d", protocol.ErrPeerFailed, d))
	}
	pages, err := pe.snd.SubmitWith(id(r), qpTo(decodeID(d)), h.cfg.Prompts[r],
		protocol.SubmitOptions{Scope: h.scopeOf(r), Chain: h.chain[r]})
	if err != nil {
		return h.router.LegEnded(prefillID(p), id(r), err)
	}
	h.srcPages[r] = pages
	h.computed[r] = 0 // the pages hold what they held: the engine computes them one Compute at a time
	return nil
}

// compute is the engine computing request r's next page into its source
// page, a chunk of one page, and telling the Sender how many are complete.
func (h *Refinement) compute(r int) error {
	p, _ := h.routeOf(r)
	i := h.computed[r]
	if i >= len(h.srcPages[r]) {
		return fmt.Errorf("r%d has %d pages, all computed", r, len(h.srcPages[r]))
	}
	h.fill(h.pre[p].src.Payload(h.srcPages[r][i]), spec.Label{Req: int8(r), Index: int8(i)})
	h.computed[r]++
	return h.pre[p].snd.ComputedPages(id(r), h.computed[r])
}

// release hands prefill node p's next operation for msg's request to the
// wire: it must be the operation the spec just sent.
func (h *Refinement) release(p int, msg spec.Msg, damage uint8) error {
	pe := h.pre[p]
	for i, op := range pe.staged {
		if requestOf(op) != id(int(msg.Req)) {
			continue
		}
		if kindOf(op) != msg.Kind || msg.Kind == spec.MWrite && int(op.Write.Index) != int(msg.Index) {
			return fmt.Errorf("the spec sent %v r%d[%d]; the sender's next for r%d is %s", msg.Kind, msg.Req, msg.Index, msg.Req, h.describe(op))
		}
		pe.staged = append(pe.staged[:i:i], pe.staged[i+1:]...)
		pr := h.pairs[p][decodeOf(nodeAt(op.Peer))]
		pr.wire = append(pr.wire, wireOp{op: op, damage: damage, inc: pe.inc, dinc: pr.dinc})
		return nil
	}
	return fmt.Errorf("the spec sent %v r%d[%d]; the sender emitted nothing for r%d", msg.Kind, msg.Req, msg.Index, msg.Req)
}

// describe names an operation with the spec's request numbers.
func (h *Refinement) describe(op protocol.Op) string {
	if w := op.Write; w != nil {
		return fmt.Sprintf("WRITE r%d[%d] -> page %d@%d", int(w.Request)-1, w.Index, w.Remote.Page, w.Remote.Epoch)
	}
	return fmt.Sprintf("%s r%d", op.Msg.Type(), int(protocol.RequestOf(op.Msg))-1)
}

func requestOf(op protocol.Op) protocol.RequestID {
	if op.Write != nil {
		return op.Write.Request
	}
	return protocol.RequestOf(op.Msg)
}

func kindOf(op protocol.Op) spec.MsgKind {
	switch op.Msg.(type) {
	case *protocol.Bootstrap:
		return spec.MBootstrap
	case *protocol.Done:
		return spec.MDone
	case *protocol.AbortAck:
		return spec.MAbortAck
	}
	return spec.MWrite
}

// deliver places the WRITE, or delivers the SEND, at the head of pair (p, d).
func (h *Refinement) deliver(p, d int) {
	pr, pe, de := h.pairs[p][d], h.pre[p], h.dec[d]
	w := pr.wire[0]
	pr.wire = pr.wire[1:]
	if wr := w.op.Write; wr != nil {
		payload := de.dst.Payload(uint32(wr.Remote.Page))
		copy(payload, pe.src.Payload(uint32(wr.Source))) // the NIC reads the source page now
		if w.damage == spec.DamagedPayload {
			payload[len(payload)/2] ^= 0x40
		}
		record := de.dst.TagRecord(uint32(wr.Remote.Page))
		copy(record, wr.Tag)
		damageTag(record, w.damage) // after the MAC: the record no longer authenticates

		if !pe.crashed && w.inc == pe.inc { // the incarnation that posted it is the one alive
			pe.snd.Completed(wr.ID, nil)
		}
		return
	}
	de.recv.Step(qpTo(prefillID(p)), w.op.Msg, time.Unix(0, 0)) // refusals come back as effects or are no-ops
}

// read is decode attending over r's pages: Acquire, a check of every byte
// against the KV r's prefill computed, Finish.
func (h *Refinement) read(r int) error {
	_, d := h.routeOf(r)
	de := h.dec[d]
	refs, err := de.recv.Acquire(id(r))
	if err != nil {
		return nil // an explicit failure: its outcome comes through the effects
	}
	for _, ref := range refs { // what decode read, compared with what the spec says it read
		h.readLabels[r] = append(h.readLabels[r], h.labelOf(de.dst.Payload(uint32(ref.Page))))
	}
	return de.recv.Finish(id(r))
}

// cut breaks queue pair (p, d): both directions and prefill's backlog for
// it flush, both ends learn.
func (h *Refinement) cut(p, d int) {
	pr, pe := h.pairs[p][d], h.pre[p]
	pr.wire, pr.back = nil, nil
	pe.unstage(d)
	h.dec[d].recv.QueuePairFenced(qpTo(prefillID(p)))
	if !pe.crashed {
		pe.snd.Flushed(qpTo(decodeID(d)))
	}
}

// collect carries effects: each Sender's operations into its backlog, each
// Receiver's messages onto decode→prefill, cuts, and every node's outcomes
// to the router, whose effects it then carries.
func (h *Refinement) collect(a spec.Action) error {
	for {
		for p, pe := range h.pre {
			se := pe.snd.Effects()
			if pe.crashed {
				continue
			}
			for _, op := range se.Ops {
				// A SEND on a queue pair that is not live is flushed; a
				// WRITE still waits for the spec's PostWrite, which flushes
				// it (see postBacklog).
				if d := decodeOf(nodeAt(op.Peer)); op.Write != nil || h.live(p, d) {
					pe.staged = append(pe.staged, op)
				} else {
					h.postedIntoSilence(p, d) // a SEND lost to a partition is never acknowledged
				}
			}
			for _, o := range se.Outcomes {
				if err := h.router.LegEnded(prefillID(p), o.Request, o.Err); err != nil {
					return fmt.Errorf("%w after %v: the router refused prefill's outcome for r%d: %v", ErrRefinement, a, int(o.Request)-1, err)
				}
			}
		}
		cuts := false
		for d, de := range h.dec {
			re := de.recv.Effects()
			for _, s := range re.Sends {
				if g, ok := s.Msg.(*protocol.Grant); ok {
					r := int(g.Request) - 1
					h.granted[r] = nil
					for _, p := range g.Pages {
						h.granted[r] = append(h.granted[r], protocol.PageRef{Page: p.Page, Epoch: p.Epoch})
					}
				}
				if p := prefillOf(nodeAt(s.Peer)); !h.pre[p].crashed && h.live(p, d) {
					h.pairs[p][d].back = append(h.pairs[p][d].back, backMsg{msg: s.Msg, dinc: de.inc})
				}
			}
			for _, o := range re.Outcomes {
				if de.recv.Status(o.Request) == protocol.ReceiverNone {
					h.refused[int(o.Request)-1] = true // decode's intake refused it and kept no record
				}
				if err := h.router.LegEnded(decodeID(d), o.Request, o.Err); err != nil {
					return fmt.Errorf("%w after %v: the router refused decode's outcome for r%d: %v", ErrRefinement, a, int(o.Request)-1, err)
				}
			}
			for _, peer := range re.Cuts { // a lost prefill node: the cut is for good
				h.pairs[prefillOf(nodeAt(peer))][d].fenced = true
				h.cut(prefillOf(nodeAt(peer)), d)
				cuts = true
			}
		}
		if err := h.routerEffects(a, false); err != nil {
			return err
		}
		if !cuts {
			return nil
		}
	}
}

// clientView is a request's client-visible outcome at the router, in the
// spec's terms.
func (h *Refinement) clientView(r int) (spec.Outcome, spec.Reason) {
	st := h.router.Request(id(r))
	switch {
	case st.Status == protocol.RouteNone || st.Status == protocol.RouteRunning:
		return spec.Pending, spec.NoReason
	case st.Err == nil:
		return spec.OK, spec.NoReason
	case errors.Is(st.Err, protocol.ErrRejected):
		return spec.Rejected, reasonOf(st.Err)
	case errors.Is(st.Err, protocol.ErrCancelled):
		return spec.Cancelled, spec.ClientCancelled
	}
	return spec.Failed, reasonOf(st.Err)
}

// reasonOf maps an implementation error to the spec's reason.
func reasonOf(err error) spec.Reason {
	for _, m := range []struct {
		err error
		why spec.Reason
	}{
		{protocol.ErrTooLong, spec.OverLimit}, {protocol.ErrRejected, spec.OverLimit},
		{protocol.ErrNoCapacity, spec.NoCapacity}, {protocol.ErrTokenMismatch, spec.TokenMismatch},
		{protocol.ErrTagMismatch, spec.TagMismatch}, {protocol.ErrTagMalformed, spec.TagMismatch},
		{protocol.ErrFenced, spec.TagMismatch}, {protocol.ErrChecksumMismatch, spec.ChecksumMismatch},
		{protocol.ErrTimedOut, spec.TimedOut}, {protocol.ErrPeerFailed, spec.PeerFailed},
		{protocol.ErrNoNode, spec.PeerFailed}, // the spec's router fails a request once its prefill node is lost
		{protocol.ErrCancelled, spec.ClientCancelled},
	} {
		if errors.Is(err, m.err) {
			return m.why
		}
	}
	return spec.GrantMismatch
}

func (h *Refinement) grantOf(r int) []protocol.PageRef { return h.granted[r] }

// recordPages is request r's pages as its decode node's Receiver holds them:
// its prefix hit's pinned pages, then its fresh ones (the spec's record).
func (h *Refinement) recordPages(r int) []protocol.PageRef {
	_, d := h.routeOf(r)
	prefix, fresh := h.dec[d].recv.Pages(id(r))
	return append(slices.Clone(prefix), fresh...)
}

// sourceMatches reports whether n's sender record for r took the source
// pages, in order, that the Sender's pool gave r.
func (h *Refinement) sourceMatches(r int, n *spec.State) bool {
	snd := &n.Req[r].S
	if !snd.SrcHeld || int(snd.Pages) != len(h.srcPages[r]) {
		return false
	}
	for i, pg := range h.srcPages[r] {
		if int(snd.Src[i]) != int(pg) {
			return false
		}
	}
	return true
}

func (h *Refinement) grantMatches(r int, n *spec.State) bool {
	refs := h.grantOf(r)
	if h.cfg.PrefixCache > 0 {
		refs = h.recordPages(r)
	}
	rec := &n.Req[r].R
	if len(refs) != int(rec.N) {
		return false
	}
	for i, ref := range refs {
		if int(ref.Page) != int(rec.Pages[i].Page) || ref.Epoch != uint64(rec.Pages[i].Epoch) {
			return false
		}
	}
	return true
}

// compare fails if the implementation's view differs from the spec's, or,
// with the prefix cache, if a Receiver's own audit fails (ErrAudit).
func (h *Refinement) compare(after string) error {
	want, got := SpecView(h.cfg, &h.s), h.View()
	if want == got {
		if h.cfg.PrefixCache > 0 {
			for d, de := range h.dec {
				if err := de.recv.Audit(); err != nil {
					return fmt.Errorf("%w after %s: decode node %d: %v", ErrAudit, after, d, err)
				}
			}
		}
		return nil
	}
	wl, gl := strings.Split(want, "\n"), strings.Split(got, "\n")
	var diff []string
	for i := 0; i < max(len(wl), len(gl)); i++ {
		var w, g string
		if i < len(wl) {
			w = wl[i]
		}
		if i < len(gl) {
			g = gl[i]
		}
		if w != g {
			diff = append(diff, fmt.Sprintf("  spec: %s\n  impl: %s", w, g))
		}
	}
	return fmt.Errorf("%w after %s:\n%s", ErrRefinement, after, strings.Join(diff, "\n"))
}

// senderPhase names the implementation's sender states as the spec's.
var senderPhase = map[protocol.SenderStatus]string{
	protocol.SenderNone: "-", protocol.SenderAwaitGrant: "awaiting grant", protocol.SenderWriting: "writing",
	protocol.SenderDoneSent: "done sent", protocol.SenderAborting: "aborting", protocol.SenderFinished: "finished",
	protocol.SenderAborted: "aborted", protocol.SenderFailed: "failed",
}

// senderView is request r's sender state: its prefill node's Sender's, or
// what it was when that node crashed.
func (h *Refinement) senderView(r int) string {
	if h.gone[r] != "" {
		return h.gone[r]
	}
	p, _ := h.routeOf(r) // node 0 for a request not yet routed, as the spec's record
	return senderPhase[h.pre[p].snd.Status(id(r))]
}

// refKey is the tag key of the refinement's queue pairs, from a fixed
// secret so that every run replays.
var refKey = func() *protocol.TagKey {
	secret := sha256.Sum256([]byte("kvhandoff refinement queue pair"))
	k, err := protocol.NewTagKey(secret[:], protocol.SumXXH3)
	if err != nil {
		panic(err) // a 32-byte secret is always valid
	}
	return k
}()

func refKeys(protocol.PeerID) *protocol.TagKey { return refKey }

// multi reports whether cfg's deployment has more than one queue pair: only
// then do views name nodes.
func multi(cfg spec.Config) bool { return cfg.NumPrefills()*cfg.NumDecodes() > 1 }

// viewSize is the room a view's builder starts with: enough for the views
// of the tests' deployments (a one-pair deployment's take 0.5 to 1 KB, a
// 2x2 one's up to 1.8 KB), instead of growing by doublings.
const viewSize = 2048

// pageName is how a view names page p of decode node d.
func pageName(cfg spec.Config, d, p int) string {
	if !multi(cfg) {
		return "page " + strconv.Itoa(p)
	}
	return "page d" + strconv.Itoa(d) + "/" + strconv.Itoa(p)
}

// The views are written without fmt where they are long: a refinement walk
// writes two views a step (with fmt, half of the refinement tests' CPU).

// writePageLine writes a view's line for page p of decode node d.
func writePageLine(b *strings.Builder, cfg spec.Config, d, p int, owner string, epoch uint64, quarantined bool, holds, tag string) {
	b.WriteString(pageName(cfg, d, p))
	b.WriteString(": ")
	b.WriteString(owner)
	b.WriteString(" epoch ")
	b.WriteString(strconv.FormatUint(epoch, 10))
	b.WriteString(" quarantined ")
	b.WriteString(strconv.FormatBool(quarantined))
	b.WriteString(" holds ")
	b.WriteString(holds)
	b.WriteString(" tag ")
	b.WriteString(tag)
	b.WriteString("\n")
}

// tagName is how a view names a tag record: its request, index and epoch,
// and the label its sum is of.
func tagName(req string, index int64, epoch uint64, sum string) string {
	return req + "[" + strconv.FormatInt(index, 10) + "]@" + strconv.FormatUint(epoch, 10) + " sum " + sum
}

// reqName is how a view names request r (an owner, a tag's request).
func reqName(r int) string { return "r" + strconv.Itoa(r) }

// writeRequestHead writes the start of a view's line for request r: its
// client outcome and reason, and its sender's and receiver's states.
func writeRequestHead(b *strings.Builder, r int, inc string, o spec.Outcome, why spec.Reason, sender, receiver string) {
	b.WriteString(reqName(r))
	b.WriteString(inc)
	b.WriteString(": ")
	b.WriteString(o.String())
	b.WriteString(" ")
	b.WriteString(why.String())
	b.WriteString(" | sender ")
	b.WriteString(sender)
	b.WriteString(" | receiver ")
	b.WriteString(receiver)
	b.WriteString(" | grant")
}

// writePageRef writes a granted page of a request's line.
func writePageRef(b *strings.Builder, page int64, epoch uint64) {
	b.WriteString(" ")
	b.WriteString(strconv.FormatInt(page, 10))
	b.WriteString("@")
	b.WriteString(strconv.FormatUint(epoch, 10))
}

// writeSource writes the i-th source page of a request's line.
func writeSource(b *strings.Builder, i int, label string) {
	b.WriteString(" ")
	b.WriteString(strconv.Itoa(i))
	b.WriteString(":")
	b.WriteString(label)
}

// pairName is how a view names queue pair (p, d) and its state: the
// prefill incarnation decode holds it for, with decode restarts the decode
// incarnation prefill holds it to, and whether it is fenced.
func pairName(cfg spec.Config, p, d int, inc, dinc uint64, fenced bool) string {
	switch {
	case !multi(cfg) && cfg.Faults[spec.FaultRestart] == 0 && cfg.Faults[spec.FaultLease] == 0:
		return "queue pair"
	case cfg.DecodeRestarts:
		return fmt.Sprintf("queue pair p%d-d%d (incarnation %d to decode incarnation %d, fenced %v)", p, d, inc, dinc, fenced)
	}
	return fmt.Sprintf("queue pair p%d-d%d (incarnation %d, fenced %v)", p, d, inc, fenced)
}

// unackedName is the line of a queue pair's view that says whether
// prefill holds work on it that no one will acknowledge: only with static
// peers, where RC's retry limit ends it (spec.State.Unacked).
func unackedName(cfg spec.Config, unacked bool) string {
	if !cfg.StaticPeers {
		return ""
	}
	return fmt.Sprintf("unacknowledged work %v\n", unacked)
}

// incName is how a view shows the decode incarnation a message or a route
// names: only with decode restarts.
func incName(cfg spec.Config, dinc uint64) string {
	if !cfg.DecodeRestarts {
		return ""
	}
	return "@dinc" + strconv.FormatUint(dinc, 10)
}

// View is the implementation's state in the spec's terms: per request the
// client's outcome, both legs' states, the granted pages and the labels of
// the source pages it holds; per decode page its owner, epoch, quarantine,
// content and tag record; each queue pair's content in order.
func (h *Refinement) View() string {
	var b strings.Builder
	b.Grow(viewSize)
	for r := range h.cfg.Prompts {
		o, why := h.clientView(r)
		sp := h.senderView(r)
		p, d := h.routeOf(r)
		st := h.dec[d].recv.Status(id(r))
		rp := st.String()
		if st == protocol.ReceiverNone || h.refused[r] && st == protocol.ReceiverTombstone {
			rp = "-" // never bootstrapped, or refused at intake (a later cancel leaves a tombstone)
		}
		writeRequestHead(&b, r, incName(h.cfg, h.routedInc[r]), o, why, sp, rp)
		if rp != "-" && st != protocol.ReceiverTombstone {
			refs := h.granted[r]
			if h.cfg.PrefixCache > 0 {
				prefix, _ := h.dec[d].recv.Pages(id(r))
				refs = h.recordPages(r)
				fmt.Fprintf(&b, " prefix %d:", len(prefix))
			}
			for _, ref := range refs {
				writePageRef(&b, int64(ref.Page), ref.Epoch)
			}
		}
		if h.readLabels[r] != nil {
			fmt.Fprintf(&b, " | read %s", strings.Join(h.readLabels[r], " "))
		}
		b.WriteString(" | source")
		if pe := h.pre[p]; h.gone[r] == "" && !pe.crashed && sp != "-" {
			for i, pg := range h.srcPages[r] {
				if pool := pe.snd.Pool(); pool.Holds(id(r), protocol.PageRef{Page: pg, Epoch: pool.Epoch(pg)}) {
					writeSource(&b, i, h.labelOf(pe.src.Payload(uint32(pg))))
				}
			}
		}
		b.WriteString("\n")
	}
	for d, de := range h.dec {
		pool := de.recv.Pool()
		rank := map[uint32]int{}
		for i, p := range pool.LRUOrder() {
			rank[p] = i + 1
		}
		for p := 0; p < h.cfg.DecodePages; p++ {
			owner, quarantined, free := pool.Owner(uint32(p))
			o := "free"
			if !free {
				o = reqName(int(owner) - 1)
			}
			if e, ok := pool.Entry(uint32(p)); ok {
				chain, known := h.chainID[e.Hash]
				if !known {
					chain = 255 // a hash no prompt of the run has: the spec has no such key
				}
				o = cachedName(uint8(e.Scope), chain, e.Pins, rank[uint32(p)], e.Purged)
			}
			tag := "torn"
			t, err := protocol.ParseTag(de.dst.TagRecord(uint32(p)), refKey)
			if err != nil && errors.Is(err, protocol.ErrTagMismatch) {
				// Damaged in transit: the MAC fails, which is how the Receiver
				// notices; the spec's tag is the fields, so the view shows them.
				t, err = tagFields(de.dst.TagRecord(uint32(p))), nil
			}
			if err == nil {
				req := reqName(int(t.Request) - 1)
				if t.Request == tenantID {
					req = "tenant"
				}
				tag = tagName(req, int64(t.Index), t.Epoch, h.sums[t.Sum].String())
			}
			writePageLine(&b, h.cfg, d, p, o, pool.Epoch(uint32(p)), quarantined, h.labelOf(de.dst.Payload(uint32(p))), tag)
		}
	}
	for p := range h.pre {
		for d := range h.dec {
			pr := h.pairs[p][d]
			b.WriteString(pairName(h.cfg, p, d, pr.inc, pr.dinc, pr.fenced) + ":")
			for _, w := range pr.wire {
				fmt.Fprintf(&b, " %v r%d", kindOf(w.op), int(requestOf(w.op))-1)
				if w.op.Write != nil {
					fmt.Fprintf(&b, "[%d]", w.op.Write.Index)
				}
				b.WriteString(incName(h.cfg, w.dinc))
			}
			b.WriteString("\nback:")
			for _, m := range pr.back {
				k := spec.MGrant
				if _, ok := m.msg.(*protocol.Abort); ok {
					k = spec.MAbort
				}
				fmt.Fprintf(&b, " %v r%d%s", k, int(protocol.RequestOf(m.msg))-1, incName(h.cfg, m.dinc))
			}
			b.WriteString("\n" + unackedName(h.cfg, pr.unacked))
		}
	}
	if h.cfg.DecodeRestarts {
		for d, de := range h.dec {
			fmt.Fprintf(&b, "decode %d: incarnation %d\n", d, de.inc)
		}
	}
	for p, pe := range h.pre {
		writeRouterQueue(&b, "router to prefill", p, h.cfg.NumPrefills(), pe.toPrefill)
	}
	for d, de := range h.dec {
		writeRouterQueue(&b, "router to decode", d, h.cfg.NumDecodes(), de.toDecode)
	}
	return b.String()
}

// cachedName is how a view names a cached page: its key (scope, chain
// id), its pins, its rank in LRU order (1 the least recently used; 0 for a
// purged page, in no order) and whether it was purged.
func cachedName(scope, chain uint8, pins, lru int, purged bool) string {
	s := fmt.Sprintf("cached scope %d chain %d pins %d lru %d", scope, chain, pins, lru)
	if purged {
		s += " purged"
	}
	return s
}

// writeRouterQueue is the view of the router's messages to one node.
func writeRouterQueue(b *strings.Builder, name string, node, of int, msgs []spec.Msg) {
	if of > 1 {
		name += fmt.Sprint(" ", node)
	}
	b.WriteString(name + ":")
	for _, m := range msgs {
		fmt.Fprintf(b, " %v r%d", m.Kind, m.Req)
		if m.Kind == spec.MPeerFailed || m.Kind == spec.MPeerRestarted {
			fmt.Fprintf(b, " of %d@%d", m.Peer, m.Inc)
		}
		if m.DInc > 0 { // a decode node's PeerRestarted: its new incarnation
			fmt.Fprintf(b, " decode incarnation %d", m.DInc)
		}
	}
	b.WriteString("\n")
}

// SpecView is View for a spec state.
func SpecView(cfg spec.Config, s *spec.State) string {
	var b strings.Builder
	b.Grow(viewSize)
	for r := range cfg.Prompts {
		q := &s.Req[r]
		sp := q.S.Phase.String()
		if (q.S.Phase == spec.SRejected || q.S.Phase == spec.SFailed) && q.S.Pages == 0 {
			sp = "-" // the sender's intake refused it (too long, or no room): it keeps no record
		}
		why := q.Reason
		switch why {
		case spec.Flushed:
			why = spec.PeerFailed // the implementation has one error for a fenced queue pair: ErrPeerFailed
		case spec.GrantMismatch:
			why = spec.TokenMismatch // and one for counts that differ, on a Grant as on a Done: ErrTokenMismatch
		}
		rp := q.R.Phase.String()
		if q.R.Phase == spec.RNone || q.R.Phase == spec.RRejected || q.R.Phase == spec.RClosed && q.R.Reason == spec.NoCapacity && q.R.N == 0 {
			rp = "-" // decode's intake refused it (over its limit, or no room): it keeps no record
		}
		writeRequestHead(&b, r, incName(cfg, uint64(q.DInc)), q.Outcome, why, sp, rp)
		if rp != "-" && q.R.Phase != spec.RTombstone {
			if cfg.PrefixCache > 0 {
				fmt.Fprintf(&b, " prefix %d:", q.R.Prefix)
			}
			for i := 0; i < int(q.R.N); i++ {
				writePageRef(&b, int64(q.R.Pages[i].Page), uint64(q.R.Pages[i].Epoch))
			}
		}
		if q.Read {
			var read []string
			for i := 0; i < int(q.ReadN); i++ {
				read = append(read, q.ReadData[i].String())
			}
			fmt.Fprintf(&b, " | read %s", strings.Join(read, " "))
		}
		b.WriteString(" | source")
		if q.S.SrcHeld {
			for i := 0; i < int(q.S.Pages); i++ {
				writeSource(&b, i, s.Src[q.P][q.S.Src[i]].Data.String())
			}
		}
		b.WriteString("\n")
	}
	for d := 0; d < cfg.NumDecodes(); d++ {
		for p := 0; p < cfg.DecodePages; p++ {
			pg := &s.Pages[d][p]
			o := "free"
			if pg.Owner != spec.Free {
				o = reqName(int(pg.Owner))
			}
			if pg.Cached {
				o = cachedName(pg.Scope, pg.Key, int(pg.Pins), int(pg.LRU), pg.Doomed)
			}
			req := reqName(int(pg.Tag.Req))
			if pg.Tag.Req == spec.Tenant {
				req = "tenant"
			}
			writePageLine(&b, cfg, d, p, o, uint64(pg.Epoch), pg.Quarantined, pg.Data.String(),
				tagName(req, int64(pg.Tag.Index), uint64(pg.Tag.Epoch), pg.Tag.Sum.String()))
		}
	}
	for p := 0; p < cfg.NumPrefills(); p++ {
		for d := 0; d < cfg.NumDecodes(); d++ {
			b.WriteString(pairName(cfg, p, d, uint64(s.QPInc[p][d]), uint64(s.PQPInc[p][d]), s.Fenced[p][d]) + ":")
			for _, m := range s.QP[p][d].Items() {
				fmt.Fprintf(&b, " %v r%d", m.Kind, m.Req)
				if m.Kind == spec.MWrite {
					fmt.Fprintf(&b, "[%d]", m.Index)
				}
				b.WriteString(incName(cfg, uint64(m.DInc)))
			}
			b.WriteString("\nback:")
			for _, m := range s.QPBack[p][d].Items() {
				fmt.Fprintf(&b, " %v r%d%s", m.Kind, m.Req, incName(cfg, uint64(m.DInc)))
			}
			b.WriteString("\n" + unackedName(cfg, s.Unacked[p][d]))
		}
	}
	if cfg.DecodeRestarts {
		for d := 0; d < cfg.NumDecodes(); d++ {
			fmt.Fprintf(&b, "decode %d: incarnation %d\n", d, s.DInc[d])
		}
	}
	for p := 0; p < cfg.NumPrefills(); p++ {
		writeRouterQueue(&b, "router to prefill", p, cfg.NumPrefills(), s.ToPrefill[p].Items())
	}
	for d := 0; d < cfg.NumDecodes(); d++ {
		writeRouterQueue(&b, "router to decode", d, cfg.NumDecodes(), s.ToDecode[d].Items())
	}
	return b.String()
}

// Offsets of a tag record's fields (protocol.Tag's encoding: magic and
// version, then request, epoch, index, tokens, sum, then the MAC).
const (
	tagRequestAt = 8
	tagEpochAt   = 16
	tagIndexAt   = 24
)

// damageTag damages one field of a tag record in transit, as the spec's
// corrupt fault with DamageTag does: the request becomes the tenant's, or
// the index or the epoch goes up by one. The MAC is left as it was.
func damageTag(record []byte, damage uint8) {
	switch damage {
	case spec.DamagedTagReq:
		binary.BigEndian.PutUint64(record[tagRequestAt:], uint64(tenantID))
	case spec.DamagedTagIndex:
		binary.BigEndian.PutUint32(record[tagIndexAt:], binary.BigEndian.Uint32(record[tagIndexAt:])+1)
	case spec.DamagedTagEpoch:
		binary.BigEndian.PutUint64(record[tagEpochAt:], binary.BigEndian.Uint64(record[tagEpochAt:])+1)
	}
}

// tagFields reads a tag record's fields without checking its MAC.
func tagFields(record []byte) protocol.Tag {
	return protocol.Tag{
		Request: protocol.RequestID(binary.BigEndian.Uint64(record[tagRequestAt:])),
		Epoch:   binary.BigEndian.Uint64(record[tagEpochAt:]),
		Index:   binary.BigEndian.Uint32(record[tagIndexAt:]),
		Tokens:  binary.BigEndian.Uint32(record[28:]),
		Sum:     binary.BigEndian.Uint64(record[32:]),
	}
}

// damageGrant is a Grant as the spec's CorruptSend delivers it: its token
// count one more, or one page more (a copy of its last page one number on,
// so that the page count is what differs).
func damageGrant(g *protocol.Grant, arg uint16) *protocol.Grant {
	d := &protocol.Grant{Request: g.Request, Tokens: g.Tokens, Pages: append([]protocol.PageGrant(nil), g.Pages...)}
	if arg&spec.SendPages == 0 {
		d.Tokens++
		return d
	}
	extra := protocol.PageGrant{Page: 0, Epoch: 1}
	if n := len(d.Pages); n > 0 {
		extra = d.Pages[n-1]
		extra.Page++
		extra.Addr += 1 << 20
	}
	d.Pages = append(d.Pages, extra)
	return d
}
