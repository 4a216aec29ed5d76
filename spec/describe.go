package spec

import (
	"fmt"
	"strings"
)

// Describe explains one step for a reader who has not seen the code: what
// happened (the action, read off the state before it) and what changed that
// matters (outcomes, legs, page owners and epochs, what was written where, what
// decode read, messages sent).
func (m *Model) Describe(prev *State, a Action, next *State) (what, detail string) {
	return m.describeAction(prev, a), strings.Join(m.changes(prev, a, next), "; ")
}

func msgString(msg Msg) string {
	switch msg.Kind {
	case MPrefill, MBootstrap:
		if msg.Scope > 0 {
			return fmt.Sprintf("%s{r%d, %d tokens, scope %d}", msg.Kind, msg.Req, msg.Tokens, msg.Scope)
		}
		return fmt.Sprintf("%s{r%d, %d tokens}", msg.Kind, msg.Req, msg.Tokens)
	case MGrant, MDone:
		prefix := ""
		if msg.Prefix > 0 {
			prefix = fmt.Sprintf(", prefix %d pages present", msg.Prefix)
		}
		return fmt.Sprintf("%s{r%d, %d tokens%s, %d pages, slot %d}", [...]string{MGrant: "Grant", MDone: "Done"}[msg.Kind], msg.Req, msg.Tokens, prefix, msg.Pages, msg.Slot)
	case MWrite:
		return fmt.Sprintf("WRITE r%d[%d] -> page %d@%d", msg.Req, msg.Index, msg.Target.Page, msg.Target.Epoch)
	case MPeerFailed:
		return "PeerFailed{prefill}"
	case MPeerRestarted:
		if msg.DInc > 0 { // a decode node's: its incarnations after a restart are 1 and up
			return fmt.Sprintf("PeerRestarted{d%d, incarnation %d}", msg.Peer, msg.DInc)
		}
		return fmt.Sprintf("PeerRestarted{p%d, incarnation %d}", msg.Peer, msg.Inc)
	}
	return fmt.Sprintf("%s{r%d}", msg.Kind, msg.Req)
}

// multi reports whether the deployment has more than one queue pair: only
// then do descriptions name nodes.
func (m *Model) multi() bool { return m.cfg.NumPrefills()*m.cfg.NumDecodes() > 1 }

// prefillName and decodeName name a node in descriptions.
func (m *Model) prefillName(p int) string {
	if !m.multi() {
		return "prefill"
	}
	return fmt.Sprintf("prefill p%d", p)
}

func (m *Model) decodeName(d int) string {
	if !m.multi() {
		return "decode"
	}
	return fmt.Sprintf("decode d%d", d)
}

func (m *Model) describeAction(s *State, a Action) string {
	r := a.Req
	var rp, rd int // the nodes of a's request, when it has one
	if r >= 0 {
		rp, rd = int(s.Req[r].P), int(s.Req[r].D)
	}
	ap, ad := int(a.Arg>>4), int(a.Arg&15) // a queue pair's nodes, for the actions that name one
	switch a.Kind {
	case Submit:
		out := fmt.Sprintf("client submits r%d (%d tokens; the router admits up to %d)", r, m.cfg.Prompts[r], m.cfg.ContextLimit)
		if m.cacheOn() {
			out = fmt.Sprintf("client of tenant scope %d submits r%d (%d tokens, pages %s; the router admits up to %d)", m.cfg.scopeOf(int(r)), r, m.cfg.Prompts[r], m.cfg.contentsOf(int(r)), m.cfg.ContextLimit)
		}
		if sc := a.Arg >> 8; sc != 0 {
			out += fmt.Sprintf(" [FAULT rogue: its body names scope %d]", sc)
			if !m.cfg.Bugs.Has(ClientScope) {
				return out + ": the scope is the tenant's, so the router refuses it"
			}
			out += ": the router takes it"
		}
		if m.multi() && m.cfg.Prompts[r] <= m.cfg.ContextLimit {
			if a.Arg == 0 && (s.CrashDetected[0] || s.DecodeLost[0]) {
				return out + "; no live node of some role"
			}
			out += fmt.Sprintf("; the router picks %s and %s", m.prefillName(ap), m.decodeName(ad))
		}
		return out
	case PrefillRecv:
		return m.prefillName(int(a.Arg&15)) + " receives " + msgString(s.ToPrefill[a.Arg&15].Head()) + " from the router"
	case PrefillRecvQP:
		return m.prefillName(ap) + " receives " + msgString(s.QPBack[ap][ad].Head()) + " from " + m.decodeName(ad)
	case DecodeRecv:
		return m.decodeName(int(a.Arg)) + " receives " + msgString(s.ToDecode[a.Arg].Head()) + " from the router"
	case DecodeRecvQP:
		h := s.QP[rp][rd].Head()
		if h.Kind == MWrite {
			return fmt.Sprintf("the queue pair places WRITE r%d[%d] into page %d (granted at epoch %d)", h.Req, h.Index, h.Target.Page, h.Target.Epoch)
		}
		return m.decodeName(rd) + " receives " + msgString(h) + " from " + m.prefillName(rp)
	case PostWrite:
		snd := &s.Req[r].S
		i := snd.Posted
		out := fmt.Sprintf("prefill posts WRITE r%d[%d]: source page %d -> decode page %d@%d", r, i, snd.Src[i], snd.Grant[i].Page, snd.Grant[i].Epoch)
		if a.Arg&Late != 0 {
			out += " [FAULT late: it stays in the network]"
		}
		if a.Arg&Corrupt != 0 {
			out += " [FAULT corrupt: " + [...]string{"payload", "tag record's request", "tag record's page index", "tag record's epoch"}[a.Arg&corruptTagMask>>2] + " damaged in transit]"
		}
		return out
	case DecodeRead:
		return fmt.Sprintf("decode attends over r%d's pages and replies", r)
	case Compute:
		snd := &s.Req[r].S
		out := fmt.Sprintf("%s computes r%d's page %d (of %d) into source page %d", m.prefillName(rp), r, snd.Computed, snd.Pages, snd.Src[snd.Computed])
		if !snd.SrcHeld {
			out += ", which its ended leg gave back"
		}
		return out
	case DetectCrash:
		if a.Arg&DecodeNode != 0 {
			if m.cfg.StaticPeers {
				return fmt.Sprintf("the router loses %s: a call to its control API failed (it is partitioned, alive); the static registry still lists it, and no prefill node is told", m.decodeName(int(a.Arg&15)))
			}
			return fmt.Sprintf("the router loses %s: its registry lease expired (it is partitioned, alive)", m.decodeName(int(a.Arg&15)))
		}
		if m.multi() {
			return fmt.Sprintf("the router detects that prefill node p%d is gone (its lease expired)", a.Arg)
		}
		return "the router detects that the prefill node is gone"
	case Cancel:
		return fmt.Sprintf("[FAULT cancel] the client disconnects r%d", r)
	case Crash:
		if m.multi() {
			return fmt.Sprintf("[FAULT crash] prefill node p%d crashes", a.Arg)
		}
		return "[FAULT crash] the prefill node crashes"
	case Timeout:
		return fmt.Sprintf("[FAULT timeout] %s's timer for r%d fires", m.decodeName(rd), r)
	case Cut:
		if m.multi() {
			return fmt.Sprintf("[FAULT cut] the queue pair p%d-d%d breaks: everything in flight on it is flushed", ap, ad)
		}
		return "[FAULT cut] the queue pair breaks: everything in flight is flushed"
	case LeaseLost:
		if a.Arg&DecodeNode != 0 {
			return fmt.Sprintf("[FAULT lease] decode node d%d's registry lease expires (it lives on, unreachable)", a.Arg&15)
		}
		return fmt.Sprintf("[FAULT lease] prefill node p%d's registry lease expires (it lives on, unreachable)", a.Arg)
	case Restart:
		if a.Arg&DecodeNode != 0 {
			d := int(a.Arg & 15)
			return fmt.Sprintf("[FAULT restart] %s crashes and comes back as incarnation %d (a fresh pool, epochs from zero, no records, new queue pairs) and registers under its name", m.decodeName(d), s.DInc[d]+1)
		}
		return fmt.Sprintf("[FAULT restart] %s comes back as incarnation %d (fresh pools, no records) and registers under its name", m.prefillName(int(a.Arg)), s.Inc[a.Arg]+1)
	case Partition:
		if m.cfg.StaticPeers {
			return fmt.Sprintf("[FAULT partition] %s is cut off from the router and every prefill node, alive: what is in flight to or from it is lost, and no one is told (the static registry lists it for good)", m.decodeName(int(a.Arg&15)))
		}
		return fmt.Sprintf("[FAULT partition] %s is cut off from the router, the registry and every prefill node, alive: what is in flight to or from it is lost, and no one is told (the registry still lists it until its lease expires)", m.decodeName(int(a.Arg&15)))
	case RetryExceeded:
		return fmt.Sprintf("RC's retry limit: work that %s posted on its queue pair to the silent %s is never acknowledged, so its end breaks: every leg on it fails, and no new queue pair to it can be set up", m.prefillName(ap), m.decodeName(ad))
	case DataplaneCut:
		return fmt.Sprintf("[FAULT dataplane-cut] the network between %s and every prefill node fails: each of its queue pairs breaks at both ends (everything in flight on it is flushed) and no new one can be set up; the registry and the router still list it", m.decodeName(int(a.Arg&15)))
	case RogueWrite:
		out := fmt.Sprintf("[FAULT rogue] %s WRITEs page %d of %s with the key of r%d's Grant", m.prefillName(rp), a.Arg, m.decodeName(rd), r)
		switch {
		case !m.keyLive(s, int(r)):
			return out + ": decode has revoked that key, so the WRITE fails with a remote access error"
		case !m.keyCovers(s, int(r), int(a.Arg)):
			return out + ": the key does not cover that page, so the WRITE fails with a remote access error"
		}
		return out + ": the key is live and covers the page, so it lands"
	case RogueBootstrap:
		out := fmt.Sprintf("[FAULT rogue] a peer sends %s a Bootstrap for r%d, which the router never dispatched", m.decodeName(int(a.Arg)), r)
		if !m.cfg.Bugs.Has(UnticketedBootstrap) {
			return out + ": it carries no ticket, so decode refuses it"
		}
		return out
	case CorruptSend:
		field := [...]string{"token", "page"}[a.Arg&SendPages]
		if a.Arg&SendBack != 0 {
			return fmt.Sprintf("[FAULT corrupt] %s receives %s from %s with its %s count damaged", m.prefillName(rp), msgString(s.QPBack[rp][rd].Head()), m.decodeName(rd), field)
		}
		return fmt.Sprintf("[FAULT corrupt] %s receives %s from %s with its %s count damaged", m.decodeName(rd), msgString(s.QP[rp][rd].Head()), m.prefillName(rp), field)
	}
	return a.String()
}

func (m *Model) changes(p *State, a Action, n *State) []string {
	var out []string
	add := func(format string, args ...any) { out = append(out, fmt.Sprintf(format, args...)) }
	for r := range m.cfg.Prompts {
		pq, nq := &p.Req[r], &n.Req[r]
		if pq.S.Phase != nq.S.Phase {
			add("prefill r%d: %s -> %s", r, pq.S.Phase, nq.S.Phase)
		}
		if !pq.S.Placeholder && nq.S.Placeholder {
			add("prefill marks r%d rejected (%d tokens > its pool of %d) but swaps in a 1-token placeholder and keeps it: admission checks finished, not rejected",
				r, m.cfg.Prompts[r], m.cfg.PrefillLimit())
		}
		if pq.R.Phase != nq.R.Phase {
			s := fmt.Sprintf("decode r%d: %s -> %s", r, pq.R.Phase, nq.R.Phase)
			if nq.R.Reason != NoReason && nq.R.Reason != pq.R.Reason {
				s += " (" + nq.R.Reason.String() + ")"
			}
			if pq.R.Phase == RNone && nq.R.Phase == RReserved {
				var refs []string
				for i := 0; i < int(nq.R.N); i++ {
					refs = append(refs, fmt.Sprintf("%d@%d", nq.R.Pages[i].Page, nq.R.Pages[i].Epoch))
				}
				s += fmt.Sprintf(", pages [%s], slot %d", strings.Join(refs, " "), nq.R.Slot)
			}
			add("%s", s)
		}
		if !pq.R.Released && nq.R.Released && nq.R.Phase != RRejected {
			if nq.R.Reason == ClientCancelled && m.cfg.Bugs.Has(LeakOnCancel) && nq.R.Phase == RClosed {
				add("decode forgets r%d's pages (never returned)", r)
			}
		}
		if pq.Outcome != nq.Outcome {
			s := fmt.Sprintf("client sees r%d %s", r, nq.Outcome)
			if nq.Reason != NoReason {
				s += " (" + nq.Reason.String() + ")"
			}
			add("%s", s)
		}
		if !pq.Read && nq.Read {
			var got []string
			for i := 0; i < int(nq.ReadN); i++ {
				got = append(got, fmt.Sprintf("page %d = %s", nq.R.Pages[i].Page, nq.ReadData[i]))
			}
			add("decode read for r%d: %s", r, strings.Join(got, ", "))
		}
	}
	for d := 0; d < m.cfg.NumDecodes(); d++ {
		at := ""
		if m.multi() {
			at = fmt.Sprintf(" of d%d", d)
		}
		for i := 0; i < m.cfg.DecodePages; i++ {
			pp, np := &p.Pages[d][i], &n.Pages[d][i]
			if pp.Owner != np.Owner || pp.Epoch != np.Epoch || pp.Quarantined != np.Quarantined || pp.Cached != np.Cached || pp.Pins != np.Pins {
				add("page %d%s: %s -> %s", i, at, ownerString(pp), ownerString(np))
			}
			if pp.Data != np.Data || pp.Tag != np.Tag {
				add("page %d%s now holds %s with tag record {r%d[%d]@%d, sum of %s}", i, at, np.Data, np.Tag.Req, np.Tag.Index, np.Tag.Epoch, np.Tag.Sum)
			}
		}
	}
	for sp := 0; sp < m.cfg.NumPrefills(); sp++ {
		name := m.prefillName(sp)
		for i := 0; i < m.cfg.PrefillPages; i++ {
			ps, ns := p.Src[sp][i], n.Src[sp][i]
			if ps.Owner != ns.Owner {
				add("%s source page %d: %s -> %s", name, i, srcOwner(ps.Owner), srcOwner(ns.Owner))
			}
			if ps.Data != ns.Data {
				add("%s source page %d now holds %s", name, i, ns.Data)
			}
		}
	}
	type queueChange struct {
		name          string
		before, after *Queue
		pop           bool
	}
	var queues []queueChange
	ap, ad := int(a.Arg>>4), int(a.Arg&15)
	var rp, rd int
	if a.Req >= 0 {
		rp, rd = int(p.Req[a.Req].P), int(p.Req[a.Req].D)
	}
	for sp := 0; sp < m.cfg.NumPrefills(); sp++ {
		queues = append(queues, queueChange{"router -> " + m.prefillName(sp), &p.ToPrefill[sp], &n.ToPrefill[sp], a.Kind == PrefillRecv && int(a.Arg&15) == sp})
	}
	for d := 0; d < m.cfg.NumDecodes(); d++ {
		queues = append(queues, queueChange{"router -> " + m.decodeName(d), &p.ToDecode[d], &n.ToDecode[d], a.Kind == DecodeRecv && int(a.Arg) == d})
	}
	for sp := 0; sp < m.cfg.NumPrefills(); sp++ {
		for d := 0; d < m.cfg.NumDecodes(); d++ {
			queues = append(queues,
				queueChange{m.prefillName(sp) + " -> " + m.decodeName(d), &p.QP[sp][d], &n.QP[sp][d], a.Kind == DecodeRecvQP && rp == sp && rd == d},
				queueChange{m.decodeName(d) + " -> " + m.prefillName(sp), &p.QPBack[sp][d], &n.QPBack[sp][d], a.Kind == PrefillRecvQP && ap == sp && ad == d})
		}
	}
	for _, q := range queues {
		kept := int(q.before.N)
		if q.pop {
			kept--
		}
		if q.after.N == 0 && kept > 0 {
			add("%s: %d in flight flushed", q.name, kept)
			continue
		}
		for _, msg := range q.after.Items()[max(0, min(kept, int(q.after.N))):] {
			add("sends %s (%s)", msgString(msg), q.name)
		}
	}
	if !p.Foreign.Happened && n.Foreign.Happened {
		add("WRITE of r%d landed in page %d, which r%d owns", n.Foreign.Req, n.Foreign.Page, n.Foreign.Owner)
	}
	if g := &n.Ghost; g.Changed && !p.Ghost.Changed {
		add("r%d's outcome had already been given to the client as %s: it changed", g.ChangedReq, g.ChangedFrom)
	}
	if g := &n.Ghost; g.OldInc && !p.Ghost.OldInc {
		q := &n.Req[g.OldIncReq]
		switch {
		case g.OldIncWhat == OldIncOK && q.DInc != p.DInc[q.D]:
			add("r%d was dispatched to an incarnation of %s that has been replaced, and it is ok", g.OldIncReq, m.decodeName(int(q.D)))
		case g.OldIncWhat == OldIncOK:
			add("r%d was dispatched to an incarnation of %s that has been replaced, and it is ok", g.OldIncReq, m.prefillName(int(q.P)))
		case g.OldIncWhat == OldIncGrant:
			add("that message was sent by a replaced incarnation of %s, and %s had accepted its successor's queue pair", m.decodeName(int(q.D)), m.prefillName(int(q.P)))
		case a.Kind == DecodeRecvQP && p.QP[q.P][q.D].Head().DInc != p.DInc[q.D]:
			add("that message was posted to a replaced incarnation of %s, and landed on its successor", m.decodeName(int(q.D)))
		default:
			add("that message was sent by a replaced incarnation of %s, on the queue pair decode now holds for its successor", m.prefillName(int(n.Req[g.OldIncReq].P)))
		}
	}
	if g := &n.Ghost; g.Pinned && !p.Ghost.Pinned {
		add("page %d was pinned (or cached) and has been reallocated or written: a request that shares it reads KV that is not the prefix it verified", g.PinnedPage)
	}
	for r := range m.cfg.Prompts {
		if q := &n.Req[r]; p.Req[r].R.Prefix == 0 && q.R.Prefix > 0 {
			add("r%d's prefix hit: %d cached prompt pages pinned, %d fresh pages granted", r, q.R.Prefix, int(q.R.N)-int(q.R.Prefix))
		}
	}
	if g := &n.Ghost; g.Tampered && !p.Ghost.Tampered {
		add("r%d was verified, and a page of it changed before it was freed: decode will read KV it did not verify", g.TamperedReq)
	}
	if g := &n.Ghost; g.Spurious && !p.Ghost.Spurious {
		add("no fault has happened, and nothing in the state before this step gives r%d that outcome", g.SpuriousReq)
	}
	for sp := 0; sp < m.cfg.NumPrefills(); sp++ {
		for d := 0; d < m.cfg.NumDecodes(); d++ {
			if p.QPInc[sp][d] != n.QPInc[sp][d] {
				add("%s now holds a queue pair to incarnation %d of %s", m.decodeName(d), n.QPInc[sp][d], m.prefillName(sp))
			}
			if p.PQPInc[sp][d] != n.PQPInc[sp][d] {
				add("%s now holds a queue pair to incarnation %d of %s", m.prefillName(sp), n.PQPInc[sp][d], m.decodeName(d))
			}
		}
		if !p.PrefillCrashed[sp] && n.PrefillCrashed[sp] {
			if m.multi() {
				add("prefill p%d's memory and queues are gone; WRITEs already in the network can still land", sp)
			} else {
				add("prefill's memory and queues are gone; WRITEs already in the network can still land")
			}
		}
	}
	return out
}

func ownerString(pg *DecodePage) string {
	switch {
	case pg.Cached && pg.Pins > 0:
		return fmt.Sprintf("cached in scope %d, chain %d, pinned by %d@%d", pg.Scope, pg.Key, pg.Pins, pg.Epoch)
	case pg.Cached:
		return fmt.Sprintf("cached in scope %d, chain %d@%d", pg.Scope, pg.Key, pg.Epoch)
	case pg.Owner == Free:
		return fmt.Sprintf("free@%d", pg.Epoch)
	case pg.Quarantined:
		return fmt.Sprintf("quarantined for r%d@%d", pg.Owner, pg.Epoch)
	}
	return fmt.Sprintf("r%d@%d", pg.Owner, pg.Epoch)
}

func srcOwner(o int8) string {
	if o == Free {
		return "free"
	}
	return fmt.Sprintf("r%d", o)
}
