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
	mk := func(d *Device) (rdma.ProtectionDomain, rdma.CompletionQueue, rdma.CompletionQueue, rdma.QueuePair) {
		pd, _ := d.AllocPD()
		s, _ := d.CreateCQ(64)
		r, _ := d.CreateCQ(64)
		qp, err := pd.CreateQP(s, r, 64)
		if err != nil {
			t.Fatal(err)
		}
		return pd, s, r, qp
	}
	x := &rdmatest.Pair{}
	x.PDA, x.ASend, x.ARecv, x.A = mk(listen("a"))
	x.PDB, x.BSend, x.BRecv, x.B = mk(listen("b"))
	if err := x.A.Connect(x.B.Info()); err != nil {
		t.Fatal(err)
	}
	if err := x.B.Connect(x.A.Info()); err != nil {
		t.Fatal(err)
	}
	return x
}

func TestConformanceTCP(t *testing.T) {
	rdmatest.Run(t, func(t *testing.T) *rdmatest.Pair { return pair(t, "tcp") })
}

func TestConformanceUnix(t *testing.T) {
	rdmatest.Run(t, func(t *testing.T) *rdmatest.Pair { return pair(t, "unix") })
}
