package linearizability

import (
	"fmt"
	"sort"

	"github.com/anishathalye/porcupine"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// OpKind is an operation of the concurrent receiver API.
type OpKind uint8

// The operations.
const (
	OpBootstrap OpKind = iota
	OpDone
	OpCancel
	OpStatus
	OpAcquire
	OpFinish
	OpCut
)

func (k OpKind) String() string {
	return [...]string{"Bootstrap", "Done", "Cancel", "Status", "Acquire", "Finish", "Cut"}[k]
}

// Input is an operation's call.
type Input struct {
	Kind    OpKind
	Request protocol.RequestID
}

// Output is an operation's return.
type Output struct {
	OK         bool                    // the call succeeded (nil error)
	Status     protocol.ReceiverStatus // the receiver's Status answer
	SendStatus protocol.SenderStatus   // the sender's Status answer
	Unknown    bool                    // the caller did not wait: the outcome is unknown
}

// step is the receiver's sequential semantics for one request, as seen through
// the concurrent API. It returns the possible next states (none if the output
// is impossible in state s).
func step(s protocol.ReceiverStatus, in Input, out Output) []protocol.ReceiverStatus {
	next, ok := s, true // the state after the call, and the result it must report
	switch in.Kind {
	case OpBootstrap:
		switch s {
		case protocol.ReceiverNone:
			next = protocol.ReceiverReserved
		case protocol.ReceiverTombstone:
		default:
			ok = false // a duplicate
		}
	case OpDone:
		switch s {
		case protocol.ReceiverReserved:
			next = protocol.ReceiverReady
		case protocol.ReceiverQuarantine:
			next = protocol.ReceiverClosed // a late Done is the fence
		case protocol.ReceiverNone, protocol.ReceiverReady, protocol.ReceiverReading:
			ok = false // unknown request, or a second Done
		}
	case OpCancel:
		switch s {
		case protocol.ReceiverNone:
			next = protocol.ReceiverTombstone
		case protocol.ReceiverReserved:
			next = protocol.ReceiverQuarantine
		case protocol.ReceiverReady:
			next = protocol.ReceiverClosed
		}
		if out.Unknown { // fire-and-forget: applied, or not (yet, or ever)
			return dedupe(next, s)
		}
		return []protocol.ReceiverStatus{next}
	case OpStatus:
		if out.Status != s {
			return nil
		}
		return []protocol.ReceiverStatus{s}
	case OpAcquire:
		if s == protocol.ReceiverReady {
			next = protocol.ReceiverReading
		} else {
			ok = false
		}
	case OpFinish:
		if s == protocol.ReceiverReading {
			next = protocol.ReceiverFinished
		} else {
			ok = false
		}
	case OpCut:
		if s == protocol.ReceiverReserved || s == protocol.ReceiverQuarantine {
			next = protocol.ReceiverClosed
		}
		return []protocol.ReceiverStatus{next}
	}
	if out.OK != ok {
		return nil
	}
	return []protocol.ReceiverStatus{next}
}

func dedupe(a, b protocol.ReceiverStatus) []protocol.ReceiverStatus {
	if a == b {
		return []protocol.ReceiverStatus{a}
	}
	return []protocol.ReceiverStatus{a, b}
}

// Model is the porcupine model of the concurrent receiver, partitioned by request.
var Model = porcupine.NondeterministicModel{
	Init: func() []interface{} { return []interface{}{protocol.ReceiverNone} },
	Step: func(state, input, output interface{}) []interface{} {
		var out []interface{}
		for _, s := range step(state.(protocol.ReceiverStatus), input.(Input), output.(Output)) {
			out = append(out, s)
		}
		return out
	},
	Partition: func(history []porcupine.Operation) [][]porcupine.Operation {
		by := map[protocol.RequestID][]porcupine.Operation{}
		for _, op := range history {
			id := op.Input.(Input).Request
			by[id] = append(by[id], op)
		}
		ids := make([]protocol.RequestID, 0, len(by))
		for id := range by {
			ids = append(ids, id)
		}
		sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
		out := make([][]porcupine.Operation, 0, len(ids))
		for _, id := range ids {
			out = append(out, by[id])
		}
		return out
	},
	DescribeOperation: func(input, output interface{}) string {
		in, out := input.(Input), output.(Output)
		switch {
		case out.Unknown:
			return fmt.Sprintf("%s(r%d) -> ? (not awaited)", in.Kind, in.Request)
		case in.Kind == OpStatus:
			return fmt.Sprintf("Status(r%d) -> %s", in.Request, out.Status)
		case in.Kind == OpCancel || in.Kind == OpCut:
			return fmt.Sprintf("%s(r%d)", in.Kind, in.Request)
		case out.OK:
			return fmt.Sprintf("%s(r%d) -> ok", in.Kind, in.Request)
		}
		return fmt.Sprintf("%s(r%d) -> error", in.Kind, in.Request)
	},
	DescribeState: func(state interface{}) string { return state.(protocol.ReceiverStatus).String() },
}
