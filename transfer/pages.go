package transfer

import "github.com/kvhandoff/kvhandoff/protocol"

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

// Epochs reads the decode pool's current epochs, for the engine's read-time
// check of every page it reads against the epoch Acquire granted. It is safe
// for concurrent use and takes no lock of the endpoint's.
func (d *Decode) Epochs() protocol.EpochView { return d.receiver.Pool().View() }

// Payload is decode page's payload (PageBytes; its tag slot follows it in the
// region and is the endpoint's).
func (d *Decode) Payload(page uint32) []byte { return d.payload(page) }
