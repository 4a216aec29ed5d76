package inproc

import (
	"testing"

	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/rdmatest"
)

func pair(t *testing.T, f *Fabric) *rdmatest.Pair {
	t.Helper()
	mk := func(name string) (rdma.ProtectionDomain, rdma.CompletionQueue, rdma.CompletionQueue, rdma.QueuePair) {
		d := f.Device(name)
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
	x.PDA, x.ASend, x.ARecv, x.A = mk("a")
	x.PDB, x.BSend, x.BRecv, x.B = mk("b")
	if err := x.A.Connect(x.B.Info()); err != nil {
		t.Fatal(err)
	}
	if err := x.B.Connect(x.A.Info()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { x.A.ToError(); x.B.ToError() })
	return x
}

func TestConformance(t *testing.T) {
	f := NewFabric("test")
	rdmatest.Run(t, func(t *testing.T) *rdmatest.Pair { return pair(t, f) })
}

var _ rdma.Faults = (*QP)(nil)
