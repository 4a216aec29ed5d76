package engine

import (
	"fmt"
	"sync"

	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
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
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.e == nil {
		return fmt.Errorf("%w: the KV source has no engine", ErrBadRequest)
	}
	prompt, ok := s.prompts[id]
	if !ok {
		return fmt.Errorf("%w: no prompt for request %d", ErrBadRequest, id)
	}
	delete(s.prompts, id)
	if tokens != len(prompt) {
		return fmt.Errorf("%w: request %d: %d tokens to compute, its prompt has %d", ErrBadRequest, id, tokens, len(prompt))
	}
	table := kv.SourceTable(pages)
	if err := s.e.cache.ValidTable(table); err != nil {
		return err
	}
	if need := s.e.cache.Geometry().PagesFor(len(prompt)); len(table) < need {
		// Only the incident's bug hands fewer source pages than the prompt
		// needs: the sender marked the prompt rejected and swapped in a
		// one-token placeholder (admit-finished), whose KV is computed: the
		// prompt's first token, BOS (every prompt starts with it).
		if !s.e.opts.Research.Has(research.AdmitFinished) {
			return fmt.Errorf("%w: request %d: %d source pages for a prompt of %d tokens (%d pages)", ErrBadRequest, id, len(table), len(prompt), need)
		}
		prompt = prompt[:1]
	}
	if _, err := s.e.Prefill(table, prompt); err != nil {
		return err
	}
	// A device backend computed the KV in its own pool; the WRITEs send the host pages.
	ids := make([]uint32, len(table))
	for i, ref := range table {
		ids[i] = ref.Page
	}
	return s.e.backend.DownloadPages(ids)
}
