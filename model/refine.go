package model

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/protocol/checksum"
	"github.com/kvhandoff/kvhandoff/protocol/protocoltest"
	"github.com/kvhandoff/kvhandoff/spec"
)

// Refinement runs the implementation beside the spec, one spec action at a
// time: the real protocol.Router, protocol.Sender (one prefill node) and
// protocol.Receiver (the decode node), over an in-memory queue pair and
// in-memory RDMA whose every placement the harness performs, and in-memory
// queues from the router to each node. After every step it maps the
// implementation's state to the spec's (View) and fails on any difference;
// the spec's properties are then evaluated on the spec state, which the
// mapping has just shown equal.
//
// The router's part of the view is each request's client-visible outcome
// and reason (Router.Request) and the router's messages to each node in
// order (Dispatch as the spec's Prefill, CancelLeg as Abort, PeerLost as
// PeerFailed). The spec's router checks only the advertised context length,
// so the harness advertises both nodes as taking ContextLimit tokens: the
// Router's intake then decides exactly what the spec's does, and each node's
// own intake is exercised as in the incident. One thing the Router does that
// the spec's router does not: on a failed leg (or a lost node) it also
// cancels the other leg, a second path beside the legs' own Abort and
// AbortAck. The harness checks that each such cancel names a leg of a
// request that has just failed, and does not deliver it (the spec has no
// action for it); the simulation delivers them.
//
// The correspondence, action by action:
//
//	Submit        Router.Submit; its Dispatch on the router→prefill queue
//	PrefillRecv   Sender.Submit, the KV computed, Sender.Computed (or Sender.Cancel for an Abort)
//	PrefillRecvQP Sender.Step with the Grant or Abort at the head of decode→prefill
//	PostWrite     the next WRITE of the request the sender emitted is handed to the wire
//	DecodeRecvQP  the head of the wire: a WRITE placed (payload, then tag record) and
//	              Sender.Completed, or a SEND given to Receiver.Step
//	DecodeRecv    Receiver.Cancel, or Receiver.PeerFailed and the cut it asks for
//	DecodeRead    Receiver.Acquire, the pages read and checked, Receiver.Finish
//	DetectCrash   Router.NodeLost; its PeerLost on the router→decode queue
//	Cancel        Router.Cancel; its CancelLegs on both queues
//	Timeout       Receiver.Expire
//	Cut           both ends fenced: Receiver.QueuePairFenced, Sender.Flushed
//	Crash         the sender is dropped: it is never called again
//
// Two differences of granularity are mapped, not hidden. The Sender emits a
// whole window of WRITEs (and Done behind them) in one step, where the spec
// posts one WRITE per PostWrite: the harness keeps what the Sender emitted as
// its send backlog and hands each operation to the wire when the spec posts
// it, failing if the spec posts something the Sender did not emit, or if the
// Sender emitted a message (not a WRITE, nor what queues behind one) that the
// spec did not send. And the spec lets a reservation take any free pages in
// any order, where the pool takes the most recently freed: the harness picks
// the spec successor whose reservation equals the pool's.
//
// Source pages are compared by content, not by number: the spec's prefill
// node takes the lowest free pages, the Sender's pool the most recently freed.
type Refinement struct {
	m      *spec.Model
	cfg    spec.Config
	s      spec.State
	router *protocol.Router
	snd    *protocol.Sender
	recv   *protocol.Receiver
	src    *protocoltest.Memory
	dst    *protocoltest.Memory
	size   int

	crashed    bool
	staged     []protocol.Op // emitted by the Sender, not yet on the wire
	wire       []wireOp      // prefill→decode on the queue pair: the spec's QP
	back       []protocol.Message
	toPrefill  []spec.Msg // the router's messages, as the spec's
	toDecode   []spec.Msg
	srcPages   [spec.MaxRequests][]uint32
	granted    [spec.MaxRequests][]protocol.PageRef
	readLabels [spec.MaxRequests][]string
	// refused: decode's intake refused the request, which leaves no record there.
	refused [spec.MaxRequests]bool
	sums    map[uint64]spec.Label

	// Faults picks the fault variant (spec.Late, spec.Corrupt bits) of each
	// WRITE the Sender posts, for request r; nil posts every WRITE cleanly.
	// A variant the spec does not allow now (no budget left) is ignored.
	Faults func(r int) uint16

	// Trace is every step taken, for a failure report.
	Trace []string
}

type wireOp struct {
	op     protocol.Op
	damage uint8 // what the corrupt fault damages in transit: spec.DamagedPayload, a tag field, or 0
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

// ErrOutOfBounds says the run left the spec's bounds: a queue of the spec
// reached spec.MaxQueue, where the spec drops the message and flags
// WithinBounds. It is a limit of the model, not a difference: the run ends.
var ErrOutOfBounds = errors.New("the spec's queue bound was reached")

// The nodes' names: the Router's, and each end's for the other.
const (
	prefillPeer = protocol.PeerID(1)
	decodePeer  = protocol.PeerID(2)
)

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
	m, err := spec.New(cfg)
	if err != nil {
		return nil, err
	}
	const size = 64
	h := &Refinement{m: m, cfg: cfg, s: m.Initial()[0], size: size, sums: map[uint64]spec.Label{}}
	h.src = protocoltest.NewMemory(cfg.PrefillPages, size)
	h.dst = protocoltest.NewMemory(cfg.DecodePages, size)
	tenant := spec.Label{Req: spec.Tenant}
	for p := 0; p < cfg.DecodePages; p++ { // an earlier tenant's KV and tag record: pages are never zeroed
		h.fill(h.dst.Payload(uint32(p)), tenant)
		copy(h.dst.TagRecord(uint32(p)), protocol.Tag{Request: tenantID, Tokens: 1, Sum: checksum.Sum(h.dst.Payload(uint32(p)))}.Append(nil, refKey))
	}
	// Both nodes advertise what the spec's router trusts: ContextLimit tokens.
	advertised := protocol.PagesFor(uint32(cfg.ContextLimit), cfg.PageSize)
	h.router = protocol.NewRouter(protocol.RouterConfig{Research: bugs})
	for _, n := range []protocol.NodeInfo{
		{ID: prefillPeer, Role: protocol.RolePrefill, ContextTokens: cfg.ContextLimit, PoolPages: advertised, PageTokens: cfg.PageSize},
		{ID: decodePeer, Role: protocol.RoleDecode, ContextTokens: cfg.ContextLimit, PoolPages: advertised, PageTokens: cfg.PageSize},
	} {
		if err := h.router.AddNode(n); err != nil {
			return nil, err
		}
	}
	if h.snd, err = protocol.NewSender(protocol.SenderConfig{Pages: cfg.PrefillPages, PageTokens: cfg.PageSize,
		MaxInFlight: cfg.MaxInFlight, Memory: h.src, TagKeys: refKeys, Research: bugs}); err != nil {
		return nil, err
	}
	if h.recv, err = protocol.NewReceiver(protocol.ReceiverConfig{Pages: cfg.DecodePages, PageTokens: cfg.PageSize,
		MaxTokens: cfg.DecodeLimit(), Slots: cfg.DecodeSlots, Memory: h.dst, TagKeys: refKeys,
		Region: func(p uint32) (uint64, uint32) { return uint64(p) << 20, 0x1000 }, Research: bugs}); err != nil {
		return nil, err
	}
	return h, h.compare("initial state")
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
	b[0], b[1] = byte(l.Req), byte(l.Index)
	for j := 2; j < len(b); j++ {
		b[j] = byte(int(l.Req)*31 + int(l.Index)*7 + j)
	}
	if l.Corrupt {
		b[len(b)/2] ^= 0x40
	}
	return b
}

// labelOf reads a payload back as a label.
func (h *Refinement) labelOf(b []byte) string {
	l := spec.Label{Req: int8(b[0]), Index: int8(b[1])}
	if bytes.Equal(b, h.bytesOf(l)) {
		return l.String()
	}
	l.Corrupt = true
	if bytes.Equal(b, h.bytesOf(l)) {
		return l.String()
	}
	return fmt.Sprintf("bytes %x...", b[:4])
}

// State is the spec state the implementation is at.
func (h *Refinement) State() *spec.State { return &h.s }

// Model is the spec model.
func (h *Refinement) Model() *spec.Model { return h.m }

// Enabled lists the spec's enabled actions that a driver chooses: not
// PostWrite, which follows the Sender (see Step), and for a reservation one
// action only, since the pool chooses the pages.
func (h *Refinement) Enabled() []spec.Action {
	var out []spec.Action
	seen := map[spec.Action]bool{}
	h.m.Successors(&h.s, func(a spec.Action, _ *spec.State) {
		if a.Kind == spec.PostWrite {
			return
		}
		if a.Kind == spec.DecodeRecvQP {
			a.Arg = 0
		}
		if !seen[a] {
			seen[a] = true
			out = append(out, a)
		}
	})
	return out
}

// Step applies a to both the spec and the implementation and compares them;
// then, for every WRITE the Sender emitted, it takes the spec's PostWrite
// (with the fault variant Faults picks) and compares again. The Sender posts
// eagerly, as soon as its window allows: that is one of the schedules the
// spec allows, so refinement holds if every such step is a spec step.
func (h *Refinement) Step(a spec.Action) error {
	if a.Kind == spec.PostWrite {
		return fmt.Errorf("model: PostWrite follows the sender; drive the other actions")
	}
	if err := h.step(a, func(popped *int) error { return h.apply(a, popped) }); err != nil {
		return err
	}
	if err := h.postBacklog(a); err != nil {
		return err
	}
	// The Sender posts as soon as it may: a WRITE the spec could post now and
	// the Sender has not emitted is a sender that lags behind the spec.
	posts := h.postsEnabled()
	for r := range h.cfg.Prompts {
		if posts[spec.Action{Kind: spec.PostWrite, Req: int8(r)}] {
			return fmt.Errorf("%w after %v: the spec posts r%d's next WRITE now; the sender has not", ErrRefinement, a, r)
		}
	}
	return nil
}

// postBacklog takes the spec's PostWrite for every WRITE the Sender emitted.
func (h *Refinement) postBacklog(a spec.Action) error {
	for len(h.staged) > 0 {
		op := h.staged[0]
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
		if err := h.step(post, func(popped *int) error { return h.apply(post, popped) }); err != nil {
			return err
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
// are handed from the Sender's backlog to the wire, and the views compared.
func (h *Refinement) step(a spec.Action, impl func(popped *int) error) error {
	var next []spec.State
	h.m.Successors(&h.s, func(b spec.Action, n *spec.State) {
		if b == a || a.Kind == spec.DecodeRecvQP && b.Kind == spec.DecodeRecvQP {
			next = append(next, *n)
		}
	})
	if len(next) == 0 {
		return fmt.Errorf("model: %v is not enabled", a)
	}
	h.Trace = append(h.Trace, a.String())
	before := h.s.QP[0][0].Items()
	popped := 0
	if err := impl(&popped); err != nil {
		return err
	}
	chosen := next[0]
	if len(next) > 1 { // a reservation: the spec state whose pages are the pool's
		chosen = spec.State{}
		r := int(a.Req)
		for _, n := range next {
			if h.grantMatches(r, &n) {
				chosen = n
				break
			}
		}
		if !chosen.Req[r].R.Phase.Live() {
			return fmt.Errorf("%w after %v: the pool reserved pages no spec choice reserves: %v", ErrRefinement, a, h.grantOf(r))
		}
	}
	h.s = chosen
	if h.s.Overflow {
		return fmt.Errorf("%w after %v (spec.MaxQueue %d)", ErrOutOfBounds, a, spec.MaxQueue)
	}
	// Whatever the spec put on the queue pair in this step, the harness hands
	// from the Sender's backlog to the wire, in the same order.
	var sent []spec.Msg
	if h.s.QP[0][0].N > 0 {
		kept := len(before) - popped
		if a.Kind == spec.Cut || int(h.s.QP[0][0].N) < kept {
			kept = 0 // the queue pair was cleared
		}
		sent = h.s.QP[0][0].Items()[kept:]
	}
	for _, msg := range sent {
		if err := h.release(msg, msg.Damage); err != nil {
			return fmt.Errorf("%w after %v: %v", ErrRefinement, a, err)
		}
	}
	if len(h.staged) > 0 {
		return nil // the Sender ran ahead: compared once the spec has posted what it emitted
	}
	return h.compare(a.String())
}

// apply does a's part on the implementation's side.
func (h *Refinement) apply(a spec.Action, popped *int) error {
	r := int(a.Req)
	switch a.Kind {
	case spec.Submit:
		h.router.Submit(id(r), h.cfg.Prompts[r], time.Unix(0, 0)) // a refusal is the request's state at the router
		h.routerEffects(a, false)
	case spec.PrefillRecv:
		msg := h.toPrefill[0]
		h.toPrefill = h.toPrefill[1:]
		if msg.Kind == spec.MAbort {
			h.snd.Cancel(id(int(msg.Req)))
			break
		}
		if err := h.intake(int(msg.Req)); err != nil {
			return fmt.Errorf("%w after %v: %v", ErrRefinement, a, err)
		}
	case spec.PrefillRecvQP:
		msg := h.back[0]
		h.back = h.back[1:]
		if err := h.snd.Step(decodePeer, msg); err != nil && !errors.Is(err, protocol.ErrUnknownRequest) {
			return fmt.Errorf("%w after %v: the sender refused %s: %v", ErrRefinement, a, msg.Type(), err)
		}
	case spec.PostWrite:
		if a.Arg&spec.Late == 0 && len(h.wire) == 0 {
			// Nothing ahead of it on the queue pair: the spec places it at once.
			msg := spec.Msg{Kind: spec.MWrite, Req: a.Req, Index: int8(h.s.Req[r].S.Posted)}
			if err := h.release(msg, writeDamage(a.Arg)); err != nil {
				return fmt.Errorf("%w after %v: %v", ErrRefinement, a, err)
			}
			h.deliver()
		}
	case spec.DecodeRecvQP:
		*popped = 1
		h.deliver()
	case spec.DecodeRecv:
		msg := h.toDecode[0]
		h.toDecode = h.toDecode[1:]
		if msg.Kind == spec.MAbort {
			h.recv.Cancel(id(int(msg.Req)))
		} else {
			h.recv.PeerFailed(prefillPeer)
		}
	case spec.DecodeRead:
		if err := h.read(r); err != nil {
			return fmt.Errorf("%w after %v: %v", ErrRefinement, a, err)
		}
	case spec.DetectCrash:
		if err := h.router.NodeLost(prefillPeer); err != nil {
			return fmt.Errorf("%w after %v: %v", ErrRefinement, a, err)
		}
		if err := h.routerEffects(a, false); err != nil {
			return err
		}
	case spec.Cancel:
		if err := h.router.Cancel(id(r)); err != nil {
			return fmt.Errorf("%w after %v: the router refused it: %v", ErrRefinement, a, err)
		}
		if err := h.routerEffects(a, true); err != nil {
			return err
		}
	case spec.Crash:
		h.crashed = true
		h.staged, h.back, h.toPrefill = nil, nil, nil
	case spec.Timeout:
		if err := h.recv.Expire(id(r)); err != nil {
			return fmt.Errorf("%w after %v: %v", ErrRefinement, a, err)
		}
	case spec.Cut:
		h.cut()
	case spec.CorruptSend:
		if a.Arg&spec.SendBack != 0 {
			g, ok := h.back[0].(*protocol.Grant)
			if !ok {
				return fmt.Errorf("%w after %v: the head of decode→prefill is %s, not a Grant", ErrRefinement, a, h.back[0].Type())
			}
			h.back = h.back[1:]
			if err := h.snd.Step(decodePeer, damageGrant(g, a.Arg)); err != nil && !errors.Is(err, protocol.ErrUnknownRequest) {
				return fmt.Errorf("%w after %v: the sender refused the damaged Grant: %v", ErrRefinement, a, err)
			}
			break
		}
		*popped = 1
		w := h.wire[0]
		d, ok := w.op.Msg.(*protocol.Done)
		if !ok {
			return fmt.Errorf("%w after %v: the head of the queue pair is %s, not a Done", ErrRefinement, a, h.describe(w.op))
		}
		h.wire = h.wire[1:]
		damaged := *d
		if a.Arg&spec.SendPages != 0 {
			damaged.Pages++
		} else {
			damaged.Tokens++
		}
		h.recv.Step(prefillPeer, &damaged, time.Unix(0, 0)) // refusals come back as effects or are no-ops
	}
	return h.collect(a)
}

// routerEffects carries the router's effects: its messages onto the queues
// to the nodes (a crashed node's are dropped, as the spec drops them).
// Cancels count as the spec's Aborts only after a client's Cancel (client
// set); any other is the Router's second path on a failed leg, checked and
// not delivered (see Refinement).
func (h *Refinement) routerEffects(a spec.Action, client bool) error {
	e := h.router.Effects()
	for _, d := range e.Dispatches {
		if d.Prefill != prefillPeer || d.Decode != decodePeer {
			return fmt.Errorf("%w after %v: the router dispatched r%d to nodes %d and %d", ErrRefinement, a, int(d.Request)-1, d.Prefill, d.Decode)
		}
		if !h.crashed {
			h.toPrefill = append(h.toPrefill, spec.Msg{Kind: spec.MPrefill, Req: int8(d.Request - 1)})
		}
	}
	for _, c := range e.Cancels {
		msg := spec.Msg{Kind: spec.MAbort, Req: int8(c.Request - 1)}
		switch {
		case !client:
			if st := h.router.Request(c.Request); st.Status == protocol.RouteRunning || st.Err == nil {
				return fmt.Errorf("%w after %v: the router cancelled a leg of r%d, which has not failed (%v)", ErrRefinement, a, msg.Req, st.Status)
			}
		case c.Node == decodePeer:
			h.toDecode = append(h.toDecode, msg)
		case !h.crashed:
			h.toPrefill = append(h.toPrefill, msg)
		}
	}
	for _, l := range e.PeerLost {
		if l.Node != decodePeer || l.Peer != prefillPeer {
			return fmt.Errorf("%w after %v: the router told node %d that %d is lost", ErrRefinement, a, l.Node, l.Peer)
		}
		h.toDecode = append(h.toDecode, spec.Msg{Kind: spec.MPeerFailed, Req: -1})
	}
	return nil // outcomes are the router's state, compared in the view
}

// intake is the prefill node taking request r: admission, the KV computed.
// Its refusal is its leg's outcome, relayed to the router.
func (h *Refinement) intake(r int) error {
	pages, err := h.snd.Submit(id(r), decodePeer, h.cfg.Prompts[r])
	if err != nil {
		return h.router.LegEnded(prefillPeer, id(r), err)
	}
	h.srcPages[r] = pages
	for i, p := range pages {
		h.fill(h.src.Payload(uint32(p)), spec.Label{Req: int8(r), Index: int8(i)})
	}
	return h.snd.Computed(id(r))
}

// release hands the Sender's next operation for msg's request to the wire:
// it must be the operation the spec just sent.
func (h *Refinement) release(msg spec.Msg, damage uint8) error {
	for i, op := range h.staged {
		if requestOf(op) != id(int(msg.Req)) {
			continue
		}
		if kindOf(op) != msg.Kind || msg.Kind == spec.MWrite && int(op.Write.Index) != int(msg.Index) {
			return fmt.Errorf("the spec sent %v r%d[%d]; the sender's next for r%d is %s", msg.Kind, msg.Req, msg.Index, msg.Req, h.describe(op))
		}
		h.staged = append(h.staged[:i:i], h.staged[i+1:]...)
		h.wire = append(h.wire, wireOp{op: op, damage: damage})
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

// deliver places the WRITE, or delivers the SEND, at the head of the wire.
func (h *Refinement) deliver() {
	w := h.wire[0]
	h.wire = h.wire[1:]
	if wr := w.op.Write; wr != nil {
		payload := h.dst.Payload(uint32(wr.Remote.Page))
		copy(payload, h.src.Payload(uint32(wr.Source))) // the NIC reads the source page now
		if w.damage == spec.DamagedPayload {
			payload[len(payload)/2] ^= 0x40
		}
		record := h.dst.TagRecord(uint32(wr.Remote.Page))
		copy(record, wr.Tag)
		damageTag(record, w.damage) // after the MAC: the record no longer authenticates

		if !h.crashed {
			h.snd.Completed(wr.ID, nil)
		}
		return
	}
	h.recv.Step(prefillPeer, w.op.Msg, time.Unix(0, 0)) // refusals come back as effects or are no-ops
}

// read is decode attending over r's pages: Acquire, a check of every byte
// against the KV r's prefill computed, Finish.
func (h *Refinement) read(r int) error {
	refs, err := h.recv.Acquire(id(r))
	if err != nil {
		return nil // an explicit failure: its outcome comes through the effects
	}
	for _, ref := range refs { // what decode read, compared with what the spec says it read
		h.readLabels[r] = append(h.readLabels[r], h.labelOf(h.dst.Payload(uint32(ref.Page))))
	}
	return h.recv.Finish(id(r))
}

// cut breaks the queue pair: both directions and the sender's backlog flush,
// both ends learn.
func (h *Refinement) cut() {
	h.wire, h.back, h.staged = nil, nil, nil
	h.recv.QueuePairFenced(prefillPeer)
	if !h.crashed {
		h.snd.Flushed(decodePeer)
	}
}

// collect carries effects: the sender's operations into its backlog, the
// receiver's messages onto decode→prefill, cuts, and both nodes' outcomes
// to the router, whose effects it then carries.
func (h *Refinement) collect(a spec.Action) error {
	for {
		se := h.snd.Effects()
		if !h.crashed {
			h.staged = append(h.staged, se.Ops...)
			for _, o := range se.Outcomes {
				if err := h.router.LegEnded(prefillPeer, o.Request, o.Err); err != nil {
					return fmt.Errorf("%w after %v: the router refused prefill's outcome for r%d: %v", ErrRefinement, a, int(o.Request)-1, err)
				}
			}
		}
		re := h.recv.Effects()
		for _, s := range re.Sends {
			if g, ok := s.Msg.(*protocol.Grant); ok {
				r := int(g.Request) - 1
				h.granted[r] = nil
				for _, p := range g.Pages {
					h.granted[r] = append(h.granted[r], protocol.PageRef{Page: p.Page, Epoch: p.Epoch})
				}
			}
			if !h.crashed {
				h.back = append(h.back, s.Msg)
			}
		}
		for _, o := range re.Outcomes {
			if h.recv.Status(o.Request) == protocol.StatusNone {
				h.refused[int(o.Request)-1] = true // decode's intake refused it and kept no record
			}
			if err := h.router.LegEnded(decodePeer, o.Request, o.Err); err != nil {
				return fmt.Errorf("%w after %v: the router refused decode's outcome for r%d: %v", ErrRefinement, a, int(o.Request)-1, err)
			}
		}
		if err := h.routerEffects(a, false); err != nil {
			return err
		}
		if len(re.Cuts) == 0 {
			return nil
		}
		h.cut()
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

func (h *Refinement) grantMatches(r int, n *spec.State) bool {
	refs := h.grantOf(r)
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

// compare fails if the implementation's view differs from the spec's.
func (h *Refinement) compare(after string) error {
	want, got := SpecView(h.cfg, &h.s), h.View()
	if want == got {
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
	protocol.SendStatusNone: "-", protocol.SendStatusAwaitGrant: "awaiting grant", protocol.SendStatusWriting: "writing",
	protocol.SendStatusDoneSent: "done sent", protocol.SendStatusAborting: "aborting", protocol.SendStatusFinished: "finished",
	protocol.SendStatusAborted: "aborted", protocol.SendStatusFailed: "failed",
}

// refKey is the tag key of the refinement's one queue pair, from a fixed
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

// View is the implementation's state in the spec's terms: per request the
// client's outcome, both legs' states, the granted pages and the labels of
// the source pages it holds; per decode page its owner, epoch, quarantine,
// content and tag record; the queue pair's content in order.
func (h *Refinement) View() string {
	var b strings.Builder
	pool := h.recv.Pool()
	for r := range h.cfg.Prompts {
		o, why := h.clientView(r)
		sp := senderPhase[h.snd.Status(id(r))]
		if h.crashed && sp != "finished" && sp != "aborted" && sp != "-" {
			sp = "failed"
		}
		st := h.recv.Status(id(r))
		rp := st.String()
		if st == protocol.StatusNone || h.refused[r] && st == protocol.StatusTombstone {
			rp = "-" // never bootstrapped, or refused at intake (a later cancel leaves a tombstone)
		}
		fmt.Fprintf(&b, "r%d: %v %v | sender %s | receiver %s | grant", r, o, why, sp, rp)
		if rp != "-" && st != protocol.StatusTombstone {
			for _, ref := range h.granted[r] {
				fmt.Fprintf(&b, " %d@%d", ref.Page, ref.Epoch)
			}
		}
		if h.readLabels[r] != nil {
			fmt.Fprintf(&b, " | read %s", strings.Join(h.readLabels[r], " "))
		}
		b.WriteString(" | source")
		if !h.crashed && sp != "-" {
			for i, p := range h.srcPages[r] {
				if pool := h.snd.Pool(); pool.Holds(id(r), protocol.PageRef{Page: p, Epoch: pool.Epoch(p)}) {
					fmt.Fprintf(&b, " %d:%s", i, h.labelOf(h.src.Payload(uint32(p))))
				}
			}
		}
		b.WriteString("\n")
	}
	for p := 0; p < h.cfg.DecodePages; p++ {
		owner, quarantined, free := pool.Owner(uint32(p))
		o := "free"
		if !free {
			o = fmt.Sprintf("r%d", int(owner)-1)
		}
		tag := "torn"
		t, err := protocol.ParseTag(h.dst.TagRecord(uint32(p)), refKey)
		if err != nil && errors.Is(err, protocol.ErrTagMismatch) {
			// Damaged in transit: the MAC fails, which is how the Receiver
			// notices; the spec's tag is the fields, so the view shows them.
			t, err = tagFields(h.dst.TagRecord(uint32(p))), nil
		}
		if err == nil {
			req := fmt.Sprintf("r%d", int(t.Request)-1)
			if t.Request == tenantID {
				req = "tenant"
			}
			tag = fmt.Sprintf("%s[%d]@%d sum %v", req, t.Index, t.Epoch, h.sums[t.Sum])
		}
		fmt.Fprintf(&b, "page %d: %s epoch %d quarantined %v holds %s tag %s\n", p, o, pool.Epoch(uint32(p)), quarantined,
			h.labelOf(h.dst.Payload(uint32(p))), tag)
	}
	b.WriteString("queue pair:")
	for _, w := range h.wire {
		fmt.Fprintf(&b, " %v r%d", kindOf(w.op), int(requestOf(w.op))-1)
		if w.op.Write != nil {
			fmt.Fprintf(&b, "[%d]", w.op.Write.Index)
		}
	}
	b.WriteString("\nback:")
	for _, m := range h.back {
		k := spec.MGrant
		if _, ok := m.(*protocol.Abort); ok {
			k = spec.MAbort
		}
		fmt.Fprintf(&b, " %v r%d", k, int(protocol.RequestOf(m))-1)
	}
	writeRouterQueues(&b, h.toPrefill, h.toDecode)
	return b.String()
}

// writeRouterQueues is the view of the router's messages to each node.
func writeRouterQueues(b *strings.Builder, toPrefill, toDecode []spec.Msg) {
	for _, q := range []struct {
		name string
		msgs []spec.Msg
	}{{"\nrouter to prefill:", toPrefill}, {"\nrouter to decode:", toDecode}} {
		b.WriteString(q.name)
		for _, m := range q.msgs {
			fmt.Fprintf(b, " %v r%d", m.Kind, m.Req)
		}
	}
}

// SpecView is View for a spec state.
func SpecView(cfg spec.Config, s *spec.State) string {
	var b strings.Builder
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
		fmt.Fprintf(&b, "r%d: %v %v | sender %s | receiver %s | grant", r, q.Outcome, why, sp, rp)
		if rp != "-" && q.R.Phase != spec.RTombstone {
			for i := 0; i < int(q.R.N); i++ {
				fmt.Fprintf(&b, " %d@%d", q.R.Pages[i].Page, q.R.Pages[i].Epoch)
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
				fmt.Fprintf(&b, " %d:%v", i, s.Src[0][q.S.Src[i]].Data)
			}
		}
		b.WriteString("\n")
	}
	for p := 0; p < cfg.DecodePages; p++ {
		pg := &s.Pages[0][p]
		o := "free"
		if pg.Owner != spec.Free {
			o = fmt.Sprintf("r%d", pg.Owner)
		}
		req := fmt.Sprintf("r%d", pg.Tag.Req)
		if pg.Tag.Req == spec.Tenant {
			req = "tenant"
		}
		fmt.Fprintf(&b, "page %d: %s epoch %d quarantined %v holds %v tag %s[%d]@%d sum %v\n", p, o, pg.Epoch, pg.Quarantined,
			pg.Data, req, pg.Tag.Index, pg.Tag.Epoch, pg.Tag.Sum)
	}
	b.WriteString("queue pair:")
	for _, m := range s.QP[0][0].Items() {
		fmt.Fprintf(&b, " %v r%d", m.Kind, m.Req)
		if m.Kind == spec.MWrite {
			fmt.Fprintf(&b, "[%d]", m.Index)
		}
	}
	b.WriteString("\nback:")
	for _, m := range s.QPBack[0][0].Items() {
		fmt.Fprintf(&b, " %v r%d", m.Kind, m.Req)
	}
	writeRouterQueues(&b, s.ToPrefill[0].Items(), s.ToDecode[0].Items())
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
