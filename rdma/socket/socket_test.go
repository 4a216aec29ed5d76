package socket

import (
	"path/filepath"
	"testing"

	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/rdmatest"
)

var _ rdma.Faults = (*QP)(nil)

// pair connects two queue pairs on two devices, each listening on its own
// socket, so every request crosses a real stream socket.
func pair(t *testing.T, network string) *rdmatest.Pair {
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
	return rdmatest.NewPair(t, listen("a"), listen("b"))
}

func TestConformanceTCP(t *testing.T) {
	rdmatest.Run(t, func(t *testing.T) *rdmatest.Pair { return pair(t, "tcp") })
}

func TestConformanceUnix(t *testing.T) {
	rdmatest.Run(t, func(t *testing.T) *rdmatest.Pair { return pair(t, "unix") })
}
