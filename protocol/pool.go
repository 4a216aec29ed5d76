package protocol

import (
	"errors"
	"fmt"
	"sync/atomic"
)

// PageRef is an ownership tag: a decode page and the epoch it was allocated at.
// The pair names one tenancy of the page; a later allocation of the same page
// has a higher epoch.
type PageRef struct {
	Page  uint32
	Epoch uint64
}

// Errors of the page pool.
var (
	// ErrNoCapacity: not enough free pages for a reservation.
	ErrNoCapacity = errors.New("protocol: not enough free pages")
	// ErrFenced: the page is no longer the caller's (freed or reallocated since
	// it was granted): reading it would read someone else's KV.
	ErrFenced = errors.New("protocol: page no longer owned at this epoch")
)

// ErrNotShared: a page read as a shared prefix page is no longer cached at
// the epoch it was pinned at, in the reader's scope, or pinned.
var ErrNotShared = errors.New("protocol: page is not a pinned cached page of this scope")

type pageState uint8

const (
	pageFree pageState = iota
	pageOwned
	pageQuarantined
	pageCached
)

// noPage ends the cache's LRU list.
const noPage = ^uint32(0)

type page struct {
	state pageState
	// epoch is written only by the pool's owner (Allocate) and read
	// atomically, so that a decoder checks it at read time through an
	// EpochView without the owner's lock.
	epoch atomic.Uint64
	owner RequestID
	// A cached page: its key, the requests reading it as their prefix, and
	// its place in the LRU list (prev toward the most recently used end).
	key        cacheKey
	pins       uint32
	prev, next uint32
	// writer is the peer whose WRITE filled a cached page (noWriter if
	// none was named); doomed: its writer failed while the page was
	// pinned, so it is out of the index and the LRU list (no new hit) and
	// is freed at its last unpin.
	writer PeerID
	doomed bool
	// insertedBy is the request whose Finish cached the page: an insertion
	// at its scope's cap never evicts a page of its own chain.
	insertedBy RequestID
}

// noWriter is the writer of a cached page inserted without one.
const noWriter = ^PeerID(0)

// cacheKey is what a cached page is found by: the scope and the chain hash
// of the prompt prefix it ends (docs/protocol.md rule 21).
type cacheKey struct {
	scope Scope
	hash  ChainHash
}

// Pool is a decode node's page pool (docs/protocol.md rules 11, 16 and 21-24).
// Every page is free, owned by one request at one epoch, quarantined for one
// request until that request's writer is fenced, or cached: a verified full
// prompt page kept under (scope, chain hash) for later requests of its scope
// to read, pinned by each request reading it. Allocation advances each page's
// epoch, so a PageRef names one tenancy; every operation on a page names the
// tenancy it means and touches nothing else. Allocate evicts the least
// recently used unpinned cached pages when the free list is short. A cached
// page records the peer that wrote it, so that PurgeWriter can take a
// caught writer's pages out of the cache. It is not safe for concurrent use.
type Pool struct {
	pages []page
	free  []uint32 // LIFO: the most recently freed page is reused first
	// The cache: its index, its LRU list of every cached page (head most
	// recently used), and how many of them are pinned.
	index      map[cacheKey]uint32
	head, tail uint32
	cached     int
	pinned     int
	doomed     int
	evictions  uint64
	purged     uint64
	// doubleFree is the double-free switch: Release frees the named pages
	// whoever holds them now.
	doubleFree bool
	// scopeDropped is the scope-dropped switch: the cache key and the shared
	// read check ignore the scope. evictPinned is the evict-pinned switch:
	// eviction takes pinned pages too.
	scopeDropped, evictPinned bool
	// scopeCap, if positive, is the most cached pages one scope may hold
	// (SetScopeCap); perScope counts each scope's indexed cached pages.
	scopeCap int
	perScope map[Scope]int
	// journal, when on (Journal), lists every tenancy freed, cached,
	// pinned or unpinned since the last TakeJournal.
	journal   bool
	journaled []PoolChange
}

// PoolChange is one change of a tenancy the pool's journal records, and
// the request that made it (Owner): Kind says which.
type PoolChange struct {
	Owner RequestID
	Ref   PageRef
	Kind  PoolChangeKind
}

// PoolChangeKind is what a PoolChange did to its tenancy.
type PoolChangeKind uint8

// The changes the journal records.
const (
	// PageFreed: the page went back to the free list, its tenancy over.
	// Owner is the request that gave it back, or 0 for a cached page the
	// pool freed itself (evicted, purged, or doomed and unpinned at last).
	PageFreed PoolChangeKind = iota
	// PageCached: the request's page moved into the prefix cache; the
	// tenancy goes on, the cache's, until the pool frees it.
	PageCached
	// PagePinned, PageUnpinned: a request took or dropped a pin on a
	// cached page it reads as its prefix (Pin, Unpin).
	PagePinned
	PageUnpinned
)

// Journal turns on (or off) the journal of tenancies freed, cached, pinned
// and unpinned, which TakeJournal drains: a driver that traces its node
// (docs/trace.md) writes each change, so that a trace shows every
// tenancy's end and a checker can tell a page reallocated, read, freed
// while a request held or pinned it, or never given back. Off by default:
// a driver that never drains it would grow it without bound.
func (p *Pool) Journal(on bool) {
	p.journal = on
	p.journaled = nil
}

// TakeJournal returns the changes since the last call, in the order they
// happened, and empties the journal (nil when it is off).
func (p *Pool) TakeJournal() []PoolChange {
	j := p.journaled
	p.journaled = nil
	return j
}

// record journals a change of page id's current tenancy, if the journal
// is on.
func (p *Pool) record(owner RequestID, id uint32, kind PoolChangeKind) {
	if p.journal {
		p.journaled = append(p.journaled, PoolChange{Owner: owner, Ref: PageRef{Page: id, Epoch: p.pages[id].epoch.Load()}, Kind: kind})
	}
}

// freed puts page id on the free list, journaling the end of its tenancy
// for owner.
func (p *Pool) freed(owner RequestID, id uint32) {
	p.free = append(p.free, id)
	p.record(owner, id, PageFreed)
}

// SetScopeCap caps the cached pages of each scope at n (0, the default, is
// no cap: one LRU over every scope). A scope at its cap that inserts a page
// evicts its own least recently used unpinned page first, or inserts
// nothing if all of its pages are pinned: so no scope pushes another's
// pages out of the cache, nor reads the others' load in its own hits
// (docs/security.md). Pages cached past a lowered cap stay until evicted.
func (p *Pool) SetScopeCap(n int) { p.scopeCap = max(n, 0) }

// ScopeCached is the number of cached pages scope holds (purged ones
// waiting for their last unpin aside).
func (p *Pool) ScopeCached(scope Scope) int { return p.perScope[scope] }

// NewPool returns a pool of n free pages, numbered 0..n-1, all at epoch 0.
func NewPool(n int) *Pool {
	p := &Pool{pages: make([]page, n), free: make([]uint32, n), index: map[cacheKey]uint32{}, head: noPage, tail: noPage, perScope: map[Scope]int{}}
	for i := range p.free {
		p.free[i] = uint32(n - 1 - i) // page 0 is handed out first
	}
	return p
}

// Len is the number of pages in the pool.
func (p *Pool) Len() int { return len(p.pages) }

// Free is the number of free pages.
func (p *Pool) Free() int { return len(p.free) }

// Cached is the number of cached pages, pinned or not.
func (p *Pool) Cached() int { return p.cached }

// Pinned is the number of cached pages some request reads as its prefix.
func (p *Pool) Pinned() int { return p.pinned }

// Evictions is the number of cached pages evicted so far.
func (p *Pool) Evictions() uint64 { return p.evictions }

// Purged is the number of cached pages taken out of the cache because
// their writer failed (PurgeWriter), evicted at once or at their last unpin.
func (p *Pool) Purged() uint64 { return p.purged }

// evictable is how many cached pages Allocate may evict: the unpinned ones
// (doomed pages are pinned, and in no list eviction walks).
func (p *Pool) evictable() int {
	if p.evictPinned {
		return p.cached - p.doomed
	}
	return p.cached - p.pinned
}

// Allocate gives owner n pages, advancing each one's epoch. When the free
// list is short it evicts the least recently used unpinned cached pages
// first (docs/protocol.md rule 24). It allocates all n or none: with fewer
// free and evictable it returns ErrNoCapacity and changes nothing.
func (p *Pool) Allocate(owner RequestID, n int) ([]PageRef, error) {
	if n <= 0 || n > len(p.free)+p.evictable() {
		if p.cached > 0 {
			return nil, fmt.Errorf("%w: %d wanted, %d free and %d evictable of %d", ErrNoCapacity, n, len(p.free), p.evictable(), len(p.pages))
		}
		return nil, fmt.Errorf("%w: %d wanted, %d free of %d", ErrNoCapacity, n, len(p.free), len(p.pages))
	}
	for len(p.free) < n {
		p.evict()
	}
	refs := make([]PageRef, n)
	for i := range refs {
		id := p.free[len(p.free)-1]
		p.free = p.free[:len(p.free)-1]
		pg := &p.pages[id]
		e := pg.epoch.Add(1)
		pg.state, pg.owner = pageOwned, owner
		refs[i] = PageRef{Page: id, Epoch: e}
	}
	return refs, nil
}

// evict frees the least recently used evictable cached page. The caller
// has made sure there is one. Pin and TouchChain keep every cached page
// more recent than the cached pages further down its chain, and a pin
// holds a page's whole path from the root, so the least recently used
// unpinned page is a leaf: eviction never takes a chain's root and leaves
// its later pages cached but unreachable (LookupPrefix needs a run from
// page 0).
func (p *Pool) evict() {
	id := p.tail
	for p.pages[id].pins > 0 && !p.evictPinned {
		id = p.pages[id].prev
	}
	p.evictions++
	p.drop(id)
}

// drop frees a listed cached page: out of the LRU list and the index, back
// to the free list.
func (p *Pool) drop(id uint32) {
	pg := &p.pages[id]
	if pg.pins > 0 { // evict-pinned: the readers' pins are dropped with the page
		p.pinned--
		pg.pins = 0
	}
	p.unlink(id)
	delete(p.index, p.keyOf(pg.key))
	p.uncount(pg.key.scope)
	p.cached--
	pg.state, pg.key, pg.writer = pageFree, cacheKey{}, noWriter
	p.freed(0, id)
}

// uncount takes a page out of its scope's count of cached pages.
func (p *Pool) uncount(scope Scope) {
	if p.perScope[scope]--; p.perScope[scope] <= 0 {
		delete(p.perScope, scope)
	}
}

// evictInScope frees scope's least recently used unpinned cached page (a
// chain's leaf, as evict's), for owner's insertion at the scope's cap: not
// one owner cached (the pages of the very chain it is inserting, which
// would leave the rest unreachable); false if there is none.
func (p *Pool) evictInScope(scope Scope, owner RequestID) bool {
	for id := p.tail; id != noPage; id = p.pages[id].prev {
		if pg := &p.pages[id]; pg.key.scope == scope && pg.pins == 0 && pg.insertedBy != owner {
			p.evictions++
			p.drop(id)
			return true
		}
	}
	return false
}

// PurgeWriter takes every cached page writer filled out of the cache, for
// a writer found failed or misbehaving (docs/security.md): an unpinned
// page is freed at once, a pinned one leaves the index and the LRU list at
// once (no request hits it any more) and is freed at its last Unpin, so
// the requests reading it now keep reading what they verified. It returns
// how many pages it freed and how many it doomed.
func (p *Pool) PurgeWriter(writer PeerID) (freed, doomed int) {
	if writer == noWriter {
		return 0, 0
	}
	for id := range p.pages {
		pg := &p.pages[id]
		if pg.state != pageCached || pg.doomed || pg.writer != writer {
			continue
		}
		p.purged++
		if pg.pins == 0 {
			p.drop(uint32(id))
			freed++
			continue
		}
		p.unlink(uint32(id))
		delete(p.index, p.keyOf(pg.key))
		p.uncount(pg.key.scope)
		pg.doomed = true
		p.doomed++
		doomed++
	}
	return freed, doomed
}

// keyOf is the index key of k: under scope-dropped, the chain hash alone.
func (p *Pool) keyOf(k cacheKey) cacheKey {
	if p.scopeDropped {
		k.scope = 0
	}
	return k
}

// unlink takes a cached page out of the LRU list.
func (p *Pool) unlink(id uint32) {
	pg := &p.pages[id]
	if pg.prev != noPage {
		p.pages[pg.prev].next = pg.next
	} else {
		p.head = pg.next
	}
	if pg.next != noPage {
		p.pages[pg.next].prev = pg.prev
	} else {
		p.tail = pg.prev
	}
	pg.prev, pg.next = noPage, noPage
}

// touch makes a cached page the most recently used.
func (p *Pool) touch(id uint32) {
	if p.head == id {
		return
	}
	p.unlink(id)
	p.pushFront(id)
}

func (p *Pool) pushFront(id uint32) {
	pg := &p.pages[id]
	pg.prev, pg.next = noPage, p.head
	if p.head != noPage {
		p.pages[p.head].prev = id
	} else {
		p.tail = id
	}
	p.head = id
}

// LookupPrefix is the length of the longest run chain[0..k) whose pages are
// all cached under scope (docs/protocol.md rule 21). It changes nothing;
// Pin takes them. Scope 0 never hits.
func (p *Pool) LookupPrefix(scope Scope, chain []ChainHash) int {
	if scope == 0 {
		return 0
	}
	k := 0
	for k < len(chain) {
		if _, ok := p.index[p.keyOf(cacheKey{scope, chain[k]})]; !ok {
			break
		}
		k++
	}
	return k
}

// Pin pins the cached pages of chain[0..k) under scope (LookupPrefix's k or
// less) for owner, the request that reads them as its prefix, and returns
// them in order, each at its current epoch: until Unpin they are never
// evicted. It pins all or none: if a page of the run is not cached it
// returns nil.
func (p *Pool) Pin(owner RequestID, scope Scope, chain []ChainHash) []PageRef {
	if p.LookupPrefix(scope, chain) < len(chain) || len(chain) == 0 {
		return nil
	}
	refs := make([]PageRef, len(chain))
	// Deepest first, so that the root ends the most recently used: a
	// chain's pages are evicted leaf first (see evict).
	for i := len(chain) - 1; i >= 0; i-- {
		id := p.index[p.keyOf(cacheKey{scope, chain[i]})]
		pg := &p.pages[id]
		if pg.pins == 0 {
			p.pinned++
		}
		pg.pins++
		p.touch(id)
		refs[i] = PageRef{Page: id, Epoch: pg.epoch.Load()}
	}
	for _, ref := range refs {
		p.record(owner, ref.Page, PagePinned)
	}
	return refs
}

// anyPurged reports whether a page of refs is a purged cached page
// (PurgeWriter): pages written past it would hang from a prefix no request
// can hit.
func (p *Pool) anyPurged(refs []PageRef) bool {
	for _, ref := range refs {
		if int(ref.Page) < len(p.pages) && p.pages[ref.Page].doomed {
			return true
		}
	}
	return false
}

// TouchChain makes the cached pages of chain under scope the most recently
// used, deepest first, so that each page is more recent than every cached
// page further down its chain. Finish calls it over a request's whole
// prompt after inserting its pages: inserted one by one, the deepest would
// otherwise be more recent than the root it hangs from.
func (p *Pool) TouchChain(scope Scope, chain []ChainHash) {
	if scope == 0 {
		return
	}
	for i := len(chain) - 1; i >= 0; i-- {
		if id, ok := p.index[p.keyOf(cacheKey{scope, chain[i]})]; ok {
			p.touch(id)
		}
	}
}

// Unpin drops owner's pin from each of refs' pages that is still cached at
// its epoch under scope and pinned; a page evicted since (under
// evict-pinned) is left alone. It returns how many pins it dropped.
func (p *Pool) Unpin(owner RequestID, scope Scope, refs []PageRef) int {
	n := 0
	for _, ref := range refs {
		if !p.sharedAt(scope, ref) || p.pages[ref.Page].pins == 0 {
			continue
		}
		pg := &p.pages[ref.Page]
		p.record(owner, ref.Page, PageUnpinned)
		pg.pins--
		if pg.pins == 0 {
			p.pinned--
			if pg.doomed { // its writer failed: freed now its last reader is done
				pg.doomed = false
				p.doomed--
				p.cached--
				pg.state, pg.key, pg.writer = pageFree, cacheKey{}, noWriter
				p.freed(0, ref.Page)
			}
		}
		n++
	}
	return n
}

// Insert makes owner's page ref a cached page under (scope, hash): unpinned,
// the most recently used, at the same epoch, so the PageRef the request
// verified names it still. Only an owned page (not quarantined) of a
// request with a scope is inserted, and only if the key is not cached yet;
// otherwise it returns false and the page stays owner's to release.
func (p *Pool) Insert(owner RequestID, ref PageRef, scope Scope, hash ChainHash) bool {
	return p.InsertFrom(owner, ref, scope, hash, noWriter)
}

// InsertFrom is Insert recording writer, the peer whose WRITE filled the
// page, for PurgeWriter.
func (p *Pool) InsertFrom(owner RequestID, ref PageRef, scope Scope, hash ChainHash, writer PeerID) bool {
	key := cacheKey{scope, hash}
	if scope == 0 || !p.holds(owner, ref) || p.pages[ref.Page].state != pageOwned {
		return false
	}
	if _, dup := p.index[p.keyOf(key)]; dup {
		return false
	}
	if p.scopeCap > 0 && p.perScope[scope] >= p.scopeCap && !p.evictInScope(scope, owner) {
		return false
	}
	pg := &p.pages[ref.Page]
	pg.state, pg.owner, pg.key, pg.pins, pg.writer, pg.insertedBy = pageCached, 0, key, 0, writer, owner
	p.index[p.keyOf(key)] = ref.Page
	p.pushFront(ref.Page)
	p.cached++
	p.perScope[scope]++
	p.record(owner, ref.Page, PageCached)
	return true
}

// sharedAt reports whether ref's page is cached at ref's epoch under scope
// (under scope-dropped, under any scope).
func (p *Pool) sharedAt(scope Scope, ref PageRef) bool {
	if int(ref.Page) >= len(p.pages) {
		return false
	}
	pg := &p.pages[ref.Page]
	return pg.state == pageCached && pg.epoch.Load() == ref.Epoch && (pg.key.scope == scope || p.scopeDropped)
}

// CheckShared is the read-time check of a shared prefix page
// (docs/protocol.md rule 23): a request of scope may read ref's page only
// while it is cached at the epoch it was pinned at, under that scope, and
// pinned.
func (p *Pool) CheckShared(scope Scope, ref PageRef) error {
	if !p.sharedAt(scope, ref) || p.pages[ref.Page].pins == 0 {
		return fmt.Errorf("%w: page %d at epoch %d, scope %#x", ErrNotShared, ref.Page, ref.Epoch, uint64(scope))
	}
	return nil
}

// holds reports whether owner still holds ref's page at ref's epoch (owned
// or quarantined; a cached page is no request's).
func (p *Pool) holds(owner RequestID, ref PageRef) bool {
	if int(ref.Page) >= len(p.pages) {
		return false
	}
	pg := &p.pages[ref.Page]
	return (pg.state == pageOwned || pg.state == pageQuarantined) && pg.owner == owner && pg.epoch.Load() == ref.Epoch
}

// Quarantine keeps owner's pages out of circulation until Release: the
// request ended while its writer may still write. Pages owner no longer holds
// at those epochs are left alone. It returns how many pages it quarantined.
func (p *Pool) Quarantine(owner RequestID, refs []PageRef) int {
	n := 0
	for _, ref := range refs {
		if p.holds(owner, ref) && p.pages[ref.Page].state == pageOwned {
			p.pages[ref.Page].state = pageQuarantined
			n++
		}
	}
	return n
}

// Release returns owner's pages to the pool. It frees only pages owner still
// holds at the granted epochs, so it is idempotent: a second release, or a
// release that comes after a page was freed and reallocated, frees nothing. It
// returns how many pages it freed.
func (p *Pool) Release(owner RequestID, refs []PageRef) int {
	n := 0
	for _, ref := range refs {
		if p.holds(owner, ref) || p.doubleFree && int(ref.Page) < len(p.pages) && (p.pages[ref.Page].state == pageOwned || p.pages[ref.Page].state == pageQuarantined) {
			p.pages[ref.Page].state = pageFree
			p.freed(owner, ref.Page)
			n++
		}
	}
	return n
}

// Check is the read-time check (docs/protocol.md rule 8): owner may read ref's page
// only while it still owns it at the epoch it was granted. Quarantined pages
// are not readable either.
func (p *Pool) Check(owner RequestID, ref PageRef) error {
	if !p.holds(owner, ref) || p.pages[ref.Page].state != pageOwned {
		return fmt.Errorf("%w: page %d at epoch %d, request %d", ErrFenced, ref.Page, ref.Epoch, owner)
	}
	return nil
}

// Owner says who holds page: the owning request and whether the page is
// quarantined, or free. A cached page is held by no request: owner 0, not
// free. For audits and tests; the protocol itself asks Holds.
func (p *Pool) Owner(page uint32) (owner RequestID, quarantined, free bool) {
	pg := &p.pages[page]
	return pg.owner, pg.state == pageQuarantined, pg.state == pageFree
}

// Shared says whether page is cached, under which scope, and how many
// requests have it pinned. For audits and tests.
func (p *Pool) Shared(page uint32) (scope Scope, pins int, cached bool) {
	pg := &p.pages[page]
	if pg.state != pageCached {
		return 0, 0, false
	}
	return pg.key.scope, int(pg.pins), true
}

// CacheEntry is what a cached page is kept under, for audits and the
// refinement mapping (package model): its key, its pins, and whether it
// was purged (its writer failed while it was pinned: out of the index,
// freed at its last unpin).
type CacheEntry struct {
	Scope  Scope
	Hash   ChainHash
	Pins   int
	Purged bool
}

// Entry says what page is cached under, if it is cached.
func (p *Pool) Entry(page uint32) (CacheEntry, bool) {
	pg := &p.pages[page]
	if pg.state != pageCached {
		return CacheEntry{}, false
	}
	return CacheEntry{Scope: pg.key.scope, Hash: pg.key.hash, Pins: int(pg.pins), Purged: pg.doomed}, true
}

// LRUOrder is the cached pages eviction may consider, least recently used
// first (purged pages are in no order). For audits and the refinement mapping.
func (p *Pool) LRUOrder() []uint32 {
	var out []uint32
	for id := p.tail; id != noPage; id = p.pages[id].prev {
		out = append(out, id)
	}
	return out
}

// Epoch is a page's current epoch.
func (p *Pool) Epoch(page uint32) uint64 { return p.pages[page].epoch.Load() }

// EpochView reads a pool's current epochs, and nothing else. Unlike the
// Pool, it is safe for concurrent use, also while the pool's owner changes
// the pool: a decoder holds one to check, at every read of a page, that the
// page is still at the epoch it was granted, without taking the lock its
// endpoint guards the pool with.
type EpochView struct{ p *Pool }

// View is p's EpochView.
func (p *Pool) View() EpochView { return EpochView{p} }

// Len is the number of pages in the pool.
func (v EpochView) Len() int { return len(v.p.pages) }

// Epoch is page's current epoch; a page outside the pool has none
// (math.MaxUint64, which no PageRef carries).
func (v EpochView) Epoch(page uint32) uint64 {
	if int(page) >= len(v.p.pages) {
		return ^uint64(0)
	}
	return v.p.pages[page].epoch.Load()
}

// Quarantined is the number of quarantined pages.
func (p *Pool) Quarantined() int {
	n := 0
	for i := range p.pages {
		if p.pages[i].state == pageQuarantined {
			n++
		}
	}
	return n
}

// Holds reports whether owner holds ref's page at ref's epoch (owned or
// quarantined), for audits: Conservation says every live request holds every
// page it was granted.
func (p *Pool) Holds(owner RequestID, ref PageRef) bool { return p.holds(owner, ref) }

// Audit checks the pool's own bookkeeping: every page in the free list is free
// and listed once, and every free page is listed; every cached page is in
// the LRU list once and in the index under its key, the index names only
// cached pages, and the cached and pinned counts are right.
func (p *Pool) Audit() error {
	listed := make([]bool, len(p.pages))
	for _, id := range p.free {
		if listed[id] || p.pages[id].state != pageFree {
			return fmt.Errorf("protocol: pool: page %d listed free twice or while held", id)
		}
		listed[id] = true
	}
	cached, pinned, doomed := 0, 0, 0
	perScope := map[Scope]int{}
	for id := range p.pages {
		pg := &p.pages[id]
		if pg.state == pageCached && !pg.doomed {
			perScope[pg.key.scope]++
		}
		switch pg.state {
		case pageFree:
			if !listed[id] {
				return fmt.Errorf("protocol: pool: free page %d is not in the free list", id)
			}
		case pageCached:
			cached++
			if pg.pins > 0 {
				pinned++
			}
			if pg.doomed {
				doomed++
				if pg.pins == 0 {
					return fmt.Errorf("protocol: pool: page %d, purged, is unpinned but not freed", id)
				}
				if at, ok := p.index[p.keyOf(pg.key)]; ok && at == uint32(id) {
					return fmt.Errorf("protocol: pool: page %d, purged, is still indexed", id)
				}
			} else if at, ok := p.index[p.keyOf(pg.key)]; !ok || at != uint32(id) {
				return fmt.Errorf("protocol: pool: cached page %d is not indexed under its key", id)
			}
		}
		if pg.state != pageCached && pg.pins != 0 {
			return fmt.Errorf("protocol: pool: page %d is pinned but not cached", id)
		}
	}
	inList, prev := 0, noPage
	for id := p.head; id != noPage; id = p.pages[id].next {
		if inList++; inList > cached || p.pages[id].doomed || p.pages[id].state != pageCached || p.pages[id].prev != prev {
			return fmt.Errorf("protocol: pool: the LRU list is broken at page %d", id)
		}
		prev = id
	}
	switch {
	case prev != p.tail:
		return fmt.Errorf("protocol: pool: the LRU list ends at page %d, its tail is %d", prev, p.tail)
	case inList != cached-doomed || len(p.index) != cached-doomed || p.cached != cached || p.doomed != doomed:
		return fmt.Errorf("protocol: pool: %d cached pages (%d purged, %d counted), %d in the LRU list, %d indexed, %d counted", cached, doomed, p.doomed, inList, len(p.index), p.cached)
	case p.pinned != pinned:
		return fmt.Errorf("protocol: pool: %d pinned pages, %d counted", pinned, p.pinned)
	case len(perScope) != len(p.perScope):
		return fmt.Errorf("protocol: pool: %d scopes hold cached pages, %d counted", len(perScope), len(p.perScope))
	}
	for scope, n := range perScope {
		if p.perScope[scope] != n {
			return fmt.Errorf("protocol: pool: scope %#x holds %d cached pages, %d counted", uint64(scope), n, p.perScope[scope])
		}
	}
	return nil
}
