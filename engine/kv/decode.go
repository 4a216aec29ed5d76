package kv

import (
	"fmt"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// Endpoint is a decode node's transport endpoint as the cache sees it: its
// pages, which the WRITEs fill, and their current epochs (transfer.Decode).
type Endpoint interface {
	Pages() [][]byte
	Epoch(page uint32) uint64
}

// DecodePool is a decode node's KV: the endpoint's pages, then pages of the
// node's own for the tokens it generates. The protocol grants a request
// pages for its prompt only; decode appends its own tokens' KV after the
// prompt, past the grant once the last granted page is full.
type DecodePool struct {
	cache *Cache
	own   *protocol.Pool
	at    uint32
}

// NewDecodePool is a cache over ep's pages followed by own pages of the
// node's own (allocated here), with Split epochs.
func NewDecodePool(g Geometry, ep Endpoint, own int) (*DecodePool, error) {
	if err := g.Validate(); err != nil {
		return nil, err
	}
	if own < 1 {
		return nil, fmt.Errorf("%w: %d own pages", ErrGeometry, own)
	}
	pages := ep.Pages()
	ownPages, err := New(g, own)
	if err != nil {
		return nil, err
	}
	all := append(pages[:len(pages):len(pages)], ownPages.payloads...)
	pool := protocol.NewPool(own)
	c, err := OverPages(g, all, Split{At: uint32(len(pages)), Low: ep, High: pool})
	if err != nil {
		return nil, err
	}
	return &DecodePool{cache: c, own: pool, at: uint32(len(pages))}, nil
}

// Cache is the cache over both sets of pages, for the engine.
func (d *DecodePool) Cache() *Cache { return d.cache }

// Own is the pool of the node's own pages.
func (d *DecodePool) Own() *protocol.Pool { return d.own }

// Table is request id's table for positions positions: the pages the
// endpoint acquired for it (at their current epochs), then as many of the
// node's own pages as the positions past them need (allocated to id; give
// them back with Release). Without enough own pages free it fails with
// protocol.ErrNoCapacity and allocates nothing.
func (d *DecodePool) Table(id protocol.RequestID, acquired [][]byte, positions int) (Table, error) {
	t, err := d.cache.Lookup(acquired)
	if err != nil {
		return nil, err
	}
	for _, ref := range t {
		if ref.Page >= d.at {
			return nil, fmt.Errorf("%w: an acquired page is one of the node's own", ErrGeometry)
		}
	}
	if more := d.cache.geom.PagesFor(positions) - len(t); more > 0 {
		refs, err := d.own.Allocate(id, more)
		if err != nil {
			return nil, err
		}
		t = append(t, Shift(refs, d.at)...)
	}
	return t, nil
}

// Release gives back the node's own pages of t (the endpoint's pages go back
// through the endpoint's Finish).
func (d *DecodePool) Release(id protocol.RequestID, t Table) int {
	var own []protocol.PageRef
	for _, ref := range t {
		if ref.Page >= d.at {
			own = append(own, protocol.PageRef{Page: ref.Page - d.at, Epoch: ref.Epoch})
		}
	}
	return d.own.Release(id, own)
}
