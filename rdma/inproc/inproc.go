// Package inproc is a pure-Go RDMA provider inside one process, with the
// semantics of reliable-connected queue pairs (see package rdma): in-order
// execution per queue pair, WRITE placed before a later SEND is delivered, a
// completion only after placement, key and bounds violations that break the
// queue pair, and ToError as a fence after which nothing lands.
//
// A WRITE is one copy, from the local registered region into the remote one,
// the copy a NIC would do. Work requests run on a goroutine per queue pair, under
// one fabric-wide execution lock that ToError also takes: when ToError returns,
// no placement is in progress and none can start. The lock serializes
// placements across queue pairs, which costs parallelism, not correctness.
//
// Memory windows (rdma.MemoryWindow) are checked for every WRITE with the
// region keys, under the same lock: an invalidate takes it, so when it
// completes no placement under the window's key is in progress or can start.
// Binds and invalidates execute when posted.
//
// Fault hooks for tests and simulations: Pause and Resume (placements and
// completions held back: a late WRITE), CorruptNext (the next WRITE's payload
// is damaged in transit), and ToError on either side (a cut).
//
// Receive-not-ready is not retried: a SEND or WRITE WITH IMMEDIATE that finds
// no posted RECV completes with ReceiverNotReady and breaks the queue pair, as
// on hardware with rnr_retry = 0.
package inproc

import (
	"fmt"
	"sync"

	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/internal/soft"
)

// Fabric is a set of devices whose queue pairs can connect to each other.
type Fabric struct {
	name    string
	mu      sync.Mutex // guards the tables
	exec    sync.Mutex // held while a work request executes, and by ToError
	qps     map[uint32]*QP
	regions soft.Regions
}

// NewFabric returns an empty fabric.
func NewFabric(name string) *Fabric {
	return &Fabric{name: name, qps: map[uint32]*QP{}}
}

// Device returns a device on the fabric.
func (f *Fabric) Device(name string) rdma.Device { return &device{f: f, name: name} }

type device struct {
	f    *Fabric
	name string
}

func (d *device) Name() string { return d.name }

func (d *device) AllocPD() (rdma.ProtectionDomain, error) { return &pd{f: d.f, dev: d}, nil }

func (d *device) CreateCQ(depth int) (rdma.CompletionQueue, error) {
	if depth < 1 {
		return nil, fmt.Errorf("%w: CQ depth %d", rdma.ErrBadRequest, depth)
	}
	return soft.New(), nil
}

// Close moves the device's queue pairs to the error state.
func (d *device) Close() error {
	d.f.mu.Lock()
	var mine []*QP
	for _, q := range d.f.qps {
		if q.pd.dev == d {
			mine = append(mine, q)
		}
	}
	d.f.mu.Unlock()
	for _, q := range mine {
		q.ToError()
	}
	return nil
}

type pd struct {
	f   *Fabric
	dev *device
}

// Alloc implements rdma.ProtectionDomain.
func (p *pd) Alloc(size int, access rdma.Access) (rdma.MemoryRegion, error) {
	return p.f.regions.Alloc(p, size, access)
}

// Register implements rdma.ProtectionDomain.
func (p *pd) Register(buf []byte, access rdma.Access) (rdma.MemoryRegion, error) {
	return p.f.regions.Register(p, buf, access)
}

// Deregister implements rdma.Deregistrar.
func (p *pd) Deregister(m rdma.MemoryRegion) error { return p.f.regions.Deregister(p, m) }

// AllocWindow implements rdma.WindowDomain.
func (p *pd) AllocWindow() (rdma.MemoryWindow, error) {
	return &window{Window: p.f.regions.AllocWindow(p), f: p.f}, nil
}

// window is a memory window: its key is checked for every WRITE under the
// fabric's execution lock, which an invalidate takes too.
type window struct {
	*soft.Window
	f *Fabric
}

// Close implements rdma.MemoryWindow: under the execution lock, so no
// placement under its key is in progress or can start once it returns.
func (w *window) Close() error {
	w.f.exec.Lock()
	defer w.f.exec.Unlock()
	w.f.regions.Close(w.Window)
	return nil
}

// windowOp executes a bind or invalidate posted on q.
func (q *QP) windowOp(wr rdma.WorkRequest) error {
	w, ok := wr.Window.(*window)
	if !ok || w.f != q.f {
		return fmt.Errorf("%w: a window of another provider or fabric", rdma.ErrBadRequest)
	}
	if wr.Op == rdma.OpBind {
		return q.f.regions.Bind(w.Window, q.pd, q, wr.Local)
	}
	q.f.exec.Lock() // the fence: no placement in progress, none can start under the old key
	defer q.f.exec.Unlock()
	return q.f.regions.Invalidate(w.Window, q.pd)
}

func (p *pd) CreateQP(sendCQ, recvCQ rdma.CompletionQueue, depth int) (rdma.QueuePair, error) {
	s, ok1 := sendCQ.(*soft.Queue)
	r, ok2 := recvCQ.(*soft.Queue)
	if !ok1 || !ok2 || depth < 1 {
		return nil, fmt.Errorf("%w: CQs of another provider, or depth %d", rdma.ErrBadRequest, depth)
	}
	f := p.f
	f.mu.Lock()
	defer f.mu.Unlock()
	qpn := soft.Random32()
	for qpn == 0 || f.qps[qpn] != nil {
		qpn = soft.Random32()
	}
	q := &QP{f: f, pd: p, qpn: qpn, psn: soft.Random32() & 0xFFFFFF}
	q.Init(p, s, r, depth, 0)
	q.WindowOp = q.windowOp
	f.qps[q.qpn] = q
	return q, nil
}

// QP is a reliable-connected queue pair of the in-process provider. Its
// work queues, posting and fault hooks are soft.WorkQueues'.
type QP struct {
	soft.WorkQueues // remote is guarded by its Mu too
	f               *Fabric
	pd              *pd
	qpn             uint32
	psn             uint32
	remote          *QP
}

// Info implements rdma.QueuePair.
func (q *QP) Info() rdma.ConnInfo {
	return rdma.ConnInfo{Fabric: q.f.name, QPN: q.qpn, PSN: q.psn, Node: q.pd.dev.name}
}

// Connect implements rdma.QueuePair. The peer must be named exactly: its
// QPN, its PSN and its device's name (when remote.Node is set); and a peer
// already connected to another queue pair is refused. Only the peer q is
// connected to reaches q as a responder (see step).
func (q *QP) Connect(remote rdma.ConnInfo) error {
	q.f.mu.Lock()
	r := q.f.qps[remote.QPN]
	q.f.mu.Unlock()
	if remote.Fabric != q.f.name || r == nil || r.psn != remote.PSN&0xFFFFFF || (remote.Node != "" && remote.Node != r.pd.dev.name) {
		return fmt.Errorf("%w: no queue pair %d with that PSN and identity on %s", rdma.ErrUnknownPeer, remote.QPN, remote.Fabric)
	}
	if r == q {
		return fmt.Errorf("%w: a queue pair cannot be its own peer", rdma.ErrBadRequest)
	}
	r.Mu.Lock()
	taken := r.remote != nil && r.remote != q
	r.Mu.Unlock()
	if taken {
		return fmt.Errorf("%w: queue pair %d is connected to another peer", rdma.ErrUnknownPeer, remote.QPN)
	}
	q.Mu.Lock()
	defer q.Mu.Unlock()
	if q.QPState != rdma.StateReset {
		return fmt.Errorf("%w: connect from state %d", rdma.ErrBadRequest, q.QPState)
	}
	q.remote, q.QPState = r, rdma.StateRTS
	go q.run()
	return nil
}

// ToError implements rdma.QueuePair: every outstanding work request completes
// with FlushError, and nothing posted on q lands after ToError returns.
func (q *QP) ToError() error {
	q.f.exec.Lock() // no placement in progress, none can start
	defer q.f.exec.Unlock()
	q.toError(nil)
	return nil
}

// toError flushes q; the caller holds f.exec. A failed work request's own
// completion, head, comes before the flushes.
func (q *QP) toError(head *rdma.Completion) {
	q.Mu.Lock()
	defer q.Mu.Unlock()
	q.FailLocked(head)
}

// run executes q's send queue in order until q is in the error state.
func (q *QP) run() {
	for range q.Wake {
		for q.step() {
		}
		if q.State() == rdma.StateError {
			return
		}
	}
}

// step executes the head of the send queue, if it may; it reports whether it did.
func (q *QP) step() bool {
	f := q.f
	f.exec.Lock()
	defer f.exec.Unlock()
	q.Mu.Lock()
	if q.QPState != rdma.StateRTS || q.Paused || len(q.SQ) == 0 {
		q.Mu.Unlock()
		return false
	}
	wr := q.SQ[0]
	q.SQ = q.SQ[1:]
	corrupt := q.TakeCorruptLocked(wr.Op)
	r := q.remote
	q.Mu.Unlock()

	src := wr.Local.MR.Bytes()[wr.Local.Offset : wr.Local.Offset+wr.Local.Length]
	fail := func(st rdma.Status, remoteToo bool) bool {
		q.toError(&rdma.Completion{WRID: wr.ID, Op: wr.Op, Status: st})
		if remoteToo {
			r.toError(nil)
		}
		return true
	}
	r.Mu.Lock()
	rstate, rpeer := r.QPState, r.remote
	r.Mu.Unlock()
	if rstate != rdma.StateRTS {
		return fail(rdma.FlushError, false) // the responder is gone: the request cannot complete
	}
	if rpeer != q {
		// The responder is connected to another queue pair: it drops what q
		// sends, and q's retries run out.
		return fail(rdma.TransportError, false)
	}
	switch wr.Op {
	case rdma.OpWrite, rdma.OpWriteImm:
		dst, _ := f.regions.Target(r.pd, r, wr.RKey, wr.RemoteAddr, len(src)) // under f.exec: no invalidate can come in the middle
		if dst == nil {
			return fail(rdma.RemoteAccessError, true) // a NAK: both ends go to error, as on hardware
		}
		var recv rdma.WorkRequest
		if wr.Op == rdma.OpWriteImm {
			var ok bool
			if recv, ok = r.takeRecv(); !ok {
				return fail(rdma.ReceiverNotReady, true)
			}
		}
		copy(dst, src)
		if corrupt {
			rdma.Damage(dst[:len(src)])
		}
		if wr.Op == rdma.OpWriteImm {
			r.RecvCQ().Push(rdma.Completion{WRID: recv.ID, Op: rdma.OpRecvImm, Imm: wr.Imm, HasImm: true})
		}
	case rdma.OpSend:
		recv, ok := r.takeRecv()
		if !ok {
			return fail(rdma.ReceiverNotReady, true)
		}
		if recv.Local.Length < len(src) {
			r.RecvCQ().Push(rdma.Completion{WRID: recv.ID, Op: rdma.OpRecv, Status: rdma.LocalLengthError})
			return fail(rdma.RemoteAccessError, true)
		}
		copy(recv.Local.MR.Bytes()[recv.Local.Offset:], src)
		r.RecvCQ().Push(rdma.Completion{WRID: recv.ID, Op: rdma.OpRecv, Bytes: len(src), Imm: wr.Imm, HasImm: wr.HasImm})
	}
	q.SendCQ().Push(rdma.Completion{WRID: wr.ID, Op: wr.Op})
	return true
}

// takeRecv consumes the head of q's receive queue.
func (q *QP) takeRecv() (rdma.WorkRequest, bool) {
	q.Mu.Lock()
	defer q.Mu.Unlock()
	return q.TakeRecvLocked()
}
