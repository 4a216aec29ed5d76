package soft

import (
	"fmt"
	"sync"

	"github.com/kvhandoff/kvhandoff/rdma"
)

// WorkQueues is what a software queue pair keeps under its lock, Mu: its
// state, its work queues, its fault flags and the wake-up of the goroutine
// that executes its sends. Embedded in a queue pair, it supplies State,
// PostSend, PostRecv, Pause, Resume and CorruptNext; the provider supplies
// execution, connection and ToError.
type WorkQueues struct {
	Mu       sync.Mutex
	QPState  rdma.QPState
	SQ       []rdma.WorkRequest // posted sends, not yet executed
	InFlight []rdma.WorkRequest // sends executing (transmitted, not yet answered)
	RQ       []rdma.WorkRequest // posted receives
	Paused   bool
	// HeldWindows are binds and invalidates posted while Paused: they run,
	// in order, at Resume (a bind under the key it reported when posted).
	HeldWindows []rdma.WorkRequest
	Corrupt     bool
	Wake        chan struct{}

	// WindowOp executes a bind or an invalidate (OpBind, OpInvalidate) for
	// the provider, with its fence; nil: the provider has no windows.
	WindowOp func(wr rdma.WorkRequest) error

	owner  any // the protection domain whose regions work requests may use
	depth  int
	maxLen int
	sendCQ *Queue
	recvCQ *Queue
}

// Init prepares w for a queue pair of protection domain owner with queues of
// depth work requests, none longer than maxLen bytes (0: no limit).
func (w *WorkQueues) Init(owner any, sendCQ, recvCQ *Queue, depth, maxLen int) {
	w.owner, w.sendCQ, w.recvCQ, w.depth, w.maxLen = owner, sendCQ, recvCQ, depth, maxLen
	w.Wake = make(chan struct{}, 1)
}

// SendCQ is the completion queue of the send queue.
func (w *WorkQueues) SendCQ() *Queue { return w.sendCQ }

// RecvCQ is the completion queue of the receive queue.
func (w *WorkQueues) RecvCQ() *Queue { return w.recvCQ }

// State implements rdma.QueuePair.
func (w *WorkQueues) State() rdma.QPState {
	w.Mu.Lock()
	defer w.Mu.Unlock()
	return w.QPState
}

// PostSend implements rdma.QueuePair.
// Binds and invalidates are local: they execute when posted, on a queue pair
// ready to send, and complete at once, before earlier work requests may have;
// while the queue pair is paused they wait, with nothing else, until Resume.
func (w *WorkQueues) PostSend(wr rdma.WorkRequest) error {
	if wr.Op == rdma.OpBind || wr.Op == rdma.OpInvalidate {
		return w.postWindow(wr)
	}
	if wr.Op != rdma.OpWrite && wr.Op != rdma.OpWriteImm && wr.Op != rdma.OpSend {
		return fmt.Errorf("%w: %v on the send queue", rdma.ErrBadRequest, wr.Op)
	}
	return w.post(&w.SQ, wr, true)
}

// PostRecv implements rdma.QueuePair. Receives may be posted before the queue
// pair is connected, as on hardware.
func (w *WorkQueues) PostRecv(wr rdma.WorkRequest) error {
	if wr.Op != rdma.OpRecv {
		return fmt.Errorf("%w: %v on the receive queue", rdma.ErrBadRequest, wr.Op)
	}
	return w.post(&w.RQ, wr, false)
}

func (w *WorkQueues) postWindow(wr rdma.WorkRequest) error {
	if w.WindowOp == nil || wr.Window == nil {
		return fmt.Errorf("%w: %v without a window", rdma.ErrBadRequest, wr.Op)
	}
	w.Mu.Lock()
	switch {
	case w.QPState == rdma.StateError:
		w.Mu.Unlock()
		return rdma.ErrQPError
	case w.QPState == rdma.StateReset:
		w.Mu.Unlock()
		return rdma.ErrNotConnected
	case w.Paused:
		if len(w.SQ)+len(w.InFlight)+len(w.HeldWindows) >= w.depth {
			w.Mu.Unlock()
			return rdma.ErrQueueFull
		}
		if sw, ok := wr.Window.(interface{ softWindow() *Window }); ok && wr.Op == rdma.OpBind {
			sw.softWindow().reserveKey()
		}
		w.HeldWindows = append(w.HeldWindows, wr)
		w.Mu.Unlock()
		return nil
	}
	w.Mu.Unlock()
	if err := w.WindowOp(wr); err != nil {
		return err
	}
	w.sendCQ.Push(rdma.Completion{WRID: wr.ID, Op: wr.Op})
	return nil
}

// post appends wr to one of w's queues, after the checks both share.
func (w *WorkQueues) post(queue *[]rdma.WorkRequest, wr rdma.WorkRequest, send bool) error {
	if _, err := Local(w.owner, wr.Local); err != nil {
		return err
	}
	if w.maxLen > 0 && wr.Local.Length > w.maxLen {
		return fmt.Errorf("%w: %d bytes exceed the largest message", rdma.ErrBadRequest, wr.Local.Length)
	}
	w.Mu.Lock()
	defer w.Mu.Unlock()
	switch {
	case w.QPState == rdma.StateError:
		return rdma.ErrQPError
	case send && w.QPState != rdma.StateRTS:
		return rdma.ErrNotConnected
	case send && len(w.SQ)+len(w.InFlight) >= w.depth, !send && len(w.RQ) >= w.depth:
		return rdma.ErrQueueFull
	}
	*queue = append(*queue, wr)
	if send {
		w.KickLocked() // sends run on the queue pair's goroutine
	}
	return nil
}

// KickLocked wakes the goroutine that executes sends; the caller holds Mu.
func (w *WorkQueues) KickLocked() {
	select {
	case w.Wake <- struct{}{}:
	default:
	}
}

// FailLocked moves w to the error state, unless it is there already (then it
// reports false): head, if given, completes first, then every outstanding
// work request, send and receive, with FlushError. The state changes before
// any of these completions can be seen. The caller holds Mu.
func (w *WorkQueues) FailLocked(head *rdma.Completion) bool {
	if w.QPState == rdma.StateError {
		return false
	}
	w.QPState = rdma.StateError
	if head != nil {
		w.sendCQ.Push(*head)
	}
	for _, q := range [][]rdma.WorkRequest{w.HeldWindows, w.InFlight, w.SQ} {
		for _, wr := range q {
			w.sendCQ.Push(rdma.Completion{WRID: wr.ID, Op: wr.Op, Status: rdma.FlushError})
		}
	}
	for _, wr := range w.RQ {
		w.recvCQ.Push(rdma.Completion{WRID: wr.ID, Op: rdma.OpRecv, Status: rdma.FlushError})
	}
	w.HeldWindows, w.InFlight, w.SQ, w.RQ = nil, nil, nil, nil
	w.KickLocked()
	return true
}

// TakeRecvLocked consumes the head of the receive queue, if w is ready to
// receive; the caller holds Mu.
func (w *WorkQueues) TakeRecvLocked() (rdma.WorkRequest, bool) {
	if w.QPState != rdma.StateRTS || len(w.RQ) == 0 {
		return rdma.WorkRequest{}, false
	}
	wr := w.RQ[0]
	w.RQ = w.RQ[1:]
	return wr, true
}

// Pause implements rdma.Faults: nothing more executes until Resume.
func (w *WorkQueues) Pause() {
	w.Mu.Lock()
	w.Paused = true
	w.Mu.Unlock()
}

// Resume implements rdma.Faults: held binds and invalidates run first, in
// order; one refused now fails the queue pair, as a NIC's bind error does
// (rdma has no status of its own for it: TransportError).
func (w *WorkQueues) Resume() {
	for {
		w.Mu.Lock()
		if len(w.HeldWindows) == 0 { // none posted meanwhile either
			w.Paused = false
			w.KickLocked()
			w.Mu.Unlock()
			return
		}
		wr := w.HeldWindows[0]
		w.HeldWindows = w.HeldWindows[1:]
		w.Mu.Unlock()
		if err := w.WindowOp(wr); err != nil {
			w.Mu.Lock()
			w.FailLocked(&rdma.Completion{WRID: wr.ID, Op: wr.Op, Status: rdma.TransportError})
			w.Mu.Unlock()
			continue // FailLocked flushed the rest
		}
		w.sendCQ.Push(rdma.Completion{WRID: wr.ID, Op: wr.Op})
	}
}

// CorruptNext implements rdma.Faults: the next WRITE's payload is damaged in
// transit; its source is untouched.
func (w *WorkQueues) CorruptNext() {
	w.Mu.Lock()
	w.Corrupt = true
	w.Mu.Unlock()
}

// TakeCorruptLocked reports whether the send about to execute, of op, is the
// one CorruptNext marked (SENDs are never corrupted); the caller holds Mu.
func (w *WorkQueues) TakeCorruptLocked(op rdma.Opcode) bool {
	if !w.Corrupt || op == rdma.OpSend {
		return false
	}
	w.Corrupt = false
	return true
}
