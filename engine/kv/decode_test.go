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

func (e *endpoint) Pages() [][]byte            { return e.pages }
func (e *endpoint) Epochs() protocol.EpochView { return e.pool.View() }

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
	acquired := granted
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
	if _, err := d.Table(8, []protocol.PageRef{{Page: 7, Epoch: 1}}, 1); !errors.Is(err, ErrGeometry) {
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

// lockedEndpoint is an endpoint whose pool its owner changes under a lock,
// as transfer.Decode's Receiver does, while the cache reads its epochs
// through the pool's EpochView, without that lock.
type lockedEndpoint struct {
	endpoint
	mu sync.Mutex
}

// Requests on several goroutines take and return own pages and read epochs
// at once (run with -race): every live table is checked clean, and every own
// page comes back; a stale reader checking pages it gave back, while others
// reallocate them, reads their epochs safely; and so does a reader of
// endpoint pages that the endpoint's owner reallocates, under its own lock,
// meanwhile.
func TestDecodePoolIsSafeForConcurrentUse(t *testing.T) {
	c, _ := New(geom, 12)
	ep := &lockedEndpoint{endpoint: endpoint{pool: c.Pool()}}
	for p := range 12 {
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
	ep.mu.Lock()
	churned, err := ep.pool.Allocate(98, 2) // pages the owner keeps reallocating below
	ep.pool.Release(98, churned)
	ep.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	wg.Add(2)
	go func() {
		defer wg.Done()
		for range 2000 {
			ep.mu.Lock()
			refs, err := ep.pool.Allocate(98, 2)
			if err == nil {
				ep.pool.Release(98, refs)
			}
			ep.mu.Unlock()
			for i := range churned {
				d.Cache().Check(Table(churned), i) // fails once reallocated, never races
			}
		}
	}()
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
			acquired := granted
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
