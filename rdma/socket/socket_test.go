package socket

import (
	"bytes"
	"crypto/tls"
	"encoding/binary"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/rdmatest"
)

var _ rdma.Faults = (*QP)(nil)

// The deployment's authority for every test of the package, and one nobody
// trusts.
var (
	testCA     = sync.OnceValue(func() *pki.CA { return mustCA("kvhandoff-test") })
	strangerCA = sync.OnceValue(func() *pki.CA { return mustCA("stranger") })
)

func mustCA(name string) *pki.CA {
	ca, err := pki.NewCA(name)
	if err != nil {
		panic(err)
	}
	return ca
}

// nodeConfig is the device configuration of node name, with the given limits.
func nodeConfig(t testing.TB, name string) Config {
	t.Helper()
	tc, err := testCA().Config(name)
	if err != nil {
		t.Fatal(err)
	}
	return Config{TLS: tc, Logger: quiet}
}

// quiet takes the warnings of the devices under attack, which are expected.
var quiet = slog.New(slog.DiscardHandler)

// Bounds for the hostile suite. They are short enough that its attacks end
// in seconds, and long enough that the well-behaved queue pairs sharing the
// attacked devices survive the scheduling stalls of a loaded 2-core CI
// machine under -race (stalls near a second were seen): every bound also
// governs those pairs, so a sub-second one made them fail at random (a
// frame bound of 300 ms broke a bystander's frame; an idle bound of 1 s,
// with keepalives every 250 ms, broke idle bystanders). The idle bound
// tolerates a stall of three quarters of itself (keepalives go every
// quarter), the frame bound one of itself.
const (
	testHandshake  = 3 * time.Second
	testFrame      = 1500 * time.Millisecond
	testMaxPending = 32
	testIdle       = 3 * time.Second
)

// devices opens two devices, nodes "a" and "b", each listening on its own
// socket, so every request crosses a real stream socket.
func devices(t *testing.T, network string) (*Device, *Device) {
	t.Helper()
	listen := func(name string) *Device {
		addr := "127.0.0.1:0"
		if network == "unix" {
			addr = filepath.Join(t.TempDir(), name+".sock")
		}
		cfg := nodeConfig(t, name)
		cfg.HandshakeTimeout, cfg.FrameTimeout, cfg.MaxPending, cfg.IdleTimeout = testHandshake, testFrame, testMaxPending, testIdle
		d, err := Listen(network, addr, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		return d
	}
	return listen("a"), listen("b")
}

func pair(t *testing.T, network string) *rdmatest.Pair {
	t.Helper()
	a, b := devices(t, network)
	return rdmatest.NewPair(t, a, b)
}

func TestConformanceTCP(t *testing.T) {
	rdmatest.Run(t, func(t *testing.T) *rdmatest.Pair { return pair(t, "tcp") })
}

func TestConformanceUnix(t *testing.T) {
	rdmatest.Run(t, func(t *testing.T) *rdmatest.Pair { return pair(t, "unix") })
}

// Plaintext, asked for, gives the same semantics, and every such device
// says so in a warning.
func TestConformanceInsecure(t *testing.T) {
	rdmatest.Run(t, func(t *testing.T) *rdmatest.Pair {
		listen := func() rdma.Device {
			var log bytes.Buffer
			d, err := Listen("tcp", "127.0.0.1:0", Config{Insecure: true, Logger: slog.New(slog.NewTextHandler(&log, nil))})
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(log.String(), "level=WARN") || !strings.Contains(log.String(), "plaintext") {
				t.Fatalf("a plaintext device logged %q, want a warning", log.String())
			}
			t.Cleanup(func() { d.Close() })
			return d
		}
		return rdmatest.NewPair(t, listen(), listen())
	})
}

// wire is package socket's wire for the hostile suite.
type wire struct{}

func (wire) Dial(t *testing.T, d rdma.Device) net.Conn {
	t.Helper()
	network, address, _ := strings.Cut(d.Name(), ":")
	c, err := net.Dial(network, address)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func (wire) Secure(conn net.Conn, as string, stranger bool) (net.Conn, error) {
	ca := testCA()
	if stranger {
		ca = strangerCA()
	}
	cert, err := ca.Issue(as)
	if err != nil {
		return nil, err
	}
	// The stranger trusts the real authority: it can check the server, it
	// just cannot prove itself.
	c := pki.Config(cert, testCA().Pool())
	c.InsecureSkipVerify = true // the suite attacks the device; it need not check it
	tc := tls.Client(conn, c)
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	if err := tc.Handshake(); err != nil {
		return nil, err
	}
	conn.SetDeadline(time.Time{})
	return tc, nil
}

func (wire) Hello(to, from rdma.ConnInfo) []byte {
	h := make([]byte, helloLen)
	copy(h, "KVHR")
	h[4] = version
	binary.BigEndian.PutUint32(h[5:], to.QPN)
	binary.BigEndian.PutUint32(h[9:], to.PSN)
	binary.BigEndian.PutUint32(h[13:], from.QPN)
	binary.BigEndian.PutUint32(h[17:], from.PSN)
	return h
}

func (wire) Header(op rdma.Opcode, rkey uint32, addr uint64, n uint32) []byte {
	h := make([]byte, headerLen)
	h[0] = byte(op)
	binary.BigEndian.PutUint32(h[4:], rkey)
	binary.BigEndian.PutUint64(h[8:], addr)
	binary.BigEndian.PutUint32(h[20:], n)
	return h
}

func (wire) Limits() rdmatest.Limits {
	return rdmatest.Limits{Handshake: testHandshake, Frame: testFrame, Idle: testIdle, MaxPending: testMaxPending}
}

func hostile(network string) rdmatest.Hostile {
	return rdmatest.Hostile{
		Devices: func(t *testing.T) (rdma.Device, rdma.Device) {
			a, b := devices(t, network)
			return a, b
		},
		KeysAreSecret: true,
		Identities:    true,
		Wire:          wire{},
	}
}

func TestHostilePeersTCP(t *testing.T)  { rdmatest.RunHostile(t, hostile("tcp")) }
func TestHostilePeersUnix(t *testing.T) { rdmatest.RunHostile(t, hostile("unix")) }
