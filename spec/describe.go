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
		return fmt.Sprintf("%s{r%d, %d tokens}", msg.Kind, msg.Req, msg.Tokens)
	case MGrant:
		return fmt.Sprintf("Grant{r%d, %d tokens, %d pages, slot %d}", msg.Req, msg.Tokens, msg.Pages, msg.Slot)
	case MDone:
		return fmt.Sprintf("Done{r%d, %d tokens, %d pages, slot %d}", msg.Req, msg.Tokens, msg.Pages, msg.Slot)
	case MWrite:
		return fmt.Sprintf("WRITE r%d[%d] -> page %d@%d", msg.Req, msg.Index, msg.Target.Page, msg.Target.Epoch)
	case MPeerFailed:
		return "PeerFailed{prefill}"
	}
	return fmt.Sprintf("%s{r%d}", msg.Kind, msg.Req)
}

func (m *Model) describeAction(s *State, a Action) string {
	r := a.Req
	switch a.Kind {
	case Submit:
		return fmt.Sprintf("client submits r%d (%d tokens; the router admits up to %d)", r, m.cfg.Prompts[r], m.cfg.ContextLimit)
	case PrefillRecv:
		return "prefill receives " + msgString(s.ToPrefill.Head()) + " from the router"
	case PrefillRecvQP:
		return "prefill receives " + msgString(s.QPBack.Head()) + " from decode"
	case DecodeRecv:
		return "decode receives " + msgString(s.ToDecode.Head()) + " from the router"
	case DecodeRecvQP:
		h := s.QP.Head()
		if h.Kind == MWrite {
			return fmt.Sprintf("the queue pair places WRITE r%d[%d] into page %d (granted at epoch %d)", h.Req, h.Index, h.Target.Page, h.Target.Epoch)
		}
		return "decode receives " + msgString(h) + " from prefill"
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
	case DetectCrash:
		return "the router detects that the prefill node is gone"
	case Cancel:
		return fmt.Sprintf("[FAULT cancel] the client disconnects r%d", r)
	case Crash:
		return "[FAULT crash] the prefill node crashes"
	case Timeout:
		return fmt.Sprintf("[FAULT timeout] decode's timer for r%d fires", r)
	case Cut:
		return "[FAULT cut] the queue pair breaks: everything in flight is flushed"
	case CorruptSend:
		field := [...]string{"token", "page"}[a.Arg&SendPages]
		if a.Arg&SendBack != 0 {
			return fmt.Sprintf("[FAULT corrupt] prefill receives %s from decode with its %s count damaged", msgString(s.QPBack.Head()), field)
		}
		return fmt.Sprintf("[FAULT corrupt] decode receives %s from prefill with its %s count damaged", msgString(s.QP.Head()), field)
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
	for i := 0; i < m.cfg.DecodePages; i++ {
		pp, np := &p.Pages[i], &n.Pages[i]
		if pp.Owner != np.Owner || pp.Epoch != np.Epoch || pp.Quarantined != np.Quarantined {
			add("page %d: %s -> %s", i, ownerString(pp), ownerString(np))
		}
		if pp.Data != np.Data || pp.Tag != np.Tag {
			add("page %d now holds %s with tag record {r%d[%d]@%d, sum of %s}", i, np.Data, np.Tag.Req, np.Tag.Index, np.Tag.Epoch, np.Tag.Sum)
		}
	}
	for i := 0; i < m.cfg.PrefillPages; i++ {
		ps, ns := p.Src[i], n.Src[i]
		if ps.Owner != ns.Owner {
			add("prefill source page %d: %s -> %s", i, srcOwner(ps.Owner), srcOwner(ns.Owner))
		}
		if ps.Data != ns.Data {
			add("prefill source page %d now holds %s", i, ns.Data)
		}
	}
	for _, q := range []struct {
		name   string
		before *Queue
		after  *Queue
		pop    bool
	}{
		{"router -> prefill", &p.ToPrefill, &n.ToPrefill, a.Kind == PrefillRecv},
		{"router -> decode", &p.ToDecode, &n.ToDecode, a.Kind == DecodeRecv},
		{"prefill -> decode", &p.QP, &n.QP, a.Kind == DecodeRecvQP},
		{"decode -> prefill", &p.QPBack, &n.QPBack, a.Kind == PrefillRecvQP},
	} {
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
	if g := &n.Ghost; g.Spurious && !p.Ghost.Spurious {
		add("no fault has happened, and nothing in the state before this step gives r%d that outcome", g.SpuriousReq)
	}
	if !p.PrefillCrashed && n.PrefillCrashed {
		add("prefill's memory and queues are gone; WRITEs already in the network can still land")
	}
	return out
}

func ownerString(pg *DecodePage) string {
	switch {
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
