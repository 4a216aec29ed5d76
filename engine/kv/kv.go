package kv

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// Geometry is the shape of the KV one page holds.
type Geometry struct {
	Layers     int // transformer layers
	KVHeads    int // key/value heads per layer
	HeadDim    int // dimensions per head
	PageTokens int // positions per page
}

// ErrGeometry: a geometry, region or table that does not fit together.
var ErrGeometry = errors.New("kv: geometry mismatch")

// Validate checks that every field is positive and a page stays addressable.
func (g Geometry) Validate() error {
	if g.Layers <= 0 || g.KVHeads <= 0 || g.HeadDim <= 0 || g.PageTokens <= 0 {
		return fmt.Errorf("%w: every field must be positive: %+v", ErrGeometry, g)
	}
	if int64(g.Layers)*2*int64(g.PageTokens)*int64(g.KVHeads)*int64(g.HeadDim)*4 > 1<<31 {
		return fmt.Errorf("%w: a page of %+v exceeds 2 GiB", ErrGeometry, g)
	}
	return nil
}

// KVDim is the width of one position's keys (or values) in one layer.
func (g Geometry) KVDim() int { return g.KVHeads * g.HeadDim }

// PageFloats is the number of float32 values in one page.
func (g Geometry) PageFloats() int { return g.Layers * 2 * g.PageTokens * g.KVDim() }

// PageBytes is the size of a page's payload.
func (g Geometry) PageBytes() int { return 4 * g.PageFloats() }

// Stride is the distance between consecutive pages in a pool region: the
// payload and its tag record.
func (g Geometry) Stride() int { return g.PageBytes() + protocol.TagSize }

// KeyOffset is the float32 index, within a page, of the keys of token (the
// token's index within the page) in layer; ValueOffset likewise for values.
func (g Geometry) KeyOffset(layer, token int) int {
	return (layer*2*g.PageTokens + token) * g.KVDim()
}

// ValueOffset is the float32 index, within a page, of token's values in layer.
func (g Geometry) ValueOffset(layer, token int) int {
	return ((layer*2+1)*g.PageTokens + token) * g.KVDim()
}

// PagesFor is how many pages hold tokens positions.
func (g Geometry) PagesFor(tokens int) int {
	if tokens <= 0 {
		return 0
	}
	return protocol.PagesFor(uint32(tokens), g.PageTokens) // one arithmetic with the wire
}

// Table is a request's page table: the tags it holds, in position order.
// Entry i holds positions [i*PageTokens, (i+1)*PageTokens).
type Table []protocol.PageRef

// TagError is a failed read-time check: the request's tag for the page at
// Index of its table names Epoch Held, but the page is now at epoch Current
// (freed and allocated again since the request was granted it).
type TagError struct {
	Index   int    // the page's index in the request's table
	Page    uint32 // the pool page
	Held    uint64 // the epoch the request holds
	Current uint64 // the page's current epoch
}

func (e *TagError) Error() string {
	return fmt.Sprintf("kv: page %d (index %d of the request's table) is at epoch %d, the request holds epoch %d: %v",
		e.Page, e.Index, e.Current, e.Held, protocol.ErrTagMismatch)
}

// Unwrap makes a TagError match protocol.ErrTagMismatch.
func (e *TagError) Unwrap() error { return protocol.ErrTagMismatch }

// Epochs is where a cache reads each page's current epoch: a protocol.Pool
// it owns, or the protocol.EpochView of a pool a transport endpoint owns.
type Epochs interface {
	Epoch(page uint32) uint64
}

// Cache is a pool of KV pages, with the source of their current epochs.
type Cache struct {
	geom     Geometry
	region   []byte   // the whole region (New, Over); nil for OverPages
	payloads [][]byte // page p's KV bytes
	tags     [][]byte // page p's tag record slot; nil for OverPages
	pool     *protocol.Pool
	epochs   Epochs
}

// New allocates a region of pages pages and a fresh pool for them.
func New(g Geometry, pages int) (*Cache, error) {
	if err := g.Validate(); err != nil {
		return nil, err
	}
	if pages <= 0 {
		return nil, fmt.Errorf("%w: %d pages", ErrGeometry, pages)
	}
	// Backed by uint64s so the float32 views are aligned.
	words := make([]uint64, (pages*g.Stride()+7)/8)
	region := unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), pages*g.Stride())
	return Over(g, region, protocol.NewPool(pages))
}

// Over wraps a region someone else allocated (a registered memory region of
// the transport) and the pool that owns its pages. The region must hold
// pool.Len() pages at g.Stride() and be 4-byte aligned.
func Over(g Geometry, region []byte, pool *protocol.Pool) (*Cache, error) {
	if err := g.Validate(); err != nil {
		return nil, err
	}
	if pool == nil || pool.Len() == 0 {
		return nil, fmt.Errorf("%w: no pool", ErrGeometry)
	}
	n, stride, pb := pool.Len(), g.Stride(), g.PageBytes()
	if len(region) < n*stride {
		return nil, fmt.Errorf("%w: region of %d bytes holds fewer than %d pages of %d bytes", ErrGeometry, len(region), n, stride)
	}
	payloads, tags := make([][]byte, n), make([][]byte, n)
	for p := range payloads {
		o := p * stride
		payloads[p] = region[o : o+pb : o+pb]
		tags[p] = region[o+pb : o+stride : o+stride]
	}
	c, err := overPages(g, payloads, pool)
	if err != nil {
		return nil, err
	}
	c.region, c.tags, c.pool = region[:n*stride], tags, pool
	return c, nil
}

// OverPages wraps pages someone else holds, page p's KV bytes at payloads[p]
// (a transport endpoint's pages, such as transfer.Decode.Pages), with the
// source of their epochs. Each must be PageBytes long and 4-byte aligned. Such
// a cache has no tag record slots: the endpoint verifies its pages itself.
func OverPages(g Geometry, payloads [][]byte, epochs Epochs) (*Cache, error) {
	if err := g.Validate(); err != nil {
		return nil, err
	}
	if epochs == nil {
		return nil, fmt.Errorf("%w: no epochs", ErrGeometry)
	}
	return overPages(g, payloads, epochs)
}

func overPages(g Geometry, payloads [][]byte, epochs Epochs) (*Cache, error) {
	if len(payloads) == 0 {
		return nil, fmt.Errorf("%w: no pages", ErrGeometry)
	}
	c := &Cache{geom: g, payloads: payloads, epochs: epochs}
	seen := make(map[*byte]bool, len(payloads)) // only to refuse a page listed twice
	for p, b := range payloads {
		if len(b) != g.PageBytes() {
			return nil, fmt.Errorf("%w: page %d has %d bytes, the geometry %d", ErrGeometry, p, len(b), g.PageBytes())
		}
		if uintptr(unsafe.Pointer(unsafe.SliceData(b)))%4 != 0 {
			return nil, fmt.Errorf("%w: page %d is not 4-byte aligned", ErrGeometry, p)
		}
		if seen[&b[0]] {
			return nil, fmt.Errorf("%w: page %d is listed twice", ErrGeometry, p)
		}
		seen[&b[0]] = true
	}
	return c, nil
}

// Geometry is the cache's page geometry.
func (c *Cache) Geometry() Geometry { return c.geom }

// Pool is the pool that owns the pages' epochs, or nil for a cache made by
// OverPages (its epochs come from elsewhere).
func (c *Cache) Pool() *protocol.Pool { return c.pool }

// Pages is the number of pages.
func (c *Cache) Pages() int { return len(c.payloads) }

// Region is the whole pool region, pages and tag records, or nil for a cache
// made by OverPages.
func (c *Cache) Region() []byte { return c.region }

// Payload is page's KV bytes (protocol.PageMemory).
func (c *Cache) Payload(page uint32) []byte { return c.payloads[page] }

// TagRecord is page's tag record slot (protocol.PageMemory); nil for a cache
// made by OverPages.
func (c *Cache) TagRecord(page uint32) []byte {
	if c.tags == nil {
		return nil
	}
	return c.tags[page]
}

// Page is page's KV bytes (protocol.SourceMemory, for a prefill node).
func (c *Cache) Page(page uint32) []byte { return c.Payload(page) }

// Floats is page's KV as float32 values, aliasing its bytes.
func (c *Cache) Floats(page uint32) []float32 {
	b := c.payloads[page]
	return unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(b))), len(b)/4)
}

// Epoch is page's current epoch.
func (c *Cache) Epoch(page uint32) uint64 { return c.epochs.Epoch(page) }

// Epochs is the current epoch of every page in table, in table order,
// appended to dst: what a backend mirrors before a step.
func (c *Cache) Epochs(dst []uint64, table Table) []uint64 {
	for _, ref := range table {
		dst = append(dst, c.epochs.Epoch(ref.Page))
	}
	return dst
}

// Check is the read-time check of one table entry against the epochs.
func (c *Cache) Check(table Table, index int) error {
	ref := table[index]
	if cur := c.epochs.Epoch(ref.Page); cur != ref.Epoch {
		return &TagError{Index: index, Page: ref.Page, Held: ref.Epoch, Current: cur}
	}
	return nil
}

// SourceTable is the table of a prefill node's source pages, by their
// numbers in the cache (the transport's Sender hands them out: transfer's
// FillKV), at epoch 0: source pages are Unversioned, a request's alone for
// the whole call that computes them.
func SourceTable(pages []uint32) Table {
	t := make(Table, len(pages))
	for i, p := range pages {
		t[i] = protocol.PageRef{Page: p}
	}
	return t
}

// ValidTable checks that every page of table is in the pool, so a backend can
// index without bounds failures.
func (c *Cache) ValidTable(table Table) error {
	for i, ref := range table {
		if int(ref.Page) >= len(c.payloads) {
			return fmt.Errorf("%w: table entry %d names page %d of a pool of %d", ErrGeometry, i, ref.Page, len(c.payloads))
		}
	}
	return nil
}

type unversioned struct{}

func (unversioned) Epoch(uint32) uint64 { return 0 }

// Unversioned is the epochs of pages that never change hands while a request
// uses them: a prefill node's source pages, which are a request's alone for
// the whole call that computes them (transfer's FillKV). The read-time check
// then always passes; it is the decode node's pages, reallocated between
// requests, that need real epochs.
var Unversioned Epochs = unversioned{}

// Split is the epochs of a cache whose pages are two sets: pages below At
// are Low's (a decode endpoint's, which the transport fills), pages from At
// on are High's, numbered from 0 there (a pool of the decode node's own, for
// the tokens it generates past what the transport granted).
type Split struct {
	At   uint32
	Low  Epochs
	High Epochs
}

// Epoch is page's epoch in whichever set holds it.
func (s Split) Epoch(page uint32) uint64 {
	if page < s.At {
		return s.Low.Epoch(page)
	}
	return s.High.Epoch(page - s.At)
}

// Shift is refs (of High's pool) as pages of a Split cache with the given At.
func Shift(refs []protocol.PageRef, at uint32) Table {
	t := make(Table, len(refs))
	for i, r := range refs {
		t[i] = protocol.PageRef{Page: r.Page + at, Epoch: r.Epoch}
	}
	return t
}
