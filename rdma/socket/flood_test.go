package socket

import (
	"io"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/admission/admissiontest"
	"github.com/kvhandoff/kvhandoff/rdma"
)

// A stranger without a certificate that keeps dialling the device from one
// address (127.0.0.2), never handshaking, evicts only its own pending
// connections: the genuine peer on 127.0.0.1 connects every time. (With
// the oldest evicted whatever its source, 3 of 10 Connects failed.)
func TestFloodFromOneAddressDoesNotEvictAnotherAddressesHandshake(t *testing.T) {
	listen := func(name string) *Device {
		cfg := nodeConfig(t, name) // the default MaxPending and HandshakeTimeout
		d, err := Listen("tcp", "127.0.0.1:0", cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		return d
	}
	a, b := listen("a"), listen("b")
	_, address, _ := strings.Cut(b.Name(), ":")
	stop := admissiontest.Flood(t, address, "127.0.0.2", 4)
	const tries = 10
	fails := 0
	for i := range tries {
		_, _, qa := newQP(t, a)
		_, _, qb := newQP(t, b)
		if err := qb.Connect(qa.Info()); err != nil { // b dials a, which is not flooded
			t.Fatal(err)
		}
		if err := qa.Connect(qb.Info()); err != nil { // a dials the flooded b
			fails++
			t.Logf("try %d: %v", i, err)
		}
		qa.ToError()
		qb.ToError()
	}
	dials := stop()
	t.Logf("%d flood connections; %d of %d genuine Connects failed", dials, fails, tries)
	if fails > 0 {
		t.Fatalf("a one-address flood denied the genuine peer %d of %d times", fails, tries)
	}
	if dials < int64(b.cfg.MaxPending) {
		t.Fatalf("the flood made only %d connections, too few to fill the %d places", dials, b.cfg.MaxPending)
	}
}

// An authenticated node that knows a queue pair's QPN and PSN but is not
// its peer holds at most one of its waiting places, however often it dials,
// and each for at most HandshakeTimeout: the genuine peer still gets in.
func TestASquatterHoldsOneWaitingPlaceForAWhile(t *testing.T) {
	a, b := devices(t, "tcp")
	w := wire{}
	_, _, peer := newQP(t, a)
	_, _, victim := newQP(t, b) // still in Reset: arrivals wait
	var squatters []io.Reader
	for range 2 * maxWaiting {
		raw := w.Dial(t, b)
		conn, err := w.Secure(raw, "c", false)
		if err != nil {
			t.Fatal(err)
		}
		conn.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := conn.Write(w.Hello(victim.Info(), peer.Info())); err != nil {
			t.Fatal(err)
		}
		var answer [1]byte
		if _, err := io.ReadFull(conn, answer[:]); err != nil || answer[0] != 0 {
			t.Fatalf("squatter %d hello: %v %v (a waiting place is open to it)", len(squatters), answer, err)
		}
		squatters = append(squatters, conn)
	}
	// The genuine peer dials before the victim's Connect: it waits too.
	if err := peer.Connect(victim.Info()); err != nil {
		t.Fatalf("the genuine peer was refused while a squatter dialled: %v", err)
	}
	// Every squatter's connection is closed: replaced by its next, or
	// dropped by the victim's Connect, which names another peer.
	if err := victim.Connect(peer.Info()); err != nil {
		t.Fatal(err)
	}
	for i, s := range squatters {
		if n, err := io.Copy(io.Discard, s); n != 0 || err != nil {
			t.Fatalf("squatter %d: read %d bytes, %v; want its connection closed", i, n, err)
		}
	}
	if !waitState(peer, rdma.StateRTS) || !waitState(victim, rdma.StateRTS) {
		t.Fatal("the genuine pair is not connected")
	}
}

// A connection that waits for a Connect that never comes is dropped after
// HandshakeTimeout, freeing its place.
func TestAWaitingConnectionIsDroppedAfterTheHandshakeTimeout(t *testing.T) {
	a, b := devices(t, "tcp")
	_, _, peer := newQP(t, a)
	_, _, victim := newQP(t, b)
	if err := peer.Connect(victim.Info()); err != nil { // waits at b
		t.Fatal(err)
	}
	// b's victim never connects: within HandshakeTimeout the waiting
	// connection is dropped, and the peer, whose requests it would carry,
	// breaks (its answers see the close).
	if !waitState(peer, rdma.StateError) {
		t.Fatalf("peer still %v long after the waiting connection's deadline", peer.State())
	}
	victim.(*QP).Mu.Lock()
	waiting := len(victim.(*QP).waiting)
	victim.(*QP).Mu.Unlock()
	if waiting != 0 {
		t.Fatalf("%d connections still waiting", waiting)
	}
}

func waitState(qp rdma.QueuePair, want rdma.QPState) bool {
	for deadline := time.Now().Add(10 * testHandshake); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if qp.State() == want {
			return true
		}
	}
	return false
}

// A queue pair in the error state is forgotten by its device: reconnecting
// many times leaves no entries behind.
func TestBrokenQueuePairsLeaveTheDevice(t *testing.T) {
	a, b := devices(t, "tcp")
	for range 20 {
		_, _, qa := newQP(t, a)
		_, _, qb := newQP(t, b)
		if err := qb.Connect(qa.Info()); err != nil {
			t.Fatal(err)
		}
		if err := qa.Connect(qb.Info()); err != nil {
			t.Fatal(err)
		}
		qa.ToError()
		qb.ToError()
	}
	for _, d := range []*Device{a, b} {
		d.mu.Lock()
		n := len(d.qps)
		d.mu.Unlock()
		if n != 0 {
			t.Fatalf("%s holds %d queue pairs after all broke", d.Name(), n)
		}
	}
}
