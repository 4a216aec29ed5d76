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
func (g Geometry) PagesFor(tokens int) int { return (tokens + g.PageTokens - 1) / g.PageTokens }

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

// Cache is a pool of KV pages in one region, with the protocol.Pool that owns
// their epochs.
type Cache struct {
	geom   Geometry
	region []byte
	pool   *protocol.Pool
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
	if len(region) < pool.Len()*g.Stride() {
		return nil, fmt.Errorf("%w: region of %d bytes holds fewer than %d pages of %d bytes", ErrGeometry, len(region), pool.Len(), g.Stride())
	}
	if uintptr(unsafe.Pointer(unsafe.SliceData(region)))%4 != 0 {
		return nil, fmt.Errorf("%w: region is not 4-byte aligned", ErrGeometry)
	}
	return &Cache{geom: g, region: region[:pool.Len()*g.Stride()], pool: pool}, nil
}

// Geometry is the cache's page geometry.
func (c *Cache) Geometry() Geometry { return c.geom }

// Pool is the pool that owns the pages' epochs.
func (c *Cache) Pool() *protocol.Pool { return c.pool }

// Pages is the number of pages.
func (c *Cache) Pages() int { return c.pool.Len() }

// Region is the whole pool region: pages and tag records.
func (c *Cache) Region() []byte { return c.region }

// Payload is page's KV bytes (protocol.PageMemory).
func (c *Cache) Payload(page uint32) []byte {
	o := int(page) * c.geom.Stride()
	return c.region[o : o+c.geom.PageBytes() : o+c.geom.PageBytes()]
}

// TagRecord is page's tag record slot (protocol.PageMemory).
func (c *Cache) TagRecord(page uint32) []byte {
	o := int(page)*c.geom.Stride() + c.geom.PageBytes()
	return c.region[o : o+protocol.TagSize : o+protocol.TagSize]
}

// Page is page's KV bytes (protocol.SourceMemory, for a prefill node).
func (c *Cache) Page(page uint32) []byte { return c.Payload(page) }

// Floats is page's KV as float32 values, aliasing the region.
func (c *Cache) Floats(page uint32) []float32 {
	b := c.Payload(page)
	return unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(b))), len(b)/4)
}

// Epochs is the pool's current epoch of every page in table, in table order,
// appended to dst: what a backend mirrors before a step.
func (c *Cache) Epochs(dst []uint64, table Table) []uint64 {
	for _, ref := range table {
		dst = append(dst, c.pool.Epoch(ref.Page))
	}
	return dst
}

// Check is the read-time check of one table entry against the pool.
func (c *Cache) Check(table Table, index int) error {
	ref := table[index]
	if cur := c.pool.Epoch(ref.Page); cur != ref.Epoch {
		return &TagError{Index: index, Page: ref.Page, Held: ref.Epoch, Current: cur}
	}
	return nil
}

// ValidTable checks that every page of table is in the pool, so a backend can
// index without bounds failures.
func (c *Cache) ValidTable(table Table) error {
	for i, ref := range table {
		if int(ref.Page) >= c.pool.Len() {
			return fmt.Errorf("%w: table entry %d names page %d of a pool of %d", ErrGeometry, i, ref.Page, c.pool.Len())
		}
	}
	return nil
}
