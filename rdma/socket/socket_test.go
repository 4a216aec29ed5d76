package socket

import (
	"path/filepath"
	"testing"

	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/rdmatest"
)

var _ rdma.Faults = (*QP)(nil)

// devices opens two devices, each listening on its own socket, so every
// request crosses a real stream socket.
func devices(t *testing.T, network string) (*Device, *Device) {
	t.Helper()
	listen := func(name string) *Device {
		addr := "127.0.0.1:0"
		if network == "unix" {
			addr = filepath.Join(t.TempDir(), name+".sock")
		}
		d, err := Listen(network, addr)
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

func hostile(network string) rdmatest.Hostile {
	return rdmatest.Hostile{
		Devices: func(t *testing.T) (rdma.Device, rdma.Device) {
			a, b := devices(t, network)
			return a, b
		},
		KeysAreSecret: true,
		Identities:    true,
	}
}

func TestHostilePeersTCP(t *testing.T)  { rdmatest.RunHostile(t, hostile("tcp")) }
func TestHostilePeersUnix(t *testing.T) { rdmatest.RunHostile(t, hostile("unix")) }
