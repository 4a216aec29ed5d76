package transfer

import (
	"github.com/kvhandoff/kvhandoff/internal/trace"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// msgEvent is the trace event of a SEND m on queue pair c (docs/trace.md).
func msgEvent(kind string, c *conn, m protocol.Message) trace.Event {
	ev := trace.Event{Kind: kind, Peer: c.name, QP: uint32(c.peer), Req: uint64(protocol.RequestOf(m))}
	switch m := m.(type) {
	case *protocol.Bootstrap:
		ev.Msg, ev.Tokens = "Bootstrap", m.Tokens
	case *protocol.Grant:
		ev.Msg, ev.Tokens, ev.Prefix = "Grant", m.Tokens, m.Prefix
		ev.Pages, ev.Epochs = make([]uint32, len(m.Pages)), make([]uint64, len(m.Pages))
		for i, g := range m.Pages {
			ev.Pages[i], ev.Epochs[i] = g.Page, g.Epoch
		}
	case *protocol.Done:
		ev.Msg, ev.Tokens, ev.NPages, ev.Prefix = "Done", m.Tokens, m.Pages, m.Prefix
	case *protocol.Abort:
		ev.Msg, ev.Reason = "Abort", m.Reason.String()
	case *protocol.AbortAck:
		ev.Msg = "AbortAck"
	}
	return ev
}

// writeEvent is the trace event of a WRITE handed to queue pair c.
func writeEvent(c *conn, w *protocol.Write) trace.Event {
	return trace.Event{Kind: trace.Post, Peer: c.name, QP: uint32(c.peer), Req: uint64(w.Request), Write: w.ID, Index: w.Index,
		Pages: []uint32{w.Remote.Page}, Epochs: []uint64{w.Remote.Epoch}}
}

// errText is err's text for a trace, "" for nil.
func errText(err error) string { return trace.ErrText(err) }

// refEvent is an event of kind naming the pages refs.
func refEvent(kind string, id protocol.RequestID, refs []protocol.PageRef, err error) trace.Event {
	ev := trace.Event{Kind: kind, Req: uint64(id), Err: errText(err)}
	for _, r := range refs {
		ev.Pages, ev.Epochs = append(ev.Pages, r.Page), append(ev.Epochs, r.Epoch)
	}
	return ev
}

// opEvent is the trace event of an Op handed to queue pair c.
func opEvent(c *conn, op protocol.Op) trace.Event {
	if op.Write != nil {
		return writeEvent(c, op.Write)
	}
	return msgEvent(trace.Send, c, op.Msg)
}

// qpEvent is an event of kind on queue pair c.
func qpEvent(kind string, c *conn) trace.Event {
	return trace.Event{Kind: kind, Peer: c.name, QP: uint32(c.peer)}
}
