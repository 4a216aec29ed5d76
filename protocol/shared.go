package protocol

import (
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
)

// SharedReceiver is a Receiver that decode workers, a timer and the transport's
// completion poller may call concurrently. Every method holds one lock for its
// whole effect, so each call takes effect at one instant between its call and
// its return (it is linearizable; package linearizability checks this on
// histories from real concurrent runs).
type SharedReceiver struct {
	mu sync.Mutex
	r  *Receiver
}

// NewSharedReceiver returns a concurrency-safe receiver. The concurrency bugs
// of the catalogue (stale-status, split-acquire) are not here: they are
// wrappers in the module's internal/research/racy, and a config that asks for
// them is refused.
func NewSharedReceiver(cfg ReceiverConfig) (*SharedReceiver, error) {
	for _, sw := range research.Concurrency() {
		if cfg.Research.Has(sw) {
			return nil, fmt.Errorf("protocol: switch %v is not the receiver's: see internal/research/racy", sw)
		}
	}
	r, err := NewReceiver(cfg)
	if err != nil {
		return nil, err
	}
	return &SharedReceiver{r: r}, nil
}

// Step handles a message from a sender (see Receiver.Step).
func (s *SharedReceiver) Step(peer PeerID, m Message, now time.Time) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.r.Step(peer, m, now)
}

// Cancel ends a request (see Receiver.Cancel).
func (s *SharedReceiver) Cancel(id RequestID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.r.Cancel(id)
}

// Status is the request's state (see Receiver.Status).
func (s *SharedReceiver) Status(id RequestID) ReceiverStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.r.Status(id)
}

// Acquire hands a verified request's pages to a decode worker (see Receiver.Acquire).
func (s *SharedReceiver) Acquire(id RequestID) ([]PageRef, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.r.Acquire(id)
}

// Finish ends a read (see Receiver.Finish).
func (s *SharedReceiver) Finish(id RequestID) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.r.Finish(id)
}

// Tick fails reserved requests past their deadline (see Receiver.Tick).
func (s *SharedReceiver) Tick(now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.r.Tick(now)
}

// QueuePairFenced fences every request on peer (see Receiver.QueuePairFenced).
func (s *SharedReceiver) QueuePairFenced(peer PeerID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.r.QueuePairFenced(peer)
}

// Stats is the prefix cache's counters (see Receiver.Stats).
func (s *SharedReceiver) Stats() ReceiverStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.r.Stats()
}

// Effects hands over the accumulated effects (see Receiver.Effects), in
// slices of their own: concurrent callers may hold them as long as they like.
func (s *SharedReceiver) Effects() ReceiverEffects {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.r.Effects()
	return ReceiverEffects{Sends: slices.Clone(e.Sends), Cuts: slices.Clone(e.Cuts),
		Verified: slices.Clone(e.Verified), Outcomes: slices.Clone(e.Outcomes)}
}

// RequestOf is the request a message is about.
func RequestOf(m Message) RequestID {
	if isNil(m) {
		return 0
	}
	switch m := m.(type) {
	case *Bootstrap:
		return m.Request
	case *Done:
		return m.Request
	case *AbortAck:
		return m.Request
	case *Grant:
		return m.Request
	case *Abort:
		return m.Request
	}
	return 0
}

// SharedSender is a Sender that prefill workers, the router and the transport's
// completion poller may call concurrently: one lock per call, so every call is
// linearizable.
type SharedSender struct {
	mu sync.Mutex
	s  *Sender
}

// NewSharedSender returns a concurrency-safe sender.
func NewSharedSender(cfg SenderConfig) (*SharedSender, error) {
	s, err := NewSender(cfg)
	if err != nil {
		return nil, err
	}
	return &SharedSender{s: s}, nil
}

// Submit is the sender's intake (see Sender.Submit).
func (s *SharedSender) Submit(id RequestID, peer PeerID, tokens int) ([]uint32, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.s.Submit(id, peer, tokens)
}

// SubmitWith is the sender's intake with the router's ticket, scope and
// chain (see Sender.SubmitWith).
func (s *SharedSender) SubmitWith(id RequestID, peer PeerID, tokens int, o SubmitOptions) ([]uint32, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.s.SubmitWith(id, peer, tokens, o)
}

// Computed says the KV is ready (see Sender.Computed).
func (s *SharedSender) Computed(id RequestID) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.s.Computed(id)
}

// ComputedPages says the first n pages' KV is ready (see Sender.ComputedPages).
func (s *SharedSender) ComputedPages(id RequestID, n int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.s.ComputedPages(id, n)
}

// Step handles a message from a receiver (see Sender.Step).
func (s *SharedSender) Step(peer PeerID, m Message) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.s.Step(peer, m)
}

// Completed reports a WRITE completion (see Sender.Completed).
func (s *SharedSender) Completed(writeID uint64, err error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.s.Completed(writeID, err)
}

// Cancel stops a request (see Sender.Cancel).
func (s *SharedSender) Cancel(id RequestID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.s.Cancel(id)
}

// Flushed fails every request on a broken queue pair (see Sender.Flushed).
func (s *SharedSender) Flushed(peer PeerID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.s.Flushed(peer)
}

// Status is the request's state (see Sender.Status).
func (s *SharedSender) Status(id RequestID) SenderStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.s.Status(id)
}

// Effects hands over the accumulated effects (see Sender.Effects), in slices
// of their own: concurrent callers may hold them as long as they like.
func (s *SharedSender) Effects() SenderEffects {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.s.Effects()
	return SenderEffects{Ops: slices.Clone(e.Ops), Outcomes: slices.Clone(e.Outcomes)}
}
