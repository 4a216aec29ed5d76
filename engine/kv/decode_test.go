package kv

import (
	"errors"
	"sync"
	"testing"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// endpoint is a decode endpoint's pages with a pool of their epochs.
type endpoint struct {
	pages [][]byte
	pool  *protocol.Pool
}

func (e *endpoint) Pages() [][]byte          { return e.pages }
func (e *endpoint) Epoch(page uint32) uint64 { return e.pool.Epoch(page) }

// A request's table is its granted pages, then the node's own pages for the
// positions past them; own pages run out with ErrNoCapacity, allocating
// nothing; Release returns only the own pages; epochs of both sets are read
// from their owners, so a granted page reallocated by the endpoint fails the
// check.
func TestDecodePoolExtendsTheGrantWithOwnPages(t *testing.T) {
	c, _ := New(geom, 6)
	ep := &endpoint{pool: c.Pool()}
	for p := range 6 {
		ep.pages = append(ep.pages, c.Payload(uint32(p)))
	}
	d, err := NewDecodePool(geom, ep, 3)
	if err != nil {
		t.Fatal(err)
	}
	granted, _ := ep.pool.Allocate(7, 2)
	acquired := [][]byte{ep.pages[granted[0].Page], ep.pages[granted[1].Page]}
	table, err := d.Table(7, acquired, 4*geom.PageTokens)
	if err != nil {
		t.Fatal(err)
	}
	if len(table) != 4 || table[0] != granted[0] || table[2].Page < 6 || table[3].Page < 6 || d.OwnFree() != 1 {
		t.Fatalf("table %v, own free %d", table, d.OwnFree())
	}
	for i := range table {
		if err := d.Cache().Check(table, i); err != nil {
			t.Fatalf("entry %d: %v", i, err)
		}
	}
	if _, err := d.Table(8, acquired[:1], 4*geom.PageTokens); !errors.Is(err, protocol.ErrNoCapacity) || d.OwnFree() != 1 {
		t.Fatalf("past the own pages: %v, %d free", err, d.OwnFree())
	}
	if _, err := d.Table(8, [][]byte{d.Cache().Payload(7)}, 1); !errors.Is(err, ErrGeometry) {
		t.Fatalf("an own page passed off as acquired: %v", err)
	}
	ep.pool.Release(7, granted[1:])
	ep.pool.Allocate(9, 1)
	if err := d.Cache().Check(table, 1); !errors.Is(err, protocol.ErrTagMismatch) {
		t.Fatalf("granted page reallocated by the endpoint: %v", err)
	}
	if n := d.Release(7, table); n != 2 || d.OwnFree() != 3 {
		t.Fatalf("released %d, %d free", n, d.OwnFree())
	}
}

// lockedEndpoint is an endpoint whose epochs are read under a lock, as
// transfer.Decode's are.
type lockedEndpoint struct {
	endpoint
	mu sync.Mutex
}

func (e *lockedEndpoint) Epoch(page uint32) uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.pool.Epoch(page)
}

// Requests on several goroutines take and return own pages and read epochs
// at once (run with -race): every live table is checked clean, and every own
// page comes back; a stale reader checking pages it gave back, while others
// reallocate them, reads their epochs safely.
func TestDecodePoolIsSafeForConcurrentUse(t *testing.T) {
	c, _ := New(geom, 8)
	ep := &lockedEndpoint{endpoint: endpoint{pool: c.Pool()}}
	for p := range 8 {
		ep.pages = append(ep.pages, c.Payload(uint32(p)))
	}
	d, err := NewDecodePool(geom, ep, 16)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	stale, err := d.Table(99, nil, 3*geom.PageTokens)
	if err != nil {
		t.Fatal(err)
	}
	d.Release(99, stale)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for range 2000 {
			for i := range stale {
				d.Cache().Check(stale, i) // may fail: the pages are others' now
			}
		}
	}()
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := protocol.RequestID(w + 1)
			ep.mu.Lock()
			granted, err := ep.pool.Allocate(id, 2)
			ep.mu.Unlock()
			if err != nil {
				t.Error(err)
				return
			}
			acquired := [][]byte{ep.pages[granted[0].Page], ep.pages[granted[1].Page]}
			for range 200 {
				table, err := d.Table(id, acquired, 6*geom.PageTokens)
				if err != nil {
					t.Error(err)
					return
				}
				for i := range table {
					if err := d.Cache().Check(table, i); err != nil {
						t.Error(err)
						return
					}
				}
				if n := d.Release(id, table); n != 4 {
					t.Errorf("released %d own pages, want 4", n)
					return
				}
			}
		}()
	}
	wg.Wait()
	if d.OwnFree() != 16 {
		t.Fatalf("%d of 16 own pages free", d.OwnFree())
	}
}
