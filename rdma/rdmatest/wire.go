package rdmatest

import (
	"bytes"
	"io"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/rdma"
)

// Wire is a provider's wire as a process on the network reaches it: raw
// connections to a device, its handshake and hello, and its request frames.
// Package socket supplies one; the suite crafts the attacks with it.
type Wire interface {
	// Dial opens a raw stream connection to device d: nothing said yet.
	Dial(t *testing.T, d rdma.Device) net.Conn
	// Secure runs the client's side of the device's handshake on conn,
	// with a certificate for the node called as, from the deployment's
	// authority or, if stranger, from an authority nobody trusts. It
	// returns the connection to say the hello on.
	Secure(conn net.Conn, as string, stranger bool) (net.Conn, error)
	// Hello is the hello of queue pair from addressed to queue pair to.
	Hello(to, from rdma.ConnInfo) []byte
	// Header is a request frame's header announcing n payload bytes.
	Header(op rdma.Opcode, rkey uint32, addr uint64, n uint32) []byte
	// Limits are those of the devices Hostile.Devices makes.
	Limits() Limits
}

// Limits are the bounds a device with a wire holds its peers to.
type Limits struct {
	Handshake  time.Duration // the handshake and hello
	Frame      time.Duration // a frame, once begun (plus its payload's time)
	Idle       time.Duration // silence between frames
	MaxPending int           // connections before their hello
}

// runWire runs the wire-level attacks. Those that wait for a bound of the
// device to expire (half a frame, slowloris, the silent peer) run in
// parallel, after the others: the flood and the huge lengths measure the
// process's goroutines and allocations, and run alone.
func runWire(t *testing.T, h Hostile) {
	t.Run("StrangerWithoutACertificateNeverReachesAQueuePair", func(t *testing.T) { stranger(t, h) })
	t.Run("ForgedHelloIsRefused", func(t *testing.T) { forgedHello(t, h) })
	t.Run("HugeAnnouncedLengthAllocatesNothing", func(t *testing.T) { hugeLength(t, h) })
	t.Run("MalformedHeaderBreaksTheQueuePair", func(t *testing.T) { malformed(t, h) })
	t.Run("HalfAFrameBreaksTheQueuePair", func(t *testing.T) { halfFrame(t, h) })
	t.Run("SlowlorisBreaksOnlyItsQueuePair", func(t *testing.T) { slowloris(t, h) })
	t.Run("SilentPeerBreaksItsQueuePairAndKeepalivesKeepOthers", func(t *testing.T) { silent(t, h) })
	t.Run("FloodOfIdleConnectionsStaysBounded", func(t *testing.T) { flood(t, h) })
}

// victim is a responder's queue pair connected to a puppet on the requester
// device that never dials: the suite speaks for the puppet over the wire.
type victim struct {
	qp, puppet rdma.QueuePair
	dst        rdma.MemoryRegion
	recv       rdma.CompletionQueue
}

func newVictim(t *testing.T, a, b rdma.Device, regionBytes int) *victim {
	t.Helper()
	mk := func(d rdma.Device) (rdma.ProtectionDomain, rdma.CompletionQueue, rdma.QueuePair) {
		pd, err := d.AllocPD()
		if err != nil {
			t.Fatal(err)
		}
		cq, err := d.CreateCQ(64)
		if err != nil {
			t.Fatal(err)
		}
		qp, err := pd.CreateQP(cq, cq, 16)
		if err != nil {
			t.Fatal(err)
		}
		return pd, cq, qp
	}
	_, _, puppet := mk(a)
	pd, cq, qp := mk(b)
	v := &victim{qp: qp, puppet: puppet, recv: cq, dst: register(t, pd, regionBytes, rdma.LocalWrite|rdma.RemoteWrite)}
	inbox := register(t, pd, 64, rdma.LocalWrite)
	if err := qp.PostRecv(rdma.WorkRequest{ID: 1, Op: rdma.OpRecv, Local: rdma.SGE{MR: inbox, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	if err := qp.Connect(puppet.Info()); err != nil {
		t.Fatal(err)
	}
	return v
}

// attach speaks for v's puppet: a certificate for its node, the hello, and
// the device's acceptance. The next bytes on the connection are frames.
func attach(t *testing.T, w Wire, b rdma.Device, v *victim) net.Conn {
	t.Helper()
	conn, answer := greet(t, w, b, v.puppet.Info().Node, false, w.Hello(v.qp.Info(), v.puppet.Info()))
	if answer != 0 {
		t.Fatalf("the genuine hello was refused (%d)", answer)
	}
	return conn
}

// greet dials b, authenticates as node as, says hello and returns the
// device's answer (-1: the connection was closed instead).
func greet(t *testing.T, w Wire, b rdma.Device, as string, stranger bool, hello []byte) (net.Conn, int) {
	t.Helper()
	raw := w.Dial(t, b)
	conn, err := w.Secure(raw, as, stranger)
	if err != nil {
		raw.Close()
		return nil, -1
	}
	t.Cleanup(func() { conn.Close() })
	conn.SetDeadline(time.Now().Add(wait))
	if _, err := conn.Write(hello); err != nil {
		return conn, -1
	}
	var a [1]byte
	if _, err := io.ReadFull(conn, a[:]); err != nil {
		return conn, -1
	}
	return conn, int(a[0])
}

// closedByPeer reports whether the device closed conn (a read ends in an
// error, not a timeout of ours).
func closedByPeer(conn net.Conn) bool {
	conn.SetReadDeadline(time.Now().Add(wait))
	_, err := io.Copy(io.Discard, conn)
	ne, ok := err.(net.Error)
	return !(ok && ne.Timeout())
}

// stranger: a peer with no certificate, or one from an authority nobody
// trusts, is cut off in the handshake; even a plaintext hello naming the
// victim's QPN and PSN exactly, followed by a WRITE, lands nothing.
func stranger(t *testing.T, h Hostile) {
	a, b := h.Devices(t)
	good := newBystander(t, a, b)
	v := newVictim(t, a, b, 4096)
	w := h.Wire
	raw := w.Dial(t, b)
	defer raw.Close()
	raw.Write(w.Hello(v.qp.Info(), v.puppet.Info()))
	raw.Write(w.Header(rdma.OpWrite, v.dst.RKey(), v.dst.Addr(), 64))
	raw.Write(bytes.Repeat([]byte{0xEE}, 64))
	if !closedByPeer(raw) {
		t.Fatal("a plaintext stranger was kept talking")
	}
	if _, answer := greet(t, w, b, v.puppet.Info().Node, true, w.Hello(v.qp.Info(), v.puppet.Info())); answer != -1 {
		t.Fatalf("a certificate of an unknown authority was answered (%d)", answer)
	}
	if !bytes.Equal(v.dst.Bytes(), make([]byte, 4096)) {
		t.Fatal("a stranger's bytes landed")
	}
	if v.qp.State() != rdma.StateRTS {
		t.Fatal("a stranger disturbed a queue pair it never reached")
	}
	attach(t, w, b, v) // the genuine peer still gets in
	good.served(t)
}

// forgedHello: an authenticated node whose hello has the wrong PSN, names a
// queue pair other than the one the victim was connected to, or comes with
// the certificate of another node, is refused; the genuine hello, differing
// only in that, is accepted afterwards.
func forgedHello(t *testing.T, h Hostile) {
	a, b := h.Devices(t)
	good := newBystander(t, a, b)
	v := newVictim(t, a, b, 4096)
	w := h.Wire
	to, from := v.qp.Info(), v.puppet.Info()
	for name, f := range map[string]func() (string, []byte){
		"wrong target PSN": func() (string, []byte) { x := to; x.PSN ^= 1; return from.Node, w.Hello(x, from) },
		"wrong target QPN": func() (string, []byte) { x := to; x.QPN ^= 1; return from.Node, w.Hello(x, from) },
		"another dialler":  func() (string, []byte) { x := from; x.QPN ^= 1; return from.Node, w.Hello(to, x) },
		"dialler's PSN":    func() (string, []byte) { x := from; x.PSN ^= 1; return from.Node, w.Hello(to, x) },
		"another node":     func() (string, []byte) { return from.Node + "-impostor", w.Hello(to, from) },
	} {
		as, hello := f()
		if _, answer := greet(t, w, b, as, false, hello); answer == 0 {
			t.Errorf("%s: the forged hello was accepted", name)
		}
	}
	conn := attach(t, w, b, v)
	conn.Write(w.Header(rdma.OpWrite, v.dst.RKey(), v.dst.Addr(), 4))
	conn.Write([]byte("real"))
	var st [1]byte
	if _, err := io.ReadFull(conn, st[:]); err != nil || rdma.Status(st[0]) != rdma.Success || string(v.dst.Bytes()[:4]) != "real" {
		t.Fatalf("the genuine peer's WRITE: %v, status %d", err, st[0])
	}
	good.served(t)
}

func heapAlloc() uint64 {
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.TotalAlloc
}

// hugeLength: headers announcing up to 1 GiB, refused or accepted, make the
// responder allocate nothing on their word.
func hugeLength(t *testing.T, h Hostile) {
	a, b := h.Devices(t)
	good := newBystander(t, a, b)
	const region = 16 << 20
	for name, hdr := range map[string]func(v *victim) []byte{
		"1 GiB WRITE beyond a small region": func(v *victim) []byte {
			return h.Wire.Header(rdma.OpWrite, v.dst.RKey(), v.dst.Addr(), 1<<30)
		},
		"1 GiB SEND into a 64-byte receive": func(v *victim) []byte { return h.Wire.Header(rdma.OpSend, 0, 0, 1<<30) },
		"16 MiB WRITE in bounds, then silence": func(v *victim) []byte {
			return h.Wire.Header(rdma.OpWrite, v.dst.RKey(), v.dst.Addr(), region)
		},
		"4 GiB - 1 announced": func(v *victim) []byte { return h.Wire.Header(rdma.OpWrite, v.dst.RKey(), v.dst.Addr(), 1<<32-1) },
	} {
		t.Run(name, func(t *testing.T) {
			v := newVictim(t, a, b, region)
			conn := attach(t, h.Wire, b, v)
			before := heapAlloc()
			conn.Write(hdr(v))
			time.Sleep(50 * time.Millisecond) // let the responder act on the header: it must not allocate
			allocated := heapAlloc() - before
			conn.Close()
			waitStateWithin(t, v.qp, rdma.StateError, h.Wire.Limits().Frame)
			t.Logf("allocated %d bytes after the header", allocated)
			if allocated > 1<<20 {
				t.Fatalf("the responder allocated %d bytes on a peer's word", allocated)
			}
			good.served(t)
		})
	}
}

// halfFrame: half a header, or a header and part of its payload, then a
// close, moves the queue pair to the error state (the receiver learns of it
// and fences); a fresh queue pair on the same devices connects and is served.
func halfFrame(t *testing.T, h Hostile) {
	t.Parallel()
	a, b := h.Devices(t)
	good := newBystander(t, a, b)
	for name, frame := range map[string]func(v *victim) []byte{
		"half a header": func(v *victim) []byte { return h.Wire.Header(rdma.OpWrite, v.dst.RKey(), v.dst.Addr(), 64)[:12] },
		"half a payload": func(v *victim) []byte {
			return append(h.Wire.Header(rdma.OpWrite, v.dst.RKey(), v.dst.Addr(), 64), make([]byte, 32)...)
		},
		"nothing at all": func(v *victim) []byte { return nil },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			v := newVictim(t, a, b, 4096)
			conn := attach(t, h.Wire, b, v)
			conn.Write(frame(v))
			conn.Close()
			waitStateWithin(t, v.qp, rdma.StateError, h.Wire.Limits().Frame)
			if c := collect(t, v.recv, 1)[0]; c.Status != rdma.FlushError {
				t.Fatalf("the posted receive completed %v, want a flush", c.Status)
			}
			newBystander(t, a, b).served(t)
			good.served(t)
		})
	}
}

// slowloris: a frame begun and then stalled, or trickled a byte at a time,
// breaks its queue pair once the frame bound is past (eventually: within a
// generous guard after it); the bystander is served meanwhile.
func slowloris(t *testing.T, h Hostile) {
	t.Parallel()
	a, b := h.Devices(t)
	good := newBystander(t, a, b)
	frameLimit := h.Wire.Limits().Frame
	for name, trickle := range map[string]bool{"stalled": false, "trickled": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			v := newVictim(t, a, b, 4096)
			conn := attach(t, h.Wire, b, v)
			frame := append(h.Wire.Header(rdma.OpWrite, v.dst.RKey(), v.dst.Addr(), 4096), make([]byte, 4096)...)
			start := time.Now()
			conn.Write(frame[:1])
			for i := 1; v.qp.State() == rdma.StateRTS && time.Since(start) < frameLimit+wait; i++ {
				if trickle && i < len(frame) {
					conn.Write(frame[i : i+1])
				}
				good.served(t)
				time.Sleep(frameLimit / 10)
			}
			if v.qp.State() != rdma.StateError {
				t.Fatalf("the queue pair was held for %v (frame bound %v)", time.Since(start), frameLimit)
			}
			t.Logf("broken after %v (frame bound %v)", time.Since(start).Round(time.Millisecond), frameLimit)
			conn.Close()
			good.served(t)
		})
	}
}

// flood: many times the bound of idle connections, and as many forged
// hellos, leave the responder's goroutines and heap bounded; the bystander is
// served and a new queue pair connects during the flood; when the flood
// stops, the goroutines come back.
func flood(t *testing.T, h Hostile) {
	a, b := h.Devices(t)
	good := newBystander(t, a, b)
	handshake, maxPending := h.Wire.Limits().Handshake, h.Wire.Limits().MaxPending
	runtime.GC()
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	g0 := runtime.NumGoroutine()
	n := 8 * maxPending
	conns := make([]net.Conn, 0, n)
	for i := 0; i < n; i++ {
		conns = append(conns, h.Wire.Dial(t, b))
	}
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	good.served(t)
	newBystander(t, a, b).served(t) // a handshake during the flood succeeds
	for i := 0; i < maxPending; i++ {
		v := good.x.B.Info()
		v.PSN ^= 1
		greet(t, h.Wire, b, good.x.A.Info().Node, false, h.Wire.Hello(v, good.x.A.Info()))
	}
	g1 := runtime.NumGoroutine()
	runtime.GC()
	runtime.ReadMemStats(&m1)
	grew := int64(m1.HeapInuse) - int64(m0.HeapInuse)
	t.Logf("%d idle connections and %d forged hellos: goroutines %d -> %d, heap in use %+d KiB", n, maxPending, g0, g1, grew>>10)
	// Each admitted connection holds one goroutine; the rest are the test's
	// own queue pairs (a few each).
	if g1-g0 > maxPending+32 {
		t.Fatalf("goroutines grew by %d under a flood bounded at %d connections", g1-g0, maxPending)
	}
	if grew > 64<<20 {
		t.Fatalf("heap grew by %d MiB under the flood", grew>>20)
	}
	if !eventuallyWithin(handshake, func() bool { return runtime.NumGoroutine() <= g0+32 }) {
		t.Fatalf("goroutines stayed at %d after the handshake bound (%v)", runtime.NumGoroutine(), handshake)
	}
	good.served(t)
}

// malformed: a header with an opcode a peer may not send, reserved bits or
// unknown flags set, or a length beyond the largest message breaks its queue
// pair and lands nothing.
func malformed(t *testing.T, h Hostile) {
	a, b := h.Devices(t)
	good := newBystander(t, a, b)
	for name, mutate := range map[string]func(hdr []byte){
		"RECV opcode":       func(hdr []byte) { hdr[0] = byte(rdma.OpRecv) },
		"opcode zero":       func(hdr []byte) { hdr[0] = 0 },
		"opcode 255":        func(hdr []byte) { hdr[0] = 255 },
		"reserved bits set": func(hdr []byte) { hdr[3] = 1 },
		"unknown flag":      func(hdr []byte) { hdr[1] = 2 },
		"length 2^31":       func(hdr []byte) { hdr[20] = 0x80 },
	} {
		t.Run(name, func(t *testing.T) {
			v := newVictim(t, a, b, 4096)
			conn := attach(t, h.Wire, b, v)
			hdr := h.Wire.Header(rdma.OpWrite, v.dst.RKey(), v.dst.Addr(), 64)
			mutate(hdr)
			conn.Write(append(hdr, bytes.Repeat([]byte{0xEE}, 64)...))
			waitState(t, v.qp, rdma.StateError)
			if !bytes.Equal(v.dst.Bytes(), make([]byte, 4096)) {
				t.Fatal("a malformed request landed bytes")
			}
			good.served(t)
		})
	}
}

// silent: a peer that attaches and then says nothing, not even a keepalive,
// breaks its queue pair once the idle bound is past (eventually: within a
// generous guard after it); a genuine pair idle for twice that bound stays
// up, kept alive by its keepalives, and is served.
func silent(t *testing.T, h Hostile) {
	t.Parallel()
	a, b := h.Devices(t)
	good := newBystander(t, a, b)
	good.served(t)
	idle := h.Wire.Limits().Idle
	v := newVictim(t, a, b, 4096)
	attach(t, h.Wire, b, v)
	start := time.Now()
	waitStateWithin(t, v.qp, rdma.StateError, idle)
	t.Logf("a silent peer's queue pair broke after %v (idle bound %v)", time.Since(start).Round(time.Millisecond), idle)
	if wait := 2*idle - time.Since(start); wait > 0 {
		time.Sleep(wait)
	}
	if good.x.A.State() != rdma.StateRTS || good.x.B.State() != rdma.StateRTS {
		t.Fatal("an idle genuine pair was broken: its keepalives did not keep it")
	}
	good.served(t)
}
