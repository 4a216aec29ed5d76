// Package racy holds the concurrency bugs of the catalogue's shared layer
// (research.StaleStatus, research.SplitAcquire) as wrappers around
// protocol.SharedReceiver, so that package linearizability can show its
// checker catches each one. They live here, not in package protocol, so that
// no code path an engine links carries them: protocol.SharedReceiver has one
// lock per call and nothing else, and refuses a config with these switches on.
package racy

import (
	"runtime"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// Receiver is the concurrent receiver API, as protocol.SharedReceiver offers it.
type Receiver interface {
	Step(peer protocol.PeerID, m protocol.Message, now time.Time) error
	Cancel(id protocol.RequestID)
	Status(id protocol.RequestID) protocol.ReceiverStatus
	Acquire(id protocol.RequestID) ([]protocol.PageRef, error)
	Finish(id protocol.RequestID) error
	Tick(now time.Time)
	QueuePairFenced(peer protocol.PeerID)
	Effects() protocol.ReceiverEffects
	Stats() protocol.ReceiverStats
}

// NewReceiver returns a protocol.SharedReceiver for cfg, with the concurrency
// switches in bugs wrapped around it; without any, the SharedReceiver itself.
// cfg.Research carries the protocol's switches only.
func NewReceiver(cfg protocol.ReceiverConfig, bugs research.Switches) (Receiver, error) {
	inner, err := protocol.NewSharedReceiver(cfg)
	if err != nil {
		return nil, err
	}
	var r Receiver = inner
	if bugs.Has(research.SplitAcquire) {
		r = &splitAcquire{Receiver: r}
	}
	if bugs.Has(research.StaleStatus) {
		r = &staleStatus{Receiver: r, cache: map[protocol.RequestID]protocol.ReceiverStatus{}}
	}
	return r, nil
}

// staleStatus is the stale-status bug: Status answers from a cache that every
// call refreshes but Cancel, so a status read can observe a state older than
// a completed cancel.
type staleStatus struct {
	Receiver
	mu    sync.Mutex
	cache map[protocol.RequestID]protocol.ReceiverStatus
}

func (s *staleStatus) refresh(id protocol.RequestID) {
	st := s.Receiver.Status(id)
	s.mu.Lock()
	s.cache[id] = st
	s.mu.Unlock()
}

func (s *staleStatus) forget() {
	s.mu.Lock()
	clear(s.cache)
	s.mu.Unlock()
}

func (s *staleStatus) Step(peer protocol.PeerID, m protocol.Message, now time.Time) error {
	err := s.Receiver.Step(peer, m, now)
	s.refresh(protocol.RequestOf(m))
	return err
}

func (s *staleStatus) Status(id protocol.RequestID) protocol.ReceiverStatus {
	s.mu.Lock()
	st, ok := s.cache[id]
	s.mu.Unlock()
	if ok {
		return st
	}
	return s.Receiver.Status(id)
}

func (s *staleStatus) Acquire(id protocol.RequestID) ([]protocol.PageRef, error) {
	refs, err := s.Receiver.Acquire(id)
	s.refresh(id)
	return refs, err
}

func (s *staleStatus) Finish(id protocol.RequestID) error {
	err := s.Receiver.Finish(id)
	s.refresh(id)
	return err
}

func (s *staleStatus) Tick(now time.Time) { s.Receiver.Tick(now); s.forget() }

func (s *staleStatus) QueuePairFenced(peer protocol.PeerID) {
	s.Receiver.QueuePairFenced(peer)
	s.forget()
}

// splitAcquire is the split-acquire bug: Acquire checks readiness, lets
// others run, then takes the pages, and reports success whatever the second
// step found: a Cancel can slip in between.
type splitAcquire struct{ Receiver }

func (s *splitAcquire) Acquire(id protocol.RequestID) ([]protocol.PageRef, error) {
	if s.Receiver.Status(id) != protocol.ReceiverReady {
		return s.Receiver.Acquire(id)
	}
	runtime.Gosched()
	refs, _ := s.Receiver.Acquire(id) // may fail now; the caller is told it worked
	return refs, nil
}
