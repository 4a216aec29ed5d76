package soft

import (
	"runtime"
	"testing"

	"github.com/kvhandoff/kvhandoff/rdma"
)

// The permutation is a bijection: on a slice of its domain, no two inputs
// share a key (a sample of 2^20 consecutive counters, where a random
// function would collide about 128 times).
func TestWindowKeysNeverRepeat(t *testing.T) {
	k := newWindowKeys()
	seen := make(map[uint32]uint32, 1<<20)
	for n := uint32(1); n <= 1<<20; n++ {
		key := k.permute(n)
		if m, dup := seen[key]; dup {
			t.Fatalf("binds %d and %d share key %#x", m, n, key)
		}
		seen[key] = n
	}
}

// A million binds of one recycled window hold the memory of one window: no
// record of the keys issued grows with them.
func TestBindsDoNotGrowMemory(t *testing.T) {
	var r Regions
	owner, qp := new(int), new(int)
	m, err := r.Alloc(owner, 4096, rdma.LocalWrite|rdma.RemoteWrite|rdma.WindowBind)
	if err != nil {
		t.Fatal(err)
	}
	w := r.AllocWindow(owner)
	binds := 1_000_000
	if testing.Short() {
		binds = 200_000
	}
	heap := func() uint64 {
		runtime.GC()
		var s runtime.MemStats
		runtime.ReadMemStats(&s)
		return s.HeapAlloc
	}
	before := heap()
	prev := uint32(0)
	for range binds {
		if err := r.Bind(w, owner, qp, rdma.SGE{MR: m, Offset: 0, Length: 4096}); err != nil {
			t.Fatal(err)
		}
		if w.key == prev {
			t.Fatalf("a bind kept key %#x", prev)
		}
		prev = w.key
		if err := r.Invalidate(w, owner); err != nil {
			t.Fatal(err)
		}
	}
	after := heap()
	runtime.KeepAlive(&r) // what the Regions hold counts, not what the GC could drop
	if after > before+1<<20 {
		t.Fatalf("%d binds grew the heap from %d to %d bytes", binds, before, after)
	}
}
