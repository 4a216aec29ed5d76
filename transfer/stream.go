package transfer

import (
	"errors"
	"fmt"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// ErrStopped: a StreamingKVSource stopped computing a request's KV because
// the request ended meanwhile (cancelled, aborted, its queue pair
// flushed): its computed callback answered false.
var ErrStopped = errors.New("transfer: the request ended while its KV was computed")

// StreamingKVSource computes a request's KV a chunk at a time, so that the
// pages of each chunk move while the next one is computed (docs/protocol.md
// rule 25). A KVSource that implements it streams when
// PrefillConfig.ChunkPages is set.
type StreamingKVSource interface {
	KVSource
	// FillKVChunks is FillKV in chunks of chunkPages pages, in request
	// order: after each chunk it calls computed with the pages now complete
	// in every layer (the first pages of pages, cumulative; the last call
	// says all of them). computed answers false when the request ended
	// meanwhile: the source then stops at once, touches the pages no more
	// (they may already be another request's), and returns an error
	// wrapping ErrStopped. Between two calls of computed the pages are the
	// request's alone, as in FillKV.
	FillKVChunks(id protocol.RequestID, tokens int, pages []uint32, memory [][]byte,
		chunkPages int, computed func(pages int) bool) error
}

// FillKVChunks implements StreamingKVSource.
func (g GeneratedKV) FillKVChunks(id protocol.RequestID, _ int, _ []uint32, memory [][]byte, chunkPages int, computed func(int) bool) error {
	chunkPages = max(chunkPages, 1)
	for lo := 0; lo < len(memory); lo += chunkPages {
		hi := min(lo+chunkPages, len(memory))
		for i := lo; i < hi; i++ {
			GenerateKV(id, i, g.PageTokens, memory[i])
		}
		if !computed(hi) {
			return fmt.Errorf("%w: request %d after %d of %d pages", ErrStopped, id, hi, len(memory))
		}
	}
	return nil
}

// fill computes request id's KV through the source: in chunks, each
// reported to the Sender between them (chunkDone), when the endpoint
// streams and the source can; else in one FillKV.
func (p *Prefill) fill(id protocol.RequestID, st *computing, tokens int, pages []uint32, memory [][]byte) error {
	if s, ok := p.cfg.KV.(StreamingKVSource); ok && p.cfg.ChunkPages > 0 {
		return s.FillKVChunks(id, tokens, pages, memory, p.cfg.ChunkPages, func(n int) bool { return p.chunkDone(id, st, n) })
	}
	err := p.cfg.KV.FillKV(id, tokens, pages, memory)
	if err == nil {
		p.mu.Lock() // the run loop reads it (ended) under the lock
		st.reported = len(pages)
		p.mu.Unlock()
	}
	return err
}

// chunkDone is a chunk's end: the request's pages are not being written
// now, so what was held for it applies, in order, and the Sender learns the
// pages computed; the answer is whether the request is still live.
func (p *Prefill) chunkDone(id protocol.RequestID, st *computing, n int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	st.chunks++
	if n > st.reported {
		st.reported = n
	}
	p.applyHeld(id, st)
	if p.flushHeld[st.peer] {
		// Its queue pair broke: the flush, which fails it, waits for the
		// other requests on it that are inside a chunk; this one stops.
		return false
	}
	p.computed(id, st, n)
	p.carry()
	p.flushAll()
	switch p.sender.Status(id) {
	case protocol.SenderAwaitGrant, protocol.SenderWriting, protocol.SenderDoneSent:
		return true
	}
	return false
}

// applyHeld feeds the Sender what came for a computing request while its
// pages were being written: decode's messages in order, then a cancel.
func (p *Prefill) applyHeld(id protocol.RequestID, st *computing) {
	for _, m := range st.held {
		if err := p.sender.Step(st.peer, m); err != nil {
			p.refused++
		}
	}
	clear(st.held)
	st.held = st.held[:0]
	if st.cancelled {
		st.cancelled = false
		p.sender.Cancel(id)
	}
}

// ended marks a computing request's end as arrived, once: the pages it
// computes from its last reported chunk on are computed after its end
// (Stats.PagesComputedAfterEnd).
func (st *computing) ended() {
	if st.endedAt < 0 {
		st.endedAt = st.reported
	}
}

// account adds a request whose computation returned to the endpoint's
// counters of work done after a request's end.
func (p *Prefill) account(st *computing, total int) {
	p.chunksComputed += uint64(max(st.chunks, 1))
	if st.endedAt < 0 {
		return
	}
	after := uint64(max(total-st.endedAt, 0))
	p.pagesAfterEnd += after
	p.mostPagesAfterEnd = max(p.mostPagesAfterEnd, after)
}
