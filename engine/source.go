package engine

import (
	"fmt"
	"sync"

	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// Source computes requests' KV on a prefill node: it is the transport's
// KVSource (transfer.PrefillConfig.KV). Its engine's cache must be over the
// endpoint's source pages (kv.OverPages(g, prefill.Pages(), kv.Unversioned)),
// so the KV is computed straight into the memory the WRITEs send.
//
// The endpoint exists before the engine whose cache is over its pages, so a
// Source is made first (NewSource) and given its engine with Use before the
// node submits anything.
type Source struct {
	mu      sync.Mutex
	e       *Engine
	prompts map[protocol.RequestID][]int
	// chunks and stopped count the computation (Stats).
	chunks, stopped uint64
}

// NewSource is a KV source without an engine yet.
func NewSource() *Source { return &Source{prompts: map[protocol.RequestID][]int{}} }

// Use makes e the source's engine.
func (s *Source) Use(e *Engine) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.e = e
}

// Expect records request id's prompt, before the node submits id.
func (s *Source) Expect(id protocol.RequestID, prompt []int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.prompts[id] = append([]int(nil), prompt...)
}

// Forget drops id's prompt (a request that was never submitted).
func (s *Source) Forget(id protocol.RequestID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.prompts, id)
}

// FillKV computes request id's prompt KV into pages, the request's source
// pages in order, named by their numbers in the engine's cache. The prompt must be the one Expect recorded, tokens long,
// and the pages must hold it; with the engine's Options.Research holding
// admit-finished, fewer pages are the sender's one-token placeholder, and
// the placeholder's KV is what is computed (the 2026 incident).
// Calls for different requests run one at a time: the engine is one
// backend, used by one goroutine at a time.
func (s *Source) FillKV(id protocol.RequestID, tokens int, pages []uint32, _ [][]byte) error {
	return s.FillKVChunks(id, tokens, pages, nil, 0, nil)
}

// FillKVChunks is FillKV in chunks of chunkPages pages (the whole prompt
// when chunkPages is 0): each chunk is one batched prefill step over the
// positions of its pages, attending over the KV of the chunks before it, so
// the KV is the one FillKV computes. After each chunk the pages it
// completed are downloaded from a device backend, and computed (if not nil)
// is told how many of the prompt's pages now hold their KV; when it answers
// false (the request ended) the source stops there, touches the pages no
// more, and returns an error wrapping transfer.ErrStopped. It implements
// transfer.StreamingKVSource.
func (s *Source) FillKVChunks(id protocol.RequestID, tokens int, pages []uint32, _ [][]byte, chunkPages int, computed func(pages int) bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	table, prompt, err := s.prepare(id, tokens, pages)
	if err != nil {
		return err
	}
	g := s.e.cache.Geometry()
	step := len(prompt)
	if chunkPages > 0 {
		step = chunkPages * g.PageTokens
	}
	ids := make([]uint32, 0, len(table))
	for lo := 0; lo < len(prompt); lo += step {
		hi := min(lo+step, len(prompt))
		if _, err := s.e.Step(table, prompt[lo:hi], lo); err != nil {
			return err
		}
		// A device backend computed the KV in its own pool; the WRITEs send the host pages.
		first, done := lo/g.PageTokens, g.PagesFor(hi)
		ids = ids[:0]
		for _, ref := range table[first:done] {
			ids = append(ids, ref.Page)
		}
		if err := s.e.backend.DownloadPages(ids); err != nil {
			return err
		}
		s.chunks++
		if computed != nil && !computed(done) {
			s.stopped++
			return fmt.Errorf("%w: request %d after %d of %d prompt tokens", transfer.ErrStopped, id, hi, len(prompt))
		}
	}
	return nil
}

// prepare takes request id's prompt, checked against tokens and its source
// pages.
func (s *Source) prepare(id protocol.RequestID, tokens int, pages []uint32) (kv.Table, []int, error) {
	if s.e == nil {
		return nil, nil, fmt.Errorf("%w: the KV source has no engine", ErrBadRequest)
	}
	prompt, ok := s.prompts[id]
	if !ok {
		return nil, nil, fmt.Errorf("%w: no prompt for request %d", ErrBadRequest, id)
	}
	delete(s.prompts, id)
	if tokens != len(prompt) {
		return nil, nil, fmt.Errorf("%w: request %d: %d tokens to compute, its prompt has %d", ErrBadRequest, id, tokens, len(prompt))
	}
	table := kv.SourceTable(pages)
	if err := s.e.cache.ValidTable(table); err != nil {
		return nil, nil, err
	}
	if need := s.e.cache.Geometry().PagesFor(len(prompt)); len(table) < need {
		// Only the incident's bug hands fewer source pages than the prompt
		// needs: the sender marked the prompt rejected and swapped in a
		// one-token placeholder (admit-finished), whose KV is computed: the
		// prompt's first token, BOS (every prompt starts with it).
		if !s.e.opts.Research.Has(research.AdmitFinished) {
			return nil, nil, fmt.Errorf("%w: request %d: %d source pages for a prompt of %d tokens (%d pages)", ErrBadRequest, id, len(table), len(prompt), need)
		}
		prompt = prompt[:1]
	}
	return table, prompt, nil
}

// SourceStats are a Source's counters.
type SourceStats struct {
	// Chunks is the prefill steps computed (a request computed whole is one).
	Chunks uint64
	// Stopped is the requests whose computation stopped before their last
	// chunk because the request had ended (transfer.ErrStopped).
	Stopped uint64
}

// Stats returns the source's counters.
func (s *Source) Stats() SourceStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return SourceStats{Chunks: s.chunks, Stopped: s.stopped}
}
