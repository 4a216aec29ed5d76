package kv

import (
	"errors"
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
	if len(table) != 4 || table[0] != granted[0] || table[2].Page < 6 || table[3].Page < 6 || d.Own().Free() != 1 {
		t.Fatalf("table %v, own free %d", table, d.Own().Free())
	}
	for i := range table {
		if err := d.Cache().Check(table, i); err != nil {
			t.Fatalf("entry %d: %v", i, err)
		}
	}
	if _, err := d.Table(8, acquired[:1], 4*geom.PageTokens); !errors.Is(err, protocol.ErrNoCapacity) || d.Own().Free() != 1 {
		t.Fatalf("past the own pages: %v, %d free", err, d.Own().Free())
	}
	if _, err := d.Table(8, [][]byte{d.Cache().Payload(7)}, 1); !errors.Is(err, ErrGeometry) {
		t.Fatalf("an own page passed off as acquired: %v", err)
	}
	ep.pool.Release(7, granted[1:])
	ep.pool.Allocate(9, 1)
	if err := d.Cache().Check(table, 1); !errors.Is(err, protocol.ErrTagMismatch) {
		t.Fatalf("granted page reallocated by the endpoint: %v", err)
	}
	if n := d.Release(7, table); n != 2 || d.Own().Free() != 3 {
		t.Fatalf("released %d, %d free", n, d.Own().Free())
	}
}
