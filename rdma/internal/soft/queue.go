// Package soft holds what the providers that work in software share: a
// completion queue kept in Go memory (packages inproc and socket complete
// everything through it, package verbs the work requests it holds back or
// flushes itself); registered regions of Go memory with their keys and
// addresses; and a queue pair's work queues, posting checks, flush and fault
// hooks (packages inproc and socket).
package soft

import (
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/rdma"
)

// Queue is a completion queue. Overrun is not modelled: the queue grows.
type Queue struct {
	mu     sync.Mutex
	items  []rdma.Completion
	notify chan struct{}
}

// New returns an empty queue.
func New() *Queue { return &Queue{notify: make(chan struct{}, 1)} }

// Push appends a completion and wakes a waiter.
func (q *Queue) Push(c rdma.Completion) {
	q.mu.Lock()
	q.items = append(q.items, c)
	q.mu.Unlock()
	select {
	case q.notify <- struct{}{}:
	default:
	}
}

// Len is the number of completions not yet polled.
func (q *Queue) Len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.items)
}

// Poll implements rdma.CompletionQueue.
func (q *Queue) Poll(max int) []rdma.Completion {
	q.mu.Lock()
	defer q.mu.Unlock()
	n := min(max, len(q.items))
	if n == 0 {
		return nil
	}
	out := append([]rdma.Completion(nil), q.items[:n]...)
	q.items = q.items[n:]
	return out
}

// Wait implements rdma.CompletionQueue.
func (q *Queue) Wait(max int, timeout time.Duration) []rdma.Completion {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		if out := q.Poll(max); len(out) > 0 {
			return out
		}
		select {
		case <-q.notify:
		case <-deadline.C:
			return q.Poll(max)
		}
	}
}

// Notify is signalled after each Push, for a waiter that also watches other
// sources of completions.
func (q *Queue) Notify() <-chan struct{} { return q.notify }
