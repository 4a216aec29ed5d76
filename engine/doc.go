// Package engine is kvhandoff's bundled inference engine: a small transformer
// (package llama) computed by a backend (package backend: cpu, or cuda with
// the build tag) over a paged KV cache (package kv) whose pages are the ones
// the handoff moves.
//
// The packages, importing downward only:
//
//	engine          requests: prefill, decode, generation, the tag check's switch
//	engine/backend  what a backend computes: Backend, Step
//	engine/cpu      the CPU backend, AVX2+FMA kernels or pure Go, parallel over heads and rows
//	engine/cuda     the CUDA backend (build tag cuda; the only importer of gorgonia.org/cu)
//	engine/llama    architecture, weights, llama2.c checkpoints and tokenizers, the built-in model, sampling
//	engine/kv       page geometry, the pool region, page tables, the read-time check
//
// A request's life on one node:
//
//	m, _ := llama.Builtin(seed)                      // or llama.ReadCheckpoint(f)
//	b := cpu.New()
//	cache, _ := kv.New(engine.GeometryOf(m.Config, pageTokens), pages)
//	e, _ := engine.New(m, b, cache, engine.Options{})
//	refs, _ := cache.Pool().Allocate(id, cache.Geometry().PagesFor(len(prompt)+n))
//	out, err := e.Generate(kv.Table(refs), prompt, n, sampler)
//	cache.Pool().Release(id, refs)
//
// and split over the handoff (package transfer), with no copy of the KV on
// the CPU path:
//
//	// prefill node: the engine computes into the endpoint's source pages
//	src := engine.NewSource()
//	p, _ := transfer.NewPrefill(dev, transfer.PrefillConfig{..., PageBytes: g.PageBytes(), KV: src})
//	cache, _ := kv.OverPages(g, p.Pages(), kv.Unversioned)
//	e, _ := engine.New(m, cpu.New(), cache, engine.Options{}); src.Use(e)
//	src.Expect(id, prompt); p.Submit(id, "decode-1", len(prompt)) // FillKV runs e.Prefill
//	// with PrefillConfig.ChunkPages, FillKVChunks instead: a step per chunk of
//	// pages, each chunk's pages sent while the next is computed, and a cancel
//	// stops the prefill at the chunk's end (Source.Stats counts the chunks)
//
//	// decode node: the engine reads the pages the WRITEs placed, checked
//	// against the endpoint's epochs, and appends its own tokens in pages
//	// of its own past the grant
//	dp, _ := kv.NewDecodePool(g, d, ownPages)
//	e, _ := engine.New(m, cpu.New(), dp.Cache(), engine.Options{})
//	refs, _ := d.Acquire(id)                           // after Verified: pages and granted epochs
//	table, _ := dp.Table(id, refs, len(prompt)+n)      // granted pages, then own ones
//	e.Arrived(table[:len(refs)])                       // a device backend copies them in
//	out, err := e.Decode(table, prompt, n, sampler, stop)
//	dp.Release(id, table)
//	d.Finish(id)
//
// Decode recomputes the last prompt position (its KV is identical) to get
// that position's logits, then appends its own tokens' KV to the table's
// pages.
//
// With a decode node's prefix cache, a table's first pages may be a cached
// prefix that other requests wrote, shared read-only: DecodeShared reads
// them through the same table and epoch check and refuses any write into
// them (ErrSharedWrite); PrefillFrom computes a prompt's positions past a
// prefix whose KV its table already holds (docs/engine.md, "Shared prefix
// pages").
//
// Every step checks every page it reads or writes against the pool's current
// epoch (package kv); a mismatch fails the request with a *kv.TagError naming
// the page (errors.Is(err, protocol.ErrTagMismatch)). Options.Research with
// no-tag-check turns the check off; only code inside this module can set it.
//
// An Engine is used by one goroutine at a time, serialized with the pool's
// allocations.
package engine
