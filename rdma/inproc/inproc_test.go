package inproc

import (
	"testing"

	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/rdmatest"
)

func pair(t *testing.T, f *Fabric) *rdmatest.Pair {
	x := rdmatest.NewPair(t, f.Device("a"), f.Device("b"))
	t.Cleanup(func() { x.A.ToError(); x.B.ToError() })
	return x
}

func TestConformance(t *testing.T) {
	f := NewFabric("test")
	rdmatest.Run(t, func(t *testing.T) *rdmatest.Pair { return pair(t, f) })
}

var _ rdma.Faults = (*QP)(nil)

func TestHostilePeers(t *testing.T) {
	rdmatest.RunHostile(t, rdmatest.Hostile{
		Devices: func(t *testing.T) (rdma.Device, rdma.Device) {
			f := NewFabric(t.Name())
			a, b := f.Device("requester"), f.Device("responder")
			t.Cleanup(func() { a.Close(); b.Close() })
			return a, b
		},
		KeysAreSecret: true,
		Identities:    true,
	})
}
