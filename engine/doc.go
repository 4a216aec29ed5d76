// Package engine is kvhandoff's bundled inference engine: a small transformer
// (package model) computed by a backend (package backend: cpu, or cuda with
// the build tag) over a paged KV cache (package kv) whose pages are the ones
// the handoff moves.
//
// The packages, importing downward only:
//
//	engine          requests: prefill, decode, generation, the tag check's switch
//	engine/backend  what a backend computes: Backend, Step
//	engine/cpu      the CPU backend, pure Go, parallel over heads and rows
//	engine/cuda     the CUDA backend (build tag cuda; the only importer of gorgonia.org/cu)
//	engine/model    architecture, weights, llama2.c checkpoints and tokenizers, the built-in model, sampling
//	engine/kv       page geometry, the pool region, page tables, the read-time check
//
// A request's life on one node:
//
//	m, _ := model.Builtin(seed)                      // or model.ReadCheckpoint(f)
//	b := cpu.New()
//	cache, _ := kv.New(engine.GeometryOf(m.Config, pageTokens), pages)
//	e, _ := engine.New(m, b, cache, engine.Options{})
//	refs, _ := cache.Pool().Allocate(id, cache.Geometry().PagesFor(len(prompt)+n))
//	out, err := e.Generate(kv.Table(refs), prompt, n, sampler)
//	cache.Pool().Release(id, refs)
//
// and split over the handoff: the prefill node runs e.Prefill(table, prompt),
// which writes the prompt's KV into its source pages, and the transport WRITEs
// those pages with their tag records into pages the decode node granted; after
// verification the decode node runs e.Decode(table, prompt, n, sampler) over
// them. Decode recomputes the last prompt position (its KV is identical) to get
// that position's logits, then appends its own tokens' KV to the table's pages.
//
// Every step checks every page it reads or writes against the pool's current
// epoch (package kv); a mismatch fails the request with a *kv.TagError naming
// the page (errors.Is(err, protocol.ErrTagMismatch)). Options.Research with
// no-tag-check turns the check off; only code inside this module can set it.
//
// An Engine is used by one goroutine at a time, serialized with the pool's
// allocations.
package engine
