package soft

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"sync"

	"github.com/kvhandoff/kvhandoff/rdma"
)

// Region is a registered region of Go memory. Owner is the protection domain
// it belongs to: only work requests of that domain may use it.
type Region struct {
	Owner  any
	Buf    []byte
	Access rdma.Access
	addr   uint64
	key    uint32
}

// Addr implements rdma.MemoryRegion.
func (m *Region) Addr() uint64 { return m.addr }

// Len implements rdma.MemoryRegion.
func (m *Region) Len() int { return len(m.Buf) }

// LKey implements rdma.MemoryRegion.
func (m *Region) LKey() uint32 { return m.key }

// RKey implements rdma.MemoryRegion.
func (m *Region) RKey() uint32 { return m.key }

// Bytes implements rdma.MemoryRegion.
func (m *Region) Bytes() []byte { return m.Buf }

// Regions keys the regions of one fabric or device. Each gets a remote key
// drawn from crypto/rand, unique on the device and never reused, and a
// page-aligned base address drawn the same way: a peer cannot guess a key, and
// a key a predecessor device issued opens nothing on its successor. Addresses
// of two regions may overlap: a WRITE is placed by key first, then checked
// against that one region's range. Window keys are never reused either, for
// 2^32 binds, without remembering them (windowKeys).
type Regions struct {
	mu      sync.Mutex
	byKey   map[uint32]*Region
	windows map[uint32]*Window // bound windows by their key
	used    map[uint32]bool    // every region key ever issued (regions are few)
	keys    *windowKeys
}

func (r *Regions) init() {
	if r.byKey == nil {
		r.byKey, r.windows, r.used = map[uint32]*Region{}, map[uint32]*Window{}, map[uint32]bool{}
		r.keys = newWindowKeys()
	}
}

// lowestAddr and addrSpan bound the base addresses: above 4 GiB (no small
// integer is a valid address) and far enough below 2^64 that base+len never
// wraps.
const (
	lowestAddr = 1 << 32
	addrSpan   = 1 << 62
)

// Register registers buf for owner.
func (r *Regions) Register(owner any, buf []byte, access rdma.Access) (*Region, error) {
	if len(buf) == 0 {
		return nil, fmt.Errorf("%w: empty region", rdma.ErrBadRequest)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.init()
	key := Random32()
	for key == 0 || r.used[key] {
		key = Random32()
	}
	addr := (lowestAddr + Random64()%addrSpan) &^ 4095
	m := &Region{Owner: owner, Buf: buf, Access: access, addr: addr, key: key}
	r.used[key] = true
	r.byKey[m.key] = m
	return m, nil
}

// Deregister deregisters owner's region m (rdma.Deregistrar): its key,
// never reissued, opens nothing from now on. A region with a window bound
// on it is refused.
func (r *Regions) Deregister(owner any, m rdma.MemoryRegion) error {
	reg, ok := m.(*Region)
	r.mu.Lock()
	defer r.mu.Unlock()
	if !ok || reg == nil || reg.Owner != owner || r.byKey[reg.key] != reg {
		return fmt.Errorf("%w: deregistration of a region this protection domain has not registered", rdma.ErrBadRequest)
	}
	for _, w := range r.windows {
		if w.region == reg {
			return fmt.Errorf("%w: deregistration of a region with a window bound on it", rdma.ErrBadRequest)
		}
	}
	delete(r.byKey, reg.key)
	return nil
}

// Alloc registers size bytes of fresh memory for owner: Go memory never
// moves under these providers.
func (r *Regions) Alloc(owner any, size int, access rdma.Access) (*Region, error) {
	if size <= 0 {
		return nil, fmt.Errorf("%w: region of %d bytes", rdma.ErrBadRequest, size)
	}
	return r.Register(owner, make([]byte, size), access)
}

// Target is where a remote WRITE of n bytes at addr with rkey, arriving on
// responder queue pair qp, lands in one of owner's regions, or nil when the
// responder must refuse it: an unknown key, a region of another domain or
// without remote write access, a window bound on another queue pair, or out
// of bounds (of the region, or of the window's range). For a window's key it
// also returns the window, which the placement checks again (Valid) for
// every piece it places: an invalidate may come in the middle.
func (r *Regions) Target(owner, qp any, rkey uint32, addr uint64, n int) ([]byte, *Window) {
	r.mu.Lock()
	var m *Region
	var w *Window
	var lo, size uint64 // the range the key opens, in m
	if m = r.byKey[rkey]; m != nil {
		if m.Access&rdma.RemoteWrite == 0 {
			m = nil
		} else {
			size = uint64(len(m.Buf))
		}
	} else if w = r.windows[rkey]; w != nil && w.qp == qp {
		m, lo, size = w.region, w.off, w.n
	}
	r.mu.Unlock()
	if m == nil || m.Owner != owner || n < 0 || addr < m.addr || addr-m.addr < lo {
		return nil, nil
	}
	// Offsets, never addr+n: a peer chooses addr, and addr+n can wrap past 2^64.
	off := addr - m.addr - lo
	if off > size || uint64(n) > size-off {
		return nil, nil
	}
	return m.Buf[lo+off : lo+off+uint64(n)], w
}

// Local checks a work request's local buffer: a region of owner's, in bounds.
func Local(owner any, s rdma.SGE) ([]byte, error) {
	m, ok := s.MR.(*Region)
	// Offset+Length can overflow int: compare the length with what is left.
	if !ok || m == nil || m.Owner != owner || s.Offset < 0 || s.Length < 0 || s.Offset > len(m.Buf) || s.Length > len(m.Buf)-s.Offset {
		return nil, fmt.Errorf("%w: local buffer outside its region or not of this protection domain", rdma.ErrBadRequest)
	}
	return m.Buf[s.Offset : s.Offset+s.Length], nil
}

// Random32 is 32 bits from crypto/rand: keys, queue pair numbers and PSNs a
// peer must not guess.
func Random32() uint32 {
	var b [4]byte
	rand.Read(b[:]) // never fails (crypto/rand's contract since Go 1.24)
	return binary.BigEndian.Uint32(b[:])
}

// Random64 is 64 bits from crypto/rand.
func Random64() uint64 {
	var b [8]byte
	rand.Read(b[:])
	return binary.BigEndian.Uint64(b[:])
}
