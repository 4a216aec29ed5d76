package model

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/protocol/checksum"
)

// SimConfig is one simulated deployment: a protocol.Router, prefill nodes and
// one decode node joined by in-memory queue pairs, a stream of requests, and
// faults.
type SimConfig struct {
	Seed         uint64
	Requests     int     // requests in the run; 0 means 24
	Senders      int     // prefill nodes; 0 means 2
	DecodePages  int     // 0 means 24
	PrefillPages int     // per prefill node; 0 means 12 (its intake limit: PrefillPages*PageTokens)
	PageTokens   int     // 0 means 4
	PageBytes    int     // 0 means 64
	FaultRate    float64 // chance that a step is a fault; 0 means 0.03
	Bugs         research.Switches
}

func (c *SimConfig) defaults() {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&c.Requests, 24)
	def(&c.Senders, 2)
	def(&c.DecodePages, 24)
	def(&c.PrefillPages, 12)
	def(&c.PageTokens, 4)
	def(&c.PageBytes, 64)
	if c.FaultRate == 0 {
		c.FaultRate = 0.03
	}
}

// Client-visible outcomes, as the router reports them.
const (
	OutcomeOK        = "ok"
	OutcomeRejected  = "rejected"
	OutcomeCancelled = "cancelled"
	OutcomeFailed    = "failed"
)

// Violation is the first property a run broke.
type Violation struct {
	Property string `json:"property"`
	Detail   string `json:"detail"`
	Step     int    `json:"step"`
}

// SimResult is one seed's run.
type SimResult struct {
	Seed        uint64
	Requests    int
	Outcomes    map[string]int // client-visible outcomes
	FailedBy    map[string]int // failed requests by the error that decided them
	Violation   *Violation
	PagesLeaked int      // decode and prefill pages not free at the end
	Trace       []string // every step, for replaying a failure by eye
}

// mem is a node's KV memory.
type mem struct{ payload, tags [][]byte }

func newMem(pages, size int, tenant bool) *mem {
	m := &mem{}
	var tenantKey *protocol.TagKey // the earlier tenant came over prefill node 0's queue pair
	if tenant {
		tenantKey = queuePairKey(0)
	}
	for i := 0; i < pages; i++ {
		kv := make([]byte, size)
		var tag []byte
		if tenant { // an earlier tenant's KV with its valid tag record: pages are never zeroed
			for j := range kv {
				kv[j] = byte(0xE0 ^ i ^ j)
			}
			tag = protocol.Tag{Request: 1 << 40, Index: uint32(i), Tokens: 1, Sum: checksum.Sum(kv)}.Append(nil, tenantKey)
		} else {
			tag = make([]byte, protocol.TagSize)
		}
		m.payload, m.tags = append(m.payload, kv), append(m.tags, tag)
	}
	return m
}

func (m *mem) Page(p uint32) []byte      { return m.payload[p] }
func (m *mem) Payload(p uint32) []byte   { return m.payload[p] }
func (m *mem) TagRecord(p uint32) []byte { return m.tags[p] }

// pattern is request id's KV for page i: recognisable, so a read of anything
// else is caught.
func pattern(id protocol.RequestID, i, size int) []byte {
	b := make([]byte, size)
	for j := range b {
		b[j] = byte(uint64(id)*131 + uint64(i)*17 + uint64(j))
	}
	return b
}

type simReq struct {
	id         protocol.RequestID
	sender     int // the prefill node the router chose; -1 before
	tokens     int
	submitted  bool
	src        []uint32
	computed   bool
	granted    []protocol.PageRef
	sOut, rOut bool // each node reported
	client     string
	read       bool // decode read it and checked its bytes
}

// routerMsg is a message from the router to a node: a dispatch (prefill
// nodes), a cancel of one leg, or the news that a prefill node is lost
// (decode). Each node's messages travel in order.
type routerMsg struct {
	kind   routerMsgKind
	id     protocol.RequestID
	tokens int
	peer   protocol.PeerID // dispatch: the decode node; peer lost: the lost node
}

type routerMsgKind uint8

const (
	msgDispatch routerMsgKind = iota
	msgCancel
	msgPeerLost
)

func (m routerMsg) String() string {
	switch m.kind {
	case msgDispatch:
		return fmt.Sprintf("dispatch of r%d (%d tokens)", m.id, m.tokens)
	case msgCancel:
		return fmt.Sprintf("cancel of r%d", m.id)
	}
	return fmt.Sprintf("news that prefill %d is lost", m.peer)
}

// decodeID names the decode node; prefill node k is protocol.PeerID(k).
const decodeID = protocol.PeerID(1000)

// routerTimeout fails a request the router has had this long without an
// outcome: past the decode node's timeout, so both paths are exercised.
const routerTimeout = 90 * time.Second

type world struct {
	cfg       SimConfig
	pick      func(n int) int // every choice the world makes: seeded, or drawn by rapid
	now       time.Time
	step      int
	senders   []*protocol.Sender
	src       []*mem
	crashed   []bool
	detected  []bool
	recv      *protocol.Receiver
	dst       *mem
	fwd       [][]protocol.Op   // per sender: posted on its queue pair, not yet placed or delivered
	back      [][]protocol.Send // per sender: decode's messages to it
	corrupt   map[uint64]bool   // WRITEs to corrupt in transit
	router    *protocol.Router
	toPrefill [][]routerMsg // per prefill node: the router's messages to it
	toDecode  []routerMsg
	reqs      []*simReq
	next      int // next request to submit
	drainAt   int // the step from which no more faults happen
	verified  []protocol.RequestID
	reading   []protocol.RequestID
	res       *SimResult
}

// Simulate runs one seed: a random workload, interleaving and faults, with the
// spec's properties checked after every step, then a fault-free drain that
// checks termination and that every page comes back. The same seed replays
// the same run.
func Simulate(cfg SimConfig) *SimResult {
	cfg.defaults()
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x6b76))
	limit := cfg.PrefillPages * cfg.PageTokens
	tokens := make([]int, cfg.Requests)
	for i := range tokens {
		// Mostly short prompts, some long, and about one in ten over the
		// prefill pool (the incident's over-long ones), which decode could hold.
		switch x := rng.IntN(20); {
		case x < 15:
			tokens[i] = 1 + rng.IntN(3*cfg.PageTokens)
		case x < 18:
			tokens[i] = 1 + rng.IntN(limit)
		case x == 18 && rng.IntN(4) == 0:
			// Over every pool: the router's own intake rejects it.
			tokens[i] = cfg.DecodePages*cfg.PageTokens + 1 + rng.IntN(limit)
		default:
			tokens[i] = limit + 1 + rng.IntN(min(limit, cfg.DecodePages*cfg.PageTokens-limit))
		}
	}
	w := newWorld(cfg, tokens, rng.IntN)
	w.run(rng)
	return w.res
}

// queuePairKey is the tag key of the queue pair between prefill node peer and
// the decode node, the same for both ends: derived from the peer, so that
// every seed replays, and different per queue pair, as in a deployment.
func queuePairKey(peer protocol.PeerID) *protocol.TagKey {
	secret := sha256.Sum256(fmt.Appendf(nil, "kvhandoff sim queue pair %d", peer))
	k, err := protocol.NewTagKey(secret[:], protocol.SumXXH3)
	if err != nil {
		panic(err) // a 32-byte secret is always valid
	}
	return k
}

// newWorld builds the deployment with one request per entry of tokens.
func newWorld(cfg SimConfig, tokens []int, pick func(int) int) *world {
	w := &world{cfg: cfg, pick: pick, now: time.Unix(1_000_000, 0),
		corrupt: map[uint64]bool{},
		res:     &SimResult{Seed: cfg.Seed, Requests: len(tokens), Outcomes: map[string]int{}, FailedBy: map[string]int{}}}
	w.router = protocol.NewRouter(protocol.RouterConfig{Timeout: routerTimeout, Research: cfg.Bugs})
	must := func(err error) {
		if err != nil {
			panic(err) // the defaults are valid; a bad config is a programming error here
		}
	}
	// The tag key of the queue pair between prefill node k and the decode
	// node: the sender knows it as its key for decodeID, the receiver as its
	// key for k.
	keys := make([]*protocol.TagKey, cfg.Senders)
	for k := range keys {
		keys[k] = queuePairKey(protocol.PeerID(k))
	}
	for k := 0; k < cfg.Senders; k++ {
		// Each prefill node advertises decode's pool, not its own, as the
		// incident's did: so the router lets over-long prompts through and
		// each node's own intake is exercised.
		must(w.router.AddNode(protocol.NodeInfo{ID: protocol.PeerID(k), Role: protocol.RolePrefill,
			PoolPages: cfg.DecodePages, PageTokens: cfg.PageTokens}))
		m := newMem(cfg.PrefillPages, cfg.PageBytes, false)
		s, err := protocol.NewSender(protocol.SenderConfig{Pages: cfg.PrefillPages, PageTokens: cfg.PageTokens, MaxInFlight: 2, Memory: m, Research: cfg.Bugs,
			TagKeys: func(peer protocol.PeerID) *protocol.TagKey {
				if peer != decodeID {
					return nil
				}
				return keys[k]
			}})
		if err != nil {
			panic(err) // the defaults are valid; a bad config is a programming error here
		}
		w.senders, w.src = append(w.senders, s), append(w.src, m)
	}
	must(w.router.AddNode(protocol.NodeInfo{ID: decodeID, Role: protocol.RoleDecode, PoolPages: cfg.DecodePages, PageTokens: cfg.PageTokens}))
	w.toPrefill = make([][]routerMsg, cfg.Senders)
	w.crashed, w.detected = make([]bool, cfg.Senders), make([]bool, cfg.Senders)
	w.fwd, w.back = make([][]protocol.Op, cfg.Senders), make([][]protocol.Send, cfg.Senders)
	w.dst = newMem(cfg.DecodePages, cfg.PageBytes, true)
	var err error
	w.recv, err = protocol.NewReceiver(protocol.ReceiverConfig{Pages: cfg.DecodePages, PageTokens: cfg.PageTokens,
		Slots: cfg.DecodePages, Timeout: 10 * time.Second, Memory: w.dst,
		TagKeys: func(peer protocol.PeerID) *protocol.TagKey {
			if int(peer) >= len(keys) {
				return nil
			}
			return keys[peer]
		},
		Region: func(p uint32) (uint64, uint32) { return uint64(p) << 20, 0x1000 }, Research: cfg.Bugs})
	if err != nil {
		panic(err)
	}
	for i, t := range tokens {
		w.reqs = append(w.reqs, &simReq{id: protocol.RequestID(i + 1), tokens: t, sender: -1})
	}
	return w
}

// event is one enabled step; kind groups events for the rapid state machine.
type event struct {
	kind, name string
	do         func()
}

func (w *world) run(rng *rand.Rand) {
	const maxSteps = 20000
	for w.step = 0; w.step < maxSteps && w.res.Violation == nil; w.step++ {
		draining := w.next == len(w.reqs) && w.step >= w.drainAt
		protocolEvents, faults := w.events(draining)
		var e event
		switch {
		case len(faults) > 0 && (len(protocolEvents) == 0 || rng.Float64() < w.cfg.FaultRate):
			e = faults[rng.IntN(len(faults))]
		case len(protocolEvents) > 0:
			e = protocolEvents[rng.IntN(len(protocolEvents))]
		default:
			w.finish()
			return
		}
		w.apply(e)
	}
	if w.res.Violation == nil {
		w.violate("Termination", "still running after %d steps", maxSteps)
	}
}

// apply runs one event and checks the safety properties after it.
func (w *world) apply(e event) {
	w.res.Trace = append(w.res.Trace, fmt.Sprintf("%4d %s", w.step, e.name))
	e.do()
	w.collect()
	w.audit()
}

func (w *world) violate(prop, format string, a ...any) {
	if w.res.Violation == nil {
		w.res.Violation = &Violation{Property: prop, Detail: fmt.Sprintf(format, a...), Step: w.step}
	}
}

// events lists what can happen now: protocol events, and faults unless draining.
func (w *world) events(draining bool) (proto, faults []event) {
	add := func(list *[]event, name string, do func()) {
		*list = append(*list, event{kind: strings.TrimSuffix(strings.Fields(name)[0], ":"), name: name, do: do})
	}
	if w.next < len(w.reqs) {
		q := w.reqs[w.next]
		add(&proto, fmt.Sprintf("submit r%d (%d tokens)", q.id, q.tokens), func() { w.submit(q) })
	}
	for _, q := range w.reqs {
		// An engine computes only while the request is live on its node: once
		// the sender reported an outcome, its source pages may be someone else's.
		if q.src != nil && !q.computed && !q.sOut && !w.crashed[q.sender] {
			add(&proto, fmt.Sprintf("compute: prefill %d computes r%d", q.sender, q.id), func() { w.compute(q) })
		}
	}
	for k := range w.senders {
		if len(w.fwd[k]) > 0 {
			op := w.fwd[k][0]
			name := fmt.Sprintf("deliver: queue pair %d delivers %s", k, describe(op))
			add(&proto, name, func() { w.deliver(k) })
			if op.Write != nil && !draining {
				add(&faults, "corrupt: FAULT "+describe(op)+" is corrupted in transit", func() { w.corrupt[op.Write.ID] = true })
			}
		}
		if len(w.back[k]) > 0 && !w.crashed[k] {
			m := w.back[k][0].Msg
			add(&proto, fmt.Sprintf("back: prefill %d receives %s r%d", k, m.Type(), protocol.RequestOf(m)), func() { w.deliverBack(k) })
		}
		if w.crashed[k] && !w.detected[k] {
			add(&proto, fmt.Sprintf("detect: the router finds prefill %d gone", k), func() { w.detect(k) })
		}
		if len(w.toPrefill[k]) > 0 && !w.crashed[k] {
			add(&proto, fmt.Sprintf("router: prefill %d receives the router's %v", k, w.toPrefill[k][0]), func() { w.deliverRouter(k) })
		}
		if !draining && !w.crashed[k] && (len(w.fwd[k]) > 0 || len(w.back[k]) > 0) {
			add(&faults, fmt.Sprintf("cut: FAULT queue pair %d breaks", k), func() { w.cut(k) })
		}
		if !draining && !w.crashed[k] && k > 0 { // prefill 0 stays up, so the workload can finish
			add(&faults, fmt.Sprintf("crash: FAULT prefill %d crashes", k), func() { w.crash(k) })
		}
	}
	if len(w.toDecode) > 0 {
		add(&proto, fmt.Sprintf("router: decode receives the router's %v", w.toDecode[0]), func() { w.deliverRouter(-1) })
	}
	if len(w.verified) > 0 {
		add(&proto, fmt.Sprintf("acquire: decode acquires r%d", w.verified[0]), func() { w.acquire() })
	}
	if len(w.reading) > 0 {
		add(&proto, fmt.Sprintf("finish: decode finishes r%d", w.reading[0]), func() { w.finishRead() })
	}
	if !draining {
		for _, q := range w.reqs {
			if q.submitted && q.client == "" {
				add(&faults, fmt.Sprintf("cancel: FAULT client cancels r%d", q.id), func() { w.cancel(q) })
			}
		}
		add(&faults, "timeout: FAULT time jumps past every timeout", func() {
			w.now = w.now.Add(time.Minute)
			w.recv.Tick(w.now)
			w.router.Tick(w.now)
		})
	}
	return proto, faults
}

func describe(op protocol.Op) string {
	if w := op.Write; w != nil {
		return fmt.Sprintf("WRITE r%d[%d] -> page %d@%d", w.Request, w.Index, w.Remote.Page, w.Remote.Epoch)
	}
	return fmt.Sprintf("%s r%d", op.Msg.Type(), protocol.RequestOf(op.Msg))
}

func (w *world) req(id protocol.RequestID) *simReq { return w.reqs[id-1] }

// decide records the client's outcome, which the router reports: exactly
// once per request.
func (w *world) decide(q *simReq, err error) {
	if q.client != "" {
		w.violate("OneOutcome", "the router reported r%d twice: %s, then %v", q.id, q.client, err)
		return
	}
	q.client = OutcomeOK
	if err != nil {
		q.client = clientOutcome(err)
	}
	switch {
	case q.client == OutcomeFailed:
		w.res.FailedBy[failReason(err)]++
	case q.client == OutcomeOK && !q.read:
		w.violate("HonestOutcome", "the router reported r%d ok without a checked read", q.id)
	}
}

// failReason names the protocol error behind a failure.
func failReason(err error) string {
	if errors.Is(err, protocol.ErrNodeLost) || errors.Is(err, protocol.ErrNoNode) {
		return "prefill node lost"
	}
	for _, e := range []error{protocol.ErrNoCapacity, protocol.ErrTimedOut, protocol.ErrPeerFailed, protocol.ErrTokenMismatch,
		protocol.ErrTagMismatch, protocol.ErrTagMalformed, protocol.ErrChecksumMismatch, protocol.ErrFenced} {
		if errors.Is(err, e) {
			return strings.TrimPrefix(e.Error(), "protocol: ")
		}
	}
	return "other"
}

func (w *world) submit(q *simReq) {
	w.next++
	q.submitted = true
	if w.next == len(w.reqs) {
		w.drainAt = w.step + w.pick(100) // faults stop at a random point after the last request
	}
	_, err := w.router.Submit(q.id, q.tokens, w.now)
	switch {
	case err == nil: // the dispatch travels with the router's effects
	case errors.Is(err, protocol.ErrRejected):
		w.decide(q, err)
		if q.tokens <= w.router.Limit() {
			w.violate("HonestOutcome", "the router rejected r%d of %d tokens although the deployment takes %d: %v", q.id, q.tokens, w.router.Limit(), err)
		}
	default: // every prefill node is lost: an explicit failure
		w.decide(q, err)
	}
}

// intake is prefill node k taking a dispatch from the router.
func (w *world) intake(k int, m routerMsg) {
	q := w.req(m.id)
	q.sender = k
	src, err := w.senders[k].Submit(q.id, m.peer, m.tokens)
	if err != nil {
		// The node's own intake refused it: rejected for good, or its pool is busy.
		q.sOut = true
		if errors.Is(err, protocol.ErrRejected) && q.tokens <= w.cfg.PrefillPages*w.cfg.PageTokens {
			w.violate("HonestOutcome", "prefill %d rejected r%d of %d tokens although it fits: %v", k, q.id, q.tokens, err)
		}
		w.legEnded(protocol.PeerID(k), q.id, err)
		return
	}
	q.src = src
}

func (w *world) compute(q *simReq) {
	for i, p := range q.src {
		copy(w.src[q.sender].payload[p], pattern(q.id, i, w.cfg.PageBytes))
	}
	q.computed = true
	if err := w.senders[q.sender].Computed(q.id); err != nil {
		w.violate("NoProtocolError", "Computed(r%d): %v", q.id, err)
	}
}

// deliver places the WRITE, or delivers the SEND, at the head of queue pair k.
func (w *world) deliver(k int) {
	op := w.fwd[k][0]
	w.fwd[k] = w.fwd[k][1:]
	if wr := op.Write; wr != nil {
		// NoForeignWrite: never into a page another request holds.
		for _, q := range w.reqs {
			if q.id != wr.Request && w.recv.Pool().Holds(q.id, protocol.PageRef{Page: wr.Remote.Page, Epoch: w.recv.Pool().Epoch(wr.Remote.Page)}) {
				w.violate("NoForeignWrite", "WRITE of r%d landed in page %d, which r%d holds", wr.Request, wr.Remote.Page, q.id)
			}
		}
		payload := w.dst.payload[wr.Remote.Page]
		copy(payload, w.src[k].payload[wr.Source]) // the NIC reads the source page now
		if w.corrupt[wr.ID] {
			payload[len(payload)/2] ^= 0x40
		}
		copy(w.dst.tags[wr.Remote.Page], wr.Tag)
		if !w.crashed[k] {
			if err := w.senders[k].Completed(wr.ID, nil); err != nil {
				w.violate("NoProtocolError", "Completed: %v", err)
			}
		}
		return
	}
	if err := w.recv.Step(protocol.PeerID(k), op.Msg, w.now); err != nil {
		w.violate("NoProtocolError", "decode refused %s from prefill %d: %v", describe(op), k, err)
	}
}

func (w *world) deliverBack(k int) {
	m := w.back[k][0].Msg
	w.back[k] = w.back[k][1:]
	if err := w.senders[k].Step(decodeID, m); err != nil {
		w.violate("NoProtocolError", "prefill %d refused %s r%d: %v", k, m.Type(), protocol.RequestOf(m), err)
	}
}

// deliverRouter hands the head of the router's messages to prefill node k,
// or to decode for k < 0.
func (w *world) deliverRouter(k int) {
	var m routerMsg
	if k < 0 {
		m, w.toDecode = w.toDecode[0], w.toDecode[1:]
		switch m.kind {
		case msgCancel:
			w.recv.Cancel(m.id)
		case msgPeerLost:
			w.recv.PeerFailed(m.peer)
		}
		return
	}
	m, w.toPrefill[k] = w.toPrefill[k][0], w.toPrefill[k][1:]
	switch m.kind {
	case msgDispatch:
		w.intake(k, m)
	case msgCancel:
		w.senders[k].Cancel(m.id)
	}
}

// cancel is the client going away.
func (w *world) cancel(q *simReq) {
	if err := w.router.Cancel(q.id); err != nil {
		w.violate("NoProtocolError", "the router refused the cancel of r%d: %v", q.id, err)
	}
}

func (w *world) acquire() {
	id := w.verified[0]
	w.verified = w.verified[1:]
	q := w.req(id)
	refs, err := w.recv.Acquire(id)
	if err != nil {
		return // an explicit error: the outcome comes through Effects
	}
	for i, ref := range refs {
		if !bytes.Equal(w.dst.payload[ref.Page], pattern(id, i, w.cfg.PageBytes)) {
			w.violate("Isolation", "decode read page %d for r%d[%d], and it holds KV r%d did not write", ref.Page, id, i, id)
			return
		}
	}
	if len(refs) != (q.tokens+w.cfg.PageTokens-1)/w.cfg.PageTokens {
		w.violate("HonestOutcome", "r%d has %d tokens but decode read %d pages", id, q.tokens, len(refs))
	}
	q.read = true
	w.reading = append(w.reading, id)
}

func (w *world) finishRead() {
	id := w.reading[0]
	w.reading = w.reading[1:]
	if err := w.recv.Finish(id); err != nil {
		w.violate("NoProtocolError", "Finish(r%d): %v", id, err)
	}
}

// cut breaks queue pair k: both directions flush, both ends learn.
func (w *world) cut(k int) {
	w.fwd[k], w.back[k] = nil, nil
	w.recv.QueuePairFenced(protocol.PeerID(k))
	if !w.crashed[k] {
		w.senders[k].Flushed(decodeID)
	}
}

func (w *world) crash(k int) {
	w.crashed[k] = true
	w.back[k] = nil // what the dead node's WRITEs and SENDs put on the wire can still land
	w.toPrefill[k] = nil
	for _, q := range w.reqs {
		if q.sender == k && !q.sOut {
			q.sOut = true // the node is gone: it will never report
		}
	}
}

// detect: the registry's lease on the dead node expires, and the router
// hears of it: it fails what it dispatched there and tells decode, which
// asks for the cut.
func (w *world) detect(k int) {
	w.detected[k] = true
	if err := w.router.NodeLost(protocol.PeerID(k)); err != nil {
		w.violate("NoProtocolError", "NodeLost(%d): %v", k, err)
	}
}

// legEnded relays a node's outcome to the router.
func (w *world) legEnded(node protocol.PeerID, id protocol.RequestID, err error) {
	if rerr := w.router.LegEnded(node, id, err); rerr != nil {
		w.violate("NoProtocolError", "the router refused node %d's outcome for r%d: %v", node, id, rerr)
	}
}

// collect carries the nodes' effects onto the wires and their outcomes to
// the router, and the router's effects to the nodes and the clients.
func (w *world) collect() {
	for k, s := range w.senders {
		e := s.Effects()
		if w.crashed[k] {
			continue
		}
		w.fwd[k] = append(w.fwd[k], e.Ops...)
		for _, o := range e.Outcomes {
			q := w.req(o.Request)
			if q.sOut {
				w.violate("OneOutcome", "prefill %d reported r%d twice", k, o.Request)
			}
			q.sOut = true
			w.legEnded(protocol.PeerID(k), o.Request, o.Err)
		}
	}
	e := w.recv.Effects()
	for _, s := range e.Sends {
		if g, ok := s.Msg.(*protocol.Grant); ok {
			q := w.req(g.Request)
			for _, p := range g.Pages {
				q.granted = append(q.granted, protocol.PageRef{Page: p.Page, Epoch: p.Epoch})
			}
		}
		if k := int(s.Peer); !w.crashed[k] {
			w.back[k] = append(w.back[k], s)
		}
	}
	w.verified = append(w.verified, e.Verified...)
	for _, o := range e.Outcomes {
		q := w.req(o.Request)
		if q.rOut {
			w.violate("OneOutcome", "decode reported r%d twice", o.Request)
		}
		q.rOut = true
		if o.Err == nil && !q.read {
			w.violate("HonestOutcome", "decode reported r%d ok without a checked read", o.Request)
		}
		w.legEnded(decodeID, o.Request, o.Err)
	}
	re := w.router.Effects()
	for _, d := range re.Dispatches {
		if k := int(d.Prefill); !w.crashed[k] { // a crashed node drops what it is sent
			w.toPrefill[k] = append(w.toPrefill[k], routerMsg{kind: msgDispatch, id: d.Request, tokens: d.Tokens, peer: d.Decode})
		}
	}
	for _, c := range re.Cancels {
		m := routerMsg{kind: msgCancel, id: c.Request}
		if c.Node == decodeID {
			w.toDecode = append(w.toDecode, m)
		} else if k := int(c.Node); !w.crashed[k] {
			w.toPrefill[k] = append(w.toPrefill[k], m)
		}
	}
	for _, l := range re.PeerLost {
		w.toDecode = append(w.toDecode, routerMsg{kind: msgPeerLost, peer: l.Peer})
	}
	for _, o := range re.Outcomes {
		w.decide(w.req(o.Request), o.Err)
	}
	for _, k := range e.Cuts {
		w.cut(int(k))
		w.collect()
	}
	if len(re.Dispatches)+len(re.Cancels)+len(re.PeerLost)+len(re.Outcomes) > 0 {
		w.collect() // the router's decisions may have made more
	}
}

func clientOutcome(err error) string {
	switch {
	case errors.Is(err, protocol.ErrRejected):
		return OutcomeRejected
	case errors.Is(err, protocol.ErrCancelled):
		return OutcomeCancelled
	}
	return OutcomeFailed
}

// audit checks Conservation after every step: both pools' own bookkeeping,
// and every request that decode still works on holds every page it was granted.
func (w *world) audit() {
	if err := w.recv.Pool().Audit(); err != nil {
		w.violate("Conservation", "decode %v", err)
	}
	for k, s := range w.senders {
		if err := s.Pool().Audit(); err != nil && !w.crashed[k] {
			w.violate("Conservation", "prefill %d %v", k, err)
		}
	}
	for _, q := range w.reqs {
		if q.granted == nil || q.rOut {
			continue
		}
		for _, ref := range q.granted {
			if !w.recv.Pool().Holds(q.id, ref) {
				w.violate("Conservation", "r%d is live on decode but page %d@%d is no longer its", q.id, ref.Page, ref.Epoch)
			}
		}
	}
}

// finish runs when nothing is left to happen: Termination and NoLeak.
func (w *world) finish() {
	for _, q := range w.reqs {
		switch {
		case q.client == "":
			w.violate("Termination", "r%d has no outcome", q.id)
		case q.granted != nil && !q.rOut:
			w.violate("Termination", "r%d never ended on decode", q.id)
		case q.src != nil && !q.sOut && !w.crashed[q.sender]:
			w.violate("Termination", "r%d never ended on prefill %d", q.id, q.sender)
		}
		w.res.Outcomes[q.client]++
	}
	leaked := w.recv.Pool().Len() - w.recv.Pool().Free()
	for k, s := range w.senders {
		if !w.crashed[k] {
			leaked += s.Pool().Len() - s.Pool().Free()
		}
	}
	w.res.PagesLeaked = leaked
	for _, n := range w.router.Nodes() {
		if n.Requests > 0 {
			w.violate("Termination", "the router still counts %d requests on node %d: their outcomes never reached it", n.Requests, n.Info.ID)
		}
	}
	if leaked > 0 {
		w.violate("NoLeak", "%d pages still held at quiescence", leaked)
	}
}
