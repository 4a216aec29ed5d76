package spec

// Property names, as docs/spec.md#properties states them.
const (
	Isolation        = "Isolation"
	HonestOutcome    = "HonestOutcome"
	NoForeignWrite   = "NoForeignWrite"
	RejectedStaysOut = "RejectedStaysOut"
	Conservation     = "Conservation"
	WithinBounds     = "WithinBounds"
	OutcomeFinal     = "OutcomeFinal"
	// NoSpuriousFailure is the progress property: without faults, a request
	// fails or is rejected only for a reason the state gives.
	NoSpuriousFailure = "NoSpuriousFailure"
	// NoOldIncarnation: nothing of a node's replaced incarnation (prefill, or decode with Config.DecodeRestarts)
	// completes or lands after its successor is known.
	NoOldIncarnation = "NoOldIncarnation"
	// ReadAsVerified: the KV decode reads for a request is the KV it
	// verified: no page of a verified request changes before it is freed.
	ReadAsVerified = "ReadAsVerified"
	// Ticketed: decode holds pages only for a request the router
	// dispatched (the router's ticket).
	Ticketed    = "Ticketed"
	Termination = "Termination"
	NoLeak      = "NoLeak"
)

// Invariant is a named safety predicate over a state.
type Invariant struct {
	Name  string
	Doc   string
	Holds func(m *Model, s *State) bool
}

// Goal is a named liveness property: a state predicate that must stay reachable
// from every reachable state through protocol actions (see docs/spec.md).
type Goal struct {
	Name    string
	Doc     string
	Reached func(m *Model, s *State) bool
}

// Invariants are the safety properties, in the order a violation is reported
// when several fail in the same state.
var Invariants = []Invariant{
	{Isolation, "every page decode read for r holds exactly the KV r wrote for that page, uncorrupted", isolation},
	{HonestOutcome, "a request reported ok read every page of its prompt, each verified as its own; every other outcome carries an explicit reason", honestOutcome},
	{NoForeignWrite, "no WRITE for r lands in a decode page owned (or quarantined) by another request", noForeignWrite},
	{RejectedStaysOut, "a request whose outcome is rejected holds no decode pages, no grant, and no WRITE or Done in flight", rejectedStaysOut},
	{Conservation, "every page a live request holds is owned by it at the granted epoch: a page is free, owned once, or quarantined, never two owners", conservation},
	{OutcomeFinal, "a client-visible outcome never changes: once a request is ok, rejected, cancelled or failed, it stays so, with the same reason", func(_ *Model, s *State) bool { return !s.Ghost.Changed }},
	{NoSpuriousFailure, "in a run without faults a request ends other than ok only for a reason the state gave: over the limit of the node that refused it, or that node's pool or slots really too full for it at that moment", func(_ *Model, s *State) bool { return !s.Ghost.Spurious }},
	{NoOldIncarnation, "nothing of a restarted node's old incarnation completes or lands after the restart: no request dispatched to it reaches the client as ok once the node has a new incarnation, no WRITE or SEND the old one posted lands on a decode node that has accepted the new one's queue pair, nothing posted to a replaced decode incarnation lands on its successor, and no prefill node takes a Grant of a decode incarnation it has replaced", func(_ *Model, s *State) bool { return !s.Ghost.OldInc }},
	{ReadAsVerified, "the KV decode reads for a request is the KV it verified: no page of a verified request changes (payload or tag record) before it is freed", func(_ *Model, s *State) bool { return !s.Ghost.Tampered }},
	{Ticketed, "decode holds pages or a slot only for a request the router dispatched", ticketed},
	{NoCrossScopeRead, "with the prefix cache, no request reads KV written for another request unless both are of the same tenant scope (not 0), or the page is one of a declared public prefix both start with: a prefix hit crosses no tenant's scope", noCrossScopeRead},
	{PinnedNeverReallocated, "with the prefix cache, a pinned page is never reallocated or written while pinned, and a cached page is never written", func(_ *Model, s *State) bool { return !s.Ghost.Pinned }},
	{PrefixExact, "with the prefix cache, the prefix hit and the written pages make exactly the request's prompt: prefill skips exactly the pages of decode's hit (no hole), WRITEs none of them (no overlap), and the hit leaves the last page to be written", prefixExact},
	{WithinBounds, "no queue exceeded the model's bound (a modelling limit, not a protocol property)", func(_ *Model, s *State) bool { return !s.Overflow }},
}

// Goals are the liveness properties.
var Goals = []Goal{
	{Termination, "every request reaches an outcome and both of its legs end", func(m *Model, s *State) bool { return m.terminated(s) }},
	{NoLeak, "at quiescence (every request ended, nothing in flight) every decode page, prefill page and decode slot is free (or, with the prefix cache, cached and unpinned), and every request's record on either node holds nothing", noLeak},
}

func isolation(m *Model, s *State) bool {
	for r := range m.cfg.Prompts {
		q := &s.Req[r]
		for i := 0; i < int(q.ReadN); i++ {
			if !m.ownKV(q.ReadData[i], r, i) {
				return false
			}
		}
	}
	return true
}

func honestOutcome(m *Model, s *State) bool {
	for r, t := range m.cfg.Prompts {
		q := &s.Req[r]
		switch q.Outcome {
		case OK:
			if !q.Read || int(q.ReadN) != m.cfg.PagesFor(t) {
				return false
			}
			for i := 0; i < int(q.ReadN); i++ {
				if !m.ownKV(q.ReadData[i], r, i) {
					return false
				}
			}
		case Rejected, Cancelled, Failed:
			if q.Reason == NoReason {
				return false
			}
		}
	}
	return true
}

func ticketed(m *Model, s *State) bool {
	for r := range m.cfg.Prompts {
		if q := &s.Req[r]; !q.Submitted && (holds(&q.R) || q.R.Slot >= 0) {
			return false
		}
	}
	return true
}

func noForeignWrite(_ *Model, s *State) bool { return !s.Foreign.Happened }

// holds reports whether r's decode record still holds its pages.
func holds(rc *Receiver) bool {
	return rc.Phase == RReserved || rc.Phase == RReady || rc.Phase == RQuarantine && !rc.Released
}

func rejectedStaysOut(m *Model, s *State) bool {
	for r := range m.cfg.Prompts {
		q := &s.Req[r]
		if q.Outcome != Rejected {
			continue
		}
		if holds(&q.R) || q.S.Granted && q.S.Phase.Live() {
			return false
		}
		for _, msg := range s.QP[q.P][q.D].Items() {
			if int(msg.Req) == r && (msg.Kind == MWrite || msg.Kind == MDone) {
				return false
			}
		}
		for _, msg := range s.QPBack[q.P][q.D].Items() {
			if int(msg.Req) == r && msg.Kind == MGrant {
				return false
			}
		}
	}
	return true
}

func conservation(m *Model, s *State) bool {
	for d := 0; d < m.cfg.NumDecodes(); d++ {
		for p := 0; p < m.cfg.DecodePages; p++ {
			if pg := &s.Pages[d][p]; pg.Quarantined && pg.Owner == Free {
				return false
			}
		}
	}
	for r := range m.cfg.Prompts {
		rc := &s.Req[r].R
		if !holds(rc) {
			continue
		}
		for i := int(rc.Prefix); i < int(rc.N); i++ { // the pinned prefix pages: PinnedNeverReallocated
			ref := rc.Pages[i]
			pg := &s.Pages[s.Req[r].D][ref.Page]
			if pg.Owner != int8(r) || pg.Epoch != ref.Epoch {
				return false
			}
		}
	}
	return true
}

// terminated: every request has an outcome and neither leg is still working.
func (m *Model) terminated(s *State) bool {
	for r := range m.cfg.Prompts {
		q := &s.Req[r]
		if !q.Submitted || q.Outcome == Pending || q.S.Phase.Live() || q.R.Phase.Live() {
			return false
		}
	}
	return true
}

func noLeak(m *Model, s *State) bool {
	if !m.terminated(s) {
		return false
	}
	for p := 0; p < m.cfg.NumPrefills(); p++ {
		if s.ToPrefill[p].N > 0 {
			return false
		}
		for d := 0; d < m.cfg.NumDecodes(); d++ {
			if s.QP[p][d].N+s.QPBack[p][d].N > 0 {
				return false
			}
		}
		for i := 0; i < m.cfg.PrefillPages; i++ {
			if s.Src[p][i].Owner != Free {
				return false
			}
		}
	}
	for d := 0; d < m.cfg.NumDecodes(); d++ {
		if s.ToDecode[d].N > 0 {
			return false
		}
		for p := 0; p < m.cfg.DecodePages; p++ {
			if s.Pages[d][p].Owner != Free || s.Pages[d][p].Quarantined || s.Pages[d][p].Pins > 0 {
				return false
			}
		}
		for i := 0; i < m.cfg.DecodeSlots; i++ {
			if s.Slots[d][i] != Free {
				return false
			}
		}
	}
	// Every record has ended (Termination) and gave back what it took: the
	// sender its source pages, the receiver the pages it was granted.
	for r := range m.cfg.Prompts {
		q := &s.Req[r]
		if q.S.SrcHeld || q.R.N > 0 && !q.R.Released {
			return false
		}
	}
	return true
}
