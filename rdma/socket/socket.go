// Package socket is a pure-Go RDMA provider between processes, over stream
// sockets (TCP or Unix), with the semantics of reliable-connected queue pairs
// (see package rdma).
//
// A Device listens on a socket; its address is the Fabric of its queue pairs'
// ConnInfo. Connect dials the peer's device, so each queue pair's requests
// travel on a connection of their own, in the order posted, and the peer's
// device answers each with an acknowledgement after it has executed it:
//
//	requester                          responder (the peer's device)
//	PostSend ─► transmit, in order ─►  check key, bounds, access; place the
//	                                   bytes or consume a posted RECV
//	completion ◄──── ACK or NAK ◄────  (a NAK breaks both queue pairs)
//
// So a completion means the placement happened, a WRITE is placed before a
// later SEND on the same queue pair is delivered (one ordered stream), and a
// WRITE with a wrong key, outside the region or into a region without remote
// write access is refused by the peer and breaks both ends, as on hardware.
//
// The fence: the responder places each payload under its queue pair's
// placement lock, after checking that the queue pair is still ready, and
// ToError takes that lock. When ToError returns on the responder, nothing
// lands any more. ToError on the requester flushes what it has not yet
// transmitted and everything awaiting acknowledgement; bytes already on the
// wire may still be placed, as on hardware (see package rdma). A payload is
// read off the socket whole before it is placed, so a stalled peer cannot
// hold up a fence.
//
// The fault hooks are those of rdma.Faults: Pause holds transmission (a late
// WRITE), CorruptNext damages the next WRITE's payload on the wire, ToError is
// a cut. Receive-not-ready is not retried: a SEND or WRITE WITH IMMEDIATE
// that finds no posted RECV fails with ReceiverNotReady, as with
// rnr_retry = 0.
//
// Wire format, per request (big-endian): op u8, flags u8 (bit 0: immediate
// present), reserved u16, rkey u32, remote address u64, immediate u32, length
// u32, then length payload bytes; per answer: one status byte. A connection
// opens with a hello: "KVHR", version u8, the target queue pair number u32,
// the dialling queue pair number u32; the device answers one byte, 0 when the
// queue pair exists.
package socket

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/internal/soft"
)

// MaxMessage is the largest payload of one work request (1 GiB): a peer that
// announces more is broken, not trusted with an allocation.
const MaxMessage = 1 << 30

const (
	version   = 1
	headerLen = 24
	helloLen  = 13
)

// Device is an RDMA device of this provider: a listening socket and the
// memory regions and queue pairs made on it.
type Device struct {
	name    string
	network string
	ln      net.Listener

	mu      sync.Mutex
	qps     map[uint32]*QP
	regions soft.Regions
	closed  bool
}

// Listen opens a device listening on network ("tcp", "unix") and address,
// for example Listen("tcp", "127.0.0.1:0").
func Listen(network, address string) (*Device, error) {
	ln, err := net.Listen(network, address)
	if err != nil {
		return nil, err
	}
	d := &Device{network: network, ln: ln, name: network + ":" + ln.Addr().String(),
		qps: map[uint32]*QP{}}
	go d.accept()
	return d, nil
}

// Name implements rdma.Device: the network and address peers dial.
func (d *Device) Name() string { return d.name }

// AllocPD implements rdma.Device.
func (d *Device) AllocPD() (rdma.ProtectionDomain, error) { return &pd{d: d}, nil }

// CreateCQ implements rdma.Device.
func (d *Device) CreateCQ(depth int) (rdma.CompletionQueue, error) {
	if depth < 1 {
		return nil, fmt.Errorf("%w: CQ depth %d", rdma.ErrBadRequest, depth)
	}
	return soft.New(), nil
}

// Close implements rdma.Device: it stops listening and moves every queue
// pair to the error state.
func (d *Device) Close() error {
	d.mu.Lock()
	d.closed = true
	qps := make([]*QP, 0, len(d.qps))
	for _, q := range d.qps {
		qps = append(qps, q)
	}
	d.mu.Unlock()
	err := d.ln.Close()
	for _, q := range qps {
		q.ToError()
	}
	return err
}

type pd struct{ d *Device }

// Alloc implements rdma.ProtectionDomain.
func (p *pd) Alloc(size int, access rdma.Access) (rdma.MemoryRegion, error) {
	return p.d.regions.Alloc(p, size, access)
}

// Register implements rdma.ProtectionDomain. Addresses are the device's own
// numbering, page aligned, never reused while the device is open.
func (p *pd) Register(buf []byte, access rdma.Access) (rdma.MemoryRegion, error) {
	return p.d.regions.Register(p, buf, access)
}

// CreateQP implements rdma.ProtectionDomain.
func (p *pd) CreateQP(sendCQ, recvCQ rdma.CompletionQueue, depth int) (rdma.QueuePair, error) {
	s, ok1 := sendCQ.(*soft.Queue)
	r, ok2 := recvCQ.(*soft.Queue)
	if !ok1 || !ok2 || depth < 1 {
		return nil, fmt.Errorf("%w: CQs of another provider, or depth %d", rdma.ErrBadRequest, depth)
	}
	d := p.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("%w: device closed", rdma.ErrBadRequest)
	}
	qpn := soft.Random32()
	for qpn == 0 || d.qps[qpn] != nil {
		qpn = soft.Random32()
	}
	q := &QP{d: d, pd: p, qpn: qpn, ready: make(chan struct{})}
	q.Init(p, s, r, depth, MaxMessage)
	d.qps[q.qpn] = q
	return q, nil
}

// QP is a reliable-connected queue pair of the socket provider. Its work
// queues, posting and fault hooks are soft.WorkQueues'; its InFlight are the
// requests transmitted and not yet answered.
type QP struct {
	soft.WorkQueues // out and in are guarded by its Mu too
	d               *Device
	pd              *pd
	qpn             uint32

	// place is held by the responder while it places a payload or consumes a
	// receive, and by ToError: the fence.
	place sync.Mutex

	out   net.Conn      // our requests, the peer's answers
	in    net.Conn      // the peer's requests, our answers
	ready chan struct{} // closed when q leaves the reset state
}

// Info implements rdma.QueuePair.
func (q *QP) Info() rdma.ConnInfo { return rdma.ConnInfo{Fabric: q.d.name, QPN: q.qpn} }

// Connect implements rdma.QueuePair: it dials the peer's device.
func (q *QP) Connect(remote rdma.ConnInfo) error {
	network, address, ok := strings.Cut(remote.Fabric, ":")
	if !ok {
		return fmt.Errorf("%w: fabric %q is not network:address", rdma.ErrUnknownPeer, remote.Fabric)
	}
	if st := q.State(); st != rdma.StateReset {
		return fmt.Errorf("%w: connect from state %d", rdma.ErrBadRequest, st)
	}
	conn, err := net.DialTimeout(network, address, 10*time.Second)
	if err != nil {
		return fmt.Errorf("%w: %v", rdma.ErrUnknownPeer, err)
	}
	var hello [helloLen]byte
	copy(hello[:], "KVHR")
	hello[4] = version
	binary.BigEndian.PutUint32(hello[5:], remote.QPN)
	binary.BigEndian.PutUint32(hello[9:], q.qpn)
	var answer [1]byte
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := conn.Write(hello[:]); err != nil {
		conn.Close()
		return fmt.Errorf("%w: %v", rdma.ErrUnknownPeer, err)
	}
	if _, err := io.ReadFull(conn, answer[:]); err != nil || answer[0] != 0 {
		conn.Close()
		return fmt.Errorf("%w: %s refused queue pair %d", rdma.ErrUnknownPeer, remote.Fabric, remote.QPN)
	}
	conn.SetDeadline(time.Time{})
	if tc, ok := conn.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	q.Mu.Lock()
	if q.QPState != rdma.StateReset {
		q.Mu.Unlock()
		conn.Close()
		return fmt.Errorf("%w: state changed while connecting", rdma.ErrQPError)
	}
	q.out, q.QPState = conn, rdma.StateRTS
	close(q.ready)
	q.Mu.Unlock()
	go q.transmit(conn)
	go q.answers(conn)
	return nil
}

// ToError implements rdma.QueuePair. Every outstanding work request, send and
// receive, completes with FlushError; once it returns, this queue pair places
// nothing more as a responder.
func (q *QP) ToError() error {
	q.fail(nil)
	return nil
}

// fail breaks q. The head of the transmitted work requests completes with
// status *head, if given, before the rest are flushed, and q is in the error
// state before any of these completions is seen.
func (q *QP) fail(head *rdma.Status) {
	q.place.Lock()
	defer q.place.Unlock()
	q.Mu.Lock()
	defer q.Mu.Unlock()
	if q.QPState == rdma.StateReset {
		close(q.ready)
	}
	var first *rdma.Completion
	if head != nil && len(q.InFlight) > 0 {
		wr := q.InFlight[0]
		q.InFlight = q.InFlight[1:]
		first = &rdma.Completion{WRID: wr.ID, Op: wr.Op, Status: *head}
	}
	if !q.FailLocked(first) {
		return
	}
	for _, c := range []net.Conn{q.out, q.in} {
		if c != nil {
			c.Close()
		}
	}
}

// transmit sends q's work requests in order until q is in the error state.
func (q *QP) transmit(conn net.Conn) {
	var hdr [headerLen]byte
	for range q.Wake {
		for {
			q.Mu.Lock()
			if q.QPState != rdma.StateRTS || q.Paused || len(q.SQ) == 0 {
				done := q.QPState == rdma.StateError
				q.Mu.Unlock()
				if done {
					return
				}
				break
			}
			wr := q.SQ[0]
			q.SQ = q.SQ[1:]
			q.InFlight = append(q.InFlight, wr)
			corrupt := q.TakeCorruptLocked(wr.Op)
			q.Mu.Unlock()

			payload := wr.Local.MR.Bytes()[wr.Local.Offset : wr.Local.Offset+wr.Local.Length]
			if corrupt && len(payload) > 0 {
				payload = append([]byte(nil), payload...)
				payload[len(payload)/2] ^= 0x5A
			}
			hdr[0] = byte(wr.Op)
			hdr[1] = 0
			if wr.HasImm || wr.Op == rdma.OpWriteImm {
				hdr[1] = 1
			}
			binary.BigEndian.PutUint32(hdr[4:], wr.RKey)
			binary.BigEndian.PutUint64(hdr[8:], wr.RemoteAddr)
			binary.BigEndian.PutUint32(hdr[16:], wr.Imm)
			binary.BigEndian.PutUint32(hdr[20:], uint32(len(payload)))
			bufs := net.Buffers{hdr[:], payload}
			if _, err := bufs.WriteTo(conn); err != nil {
				q.broken()
				return
			}
		}
	}
}

// answers completes transmitted work requests, in order, as the peer answers.
func (q *QP) answers(conn net.Conn) {
	r := bufio.NewReader(conn)
	for {
		st, err := r.ReadByte()
		if err != nil {
			q.broken()
			return
		}
		if status := rdma.Status(st); status != rdma.Success {
			q.fail(&status)
			return
		}
		q.Mu.Lock()
		if len(q.InFlight) == 0 {
			q.Mu.Unlock()
			q.broken() // an answer to nothing: the peer is broken
			return
		}
		wr := q.InFlight[0]
		q.InFlight = q.InFlight[1:]
		q.SendCQ().Push(rdma.Completion{WRID: wr.ID, Op: wr.Op})
		q.Mu.Unlock()
	}
}

// broken handles a connection that failed under q: the peer is gone or
// fenced, so nothing outstanding can complete (on hardware, the requester's
// retries run out).
func (q *QP) broken() {
	st := rdma.FlushError
	q.fail(&st)
}

// accept takes the connections peers dial for their queue pairs.
func (d *Device) accept() {
	for {
		conn, err := d.ln.Accept()
		if err != nil {
			return
		}
		go d.serve(conn)
	}
}

// serve checks a dialling peer's hello and then executes its requests on the
// queue pair it names.
func (d *Device) serve(conn net.Conn) {
	var hello [helloLen]byte
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(conn, hello[:]); err != nil || string(hello[:4]) != "KVHR" || hello[4] != version {
		conn.Close()
		return
	}
	d.mu.Lock()
	q := d.qps[binary.BigEndian.Uint32(hello[5:])]
	d.mu.Unlock()
	refuse := q == nil
	if !refuse {
		q.Mu.Lock()
		refuse = q.in != nil || q.QPState == rdma.StateError
		if !refuse {
			q.in = conn
		}
		q.Mu.Unlock()
	}
	if refuse {
		conn.Write([]byte{1})
		conn.Close()
		return
	}
	if _, err := conn.Write([]byte{0}); err != nil {
		conn.Close()
		return
	}
	conn.SetDeadline(time.Time{})
	if tc, ok := conn.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	q.respond(conn)
}

// respond executes the peer's requests on q, in order, until the connection or
// q breaks.
func (q *QP) respond(conn net.Conn) {
	defer conn.Close()
	r := bufio.NewReaderSize(conn, 64<<10)
	w := bufio.NewWriter(conn)
	var hdr [headerLen]byte
	var scratch []byte
	<-q.ready // requests wait until q is connected, as a peer retries on hardware
	for {
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return
		}
		op := rdma.Opcode(hdr[0])
		n := binary.BigEndian.Uint32(hdr[20:])
		if n > MaxMessage || (op != rdma.OpWrite && op != rdma.OpWriteImm && op != rdma.OpSend) || hdr[2]|hdr[3] != 0 {
			q.ToError() // a malformed request: the connection cannot be trusted
			return
		}
		if cap(scratch) < int(n) {
			scratch = make([]byte, n)
		}
		payload := scratch[:n]
		if _, err := io.ReadFull(r, payload); err != nil {
			return
		}
		st := q.execute(op, hdr[1]&1 != 0, binary.BigEndian.Uint32(hdr[4:]), binary.BigEndian.Uint64(hdr[8:]),
			binary.BigEndian.Uint32(hdr[16:]), payload)
		if err := w.WriteByte(byte(st)); err != nil {
			return
		}
		if r.Buffered() == 0 || st != rdma.Success {
			if err := w.Flush(); err != nil {
				return
			}
		}
		if st != rdma.Success {
			q.ToError() // the NAK is sent: now the responder breaks too
			return
		}
	}
}

// execute places one request on q under the fence and returns the answer; an
// answer other than Success breaks q once it is sent.
func (q *QP) execute(op rdma.Opcode, hasImm bool, rkey uint32, addr uint64, imm uint32, payload []byte) rdma.Status {
	q.place.Lock()
	defer q.place.Unlock()
	q.Mu.Lock()
	defer q.Mu.Unlock()
	if q.QPState != rdma.StateRTS {
		return rdma.FlushError // fenced: nothing lands
	}
	var dst []byte
	if op == rdma.OpWrite || op == rdma.OpWriteImm {
		if dst = q.d.regions.Target(q.pd, rkey, addr, len(payload)); dst == nil {
			return rdma.RemoteAccessError
		}
	}
	var recv rdma.WorkRequest
	if op == rdma.OpWriteImm || op == rdma.OpSend {
		var ok bool
		if recv, ok = q.TakeRecvLocked(); !ok {
			return rdma.ReceiverNotReady
		}
	}
	switch op {
	case rdma.OpWrite:
		copy(dst, payload)
	case rdma.OpWriteImm:
		copy(dst, payload)
		q.RecvCQ().Push(rdma.Completion{WRID: recv.ID, Op: rdma.OpRecvImm, Imm: imm, HasImm: true})
	case rdma.OpSend:
		if recv.Local.Length < len(payload) {
			q.RecvCQ().Push(rdma.Completion{WRID: recv.ID, Op: rdma.OpRecv, Status: rdma.LocalLengthError})
			return rdma.RemoteAccessError
		}
		copy(recv.Local.MR.Bytes()[recv.Local.Offset:], payload)
		q.RecvCQ().Push(rdma.Completion{WRID: recv.ID, Op: rdma.OpRecv, Bytes: len(payload), Imm: imm, HasImm: hasImm})
	}
	return rdma.Success
}
