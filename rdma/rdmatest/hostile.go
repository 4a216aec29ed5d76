package rdmatest

import (
	"bytes"
	"errors"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/rdma"
)

// Devices makes a fresh requester device and a fresh responder device of one
// provider; the hostile suite makes several queue pairs on them, so that an
// attacker's queue pair and a well-behaved one share the responder.
type Devices func(t *testing.T) (requester, responder rdma.Device)

// Hostile describes a provider to the hostile-peer suite.
type Hostile struct {
	Devices Devices
	// KeysAreSecret: the provider draws remote keys and addresses from
	// crypto/rand, so a key a predecessor device issued opens nothing on its
	// successor. False for verbs: a NIC's keys are the driver's (rxe draws
	// 8 random bits), and docs/security.md says why nothing relies on them.
	KeysAreSecret bool
	// Identities: ConnInfo.Node names the peer's device and Connect refuses a
	// peer that is not the one named (false for verbs, which has no identity).
	Identities bool
	// Wire, if the provider has a wire the suite can reach as a stranger
	// would (package socket), runs the wire-level attacks too.
	Wire Wire
}

// RunHostile runs the hostile-peer suite: work requests and peers crafted to
// crash, mislead or exhaust the responder. Each attack must fail in the
// documented way, break at most the attacker's queue pair, and leave a
// well-behaved queue pair on the same devices served.
func RunHostile(t *testing.T, h Hostile) {
	t.Run("WrappedOrOutOfRangeAddressFailsAndBreaksOnlyItsQueuePair", func(t *testing.T) { outOfRange(t, h) })
	t.Run("UnknownKeyFailsAndBreaksOnlyItsQueuePair", func(t *testing.T) { unknownKey(t, h) })
	t.Run("OverflowingLocalBufferIsRefusedAtPost", func(t *testing.T) { localOverflow(t, h) })
	if h.KeysAreSecret {
		t.Run("KeyOfAPredecessorDeviceOpensNothing", func(t *testing.T) { staleKey(t, h) })
	}
	if h.Identities {
		t.Run("ForgedConnInfoIsRefused", func(t *testing.T) { forgedConnInfo(t, h) })
		t.Run("StrangerConnectingFirstTakesNothingOver", func(t *testing.T) { connectsFirst(t, h) })
	}
	if h.Wire != nil {
		runWire(t, h)
	}
}

// bystander is a well-behaved queue pair and its target, on the devices the
// attack uses. Attacks running in parallel on the same devices share it.
type bystander struct {
	x        *Pair
	src, dst rdma.MemoryRegion
	mu       sync.Mutex // one WRITE at a time: src, dst and n are shared
	n        uint64
}

func newBystander(t *testing.T, a, b rdma.Device) *bystander {
	t.Helper()
	x := NewPair(t, a, b)
	s := &bystander{x: x, src: register(t, x.PDA, 4096, rdma.LocalWrite), dst: register(t, x.PDB, 4096, rdma.LocalWrite|rdma.RemoteWrite)}
	return s
}

// served checks that the bystander's WRITE still lands, byte for byte.
func (s *bystander) served(t *testing.T) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.n++
	fill(s.src, byte(s.n))
	if err := s.x.A.PostSend(rdma.WorkRequest{ID: s.n, Op: rdma.OpWrite, Local: rdma.SGE{MR: s.src, Length: 4096},
		RemoteAddr: s.dst.Addr(), RKey: s.dst.RKey()}); err != nil {
		t.Fatalf("the well-behaved queue pair refused a post: %v", err)
	}
	expect(t, s.x.ASend, 1, rdma.Success)
	if !bytes.Equal(s.src.Bytes(), s.dst.Bytes()) {
		t.Fatal("the well-behaved queue pair's WRITE did not land")
	}
}

// refusedRemotely posts wr on a fresh queue pair between a and b and checks it
// fails with RemoteAccessError, breaking that queue pair and landing nothing.
func refusedRemotely(t *testing.T, a, b rdma.Device, wr func(src, dst rdma.MemoryRegion) rdma.WorkRequest) {
	t.Helper()
	x := NewPair(t, a, b)
	src := register(t, x.PDA, 4096, rdma.LocalWrite)
	dst := register(t, x.PDB, 4096, rdma.LocalWrite|rdma.RemoteWrite)
	fill(src, 0x33)
	w := wr(src, dst)
	if err := x.A.PostSend(w); err != nil {
		t.Fatalf("post %+v: %v", w, err)
	}
	expect(t, x.ASend, 1, rdma.RemoteAccessError)
	if x.A.State() != rdma.StateError {
		t.Fatal("the requester survived a remote access error")
	}
	waitState(t, x.B, rdma.StateError)
	if !bytes.Equal(dst.Bytes(), make([]byte, 4096)) {
		t.Fatal("bytes landed from a refused WRITE")
	}
}

func waitState(t *testing.T, qp rdma.QueuePair, want rdma.QPState) {
	t.Helper()
	waitStateWithin(t, qp, want, 0)
}

// waitStateWithin waits for qp to reach state want, which a bound of the
// provider's (a frame or idle bound) brings about: eventually, within the
// bound and a generous guard after it, never at a precise time.
func waitStateWithin(t *testing.T, qp rdma.QueuePair, want rdma.QPState, bound time.Duration) {
	t.Helper()
	if !eventuallyWithin(bound, func() bool { return qp.State() == want }) {
		t.Fatalf("queue pair in state %d after its bound (%v) and %v more, want %d", qp.State(), bound, wait, want)
	}
}

// outOfRange: every remote address and length that is not inside the region
// (wrapping past 2^64, beyond its end, before its start) fails with
// RemoteAccessError and breaks only the queue pair it came on.
func outOfRange(t *testing.T, h Hostile) {
	a, b := h.Devices(t)
	good := newBystander(t, a, b)
	good.served(t)
	for name, at := range map[string]func(dst rdma.MemoryRegion) (addr uint64, n int){
		"wraps past 2^64":        func(rdma.MemoryRegion) (uint64, int) { return math.MaxUint64 - 7, 64 },
		"ends exactly at 2^64":   func(rdma.MemoryRegion) (uint64, int) { return math.MaxUint64 - 63, 64 },
		"offset wraps":           func(d rdma.MemoryRegion) (uint64, int) { return d.Addr() + (math.MaxUint64 - 31), 64 },
		"one byte past the end":  func(d rdma.MemoryRegion) (uint64, int) { return d.Addr() + 4096, 1 },
		"length past the end":    func(d rdma.MemoryRegion) (uint64, int) { return d.Addr() + 1, 4096 },
		"one byte before":        func(d rdma.MemoryRegion) (uint64, int) { return d.Addr() - 1, 64 },
		"far beyond":             func(d rdma.MemoryRegion) (uint64, int) { return d.Addr() + 1<<40, 64 },
		"half the address space": func(d rdma.MemoryRegion) (uint64, int) { return d.Addr() + 1<<63, 64 },
	} {
		t.Run(name, func(t *testing.T) {
			refusedRemotely(t, a, b, func(src, dst rdma.MemoryRegion) rdma.WorkRequest {
				addr, n := at(dst)
				return rdma.WorkRequest{ID: 1, Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Length: n}, RemoteAddr: addr, RKey: dst.RKey()}
			})
			good.served(t)
		})
	}
}

// unknownKey: keys the responder never issued, and keys of another
// protection domain on the same device, open nothing.
func unknownKey(t *testing.T, h Hostile) {
	a, b := h.Devices(t)
	good := newBystander(t, a, b)
	for name, key := range map[string]func(dst rdma.MemoryRegion) uint32{
		"flipped bits":              func(d rdma.MemoryRegion) uint32 { return d.RKey() ^ 0x5A5A00 },
		"zero":                      func(rdma.MemoryRegion) uint32 { return 0 },
		"all ones":                  func(rdma.MemoryRegion) uint32 { return math.MaxUint32 },
		"another protection domain": func(rdma.MemoryRegion) uint32 { return good.dst.RKey() },
	} {
		t.Run(name, func(t *testing.T) {
			refusedRemotely(t, a, b, func(src, dst rdma.MemoryRegion) rdma.WorkRequest {
				addr := dst.Addr()
				if name == "another protection domain" {
					addr = good.dst.Addr()
				}
				return rdma.WorkRequest{ID: 1, Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Length: 64}, RemoteAddr: addr, RKey: key(dst)}
			})
			good.served(t)
		})
	}
}

// localOverflow: a local buffer whose offset plus length overflows is a bad
// request, refused at post, never a panic.
func localOverflow(t *testing.T, h Hostile) {
	a, b := h.Devices(t)
	x := NewPair(t, a, b)
	m := register(t, x.PDA, 64, rdma.LocalWrite)
	for name, s := range map[string]rdma.SGE{
		"offset near MaxInt": {MR: m, Offset: math.MaxInt - 3, Length: 8},
		"length near MaxInt": {MR: m, Offset: 8, Length: math.MaxInt - 3},
		"both at MaxInt":     {MR: m, Offset: math.MaxInt, Length: math.MaxInt},
		"offset past end":    {MR: m, Offset: 65, Length: 0},
		"negative offset":    {MR: m, Offset: -1, Length: 1},
		"no region":          {Length: 8},
	} {
		if err := x.A.PostSend(rdma.WorkRequest{Op: rdma.OpWrite, Local: s, RemoteAddr: 1, RKey: 1}); !errors.Is(err, rdma.ErrBadRequest) {
			t.Errorf("send, %s: %v, want ErrBadRequest", name, err)
		}
		if err := x.B.PostRecv(rdma.WorkRequest{Op: rdma.OpRecv, Local: s}); !errors.Is(err, rdma.ErrBadRequest) && name != "no region" {
			// B's domain does not own m: refused as well, for whichever reason.
			t.Errorf("recv, %s: %v, want ErrBadRequest", name, err)
		}
	}
	if x.A.State() != rdma.StateRTS {
		t.Fatal("a refused post broke the queue pair")
	}
}

// staleKey: a key and address a responder issued before it was closed open
// nothing on the device that replaces it, though the replacement registers
// the same sizes in the same order.
func staleKey(t *testing.T, h Hostile) {
	a0, b0 := h.Devices(t)
	old := NewPair(t, a0, b0)
	oldDst := register(t, old.PDB, 4096, rdma.LocalWrite|rdma.RemoteWrite)
	addr, key := oldDst.Addr(), oldDst.RKey()
	b0.Close()
	a0.Close()
	a, b := h.Devices(t)
	x := NewPair(t, a, b)
	dst := register(t, x.PDB, 4096, rdma.LocalWrite|rdma.RemoteWrite) // in the same order as before
	src := register(t, x.PDA, 4096, rdma.LocalWrite)
	if dst.Addr() == addr && dst.RKey() == key {
		t.Fatalf("the successor reissued key %#x at %#x: a stale grant would write into it", key, addr)
	}
	if err := x.A.PostSend(rdma.WorkRequest{ID: 1, Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Length: 64}, RemoteAddr: addr, RKey: key}); err != nil {
		t.Fatal(err)
	}
	expect(t, x.ASend, 1, rdma.RemoteAccessError)
	if !bytes.Equal(dst.Bytes(), make([]byte, 4096)) {
		t.Fatal("a stale key wrote into the successor's region")
	}
}

func newQP(t *testing.T, d rdma.Device) (rdma.ProtectionDomain, rdma.CompletionQueue, rdma.QueuePair) {
	t.Helper()
	pd, err := d.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	cq, err := d.CreateCQ(64)
	if err != nil {
		t.Fatal(err)
	}
	qp, err := pd.CreateQP(cq, cq, 16)
	if err != nil {
		t.Fatal(err)
	}
	return pd, cq, qp
}

// forgedConnInfo: Connect naming a queue pair with the wrong PSN, the wrong
// QPN or the wrong identity is refused, and so is a queue pair already
// connected to someone else; the genuine ConnInfo connects afterwards.
func forgedConnInfo(t *testing.T, h Hostile) {
	a, b := h.Devices(t)
	good := newBystander(t, a, b)
	for name, forge := range map[string]func(rdma.ConnInfo) rdma.ConnInfo{
		"wrong PSN":      func(c rdma.ConnInfo) rdma.ConnInfo { c.PSN ^= 0x000100; return c },
		"wrong QPN":      func(c rdma.ConnInfo) rdma.ConnInfo { c.QPN ^= 1; return c },
		"wrong identity": func(c rdma.ConnInfo) rdma.ConnInfo { c.Node += "-impostor"; return c },
	} {
		t.Run(name, func(t *testing.T) {
			_, _, victim := newQP(t, b)
			_, _, stranger := newQP(t, a)
			if err := stranger.Connect(forge(victim.Info())); !errors.Is(err, rdma.ErrUnknownPeer) {
				t.Fatalf("Connect with a forged %s: %v, want ErrUnknownPeer", name, err)
			}
			_, _, genuine := newQP(t, a)
			if err := genuine.Connect(victim.Info()); err != nil {
				t.Fatalf("the genuine ConnInfo after a forgery: %v", err)
			}
			good.served(t)
		})
	}
	t.Run("taken", func(t *testing.T) {
		if err := newQPConnect(t, a, good.x.B.Info()); err == nil {
			t.Fatal("a queue pair already connected to its peer accepted another")
		}
		good.served(t)
	})
}

func newQPConnect(t *testing.T, d rdma.Device, to rdma.ConnInfo) error {
	_, _, qp := newQP(t, d)
	return qp.Connect(to)
}

// connectsFirst is the reproduction: a stranger who learned the
// victim's ConnInfo connects to it before the genuine peer does. Once the
// victim connects to the genuine peer, the stranger's WRITE lands nothing
// and the genuine peer's WRITEs land.
func connectsFirst(t *testing.T, h Hostile) {
	a, b := h.Devices(t)
	pdV, _, victim := newQP(t, b)
	pdS, cqS, stranger := newQP(t, a)
	pdG, cqG, genuine := newQP(t, a)
	dst := register(t, pdV, 4096, rdma.LocalWrite|rdma.RemoteWrite)
	evil := register(t, pdS, 64, rdma.LocalWrite)
	copy(evil.Bytes(), "ATTACKER-KV")
	strangerIn := stranger.Connect(victim.Info()) == nil // it may be let in to wait
	if err := victim.Connect(genuine.Info()); err != nil {
		t.Fatal(err)
	}
	if err := genuine.Connect(victim.Info()); err != nil {
		t.Fatalf("the genuine peer, after a stranger connected first: %v", err)
	}
	if strangerIn {
		if err := stranger.PostSend(rdma.WorkRequest{ID: 1, Op: rdma.OpWrite, Local: rdma.SGE{MR: evil, Length: 64},
			RemoteAddr: dst.Addr(), RKey: dst.RKey()}); err == nil {
			if c := collect(t, cqS, 1)[0]; c.Status == rdma.Success {
				t.Fatal("the stranger's WRITE completed")
			}
		}
	}
	src := register(t, pdG, 64, rdma.LocalWrite)
	copy(src.Bytes(), "GENUINE-KV")
	if err := genuine.PostSend(rdma.WorkRequest{ID: 2, Op: rdma.OpWrite, Local: rdma.SGE{MR: src, Length: 64},
		RemoteAddr: dst.Addr(), RKey: dst.RKey()}); err != nil {
		t.Fatal(err)
	}
	expect(t, cqG, 1, rdma.Success)
	if !bytes.Equal(dst.Bytes()[:64], src.Bytes()) {
		t.Fatalf("the victim's region holds %q", dst.Bytes()[:16])
	}
}
