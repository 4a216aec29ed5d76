package rdmatest

import (
	"bytes"
	"errors"
	"testing"

	"github.com/kvhandoff/kvhandoff/rdma"
)

// runWindows holds the provider to memory windows' semantics (type 2, see
// rdma.MemoryWindow): a window bound on B opens exactly its range, to B's
// peer only, under a key that changes on every bind and opens nothing once
// invalidated; every refusal is a RemoteAccessError that breaks the
// offender's queue pair and no other.
func runWindows(t *testing.T, p Provider, o Options) {
	t.Run("WindowWriteInsideItsRangeLands", func(t *testing.T) { windowInside(t, p) })
	if o.WindowRangesUnchecked {
		t.Run("WindowWriteOutsideItsRangeLandsOnAProviderThatChecksOnlyTheRegion", func(t *testing.T) { windowOutsideUnchecked(t, p) })
	} else {
		t.Run("WindowWriteOutsideItsRangeFailsAndBreaksTheQueuePair", func(t *testing.T) { windowOutside(t, p) })
	}
	t.Run("RegionKeyOfAWindowOnlyRegionOpensNothing", func(t *testing.T) { windowRegionKey(t, p) })
	t.Run("WindowKeyFromAnotherQueuePairFailsAndBreaksOnlyThatQueuePair", func(t *testing.T) { windowWrongQP(t, p) })
	t.Run("WindowKeyAfterInvalidateFailsAndBreaksOnlyThatQueuePair", func(t *testing.T) { windowAfterInvalidate(t, p, false) })
	t.Run("WindowKeyAfterCloseFails", func(t *testing.T) { windowAfterInvalidate(t, p, true) })
	t.Run("StaleWindowKeyOpensNothingAfterARebind", func(t *testing.T) { windowStaleKey(t, p) })
	t.Run("GuessedWindowKeysOpenNothing", func(t *testing.T) { windowGuessed(t, p) })
	t.Run("HeldWriteUnderAnInvalidatedWindowNeverLands", func(t *testing.T) { windowHeld(t, p) })
	t.Run("WindowKeyChangesOnEveryBind", func(t *testing.T) { windowKeys(t, p) })
	t.Run("BindHeldByPauseBindsUnderTheKeyItReported", func(t *testing.T) { windowHeldBind(t, p) })
	t.Run("BindOnARegionWithoutWindowBindIsRefused", func(t *testing.T) { windowBindNoAccess(t, p) })
	t.Run("RebindOfABoundWindowIsRefused", func(t *testing.T) { windowRebind(t, p) })
	t.Run("BindOfAnotherProtectionDomainsWindowIsRefused", func(t *testing.T) { windowOtherPD(t, p) })
	t.Run("DeregisteredRegionsKeyOpensNothing", func(t *testing.T) { deregistered(t, p) })
}

// deregistered: a region deregistered before its device closes
// (rdma.Deregistrar) opens nothing under its key, and is not deregistered
// twice. Its memory is not read after: the provider may have unmapped it.
func deregistered(t *testing.T, p Provider) {
	w := newWindowed(t, p)
	dr, ok := w.x.PDB.(rdma.Deregistrar)
	if !ok {
		t.Fatalf("%T cannot deregister a region (rdma.Deregistrar)", w.x.PDB)
	}
	m := register(t, w.x.PDB, 4096, rdma.LocalWrite|rdma.RemoteWrite)
	addr, key := m.Addr(), m.RKey()
	if err := dr.Deregister(m); err != nil {
		t.Fatal(err)
	}
	if err := dr.Deregister(m); !errors.Is(err, rdma.ErrBadRequest) {
		t.Fatalf("a region deregistered twice: %v", err)
	}
	write(t, w.x.A, w.src, 64, addr, key)
	expect(t, w.x.ASend, 1, rdma.RemoteAccessError)
}

// bindRefused posts a bind of w on qp over [off, off+n) of mr and checks that
// it is refused: at post (software providers) or by its completion (a NIC),
// never a success.
func bindRefused(t *testing.T, qp rdma.QueuePair, cq rdma.CompletionQueue, w rdma.MemoryWindow, mr rdma.MemoryRegion, off, n int) {
	t.Helper()
	if err := qp.PostSend(rdma.WorkRequest{ID: 1 << 42, Op: rdma.OpBind, Window: w, Local: rdma.SGE{MR: mr, Offset: off, Length: n}}); err != nil {
		return
	}
	if c := collect(t, cq, 1)[0]; c.Status == rdma.Success {
		t.Fatalf("the bind completed: %+v", c)
	}
}

// landsNothing WRITEs 64 bytes at addr in dst under key and checks that the
// WRITE fails (it may find its queue pair broken by a refused bind) and
// that dst is as before.
func landsNothing(t *testing.T, w *windowed, dst rdma.MemoryRegion, addr uint64, key uint32) {
	t.Helper()
	before := bytes.Clone(dst.Bytes())
	fill(w.src, 0x5A)
	if err := w.x.A.PostSend(rdma.WorkRequest{ID: 9, Op: rdma.OpWrite, Local: rdma.SGE{MR: w.src, Length: 64}, RemoteAddr: addr, RKey: key}); err != nil {
		return // A is broken already: nothing can land through it
	}
	if c := collect(t, w.x.ASend, 1)[0]; c.Status == rdma.Success {
		t.Fatalf("a WRITE under key %#x after a refused bind completed", key)
	}
	if !bytes.Equal(dst.Bytes(), before) {
		t.Fatal("bytes of a WRITE under a refused bind's window landed")
	}
}

// windowBindNoAccess: a region registered without WindowBind takes no
// window, and the window's key then opens nothing of it.
func windowBindNoAccess(t *testing.T, p Provider) {
	w := newWindowed(t, p)
	plain := register(t, w.x.PDB, 4096, rdma.LocalWrite)
	other := allocWindow(t, w.x.PDB)
	bindRefused(t, w.x.B, w.x.BSend, other, plain, winOff, winLen)
	landsNothing(t, w, plain, plain.Addr()+winOff, other.RKey())
}

// windowRebind: a bound window must be invalidated before it is bound
// again; a provider that rebinds in place could leave the old key naming
// the new binding (a revoked Grant's key opening the next request's pages).
func windowRebind(t *testing.T, p Provider) {
	w := newWindowed(t, p)
	old := w.win.RKey()
	bindRefused(t, w.x.B, w.x.BSend, w.win, w.dst, 0, winOff)
	landsNothing(t, w, w.dst, w.dst.Addr(), old)
	if k := w.win.RKey(); k != old {
		landsNothing(t, w, w.dst, w.dst.Addr(), k)
	}
}

// windowOtherPD: a window of another protection domain (of the same device)
// is not bound on a queue pair of this one.
func windowOtherPD(t *testing.T, p Provider) {
	w := newWindowed(t, p)
	pd, err := w.x.DevB.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	foreign := allocWindow(t, pd)
	bindRefused(t, w.x.B, w.x.BSend, foreign, w.dst, 0, winOff)
	landsNothing(t, w, w.dst, w.dst.Addr(), foreign.RKey())
}

// windowHeldBind: a bind posted while its queue pair is paused reports its
// key when posted (a Grant naming it is built then) and binds under that
// key when it runs.
func windowHeldBind(t *testing.T, p Provider) {
	w := newWindowed(t, p)
	invalidate(t, w.x.B, w.x.BSend, w.win)
	b := faults(t, w.x.B)
	b.Pause()
	if err := w.x.B.PostSend(rdma.WorkRequest{ID: 1 << 40, Op: rdma.OpBind, Window: w.win, Local: rdma.SGE{MR: w.dst, Offset: winOff, Length: winLen}}); err != nil {
		t.Fatal(err)
	}
	key := w.win.RKey()
	b.Resume()
	expect(t, w.x.BSend, 1, rdma.Success)
	write(t, w.x.A, w.src, 64, w.dst.Addr()+winOff, key)
	expect(t, w.x.ASend, 1, rdma.Success)
	if !bytes.Equal(w.dst.Bytes()[winOff:winOff+64], w.src.Bytes()[:64]) {
		t.Fatal("a WRITE under the key a held bind reported did not land")
	}
}

// windowed is a pair with a region on B that only windows open, and a
// window bound on B over [off, off+n) of it.
type windowed struct {
	x   *Pair
	src rdma.MemoryRegion // A's source, 4096 bytes
	dst rdma.MemoryRegion // B's region, 4096 bytes, LocalWrite|WindowBind
	win rdma.MemoryWindow
}

const winOff, winLen = 1024, 2048

func newWindowed(t *testing.T, p Provider) *windowed {
	t.Helper()
	x := p(t)
	w := &windowed{x: x, src: register(t, x.PDA, 4096, rdma.LocalWrite), dst: register(t, x.PDB, 4096, rdma.LocalWrite|rdma.WindowBind)}
	fill(w.src, 0x21)
	w.win = allocWindow(t, x.PDB)
	bind(t, x.B, x.BSend, w.win, w.dst, winOff, winLen)
	return w
}

func allocWindow(t *testing.T, pd rdma.ProtectionDomain) rdma.MemoryWindow {
	t.Helper()
	wd, ok := pd.(rdma.WindowDomain)
	if !ok {
		t.Fatalf("%T has no memory windows (rdma.WindowDomain)", pd)
	}
	w, err := wd.AllocWindow()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	return w
}

// bind binds w on qp over [off, off+n) of mr and waits for the bind's completion.
func bind(t *testing.T, qp rdma.QueuePair, cq rdma.CompletionQueue, w rdma.MemoryWindow, mr rdma.MemoryRegion, off, n int) {
	t.Helper()
	if err := qp.PostSend(rdma.WorkRequest{ID: 1 << 40, Op: rdma.OpBind, Window: w, Local: rdma.SGE{MR: mr, Offset: off, Length: n}}); err != nil {
		t.Fatalf("bind: %v", err)
	}
	if c := expect(t, cq, 1, rdma.Success)[0]; c.Op != rdma.OpBind || c.WRID != 1<<40 {
		t.Fatalf("bind completed as %+v", c)
	}
}

// invalidate invalidates w on qp and waits for the completion.
func invalidate(t *testing.T, qp rdma.QueuePair, cq rdma.CompletionQueue, w rdma.MemoryWindow) {
	t.Helper()
	if err := qp.PostSend(rdma.WorkRequest{ID: 1 << 41, Op: rdma.OpInvalidate, Window: w}); err != nil {
		t.Fatalf("invalidate: %v", err)
	}
	if c := expect(t, cq, 1, rdma.Success)[0]; c.Op != rdma.OpInvalidate || c.WRID != 1<<41 {
		t.Fatalf("invalidate completed as %+v", c)
	}
}

// write posts a WRITE of n bytes of src on qp, to addr under key.
func write(t *testing.T, qp rdma.QueuePair, src rdma.MemoryRegion, n int, addr uint64, key uint32) {
	t.Helper()
	if err := qp.PostSend(rdma.WorkRequest{ID: 7, Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Length: n}, RemoteAddr: addr, RKey: key}); err != nil {
		t.Fatalf("post: %v", err)
	}
}

// refused checks that the WRITE just posted on x's A failed with a remote
// access error, broke A (and its responder) and landed nothing in dst
// outside what want says was there.
func refused(t *testing.T, qp rdma.QueuePair, cq rdma.CompletionQueue, dst rdma.MemoryRegion, want []byte) {
	t.Helper()
	expect(t, cq, 1, rdma.RemoteAccessError)
	if qp.State() != rdma.StateError {
		t.Fatal("a refused window WRITE left its queue pair ready")
	}
	if !bytes.Equal(dst.Bytes(), want) {
		t.Fatal("bytes of a refused window WRITE landed")
	}
}

func windowInside(t *testing.T, p Provider) {
	w := newWindowed(t, p)
	write(t, w.x.A, w.src, winLen, w.dst.Addr()+winOff, w.win.RKey())
	expect(t, w.x.ASend, 1, rdma.Success)
	if !bytes.Equal(w.dst.Bytes()[winOff:winOff+winLen], w.src.Bytes()[:winLen]) {
		t.Fatal("a WRITE inside the window did not land")
	}
	write(t, w.x.A, w.src, 64, w.dst.Addr()+winOff+winLen-64, w.win.RKey())
	expect(t, w.x.ASend, 1, rdma.Success)
}

func windowOutside(t *testing.T, p Provider) {
	for name, at := range map[string]struct {
		off uint64
		n   int
	}{
		"one byte before": {winOff - 1, 64}, "across the end": {winOff + winLen - 32, 64}, "past the end": {winOff + winLen, 1},
		"start of the region": {0, 64}, "wraps": {1<<64 - 1 - 16, 64},
	} {
		t.Run(name, func(t *testing.T) {
			w := newWindowed(t, p)
			write(t, w.x.A, w.src, at.n, w.dst.Addr()+at.off, w.win.RKey())
			refused(t, w.x.A, w.x.ASend, w.dst, make([]byte, 4096))
		})
	}
}

// windowOutsideUnchecked asserts the declared deviation as it is: a WRITE
// under the window's key, from its own peer, outside its range but inside
// its region, lands. Should the provider start checking ranges, this fails,
// and the deviation comes off.
func windowOutsideUnchecked(t *testing.T, p Provider) {
	w := newWindowed(t, p)
	write(t, w.x.A, w.src, 64, w.dst.Addr(), w.win.RKey())
	expect(t, w.x.ASend, 1, rdma.Success)
	if !bytes.Equal(w.dst.Bytes()[:64], w.src.Bytes()[:64]) {
		t.Fatal("the provider declared unchecked window ranges, yet a WRITE outside the range did not land")
	}
}

func windowRegionKey(t *testing.T, p Provider) {
	w := newWindowed(t, p)
	write(t, w.x.A, w.src, 64, w.dst.Addr()+winOff, w.dst.RKey())
	refused(t, w.x.A, w.x.ASend, w.dst, make([]byte, 4096))
}

// second is another queue pair in B's protection domain, connected to a
// queue pair of its own on A's side: a peer of the same node as the
// window's, but not the window's peer.
func second(t *testing.T, x *Pair, a, b rdma.Device) (req rdma.QueuePair, cq rdma.CompletionQueue, src rdma.MemoryRegion) {
	t.Helper()
	pdA, cqA, qpA := newQP(t, a)
	cqB, err := b.CreateCQ(64)
	if err != nil {
		t.Fatal(err)
	}
	qpB, err := x.PDB.CreateQP(cqB, cqB, 16)
	if err != nil {
		t.Fatal(err)
	}
	if err := qpA.Connect(qpB.Info()); err != nil {
		t.Fatal(err)
	}
	if err := qpB.Connect(qpA.Info()); err != nil {
		t.Fatal(err)
	}
	src = register(t, pdA, 4096, rdma.LocalWrite)
	copy(src.Bytes(), "ROGUE-KV")
	return qpA, cqA, src
}

func windowWrongQP(t *testing.T, p Provider) {
	w := newWindowed(t, p)
	rogue, cq, src := second(t, w.x, w.x.DevA, w.x.DevB)
	write(t, rogue, src, 64, w.dst.Addr()+winOff, w.win.RKey())
	refused(t, rogue, cq, w.dst, make([]byte, 4096))
	// The window's own peer is untouched.
	write(t, w.x.A, w.src, 64, w.dst.Addr()+winOff, w.win.RKey())
	expect(t, w.x.ASend, 1, rdma.Success)
}

func windowAfterInvalidate(t *testing.T, p Provider, viaClose bool) {
	w := newWindowed(t, p)
	write(t, w.x.A, w.src, 64, w.dst.Addr()+winOff, w.win.RKey())
	expect(t, w.x.ASend, 1, rdma.Success)
	key := w.win.RKey()
	// A bystander window on the same queue pair stays open.
	other := allocWindow(t, w.x.PDB)
	bind(t, w.x.B, w.x.BSend, other, w.dst, 0, winOff)
	if viaClose {
		if err := w.win.Close(); err != nil {
			t.Fatal(err)
		}
	} else {
		invalidate(t, w.x.B, w.x.BSend, w.win)
	}
	if !viaClose {
		// the bystander window still works before the violation breaks the pair
		write(t, w.x.A, w.src, 64, w.dst.Addr(), other.RKey())
		expect(t, w.x.ASend, 1, rdma.Success)
	}
	before := bytes.Clone(w.dst.Bytes())
	fill(w.src, 0x77)
	write(t, w.x.A, w.src, 64, w.dst.Addr()+winOff, key)
	refused(t, w.x.A, w.x.ASend, w.dst, before)
}

func windowStaleKey(t *testing.T, p Provider) {
	w := newWindowed(t, p)
	old := w.win.RKey()
	invalidate(t, w.x.B, w.x.BSend, w.win)
	bind(t, w.x.B, w.x.BSend, w.win, w.dst, winOff, winLen)
	if w.win.RKey() == old {
		t.Fatalf("a rebind kept key %#x", old)
	}
	write(t, w.x.A, w.src, 64, w.dst.Addr()+winOff, w.win.RKey())
	expect(t, w.x.ASend, 1, rdma.Success)
	before := bytes.Clone(w.dst.Bytes())
	write(t, w.x.A, w.src, 64, w.dst.Addr()+winOff+64, old)
	refused(t, w.x.A, w.x.ASend, w.dst, before)
}

func windowGuessed(t *testing.T, p Provider) {
	for name, guess := range map[string]func(k uint32) uint32{
		"next key":          func(k uint32) uint32 { return k + 1 },
		"previous key":      func(k uint32) uint32 { return k - 1 },
		"low byte flipped":  func(k uint32) uint32 { return k ^ 0xFF },
		"high bits flipped": func(k uint32) uint32 { return k ^ 0xFF000000 },
		"zero":              func(uint32) uint32 { return 0 },
	} {
		t.Run(name, func(t *testing.T) {
			w := newWindowed(t, p)
			write(t, w.x.A, w.src, 64, w.dst.Addr()+winOff, guess(w.win.RKey()))
			refused(t, w.x.A, w.x.ASend, w.dst, make([]byte, 4096))
		})
	}
}

// windowHeld: WRITEs under a window held back in the network (Pause) when
// the window is invalidated never land once they run.
func windowHeld(t *testing.T, p Provider) {
	w := newWindowed(t, p)
	a := faults(t, w.x.A)
	a.Pause()
	for i := 0; i < 4; i++ {
		if err := w.x.A.PostSend(rdma.WorkRequest{ID: uint64(i), Op: rdma.OpWrite, Local: rdma.SGE{MR: w.src, Offset: i * 256, Length: 256},
			RemoteAddr: w.dst.Addr() + winOff + uint64(i*256), RKey: w.win.RKey()}); err != nil {
			t.Fatal(err)
		}
	}
	invalidate(t, w.x.B, w.x.BSend, w.win)
	a.Resume()
	got := collect(t, w.x.ASend, 4)
	if got[0].Status != rdma.RemoteAccessError {
		t.Fatalf("the first held WRITE under an invalidated window completed as %+v", got[0])
	}
	for _, c := range got[1:] {
		if c.Status == rdma.Success {
			t.Fatalf("a held WRITE completed: %+v", c)
		}
	}
	if !bytes.Equal(w.dst.Bytes(), make([]byte, 4096)) {
		t.Fatal("a held WRITE landed under an invalidated window")
	}
}

// windowKeys: 32 binds of one window give 32 keys, each different from the
// one before (verbs draws the 8 bits the consumer owns; the software
// providers all 32, never reused).
func windowKeys(t *testing.T, p Provider) {
	w := newWindowed(t, p)
	prev := w.win.RKey()
	for i := 0; i < 32; i++ {
		invalidate(t, w.x.B, w.x.BSend, w.win)
		bind(t, w.x.B, w.x.BSend, w.win, w.dst, 0, 4096)
		if k := w.win.RKey(); k == prev {
			t.Fatalf("bind %d kept key %#x", i, k)
		} else {
			prev = k
		}
	}
	write(t, w.x.A, w.src, 4096, w.dst.Addr(), w.win.RKey())
	expect(t, w.x.ASend, 1, rdma.Success)
}
