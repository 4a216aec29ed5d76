package protocoltest

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// NodeConfig is one node of a Network.
type NodeConfig struct {
	Pages      int // pages in its pool
	PageTokens int // tokens per page; 0 means 4
	PageBytes  int // bytes of KV per page; 0 means 64
	// Advertise is the pool, in pages, the node advertises to the router;
	// 0 means Pages. More than Pages is the incident's misadvertisement: the
	// router lets through what the node's own intake must refuse.
	Advertise   int
	MaxInFlight int           // prefill: WRITEs in flight per request; 0 means 2
	Slots       int           // decode: requests held at once; 0 means Pages
	Timeout     time.Duration // decode: a reservation's timeout; 0 means never
	Horizon     time.Duration // how long ended records are kept; 0 means forever
	// PrefixCache turns decode's prefix cache on. Its Authorize hook admits
	// a Bootstrap only with the scope and chain the network dispatched (what
	// the router's ticket binds in a deployment).
	PrefixCache bool
}

// Config is a deployment: a protocol.Router, prefill nodes and decode nodes,
// every prefill node joined to every decode node by an in-memory queue pair.
type Config struct {
	Prefill, Decode []NodeConfig
	// RouterTimeout fails a request without an outcome after this long; 0
	// means never.
	RouterTimeout time.Duration
	// Research turns bugs of the catalogue on, in every node and the router.
	Research research.Switches
	// Start is the clock's start; zero means a fixed instant.
	Start time.Time
}

// The harness has one queue pair for each pair of a prefill and a decode node,
// and never reconnects one, so at a node's Sender or Receiver the queue pair
// to peer node X is named by X's NodeID (transfer, which reconnects, draws a
// new PeerID for each connection and keeps its own map).
func queuePairTo(node protocol.NodeID) protocol.PeerID { return protocol.PeerID(node) }

// peerNode is the node at the other end of a queue pair.
func peerNode(qp protocol.PeerID) protocol.NodeID { return protocol.NodeID(qp) }

// Node names as the router and the nodes know them: prefill node i is
// PrefillID(i), decode node j DecodeID(j).
func PrefillID(i int) protocol.NodeID { return protocol.NodeID(1 + i) }

// DecodeID names decode node j.
func DecodeID(j int) protocol.NodeID { return protocol.NodeID(101 + j) }

// PrefillNode is a prefill node: a Sender and its source pages.
type PrefillNode struct {
	ID      protocol.NodeID
	Name    string
	Sender  *protocol.Sender
	Mem     *Memory
	Crashed bool // gone: never called again; what it put on the wire may still land
	Inbox   []RouterMsg
	// Incarnation counts the node's restarts: each one is a new Sender (fresh
	// pools, no records) registered with the router under a larger one.
	Incarnation uint64
	senderCfg   protocol.SenderConfig
	info        protocol.NodeInfo // its registration with the router, at incarnation 0
}

// DecodeNode is a decode node: a Receiver and its pages.
type DecodeNode struct {
	ID       protocol.NodeID
	Name     string
	Receiver *protocol.Receiver
	Mem      *Memory
	Inbox    []RouterMsg
	Verified []protocol.RequestID // verified, not yet acquired
	Reading  []protocol.RequestID // acquired and checked, not yet finished
	// Incarnation counts the node's restarts: each one is a new Receiver
	// (a fresh pool, epochs from zero, no records) over the same pages,
	// registered with the router under a larger one.
	Incarnation uint64
	receiverCfg protocol.ReceiverConfig
	info        protocol.NodeInfo // its registration with the router, at incarnation 0
}

// QueuePair is the reliable-connected queue pair between a prefill and a
// decode node: WRITEs and SENDs prefill→decode placed and delivered in
// order, and SENDs back.
type QueuePair struct {
	Prefill *PrefillNode
	Decode  *DecodeNode
	Fwd     []protocol.Op
	Back    []protocol.Message
	// Key is the queue pair's tag key, the same at both ends (agreed at
	// setup in a deployment; derived from the pair's names here, so that
	// every run replays).
	Key *protocol.TagKey
	// Incarnation is the incarnation of Prefill that Decode holds this queue
	// pair for: a restarted node has none to Decode until Decode has cut the
	// old one's (a deployment's reconnect makes a new queue pair).
	Incarnation uint64
	// DecodeIncarnation is the incarnation of Decode that Prefill holds this
	// queue pair to: after a decode node's restart, a prefill node has none
	// to the new incarnation until it has cut the old one's.
	DecodeIncarnation uint64
	corrupt           map[uint64]bool // WRITEs to corrupt in transit
	old               int             // the first old ops of Fwd, posted by an incarnation its node has replaced
	oldBack           int             // the first messages of Back, sent by a decode incarnation since replaced
}

// queuePairKey derives the tag key of the queue pair between two nodes.
func queuePairKey(prefill, decode protocol.NodeID) *protocol.TagKey {
	secret := sha256.Sum256(fmt.Appendf(nil, "protocoltest queue pair %d-%d", prefill, decode))
	k, err := protocol.NewTagKey(secret[:], protocol.SumXXH3)
	if err != nil {
		panic(err) // a 32-byte secret is always valid
	}
	return k
}

// Name is the queue pair as logs name it.
func (q *QueuePair) Name() string { return q.Prefill.Name + "→" + q.Decode.Name }

// RouterMsgKind is what the router sends a node.
type RouterMsgKind uint8

// The router's messages.
const (
	MsgDispatch        RouterMsgKind = iota // to prefill: run the request against Peer
	MsgCancel                               // to either: cancel its leg
	MsgPeerLost                             // to decode: prefill node Peer is lost
	MsgPeerRestarted                        // to decode: prefill node Peer is back under a new incarnation (the registry's news)
	MsgDecodeRestarted                      // to prefill: decode node Peer is back under a new incarnation (the registry's news)
)

// RouterMsg is one message from the router to a node, in order per node.
type RouterMsg struct {
	Kind    RouterMsgKind
	Request protocol.RequestID
	Tokens  int
	Peer    protocol.NodeID
	// Incarnation is, in MsgDecodeRestarted, decode node Peer's new
	// incarnation: the one whose queue pair prefill holds after it.
	Incarnation uint64
}

func (m RouterMsg) String() string {
	switch m.Kind {
	case MsgDispatch:
		return fmt.Sprintf("dispatch of r%d (%d tokens)", m.Request, m.Tokens)
	case MsgCancel:
		return fmt.Sprintf("cancel of r%d", m.Request)
	case MsgPeerRestarted:
		return fmt.Sprintf("news that prefill node %d restarted", m.Peer)
	case MsgDecodeRestarted:
		return fmt.Sprintf("news that decode node %d restarted as incarnation %d", m.Peer, m.Incarnation)
	}
	return fmt.Sprintf("news that prefill node %d is lost", m.Peer)
}

// Request is what the network knows of one request.
type Request struct {
	ID              protocol.RequestID
	Tokens          int
	Prefill, Decode protocol.NodeID // 0 until dispatched
	PrefillInc      uint64          // the incarnation of Prefill it was dispatched to
	DecodeInc       uint64          // the incarnation of Decode it was dispatched to
	Src             []uint32        // source pages the prefill node's intake gave it
	Computed        bool
	ComputedPages   int // the first pages of Src whose KV is computed
	Granted         []protocol.PageRef
	PrefillEnded    bool // the prefill node reported, or crashed
	DecodeEnded     bool // the decode node reported
	Decided         bool // the client has its outcome
	Outcome         error
	Read            bool // decode read it and its bytes were its own
	// Scope and Prompt are set for a request submitted with SubmitPrompt:
	// its KV then depends on its tokens alone (page i's on the prompt up to
	// the end of page i), as a model's does, so requests sharing a prefix
	// compute the same bytes for it. Prefix is the pages decode's Grant
	// said are present.
	Scope  protocol.Scope
	Prompt []uint32
	Prefix int
	// readPages are the pages decode's Acquire gave it, until Finish.
	readPages []protocol.PageRef
	active    bool // in Network.active
	routed    bool // submitted through the router (not staged at a node by hand)
}

// Violation is a property of the spec (docs/spec.md) the network saw broken,
// or a call a node or the router refused that the protocol does not expect.
type Violation struct {
	Property string
	Detail   string
}

// Network is a whole deployment in memory, in the style of etcd raft's
// rafttest: the test (or a seeded scheduler) decides which event happens
// next, and the network carries every effect (the router's messages, the
// WRITEs and SENDs on each queue pair, outcomes to the router and the
// client) and checks the spec's properties: NoForeignWrite at every
// placement, Isolation and HonestOutcome at every read, Conservation after
// every event, one outcome per node and per client; Quiescent checks
// Termination and NoLeak. Each event is a method; each logs what happened
// through Logf when it is set.
type Network struct {
	cfg     Config
	Router  *protocol.Router
	Prefill []*PrefillNode
	Decode  []*DecodeNode
	QPs     []*QueuePair // prefill-major: QP(i, j) is QPs[i*len(Decode)+j]
	Now     time.Time
	reqs    map[protocol.RequestID]*Request
	order   []protocol.RequestID // requests in Submit order
	active  []protocol.RequestID // those not yet over (see over), in order
	// Violations are what the network saw broken, in order.
	Violations []Violation
	// Logf, when set, receives one line per thing that happened.
	Logf func(format string, a ...any)
	// Lenient logs a refused call instead of counting it a violation: for
	// scenarios that stage protocol errors on purpose.
	Lenient bool
	// ComputeAtIntake computes a request's KV as soon as its prefill node
	// takes it; otherwise Compute is an event of its own.
	ComputeAtIntake bool
	// ComputePagesAtIntake, with ComputeAtIntake, computes only that many
	// pages at intake (a streaming prefill's first chunk); 0 means all.
	ComputePagesAtIntake int
	// StreamPages makes the compute event (Events) compute one page of a
	// request at a time, as a streaming prefill in chunks of one page does
	// (Sender.ComputedPages), instead of the whole prompt.
	StreamPages bool
	// OnOutcome, when set, sees every outcome a node reports.
	OnOutcome func(node protocol.NodeID, o protocol.Outcome)
	prefill   map[protocol.NodeID]*PrefillNode
	decode    map[protocol.NodeID]*DecodeNode
	// writer is, per decode node and page, the request whose WRITE landed
	// there last (the ground truth NoCrossScopeRead is checked against),
	// and pinned, per decode node and page, the requests reading it as
	// their prefix now (PinnedNeverReallocated's).
	writer map[protocol.NodeID]map[uint32]protocol.RequestID
	pinned map[protocol.NodeID]map[uint32]int
}

func (c *NodeConfig) defaults() {
	if c.PageTokens == 0 {
		c.PageTokens = 4
	}
	if c.PageBytes == 0 {
		c.PageBytes = 64
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = 2
	}
	if c.Advertise == 0 {
		c.Advertise = c.Pages
	}
}

// New builds the deployment: every node registered with the router, every
// decode page holding an earlier tenant's KV.
func New(cfg Config) (*Network, error) {
	if len(cfg.Prefill) == 0 || len(cfg.Decode) == 0 {
		return nil, errors.New("protocoltest: a network needs a prefill node and a decode node")
	}
	if cfg.Start.IsZero() {
		cfg.Start = time.Unix(1_000_000, 0)
	}
	n := &Network{cfg: cfg, Now: cfg.Start, reqs: map[protocol.RequestID]*Request{},
		prefill: map[protocol.NodeID]*PrefillNode{}, decode: map[protocol.NodeID]*DecodeNode{},
		writer: map[protocol.NodeID]map[uint32]protocol.RequestID{}, pinned: map[protocol.NodeID]map[uint32]int{},
		Router: protocol.NewRouter(protocol.RouterConfig{Timeout: cfg.RouterTimeout, Research: cfg.Research})}
	keys := map[[2]protocol.NodeID]*protocol.TagKey{}
	for i := range cfg.Prefill {
		for j := range cfg.Decode {
			keys[[2]protocol.NodeID{PrefillID(i), DecodeID(j)}] = queuePairKey(PrefillID(i), DecodeID(j))
		}
	}
	name := func(role string, i, of int) string {
		if of == 1 {
			return role
		}
		return fmt.Sprintf("%s %d", role, i+1)
	}
	for i, c := range cfg.Prefill {
		c.defaults()
		mem := NewMemory(c.Pages, c.PageBytes)
		id := PrefillID(i)
		sc := protocol.SenderConfig{Pages: c.Pages, PageTokens: c.PageTokens, MaxInFlight: c.MaxInFlight,
			Horizon: c.Horizon, Memory: mem, Research: cfg.Research, TagKeys: func(peer protocol.PeerID) *protocol.TagKey {
				return keys[[2]protocol.NodeID{id, peerNode(peer)}] // nil for no queue pair of this network
			}}
		s, err := protocol.NewSender(sc)
		if err != nil {
			return nil, err
		}
		node := &PrefillNode{ID: id, Name: name("prefill", i, len(cfg.Prefill)), Sender: s, Mem: mem, senderCfg: sc,
			info: protocol.NodeInfo{ID: id, Role: protocol.RolePrefill, PoolPages: c.Advertise, PageTokens: c.PageTokens}}
		if err := n.Router.AddNode(node.info); err != nil {
			return nil, err
		}
		n.Prefill = append(n.Prefill, node)
		n.prefill[node.ID] = node
	}
	for j, c := range cfg.Decode {
		c.defaults()
		mem := NewMemory(c.Pages, c.PageBytes)
		id := DecodeID(j)
		mem.FillTenant(keys[[2]protocol.NodeID{PrefillID(0), id}]) // the earlier tenant came from prefill node 0
		rc := protocol.ReceiverConfig{Pages: c.Pages, PageTokens: c.PageTokens, Slots: c.Slots,
			Timeout: c.Timeout, Horizon: c.Horizon, Memory: mem, Research: cfg.Research,
			TagKeys: func(peer protocol.PeerID) *protocol.TagKey {
				return keys[[2]protocol.NodeID{peerNode(peer), id}]
			},
			Region: func(p uint32) (uint64, uint32) { return uint64(p) << 20, uint32(id) }}
		if c.PrefixCache {
			rc.PrefixCache = true
			rc.Authorize = n.authorize
		}
		n.writer[id], n.pinned[id] = map[uint32]protocol.RequestID{}, map[uint32]int{}
		r, err := protocol.NewReceiver(rc)
		if err != nil {
			return nil, err
		}
		node := &DecodeNode{ID: id, Name: name("decode", j, len(cfg.Decode)), Receiver: r, Mem: mem, receiverCfg: rc,
			info: protocol.NodeInfo{ID: id, Role: protocol.RoleDecode, PoolPages: c.Advertise, PageTokens: c.PageTokens}}
		if err := n.Router.AddNode(node.info); err != nil {
			return nil, err
		}
		n.Decode = append(n.Decode, node)
		n.decode[id] = node
	}
	for _, p := range n.Prefill {
		for _, d := range n.Decode {
			n.QPs = append(n.QPs, &QueuePair{Prefill: p, Decode: d, Key: keys[[2]protocol.NodeID{p.ID, d.ID}], corrupt: map[uint64]bool{}})
		}
	}
	return n, nil
}

func (n *Network) logf(format string, a ...any) {
	if n.Logf != nil {
		n.Logf(format, a...)
	}
}

func (n *Network) violate(prop, format string, a ...any) {
	v := Violation{Property: prop, Detail: fmt.Sprintf(format, a...)}
	n.Violations = append(n.Violations, v)
	n.logf("VIOLATION %s: %s", v.Property, v.Detail)
}

// refused is a call a node or the router refused.
func (n *Network) refused(who string, err error) {
	if n.Lenient {
		n.logf("%s refuses: %v", who, err)
		return
	}
	n.violate("NoProtocolError", "%s refused: %v", who, err)
}

// QP is the queue pair between a prefill and a decode node.
func (n *Network) QP(prefill, decode protocol.NodeID) *QueuePair {
	return n.QPs[(int(prefill)-1)*len(n.Decode)+int(decode)-101]
}

// Request is what the network knows of request id (nil if never submitted).
func (n *Network) Request(id protocol.RequestID) *Request { return n.reqs[id] }

// Requests is every request submitted, in order.
func (n *Network) Requests() []*Request {
	out := make([]*Request, len(n.order))
	for i, id := range n.order {
		out[i] = n.reqs[id]
	}
	return out
}

// PrefillNode is the prefill node named id.
func (n *Network) PrefillNode(id protocol.NodeID) *PrefillNode { return n.prefill[id] }

// DecodeNode is the decode node named id.
func (n *Network) DecodeNode(id protocol.NodeID) *DecodeNode { return n.decode[id] }

// request is id's record, made on first sight for a request a test staged at
// a node by hand, bypassing the router.
func (n *Network) request(id protocol.RequestID) *Request {
	q := n.reqs[id]
	if q == nil {
		q = &Request{ID: id, active: true}
		n.reqs[id] = q
		n.order = append(n.order, id)
		n.active = append(n.active, id)
	}
	return q
}

// Settle carries every effect after a test called a node directly.
func (n *Network) Settle() { n.settle() }

// --- events ---

// Submit is a client's request through the router. A refusal (rejected, or
// no live node) is the client's outcome and is returned.
func (n *Network) Submit(id protocol.RequestID, tokens int) error {
	return n.SubmitPrompt(id, tokens, 0, nil)
}

// SubmitPrompt is Submit of a request of scope with the given prompt (of
// tokens tokens; nil for a request whose KV is a pattern of its id, which
// shares nothing). With a scope, its Bootstrap carries the prompt's chain,
// and a decode node with the prefix cache reuses what it holds of it.
func (n *Network) SubmitPrompt(id protocol.RequestID, tokens int, scope protocol.Scope, prompt []uint32) error {
	if n.reqs[id] != nil {
		return fmt.Errorf("protocoltest: request %d submitted twice", id)
	}
	q := &Request{ID: id, Tokens: tokens, active: true, routed: true, Scope: scope, Prompt: prompt}
	n.reqs[id] = q
	n.order = append(n.order, id)
	n.active = append(n.active, id)
	_, err := n.Router.Submit(id, tokens, n.Now)
	if err != nil {
		n.logf("router refuses r%d: %v", id, err)
		n.decide(q, err)
		if errors.Is(err, protocol.ErrRejected) && tokens >= 1 && tokens <= n.Router.Limit() {
			n.violate("HonestOutcome", "the router rejected r%d of %d tokens, within the deployment's %d", id, tokens, n.Router.Limit())
		}
	}
	n.settle()
	return err
}

// DeliverRouter hands the head of the router's messages to node.
func (n *Network) DeliverRouter(node protocol.NodeID) {
	if p := n.prefill[node]; p != nil {
		m := p.Inbox[0]
		p.Inbox = p.Inbox[1:]
		n.logf("%s receives the router's %v", p.Name, m)
		switch m.Kind {
		case MsgDispatch:
			n.intake(p, m)
		case MsgCancel:
			p.Sender.Cancel(m.Request)
		case MsgDecodeRestarted:
			// The queue pair to the old incarnation is cut first: its legs
			// fail, and what the old one sent is flushed. Only then does
			// this node hold one to the new incarnation.
			qp := n.QP(p.ID, m.Peer)
			n.cut(qp)
			qp.DecodeIncarnation = m.Incarnation // restarted again since, it is dead too: the next news moves on
		}
		n.settle()
		return
	}
	d := n.decode[node]
	m := d.Inbox[0]
	d.Inbox = d.Inbox[1:]
	n.logf("%s receives the router's %v", d.Name, m)
	switch m.Kind {
	case MsgCancel:
		d.Receiver.Cancel(m.Request)
	case MsgPeerLost:
		d.Receiver.PeerFailed(queuePairTo(m.Peer))
	case MsgPeerRestarted:
		// The new incarnation's queue pair is accepted only once the old
		// one's is cut: its requests fail, and nothing it posted can land.
		qp, p := n.QP(m.Peer, d.ID), n.prefill[m.Peer]
		n.cut(qp)
		qp.Incarnation = p.Incarnation
	}
	n.settle()
}

// intake is the prefill node taking a dispatch: its own intake, then the KV.
func (n *Network) intake(p *PrefillNode, m RouterMsg) {
	q := n.reqs[m.Request]
	q.Prefill, q.Decode = p.ID, m.Peer
	if qp := n.QP(p.ID, m.Peer); qp.Incarnation != p.Incarnation {
		// Restarted, and the decode node has not accepted this incarnation
		// yet: there is no queue pair to it, so the leg fails.
		n.logf("%s has no queue pair to %s yet: r%d fails", p.Name, qp.Decode.Name, q.ID)
		q.PrefillEnded = true
		n.legEnded(p.ID, q.ID, fmt.Errorf("%w: no queue pair to %s yet", protocol.ErrPeerFailed, qp.Decode.Name))
		return
	}
	var o protocol.SubmitOptions
	if q.Scope != 0 {
		o.Scope, o.Chain = q.Scope, protocol.PrefixChain(q.Prompt, n.pageTokens(p.ID))
	}
	src, err := p.Sender.SubmitWith(q.ID, queuePairTo(m.Peer), m.Tokens, o)
	if err != nil {
		n.logf("%s refuses r%d: %v", p.Name, q.ID, err)
		q.PrefillEnded = true
		if errors.Is(err, protocol.ErrRejected) && q.Tokens <= n.cfg.Prefill[int(p.ID)-1].Pages*n.pageTokens(p.ID) {
			n.violate("HonestOutcome", "%s rejected r%d of %d tokens although it fits: %v", p.Name, q.ID, q.Tokens, err)
		}
		n.legEnded(p.ID, q.ID, err)
		return
	}
	q.Src = src
	if n.ComputeAtIntake {
		if n.ComputePagesAtIntake > 0 {
			n.computeTo(p, q, n.ComputePagesAtIntake)
			return
		}
		n.compute(p, q)
	}
}

func (n *Network) decodePageTokens(decode protocol.NodeID) int {
	c := n.cfg.Decode[int(decode)-101]
	c.defaults()
	return c.PageTokens
}

func (n *Network) pageTokens(prefill protocol.NodeID) int {
	c := n.cfg.Prefill[int(prefill)-1]
	c.defaults()
	return c.PageTokens
}

// Compute is the prefill node computing request id's KV into its source pages.
func (n *Network) Compute(id protocol.RequestID) {
	q := n.reqs[id]
	n.compute(n.prefill[q.Prefill], q)
	n.settle()
}

// ComputePages is the prefill node computing request id's KV up to its
// first pages pages (Sender.ComputedPages): a chunk of a streaming prefill.
func (n *Network) ComputePages(id protocol.RequestID, pages int) {
	q := n.reqs[id]
	n.computeTo(n.prefill[q.Prefill], q, pages)
	n.settle()
}

func (n *Network) compute(p *PrefillNode, q *Request) { n.computeTo(p, q, len(q.Src)) }

func (n *Network) computeTo(p *PrefillNode, q *Request, pages int) {
	for i := q.ComputedPages; i < min(pages, len(q.Src)); i++ {
		page := q.Src[i]
		if q.Prompt != nil {
			FillPrompt(p.Mem.payloads[page], q.Prompt, n.pageTokens(p.ID), i)
			continue
		}
		FillPattern(p.Mem.payloads[page], q.ID, i)
	}
	q.ComputedPages = max(q.ComputedPages, min(pages, len(q.Src)))
	q.Computed = q.ComputedPages == len(q.Src)
	if err := p.Sender.ComputedPages(q.ID, pages); err != nil {
		n.refused(p.Name, err)
	}
}

// Deliver places the WRITE, or delivers the SEND, at the head of qp.
func (n *Network) Deliver(qp *QueuePair) protocol.Op {
	op := qp.Fwd[0]
	qp.Fwd = qp.Fwd[1:]
	d := qp.Decode
	old := qp.old > 0 // posted by an incarnation of the prefill node that has been replaced
	if old {
		qp.old--
		if qp.Incarnation == qp.Prefill.Incarnation {
			n.violate("NoOldIncarnation", "%v, posted by a replaced incarnation of %s, reached %s after it accepted the new one", opText(op), qp.Prefill.Name, d.Name)
		}
	}
	if w := op.Write; w != nil {
		// PinnedNeverReallocated: never into a cached page, nor one a
		// request reads as its prefix; NoForeignWrite: never into a page
		// another request holds.
		_, pins, cached := d.Receiver.Pool().Shared(w.Remote.Page)
		if owner, _, free := d.Receiver.Pool().Owner(w.Remote.Page); cached || n.pinned[d.ID][w.Remote.Page] > 0 {
			n.violate("PinnedNeverReallocated", "WRITE of r%d landed in %s page %d, which is cached (%d pins) or read as a prefix by %d requests",
				w.Request, d.Name, w.Remote.Page, pins, n.pinned[d.ID][w.Remote.Page])
		} else if !free && owner != w.Request {
			n.violate("NoForeignWrite", "WRITE of r%d landed in %s page %d, which r%d holds", w.Request, d.Name, w.Remote.Page, owner)
		}
		n.writer[d.ID][w.Remote.Page] = w.Request
		payload := d.Mem.payloads[w.Remote.Page]
		copy(payload, qp.Prefill.Mem.payloads[w.Source]) // the NIC reads the source page now
		if qp.corrupt[w.ID] {
			delete(qp.corrupt, w.ID)
			payload[len(payload)/2] ^= 0x40
		}
		copy(d.Mem.tags[w.Remote.Page], w.Tag)
		n.logf("placed %v", opText(op))
		if !qp.Prefill.Crashed && !old {
			if err := qp.Prefill.Sender.Completed(w.ID, nil); err != nil {
				n.refused(qp.Prefill.Name, err)
			}
		}
	} else {
		n.logf("%s receives %v", d.Name, opText(op))
		if err := d.Receiver.Step(queuePairTo(qp.Prefill.ID), op.Msg, n.Now); err != nil {
			n.refused(d.Name, err)
		}
	}
	n.settle()
	return op
}

// DeliverBack delivers the head of qp's decode→prefill direction.
func (n *Network) DeliverBack(qp *QueuePair) {
	m := qp.Back[0]
	qp.Back = qp.Back[1:]
	if qp.oldBack > 0 { // sent by a decode incarnation that has been replaced
		qp.oldBack--
		if qp.DecodeIncarnation == qp.Decode.Incarnation {
			n.violate("NoOldIncarnation", "%s took %v, sent by a replaced incarnation of %s, after it accepted the new one", qp.Prefill.Name, opText(protocol.Op{Msg: m}), qp.Decode.Name)
		}
	}
	n.logf("%s receives %v", qp.Prefill.Name, opText(protocol.Op{Msg: m}))
	if err := qp.Prefill.Sender.Step(queuePairTo(qp.Decode.ID), m); err != nil {
		n.refused(qp.Prefill.Name, err)
	}
	n.settle()
}

// CorruptNext flips a byte of the WRITE at the head of qp in transit.
func (n *Network) CorruptNext(qp *QueuePair) {
	w := qp.Fwd[0].Write
	qp.corrupt[w.ID] = true
	n.logf("%v will be corrupted in transit", opText(qp.Fwd[0]))
}

// Acquire is decode node d's decoder taking the next verified request:
// Receiver.Acquire, then every page checked byte for byte against the KV
// the request's prefill node computed (Isolation, HonestOutcome).
func (n *Network) Acquire(d *DecodeNode) {
	id := d.Verified[0]
	d.Verified = d.Verified[1:]
	n.acquire(d, id)
	n.settle()
}

func (n *Network) acquire(d *DecodeNode, id protocol.RequestID) bool {
	q := n.reqs[id]
	refs, err := d.Receiver.Acquire(id)
	if err != nil {
		n.logf("%s cannot read r%d: %v", d.Name, id, err)
		return false // an explicit error: its outcome comes through the effects
	}
	n.logf("%s reads r%d: %d pages", d.Name, id, len(refs))
	isolated := true
	pt := n.pageTokens(q.Prefill)
	for i, ref := range refs {
		// The bytes: the request's own KV, whoever wrote them.
		if q.Prompt == nil && !HoldsPattern(d.Mem.payloads[ref.Page], id, i) ||
			q.Prompt != nil && !HoldsPrompt(d.Mem.payloads[ref.Page], q.Prompt, pt, i) {
			prop := "Isolation"
			if q.Prefix > 0 {
				prop = "PrefixExact" // the hit and the written pages do not make the prompt
			}
			n.violate(prop, "%s read page %d for r%d[%d], and it holds KV r%d did not write", d.Name, ref.Page, id, i, id)
			isolated = false
		}
		// Who wrote them: the request itself, or one of its scope.
		if w := n.writer[d.ID][ref.Page]; q.Prompt != nil && w != id && (q.Scope == 0 || n.reqs[w] == nil || n.reqs[w].Scope != q.Scope) {
			ws := protocol.Scope(0)
			if n.reqs[w] != nil {
				ws = n.reqs[w].Scope
			}
			n.violate("NoCrossScopeRead", "%s read page %d for r%d[%d] (scope %d), written by r%d (scope %d)", d.Name, ref.Page, id, i, q.Scope, w, ws)
			isolated = false
		}
	}
	if q.Prefix > 0 {
		for _, ref := range refs[:min(q.Prefix, len(refs))] {
			n.pinned[d.ID][ref.Page]++
		}
	}
	c := n.cfg.Decode[int(d.ID)-101]
	c.defaults()
	if want := protocol.PagesFor(uint32(q.Tokens), c.PageTokens); len(refs) != want {
		n.violate("HonestOutcome", "r%d has %d tokens but %s read %d pages, not %d", id, q.Tokens, d.Name, len(refs), want)
	}
	q.Read = isolated
	q.readPages = refs
	d.Reading = append(d.Reading, id)
	return true
}

// Finish is decode node d's decoder ending its oldest read.
func (n *Network) Finish(d *DecodeNode) {
	id := d.Reading[0]
	d.Reading = d.Reading[1:]
	n.unpin(d, id)
	if err := d.Receiver.Finish(id); err != nil {
		n.refused(d.Name, err)
	}
	n.settle()
}

// unpin ends request id's read of its prefix pages in the ground truth.
func (n *Network) unpin(d *DecodeNode, id protocol.RequestID) {
	q := n.reqs[id]
	if q.Prefix == 0 || q.readPages == nil {
		return
	}
	for _, ref := range q.readPages[:min(q.Prefix, len(q.readPages))] {
		if n.pinned[d.ID][ref.Page]--; n.pinned[d.ID][ref.Page] == 0 {
			delete(n.pinned[d.ID], ref.Page)
		}
	}
	q.readPages = nil
}

// Read is Acquire then Finish for request id, wherever it is verified.
func (n *Network) Read(id protocol.RequestID) {
	for _, d := range n.Decode {
		for i, v := range d.Verified {
			if v == id {
				d.Verified = append(d.Verified[:i:i], d.Verified[i+1:]...)
				if n.acquire(d, id) {
					d.Reading = d.Reading[:len(d.Reading)-1]
					n.unpin(d, id)
					if err := d.Receiver.Finish(id); err != nil {
						n.refused(d.Name, err)
					}
				}
				n.settle()
				return
			}
		}
	}
	n.logf("r%d is not verified anywhere", id)
}

// Cancel is the client going away.
func (n *Network) Cancel(id protocol.RequestID) {
	n.logf("client cancels r%d", id)
	if err := n.Router.Cancel(id); err != nil {
		n.refused("router", err)
	}
	n.settle()
}

// Advance moves the clock on by d and ticks every node and the router.
func (n *Network) Advance(d time.Duration) {
	n.Now = n.Now.Add(d)
	for _, p := range n.Prefill {
		if !p.Crashed {
			p.Sender.Tick(n.Now)
		}
	}
	for _, dn := range n.Decode {
		dn.Receiver.Tick(n.Now)
	}
	n.Router.Tick(n.Now)
	n.settle()
}

// Cut breaks qp: both directions flush, both ends learn.
func (n *Network) Cut(qp *QueuePair) {
	n.logf("the queue pair %s is cut", qp.Name())
	n.cut(qp)
	n.settle()
}

func (n *Network) cut(qp *QueuePair) {
	qp.Fwd, qp.Back, qp.old, qp.oldBack = nil, nil, 0, 0
	clear(qp.corrupt)
	qp.Decode.Receiver.QueuePairFenced(queuePairTo(qp.Prefill.ID))
	if !qp.Prefill.Crashed {
		qp.Prefill.Sender.Flushed(queuePairTo(qp.Decode.ID))
	}
}

// Crash stops prefill node p: it is never called again. What it put on the
// wire can still land; what is sent to it is lost.
func (n *Network) Crash(p *PrefillNode) {
	n.logf("%s crashes", p.Name)
	p.Crashed = true
	p.Inbox = nil
	for _, qp := range n.QPs {
		if qp.Prefill == p {
			qp.Back = nil
		}
	}
	for _, q := range n.reqs {
		if q.Prefill == p.ID {
			q.PrefillEnded = true // it will never report
		}
	}
	n.settle()
}

// Restart brings crashed prefill node p back under a new incarnation: a new
// Sender with fresh pools and no records, over the same memory (never
// zeroed). It registers with the router under its ID and the larger
// incarnation (Router.AddNode: the loss of the old one, unless that was
// detected already), and the registry tells each decode node, which cuts
// the old incarnation's queue pair before it holds one for the new.
func (n *Network) Restart(p *PrefillNode) {
	s, err := protocol.NewSender(p.senderCfg)
	if err != nil {
		n.refused(p.Name, err)
		return
	}
	p.Sender, p.Crashed, p.Inbox = s, false, nil
	p.Incarnation++
	n.logf("%s restarts as incarnation %d", p.Name, p.Incarnation)
	for _, qp := range n.QPs {
		if qp.Prefill == p {
			qp.old = len(qp.Fwd)
			qp.DecodeIncarnation = qp.Decode.Incarnation // its new queue pairs are to each decode node's live incarnation
		}
	}
	n.register(p.info, p.Incarnation)
	for _, d := range n.Decode {
		d.Inbox = append(d.Inbox, RouterMsg{Kind: MsgPeerRestarted, Peer: p.ID})
	}
	n.settle()
}

// RestartDecode crashes decode node d and brings it back at once under a
// new incarnation: a new Receiver with a fresh pool (epochs from zero), no
// records and free slots, over the same pages (never zeroed). What was in
// flight to the old incarnation is flushed; what it sent may still reach
// prefill. Its queue pairs are for each prefill node's live incarnation.
// It registers with the router under its ID and the larger incarnation
// (Router.AddNode: the loss of the old one, whose requests fail and whose
// open prefill legs are cancelled), and the registry tells each prefill
// node, which cuts its queue pair to the old incarnation before it holds
// one to the new.
func (n *Network) RestartDecode(d *DecodeNode) {
	r, err := protocol.NewReceiver(d.receiverCfg)
	if err != nil {
		n.refused(d.Name, err)
		return
	}
	d.Receiver, d.Inbox, d.Verified, d.Reading = r, nil, nil, nil
	d.Incarnation++
	n.logf("%s crashes and restarts as incarnation %d", d.Name, d.Incarnation)
	for _, qp := range n.QPs {
		if qp.Decode == d {
			qp.Fwd, qp.old = nil, 0 // its end of the queue pair went with it
			clear(qp.corrupt)
			qp.oldBack = len(qp.Back)
			qp.Incarnation = qp.Prefill.Incarnation
		}
	}
	for _, q := range n.reqs {
		if q.Decode == d.ID {
			q.DecodeEnded = true // the old incarnation will never report
		}
	}
	n.register(d.info, d.Incarnation)
	n.settle() // the router's cancels first, then the registry's news
	for _, p := range n.Prefill {
		if !p.Crashed {
			p.Inbox = append(p.Inbox, RouterMsg{Kind: MsgDecodeRestarted, Peer: d.ID, Incarnation: d.Incarnation})
		}
	}
	n.settle()
}

// register is a restarted node's registration with the router: info under
// incarnation inc (Router.AddNode: the loss of the old one).
func (n *Network) register(info protocol.NodeInfo, inc uint64) {
	info.Incarnation = inc
	if err := n.Router.AddNode(info); err != nil {
		n.refused("router", err)
	}
}

// Detect is the registry telling the router that node is lost (its lease
// expired): Router.NodeLost.
func (n *Network) Detect(node protocol.NodeID) {
	n.logf("the router finds node %d lost", node)
	if err := n.Router.NodeLost(node); err != nil {
		n.refused("router", err)
	}
	n.settle()
}

// --- effects ---

// settle carries every effect until nothing more comes: each node's
// operations and messages onto its queue pairs, each node's outcomes to
// the router, and the router's messages and outcomes.
func (n *Network) settle() {
	for more := true; more; {
		more = false
		for _, p := range n.Prefill {
			e := p.Sender.Effects()
			if p.Crashed {
				continue
			}
			for _, op := range e.Ops {
				qp := n.QP(p.ID, peerNode(op.Peer))
				if qp.DecodeIncarnation != qp.Decode.Incarnation {
					// Its other end is a replaced incarnation: flushed,
					// never placed, never completed.
					n.logf("%s posts %v to a replaced incarnation of %s: flushed", p.Name, opText(op), qp.Decode.Name)
					continue
				}
				qp.Fwd = append(qp.Fwd, op)
				n.logf("%s posts %v", p.Name, opText(op))
			}
			for _, o := range e.Outcomes {
				n.logf("%s outcome r%d: %v", p.Name, o.Request, o.Err)
				if n.OnOutcome != nil {
					n.OnOutcome(p.ID, o)
				}
				q := n.request(o.Request)
				if q.PrefillEnded {
					n.violate("OneOutcome", "%s reported r%d twice", p.Name, o.Request)
				}
				q.PrefillEnded = true
				if q.routed {
					n.legEnded(p.ID, o.Request, o.Err)
				}
				more = true
			}
		}
		for _, d := range n.Decode {
			e := d.Receiver.Effects()
			for _, s := range e.Sends {
				qp := n.QP(peerNode(s.Peer), d.ID)
				if g, ok := s.Msg.(*protocol.Grant); ok {
					q := n.request(g.Request)
					q.Decode = d.ID
					if !q.active { // a late Bootstrap reserved pages for it: watch it again
						q.active = true
						n.active = append(n.active, q.ID)
					}
					q.Granted = q.Granted[:0]
					q.Prefix = int(g.Prefix) / n.decodePageTokens(d.ID)
					for _, pg := range g.Pages {
						q.Granted = append(q.Granted, protocol.PageRef{Page: pg.Page, Epoch: pg.Epoch})
					}
				}
				n.logf("%s sends %v", d.Name, opText(protocol.Op{Msg: s.Msg}))
				// The old prefill incarnation's end is gone; and prefill holds
				// no queue pair to this decode incarnation before it took the news.
				if !qp.Prefill.Crashed && qp.Incarnation == qp.Prefill.Incarnation && qp.DecodeIncarnation == d.Incarnation {
					qp.Back = append(qp.Back, s.Msg)
				}
			}
			for _, id := range e.Verified {
				n.logf("%s verified r%d", d.Name, id)
			}
			d.Verified = append(d.Verified, e.Verified...)
			for _, o := range e.Outcomes {
				n.logf("%s outcome r%d: %v", d.Name, o.Request, o.Err)
				if n.OnOutcome != nil {
					n.OnOutcome(d.ID, o)
				}
				q := n.request(o.Request)
				if q.DecodeEnded {
					n.violate("OneOutcome", "%s reported r%d twice", d.Name, o.Request)
				}
				q.DecodeEnded = true
				if o.Err == nil && !q.Read {
					n.violate("HonestOutcome", "%s reported r%d ok without a checked read", d.Name, o.Request)
				}
				if q.routed {
					n.legEnded(d.ID, o.Request, o.Err)
				}
				more = true
			}
			for _, peer := range e.Cuts {
				n.logf("%s cuts the queue pair to %s", d.Name, n.prefill[peerNode(peer)].Name)
				n.cut(n.QP(peerNode(peer), d.ID))
				more = true
			}
		}
		e := n.Router.Effects()
		for _, dsp := range e.Dispatches {
			p := n.prefill[dsp.Prefill]
			n.logf("router dispatches r%d (%d tokens) to %s and %s", dsp.Request, dsp.Tokens, p.Name, n.decode[dsp.Decode].Name)
			q := n.reqs[dsp.Request]
			q.Prefill, q.Decode, q.PrefillInc, q.DecodeInc = dsp.Prefill, dsp.Decode, p.Incarnation, n.decode[dsp.Decode].Incarnation
			if !p.Crashed { // a crashed node drops what it is sent
				p.Inbox = append(p.Inbox, RouterMsg{Kind: MsgDispatch, Request: dsp.Request, Tokens: dsp.Tokens, Peer: dsp.Decode})
			}
		}
		for _, c := range e.Cancels {
			m := RouterMsg{Kind: MsgCancel, Request: c.Request}
			if p := n.prefill[c.Node]; p != nil {
				n.logf("router cancels r%d on %s", c.Request, p.Name)
				if !p.Crashed {
					p.Inbox = append(p.Inbox, m)
				}
			} else if d := n.decode[c.Node]; d != nil {
				n.logf("router cancels r%d on %s", c.Request, d.Name)
				d.Inbox = append(d.Inbox, m)
			}
		}
		for _, l := range e.PeerLost {
			d := n.decode[l.Node]
			n.logf("router tells %s that %s is lost", d.Name, n.prefill[l.Lost].Name)
			d.Inbox = append(d.Inbox, RouterMsg{Kind: MsgPeerLost, Peer: l.Lost})
		}
		for _, o := range e.Outcomes {
			n.decide(n.reqs[o.Request], o.Err)
		}
		more = more || len(e.Dispatches)+len(e.Cancels)+len(e.PeerLost)+len(e.Outcomes) > 0
	}
	n.audit()
}

// legEnded relays a node's outcome to the router.
func (n *Network) legEnded(node protocol.NodeID, id protocol.RequestID, err error) {
	if rerr := n.Router.LegEnded(node, id, err); rerr != nil {
		n.violate("NoProtocolError", "the router refused node %d's outcome for r%d: %v", node, id, rerr)
	}
}

// decide is the client receiving its outcome: exactly once, and success
// only after a checked read.
func (n *Network) decide(q *Request, err error) {
	n.logf("client outcome r%d: %v", q.ID, err)
	if q.Decided {
		n.violate("OneOutcome", "the client got a second outcome for r%d: %v, after %v", q.ID, err, q.Outcome)
		return
	}
	q.Decided, q.Outcome = true, err
	if err == nil && !q.Read {
		n.violate("HonestOutcome", "the client got success for r%d without a checked read", q.ID)
	}
	if p := n.prefill[q.Prefill]; err == nil && p != nil && p.Incarnation != q.PrefillInc {
		n.violate("NoOldIncarnation", "the client got success for r%d, dispatched to incarnation %d of %s, which restarted as %d", q.ID, q.PrefillInc, p.Name, p.Incarnation)
	}
	if d := n.decode[q.Decode]; err == nil && d != nil && d.Incarnation != q.DecodeInc {
		n.violate("NoOldIncarnation", "the client got success for r%d, dispatched to incarnation %d of %s, which restarted as %d", q.ID, q.DecodeInc, d.Name, d.Incarnation)
	}
}

// audit checks Conservation: every pool's own bookkeeping, and every
// request a decode node still works on holds every page it was granted.
func (n *Network) audit() {
	for _, d := range n.Decode {
		if err := d.Receiver.Audit(); err != nil {
			n.violate("Conservation", "%s: %v", d.Name, err)
		}
	}
	for _, p := range n.Prefill {
		if err := p.Sender.Pool().Audit(); err != nil && !p.Crashed {
			n.violate("Conservation", "%s: %v", p.Name, err)
		}
	}
	live := n.active[:0]
	for _, id := range n.active {
		if q := n.reqs[id]; !q.over(n) {
			live = append(live, id)
		} else {
			q.active = false
		}
	}
	clear(n.active[len(live):])
	n.active = live
	for _, id := range n.active {
		q := n.reqs[id]
		if len(q.Granted) == 0 || q.DecodeEnded {
			continue
		}
		pool := n.decode[q.Decode].Receiver.Pool()
		for _, ref := range q.Granted {
			if _, pins, cached := pool.Shared(ref.Page); cached && pool.Epoch(ref.Page) == ref.Epoch {
				// A granted page is one its writer may WRITE: a cached page
				// must never be (write-shared).
				n.violate("PinnedNeverReallocated", "r%d's Grant on %s names page %d@%d, a cached page (%d pins)", q.ID, n.decode[q.Decode].Name, ref.Page, ref.Epoch, pins)
				return
			}
			if !pool.Holds(q.ID, ref) {
				n.violate("Conservation", "r%d is live on %s but page %d@%d is no longer its", q.ID, n.decode[q.Decode].Name, ref.Page, ref.Epoch)
				return
			}
		}
	}
}

// Quiescent checks what must hold once nothing is left to happen:
// Termination (every client has its outcome, every leg ended, the router
// counts no open leg) and NoLeak (every page of every live node is free).
// It returns the pages still held.
func (n *Network) Quiescent() int {
	for _, id := range n.order {
		q := n.reqs[id]
		switch {
		case !q.Decided:
			n.violate("Termination", "r%d has no outcome", q.ID)
		case len(q.Granted) > 0 && !q.DecodeEnded:
			n.violate("Termination", "r%d never ended on %s", q.ID, n.decode[q.Decode].Name)
		case q.Src != nil && !q.PrefillEnded:
			n.violate("Termination", "r%d never ended on %s", q.ID, n.prefill[q.Prefill].Name)
		}
	}
	for _, l := range n.Router.Nodes() {
		if l.Requests > 0 {
			n.violate("Termination", "the router still counts %d requests on node %d: their outcomes never reached it", l.Requests, l.Info.ID)
		}
	}
	leaked := 0
	for _, d := range n.Decode { // an unpinned cached page is the cache's, not a leak
		pool := d.Receiver.Pool()
		leaked += pool.Len() - pool.Free() - (pool.Cached() - pool.Pinned())
	}
	for _, p := range n.Prefill {
		if !p.Crashed {
			leaked += p.Sender.Pool().Len() - p.Sender.Pool().Free()
		}
	}
	if leaked > 0 {
		n.violate("NoLeak", "%d pages still held at quiescence", leaked)
	}
	return leaked
}

// OpString describes an operation on a queue pair for logs and scenarios.
func OpString(op protocol.Op) string {
	if w := op.Write; w != nil {
		return fmt.Sprintf("WRITE r%d[%d] -> page %d@%d", w.Request, w.Index, w.Remote.Page, w.Remote.Epoch)
	}
	switch m := op.Msg.(type) {
	case *protocol.Bootstrap:
		if m.Scope != 0 {
			return fmt.Sprintf("Bootstrap r%d %d tokens scope %d, %d full pages", m.Request, m.Tokens, m.Scope, len(m.Chain))
		}
		return fmt.Sprintf("Bootstrap r%d %d tokens", m.Request, m.Tokens)
	case *protocol.Grant:
		pages := make([]string, len(m.Pages))
		for i, p := range m.Pages {
			pages[i] = fmt.Sprintf("%d@%d", p.Page, p.Epoch)
		}
		if m.Prefix != 0 {
			return fmt.Sprintf("Grant r%d %d tokens, %d present [%s]", m.Request, m.Tokens, m.Prefix, strings.Join(pages, " "))
		}
		return fmt.Sprintf("Grant r%d %d tokens [%s]", m.Request, m.Tokens, strings.Join(pages, " "))
	case *protocol.Done:
		if m.Prefix != 0 {
			return fmt.Sprintf("Done r%d %d tokens %d pages, %d skipped", m.Request, m.Tokens, m.Pages, m.Prefix)
		}
		return fmt.Sprintf("Done r%d %d tokens %d pages", m.Request, m.Tokens, m.Pages)
	case *protocol.Abort:
		return fmt.Sprintf("Abort r%d reason %d", m.Request, m.Reason)
	case *protocol.AbortAck:
		return fmt.Sprintf("AbortAck r%d", m.Request)
	}
	return fmt.Sprint(op.Msg)
}

// opText formats an operation only when a log line is written.
type opText protocol.Op

func (o opText) String() string { return OpString(protocol.Op(o)) }

// Event is one thing that can happen next, for a scheduler to choose.
type Event struct {
	Kind   string // what kind of event (deliver, back, cut, ...): rapid draws by kind
	Fault  bool
	Do     func()
	format string
	args   []any
}

// Name says what happens, for traces. It is formatted only when asked for:
// a scheduler lists many events and takes one.
func (e Event) Name() string { return e.Kind + ": " + fmt.Sprintf(e.format, e.args...) }

// EventOptions say which faults a scheduler may choose.
type EventOptions struct {
	Faults bool // cancels, corruption, cuts, crashes and clock jumps; off while draining
	// Crashable says whether prefill node i may crash (nil: none may).
	Crashable func(i int) bool
	// Restarts lets a crashed prefill node restart under a new incarnation.
	Restarts bool
	// DecodeRestarts lets a decode node crash and restart at once under a
	// new incarnation.
	DecodeRestarts bool
	// TimeJump is how far a clock jump moves the clock; 0 means a minute.
	TimeJump time.Duration
}

// Events lists what can happen now: the protocol's own events, and the
// faults that opts allows. Every event keeps the network's invariants; the
// scheduler decides their order.
func (n *Network) Events(opts EventOptions) (proto, faults []Event) {
	add := func(list *[]Event, kind string, fault bool, do func(), format string, a ...any) {
		*list = append(*list, Event{Kind: kind, Fault: fault, Do: do, format: format, args: a})
	}
	for _, id := range n.active {
		q := n.reqs[id]
		// An engine computes only while the request is live on its node: once
		// the sender reported an outcome, its source pages may be someone else's.
		// With StreamPages it computes a page at a time (a streaming
		// prefill's chunk of one), so WRITEs interleave with the computation.
		if q.Src != nil && !q.Computed && !q.PrefillEnded && !n.prefill[q.Prefill].Crashed {
			if n.StreamPages {
				add(&proto, "compute", false, func() { n.ComputePages(q.ID, q.ComputedPages+1) }, "%s computes r%d's page %d", n.prefill[q.Prefill].Name, q.ID, q.ComputedPages)
			} else {
				add(&proto, "compute", false, func() { n.Compute(q.ID) }, "%s computes r%d", n.prefill[q.Prefill].Name, q.ID)
			}
		}
	}
	for _, p := range n.Prefill {
		if len(p.Inbox) > 0 && !p.Crashed {
			add(&proto, "router", false, func() { n.DeliverRouter(p.ID) }, "%s receives the router's %v", p.Name, p.Inbox[0])
		}
	}
	for _, d := range n.Decode {
		if len(d.Inbox) > 0 {
			add(&proto, "router", false, func() { n.DeliverRouter(d.ID) }, "%s receives the router's %v", d.Name, d.Inbox[0])
		}
	}
	for _, qp := range n.QPs {
		if len(qp.Fwd) > 0 {
			op := qp.Fwd[0]
			add(&proto, "deliver", false, func() { n.Deliver(qp) }, "%s delivers %v", qp.Name(), opText(op))
			if op.Write != nil && opts.Faults && !qp.corrupt[op.Write.ID] {
				add(&faults, "corrupt", true, func() { n.CorruptNext(qp) }, "FAULT %v is corrupted in transit", opText(op))
			}
		}
		if len(qp.Back) > 0 && !qp.Prefill.Crashed {
			m := qp.Back[0]
			add(&proto, "back", false, func() { n.DeliverBack(qp) }, "%s receives %s r%d", qp.Name(), m.Type(), protocol.RequestOf(m))
		}
		if opts.Faults && !qp.Prefill.Crashed && (len(qp.Fwd) > 0 || len(qp.Back) > 0) {
			add(&faults, "cut", true, func() { n.Cut(qp) }, "FAULT queue pair %s breaks", qp.Name())
		}
	}
	for i, p := range n.Prefill {
		if p.Crashed && !n.lost(p.ID) {
			add(&proto, "detect", false, func() { n.Detect(p.ID) }, "the router finds %s gone", p.Name)
		}
		if opts.Faults && !p.Crashed && opts.Crashable != nil && opts.Crashable(i) {
			add(&faults, "crash", true, func() { n.Crash(p) }, "FAULT %s crashes", p.Name)
		}
		if opts.Faults && p.Crashed && opts.Restarts {
			add(&faults, "restart", true, func() { n.Restart(p) }, "FAULT %s restarts", p.Name)
		}
	}
	for _, d := range n.Decode {
		if opts.Faults && opts.DecodeRestarts {
			add(&faults, "decode-restart", true, func() { n.RestartDecode(d) }, "FAULT %s crashes and restarts", d.Name)
		}
		if len(d.Verified) > 0 {
			add(&proto, "acquire", false, func() { n.Acquire(d) }, "%s acquires r%d", d.Name, d.Verified[0])
		}
		if len(d.Reading) > 0 {
			add(&proto, "finish", false, func() { n.Finish(d) }, "%s finishes r%d", d.Name, d.Reading[0])
		}
	}
	if opts.Faults {
		for _, id := range n.active {
			if q := n.reqs[id]; !q.Decided {
				add(&faults, "cancel", true, func() { n.Cancel(q.ID) }, "FAULT client cancels r%d", q.ID)
			}
		}
		jump := opts.TimeJump
		if jump == 0 {
			jump = time.Minute
		}
		add(&faults, "timeout", true, func() { n.Advance(jump) }, "FAULT time jumps %v", jump)
	}
	return proto, faults
}

// lost says whether the router has been told node is lost.
func (n *Network) lost(node protocol.NodeID) bool {
	for _, l := range n.Router.Nodes() {
		if l.Info.ID == node {
			return false
		}
	}
	return true
}

// over says nothing more can happen to q: the client has its outcome, and
// each leg that started has ended (or its node crashed).
func (q *Request) over(n *Network) bool {
	if !q.Decided || q.Src != nil && !q.PrefillEnded || len(q.Granted) > 0 && !q.DecodeEnded {
		return false
	}
	// A dispatch still on its way, or a message about q still queued, may
	// yet do something: only a request no node holds is over.
	return q.Prefill == 0 || q.PrefillEnded || n.prefill[q.Prefill].Crashed
}

// Run delivers everything, one item at a time, until nothing is left:
// messages back to prefill first, then the forward direction, then reads
// of what is verified, then the router's messages (so that a cancel still
// on its way arrives last). It says whether it settled (false: still busy
// after 100,000 steps).
func (n *Network) Run() bool {
	for range 100000 {
		if !n.runOne() {
			return true
		}
	}
	return false
}

func (n *Network) runOne() bool {
	for _, q := range n.QPs {
		if len(q.Back) > 0 && !q.Prefill.Crashed {
			n.DeliverBack(q)
			return true
		}
	}
	for _, q := range n.QPs {
		if len(q.Fwd) > 0 {
			n.Deliver(q)
			return true
		}
	}
	for _, d := range n.Decode {
		if len(d.Verified) > 0 {
			n.Read(d.Verified[0])
			return true
		}
	}
	for _, p := range n.Prefill {
		if len(p.Inbox) > 0 && !p.Crashed {
			n.DeliverRouter(p.ID)
			return true
		}
	}
	for _, d := range n.Decode {
		if len(d.Inbox) > 0 {
			n.DeliverRouter(d.ID)
			return true
		}
	}
	return false
}

// authorize is a decode node's Authorize with the prefix cache on: a
// Bootstrap must carry the scope and chain the network dispatched for its
// request, as the router's ticket binds them in a deployment.
func (n *Network) authorize(_ protocol.PeerID, b *protocol.Bootstrap) error {
	q := n.reqs[b.Request]
	if q == nil {
		return fmt.Errorf("protocoltest: r%d was never dispatched", b.Request)
	}
	if b.Scope != q.Scope {
		return fmt.Errorf("protocoltest: r%d claims scope %d, dispatched in %d", b.Request, b.Scope, q.Scope)
	}
	if q.Scope != 0 {
		want := protocol.PrefixChain(q.Prompt, n.pageTokens(q.Prefill))
		if len(want) != len(b.Chain) {
			return fmt.Errorf("protocoltest: r%d's chain differs from its prompt's", b.Request)
		}
		for i := range want {
			if want[i] != b.Chain[i] {
				return fmt.Errorf("protocoltest: r%d's chain differs from its prompt's", b.Request)
			}
		}
	}
	return nil
}
