// Package transfer runs the handoff protocol over an RDMA provider: a
// protocol.Sender on the prefill node and a protocol.Receiver on the decode
// node, joined by one reliable-connected queue pair.
//
// The decode node's pages are one registered region. Page p's payload sits at
// p*(PageBytes+TagSize) and its tag record right after it, so a grant names a
// page by the address and key of that slot. Each page the sender writes is two
// WRITEs on the queue pair, the payload and then its tag record, and Done is a
// SEND behind them: reliable-connected ordering guarantees that when Done
// arrives every WRITE before it has been placed. Control messages are SENDs of
// protocol frames into receive buffers each side keeps posted, each buffer
// sized for the largest frame the link can send (MaxFrame of the largest
// request, whose Grant names every page); both intakes refuse bigger requests,
// so no frame is ever too large to send. A cut is the
// queue pair's error state, followed by QueuePairFenced and Flushed.
//
// Backpressure: what the state machines emit goes into a backlog per side and
// is posted, in order, while the send queue has room (Config.QueueDepth) and a
// buffer is free. Every buffer a work request reads (a tag record, a control
// message) stays its own until the request completes, because a NIC reads it
// when it executes the request, not when it is posted. And a SEND goes out
// only when the peer has a receive buffer posted for it (a credit), since one
// that finds none breaks the queue pair.
//
// Link is single-threaded: Pump polls both completion queues and carries
// effects until nothing more happens. The provider's own goroutines place the
// WRITEs; Pump waits for their completions.
package transfer

import (
	"errors"
	"fmt"
	"time"

	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma"
)

// Config sizes a Link.
type Config struct {
	DecodePages  int
	PrefillPages int
	PageTokens   int
	PageBytes    int
	Timeout      time.Duration // decode's timeout for a reserved request
	QueueDepth   int           // work requests in flight on each side's send queue; 0 means 1024
	// MaxRequestPages is the largest request in pages: message buffers are
	// sized for its Grant, and both nodes' intake refuses anything bigger.
	// 0 means the smaller pool, capped at protocol.MaxGrantPages.
	MaxRequestPages int
}

const (
	recvSlots = 64  // receive buffers each side keeps posted
	sendSlots = 256 // tag-record buffers on prefill's side
)

// MaxFrame is the largest control-message frame for requests of at most
// pages pages: the Grant naming every page is the largest message there is,
// and the other messages are fixed-size. Derived by encoding each message at
// its largest, so it follows the wire format rather than a copy of it.
func MaxFrame(pages int) int {
	pages = max(1, min(pages, protocol.MaxGrantPages))
	largest := 0
	for _, m := range []protocol.Message{
		&protocol.Bootstrap{Request: 1, Tokens: protocol.MaxTokens},
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

// Link is one prefill node and one decode node over one queue pair.
type Link struct {
	cfg        Config
	Sender     *protocol.Sender
	Receiver   *protocol.Receiver
	qpP, qpD   rdma.QueuePair // prefill's and decode's ends
	cqP, cqD   rdma.CompletionQueue
	src, kv    rdma.MemoryRegion // prefill source pages; decode pages with tag slots
	tagOut     rdma.MemoryRegion // staging for outgoing tag records
	inP, inD   rdma.MemoryRegion // receive buffers
	outP, outD rdma.MemoryRegion // send buffers
	// Buffers a work request reads stay its own until it completes: a NIC
	// reads them when it executes the request, not when it is posted.
	tagFree, outFreeP, outFreeD []int
	// What the state machines emitted and the queue pair cannot take yet (its
	// send queue full, or no buffer free), in order: posting stays in order.
	backlogP      []protocol.Op
	backlogD      []protocol.Send
	payloadPosted bool // the head of backlogP is a WRITE whose payload half is posted
	// Credits: receive buffers posted on each side that no SEND in flight
	// toward it will take. A SEND goes out only against a credit, so it never
	// finds its peer without a buffer (which breaks the queue pair); the
	// credit comes back when the peer has handled the message and reposted
	// the buffer. The link sees both ends, so it counts them directly.
	creditsP, creditsD int
	wrs                map[uint64]wrKind // outstanding work requests on the prefill side
	wrsD               map[uint64]int    // decode's outstanding SENDs: their buffers
	nextWR             uint64
	Outcomes           map[protocol.RequestID][2]error // [prefill, decode] outcome
	reported           map[protocol.RequestID][2]bool
	Verified           []protocol.RequestID
	now                time.Time
	msgSlot            int // bytes per message buffer: MaxFrame(cfg.MaxRequestPages)
}

type wrKind struct {
	write   uint64 // the protocol's WRITE id; 0 for a SEND
	payload bool   // the payload half of a page's two WRITEs
	buffer  int    // the tag-record or message buffer it reads; -1 for a payload
}

// Slot is where decode page p lives in the decode region.
func (l *Link) slot(p uint32) int { return int(p) * (l.cfg.PageBytes + protocol.TagSize) }

// decodeMemory lets the receiver read its pages and tag records.
type decodeMemory struct{ l *Link }

func (m decodeMemory) Payload(p uint32) []byte {
	o := m.l.slot(p)
	return m.l.kv.Bytes()[o : o+m.l.cfg.PageBytes]
}

func (m decodeMemory) TagRecord(p uint32) []byte {
	o := m.l.slot(p) + m.l.cfg.PageBytes
	return m.l.kv.Bytes()[o : o+protocol.TagSize]
}

type sourceMemory struct{ l *Link }

func (m sourceMemory) Page(p uint32) []byte {
	return m.l.src.Bytes()[int(p)*m.l.cfg.PageBytes : int(p+1)*m.l.cfg.PageBytes]
}

// SourcePage is prefill source page p, for the engine to compute KV into.
func (l *Link) SourcePage(p uint32) []byte { return sourceMemory{l}.Page(p) }

// DecodePage is decode page p's payload, for the engine to read.
func (l *Link) DecodePage(p uint32) []byte { return decodeMemory{l}.Payload(p) }

// New builds a link on two devices of a provider and connects its queue pair.
func New(cfg Config, prefill, decode rdma.Device) (*Link, error) {
	if cfg.QueueDepth == 0 {
		cfg.QueueDepth = 1024
	}
	if cfg.MaxRequestPages == 0 {
		cfg.MaxRequestPages = min(cfg.PrefillPages, cfg.DecodePages, protocol.MaxGrantPages)
	}
	if cfg.MaxRequestPages < 1 || cfg.MaxRequestPages > protocol.MaxGrantPages {
		return nil, fmt.Errorf("transfer: MaxRequestPages %d outside 1..%d", cfg.MaxRequestPages, protocol.MaxGrantPages)
	}
	if cfg.QueueDepth < 3 {
		return nil, fmt.Errorf("transfer: QueueDepth %d: a page needs two WRITEs and Done a SEND", cfg.QueueDepth)
	}
	l := &Link{cfg: cfg, wrs: map[uint64]wrKind{}, wrsD: map[uint64]int{}, Outcomes: map[protocol.RequestID][2]error{},
		reported: map[protocol.RequestID][2]bool{}, now: time.Unix(0, 0), msgSlot: MaxFrame(cfg.MaxRequestPages)}
	for i := sendSlots - 1; i >= 0; i-- {
		l.tagFree = append(l.tagFree, i)
	}
	// A SEND goes out only against a credit, so no more than recvSlots are
	// ever in flight: that many send buffers suffice.
	for i := recvSlots - 1; i >= 0; i-- {
		l.outFreeP, l.outFreeD = append(l.outFreeP, i), append(l.outFreeD, i)
	}
	msgSlot := l.msgSlot
	pdP, err := prefill.AllocPD()
	if err != nil {
		return nil, err
	}
	pdD, err := decode.AllocPD()
	if err != nil {
		return nil, err
	}
	reg := func(pd rdma.ProtectionDomain, size int, a rdma.Access) rdma.MemoryRegion {
		if err != nil {
			return nil
		}
		var m rdma.MemoryRegion
		m, err = pd.Alloc(size, a)
		return m
	}
	l.src = reg(pdP, cfg.PrefillPages*cfg.PageBytes, rdma.LocalWrite)
	l.tagOut = reg(pdP, sendSlots*protocol.TagSize, rdma.LocalWrite)
	l.inP = reg(pdP, recvSlots*msgSlot, rdma.LocalWrite)
	l.outP = reg(pdP, recvSlots*msgSlot, rdma.LocalWrite)
	l.kv = reg(pdD, cfg.DecodePages*(cfg.PageBytes+protocol.TagSize), rdma.LocalWrite|rdma.RemoteWrite)
	l.inD = reg(pdD, recvSlots*msgSlot, rdma.LocalWrite)
	l.outD = reg(pdD, recvSlots*msgSlot, rdma.LocalWrite)
	if err != nil {
		return nil, err
	}
	// One queue per side for sends and receives: room for every one of both.
	if l.cqP, err = prefill.CreateCQ(cfg.QueueDepth + recvSlots); err != nil {
		return nil, err
	}
	if l.cqD, err = decode.CreateCQ(cfg.QueueDepth + recvSlots); err != nil {
		return nil, err
	}
	// The depth bounds both work queues: the receive queue holds recvSlots,
	// the link keeps its own sends within QueueDepth.
	if l.qpP, err = pdP.CreateQP(l.cqP, l.cqP, max(cfg.QueueDepth, recvSlots)); err != nil {
		return nil, err
	}
	if l.qpD, err = pdD.CreateQP(l.cqD, l.cqD, max(cfg.QueueDepth, recvSlots)); err != nil {
		return nil, err
	}
	if err = l.qpP.Connect(l.qpD.Info()); err != nil {
		return nil, err
	}
	if err = l.qpD.Connect(l.qpP.Info()); err != nil {
		return nil, err
	}
	for i := 0; i < recvSlots; i++ {
		if err := l.qpP.PostRecv(rdma.WorkRequest{ID: recvID(i), Op: rdma.OpRecv, Local: rdma.SGE{MR: l.inP, Offset: i * msgSlot, Length: msgSlot}}); err != nil {
			return nil, err
		}
		if err := l.qpD.PostRecv(rdma.WorkRequest{ID: recvID(i), Op: rdma.OpRecv, Local: rdma.SGE{MR: l.inD, Offset: i * msgSlot, Length: msgSlot}}); err != nil {
			return nil, err
		}
	}
	l.creditsP, l.creditsD = recvSlots, recvSlots
	// Both intakes refuse what a message buffer cannot carry the Grant of.
	maxTokens := min(cfg.MaxRequestPages*cfg.PageTokens, protocol.MaxTokens)
	if l.Sender, err = protocol.NewSender(protocol.SenderConfig{Pages: cfg.PrefillPages, PageTokens: cfg.PageTokens,
		MaxTokens: min(maxTokens, cfg.PrefillPages*cfg.PageTokens), Memory: sourceMemory{l}}); err != nil {
		return nil, err
	}
	kvAddr, kvKey := l.kv.Addr(), l.kv.RKey()
	if l.Receiver, err = protocol.NewReceiver(protocol.ReceiverConfig{Pages: cfg.DecodePages, PageTokens: cfg.PageTokens,
		MaxTokens: min(maxTokens, cfg.DecodePages*cfg.PageTokens), Timeout: cfg.Timeout, Memory: decodeMemory{l},
		Region: func(p uint32) (uint64, uint32) { return kvAddr + uint64(l.slot(p)), kvKey }}); err != nil {
		return nil, err
	}
	return l, nil
}

// recvID marks receive work requests apart from sends.
func recvID(i int) uint64 { return 1<<63 | uint64(i) }

// The single peer on each side of the one queue pair.
const (
	prefillPeer = protocol.PeerID(1)
	decodePeer  = protocol.PeerID(2)
)

// Submit starts a request: intake, then the KV the engine computes (compute
// fills each source page), then the handoff.
func (l *Link) Submit(id protocol.RequestID, tokens int, compute func(i int, page []byte)) error {
	pages, err := l.Sender.Submit(id, decodePeer, tokens)
	if err != nil {
		return err
	}
	for i, p := range pages {
		compute(i, l.SourcePage(p))
	}
	return l.Sender.Computed(id)
}

// encode writes a control message into send buffer slot of out.
func (l *Link) encode(out rdma.MemoryRegion, slot int, m protocol.Message) (rdma.SGE, error) {
	msgSlot := l.msgSlot
	off := slot * msgSlot
	frame, err := protocol.AppendMessage(out.Bytes()[off:off:off+msgSlot], m)
	if err != nil {
		return rdma.SGE{}, err
	}
	if len(frame) > msgSlot {
		return rdma.SGE{}, fmt.Errorf("transfer: %s frame of %d bytes exceeds a message buffer", m.Type(), len(frame))
	}
	return rdma.SGE{MR: out, Offset: off, Length: len(frame)}, nil
}

// carry moves both state machines' effects into the backlogs and posts what
// the queue pairs can take, in order.
func (l *Link) carry() error {
	se := l.Sender.Effects()
	l.backlogP = append(l.backlogP, se.Ops...)
	l.record(se.Outcomes, 0)
	re := l.Receiver.Effects()
	l.backlogD = append(l.backlogD, re.Sends...)
	l.Verified = append(l.Verified, re.Verified...)
	l.record(re.Outcomes, 1)
	if err := l.postPrefill(); err != nil {
		return err
	}
	if err := l.postDecode(); err != nil {
		return err
	}
	for range re.Cuts {
		l.Cut()
	}
	return nil
}

// postPrefill posts the head of prefill's backlog while the send queue has
// room and a buffer is free. After a cut the queue pair refuses posts: what is
// left is dropped, and Sender.Flushed has already ended its requests.
func (l *Link) postPrefill() error {
	for len(l.backlogP) > 0 {
		op := l.backlogP[0]
		need := 1
		if op.Write != nil {
			need = 2
		}
		if len(l.wrs)+need > l.cfg.QueueDepth || len(l.tagFree) == 0 || len(l.outFreeP) == 0 ||
			op.Write == nil && l.creditsD == 0 {
			return nil // completions will make room
		}
		var err error
		if w := op.Write; w != nil {
			if !l.payloadPosted { // the payload half may be posted already, if the tag's post was refused
				err = l.postP(rdma.WorkRequest{Op: rdma.OpWrite,
					Local:      rdma.SGE{MR: l.src, Offset: int(w.Source) * l.cfg.PageBytes, Length: l.cfg.PageBytes},
					RemoteAddr: w.Remote.Addr, RKey: w.Remote.Key}, wrKind{write: w.ID, payload: true, buffer: -1})
				l.payloadPosted = err == nil
			}
			if err == nil {
				tag := l.tagFree[len(l.tagFree)-1]
				copy(l.tagOut.Bytes()[tag*protocol.TagSize:], w.Tag)
				err = l.postP(rdma.WorkRequest{Op: rdma.OpWrite,
					Local:      rdma.SGE{MR: l.tagOut, Offset: tag * protocol.TagSize, Length: protocol.TagSize},
					RemoteAddr: w.Remote.Addr + uint64(l.cfg.PageBytes), RKey: w.Remote.Key}, wrKind{write: w.ID, buffer: tag})
				if err == nil {
					l.tagFree = l.tagFree[:len(l.tagFree)-1]
					l.payloadPosted = false
				}
			}
		} else {
			slot := l.outFreeP[len(l.outFreeP)-1]
			var sge rdma.SGE
			if sge, err = l.encode(l.outP, slot, op.Msg); err != nil {
				return err
			}
			if err = l.postP(rdma.WorkRequest{Op: rdma.OpSend, Local: sge}, wrKind{buffer: slot}); err == nil {
				l.outFreeP = l.outFreeP[:len(l.outFreeP)-1]
				l.creditsD--
			}
		}
		switch {
		case err == nil:
			l.backlogP = l.backlogP[1:]
		case errors.Is(err, rdma.ErrQPError):
			l.backlogP, l.payloadPosted = nil, false
		case errors.Is(err, rdma.ErrQueueFull):
			return nil
		default:
			return err
		}
	}
	return nil
}

// postP posts one prefill work request and remembers it.
func (l *Link) postP(wr rdma.WorkRequest, k wrKind) error {
	l.nextWR++
	wr.ID = l.nextWR
	if err := l.qpP.PostSend(wr); err != nil {
		return err
	}
	l.wrs[wr.ID] = k
	return nil
}

// postDecode posts the head of decode's backlog, as postPrefill does.
func (l *Link) postDecode() error {
	for len(l.backlogD) > 0 {
		if len(l.wrsD) >= l.cfg.QueueDepth || len(l.outFreeD) == 0 || l.creditsP == 0 {
			return nil
		}
		slot := l.outFreeD[len(l.outFreeD)-1]
		sge, err := l.encode(l.outD, slot, l.backlogD[0].Msg)
		if err != nil {
			return err
		}
		l.nextWR++
		switch err := l.qpD.PostSend(rdma.WorkRequest{ID: l.nextWR, Op: rdma.OpSend, Local: sge}); {
		case err == nil:
			l.outFreeD = l.outFreeD[:len(l.outFreeD)-1]
			l.creditsP--
			l.wrsD[l.nextWR] = slot
			l.backlogD = l.backlogD[1:]
		case errors.Is(err, rdma.ErrQPError): // after a cut, posts are refused: nothing to send
			l.backlogD = nil
		case errors.Is(err, rdma.ErrQueueFull):
			return nil
		default:
			return err
		}
	}
	return nil
}

func (l *Link) record(outs []protocol.Outcome, side int) {
	for _, o := range outs {
		v, r := l.Outcomes[o.Request], l.reported[o.Request]
		v[side], r[side] = o.Err, true
		l.Outcomes[o.Request], l.reported[o.Request] = v, r
	}
}

// Reported says whether both nodes reported request id's outcome.
func (l *Link) Reported(id protocol.RequestID) bool {
	r := l.reported[id]
	return r[0] && r[1]
}

// Cut moves both ends of the queue pair to the error state (the fence) and
// tells both state machines; Pump then drains the flush completions.
func (l *Link) Cut() {
	l.qpP.ToError()
	l.qpD.ToError()
	l.backlogP, l.backlogD, l.payloadPosted = nil, nil, false
	l.Receiver.QueuePairFenced(prefillPeer)
	l.Sender.Flushed(decodePeer)
}

// Pump carries effects and handles completions until nothing is in flight or
// the wait for a completion times out; it returns how many completions it handled.
func (l *Link) Pump(timeout time.Duration) (int, error) {
	handled := 0
	for {
		if err := l.carry(); err != nil {
			return handled, err
		}
		cs := l.cqP.Poll(64)
		ds := l.cqD.Poll(64)
		if len(cs)+len(ds) == 0 {
			if len(l.wrs) == 0 && len(l.wrsD) == 0 {
				return handled, nil
			}
			if cs, ds = l.waitEither(timeout); len(cs)+len(ds) == 0 {
				return handled, nil
			}
		}
		handled += len(cs) + len(ds)
		for _, c := range cs {
			if err := l.prefillCompletion(c); err != nil {
				return handled, err
			}
		}
		for _, c := range ds {
			if err := l.decodeCompletion(c); err != nil {
				return handled, err
			}
		}
	}
}

// waitEither waits up to timeout for a completion on either side's queue, in
// slices of at most a millisecond on each, so neither side waits behind the other.
func (l *Link) waitEither(timeout time.Duration) (cs, ds []rdma.Completion) {
	deadline := time.Now().Add(timeout)
	for slice := 50 * time.Microsecond; ; slice = min(2*slice, time.Millisecond) {
		cs = l.cqP.Wait(64, slice)
		ds = l.cqD.Poll(64)
		if len(cs)+len(ds) > 0 {
			return cs, ds
		}
		ds = l.cqD.Wait(64, slice)
		cs = l.cqP.Poll(64)
		if len(cs)+len(ds) > 0 || time.Now().After(deadline) {
			return cs, ds
		}
	}
}

func statusErr(c rdma.Completion) error {
	if c.Status == rdma.Success {
		return nil
	}
	return fmt.Errorf("rdma: %v completion: %v", c.Op, c.Status)
}

func (l *Link) prefillCompletion(c rdma.Completion) error {
	if c.WRID&(1<<63) != 0 { // a message from decode
		if c.Status != rdma.Success {
			return nil // flushed receive buffer
		}
		i, msgSlot := int(c.WRID&^(1<<63)), l.msgSlot
		m, _, err := protocol.DecodeMessage(l.inP.Bytes()[i*msgSlot : i*msgSlot+c.Bytes])
		if err != nil {
			return err
		}
		if l.qpP.PostRecv(rdma.WorkRequest{ID: c.WRID, Op: rdma.OpRecv, Local: rdma.SGE{MR: l.inP, Offset: i * msgSlot, Length: msgSlot}}) == nil {
			l.creditsP++
		}
		if err := l.Sender.Step(decodePeer, m); err != nil && !errors.Is(err, protocol.ErrUnknownRequest) {
			return err
		}
		return nil
	}
	k, ok := l.wrs[c.WRID]
	if !ok {
		return fmt.Errorf("transfer: completion for unknown work request %d", c.WRID)
	}
	delete(l.wrs, c.WRID)
	switch {
	case k.write == 0:
		l.outFreeP = append(l.outFreeP, k.buffer)
		return nil // a SEND
	case !k.payload:
		l.tagFree = append(l.tagFree, k.buffer)
	}
	if k.payload && c.Status == rdma.Success {
		return nil // the tag record's completion reports the page
	}
	if err := l.Sender.Completed(k.write, statusErr(c)); err != nil && !errors.Is(err, protocol.ErrUnknownRequest) {
		return err
	}
	return nil
}

func (l *Link) decodeCompletion(c rdma.Completion) error {
	if c.WRID&(1<<63) == 0 { // one of decode's own SENDs: its buffer is free again
		l.outFreeD = append(l.outFreeD, l.wrsD[c.WRID])
		delete(l.wrsD, c.WRID)
		return nil
	}
	if c.Status != rdma.Success {
		return nil // a flushed receive buffer
	}
	i, msgSlot := int(c.WRID&^(1<<63)), l.msgSlot
	m, _, err := protocol.DecodeMessage(l.inD.Bytes()[i*msgSlot : i*msgSlot+c.Bytes])
	if err != nil {
		return err
	}
	if l.qpD.PostRecv(rdma.WorkRequest{ID: c.WRID, Op: rdma.OpRecv, Local: rdma.SGE{MR: l.inD, Offset: i * msgSlot, Length: msgSlot}}) == nil {
		l.creditsD++
	}
	if err := l.Receiver.Step(prefillPeer, m, l.now); err != nil && !errors.Is(err, protocol.ErrUnknownRequest) {
		return err
	}
	return nil
}
