package main

import (
	"errors"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/rdma"
)

// A pacedDevice emulates a link slower than the provider's own: every queue
// pair made on it sends its work requests in order, each no sooner than a
// link of rate bytes per second would have carried the bytes before it and
// its own (as netem's rate does to a socket). The provider still does the
// work; the pacing only holds each request back until its time.
//
// Why: on this machine the built-in model computes a 1,024-token prompt in
// about 200 ms and the in-process provider moves its 4 MiB of KV in about 1
// ms, so there is no transfer for streaming to hide. Deployments stand the
// other way round: a GPU prefill is fast and its KV large (an 8B model's
// 1,024 tokens are 128 MiB), so moving it takes a share of the compute time
// that depends on the network. The benchmark's --stream-link sets that
// share.
type pacedDevice struct {
	rdma.Device
	rate float64 // bytes per second
}

func (d pacedDevice) AllocPD() (rdma.ProtectionDomain, error) {
	pd, err := d.Device.AllocPD()
	if err != nil {
		return nil, err
	}
	return pacedPD{pd, d.rate}, nil
}

type pacedPD struct {
	rdma.ProtectionDomain
	rate float64
}

func (pd pacedPD) CreateQP(sendCQ, recvCQ rdma.CompletionQueue, depth int) (rdma.QueuePair, error) {
	qp, err := pd.ProtectionDomain.CreateQP(sendCQ, recvCQ, depth)
	if err != nil {
		return nil, err
	}
	p := &pacedQP{QueuePair: qp, rate: pd.rate, queue: make(chan pacedWR, max(depth, 1)), done: make(chan struct{})}
	go p.run()
	return p, nil
}

// pacedQP forwards PostSend's work requests from one goroutine, in order,
// each at its time on the emulated link. Its queue holds as many as the
// queue pair does: past that PostSend answers rdma.ErrQueueFull, as the
// provider would, and the endpoint posts again later.
type pacedQP struct {
	rdma.QueuePair
	rate  float64
	queue chan pacedWR
	done  chan struct{}

	mu     sync.Mutex
	err    error // the first failure forwarding a request: the queue pair is broken
	closed bool
}

// pacedWR is a work request and when it was posted: the link is idle only
// if it carried everything before by then (the goroutine's own lateness
// waking from a timer must not slow the link down).
type pacedWR struct {
	wr rdma.WorkRequest
	at time.Time
}

// errLinkClosed answers PostSend once the queue pair was moved to the error
// state.
var errLinkClosed = errors.New("bench: the emulated link's queue pair is in the error state")

func (p *pacedQP) PostSend(wr rdma.WorkRequest) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err != nil {
		return p.err
	}
	if p.closed {
		return errLinkClosed
	}
	select {
	case p.queue <- pacedWR{wr, time.Now()}:
		return nil
	default:
		return rdma.ErrQueueFull
	}
}

// ToError is the fence: the provider's queue pair flushes what it holds,
// and what the link still holds back is dropped (never posted, so it
// completes nowhere; the endpoint fails the requests of a broken queue pair
// as a whole).
func (p *pacedQP) ToError() error {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		close(p.done)
	}
	p.mu.Unlock()
	return p.QueuePair.ToError()
}

func (p *pacedQP) run() {
	var free time.Time // when the link has carried everything before
	for {
		var pw pacedWR
		select {
		case pw = <-p.queue:
		case <-p.done:
			return
		}
		wr := pw.wr
		if free.Before(pw.at) {
			free = pw.at
		}
		free = free.Add(time.Duration(float64(wr.Local.Length) / p.rate * float64(time.Second)))
		if wait := time.Until(free); wait > 0 {
			select {
			case <-time.After(wait):
			case <-p.done:
				return
			}
		}
		for {
			err := p.QueuePair.PostSend(wr)
			if err == nil {
				break
			}
			if errors.Is(err, rdma.ErrQueueFull) { // the endpoint polls its completions: a slot frees
				time.Sleep(20 * time.Microsecond)
				continue
			}
			p.mu.Lock()
			p.err = err
			p.mu.Unlock()
			p.ToError()
			return
		}
	}
}
