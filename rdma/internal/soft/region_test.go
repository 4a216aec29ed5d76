package soft

import (
	"errors"
	"math"
	"testing"

	"github.com/kvhandoff/kvhandoff/rdma"
)

// A remote address a peer chooses can sit anywhere in 2^64: every one outside
// the region, wrapping ones included, is refused, never a panic.
func TestTargetRefusesEveryAddressOutsideTheRegion(t *testing.T) {
	var r Regions
	owner := new(int)
	m, err := r.Alloc(owner, 4096, rdma.LocalWrite|rdma.RemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	base, key := m.Addr(), m.RKey()
	for _, c := range []struct {
		addr uint64
		n    int
	}{
		{math.MaxUint64 - 7, 64}, {math.MaxUint64, 1}, {base + math.MaxUint64 - 31, 64}, {base - 1, 1},
		{base + 4096, 1}, {base + 1, 4096}, {base, 4097}, {base, -1}, {base + 1<<63, 64}, {0, 64},
	} {
		if got, _ := r.Target(owner, nil, key, c.addr, c.n); got != nil {
			t.Errorf("WRITE of %d bytes at %#x (region %#x+4096) was given %d bytes", c.n, c.addr, base, len(got))
		}
	}
	for _, c := range []struct {
		addr uint64
		n    int
	}{{base, 4096}, {base + 4095, 1}, {base + 4096, 0}, {base + 100, 200}} {
		if got, _ := r.Target(owner, nil, key, c.addr, c.n); len(got) != c.n {
			t.Errorf("in-bounds WRITE of %d bytes at +%d refused", c.n, c.addr-base)
		}
	}
	if got, _ := r.Target(new(int), nil, key, base, 1); got != nil {
		t.Error("a region was opened to another protection domain")
	}
}

func TestLocalRefusesOverflowingBuffers(t *testing.T) {
	var r Regions
	owner := new(int)
	m, _ := r.Alloc(owner, 64, rdma.LocalWrite)
	for _, s := range []rdma.SGE{
		{MR: m, Offset: math.MaxInt - 3, Length: 8}, {MR: m, Offset: 8, Length: math.MaxInt - 3},
		{MR: m, Offset: math.MaxInt, Length: math.MaxInt}, {MR: m, Offset: 65}, {MR: (*Region)(nil), Length: 1}, {Length: 1},
	} {
		if _, err := Local(owner, s); !errors.Is(err, rdma.ErrBadRequest) {
			t.Errorf("%+v: %v, want ErrBadRequest", s, err)
		}
	}
	if b, err := Local(owner, rdma.SGE{MR: m, Offset: 60, Length: 4}); err != nil || len(b) != 4 {
		t.Errorf("in-bounds buffer: %v", err)
	}
}

// A region with a window bound on it is not deregistered (the window would
// name a region that no longer exists); once the window is invalidated, it
// is, and its key opens nothing.
func TestDeregisterRefusesARegionWithABoundWindow(t *testing.T) {
	var r Regions
	owner := new(int)
	m, err := r.Alloc(owner, 4096, rdma.LocalWrite|rdma.RemoteWrite|rdma.WindowBind)
	if err != nil {
		t.Fatal(err)
	}
	w := r.AllocWindow(owner)
	if err := r.Bind(w, owner, nil, rdma.SGE{MR: m, Offset: 0, Length: 4096}); err != nil {
		t.Fatal(err)
	}
	if err := r.Deregister(owner, m); !errors.Is(err, rdma.ErrBadRequest) {
		t.Fatalf("a region with a bound window was deregistered: %v", err)
	}
	if err := r.Deregister(new(int), m); !errors.Is(err, rdma.ErrBadRequest) {
		t.Fatalf("another owner deregistered the region: %v", err)
	}
	if err := r.Invalidate(w, owner); err != nil {
		t.Fatal(err)
	}
	if b, _ := r.Target(owner, nil, m.RKey(), m.Addr(), 64); b == nil {
		t.Fatal("the region's own key places nothing before deregistration")
	}
	if err := r.Deregister(owner, m); err != nil {
		t.Fatal(err)
	}
	if b, _ := r.Target(owner, nil, m.RKey(), m.Addr(), 64); b != nil {
		t.Fatal("a deregistered region's key still places a WRITE")
	}
}
