package transfer

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/admission"
	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma"
)

// SetupConfig says how a node sets up queue pairs with its peers out of band:
// over a small control connection (TCP), on which the two nodes exchange
// their queue pairs' connection info and their limits, and which then stays
// open for the queue pair's life: when it closes, the queue pair is cut.
type SetupConfig struct {
	// Name is this node's name, as its peers' registry knows it; with TLS,
	// its certificate must name it (a DNS name of the certificate).
	Name string
	// Incarnation is this life of the node, as its registry record says
	// (0: not said). The hello carries it, and a peer that learns of a
	// lost life cuts only that life's queue pair, or an earlier one's
	// (CutIncarnation): the next life's, set up by then, stays.
	Incarnation uint64
	// PeerIncarnation is, for Dial, the life of the peer the registry
	// names (0: any): a hello of another life is refused.
	PeerIncarnation uint64
	// TLS is the node's mutual TLS configuration: its certificate, and the CA
	// that signs its peers' (RootCAs for Dial, ClientCAs for Serve). Only TLS
	// 1.3 is spoken. Required unless Insecure.
	TLS *tls.Config
	// Insecure allows plaintext control connections, with a warning logged:
	// anyone who reaches the port can then connect a queue pair.
	Insecure bool
	// Timeout bounds each step of the exchange (the TLS handshake, each
	// message); 0 means 5 s.
	Timeout time.Duration
	// MaxHandshakes bounds the control connections Serve holds before
	// their hello; a new one beyond it evicts the oldest of the source
	// address holding the most (package internal/admission), so a flood
	// from one address evicts only its own. 0 means 64.
	MaxHandshakes int
	// Admit is the registry's word on a peer: nil if it lists the node name
	// in role, and, where it knows the node's life, as incarnation (the
	// hello's); else an error wrapping pki.ErrUnknownPeer. Serve asks it
	// of every prefill node before anything is allocated for it; nil admits
	// any name and life (the certificate's role is checked all the same).
	Admit func(name string, role pki.Role, incarnation uint64) error
	// Log receives warnings (plaintext, refused peers); nil means slog.Default().
	Log *slog.Logger
}

func (s *SetupConfig) check() error {
	if s.Name == "" || len(s.Name) > maxName {
		return fmt.Errorf("%w: a node name of 1..%d bytes is needed", ErrSetup, maxName)
	}
	if s.TLS == nil && !s.Insecure {
		return fmt.Errorf("%w: no TLS configuration (set SetupConfig.Insecure for plaintext)", ErrSetup)
	}
	if s.Timeout == 0 {
		s.Timeout = 5 * time.Second
	}
	if s.MaxHandshakes == 0 {
		s.MaxHandshakes = 64
	}
	if s.Log == nil {
		s.Log = slog.Default()
	}
	return nil
}

// keepAlive probes an idle control connection, so that a peer whose host
// vanished without closing it (power, a cable) is noticed in about 20 s and
// its queue pair cut, rather than after the system's default of minutes.
var keepAlive = net.KeepAliveConfig{Enable: true, Idle: 5 * time.Second, Interval: 5 * time.Second, Count: 3}

// The hello each side sends: who it is (its name and this life's
// incarnation), its page geometry, the largest request its receive buffers
// take, and its queue pair's connection info.
type hello struct {
	role            byte // 'P' prefill, 'D' decode
	name            string
	incarnation     uint64
	pageTokens      uint32
	pageBytes       uint32
	maxRequestPages uint32
	recvSlots       uint32
	info            rdma.ConnInfo
}

const (
	// helloMagic starts every hello: "KVHS", then the hello's format (2:
	// the wire version follows; format 1, wire versions 1 and 2, had none).
	// The format never changes place, so a node refuses any other
	// version's hello by these bytes alone.
	helloMagic   = "KVHS\x02"
	helloFormat1 = "KVHS\x01"
	maxName      = 255
	maxHello     = 1024 // a hello is read into a buffer of at most this much: nothing is sized by the peer
	readyByte    = 'R'
)

func (h *hello) encode() []byte {
	b := []byte(helloMagic)
	b = append(b, protocol.Version, h.role)
	str := func(s string) { b = append(b, byte(len(s))); b = append(b, s...) }
	str(h.name)
	b = binary.BigEndian.AppendUint64(b, h.incarnation)
	for _, v := range []uint32{h.pageTokens, h.pageBytes, h.maxRequestPages, h.recvSlots, h.info.QPN, h.info.PSN} {
		b = binary.BigEndian.AppendUint32(b, v)
	}
	b = append(b, h.info.GID[:]...)
	b = binary.BigEndian.AppendUint16(b, h.info.LID)
	str(h.info.Fabric)
	str(h.info.Node)
	return binary.BigEndian.AppendUint16(b, 0) // reserved: the tag MAC key
}

var errHello = errors.New("malformed hello")

// ErrWireVersion: the peer speaks another wire version (protocol.Version)
// than this node, so setup refuses it before any queue pair: a node of
// another version is never a peer, whose every request would break the
// queue pair. It wraps protocol.ErrVersion.
var ErrWireVersion = fmt.Errorf("%w: the peer speaks another one", protocol.ErrVersion)

// versionHello is the hello a decode node answers a hello of another
// version with, before it closes: its magic and wire version only, so that
// the prefill node too says why it was refused.
func versionHello() []byte { return append([]byte(helloMagic), protocol.Version) }

func decodeHello(b []byte) (hello, error) {
	var h hello
	switch {
	case bytes.HasPrefix(b, []byte(helloFormat1)):
		return h, fmt.Errorf("%w: its hello is of wire version 2 or earlier, this node speaks version %d", ErrWireVersion, protocol.Version)
	case len(b) > len(helloMagic) && bytes.HasPrefix(b, []byte(helloMagic)) && b[len(helloMagic)] != protocol.Version:
		return h, fmt.Errorf("%w: it speaks wire version %d, this node version %d", ErrWireVersion, b[len(helloMagic)], protocol.Version)
	case len(b) > len(helloMagic) && bytes.HasPrefix(b, []byte(helloMagic[:4])) && b[4] > helloMagic[4]:
		return h, fmt.Errorf("%w: its hello is of format %d, of a wire version after %d, which this node speaks", ErrWireVersion, b[4], protocol.Version)
	case !bytes.HasPrefix(b, []byte(helloMagic)):
		return h, fmt.Errorf("%w: not a kvhandoff hello", errHello)
	}
	// The version byte, where there is one, is this node's (above); it is
	// taken as every field is, so that a hello cut short after its magic
	// is missing bytes like any other (sliced past, it ended the process
	// on a peer's seven bytes).
	b = b[len(helloMagic):]
	short := false
	take := func(n int) []byte {
		if short || len(b) < n {
			short = true
			return make([]byte, n)
		}
		p := b[:n]
		b = b[n:]
		return p
	}
	str := func() string { return string(take(int(take(1)[0]))) }
	u32 := func() uint32 { return binary.BigEndian.Uint32(take(4)) }
	take(1) // the version
	h.role = take(1)[0]
	h.name = str()
	h.incarnation = binary.BigEndian.Uint64(take(8))
	h.pageTokens, h.pageBytes, h.maxRequestPages, h.recvSlots, h.info.QPN, h.info.PSN = u32(), u32(), u32(), u32(), u32(), u32()
	copy(h.info.GID[:], take(16))
	h.info.LID = binary.BigEndian.Uint16(take(2))
	h.info.Fabric = str()
	h.info.Node = str()
	if keyLen := binary.BigEndian.Uint16(take(2)); keyLen != 0 {
		return h, fmt.Errorf("%w: a %d-byte tag key this node does not expect", errHello, keyLen)
	}
	if short || len(b) != 0 {
		return h, fmt.Errorf("%w: %d bytes left over or missing", errHello, len(b))
	}
	return h, nil
}

// writeHello sends h as one length-prefixed frame.
func writeHello(conn net.Conn, h *hello, timeout time.Duration) error {
	return writeFrame(conn, h.encode(), timeout)
}

// writeFrame sends body as one length-prefixed frame.
func writeFrame(conn net.Conn, body []byte, timeout time.Duration) error {
	conn.SetWriteDeadline(time.Now().Add(timeout))
	_, err := conn.Write(binary.BigEndian.AppendUint16(nil, uint16(len(body))))
	if err == nil {
		_, err = conn.Write(body)
	}
	return err
}

// readHello reads one hello, within the deadline and maxHello bytes.
func readHello(conn net.Conn, timeout time.Duration) (hello, error) {
	conn.SetReadDeadline(time.Now().Add(timeout))
	var n [2]byte
	if _, err := io.ReadFull(conn, n[:]); err != nil {
		return hello{}, err
	}
	size := int(binary.BigEndian.Uint16(n[:]))
	if size > maxHello {
		return hello{}, fmt.Errorf("%w: %d bytes announced, at most %d", errHello, size, maxHello)
	}
	buf := make([]byte, size)
	if _, err := io.ReadFull(conn, buf); err != nil {
		return hello{}, err
	}
	return decodeHello(buf)
}

// secure runs the TLS 1.3 handshake on conn (client for Dial, server for
// Serve) and returns the connection and the peer's verified certificate
// names; or conn as it is when the setup is insecure.
func secure(ctx context.Context, conn net.Conn, cfg *SetupConfig, client bool, peer string) (net.Conn, error) {
	if cfg.TLS == nil {
		return conn, nil
	}
	tc := cfg.TLS.Clone()
	tc.MinVersion, tc.MaxVersion = tls.VersionTLS13, tls.VersionTLS13
	var t *tls.Conn
	if client {
		tc.ServerName = peer // the decode node's certificate must name it
		t = tls.Client(conn, tc)
	} else {
		tc.ClientAuth = tls.RequireAndVerifyClientCert
		t = tls.Server(conn, tc)
	}
	hctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	if err := t.HandshakeContext(hctx); err != nil {
		return nil, err
	}
	return t, nil
}

// tagKeyLabel is the TLS exporter label of a queue pair's tag key (RFC 8446
// section 7.5): both ends derive the same secret from their handshake, and
// nothing of it crosses the wire.
const tagKeyLabel = "EXPORTER-kvhandoff-tag-key"

// queuePairKey is the tag key of the queue pair set up over conn between the
// prefill node and the decode node named. With TLS it comes from the
// handshake's exporter; a plaintext (insecure) setup has no secret, so its key
// is derived from the names alone and anyone can compute it.
func queuePairKey(conn net.Conn, prefill, decode string) (*protocol.TagKey, error) {
	var secret []byte
	if t, ok := conn.(*tls.Conn); ok {
		cs := t.ConnectionState()
		var err error
		if secret, err = cs.ExportKeyingMaterial(tagKeyLabel, nil, protocol.TagKeySecretSize); err != nil {
			return nil, err
		}
	} else {
		sum := sha256.Sum256(fmt.Appendf(nil, "kvhandoff insecure tag key\x00%s\x00%s", prefill, decode))
		secret = sum[:]
	}
	return protocol.NewTagKey(secret, protocol.SumXXH3)
}

// authenticated checks that the peer's certificate names the node its hello
// says it is and carries role (with TLS; without, the hello's word is all
// there is), then that the registry lists it in that role, and as that
// life where the hello names one (cfg.Admit; incarnation 0 before the
// hello).
func authenticated(conn net.Conn, name string, role pki.Role, incarnation uint64, cfg *SetupConfig) error {
	if t, ok := conn.(*tls.Conn); ok {
		certs := t.ConnectionState().PeerCertificates
		if len(certs) == 0 {
			return errors.New("no certificate")
		}
		if err := pki.CheckPeer(certs[0], name, role); err != nil {
			return err
		}
	}
	if cfg.Admit != nil {
		return cfg.Admit(name, role, incarnation)
	}
	return nil
}

// check compares a peer's hello with this node's geometry.
func (h *hello) check(role byte, pageTokens, pageBytes int) error {
	switch {
	case h.role != role:
		return fmt.Errorf("%w: role %q, want %q", errHello, h.role, role)
	case h.name == "":
		return fmt.Errorf("%w: no name", errHello)
	case int(h.pageTokens) != pageTokens || int(h.pageBytes) != pageBytes:
		return fmt.Errorf("pages of %d tokens, %d bytes; this node's are %d tokens, %d bytes", h.pageTokens, h.pageBytes, pageTokens, pageBytes)
	case h.recvSlots != RecvSlots:
		return fmt.Errorf("%d receive buffers per queue pair; this node expects %d", h.recvSlots, RecvSlots)
	case h.maxRequestPages < 1 || h.maxRequestPages > protocol.MaxGrantPages:
		return fmt.Errorf("%w: largest request of %d pages", errHello, h.maxRequestPages)
	}
	return nil
}

func (e *endpoint) localHello(role byte, cfg *SetupConfig, c *conn, pageTokens, pageBytes, maxPages int) *hello {
	return &hello{role: role, name: cfg.Name, incarnation: cfg.Incarnation, pageTokens: uint32(pageTokens), pageBytes: uint32(pageBytes),
		maxRequestPages: uint32(maxPages), recvSlots: RecvSlots, info: c.qp.Info()}
}

// abandon cuts a queue pair whose setup failed: it never went live, and its
// buffers come back once its flush drains.
func (e *endpoint) abandon(c *conn, why error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.cut(c, why)
	e.role.carry()
}

// attach makes a set-up queue pair live, with its control connection, and
// watches the connection: when it closes (the peer went away, or broke the
// exchange by sending more), the queue pair is cut.
func (e *endpoint) attach(c *conn, ctl net.Conn) error {
	e.mu.Lock()
	c.ctl = ctl
	err := e.goLive(c)
	if err != nil {
		e.role.carry()
	}
	e.mu.Unlock()
	if err != nil {
		if ctl != nil {
			ctl.Close() // the peer's end hears its setup failed
		}
		return err
	}
	go func() {
		ctl.SetReadDeadline(time.Time{})
		var b [1]byte
		_, err := ctl.Read(b[:])
		if err == nil {
			err = errors.New("unexpected bytes after setup")
		}
		e.mu.Lock()
		defer e.mu.Unlock()
		if !c.broken {
			e.cut(c, fmt.Errorf("%w: control connection to %q: %v", protocol.ErrPeerFailed, c.name, err))
			e.role.carry()
			e.flushAll()
		}
	}()
	return nil
}

// Dial sets up a queue pair to the decode node peer listening at addr (its
// Serve): TLS 1.3 with the peer's certificate checked against peer and the
// decode role (pki.CheckPeer), the hellos, both queue pairs to RTS. A peer that does not answer within
// cfg.Timeout, or answers anything but a matching hello, fails with ErrSetup
// and leaves nothing behind. A queue pair already live to peer is cut once
// the new one is (a reconnect).
func (p *Prefill) Dial(ctx context.Context, peer, addr string, cfg SetupConfig) error {
	if err := cfg.check(); err != nil {
		return err
	}
	if cfg.TLS == nil {
		cfg.Log.Warn("transfer: plaintext control connection (insecure)", "peer", peer, "addr", addr)
	}
	fail := func(step string, err error) error {
		return fmt.Errorf("%w: %s %q at %s: %s: %w", ErrSetup, "decode node", peer, addr, step, err)
	}
	dctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	raw, err := (&net.Dialer{KeepAliveConfig: keepAlive}).DialContext(dctx, "tcp", addr)
	cancel()
	if err != nil {
		return fail("dial", err)
	}
	conn, err := secure(ctx, raw, &cfg, true, peer)
	if err == nil {
		// Who the peer is, before anything of this node's goes to it.
		if err = authenticated(conn, peer, pki.RoleDecode, 0, &cfg); err != nil {
			conn.Close()
		}
	}
	if err != nil {
		raw.Close()
		return fail("TLS handshake", err)
	}
	p.mu.Lock()
	c, err := p.newConn(peer, p.cfg.MaxRequestPages)
	if err == nil {
		c.incarnation = cfg.PeerIncarnation // the hello must say so (0: whatever it says)
	}
	p.mu.Unlock()
	if err != nil {
		conn.Close()
		return fail("queue pair", err)
	}
	abandon := func(step string, err error) error {
		conn.Close()
		err = fail(step, err)
		p.abandon(c, err)
		return err
	}
	if err := writeHello(conn, p.localHello('P', &cfg, c, p.cfg.PageTokens, p.cfg.PageBytes, p.cfg.MaxRequestPages), cfg.Timeout); err != nil {
		return abandon("hello", err)
	}
	h, err := readHello(conn, cfg.Timeout)
	if err == nil {
		err = h.check('D', p.cfg.PageTokens, p.cfg.PageBytes)
	}
	if err == nil && h.name != peer {
		err = fmt.Errorf("it says it is %q", h.name)
	}
	if err == nil && cfg.PeerIncarnation != 0 && h.incarnation != cfg.PeerIncarnation {
		err = fmt.Errorf("%w: it says it is life %d of %q; the registry names life %d", pki.ErrUnknownPeer, h.incarnation, peer, cfg.PeerIncarnation)
	}
	if err != nil {
		return abandon("its hello", err)
	}
	if cfg.TLS != nil {
		h.info.Node = peer // the queue pair accepts only the node the certificate named
	}
	p.mu.Lock()
	c.maxPages = min(c.maxPages, int(h.maxRequestPages)) // the decode node's receive buffers hold Bootstraps of its largest request
	c.incarnation = h.incarnation
	p.mu.Unlock()
	if c.tagKey, err = queuePairKey(conn, cfg.Name, peer); err != nil {
		return abandon("tag key", err)
	}
	if err := c.qp.Connect(h.info); err != nil {
		return abandon("connect", err)
	}
	conn.SetWriteDeadline(time.Now().Add(cfg.Timeout))
	if _, err := conn.Write([]byte{readyByte}); err != nil {
		return abandon("ready", err)
	}
	if err := p.attach(c, conn); err != nil {
		return fail("queue pair", err)
	}
	return nil
}

// Serve accepts prefill nodes' control connections on ln until ctx ends and
// sets up a queue pair with each: TLS 1.3 with a client certificate that
// must name the node its hello says it is and carry the prefill role
// (pki.CheckPeer), a name cfg.Admit lists as a prefill node, the hellos,
// the queue pair to RTS. A peer refused for who it is is logged with an
// error wrapping ErrSetup and pki.ErrPeerRefused (ErrWrongRole,
// ErrUnknownPeer, ...). Nothing is allocated for a peer before it has authenticated and sent
// a hello that matches this node; a peer that stalls, or sends anything else,
// is dropped after cfg.Timeout, or sooner when the handshakes held reach
// cfg.MaxHandshakes and its source address holds the most of them. Temporary accept errors (a full file table)
// are waited out, not fatal. Serve returns when ctx ends or ln fails.
func (d *Decode) Serve(ctx context.Context, ln net.Listener, cfg SetupConfig) error {
	if err := cfg.check(); err != nil {
		return err
	}
	if cfg.TLS == nil {
		cfg.Log.Warn("transfer: plaintext control connections (insecure)", "addr", ln.Addr().String())
	}
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	pending := admission.New(cfg.MaxHandshakes)
	defer pending.Close()
	backoff := time.Duration(0)
	for {
		raw, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			var ne net.Error
			if errors.As(err, &ne) && !errors.Is(err, net.ErrClosed) {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				cfg.Log.Warn("transfer: accept", "err", err, "retry_in", backoff)
				select {
				case <-time.After(backoff):
				case <-ctx.Done():
					return ctx.Err()
				}
				continue
			}
			return err
		}
		backoff = 0
		if tc, ok := raw.(*net.TCPConn); ok {
			tc.SetKeepAliveConfig(keepAlive)
		}
		watched, ok := pending.Admit(raw)
		if !ok {
			raw.Close()
			continue
		}
		go func() {
			if err := d.accept(ctx, raw, watched, &cfg, pending); err != nil {
				cfg.Log.Warn("transfer: refused a prefill node", "remote", raw.RemoteAddr().String(), "err", err)
			}
			pending.Done(raw)
		}()
	}
}

// accept sets up a queue pair with the prefill node on raw, reading it
// through watched, so that pending learns when it speaks.
func (d *Decode) accept(ctx context.Context, raw, watched net.Conn, cfg *SetupConfig, pending *admission.Table) error {
	conn, err := secure(ctx, watched, cfg, false, "")
	if err != nil {
		raw.Close()
		return fmt.Errorf("%w: TLS handshake: %w", ErrSetup, err)
	}
	h, err := readHello(conn, cfg.Timeout)
	if errors.Is(err, ErrWireVersion) { // tell it why, so that it says so too
		writeFrame(conn, versionHello(), cfg.Timeout)
	}
	if err == nil {
		err = h.check('P', d.cfg.PageTokens, d.cfg.PageBytes)
	}
	if err == nil {
		err = authenticated(conn, h.name, pki.RolePrefill, h.incarnation, cfg)
	}
	if err != nil {
		conn.Close()
		return fmt.Errorf("%w: hello: %w", ErrSetup, err)
	}
	// Authenticated and matching: no longer one that newer connections evict.
	if !pending.Done(raw) {
		conn.Close()
		return fmt.Errorf("%w: prefill node %q: evicted by newer connections before its hello", ErrSetup, h.name)
	}
	d.mu.Lock()
	c, err := d.newConn(h.name, min(d.cfg.MaxRequestPages, int(h.maxRequestPages)))
	if err == nil {
		c.incarnation = h.incarnation
	}
	d.mu.Unlock()
	if err != nil {
		conn.Close()
		return fmt.Errorf("%w: queue pair for %q: %w", ErrSetup, h.name, err)
	}
	abandon := func(step string, err error) error {
		conn.Close()
		err = fmt.Errorf("%w: prefill node %q: %s: %w", ErrSetup, h.name, step, err)
		d.abandon(c, err)
		return err
	}
	if cfg.TLS != nil {
		h.info.Node = h.name
	}
	if c.tagKey, err = queuePairKey(conn, h.name, cfg.Name); err != nil {
		return abandon("tag key", err)
	}
	if err := c.qp.Connect(h.info); err != nil {
		return abandon("connect", err)
	}
	if err := writeHello(conn, d.localHello('D', cfg, c, d.cfg.PageTokens, d.cfg.PageBytes, d.cfg.MaxRequestPages), cfg.Timeout); err != nil {
		return abandon("hello", err)
	}
	conn.SetReadDeadline(time.Now().Add(cfg.Timeout))
	var ready [1]byte
	if _, err := io.ReadFull(conn, ready[:]); err != nil || ready[0] != readyByte {
		if err == nil {
			err = fmt.Errorf("%#x instead of ready", ready[0])
		}
		return abandon("ready", err)
	}
	if err := d.attach(c, conn); err != nil {
		return fmt.Errorf("%w: prefill node %q: %w", ErrSetup, h.name, err)
	}
	return nil
}
