package protocol

import (
	"errors"
	"math/rand/v2"
	"slices"
	"testing"
)

func TestAllocationAdvancesEveryEpoch(t *testing.T) {
	p := NewPool(2)
	a, _ := p.Allocate(1, 2)
	p.Release(1, a)
	b, _ := p.Allocate(2, 2)
	for i := range b {
		if b[i].Epoch <= 1 {
			t.Fatalf("a reallocated page must have a new epoch: %+v then %+v", a, b)
		}
	}
}

func TestAllocationIsAllOrNothing(t *testing.T) {
	p := NewPool(3)
	if _, err := p.Allocate(1, 4); !errors.Is(err, ErrNoCapacity) || p.Free() != 3 {
		t.Fatalf("err %v, free %d: a failed reservation must take nothing", err, p.Free())
	}
	if _, err := p.Allocate(1, 0); !errors.Is(err, ErrNoCapacity) {
		t.Fatalf("a reservation of 0 pages is an error: %v", err)
	}
}

func TestReleaseIsIdempotent(t *testing.T) {
	p := NewPool(2)
	refs, _ := p.Allocate(1, 2)
	if n := p.Release(1, refs); n != 2 {
		t.Fatalf("freed %d", n)
	}
	if n := p.Release(1, refs); n != 0 || p.Free() != 2 {
		t.Fatalf("a second release freed %d pages, free %d", n, p.Free())
	}
}

// The double-free defense: a late release (a duplicate fence) names the old
// epoch, so it cannot free the page's next owner's tenancy.
func TestLateReleaseNeverFreesTheNextOwnersPage(t *testing.T) {
	p := NewPool(1)
	old, _ := p.Allocate(1, 1)
	p.Release(1, old)
	cur, _ := p.Allocate(2, 1)
	if n := p.Release(1, old); n != 0 {
		t.Fatal("a late release freed another request's page")
	}
	if err := p.Check(2, cur[0]); err != nil {
		t.Fatalf("the new owner lost its page: %v", err)
	}
}

func TestQuarantinedPagesAreNotReusedUntilReleased(t *testing.T) {
	p := NewPool(2)
	refs, _ := p.Allocate(1, 2)
	if n := p.Quarantine(1, refs); n != 2 || p.Quarantined() != 2 {
		t.Fatalf("quarantined %d", n)
	}
	if _, err := p.Allocate(2, 1); !errors.Is(err, ErrNoCapacity) {
		t.Fatal("a quarantined page must not be handed out")
	}
	if err := p.Check(1, refs[0]); !errors.Is(err, ErrFenced) {
		t.Fatal("a quarantined page must not be read")
	}
	p.Release(1, refs) // the fence arrived
	if p.Free() != 2 || p.Quarantined() != 0 {
		t.Fatal("release must free quarantined pages")
	}
}

func TestReadCheckFailsOnceThePageChangedHands(t *testing.T) {
	p := NewPool(1)
	old, _ := p.Allocate(1, 1)
	if err := p.Check(1, old[0]); err != nil {
		t.Fatal(err)
	}
	p.Release(1, old)
	if err := p.Check(1, old[0]); !errors.Is(err, ErrFenced) {
		t.Fatal("a freed page must fail the read check")
	}
	p.Allocate(2, 1)
	if err := p.Check(1, old[0]); !errors.Is(err, ErrFenced) {
		t.Fatal("a reallocated page must fail the old owner's read check")
	}
	if err := p.Check(1, PageRef{Page: 99}); !errors.Is(err, ErrFenced) {
		t.Fatal("a page outside the pool is not the caller's")
	}
}

func TestQuarantineIgnoresPagesNoLongerHeld(t *testing.T) {
	p := NewPool(1)
	old, _ := p.Allocate(1, 1)
	p.Release(1, old)
	cur, _ := p.Allocate(2, 1)
	if n := p.Quarantine(1, old); n != 0 || p.Check(2, cur[0]) != nil {
		t.Fatal("quarantining an old tenancy touched the new owner's page")
	}
}

// Conservation under random use: every page is free exactly once in the free
// list, or held by exactly one live tenancy; nothing is lost or duplicated.
func TestConservationUnderRandomOperations(t *testing.T) {
	for seed := uint64(0); seed < 50; seed++ {
		rng := rand.New(rand.NewPCG(seed, 0))
		p := NewPool(8)
		held := map[RequestID][]PageRef{}
		var retired [][2]any // (owner, refs) already released: replays must do nothing
		next := RequestID(1)
		for step := 0; step < 500; step++ {
			switch rng.IntN(4) {
			case 0:
				if refs, err := p.Allocate(next, 1+rng.IntN(3)); err == nil {
					held[next] = refs
				}
				next++
			case 1, 2:
				for id, refs := range held {
					if rng.IntN(2) == 0 {
						p.Quarantine(id, refs)
					}
					p.Release(id, refs)
					retired = append(retired, [2]any{id, refs})
					delete(held, id)
					break
				}
			case 3:
				if len(retired) > 0 {
					r := retired[rng.IntN(len(retired))]
					if n := p.Release(r[0].(RequestID), r[1].([]PageRef)); n != 0 {
						t.Fatalf("seed %d: a replayed release freed %d pages", seed, n)
					}
				}
			}
			owned := 0
			for id, refs := range held {
				for _, ref := range refs {
					if err := p.Check(id, ref); err != nil {
						t.Fatalf("seed %d step %d: %v", seed, step, err)
					}
					owned++
				}
			}
			seen := map[uint32]bool{}
			for _, f := range p.free {
				if seen[f] || p.pages[f].state != pageFree {
					t.Fatalf("seed %d step %d: page %d free twice or not free", seed, step, f)
				}
				seen[f] = true
			}
			if owned+p.Free() != p.Len() {
				t.Fatalf("seed %d step %d: %d owned + %d free != %d", seed, step, owned, p.Free(), p.Len())
			}
		}
	}
}

// Rule 24: eviction (inside Allocate) takes only unpinned cached pages,
// least recently used first, advances their epochs like any allocation, and
// keeps the index and LRU list whole (Audit); a pinned page stays, and
// CheckShared holds for it in its own scope only.
func TestEvictionTakesOnlyUnpinnedPagesLeastRecentlyUsedFirst(t *testing.T) {
	p := NewPool(4)
	chain := PrefixChain([]uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, 4)
	refs, _ := p.Allocate(1, 3)
	for i, ref := range refs {
		if !p.Insert(1, ref, 7, chain[i]) {
			t.Fatalf("page %d not inserted", i)
		}
	}
	if p.Insert(1, refs[0], 7, chain[0]) || p.Cached() != 3 || p.Free() != 1 {
		t.Fatalf("a second insert took: %d cached, %d free", p.Cached(), p.Free())
	}
	if k := p.LookupPrefix(7, chain); k != 3 {
		t.Fatalf("lookup %d, want 3", k)
	}
	if k := p.LookupPrefix(8, chain); k != 0 {
		t.Fatalf("another scope's lookup hit %d pages", k)
	}
	pinned := p.Pin(reader, 7, chain[:1]) // page 0 pinned and most recently used
	if err := p.CheckShared(7, pinned[0]); err != nil {
		t.Fatal(err)
	}
	if err := p.CheckShared(8, pinned[0]); !errors.Is(err, ErrNotShared) {
		t.Fatalf("another scope reads a pinned page: %v", err)
	}
	if err := p.CheckShared(7, refs[1]); !errors.Is(err, ErrNotShared) {
		t.Fatalf("an unpinned cached page passes the shared read check: %v", err)
	}
	// 3 pages: the free one, then pages 1 and 2 (least recently used), not 0.
	got, err := p.Allocate(2, 3)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Audit(); err != nil {
		t.Fatal(err)
	}
	for _, ref := range got {
		if ref.Page == 0 || ref.Epoch != 2 && ref.Page != 3 {
			t.Fatalf("allocated %v", got)
		}
	}
	if _, err := p.Allocate(3, 1); !errors.Is(err, ErrNoCapacity) {
		t.Fatalf("the pinned page was evicted: %v", err)
	}
	if p.Evictions() != 2 || p.LookupPrefix(7, chain) != 1 {
		t.Fatalf("%d evictions, lookup %d", p.Evictions(), p.LookupPrefix(7, chain))
	}
	if p.Unpin(reader, 7, pinned) != 1 || p.Unpin(reader, 7, pinned) != 0 || p.Pinned() != 0 {
		t.Fatal("unpin is not once per pin")
	}
	if refs, err := p.Allocate(3, 1); err != nil || refs[0].Page != 0 || refs[0].Epoch != 2 {
		t.Fatalf("the unpinned page is not evicted: %v %v", refs, err)
	}
	if err := p.Audit(); err != nil {
		t.Fatal(err)
	}
}

// The evict-pinned switch: eviction ignores pins, so a page a request
// reads as its prefix is reallocated under it (CheckShared then fails; the
// harness's PinnedNeverReallocated catches the WRITE that lands there).
func TestEvictPinnedReallocatesAPinnedPage(t *testing.T) {
	p := NewPool(1)
	p.evictPinned = true
	chain := PrefixChain([]uint32{1, 2, 3, 4}, 4)
	refs, _ := p.Allocate(1, 1)
	p.Insert(1, refs[0], 7, chain[0])
	pinned := p.Pin(reader, 7, chain)
	if _, err := p.Allocate(2, 1); err != nil {
		t.Fatalf("under evict-pinned: %v", err)
	}
	if err := p.CheckShared(7, pinned[0]); !errors.Is(err, ErrNotShared) {
		t.Fatalf("the reallocated page still passes: %v", err)
	}
}

// The journal names every tenancy's end and every pin: a release by its
// owner, an insertion into the cache by its owner, a pin and an unpin by
// the reader, an eviction, a purge and a doomed page's last unpin by none;
// it is off by default; under double-free it shows the releasing request
// ending another request's tenancy, and under evict-pinned a pinned page
// freed (what trace check refuses).
func TestThePoolsJournalNamesEveryTenancysEnd(t *testing.T) {
	p := NewPool(3)
	refs, _ := p.Allocate(1, 2)
	p.Release(1, refs[:1])
	if f := p.TakeJournal(); f != nil {
		t.Fatalf("journal off by default, took %v", f)
	}
	p.Journal(true)
	p.Release(1, refs) // refs[0] freed already: only refs[1]
	want := []PoolChange{{Owner: 1, Ref: refs[1]}}
	if f := p.TakeJournal(); len(f) != 1 || f[0] != want[0] {
		t.Fatalf("release journaled %v, want %v", f, want)
	}
	if f := p.TakeJournal(); len(f) != 0 {
		t.Fatalf("TakeJournal kept %v", f)
	}
	// Cached pages: one evicted by an allocation, one purged, one doomed
	// while pinned and freed at its last unpin.
	chain := PrefixChain([]uint32{1, 2, 3, 4, 5, 6}, 2)
	cached, _ := p.Allocate(2, 3)
	for i, ref := range cached {
		if !p.InsertFrom(2, ref, 7, chain[i], 9) {
			t.Fatalf("page %d not inserted", i)
		}
	}
	if j := p.TakeJournal(); len(j) != 3 || j[0] != (PoolChange{Owner: 2, Ref: cached[0], Kind: PageCached}) || j[2].Kind != PageCached {
		t.Fatalf("insertions journaled %v", j)
	}
	pinned := p.Pin(reader, 7, chain[:1])
	if j := p.TakeJournal(); len(j) != 1 || j[0] != (PoolChange{Owner: reader, Ref: pinned[0], Kind: PagePinned}) {
		t.Fatalf("the pin journaled %v", j)
	}
	if _, err := p.Allocate(3, 1); err != nil { // evicts an unpinned cached page
		t.Fatal(err)
	}
	evicted := p.TakeJournal()
	if len(evicted) != 1 || evicted[0].Owner != 0 || evicted[0].Ref == pinned[0] || !slices.Contains(cached, evicted[0].Ref) {
		t.Fatalf("eviction journaled %v, want one of %v but the pinned %v", evicted, cached, pinned[0])
	}
	if freed, doomed := p.PurgeWriter(9); freed != 1 || doomed != 1 {
		t.Fatalf("purge freed %d, doomed %d", freed, doomed)
	}
	if f := p.TakeJournal(); len(f) != 1 || f[0].Owner != 0 || f[0].Ref == pinned[0] || f[0].Ref == evicted[0].Ref || !slices.Contains(cached, f[0].Ref) {
		t.Fatalf("purge journaled %v, want the last unpinned one of %v", f, cached)
	}
	p.Unpin(reader, 7, pinned)
	if f := p.TakeJournal(); len(f) != 2 || f[0] != (PoolChange{Owner: reader, Ref: pinned[0], Kind: PageUnpinned}) || f[1] != (PoolChange{Ref: pinned[0]}) {
		t.Fatalf("the doomed page's last unpin journaled %v, want the unpin, then %v freed", f, pinned[0])
	}
	// double-free: a late release of request 3's old page frees request
	// 4's tenancy, and the journal says so.
	q := NewPool(1)
	q.doubleFree = true
	q.Journal(true)
	old, _ := q.Allocate(3, 1)
	q.Release(3, old)
	cur, _ := q.Allocate(4, 1)
	q.TakeJournal()
	q.Release(3, old)
	if f := q.TakeJournal(); len(f) != 1 || f[0] != (PoolChange{Owner: 3, Ref: cur[0]}) {
		t.Fatalf("under double-free journaled %v, want request 3 ending %v", f, cur[0])
	}
	// evict-pinned: the pool frees a page a request still has pinned, and
	// the journal shows the pin with no unpin before the free.
	e := NewPool(1)
	e.evictPinned = true
	e.Journal(true)
	refs, _ = e.Allocate(1, 1)
	e.Insert(1, refs[0], 7, chain[0])
	pinned = e.Pin(reader, 7, chain[:1])
	if _, err := e.Allocate(2, 1); err != nil {
		t.Fatal(err)
	}
	want = []PoolChange{{Owner: 1, Ref: refs[0], Kind: PageCached}, {Owner: reader, Ref: pinned[0], Kind: PagePinned}, {Ref: pinned[0]}}
	if j := e.TakeJournal(); !slices.Equal(j, want) {
		t.Fatalf("under evict-pinned journaled %v, want %v", j, want)
	}
}

// reader is the request that pins cached pages in the tests.
const reader RequestID = 99
