package soft

import (
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

// Regions numbers the regions of one fabric or device: each gets a key and a
// page-aligned address range of its own, never reused.
type Regions struct {
	mu       sync.Mutex
	byKey    map[uint32]*Region
	nextKey  uint32
	nextAddr uint64
}

// Register registers buf for owner.
func (r *Regions) Register(owner any, buf []byte, access rdma.Access) (*Region, error) {
	if len(buf) == 0 {
		return nil, fmt.Errorf("%w: empty region", rdma.ErrBadRequest)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.byKey == nil {
		r.byKey, r.nextKey, r.nextAddr = map[uint32]*Region{}, 0x100, 1<<32
	}
	m := &Region{Owner: owner, Buf: buf, Access: access, addr: r.nextAddr, key: r.nextKey}
	r.nextKey++
	r.nextAddr += uint64(len(buf)+4095) &^ 4095
	r.byKey[m.key] = m
	return m, nil
}

// Alloc registers size bytes of fresh memory for owner: Go memory never
// moves under these providers.
func (r *Regions) Alloc(owner any, size int, access rdma.Access) (*Region, error) {
	if size <= 0 {
		return nil, fmt.Errorf("%w: region of %d bytes", rdma.ErrBadRequest, size)
	}
	return r.Register(owner, make([]byte, size), access)
}

// Target is where a remote WRITE of n bytes at addr with rkey lands in one of
// owner's regions, or nil when the responder must refuse it: an unknown key, a
// region of another domain or without remote write access, or out of bounds.
func (r *Regions) Target(owner any, rkey uint32, addr uint64, n int) []byte {
	r.mu.Lock()
	m := r.byKey[rkey]
	r.mu.Unlock()
	if m == nil || m.Owner != owner || m.Access&rdma.RemoteWrite == 0 ||
		addr < m.addr || addr+uint64(n) > m.addr+uint64(len(m.Buf)) {
		return nil
	}
	return m.Buf[addr-m.addr : addr-m.addr+uint64(n)]
}

// Local checks a work request's local buffer: a region of owner's, in bounds.
func Local(owner any, s rdma.SGE) ([]byte, error) {
	m, ok := s.MR.(*Region)
	if !ok || m.Owner != owner || s.Offset < 0 || s.Length < 0 || s.Offset+s.Length > len(m.Buf) {
		return nil, fmt.Errorf("%w: local buffer outside its region or not of this protection domain", rdma.ErrBadRequest)
	}
	return m.Buf[s.Offset : s.Offset+s.Length], nil
}
