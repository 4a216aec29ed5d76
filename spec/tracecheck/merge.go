package tracecheck

import (
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/kvhandoff/kvhandoff/internal/trace"
)

// ErrTrace is wrapped by the errors of a trace that cannot be merged: a
// node's events out of order or missing, or a receive whose send no trace
// holds. Such a trace says nothing about the protocol; it is refused.
var ErrTrace = errors.New("tracecheck: inconsistent trace")

// stream is one node incarnation's events, in its own order.
type stream struct {
	id              int // its number, in the order the input starts them
	node, inc, role string
	events          []trace.Event
	pos             int
}

// end is one end of a queue pair: a node and its own id of the queue pair.
type end struct {
	node string
	qp   uint32
}

// msgKey names a SEND on one direction of a queue pair.
type msgKey struct {
	from, to, msg string
	req           uint64
}

// merge orders every node's events into one sequence that keeps each node
// incarnation's own order (Seq, which must run 1, 2, 3, ... with nothing
// missing) and message causality: a Recv comes after its Send (the k-th
// receipt of a message after its k-th send), and a prefill node's Submit
// after the router's Dispatch when the trace has a router. Among the events
// causality leaves free, the one with the earliest wall clock goes first.
// It also returns each node's role, from its Start events, and the node
// incarnation each event of out came from (incs, numbered in the input's
// order): the merge may place an old incarnation's events after its
// successor's Start, so that Start's place does not tell them apart.
//
// links pairs the two ends of each queue pair a message crossed (each node
// names a queue pair by an id of its own).
func merge(events []trace.Event) (out []trace.Event, incs []int, roles map[string]string, links map[end]end, err error) {
	var streams []*stream
	current := map[string]*stream{}
	roles, links = map[string]string{}, map[end]end{}
	sentOn := map[msgKey][]end{}
	for _, ev := range events {
		st := current[ev.Node]
		if ev.Kind == trace.Start || st == nil {
			st = &stream{id: len(streams), node: ev.Node, inc: ev.Inc, role: ev.Role}
			streams = append(streams, st)
			current[ev.Node] = st
			if ev.Role != "" {
				roles[ev.Node] = ev.Role
			}
		}
		if n := len(st.events); n > 0 && ev.Seq != st.events[n-1].Seq+1 {
			return nil, nil, nil, nil, fmt.Errorf("%w: node %s: event %d follows %d (events missing or out of order)", ErrTrace, ev.Node, ev.Seq, st.events[n-1].Seq)
		}
		st.events = append(st.events, ev)
	}
	router := false
	for _, r := range roles {
		router = router || r == "router"
	}
	sent, received := map[msgKey]int{}, map[msgKey]int{}
	dispatched := map[uint64]bool{}
	blocked := func(ev *trace.Event) bool {
		switch ev.Kind {
		case trace.Recv:
			k := msgKey{ev.Peer, ev.Node, ev.Msg, ev.Req}
			return received[k] >= sent[k]
		case trace.Submit:
			return router && !dispatched[ev.Req]
		}
		return false
	}
	out, incs = make([]trace.Event, 0, len(events)), make([]int, 0, len(events))
	for {
		var best *stream
		left := 0
		for _, st := range streams {
			if st.pos == len(st.events) {
				continue
			}
			left++
			ev := &st.events[st.pos]
			if blocked(ev) {
				continue
			}
			if best == nil || ev.T < best.events[best.pos].T {
				best = st
			}
		}
		if left == 0 {
			return out, incs, roles, links, nil
		}
		if best == nil {
			var heads []string
			for _, st := range streams {
				if st.pos < len(st.events) {
					ev := st.events[st.pos]
					heads = append(heads, fmt.Sprintf("%s #%d %s %s req %d from %s", ev.Node, ev.Seq, ev.Kind, ev.Msg, ev.Req, ev.Peer))
				}
			}
			sort.Strings(heads)
			return nil, nil, nil, nil, fmt.Errorf("%w: every node waits for a message no trace sent: %s", ErrTrace, strings.Join(heads, "; "))
		}
		ev := best.events[best.pos]
		best.pos++
		switch ev.Kind {
		case trace.Send:
			k := msgKey{ev.Node, ev.Peer, ev.Msg, ev.Req}
			sent[k]++
			sentOn[k] = append(sentOn[k], end{ev.Node, ev.QP})
		case trace.Recv:
			k := msgKey{ev.Peer, ev.Node, ev.Msg, ev.Req}
			received[k]++
			from, here := sentOn[k][0], end{ev.Node, ev.QP}
			sentOn[k] = sentOn[k][1:]
			if from.qp != 0 && here.qp != 0 {
				links[from], links[here] = here, from
			}
		case trace.Dispatch:
			dispatched[ev.Req] = true
		}
		out, incs = append(out, ev), append(incs, best.id)
	}
}
