package spec

import "slices"

// Streaming prefill (docs/spec.md#streaming-prefill): the prefill node
// computes a request's KV one page at a time, in order, after its intake
// has taken the source pages and sent the Bootstrap; each computation is the
// action Compute, which writes the page's KV (its Label) into its source
// page. Until then a source page holds whoever's KV was there before (pages
// are never zeroed). The rules:
//
//   - a WRITE of a granted page is posted only once that page is computed
//     (postWrites asks writable), so a request's WRITEs interleave with its
//     computation, and the Grant may arrive before, during or after it;
//   - Done goes once every page is computed and every WRITE posted
//     (doneIfComplete; with prefix reuse the pages under the Grant's prefix
//     are computed and never written);
//   - the computation stops when the leg ends (an Abort, a Cancel, a flush,
//     a refused Grant: freeSrc gives the source pages back at that moment)
//     or its node crashes: a freed, perhaps reused, source page is never
//     later computed for the old request.
//
// The engine computes a chunk of pages at a time and tells the Sender how
// many pages are complete (protocol's ComputedPages); one Compute per page
// is every chunking at once: a chunk of k pages is k Computes in a row, and
// the refinement maps each ComputedPages to that many. A Compute that took
// any number of pages at once would reach the same states through more
// transitions.
//
// write-uncomputed drops the first rule as the implementation's switch does
// (protocol's Sender): once the first page is computed, every granted
// page's WRITE may go, as if one chunk's completion were the prompt's; Done
// still waits for the last page. free-computing drops the last rule.

// computes emits the computation of the next page of each request whose
// prefill node is computing it.
func (g *successors) computes() {
	for r := 0; r < len(g.c.Prompts); r++ {
		if g.m.computable(g.s, r) {
			g.do(Action{Compute, int8(r), 0}, r, 0, 0, 0, func(x *sys, r, _, _, _ int) { x.compute(r) })
		}
	}
}

// computable reports whether request r's prefill node computes r's next page
// in s: a page is left, the node that took r is alive (not crashed, not
// replaced by a new incarnation), and r's leg is computing: from its intake
// until it ends. An aborting leg (waiting for its posted WRITEs) has ended
// as far as the engine is concerned. With free-computing the computation
// of a leg that ended by an abort, a cancel or a flush goes on, into
// source pages the leg has given back.
func (m *Model) computable(s *State, r int) bool {
	q := &s.Req[r]
	snd := &q.S
	if !q.Submitted || snd.Computed >= snd.Pages || s.PrefillCrashed[q.P] || q.PInc != s.Inc[q.P] {
		return false
	}
	switch snd.Phase {
	case SAwaitGrant, SWriting, SSent: // SSent with pages left only under write-uncomputed
		return true
	case SAborting, SAborted, SFailed:
		return m.cfg.Bugs.Has(FreeComputing)
	}
	return false
}

// writable reports whether the sender's next WRITE may be posted as far as
// the computation goes: its page is computed (or, with write-uncomputed,
// any page once the first is: the WRITE reads whatever its source page
// holds).
func (m *Model) writable(snd *Sender) bool {
	return snd.Posted < snd.Computed || m.cfg.Bugs.Has(WriteUncomputed) && snd.Computed > 0
}

// doneIfComplete sends r's Done once every page is computed and every
// WRITE posted. In the correct protocol the last WRITE waits for the last
// page, so Done follows the last PostWrite; under write-uncomputed it may
// follow the last Compute.
func (x *sys) doneIfComplete(r int) {
	if snd := &x.s.Req[r].S; snd.Phase == SWriting && snd.Posted == snd.Pages && snd.Computed == snd.Pages {
		x.sendDone(r)
	}
}

// compute writes the KV of r's next page into its source page.
func (x *sys) compute(r int) {
	snd := &x.s.Req[r].S
	i := snd.Computed
	if !snd.SrcHeld {
		x.hit(ComputeEnded)
	}
	x.srcPool(r)[snd.Src[i]].Data = Label{Req: int8(r), Index: int8(i)}
	snd.Computed++
	x.doneIfComplete(r)
}

// StreamBounds is c with a request of two pages, which write-uncomputed
// needs to act at all (its first page is computed before any WRITE goes):
// when no prompt that the router and the prefill pool admit has two pages,
// the first prompt grows to two (the default bounds' 2,2,5 become 4,2,5).
// A configuration whose pool takes no two-page prompt is returned as is.
func StreamBounds(c Config) Config {
	fits := func(t int) bool { return t <= c.ContextLimit && t <= c.PrefillLimit() && t <= c.DecodeLimit() }
	for _, t := range c.Prompts {
		if c.PagesFor(t) >= 2 && fits(t) {
			return c
		}
	}
	if len(c.Prompts) == 0 || !fits(2*c.PageSize) || len(c.Contents) > 0 {
		return c
	}
	c.Prompts = slices.Clone(c.Prompts)
	c.Prompts[0] = 2 * c.PageSize
	return c
}
