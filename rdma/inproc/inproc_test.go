package inproc

import (
	"bytes"
	"testing"
	"time"

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

// A WRITE held back in the network (Pause) and then fenced never lands: the
// fence receivers rely on before reusing a page.
func TestPausedWriteFencedNeverLands(t *testing.T) {
	x := pair(t, NewFabric("fence"))
	src, _ := x.PDA.Register(bytes.Repeat([]byte{7}, 64), rdma.LocalWrite)
	dst, _ := x.PDB.Register(make([]byte, 64), rdma.LocalWrite|rdma.RemoteWrite)
	a := x.A.(*QP)
	a.Pause()
	if err := a.PostSend(rdma.WorkRequest{ID: 1, Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Length: 64}, RemoteAddr: dst.Addr(), RKey: dst.RKey()}); err != nil {
		t.Fatal(err)
	}
	if got := x.ASend.Poll(1); len(got) != 0 {
		t.Fatalf("a paused WRITE completed: %+v", got)
	}
	a.ToError()
	a.Resume()
	c := x.ASend.Wait(1, 10*time.Second)
	if len(c) != 1 || c[0].Status != rdma.FlushError {
		t.Fatalf("got %+v, want a flush", c)
	}
	if !bytes.Equal(dst.Bytes(), make([]byte, 64)) {
		t.Fatal("the fenced WRITE landed")
	}
}

func TestCorruptNextDamagesOnePayload(t *testing.T) {
	x := pair(t, NewFabric("corrupt"))
	src, _ := x.PDA.Register(bytes.Repeat([]byte{1}, 64), rdma.LocalWrite)
	dst, _ := x.PDB.Register(make([]byte, 128), rdma.LocalWrite|rdma.RemoteWrite)
	x.A.(*QP).CorruptNext()
	for i := 0; i < 2; i++ {
		x.A.PostSend(rdma.WorkRequest{ID: uint64(i), Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Length: 64}, RemoteAddr: dst.Addr() + uint64(64*i), RKey: dst.RKey()})
	}
	for n := 0; n < 2; {
		n += len(x.ASend.Wait(2-n, 10*time.Second))
	}
	if bytes.Equal(dst.Bytes()[:64], src.Bytes()) || !bytes.Equal(dst.Bytes()[64:], src.Bytes()) {
		t.Fatal("CorruptNext must damage exactly the next WRITE")
	}
}

func TestBadRequestsAreRefusedAtPost(t *testing.T) {
	x := pair(t, NewFabric("bad"))
	mine, _ := x.PDA.Register(make([]byte, 8), rdma.LocalWrite)
	theirs, _ := x.PDB.Register(make([]byte, 8), rdma.LocalWrite)
	for name, wr := range map[string]rdma.WorkRequest{
		"recv on the send queue":    {Op: rdma.OpRecv, Local: rdma.SGE{MR: mine, Length: 8}},
		"beyond the local region":   {Op: rdma.OpWrite, Local: rdma.SGE{MR: mine, Offset: 4, Length: 8}},
		"another protection domain": {Op: rdma.OpWrite, Local: rdma.SGE{MR: theirs, Length: 8}},
	} {
		if err := x.A.PostSend(wr); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}
