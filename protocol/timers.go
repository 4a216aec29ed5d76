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
