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
// later SEND on the same queue pair is delivered (one ordered stream), and
// acknowledged before it is (the answers of a burst are flushed before a
// SEND is executed), and a
// WRITE with a wrong key, outside the region or into a region without remote
// write access is refused by the peer and breaks both ends, as on hardware.
//
// Who may connect (docs/security.md). Every connection is TLS 1.3 with both
// sides presenting a certificate of the deployment's authority (Config.TLS,
// from package internal/pki) before a byte reaches a queue pair: the dialler
// accepts the responder only under the name ConnInfo.Node gives, and the
// responder accepts the dialler only as the peer its queue pair was
// connected to: the QPN, PSN and Node passed to its Connect. The hello names
// the target's QPN and PSN, which only the out-of-band exchange tells (both
// from crypto/rand), so a stranger cannot even address a queue pair. A
// connection that arrives before its queue pair's Connect waits (at most
// maxWaiting per queue pair, one per identity, for at most
// HandshakeTimeout) and is attached or dropped once Connect names the peer:
// a stranger dialling first takes nothing over. Plaintext only with
// Config.Insecure, which logs a warning.
//
// Nothing is allocated on a peer's word. A payload is streamed from the
// connection's fixed read buffer into its target (the region, after the key
// and bounds check, or the posted receive), one buffer at a time, each under
// the queue pair's placement lock; a 1 GiB header costs the responder
// nothing. Connections that have not finished their handshake and hello are
// at most Config.MaxPending, and when they are that many a new one drops the
// oldest of the source address holding the most (package internal/admission),
// so a flood from one address evicts only its own; each gets
// Config.HandshakeTimeout; once a frame has begun it must arrive whole within
// Config.FrameTimeout plus what MinRate allows for its payload, and the
// answers must be taken as promptly (a stalled or trickling peer breaks its
// queue pair).
// Between frames a queue pair may be idle for as long as it likes, but its
// connections may not: each side sends a keepalive frame every quarter of
// Config.IdleTimeout, so every read after the hello
// has a deadline, and a peer gone silent breaks its queue pair within
// IdleTimeout. A connection that breaks, half a frame in
// or between frames, moves its queue pair to the error state, so the
// receiver learns of it and fences; the accept loop backs off and goes on
// after errors such as EMFILE.
//
// The fence: the responder places each piece of a payload under its queue
// pair's placement lock, after checking that the queue pair is still ready,
// and ToError takes that lock. When ToError returns on the responder, nothing
// lands any more (a WRITE cut in the middle may have placed its first part,
// as on hardware; it never completes). ToError on the requester flushes what
// it has not yet transmitted and everything awaiting acknowledgement; bytes
// already on the wire may still be placed, as on hardware (see package rdma).
// A stalled peer cannot hold up a fence: the lock is never held across a read.
//
// Memory windows (rdma.MemoryWindow): a WRITE under a window's key is
// checked against the window (bound on this very queue pair, in its range)
// before a byte is read, and again for every piece placed, under the
// placement lock, which the window's invalidate and Close take: once they
// return, nothing more lands under the key. Binds and invalidates execute
// when posted.
//
// The fault hooks are those of rdma.Faults: Pause holds transmission (a late
// WRITE), CorruptNext damages the next WRITE's payload on the wire, ToError is
// a cut. Receive-not-ready is not retried: a SEND or WRITE WITH IMMEDIATE
// that finds no posted RECV fails with ReceiverNotReady, as with
// rnr_retry = 0.
//
// Wire format, inside TLS, per request (big-endian): op u8, flags u8 (bit 0:
// immediate present), reserved u16, rkey u32, remote address u64, immediate
// u32, length u32, then length payload bytes; per answer: one status byte;
// a header of 24 zero bytes is a keepalive, with no payload and no answer. A
// connection opens with a hello: "KVHR", version u8, the target queue pair's
// number u32 and PSN u32, the dialling queue pair's number u32 and PSN u32;
// the device answers one byte, 0 when it accepts (a waiting connection may
// still be dropped when the target's Connect names another peer).
package socket

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/admission"
	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/internal/soft"
)

// MaxMessage is the largest payload of one work request (1 GiB): a peer that
// announces more is broken.
const MaxMessage = 1 << 30

const (
	version    = 2
	headerLen  = 24
	helloLen   = 21
	readBuffer = 64 << 10 // per connection: the only buffer a payload passes through
	maxWaiting = 4        // connections per queue pair waiting for its Connect
)

// MinRate is the slowest a frame's payload may arrive, in bytes per second
// (see Config.FrameTimeout).
const MinRate = 1 << 20

// Config says how a device authenticates and what it lets peers hold.
type Config struct {
	// TLS is the device's certificate (Certificates[0]; its first DNS name
	// is the device's identity, ConnInfo.Node) and the authorities it trusts
	// for peers (RootCAs; ClientCAs if set, for diallers). pki.Config and
	// pki.Load make one. Connections are TLS 1.3, mutually authenticated.
	TLS *tls.Config
	// Insecure runs the device in plaintext with no authentication, for
	// measuring the bare transport; it must be asked for, and Listen logs a
	// warning. Without TLS and without Insecure, Listen refuses.
	Insecure bool
	// Logger receives the device's warnings (default slog.Default()).
	Logger *slog.Logger
	// HandshakeTimeout bounds the TLS handshake and the hello (default 10 s).
	HandshakeTimeout time.Duration
	// FrameTimeout bounds a frame once its first byte has arrived: a frame
	// of n payload bytes must be in within FrameTimeout + n/MinRate
	// seconds (default 10 s).
	FrameTimeout time.Duration
	// MaxPending bounds the connections not yet past their hello (default
	// 128); when full, a new one drops the oldest of the source address
	// holding the most (see package internal/admission).
	MaxPending int
	// IdleTimeout bounds the silence between frames: each side sends a
	// keepalive every IdleTimeout/4, and a connection
	// silent for IdleTimeout breaks its queue pair (default 30 s).
	IdleTimeout time.Duration
}

func (c *Config) defaults() {
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.HandshakeTimeout <= 0 {
		c.HandshakeTimeout = 10 * time.Second
	}
	if c.FrameTimeout <= 0 {
		c.FrameTimeout = 10 * time.Second
	}
	if c.MaxPending <= 0 {
		c.MaxPending = 128
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = 30 * time.Second
	}
}

// ErrNoTLS is Listen's answer to a Config with neither TLS nor Insecure.
var ErrNoTLS = errors.New("socket: no TLS configuration (Config.TLS), and plaintext not asked for (Config.Insecure)")

// Device is an RDMA device of this provider: a listening socket and the
// memory regions and queue pairs made on it.
type Device struct {
	name   string
	node   string // the identity in its certificate
	ln     net.Listener
	cfg    Config
	server *tls.Config // nil when insecure
	client *tls.Config
	done   chan struct{}

	mu      sync.Mutex
	qps     map[uint32]*QP
	regions soft.Regions
	closed  bool
	pending *admission.Table // connections before their hello
	warned  time.Time        // the last refusal logged
	held    int              // refusals not logged since
}

// Listen opens a device listening on network ("tcp", "unix") and address,
// for example Listen("tcp", "127.0.0.1:0", cfg).
func Listen(network, address string, cfg Config) (*Device, error) {
	if cfg.TLS == nil && !cfg.Insecure {
		return nil, ErrNoTLS
	}
	ln, err := net.Listen(network, address)
	if err != nil {
		return nil, err
	}
	d, err := Serve(ln, cfg)
	if err != nil {
		ln.Close()
	}
	return d, err
}

// Serve makes a device that accepts on ln, which it owns from now on.
func Serve(ln net.Listener, cfg Config) (*Device, error) {
	cfg.defaults()
	d := &Device{ln: ln, cfg: cfg, name: ln.Addr().Network() + ":" + ln.Addr().String(),
		qps: map[uint32]*QP{}, pending: admission.New(cfg.MaxPending), done: make(chan struct{})}
	switch {
	case cfg.TLS != nil:
		node, err := pki.Name(cfg.TLS)
		if err != nil {
			return nil, err
		}
		if cfg.TLS.RootCAs == nil {
			return nil, errors.New("socket: Config.TLS trusts no authority (RootCAs)")
		}
		d.node = node
		d.server = cfg.TLS.Clone()
		d.server.MinVersion = tls.VersionTLS13
		d.server.ClientAuth = tls.RequireAndVerifyClientCert
		if d.server.ClientCAs == nil {
			d.server.ClientCAs = cfg.TLS.RootCAs
		}
		d.client = cfg.TLS.Clone()
		d.client.MinVersion = tls.VersionTLS13
	case cfg.Insecure:
		cfg.Logger.Warn("socket: plaintext device: no authentication, any peer that reaches it can address its queue pairs", "device", d.name)
	default:
		return nil, ErrNoTLS
	}
	go d.accept()
	return d, nil
}

// Name implements rdma.Device: the network and address peers dial.
func (d *Device) Name() string { return d.name }

// Node is the identity the device authenticates as (empty when insecure).
func (d *Device) Node() string { return d.node }

// AllocPD implements rdma.Device.
func (d *Device) AllocPD() (rdma.ProtectionDomain, error) { return &pd{d: d}, nil }

// CreateCQ implements rdma.Device.
func (d *Device) CreateCQ(depth int) (rdma.CompletionQueue, error) {
	if depth < 1 {
		return nil, fmt.Errorf("%w: CQ depth %d", rdma.ErrBadRequest, depth)
	}
	return soft.New(), nil
}

// Close implements rdma.Device: it stops listening, drops the connections
// still in their handshake and moves every queue pair to the error state.
func (d *Device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	close(d.done)
	qps := make([]*QP, 0, len(d.qps))
	for _, q := range d.qps {
		qps = append(qps, q)
	}
	d.mu.Unlock()
	d.pending.Close()
	err := d.ln.Close()
	for _, q := range qps {
		q.ToError()
	}
	return err
}

type pd struct{ d *Device }

// AllocWindow implements rdma.WindowDomain.
func (p *pd) AllocWindow() (rdma.MemoryWindow, error) {
	return &window{Window: p.d.regions.AllocWindow(p), d: p.d}, nil
}

// window is a memory window. Its key is checked for every piece of a WRITE
// placed under it, under the placement lock of the queue pair it is bound on,
// which its invalidate takes too.
type window struct {
	*soft.Window
	d *Device
}

// Close implements rdma.MemoryWindow: under the placement lock of the queue
// pair the window is bound on, so nothing under its key lands once it returns.
func (w *window) Close() error {
	defer fence(w.Window)()
	w.d.regions.Close(w.Window)
	return nil
}

// fence takes the placement lock of the queue pair w is bound on (none if
// unbound) and returns its unlock. Only w's owner binds it, and not
// concurrently with this, so the queue pair cannot change meanwhile.
func fence(w *soft.Window) func() {
	q, _ := w.BoundOn().(*QP)
	if q == nil {
		return func() {}
	}
	q.place.Lock()
	return q.place.Unlock
}

// windowOp executes a bind or invalidate posted on q.
func (q *QP) windowOp(wr rdma.WorkRequest) error {
	w, ok := wr.Window.(*window)
	if !ok || w.d != q.d {
		return fmt.Errorf("%w: a window of another provider or device", rdma.ErrBadRequest)
	}
	if wr.Op == rdma.OpBind {
		return q.d.regions.Bind(w.Window, q.pd, q, wr.Local)
	}
	defer fence(w.Window)()
	return q.d.regions.Invalidate(w.Window, q.pd)
}

// Alloc implements rdma.ProtectionDomain.
func (p *pd) Alloc(size int, access rdma.Access) (rdma.MemoryRegion, error) {
	return p.d.regions.Alloc(p, size, access)
}

// Deregister implements rdma.Deregistrar.
func (p *pd) Deregister(m rdma.MemoryRegion) error { return p.d.regions.Deregister(p, m) }

// Register implements rdma.ProtectionDomain. Keys and addresses are the
// device's own (see soft.Regions): random, keys never reused.
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
	q := &QP{d: d, pd: p, qpn: qpn, psn: soft.Random32() & 0xFFFFFF}
	q.Init(p, s, r, depth, MaxMessage)
	q.WindowOp = q.windowOp
	d.qps[q.qpn] = q
	return q, nil
}

// QP is a reliable-connected queue pair of the socket provider. Its work
// queues, posting and fault hooks are soft.WorkQueues'; its InFlight are the
// requests transmitted and not yet answered.
type QP struct {
	soft.WorkQueues // out, in, remote and waiting are guarded by its Mu too
	d               *Device
	pd              *pd
	qpn, psn        uint32

	// place is held by the responder while it places a piece of a payload or
	// consumes a receive, and by ToError: the fence.
	place sync.Mutex

	out     net.Conn      // our requests, the peer's answers
	in      net.Conn      // the peer's requests, our answers
	remote  rdma.ConnInfo // the peer Connect named
	waiting []*arrival    // connections that arrived before Connect
}

// arrival is a connection past its handshake and hello: who it says it comes
// from and what it proved.
type arrival struct {
	conn     net.Conn
	qpn, psn uint32
	cert     *x509.Certificate // the peer's verified leaf; nil when insecure
	verdict  chan bool         // for a waiting one: attached (true) or dropped
}

// Info implements rdma.QueuePair.
func (q *QP) Info() rdma.ConnInfo {
	return rdma.ConnInfo{Fabric: q.d.name, QPN: q.qpn, PSN: q.psn, Node: q.d.node}
}

// Connect implements rdma.QueuePair: it dials the peer's device, accepts it
// only under the identity remote.Node names (required with TLS), and from
// then on accepts requests only from the queue pair remote names.
func (q *QP) Connect(remote rdma.ConnInfo) error {
	network, address, ok := strings.Cut(remote.Fabric, ":")
	if !ok {
		return fmt.Errorf("%w: fabric %q is not network:address", rdma.ErrUnknownPeer, remote.Fabric)
	}
	if q.d.client != nil && remote.Node == "" {
		return fmt.Errorf("%w: remote.Node is empty: the identity to expect of the peer is required", rdma.ErrBadRequest)
	}
	if st := q.State(); st != rdma.StateReset {
		return fmt.Errorf("%w: connect from state %d", rdma.ErrBadRequest, st)
	}
	remote.PSN &= 0xFFFFFF
	conn, err := q.dial(network, address, remote)
	if err != nil {
		return fmt.Errorf("%w: %v", rdma.ErrUnknownPeer, err)
	}
	q.Mu.Lock()
	if q.QPState != rdma.StateReset {
		q.Mu.Unlock()
		conn.Close()
		return fmt.Errorf("%w: state changed while connecting", rdma.ErrQPError)
	}
	q.out, q.remote, q.QPState = conn, remote, rdma.StateRTS
	for _, a := range q.waiting {
		if q.in == nil && q.accepts(a) {
			q.in = a.conn
			a.verdict <- true
		} else {
			a.verdict <- false
		}
	}
	q.waiting = nil
	q.Mu.Unlock()
	go q.transmit(conn)
	go q.answers(conn)
	return nil
}

// dial opens q's outbound connection to remote: TLS with remote.Node as the
// name the responder must prove, then the hello.
func (q *QP) dial(network, address string, remote rdma.ConnInfo) (net.Conn, error) {
	timeout := q.d.cfg.HandshakeTimeout
	raw, err := net.DialTimeout(network, address, timeout)
	if err != nil {
		return nil, err
	}
	if tc, ok := raw.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	conn := raw
	raw.SetDeadline(time.Now().Add(timeout))
	if q.d.client != nil {
		c := q.d.client.Clone()
		c.ServerName = remote.Node
		tc := tls.Client(raw, c)
		if err := tc.Handshake(); err != nil {
			raw.Close()
			return nil, err
		}
		conn = tc
	}
	var hello [helloLen]byte
	copy(hello[:], "KVHR")
	hello[4] = version
	binary.BigEndian.PutUint32(hello[5:], remote.QPN)
	binary.BigEndian.PutUint32(hello[9:], remote.PSN)
	binary.BigEndian.PutUint32(hello[13:], q.qpn)
	binary.BigEndian.PutUint32(hello[17:], q.psn)
	var answer [1]byte
	if _, err := conn.Write(hello[:]); err != nil {
		conn.Close()
		return nil, err
	}
	if _, err := io.ReadFull(conn, answer[:]); err != nil || answer[0] != 0 {
		conn.Close()
		return nil, fmt.Errorf("%s refused queue pair %d", remote.Fabric, remote.QPN)
	}
	raw.SetDeadline(time.Time{})
	return conn, nil
}

// accepts reports whether arrival a comes from the peer Connect named: its
// QPN, its PSN, and (with TLS) a certificate for remote.Node. The caller
// holds Mu.
func (q *QP) accepts(a *arrival) bool {
	if a.qpn != q.remote.QPN || a.psn != q.remote.PSN {
		return false
	}
	if q.d.server == nil {
		return true
	}
	return a.cert != nil && q.remote.Node != "" && a.cert.VerifyHostname(q.remote.Node) == nil
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
	for _, a := range q.waiting {
		a.verdict <- false
	}
	q.waiting = nil
	var first *rdma.Completion
	if head != nil && len(q.InFlight) > 0 {
		wr := q.InFlight[0]
		q.InFlight = q.InFlight[1:]
		first = &rdma.Completion{WRID: wr.ID, Op: wr.Op, Status: *head}
	}
	if !q.FailLocked(first) {
		return
	}
	// In the error state for good: nothing may address q any more, so the
	// device forgets it (a device that reconnects keeps no dead entries).
	q.d.mu.Lock()
	if q.d.qps[q.qpn] == q {
		delete(q.d.qps, q.qpn)
	}
	q.d.mu.Unlock()
	for _, c := range []net.Conn{q.out, q.in} {
		if c != nil {
			c.Close()
		}
	}
}

// transmit sends q's work requests in order until q is in the error state.
// Frames go through one buffered writer, flushed whenever the send queue
// runs dry, so a burst of small requests shares system calls and TLS records.
func (q *QP) transmit(conn net.Conn) {
	w := bufio.NewWriterSize(conn, readBuffer)
	var hdr [headerLen]byte
	// A keepalive (a header of zeros: no work request, no answer) goes out
	// every quarter of IdleTimeout, so that the peer's responder can hold
	// every read to a deadline with room for a slow scheduler.
	keepalive := time.NewTicker(max(q.d.cfg.IdleTimeout/4, time.Millisecond))
	defer keepalive.Stop()
	for {
		select {
		case <-q.Wake:
		case <-keepalive.C:
			if q.State() == rdma.StateError {
				return
			}
			var nop [headerLen]byte
			w.Write(nop[:])
			if err := w.Flush(); err != nil {
				q.broken()
				return
			}
			continue
		}
		for {
			q.Mu.Lock()
			if q.QPState != rdma.StateRTS || q.Paused || len(q.SQ) == 0 {
				done := q.QPState == rdma.StateError
				q.Mu.Unlock()
				if done {
					return
				}
				if err := w.Flush(); err != nil {
					q.broken()
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
				rdma.Damage(payload)
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
			w.Write(hdr[:])
			if _, err := w.Write(payload); err != nil {
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

// accept takes the connections peers dial for their queue pairs. An error
// other than the device's own Close (EMFILE in a flood of connections, say)
// is waited out, 5 ms doubling to 1 s, never the end of the device.
func (d *Device) accept() {
	var delay time.Duration
	for {
		conn, err := d.ln.Accept()
		if err != nil {
			select {
			case <-d.done:
				return
			default:
			}
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			d.cfg.Logger.Warn("socket: accept failed; retrying", "device", d.name, "err", err, "after", delay)
			select {
			case <-d.done:
				return
			case <-time.After(delay):
			}
			continue
		}
		delay = 0
		watched, ok := d.pending.Admit(conn)
		if !ok {
			conn.Close()
			continue
		}
		go d.serve(conn, watched)
	}
}

// serve authenticates a dialling peer on raw, read through watched (see
// admission.Table.Admit), checks its hello and then executes its
// requests on the queue pair it names, if that queue pair accepts it.
func (d *Device) serve(raw, watched net.Conn) {
	a, q := d.greet(raw, watched)
	d.pending.Done(raw)
	if q == nil {
		raw.Close()
		return
	}
	a.conn.SetDeadline(time.Time{})
	if tc, ok := raw.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	if a.verdict != nil && !q.await(a) {
		a.conn.Close()
		return
	}
	q.respond(a.conn)
}

// await waits for the verdict on arrival a, waiting for q's Connect: at most
// HandshakeTimeout, so that a connection nobody claims does not hold one of
// q's waiting places for ever.
func (q *QP) await(a *arrival) bool {
	timer := time.NewTimer(q.d.cfg.HandshakeTimeout)
	defer timer.Stop()
	select {
	case ok := <-a.verdict:
		return ok
	case <-timer.C:
	}
	q.Mu.Lock()
	defer q.Mu.Unlock()
	for i, w := range q.waiting {
		if w == a {
			q.waiting = append(q.waiting[:i], q.waiting[i+1:]...)
			return false
		}
	}
	return <-a.verdict // given while the timer fired
}

// greet runs the handshake and the hello within HandshakeTimeout and binds
// the connection to its queue pair: attached at once if the queue pair is
// connected to this very peer, or waiting for its Connect. A nil queue pair
// means refused; the refusal says nothing about why (no such queue pair,
// wrong PSN, another peer), so it tells a stranger nothing.
func (d *Device) greet(raw, watched net.Conn) (*arrival, *QP) {
	raw.SetDeadline(time.Now().Add(d.cfg.HandshakeTimeout))
	a := &arrival{conn: watched} // reads through it tell d.pending raw has spoken
	if d.server != nil {
		tc := tls.Server(watched, d.server)
		if err := tc.Handshake(); err != nil {
			d.refused(raw, "handshake", err)
			return nil, nil
		}
		a.conn, a.cert = tc, tc.ConnectionState().PeerCertificates[0]
	}
	var hello [helloLen]byte
	if _, err := io.ReadFull(a.conn, hello[:]); err != nil || string(hello[:4]) != "KVHR" || hello[4] != version {
		d.refused(raw, "malformed hello", err)
		return nil, nil
	}
	a.qpn, a.psn = binary.BigEndian.Uint32(hello[13:]), binary.BigEndian.Uint32(hello[17:])
	if !d.pending.Done(raw) {
		return nil, nil // evicted meanwhile: raw is closed
	}
	d.mu.Lock()
	q := d.qps[binary.BigEndian.Uint32(hello[5:])]
	d.mu.Unlock()
	ok := q != nil && q.psn == binary.BigEndian.Uint32(hello[9:])
	if ok {
		q.Mu.Lock()
		switch {
		case q.QPState == rdma.StateRTS && q.in == nil && q.accepts(a):
			q.in = a.conn
		case q.QPState == rdma.StateReset:
			// One waiting place per identity: a newer arrival under the
			// same one replaces the older, so an authenticated node that
			// knows the QPN and PSN holds at most one of the places the
			// genuine peer needs.
			q.dropWaitingLocked(a.cert)
			if len(q.waiting) >= maxWaiting {
				ok = false
				break
			}
			a.verdict = make(chan bool, 1)
			q.waiting = append(q.waiting, a)
		default:
			ok = false
		}
		q.Mu.Unlock()
	}
	if !ok {
		d.refused(raw, "hello names no queue pair that expects this peer", nil)
		a.conn.Write([]byte{1})
		return nil, nil
	}
	// A failed write needs no handling here: the connection is dead, and
	// its first read breaks the queue pair it reaches.
	a.conn.Write([]byte{0})
	return a, q
}

// dropWaitingLocked drops the waiting arrival whose certificate names the
// identity cert names, if any (none when insecure: there is no certificate
// to tell peers apart). The caller holds Mu.
func (q *QP) dropWaitingLocked(cert *x509.Certificate) {
	if cert == nil {
		return
	}
	for i, w := range q.waiting {
		if w.cert != nil && identity(w.cert) == identity(cert) {
			w.verdict <- false
			q.waiting = append(q.waiting[:i], q.waiting[i+1:]...)
			return
		}
	}
}

// identity is the node a certificate names: its DNS names (the node's
// name is the first), whichever certificate of the authority carries them.
func identity(cert *x509.Certificate) string {
	return strings.Join(cert.DNSNames, "\x00")
}

// refused logs a connection refused before it reached a queue pair: at most
// one warning a second, with the count of those held back since.
func (d *Device) refused(conn net.Conn, why string, err error) {
	d.mu.Lock()
	now := time.Now()
	if now.Sub(d.warned) < time.Second {
		d.held++
		d.mu.Unlock()
		return
	}
	held := d.held
	d.warned, d.held = now, 0
	d.mu.Unlock()
	d.cfg.Logger.Warn("socket: refused a connection", "device", d.name, "peer", conn.RemoteAddr().String(), "why", why, "err", err, "not logged since last", held)
}

// respond executes the peer's requests on q, in order, until the connection or
// q breaks; a connection that breaks, between frames or in one, breaks q.
func (q *QP) respond(conn net.Conn) {
	defer conn.Close()
	r := bufio.NewReaderSize(conn, readBuffer)
	w := bufio.NewWriter(conn)
	var hdr [headerLen]byte
	for {
		// Between frames the peer sends keepalives; IdleTimeout without
		// a byte means it is gone or stuck.
		conn.SetReadDeadline(time.Now().Add(q.d.cfg.IdleTimeout))
		if _, err := r.Peek(1); err != nil {
			q.inboundLost(err)
			return
		}
		start := time.Now()
		conn.SetReadDeadline(start.Add(q.d.cfg.FrameTimeout))
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			q.inboundLost(err)
			return
		}
		if hdr == ([headerLen]byte{}) {
			continue // a keepalive
		}
		op := rdma.Opcode(hdr[0])
		n := binary.BigEndian.Uint32(hdr[20:])
		if n > MaxMessage || (op != rdma.OpWrite && op != rdma.OpWriteImm && op != rdma.OpSend) || hdr[2]|hdr[3] != 0 || hdr[1]&^1 != 0 {
			q.ToError() // a malformed request: the connection cannot be trusted
			return
		}
		// The whole frame has one deadline, so a peer trickling a byte at a
		// time cannot hold the queue pair: FrameTimeout, plus the time
		// MinRate allows for the payload.
		conn.SetReadDeadline(start.Add(q.d.cfg.FrameTimeout + time.Duration(n)*time.Second/MinRate))
		// The answers of a burst go out together, when the read buffer
		// runs dry, but none after the consumer hears of a later message:
		// a SEND (or WRITE WITH IMMEDIATE) is executed once the answers
		// before it are flushed, and its own goes right after. A consumer
		// that acts on a message and then breaks the queue pair (a decode
		// node whose stop ends once it has read the request a Done
		// completed) would otherwise drop the ACKs of WRITEs it placed,
		// and their requester would see them fail.
		message := op != rdma.OpWrite
		if message && w.Buffered() > 0 {
			conn.SetWriteDeadline(time.Now().Add(q.d.cfg.FrameTimeout))
			if err := w.Flush(); err != nil {
				q.ToError()
				return
			}
		}
		st, err := q.execute(r, op, hdr[1]&1 != 0, binary.BigEndian.Uint32(hdr[4:]), binary.BigEndian.Uint64(hdr[8:]),
			binary.BigEndian.Uint32(hdr[16:]), int(n))
		if err != nil {
			q.inboundLost(err) // half a frame: the stream is lost
			return
		}
		if h := executed.Load(); h != nil {
			(*h)(q, op)
		}
		// A peer that stops reading its answers is as stuck as one that
		// stops sending: every write has a deadline too, the buffer's own
		// flush when it fills as well as ours.
		conn.SetWriteDeadline(time.Now().Add(q.d.cfg.FrameTimeout))
		if err := w.WriteByte(byte(st)); err != nil {
			q.ToError()
			return
		}
		if r.Buffered() == 0 || st != rdma.Success || message {
			if err := w.Flush(); err != nil {
				q.ToError()
				return
			}
		}
		if st != rdma.Success {
			q.ToError() // the NAK is sent: now the responder breaks too
			return
		}
	}
}

// executed, set by tests only, is called by the responder after each
// request it executes, before it answers it: a test's consumer acts there.
var executed atomic.Pointer[func(q *QP, op rdma.Opcode)]

// inboundLost breaks q after the connection carrying the peer's requests
// failed with err. A frame that did not arrive in time is the peer's fault:
// q breaks at once. A connection the peer closed breaks q too, but only once
// its outbound connection has had FrameTimeout to deliver what the peer sent
// before closing: the peer closes both when it NAKs one of q's requests, and
// that NAK, not a flush, must be q's completion.
func (q *QP) inboundLost(err error) {
	q.Mu.Lock()
	out := q.out
	q.Mu.Unlock()
	if ne, ok := err.(net.Error); (ok && ne.Timeout()) || out == nil {
		q.ToError()
		return
	}
	out.SetReadDeadline(time.Now().Add(q.d.cfg.FrameTimeout)) // answers reads it: an answer, an EOF, or the deadline breaks q
}

// execute places one request of n payload bytes on q and returns the
// answer; an answer other than Success breaks q once it is sent. The target
// (a region, after its key and bounds check, or the head of the receive
// queue) is found before a byte of payload is read, and the payload streams
// into it from r's buffer, each piece under the fence. A refused request's
// payload is never read: the NAK breaks the connection. An error is the
// connection failing mid-frame.
func (q *QP) execute(r *bufio.Reader, op rdma.Opcode, hasImm bool, rkey uint32, addr uint64, imm uint32, n int) (rdma.Status, error) {
	dst, win, st := q.target(op, rkey, addr, n)
	if st != rdma.Success {
		return st, nil
	}
	for off := 0; off < n; {
		if r.Buffered() == 0 {
			if _, err := r.Peek(1); err != nil {
				return 0, err
			}
		}
		piece, _ := r.Peek(min(n-off, r.Buffered()))
		q.place.Lock()
		q.Mu.Lock()
		ready := q.QPState == rdma.StateRTS
		// A window's invalidate takes place too: once it returns, no piece
		// under its key lands.
		open := win == nil || q.d.regions.Valid(win, rkey)
		if ready && open {
			copy(dst[off:], piece)
		}
		q.Mu.Unlock()
		q.place.Unlock()
		if !ready {
			return rdma.FlushError, nil // fenced: nothing more lands
		}
		if !open {
			return rdma.RemoteAccessError, nil // invalidated in the middle: the rest is refused
		}
		r.Discard(len(piece))
		off += len(piece)
	}
	q.place.Lock()
	defer q.place.Unlock()
	q.Mu.Lock()
	defer q.Mu.Unlock()
	if q.QPState != rdma.StateRTS {
		return rdma.FlushError, nil
	}
	switch op {
	case rdma.OpWriteImm:
		recv, _ := q.TakeRecvLocked()
		q.RecvCQ().Push(rdma.Completion{WRID: recv.ID, Op: rdma.OpRecvImm, Imm: imm, HasImm: true})
	case rdma.OpSend:
		recv, _ := q.TakeRecvLocked()
		q.RecvCQ().Push(rdma.Completion{WRID: recv.ID, Op: rdma.OpRecv, Bytes: n, Imm: imm, HasImm: hasImm})
	}
	return rdma.Success, nil
}

// target is where a request's n payload bytes go, or the status refusing it.
// The receive a SEND or WRITE WITH IMMEDIATE consumes stays at the head of
// the receive queue until the payload is in (only this goroutine consumes
// it), so a fence in the middle flushes it with the rest.
func (q *QP) target(op rdma.Opcode, rkey uint32, addr uint64, n int) ([]byte, *soft.Window, rdma.Status) {
	q.Mu.Lock()
	defer q.Mu.Unlock()
	if q.QPState != rdma.StateRTS {
		return nil, nil, rdma.FlushError // fenced: nothing lands
	}
	var dst []byte
	var win *soft.Window
	if op == rdma.OpWrite || op == rdma.OpWriteImm {
		if dst, win = q.d.regions.Target(q.pd, q, rkey, addr, n); dst == nil {
			return nil, nil, rdma.RemoteAccessError
		}
	}
	if (op == rdma.OpWriteImm || op == rdma.OpSend) && len(q.RQ) == 0 {
		return nil, nil, rdma.ReceiverNotReady
	}
	if op == rdma.OpSend {
		recv := q.RQ[0]
		if recv.Local.Length < n {
			q.RQ = q.RQ[1:]
			q.RecvCQ().Push(rdma.Completion{WRID: recv.ID, Op: rdma.OpRecv, Status: rdma.LocalLengthError})
			return nil, nil, rdma.RemoteAccessError
		}
		dst = recv.Local.MR.Bytes()[recv.Local.Offset : recv.Local.Offset+n]
	}
	return dst, win, rdma.Success
}
