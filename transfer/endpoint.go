package transfer

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/trace"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma"
)

// Errors of the endpoints, for errors.Is.
var (
	// ErrNoPeer: no live queue pair to the named peer.
	ErrNoPeer = errors.New("transfer: no live queue pair to that peer")
	// ErrOtherIncarnation: the live queue pair to the named peer is a
	// later life's than the one named (CutIncarnation), and stays.
	ErrOtherIncarnation = errors.New("transfer: the live queue pair to that peer is a later life's")
	// ErrTooManyPeers: the endpoint holds MaxPeers queue pairs already.
	ErrTooManyPeers = errors.New("transfer: too many peers")
	// ErrSetup: the out-of-band connection setup failed (the peer did not
	// answer in time, answered garbage, or does not match this node).
	ErrSetup = errors.New("transfer: connection setup failed")
	// ErrClosed: the endpoint is closed.
	ErrClosed = errors.New("transfer: endpoint closed")
)

// EventKind says what an Event reports.
type EventKind uint8

// The events an endpoint reports.
const (
	// Verified (decode): the request's KV has arrived and verified; read it
	// with Acquire, then Finish.
	Verified EventKind = iota + 1
	// Outcome: the request's final result on this node, Err nil for success.
	Outcome
)

// Event is what an endpoint reports to its node.
type Event struct {
	Kind    EventKind
	Request protocol.RequestID
	Peer    string // the peer the request was on
	Err     error  // Outcome: nil for success, else wraps one of protocol's outcome errors
}

// role is what the two endpoints do differently with one shared core.
type role interface {
	// message handles a message from c's peer.
	message(c *conn, m protocol.Message) error
	// completed handles a send-queue completion on c (after its buffers are free).
	completed(c *conn, k wrKind, status rdma.Status) error
	// fenced tells the state machine that c is in the error state with nothing
	// left to complete.
	fenced(c *conn)
	// carry moves the state machine's effects into backlogs and events.
	carry()
	// tick advances the state machine's clock.
	tick(now time.Time)
}

// endpoint is what Prefill and Decode share: a device, one completion queue
// for every queue pair, the queue pairs by peer, the events for the node, the
// clock and the run loop. Every method takes mu.
type endpoint struct {
	mu       sync.Mutex
	role     role
	dev      rdma.Device
	pd       rdma.ProtectionDomain
	cq       rdma.CompletionQueue
	depth    int
	maxPeers int
	inSlot   int // receive buffer size on this side
	outSlot  int // send buffer size on this side
	tags     bool
	conns    map[protocol.PeerID]*conn // every queue pair not yet drained
	names    map[string]*conn          // the live queue pair to each peer
	nextPeer protocol.PeerID
	spare    []*buffers // buffers of drained queue pairs, for the next one
	events   []Event
	notify   chan struct{}
	now      time.Time
	closed   bool
	// ended: the node's stop has ended (Decode.TraceStopped): a message
	// that reaches it after is dropped, untraced, as the queue pair's
	// close with the node would have lost it.
	ended   bool
	refused int           // messages the state machine refused (unknown, duplicate, wrong peer), or dropped once ended
	trace   *trace.Writer // the node's protocol trace; nil: off (docs/trace.md)
}

func (e *endpoint) init(r role, dev rdma.Device, depth, maxPeers, inSlot, outSlot int, tags bool) error {
	if depth == 0 {
		depth = 1024
	}
	if depth < 3 {
		return fmt.Errorf("transfer: QueueDepth %d: a page needs two WRITEs and Done a SEND", depth)
	}
	if maxPeers == 0 {
		maxPeers = 16
	}
	*e = endpoint{role: r, dev: dev, depth: depth, maxPeers: maxPeers, inSlot: inSlot, outSlot: outSlot, tags: tags,
		conns: map[protocol.PeerID]*conn{}, names: map[string]*conn{}, notify: make(chan struct{}, 1), now: time.Unix(0, 0)}
	var err error
	if e.pd, err = dev.AllocPD(); err != nil {
		return err
	}
	// Room for every completion of every queue pair: sends and receives.
	e.cq, err = dev.CreateCQ(maxPeers * (depth + RecvSlots))
	return err
}

// tagKeyOf is the tag key of the queue pair to peer, for the protocol's
// TagKeys: nil for a peer this node has no queue pair to. The caller holds mu.
func (e *endpoint) tagKeyOf(peer protocol.PeerID) *protocol.TagKey {
	if c := e.conns[peer]; c != nil {
		return c.tagKey
	}
	return nil
}

// newConn allocates a queue pair to peer name with its buffers and posts its
// receive buffers. The caller holds mu and connects it.
func (e *endpoint) newConn(name string, maxPages int) (*conn, error) {
	if e.closed {
		return nil, ErrClosed
	}
	if len(e.conns) >= e.maxPeers {
		return nil, fmt.Errorf("%w: %d queue pairs", ErrTooManyPeers, len(e.conns))
	}
	var b *buffers
	if n := len(e.spare); n > 0 {
		b, e.spare = e.spare[n-1], e.spare[:n-1]
	} else {
		b = &buffers{}
		var err error
		if b.in, err = e.pd.Alloc(RecvSlots*e.inSlot, rdma.LocalWrite); err != nil {
			return nil, err
		}
		if b.out, err = e.pd.Alloc(RecvSlots*e.outSlot, rdma.LocalWrite); err != nil {
			return nil, err
		}
		if e.tags {
			if b.tags, err = e.pd.Alloc(tagSlots*protocol.TagSize, rdma.LocalWrite); err != nil {
				return nil, err
			}
		}
	}
	qp, err := e.pd.CreateQP(e.cq, e.cq, max(e.depth, RecvSlots))
	if err != nil {
		e.spare = append(e.spare, b)
		return nil, err
	}
	e.nextPeer++
	c := newConn(e.nextPeer, name, qp, b, e.inSlot, e.outSlot, e.depth, maxPages)
	if err := c.postRecvs(); err != nil {
		qp.ToError()
		e.spare = append(e.spare, b)
		return nil, err
	}
	e.conns[c.peer] = c
	return c, nil
}

// goLive makes c the peer's queue pair for new requests; an older one to
// the same peer is cut, so that nothing of it can complete on the new one.
func (e *endpoint) goLive(c *conn) error {
	if c.broken {
		// Its provider failed it as it was set up (the peer's end went):
		// it must not replace the peer's live queue pair.
		return fmt.Errorf("%w: the queue pair to %q broke as it was set up", protocol.ErrPeerFailed, c.name)
	}
	if c.doomed {
		// Being set up as its life's loss was told: that cut is its fence
		// too.
		err := fmt.Errorf("%w: life %d of %q was lost as its queue pair was set up", protocol.ErrPeerFailed, c.incarnation, c.name)
		e.cut(c, err)
		return err
	}
	if old := e.names[c.name]; old != nil && old != c {
		old.fail(fmt.Errorf("%w: replaced by a new queue pair", protocol.ErrPeerFailed))
	}
	c.live = true
	e.names[c.name] = c
	e.settle(c)
	return nil
}

// settle tells the state machine about a broken queue pair once its flush
// has drained, and forgets the queue pair, once: a setup that fails after
// the provider flushed its queue pair settles it again, and its buffers,
// spared twice, would go to two queue pairs at once (one's SEND carrying
// the other's message).
func (e *endpoint) settle(c *conn) {
	if !c.drained() || e.conns[c.peer] != c {
		return
	}
	if e.names[c.name] == c {
		delete(e.names, c.name)
	}
	delete(e.conns, c.peer)
	e.role.fenced(c)
	e.spare = append(e.spare, c.bufs)
}

// cut moves the queue pair to the peer to the error state.
func (e *endpoint) cut(c *conn, why error) {
	c.fail(why)
	e.settle(c)
}

// emit queues an event for the node.
func (e *endpoint) emit(ev Event) {
	e.events = append(e.events, ev)
	select {
	case e.notify <- struct{}{}:
	default:
	}
}

// Events returns the events since the last call and clears them.
func (e *endpoint) Events() []Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	ev := e.events
	e.events = nil
	return ev
}

// Notify is signalled (it holds at most one signal) when events are pending.
func (e *endpoint) Notify() <-chan struct{} { return e.notify }

// Peers lists the peers with a live queue pair.
func (e *endpoint) Peers() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []string
	for name := range e.names {
		out = append(out, name)
	}
	return out
}

// Cut moves the queue pair to peer to the error state: the fence. Every
// request on it fails once its flush has drained.
func (e *endpoint) Cut(peer string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.cutLocked(peer)
}

// cutLocked is Cut; the caller holds mu.
func (e *endpoint) cutLocked(peer string) error {
	c := e.names[peer]
	if c == nil {
		return fmt.Errorf("%w: %q", ErrNoPeer, peer)
	}
	e.cut(c, fmt.Errorf("%w: cut by this node", protocol.ErrPeerFailed))
	e.role.carry()
	e.flushAll()
	return nil
}

// CutIncarnation is Cut for the queue pair that life incarnation of peer,
// or an earlier life, set up (its hello's incarnation): the fence for a
// lost life. A lost node's next life may have connected before this node
// hears of the loss, and its queue pair then replaced the lost life's
// (which was cut at that); cut by name, the new one would go too, failing
// the new life's first requests. So a live queue pair of a later life
// stays, with ErrOtherIncarnation. A queue pair whose hello said
// incarnation 0, or a cut of incarnation 0, goes as by Cut.
//
// A queue pair of the life named, or an earlier one, that is being set up
// as the cut comes never goes live: it is cut as its setup ends, which
// fails.
//
// A later life is the peer's word in its hello: Serve takes it only where
// SetupConfig.Admit (the registry) agrees, and Dial only where it is
// SetupConfig.PeerIncarnation.
func (e *endpoint) CutIncarnation(peer string, incarnation uint64) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, c := range e.conns {
		// A queue pair of the life, or an earlier one, still being set up
		// (its life known: the hello's, or for Dial the one the registry
		// names) goes as its setup ends. Only those: the same life may
		// come back later (a node the router suspected answers again) and
		// connect anew.
		if c.name == peer && !c.live && !c.broken && c.incarnation != 0 && (incarnation == 0 || c.incarnation <= incarnation) {
			c.doomed = true
		}
	}
	if c := e.names[peer]; c != nil && incarnation != 0 && c.incarnation > incarnation {
		return fmt.Errorf("%w: %q, life %d (the one named is %d)", ErrOtherIncarnation, peer, c.incarnation, incarnation)
	}
	return e.cutLocked(peer)
}

// Faults is the fault hooks (late placements, corruption) of the live queue
// pair to peer, for tests and the demo; an error if there is none or its
// provider has no hooks.
func (e *endpoint) Faults(peer string) (rdma.Faults, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	c := e.names[peer]
	if c == nil || !c.live {
		return nil, fmt.Errorf("%w: %q", ErrNoPeer, peer)
	}
	f, ok := c.qp.(rdma.Faults)
	if !ok {
		return nil, fmt.Errorf("transfer: the queue pair to %q has no fault hooks", peer)
	}
	return f, nil
}

// flushAll posts what every queue pair's backlog can take.
func (e *endpoint) flushAll() {
	for _, c := range e.conns {
		e.flushConn(c)
	}
}

func (e *endpoint) flushConn(c *conn) {
	src, pageBytes := e.source()
	if err := c.flush(src, pageBytes, e.windows()); err != nil {
		e.cut(c, err)
	}
	e.settle(c)
}

// windows are the decode side's grant windows (nil for prefill, and under
// PoolWideKey).
func (e *endpoint) windows() *grantWindows {
	if d, ok := e.role.(*Decode); ok {
		return d.win
	}
	return nil
}

// source is the prefill side's source region and page size (nil for decode).
func (e *endpoint) source() (rdma.MemoryRegion, int) {
	if p, ok := e.role.(*Prefill); ok {
		return p.src, p.cfg.PageBytes
	}
	return nil, 0
}

// Poll advances the clock to now, handles every completion waiting, and
// posts what it can. It returns how many completions it handled. Drive an
// endpoint either with Poll (tests, a caller's own loop) or with Run, never
// both at once.
func (e *endpoint) Poll(now time.Time) int {
	return e.handle(now, e.cq.Poll(256))
}

func (e *endpoint) handle(now time.Time, wcs []rdma.Completion) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	if now.After(e.now) {
		e.now = now
	}
	e.role.tick(e.now)
	for _, wc := range wcs {
		c := e.conns[wridPeer(wc.WRID)]
		if c == nil {
			continue // a queue pair already drained and forgotten
		}
		if wc.WRID&recvBit != 0 {
			e.receive(c, wc)
		} else if k, ok := c.sent(wc.WRID); ok {
			if wc.Status != rdma.Success {
				c.fail(fmt.Errorf("%w: %v completion: %v", protocol.ErrPeerFailed, wc.Op, wc.Status))
			}
			if err := e.role.completed(c, k, wc.Status); err != nil {
				e.cut(c, err)
			}
		}
		e.settle(c)
	}
	e.role.carry()
	e.flushAll()
	return len(wcs)
}

func (e *endpoint) receive(c *conn, wc rdma.Completion) {
	if wc.Status != rdma.Success {
		c.fail(fmt.Errorf("%w: receive completion: %v", protocol.ErrPeerFailed, wc.Status))
		return
	}
	if c.broken {
		return
	}
	m, err := c.received(wc)
	if err != nil {
		c.fail(err) // a peer that breaks the queue pair's own protocol loses it
		return
	}
	if m == nil {
		return // a credit update
	}
	if e.ended {
		// The stop ended holding no page: a Bootstrap granted now would
		// take pages after it (its trace would show them held past the
		// stop), and any other message names a request that ended.
		e.refused++
		return
	}
	if e.trace != nil {
		e.trace.Emit(msgEvent(trace.Recv, c, m))
	}
	if err := e.role.message(c, m); err != nil {
		if errors.Is(err, protocol.ErrMalformed) {
			c.fail(err)
			return
		}
		e.refused++ // unknown, duplicate, late: the state machine changed nothing
	}
}

// Refused is how many messages the state machine refused (unknown or
// ended requests, duplicates, a request on another queue pair), and the
// messages a decode node whose stop ended dropped.
func (e *endpoint) Refused() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.refused
}

// Run drives the endpoint until ctx ends: it busy-polls the completion queue
// for a while after each completion, then waits on it in slices of at most
// a millisecond, so that the clock advances (timeouts, horizons) even when
// nothing completes. Calls from the node (Submit, Cancel, Acquire, ...) are
// served at any time: they take the endpoint's lock and post directly.
func (e *endpoint) Run(ctx context.Context) error {
	const spins = 64
	idle := 0
	for ctx.Err() == nil {
		var wcs []rdma.Completion
		if idle < spins {
			wcs = e.cq.Poll(256)
		} else {
			wcs = e.cq.Wait(256, time.Millisecond)
		}
		e.handle(time.Now(), wcs)
		if len(wcs) > 0 {
			idle = 0
		} else {
			idle++
			if idle < spins {
				runtime.Gosched()
			}
		}
	}
	return ctx.Err()
}

// Close cuts every queue pair and refuses new ones. The device stays the
// caller's.
func (e *endpoint) Close() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.closed = true
	for _, c := range e.conns {
		c.fail(fmt.Errorf("%w: %w", protocol.ErrPeerFailed, ErrClosed))
	}
}
