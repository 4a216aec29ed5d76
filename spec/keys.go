package spec

// Remote access per grant (issue 17; docs/spec.md, "Remote access and the
// rogue fault"). Each Grant gives its request a remote key that covers only
// the pages granted to it (and their tag records), valid only on the queue
// pair it was granted on. Decode revokes it when Done arrives, before it
// verifies: the implementation feeds Done to its state machine only once
// the revocation has completed, so the spec's "decode receives Done" is
// "Done arrived and the key is revoked", one step. Every other end of the
// record (an abort's quarantine, a timeout, a fence, a cut, a restart of
// decode) revokes it too. So the key is live exactly while decode's record
// waits for Done, and the spec derives it from the record's phase instead
// of holding it: the correct protocol gains no state and no event.
//
// The rogue fault is a peer that WRITEs any page with any key it has held,
// at any time: the late writer (the request's own sender after its Done),
// or a compromised prefill node. A WRITE lands only if its key is live and
// covers the page. A refused WRITE fails with a remote access error and
// breaks the writer's queue pair: that break is the cut fault's step, which
// the checker explores at every point with its own budget, so a refused
// try changes nothing else, spends no budget, and is a step back to the
// same state (the checker explores it once, and the coverage counts it).
// The rogue may also send a Bootstrap for a request id the router never
// dispatched: decode reserves only for a request the router dispatched to
// it (the router's ticket), so it refuses that one and reserves nothing.

// keyLive reports whether the remote key of r's Grant still lets a WRITE
// land: while decode's record waits for Done. With verify-before-revoke it
// lives on through verification until the pages are released; with
// pool-wide-key there is one key for the pool, never revoked.
func (m *Model) keyLive(s *State, r int) bool {
	switch ph := s.Req[r].R.Phase; {
	case m.cfg.Bugs.Has(PoolWideKey):
		return true
	case ph == RReserved:
		return true
	case ph == RReady:
		return m.cfg.Bugs.Has(VerifyBeforeRevoke)
	case ph == RQuarantine || ph == RClosed:
		return m.cfg.Mutation == KeyOutlivesRecord
	}
	return false
}

// keyCovers reports whether the key of r's Grant covers page of r's decode
// node: a page granted to r (by its physical page: a window is bound to a
// range of the registered region), or with pool-wide-key any page.
func (m *Model) keyCovers(s *State, r, page int) bool {
	if m.cfg.Bugs.Has(PoolWideKey) || m.cfg.Mutation == KeyCoversPool {
		return true
	}
	rec := &s.Req[r].R
	from := int(rec.Prefix) // the pinned prefix pages are in no grant
	if m.cfg.Bugs.Has(WriteShared) {
		from = 0
	}
	for i := from; i < int(rec.N); i++ {
		if int(rec.Pages[i].Page) == page {
			return true
		}
	}
	return false
}

// rogueWriter reports whether r's prefill node, the incarnation that took
// r's Grant, is alive and still holds the queue pair the Grant came on, to
// the decode incarnation that sent it: the only queue pair the key was
// valid on. A writer without one cannot WRITE at all (a crashed node, a
// replaced incarnation, a queue pair fenced for good).
func (m *Model) rogueWriter(s *State, r int) bool {
	q := &s.Req[r]
	p, d := int(q.P), int(q.D)
	return q.Submitted && q.S.Granted && !s.PrefillCrashed[p] && q.PInc == s.Inc[p] && q.DInc == s.DInc[d] &&
		!s.Fenced[p][d] && s.QPInc[p][d] == s.Inc[p] && s.PQPInc[p][d] == s.DInc[d] && !s.Severed[d]
}

// rogueWrites calls emit once per rogue WRITE worth exploring in s: every
// one that lands (its key live and covering the page) but in its own
// request's pages while decode waits for its Done (ownPending), and of those that do
// not, one whose key was revoked and one whose key does not cover its page,
// if there are such (refused, each is the same step back to s). With
// pool-wide-key a node holds the pool's key through any Grant it took, and
// WRITEs every page through the first such request.
func (m *Model) rogueWrites(s *State, emit func(r, page int)) {
	revoked, uncovered := false, false
	var pooled [MaxPrefills][MaxDecodes]bool
	for r := range m.cfg.Prompts {
		if !m.rogueWriter(s, r) {
			continue
		}
		q := &s.Req[r]
		if m.cfg.Bugs.Has(PoolWideKey) {
			if !pooled[q.P][q.D] {
				pooled[q.P][q.D] = true
				for page := 0; page < m.cfg.DecodePages; page++ {
					emit(r, page)
				}
			}
			continue
		}
		live := m.keyLive(s, r)
		for page := 0; page < m.cfg.DecodePages; page++ {
			switch covers := m.keyCovers(s, r, page); {
			case live && covers && !ownPending(s, r, page):
				emit(r, page)
			case !live && covers && !revoked:
				revoked = true
				emit(r, page)
			case live && !covers && !uncovered:
				uncovered = true
				emit(r, page)
			}
		}
	}
}

// ownPending reports whether page is one of r's own pages, granted to r,
// while decode waits for r's Done. A rogue WRITE that lands there is left
// to the corrupt fault, which explores the same: before the sender's own
// WRITE of that page lands, it overwrites the rogue's bytes (RC order puts
// it before Done); after, the page holds a payload that is not the one its
// tag record's checksum covers, as a payload corrupted in transit does, and
// verification at Done refuses it. Exploring it here too would triple the
// default check's states for nothing new (docs/spec.md, Reductions).
func ownPending(s *State, r, page int) bool {
	q := &s.Req[r]
	if q.R.Phase != RReserved {
		return false
	}
	for i := 0; i < int(q.R.N); i++ {
		if ref := q.R.Pages[i]; int(ref.Page) == page {
			pg := &s.Pages[q.D][page]
			return pg.Owner == int8(r) && pg.Epoch == ref.Epoch
		}
	}
	return false
}

// rogueWrite is a peer's WRITE of page of r's decode node with the key of
// r's Grant: it lands only if the key is live and covers the page. What it
// writes is no request's KV; it leaves the tag record alone (the record's
// MAC is keyed, so a rogue cannot forge one).
func (x *sys) rogueWrite(r, page int) {
	switch {
	case !x.m.keyLive(x.s, r):
		x.hit(RogueRevoked)
		return
	case !x.m.keyCovers(x.s, r, page):
		x.hit(RogueUncovered)
		return
	}
	x.s.Budget[FaultRogue]--
	pg := &x.pool(r)[page]
	switch pg.Owner {
	case int8(r):
		x.hit(RogueLanded)
	case Free:
		x.hit(RogueLandedFree)
	default:
		x.hit(RogueLandedForeign)
		if !x.s.Foreign.Happened {
			x.s.Foreign = ForeignWrite{Happened: true, Req: int8(r), Page: int8(page), Owner: pg.Owner, Node: x.s.Req[r].D}
		}
	}
	pg.Data = Label{Req: Rogue}
}

// ticketChecked reports whether decode's intake refuses a Bootstrap without
// the router's ticket (not under unticketed-bootstrap or no-ticket-check).
func (m *Model) ticketChecked() bool {
	return !m.cfg.Bugs.Has(UnticketedBootstrap) && m.cfg.Mutation != NoTicketCheck
}

// rogueBootstrap is a peer's Bootstrap for r to decode node d, which the
// router has not dispatched: it carries no ticket of the router's for r, so
// decode refuses it and reserves nothing. With unticketed-bootstrap decode
// reserves pages and a slot for it (the lowest free ones; its Grant goes to
// the rogue), as it would for a dispatched request, and r's record names d.
func (x *sys) rogueBootstrap(r, d int) {
	if x.m.ticketChecked() {
		x.hit(DecodeNoTicket)
		return
	}
	c := &x.m.cfg
	x.s.Budget[FaultRogue]--
	t := c.Prompts[r]
	n := c.PagesFor(t)
	slot := freeSlot(x.s, d, c.DecodeSlots)
	free := freePages(x.s, d, c.DecodePages)
	rec := &x.s.Req[r].R
	if t > c.DecodeLimit() || slot < 0 || free.n < n || rec.Phase != RNone {
		return // refused for its size or for capacity, as a dispatched one would be
	}
	x.s.Req[r].D = int8(d)
	for i, p := range free.list()[:n] {
		pg := &x.pool(r)[p]
		pg.Epoch++
		pg.Owner, pg.Quarantined = int8(r), false
		rec.Pages[i] = PageRef{Page: p, Epoch: pg.Epoch}
	}
	rec.N, rec.Slot, rec.Phase = uint8(n), slot, RReserved
	x.slots(r)[slot] = int8(r)
}
