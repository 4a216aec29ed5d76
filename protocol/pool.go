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

type pageState uint8

const (
	pageFree pageState = iota
	pageOwned
	pageQuarantined
)

type page struct {
	state pageState
	// epoch is written only by the pool's owner (Allocate) and read
	// atomically, so that a decoder checks it at read time through an
	// EpochView without the owner's lock.
	epoch atomic.Uint64
	owner RequestID
}

// Pool is a decode node's page pool (docs/protocol.md rules 11 and 16). Every page is free, owned by
// one request at one epoch, or quarantined for one request until that request's
// writer is fenced. Allocation advances each page's epoch, so a PageRef names
// one tenancy; every operation on a page names the tenancy it means and touches
// nothing else. It is not safe for concurrent use.
type Pool struct {
	pages []page
	free  []uint32 // LIFO: the most recently freed page is reused first
	// doubleFree is the double-free switch: Release frees the named pages
	// whoever holds them now.
	doubleFree bool
}

// NewPool returns a pool of n free pages, numbered 0..n-1, all at epoch 0.
func NewPool(n int) *Pool {
	p := &Pool{pages: make([]page, n), free: make([]uint32, n)}
	for i := range p.free {
		p.free[i] = uint32(n - 1 - i) // page 0 is handed out first
	}
	return p
}

// Len is the number of pages in the pool.
func (p *Pool) Len() int { return len(p.pages) }

// Free is the number of free pages.
func (p *Pool) Free() int { return len(p.free) }

// Allocate gives owner n pages, advancing each one's epoch. It allocates all n
// or none: with fewer free it returns ErrNoCapacity and changes nothing.
func (p *Pool) Allocate(owner RequestID, n int) ([]PageRef, error) {
	if n <= 0 || n > len(p.free) {
		return nil, fmt.Errorf("%w: %d wanted, %d free of %d", ErrNoCapacity, n, len(p.free), len(p.pages))
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

// holds reports whether owner still holds ref's page at ref's epoch.
func (p *Pool) holds(owner RequestID, ref PageRef) bool {
	if int(ref.Page) >= len(p.pages) {
		return false
	}
	pg := &p.pages[ref.Page]
	return pg.state != pageFree && pg.owner == owner && pg.epoch.Load() == ref.Epoch
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
		if p.holds(owner, ref) || p.doubleFree && int(ref.Page) < len(p.pages) && p.pages[ref.Page].state != pageFree {
			p.pages[ref.Page].state = pageFree
			p.free = append(p.free, ref.Page)
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
// quarantined, or free. For audits and tests; the protocol itself asks Holds.
func (p *Pool) Owner(page uint32) (owner RequestID, quarantined, free bool) {
	pg := &p.pages[page]
	return pg.owner, pg.state == pageQuarantined, pg.state == pageFree
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
// and listed once, and every free page is listed.
func (p *Pool) Audit() error {
	listed := make([]bool, len(p.pages))
	for _, id := range p.free {
		if listed[id] || p.pages[id].state != pageFree {
			return fmt.Errorf("protocol: pool: page %d listed free twice or while held", id)
		}
		listed[id] = true
	}
	for id := range p.pages {
		if p.pages[id].state == pageFree && !listed[id] {
			return fmt.Errorf("protocol: pool: free page %d is not in the free list", id)
		}
	}
	return nil
}
