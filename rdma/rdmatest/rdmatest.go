// Package rdmatest is the conformance suite for rdma providers: the same tests,
// run against every provider, check the reliable-connected semantics that
// kvhandoff's protocol relies on (see package rdma).
package rdmatest

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/rdma"
)

// Pair is two connected queue pairs, A and B, each with its own protection
// domain and completion queues.
type Pair struct {
	A, B         rdma.QueuePair
	PDA, PDB     rdma.ProtectionDomain
	ASend, ARecv rdma.CompletionQueue
	BSend, BRecv rdma.CompletionQueue
	DevA, DevB   rdma.Device // the devices they are on
}

// NewPair connects a queue pair on device a to one on device b, each with
// its own protection domain and completion queues (depth 256, 128 work
// requests per queue).
func NewPair(t *testing.T, a, b rdma.Device) *Pair {
	t.Helper()
	mk := func(d rdma.Device) (rdma.ProtectionDomain, rdma.CompletionQueue, rdma.CompletionQueue, rdma.QueuePair) {
		pd, err := d.AllocPD()
		if err != nil {
			t.Fatal(err)
		}
		s, err := d.CreateCQ(256)
		if err != nil {
			t.Fatal(err)
		}
		r, err := d.CreateCQ(256)
		if err != nil {
			t.Fatal(err)
		}
		qp, err := pd.CreateQP(s, r, 128)
		if err != nil {
			t.Fatal(err)
		}
		return pd, s, r, qp
	}
	x := &Pair{DevA: a, DevB: b}
	x.PDA, x.ASend, x.ARecv, x.A = mk(a)
	x.PDB, x.BSend, x.BRecv, x.B = mk(b)
	if err := x.A.Connect(x.B.Info()); err != nil {
		t.Fatal(err)
	}
	if err := x.B.Connect(x.A.Info()); err != nil {
		t.Fatal(err)
	}
	return x
}

// Provider makes a fresh connected pair for one test. Calling it several times
// in one test must give independent pairs (the many-queue-pairs test does).
type Provider func(t *testing.T) *Pair

const wait = 10 * time.Second // a guard against hangs, never a timing assertion

// Options declare a provider's known deviations, each of which the suite
// then asserts as it is (so that a fixed provider shows up), never skips.
type Options struct {
	// WindowRangesUnchecked: a window's key opens its whole region to the
	// bound queue pair's peer, not only the window's range (Soft-RoCE, rxe,
	// as of Linux 6.1: its responder checks a window key's WRITE against the
	// region's range). Key, queue pair and invalidation are still checked.
	WindowRangesUnchecked bool
}

// Run runs the whole suite against p, a provider with no deviation.
func Run(t *testing.T, p Provider) { RunOptions(t, p, Options{}) }

// RunOptions runs the whole suite against p, holding it to o's deviations.
func RunOptions(t *testing.T, p Provider, o Options) {
	t.Run("WritesArePlacedInOrderBeforeALaterSend", func(t *testing.T) { writesBeforeSend(t, p) })
	t.Run("WriteWithImmediateDeliversData", func(t *testing.T) { writeImm(t, p) })
	t.Run("SendDeliversBytesIntoAPostedRecv", func(t *testing.T) { send(t, p) })
	t.Run("WrongKeyFailsAndBreaksTheQueuePair", func(t *testing.T) { violation(t, p, "key") })
	t.Run("WriteOutsideTheRegionFailsAndBreaksTheQueuePair", func(t *testing.T) { violation(t, p, "bounds") })
	t.Run("RegionWithoutRemoteWriteRefusesWrites", func(t *testing.T) { violation(t, p, "access") })
	t.Run("ToErrorFlushesAndNothingLandsAfter", func(t *testing.T) { fence(t, p) })
	t.Run("ManyQueuePairsAtOnce", func(t *testing.T) { many(t, p) })
	t.Run("HeldWriteFencedAtTheResponderNeverLands", func(t *testing.T) { heldThenFenced(t, p, true) })
	t.Run("HeldWriteFlushedAtTheRequesterNeverLands", func(t *testing.T) { heldThenFenced(t, p, false) })
	t.Run("CorruptNextDamagesExactlyOnePayload", func(t *testing.T) { corruptNext(t, p) })
	t.Run("BadRequestsAreRefusedAtPost", func(t *testing.T) { badRequests(t, p) })
	t.Run("Windows", func(t *testing.T) { runWindows(t, p, o) })
}

func register(t *testing.T, pd rdma.ProtectionDomain, size int, access rdma.Access) rdma.MemoryRegion {
	t.Helper()
	m, err := pd.Alloc(size, access)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// expect waits for n completions on cq and checks each has status st.
func expect(t *testing.T, cq rdma.CompletionQueue, n int, st rdma.Status) []rdma.Completion {
	t.Helper()
	got := collect(t, cq, n)
	for _, c := range got {
		if c.Status != st {
			t.Fatalf("completion %+v, want status %v", c, st)
		}
	}
	return got
}

func fill(m rdma.MemoryRegion, seed byte) {
	for i := range m.Bytes() {
		m.Bytes()[i] = seed + byte(i*7)
	}
}

func writesBeforeSend(t *testing.T, p Provider) {
	x := p(t)
	const pages, size = 16, 4096
	src := register(t, x.PDA, pages*size, rdma.LocalWrite)
	dst := register(t, x.PDB, pages*size, rdma.LocalWrite|rdma.RemoteWrite)
	msg := register(t, x.PDA, 64, rdma.LocalWrite)
	inbox := register(t, x.PDB, 64, rdma.LocalWrite)
	fill(src, 1)
	if err := x.B.PostRecv(rdma.WorkRequest{ID: 99, Op: rdma.OpRecv, Local: rdma.SGE{MR: inbox, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < pages; i++ {
		wr := rdma.WorkRequest{ID: uint64(i), Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Offset: i * size, Length: size},
			RemoteAddr: dst.Addr() + uint64(i*size), RKey: dst.RKey()}
		if err := x.A.PostSend(wr); err != nil {
			t.Fatal(err)
		}
	}
	copy(msg.Bytes(), "done")
	if err := x.A.PostSend(rdma.WorkRequest{ID: 100, Op: rdma.OpSend, Local: rdma.SGE{MR: msg, Length: 4}}); err != nil {
		t.Fatal(err)
	}
	recv := expect(t, x.BRecv, 1, rdma.Success)
	// The SEND arrived: every earlier WRITE must be visible already.
	if !bytes.Equal(dst.Bytes(), src.Bytes()) || recv[0].Bytes != 4 || string(inbox.Bytes()[:4]) != "done" {
		t.Fatal("a SEND was delivered before the WRITEs posted ahead of it were placed")
	}
	got := expect(t, x.ASend, pages+1, rdma.Success)
	for i, c := range got {
		if c.WRID != uint64(i) && !(i == pages && c.WRID == 100) {
			t.Fatalf("completion %d is for WR %d: out of order", i, c.WRID)
		}
	}
}

func writeImm(t *testing.T, p Provider) {
	x := p(t)
	src := register(t, x.PDA, 256, rdma.LocalWrite)
	dst := register(t, x.PDB, 256, rdma.LocalWrite|rdma.RemoteWrite)
	fill(src, 3)
	if err := x.B.PostRecv(rdma.WorkRequest{ID: 7, Op: rdma.OpRecv, Local: rdma.SGE{MR: dst, Length: 0}}); err != nil {
		t.Fatal(err)
	}
	if err := x.A.PostSend(rdma.WorkRequest{ID: 1, Op: rdma.OpWriteImm, Local: rdma.SGE{MR: src, Length: 256},
		RemoteAddr: dst.Addr(), RKey: dst.RKey(), Imm: 0xC0FFEE}); err != nil {
		t.Fatal(err)
	}
	c := expect(t, x.BRecv, 1, rdma.Success)[0]
	if c.Op != rdma.OpRecvImm || !c.HasImm || c.Imm != 0xC0FFEE || c.WRID != 7 || !bytes.Equal(dst.Bytes(), src.Bytes()) {
		t.Fatalf("got %+v; bytes equal %v", c, bytes.Equal(dst.Bytes(), src.Bytes()))
	}
	expect(t, x.ASend, 1, rdma.Success)
}

func send(t *testing.T, p Provider) {
	x := p(t)
	msg := register(t, x.PDA, 32, rdma.LocalWrite)
	inbox := register(t, x.PDB, 128, rdma.LocalWrite)
	copy(msg.Bytes(), "Grant{r7, 3 pages}")
	x.B.PostRecv(rdma.WorkRequest{ID: 5, Op: rdma.OpRecv, Local: rdma.SGE{MR: inbox, Offset: 64, Length: 64}})
	x.A.PostSend(rdma.WorkRequest{ID: 6, Op: rdma.OpSend, Local: rdma.SGE{MR: msg, Length: 18}, Imm: 9, HasImm: true})
	c := expect(t, x.BRecv, 1, rdma.Success)[0]
	if c.Bytes != 18 || string(inbox.Bytes()[64:82]) != "Grant{r7, 3 pages}" || !c.HasImm || c.Imm != 9 {
		t.Fatalf("got %+v, %q", c, inbox.Bytes()[64:82])
	}
	expect(t, x.ASend, 1, rdma.Success)
}

// violation: a WRITE with a wrong key, outside the region, or into a region
// without remote write access fails on the remote side and breaks the queue
// pair; later work requests are flushed or refused, and nothing lands.
func violation(t *testing.T, p Provider, kind string) {
	x := p(t)
	src := register(t, x.PDA, 64, rdma.LocalWrite)
	access := rdma.LocalWrite | rdma.RemoteWrite
	if kind == "access" {
		access = rdma.LocalWrite
	}
	dst := register(t, x.PDB, 64, access)
	fill(src, 5)
	wr := rdma.WorkRequest{ID: 1, Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Length: 64}, RemoteAddr: dst.Addr(), RKey: dst.RKey()}
	switch kind {
	case "key":
		wr.RKey ^= 0xFFFF
	case "bounds":
		wr.RemoteAddr += 8
	}
	if err := x.A.PostSend(wr); err != nil {
		t.Fatal(err)
	}
	expect(t, x.ASend, 1, rdma.RemoteAccessError)
	if x.A.State() != rdma.StateError {
		t.Fatal("a remote access error must break the queue pair")
	}
	good := rdma.WorkRequest{ID: 2, Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Length: 8}, RemoteAddr: dst.Addr(), RKey: dst.RKey()}
	if err := x.A.PostSend(good); err == nil {
		expect(t, x.ASend, 1, rdma.FlushError)
	}
	if !bytes.Equal(dst.Bytes(), make([]byte, 64)) {
		t.Fatal("bytes landed through a broken queue pair")
	}
}

func fence(t *testing.T, p Provider) {
	x := p(t)
	src := register(t, x.PDA, 64, rdma.LocalWrite)
	dst := register(t, x.PDB, 64, rdma.LocalWrite|rdma.RemoteWrite)
	inbox := register(t, x.PDB, 64, rdma.LocalWrite)
	for i := 0; i < 3; i++ {
		x.B.PostRecv(rdma.WorkRequest{ID: uint64(10 + i), Op: rdma.OpRecv, Local: rdma.SGE{MR: inbox, Length: 64}})
	}
	if err := x.B.ToError(); err != nil {
		t.Fatal(err)
	}
	expect(t, x.BRecv, 3, rdma.FlushError)
	if err := x.A.ToError(); err != nil {
		t.Fatal(err)
	}
	fill(src, 9)
	err := x.A.PostSend(rdma.WorkRequest{ID: 1, Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Length: 64}, RemoteAddr: dst.Addr(), RKey: dst.RKey()})
	if err == nil {
		expect(t, x.ASend, 1, rdma.FlushError)
	}
	if !bytes.Equal(dst.Bytes(), make([]byte, 64)) {
		t.Fatal("a WRITE landed after the fence")
	}
}

func many(t *testing.T, p Provider) {
	const n = 8
	type job struct {
		x        *Pair
		src, dst rdma.MemoryRegion
	}
	var jobs []job
	for i := 0; i < n; i++ {
		x := p(t)
		src := register(t, x.PDA, 1<<16, rdma.LocalWrite)
		dst := register(t, x.PDB, 1<<16, rdma.LocalWrite|rdma.RemoteWrite)
		fill(src, byte(i))
		jobs = append(jobs, job{x, src, dst})
	}
	for _, j := range jobs {
		for k := 0; k < 16; k++ {
			off := k * 4096
			if err := j.x.A.PostSend(rdma.WorkRequest{ID: uint64(k), Op: rdma.OpWrite, Local: rdma.SGE{MR: j.src, Offset: off, Length: 4096},
				RemoteAddr: j.dst.Addr() + uint64(off), RKey: j.dst.RKey()}); err != nil {
				t.Fatal(err)
			}
		}
	}
	for i, j := range jobs {
		expect(t, j.x.ASend, 16, rdma.Success)
		if !bytes.Equal(j.src.Bytes(), j.dst.Bytes()) {
			t.Fatalf("queue pair %d: bytes differ", i)
		}
	}
}

func faults(t *testing.T, qp rdma.QueuePair) rdma.Faults {
	t.Helper()
	f, ok := qp.(rdma.Faults)
	if !ok {
		t.Fatalf("%T has no fault hooks (rdma.Faults)", qp)
	}
	return f
}

// heldThenFenced: WRITEs held back in the network (Pause) and then fenced,
// at the responder (the receiver's fence) or by the requester's own error
// state, never land: what a receiver relies on before it reuses a page.
func heldThenFenced(t *testing.T, p Provider, atResponder bool) {
	x := p(t)
	src := register(t, x.PDA, 4096, rdma.LocalWrite)
	dst := register(t, x.PDB, 4096, rdma.LocalWrite|rdma.RemoteWrite)
	fill(src, 7)
	a := faults(t, x.A)
	a.Pause()
	for i := 0; i < 4; i++ {
		if err := x.A.PostSend(rdma.WorkRequest{ID: uint64(i), Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Offset: i * 1024, Length: 1024},
			RemoteAddr: dst.Addr() + uint64(i*1024), RKey: dst.RKey()}); err != nil {
			t.Fatal(err)
		}
	}
	if got := x.ASend.Poll(4); len(got) != 0 {
		t.Fatalf("held WRITEs completed: %+v", got)
	}
	fence := x.A
	if atResponder {
		fence = x.B
	}
	if err := fence.ToError(); err != nil {
		t.Fatal(err)
	}
	a.Resume()
	for _, c := range collect(t, x.ASend, 4) {
		if c.Status == rdma.Success {
			t.Fatalf("a fenced WRITE completed successfully: %+v", c)
		}
	}
	if !bytes.Equal(dst.Bytes(), make([]byte, 4096)) {
		t.Fatal("a fenced WRITE landed")
	}
	if x.A.State() != rdma.StateError {
		t.Fatal("the requester must end in the error state")
	}
}

// collect waits for n completions of any status.
func collect(t *testing.T, cq rdma.CompletionQueue, n int) []rdma.Completion {
	t.Helper()
	var got []rdma.Completion
	deadline := time.Now().Add(wait)
	for len(got) < n && time.Now().Before(deadline) {
		got = append(got, cq.Wait(n-len(got), time.Until(deadline))...)
	}
	if len(got) != n {
		t.Fatalf("%d of %d completions arrived", len(got), n)
	}
	return got
}

func corruptNext(t *testing.T, p Provider) {
	x := p(t)
	src := register(t, x.PDA, 64, rdma.LocalWrite)
	dst := register(t, x.PDB, 128, rdma.LocalWrite|rdma.RemoteWrite)
	fill(src, 1)
	faults(t, x.A).CorruptNext()
	for i := 0; i < 2; i++ {
		if err := x.A.PostSend(rdma.WorkRequest{ID: uint64(i), Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Length: 64},
			RemoteAddr: dst.Addr() + uint64(64*i), RKey: dst.RKey()}); err != nil {
			t.Fatal(err)
		}
	}
	expect(t, x.ASend, 2, rdma.Success)
	want := bytes.Clone(src.Bytes())
	rdma.Damage(want)
	if !bytes.Equal(dst.Bytes()[:64], want) || !bytes.Equal(dst.Bytes()[64:], src.Bytes()) {
		t.Fatal("CorruptNext must damage exactly the next WRITE, as rdma.Damage does")
	}
	if src.Bytes()[32] != 1+byte(32*7) {
		t.Fatal("CorruptNext damaged the source, not the payload in transit")
	}
}

func badRequests(t *testing.T, p Provider) {
	x := p(t)
	mine := register(t, x.PDA, 8, rdma.LocalWrite)
	theirs := register(t, x.PDB, 8, rdma.LocalWrite)
	for name, wr := range map[string]rdma.WorkRequest{
		"recv on the send queue":    {Op: rdma.OpRecv, Local: rdma.SGE{MR: mine, Length: 8}},
		"beyond the local region":   {Op: rdma.OpWrite, Local: rdma.SGE{MR: mine, Offset: 4, Length: 8}},
		"another protection domain": {Op: rdma.OpWrite, Local: rdma.SGE{MR: theirs, Length: 8}},
		"negative length":           {Op: rdma.OpSend, Local: rdma.SGE{MR: mine, Length: -1}},
	} {
		if err := x.A.PostSend(wr); !errors.Is(err, rdma.ErrBadRequest) {
			t.Errorf("%s: %v, want ErrBadRequest", name, err)
		}
	}
	if c := x.ASend.Poll(8); len(c) != 0 {
		t.Fatalf("refused requests completed: %+v", c)
	}
}

// eventuallyWithin polls cond until it holds: for bound, the provider's own bound on
// what is awaited, and then wait more: the guard against hangs comes on top
// of the bound, so that a loaded machine's scheduling stalls never fail a
// test that waits for a bound to expire.
func eventuallyWithin(bound time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(bound + wait)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
	return true
}
