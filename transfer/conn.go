package transfer

import (
	"errors"
	"fmt"
	"io"

	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma"
)

const (
	// RecvSlots is the number of receive buffers an endpoint keeps posted on
	// each queue pair: the credits its peer starts with.
	RecvSlots = 64
	tagSlots  = 256 // tag-record buffers per queue pair on the prefill side
	// creditUpdateAt is how many reposted buffers (of messages that were not
	// credit updates themselves) a side owes before it sends a credit update
	// when it has no message to carry them.
	creditUpdateAt = RecvSlots / 4
)

// Work request ids carry the queue pair's peer id, so that completions on an
// endpoint's one completion queue find their queue pair, and those of a queue
// pair torn down find nothing.
const recvBit = 1 << 63

func recvWRID(peer protocol.PeerID, slot int) uint64 {
	return recvBit | uint64(peer)<<32 | uint64(uint32(slot))
}
func wridPeer(id uint64) protocol.PeerID { return protocol.PeerID(id >> 32 & 0x7fffffff) }
func wridSlot(id uint64) int             { return int(uint32(id)) }

// wrKind is what an outstanding send-queue work request is.
type wrKind struct {
	window  uint8              // wrBind or wrInvalidate (decode's windows); 0 otherwise
	req     protocol.RequestID // the request whose window it binds or invalidates
	write   uint64             // the protocol's WRITE id; 0 for a SEND
	payload bool               // the payload half of a page's two WRITEs
	tag     int                // the tag-record buffer it reads; -1 if none
	msg     int                // the message buffer it reads; -1 if none
}

// buffers are a queue pair's registered buffers. Regions cannot be
// deregistered, so an endpoint reuses the buffers of a queue pair torn down.
type buffers struct {
	in, out rdma.MemoryRegion // receive buffers (inSlot each), send buffers (outSlot each)
	tags    rdma.MemoryRegion // tag-record staging (prefill)
}

// conn is one RC queue pair to one peer, with its buffers, its backlog and
// its credits. Both endpoints use it: what differs is who reads its messages.
//
// Credits: every SEND carries, as immediate data, the number of receive
// buffers its sender reposted since its last SEND (what it owes the peer).
// A side sends a message only against a credit, keeping the last one for a
// credit update (a SEND of no bytes), which it sends when it owes
// creditUpdateAt buffers of real messages and has no message to carry them.
// A credit update's own buffer is returned only by a later SEND, never by an
// update, so updates never answer each other; and since at most one credit
// per side waits in that way, a side is never left without credits while
// its peer owes it more than creditUpdateAt.
type conn struct {
	peer protocol.PeerID
	name string
	// incarnation is the peer's life that set the queue pair up, as its
	// hello said (0: not said).
	incarnation uint64
	qp          rdma.QueuePair
	tagKey      *protocol.TagKey // the tag records' key, agreed at setup; set before the queue pair goes live
	bufs        *buffers
	inSlot      int
	outSlot     int
	depth       int // work requests outstanding on the send queue, at most
	// maxPages is the largest request whose Grant the peer's receive buffers
	// hold (decode) or this side's do (prefill).
	maxPages int

	outFree, tagFree []int
	wrs              map[uint64]wrKind // outstanding send-queue work requests
	seq              uint32

	credits     int // receive buffers the peer has posted that no SEND of ours will take
	owedData    int // buffers reposted for messages, not yet advertised
	owedUpdates int // buffers reposted for credit updates, not yet advertised

	backlog       []protocol.Op // in order: the queue pair cannot take them yet
	payloadPosted bool          // the head of backlog is a WRITE whose payload half is posted
	// headRuns are the window runs of the Grant at the head of backlog
	// (decode), computed once however many flushes it waits through.
	headRuns grantRuns

	// sentHook, if set (tests), sees each control message as it is posted,
	// a Grant with the keys its windows were bound under.
	sentHook func(protocol.Message)

	live   bool      // set up and not torn down: new requests may use it
	doomed bool      // its life was cut while it was being set up: it never goes live
	broken bool      // in the error state: flush completions are draining
	ctl    io.Closer // the out-of-band control connection, closed at teardown
	err    error     // why it broke
}

func newConn(peer protocol.PeerID, name string, qp rdma.QueuePair, b *buffers, inSlot, outSlot, depth, maxPages int) *conn {
	c := &conn{peer: peer, name: name, qp: qp, bufs: b, inSlot: inSlot, outSlot: outSlot, depth: depth, maxPages: maxPages,
		wrs: map[uint64]wrKind{}, credits: RecvSlots}
	for i := RecvSlots - 1; i >= 0; i-- {
		c.outFree = append(c.outFree, i)
	}
	if b.tags != nil {
		for i := tagSlots - 1; i >= 0; i-- {
			c.tagFree = append(c.tagFree, i)
		}
	}
	return c
}

// postRecvs posts every receive buffer: before the peer can send.
func (c *conn) postRecvs() error {
	for i := 0; i < RecvSlots; i++ {
		if err := c.repost(i); err != nil {
			return err
		}
	}
	return nil
}

func (c *conn) repost(slot int) error {
	return c.qp.PostRecv(rdma.WorkRequest{ID: recvWRID(c.peer, slot), Op: rdma.OpRecv,
		Local: rdma.SGE{MR: c.bufs.in, Offset: slot * c.inSlot, Length: c.inSlot}})
}

// fail moves the queue pair to the error state (the fence, on the
// responder) and closes the control connection; its flush completions then
// drain.
func (c *conn) fail(why error) {
	if c.broken {
		return
	}
	c.broken, c.live, c.err = true, false, why
	c.backlog, c.payloadPosted = nil, false
	c.qp.ToError()
	if c.ctl != nil {
		c.ctl.Close()
	}
}

// drained says a broken queue pair has no work request left to complete.
func (c *conn) drained() bool { return c.broken && len(c.wrs) == 0 }

// received handles a receive completion: the credits it carries, the buffer
// reposted, and the message, nil for a credit update. An error means the peer
// broke the protocol of the queue pair itself; the caller fails it.
func (c *conn) received(wc rdma.Completion) (protocol.Message, error) {
	slot := wridSlot(wc.WRID)
	if slot < 0 || slot >= RecvSlots || wc.Bytes < 0 || wc.Bytes > c.inSlot {
		return nil, fmt.Errorf("transfer: receive completion for buffer %d of %d bytes", slot, wc.Bytes)
	}
	if wc.HasImm {
		if int64(c.credits)+int64(wc.Imm) > RecvSlots {
			return nil, fmt.Errorf("transfer: peer %q returned %d credits, %d held of %d", c.name, wc.Imm, c.credits, RecvSlots)
		}
		c.credits += int(wc.Imm)
	}
	var m protocol.Message
	if wc.Bytes > 0 {
		var err error
		off := slot * c.inSlot
		var used int
		if m, used, err = protocol.DecodeMessage(c.bufs.in.Bytes()[off : off+wc.Bytes]); err != nil {
			return nil, fmt.Errorf("transfer: from peer %q: %w", c.name, err)
		}
		if used != wc.Bytes {
			// One SEND carries one frame: bytes after it are not ignored.
			return nil, fmt.Errorf("transfer: from peer %q: %w: %d bytes after a %d-byte frame", c.name, protocol.ErrMalformed, wc.Bytes-used, used)
		}
	}
	if c.repost(slot) == nil {
		if m != nil {
			c.owedData++
		} else {
			c.owedUpdates++
		}
	}
	return m, nil
}

// owed takes what this side owes the peer, for the SEND about to carry it.
func (c *conn) owed() uint32 {
	n := c.owedData + c.owedUpdates
	c.owedData, c.owedUpdates = 0, 0
	return uint32(n)
}

// postSend posts one work request and remembers it.
func (c *conn) postSend(wr rdma.WorkRequest, k wrKind) error {
	c.seq++
	wr.ID = uint64(c.peer)<<32 | uint64(c.seq)
	if err := c.qp.PostSend(wr); err != nil {
		return err
	}
	c.wrs[wr.ID] = k
	return nil
}

// sent handles a send-queue completion: the buffers it read are free again.
func (c *conn) sent(wrid uint64) (wrKind, bool) {
	k, ok := c.wrs[wrid]
	if !ok {
		return k, false
	}
	delete(c.wrs, wrid)
	if k.tag >= 0 {
		c.tagFree = append(c.tagFree, k.tag)
	}
	if k.msg >= 0 {
		c.outFree = append(c.outFree, k.msg)
	}
	return k, true
}

// flush posts the head of the backlog, in order, while the send queue has
// room, a buffer is free and (for a SEND) the peer has a credit to spare;
// then a credit update if one is owed. src and pageBytes locate source pages
// (prefill). After a failed post the queue pair is broken: what is left is
// dropped, and the state machine learns of it when the flush has drained.
// On decode, a Grant's windows are bound (wins) just before its SEND.
func (c *conn) flush(src rdma.MemoryRegion, pageBytes int, wins *grantWindows) error {
	for len(c.backlog) > 0 && !c.broken {
		op := c.backlog[0]
		var err error
		if w := op.Write; w != nil {
			if len(c.wrs)+2 > c.depth || len(c.tagFree) == 0 {
				break
			}
			if !c.payloadPosted { // the payload half may be posted already, if the tag's post was refused
				err = c.postSend(rdma.WorkRequest{Op: rdma.OpWrite,
					Local:      rdma.SGE{MR: src, Offset: int(w.Source) * pageBytes, Length: pageBytes},
					RemoteAddr: w.Remote.Addr, RKey: w.Remote.Key}, wrKind{write: w.ID, payload: true, tag: -1, msg: -1})
				c.payloadPosted = err == nil
			}
			if err == nil {
				tag := c.tagFree[len(c.tagFree)-1]
				copy(c.bufs.tags.Bytes()[tag*protocol.TagSize:], w.Tag)
				err = c.postSend(rdma.WorkRequest{Op: rdma.OpWrite,
					Local:      rdma.SGE{MR: c.bufs.tags, Offset: tag * protocol.TagSize, Length: protocol.TagSize},
					RemoteAddr: w.Remote.Addr + uint64(pageBytes), RKey: w.Remote.Key}, wrKind{write: w.ID, tag: tag, msg: -1})
				if err == nil {
					c.tagFree = c.tagFree[:len(c.tagFree)-1]
					c.payloadPosted = false
				}
			}
		} else {
			if len(c.outFree) == 0 || c.credits < 2 {
				break // the last credit is kept for a credit update
			}
			binds := wins.binds(c, op.Msg)
			// Room for the binds and the SEND; a queue pair with nothing
			// outstanding takes a Grant of more runs than its depth.
			if len(c.wrs)+binds >= c.depth && len(c.wrs) > 0 {
				break
			}
			if binds > 0 {
				if err := wins.bind(c, op.Msg.(*protocol.Grant)); err != nil {
					c.fail(fmt.Errorf("%w: %v", protocol.ErrPeerFailed, err))
					return nil
				}
			}
			slot := c.outFree[len(c.outFree)-1]
			off := slot * c.outSlot
			frame, ferr := protocol.AppendMessage(c.bufs.out.Bytes()[off:off:off+c.outSlot], op.Msg)
			if ferr != nil || len(frame) > c.outSlot {
				// Intake keeps every frame within its buffer; one that is not
				// is this node's bug, and must not wedge the queue pair.
				c.backlog = c.backlog[1:]
				return fmt.Errorf("transfer: %s to peer %q: %d-byte frame, %d-byte buffers: %v", op.Msg.Type(), c.name, len(frame), c.outSlot, ferr)
			}
			imm := c.owed()
			err = c.postSend(rdma.WorkRequest{Op: rdma.OpSend, Local: rdma.SGE{MR: c.bufs.out, Offset: off, Length: len(frame)},
				Imm: imm, HasImm: true}, wrKind{tag: -1, msg: slot})
			if err == nil {
				c.outFree = c.outFree[:len(c.outFree)-1]
				c.credits--
				if c.sentHook != nil {
					c.sentHook(op.Msg)
				}
			} else {
				c.owedData += int(imm) // not sent: still owed
			}
		}
		switch {
		case err == nil:
			c.backlog = c.backlog[1:]
			c.headRuns = grantRuns{}
		case errors.Is(err, rdma.ErrQueueFull):
			return nil
		default:
			c.fail(err)
			return nil
		}
	}
	if !c.broken && c.owedData >= creditUpdateAt && c.credits >= 1 && len(c.wrs) < c.depth {
		imm := c.owed()
		if err := c.postSend(rdma.WorkRequest{Op: rdma.OpSend, Local: rdma.SGE{MR: c.bufs.out, Length: 0}, Imm: imm, HasImm: true},
			wrKind{tag: -1, msg: -1}); err != nil {
			c.owedData += int(imm)
			if !errors.Is(err, rdma.ErrQueueFull) {
				c.fail(err)
			}
			return nil
		}
		c.credits--
	}
	return nil
}

// maxBootstrapFrame is the largest frame a prefill node sends for requests
// of at most pages pages: a Bootstrap with a chain of every page and a
// ticket of protocol.MaxTicket bytes (Done, Abort and AbortAck are
// smaller). A decode node's receive buffers and a prefill node's send
// buffers are this size.
func maxBootstrapFrame(pages int) int {
	pages = max(1, min(pages, protocol.MaxGrantPages))
	frame, err := protocol.AppendMessage(nil, &protocol.Bootstrap{Request: 1, Tokens: protocol.MaxTokens, Scope: 1,
		Chain: make([]protocol.ChainHash, pages), Ticket: make([]byte, protocol.MaxTicket)})
	if err != nil {
		panic(err) // within the wire's limits
	}
	return max(len(frame), MaxFrame(1))
}

// MaxFrame is the largest control-message frame for requests of at most
// pages pages: the Grant naming every page, or a Bootstrap with a chain of
// every page and a ticket of protocol.MaxTicket bytes, is the largest message there is, and the other
// messages are fixed-size. Derived by encoding each message at
// its largest, so it follows the wire format rather than a copy of it.
func MaxFrame(pages int) int {
	pages = max(1, min(pages, protocol.MaxGrantPages))
	largest := 0
	for _, m := range []protocol.Message{
		&protocol.Bootstrap{Request: 1, Tokens: protocol.MaxTokens, Scope: 1, Chain: make([]protocol.ChainHash, pages), Ticket: make([]byte, protocol.MaxTicket)},
		&protocol.Grant{Request: 1, Tokens: protocol.MaxTokens, Pages: make([]protocol.PageGrant, pages)},
		&protocol.Done{Request: 1, Tokens: protocol.MaxTokens, Pages: uint32(pages)},
		&protocol.Abort{Request: 1, Reason: protocol.AbortCancelled},
		&protocol.AbortAck{Request: 1},
	} {
		frame, err := protocol.AppendMessage(nil, m)
		if err != nil {
			panic(err) // every message above is within the wire's limits
		}
		largest = max(largest, len(frame))
	}
	return largest
}
