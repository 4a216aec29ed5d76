package kv

import (
	"fmt"
	"sync"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// Endpoint is a decode node's transport endpoint as the cache sees it: its
// pages, which the WRITEs fill, and a view of their current epochs that
// takes none of the endpoint's locks (transfer.Decode).
type Endpoint interface {
	Pages() [][]byte
	Epochs() protocol.EpochView
}

// DecodePool is a decode node's KV: the endpoint's pages, then pages of the
// node's own for the tokens it generates. The protocol grants a request
// pages for its prompt only; decode appends its own tokens' KV after the
// prompt, past the grant once the last granted page is full.
//
// It is safe for concurrent use (the endpoint's epochs are read atomically;
// the own pool is locked here), so several engines, each with its own backend, can
// decode different requests over one DecodePool at once.
type DecodePool struct {
	cache *Cache
	mu    sync.Mutex
	own   *protocol.Pool
	at    uint32
}

// ownEpochs reads the own pool's epochs under the lock.
type ownEpochs struct{ d *DecodePool }

func (o ownEpochs) Epoch(page uint32) uint64 {
	o.d.mu.Lock()
	defer o.d.mu.Unlock()
	if int(page) >= o.d.own.Len() {
		return ^uint64(0)
	}
	return o.d.own.Epoch(page)
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
	d := &DecodePool{own: protocol.NewPool(own), at: uint32(len(pages))}
	if d.cache, err = OverPages(g, all, Split{At: d.at, Low: ep.Epochs(), High: ownEpochs{d}}); err != nil {
		return nil, err
	}
	return d, nil
}

// Cache is the cache over both sets of pages, for the engine.
func (d *DecodePool) Cache() *Cache { return d.cache }

// OwnFree is how many of the node's own pages are free.
func (d *DecodePool) OwnFree() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.own.Free()
}

// Table is request id's table for positions positions: the pages the
// endpoint acquired for it, at the epochs they were granted (every read
// checks the page is still at it), then as many of the node's own pages as
// the positions past them need (allocated to id; give them back with
// Release). Without enough own pages free it fails with
// protocol.ErrNoCapacity and allocates nothing.
func (d *DecodePool) Table(id protocol.RequestID, acquired []protocol.PageRef, positions int) (Table, error) {
	t := append(make(Table, 0, d.cache.geom.PagesFor(positions)), acquired...)
	for _, ref := range t {
		if ref.Page >= d.at {
			return nil, fmt.Errorf("%w: an acquired page is one of the node's own", ErrGeometry)
		}
	}
	if more := d.cache.geom.PagesFor(positions) - len(t); more > 0 {
		d.mu.Lock()
		refs, err := d.own.Allocate(id, more)
		d.mu.Unlock()
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
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.own.Release(id, own)
}
