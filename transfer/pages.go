package transfer

import "math"

// Pages are the source region's pages in page order, PageBytes each: an
// engine's KV cache over them computes, in FillKV, the very bytes the WRITEs
// send (no copy).
func (p *Prefill) Pages() [][]byte {
	out := make([][]byte, p.cfg.Pages)
	for i := range out {
		out[i] = p.page(uint32(i))
	}
	return out
}

// Pages are the decode region's page payloads in page order, PageBytes each
// (the tag slots after them are the endpoint's): an engine's KV cache over
// them decodes from the very bytes the WRITEs placed.
func (d *Decode) Pages() [][]byte {
	out := make([][]byte, d.cfg.Pages)
	for i := range out {
		out[i] = d.payload(uint32(i))
	}
	return out
}

// Epoch is decode page's current epoch, for the engine's read-time check of
// every page it reads (a page outside the pool has none: MaxUint64).
func (d *Decode) Epoch(page uint32) uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	if int(page) >= d.cfg.Pages {
		return math.MaxUint64
	}
	return d.receiver.Pool().Epoch(page)
}
