// Package kv is the engine's paged KV cache: the page geometry, the pool of
// pages as one region, page tables, and the read-time ownership check.
//
// # Geometry
//
// A page holds the keys and values of PageTokens consecutive positions for
// every layer, as float32 in host byte order (little-endian on every machine
// we run on). Within a page the layout is layer-major, keys before values,
// then token, then the kv heads' dimensions:
//
//	page = [layer 0: K[token][kvDim], V[token][kvDim]] [layer 1: K, V] ...
//
// so that one head's keys of one page and layer are PageTokens rows at a fixed
// stride, and the whole page is one contiguous run of PageBytes bytes.
//
// # The pool region
//
// Pages live in one region with a stride of PageBytes+protocol.TagSize: page
// p's payload at p*stride, its tag record right after it. That is the layout
// package transfer gives a decode node's registered region, so one page is
// one contiguous RDMA WRITE followed by the WRITE of its tag record, and the
// bytes the engine computes are the bytes the transport moves (Over wraps a
// region someone else allocated, such as a registered memory region; New
// allocates one). Cache implements protocol.PageMemory (the receiver verifies
// pages in place) and protocol.SourceMemory (the sender checksums them).
//
// A transport endpoint that allocated and registered its own pages hands
// them out by number: OverPages wraps its pages once (transfer's
// Prefill.Pages and Decode.Pages), and a request's table is the page
// references the endpoint gives it, unchanged from the grant to the read:
// the granted pages and epochs a decode endpoint's Acquire returns
// (DecodePool.Table), or the source page numbers a prefill endpoint's
// FillKV names (SourceTable). DecodePool puts a decode node's own pages
// after the endpoint's, for the tokens it generates past what the protocol
// granted.
//
// # Ownership and epochs
//
// Ownership is protocol.Pool's, the one implementation of pages, epochs and
// quarantine: Cache reads epochs from the pool it is given (a fresh one, or
// the protocol.EpochView of the pool an endpoint's Receiver owns) and never
// keeps a second copy of the truth. A request reads its pages through a
// Table of protocol.PageRef, the tags it was granted, carried from the grant,
// never re-read. Every page read checks the page's current epoch against the
// tag
// (docs/protocol.md#rule-index, rule 8); a mismatch is a *TagError naming the page, which
// matches protocol.ErrTagMismatch with errors.Is. The research switch
// no-tag-check turns the check off, so that a demo can show what it prevents.
//
// A Cache never changes after it is made; reading epochs is as safe as its
// Epochs source: a bare protocol.Pool is not safe for concurrent use (the
// caller serializes steps with allocations); an EpochView (atomic reads,
// whatever the pool's owner does meanwhile) and DecodePool are.
package kv
