package protocol

import "time"

// timer is a moment at which something may be due for a request: a deadline
// or the end of a record's horizon. Timers are never removed when their
// reason goes away; whoever pops one checks that it still applies (the
// record is the same and in the state the timer was set for).
type timer[R any] struct {
	at  time.Time
	id  RequestID
	rec *R // the record the timer was set for: a forgotten and re-created request is another record
}

// timers is a min-heap of timers by (at, id), so that what is due at one
// instant comes out in request order and a Tick costs O(due · log n), not a
// visit of every record.
type timers[R any] []timer[R]

func (h timers[R]) less(i, j int) bool {
	if !h[i].at.Equal(h[j].at) {
		return h[i].at.Before(h[j].at)
	}
	return h[i].id < h[j].id
}

func (h *timers[R]) push(t timer[R]) {
	*h = append(*h, t)
	s := *h
	for i := len(s) - 1; i > 0; {
		parent := (i - 1) / 2
		if !s.less(i, parent) {
			break
		}
		s[i], s[parent] = s[parent], s[i]
		i = parent
	}
}

// popDue removes and returns the earliest timer if it is due at now.
func (h *timers[R]) popDue(now time.Time) (timer[R], bool) {
	s := *h
	if len(s) == 0 || now.Before(s[0].at) {
		return timer[R]{}, false
	}
	top := s[0]
	last := len(s) - 1
	s[0] = s[last]
	s[last] = timer[R]{} // drop the record pointer
	s = s[:last]
	for i := 0; ; {
		small, l, r := i, 2*i+1, 2*i+2
		if l < len(s) && s.less(l, small) {
			small = l
		}
		if r < len(s) && s.less(r, small) {
			small = r
		}
		if small == i {
			break
		}
		s[i], s[small] = s[small], s[i]
		i = small
	}
	*h = s
	return top, true
}

// queue is a first-in first-out list of timers, for horizons: every record's
// age starts at a Tick, and Ticks come in time order, so timers are pushed in
// the order they fall due and none needs sorting. A timer earlier than the
// last one pushed (a Tick whose now went back) is moved to the last one's
// time: its record is kept a little longer, never forgotten early.
type queue[R any] struct {
	items []timer[R]
	head  int
	last  time.Time
}

func (q *queue[R]) push(t timer[R]) {
	if t.at.Before(q.last) {
		t.at = q.last
	}
	q.last = t.at
	q.items = append(q.items, t)
}

// pop removes and returns the first timer, due or not.
func (q *queue[R]) pop() (timer[R], bool) {
	if q.head == len(q.items) {
		return timer[R]{}, false
	}
	return q.popDue(q.items[q.head].at)
}

// popDue removes and returns the first timer if it is due at now.
func (q *queue[R]) popDue(now time.Time) (timer[R], bool) {
	if q.head == len(q.items) || now.Before(q.items[q.head].at) {
		return timer[R]{}, false
	}
	t := q.items[q.head]
	q.items[q.head] = timer[R]{} // drop the record pointer
	q.head++
	switch {
	case q.head == len(q.items):
		q.items, q.head = q.items[:0], 0
	case q.head >= 1024 && q.head >= len(q.items)/2: // reclaim the popped half
		n := copy(q.items, q.items[q.head:])
		clear(q.items[n:])
		q.items, q.head = q.items[:n], 0
	}
	return t, true
}
