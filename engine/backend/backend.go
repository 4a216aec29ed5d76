package backend

import (
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
)

// Backend computes the model's forward pass over a paged KV cache.
type Backend interface {
	// Name is the backend's name: "cpu", "cuda".
	Name() string
	// Load takes the model's weights; called once, before AttachPool. The
	// backend may keep m's arrays (the CPU backend does) or copy them to a
	// device; the caller does not change them afterwards.
	Load(m *llama.Model) error
	// AttachPool gives the backend the KV pool. The geometry must be the
	// model's (layers, kv heads, head size). The host pages (c.Payload(p),
	// c.Floats(p); not necessarily one region) are where pages arrive from
	// and leave to the transport; a device backend keeps its own copy of the
	// pool, c.Pages() pages, in device memory.
	AttachPool(c *kv.Cache) error
	// SetEpochs records the current epochs of pages (same length) in the
	// backend's mirror, which Forward's tag check reads.
	SetEpochs(pages []uint32, epochs []uint64) error
	// Forward runs one step of one request (see Step). It returns a
	// *kv.TagError when a page of the table fails the tag check.
	Forward(s *Step) error
	// UploadPages copies pages from the host region into the backend's pool
	// (a no-op where they are the same memory).
	UploadPages(pages []uint32) error
	// DownloadPages copies pages from the backend's pool into the host region.
	DownloadPages(pages []uint32) error
	// Close frees what the backend holds.
	Close() error
}

// Step is one forward pass of one request over consecutive positions: the
// prompt at prefill, one token at a time at decode.
type Step struct {
	// Tokens are processed at positions Pos, Pos+1, ...; their keys and
	// values are written into the table's pages.
	Tokens []int
	// Pos is the position of Tokens[0]. Positions [0, Pos) already hold
	// KV in the table's pages.
	Pos int
	// Table is the request's pages; it covers positions [0, Pos+len(Tokens)).
	Table kv.Table
	// Unchecked skips the tag check (research switch no-tag-check).
	Unchecked bool
	// Logits receives the logits of the last token (length vocab).
	Logits []float32
}
