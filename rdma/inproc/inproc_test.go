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
