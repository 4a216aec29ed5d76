package spec

import (
	"fmt"
	"sync"
)

// ActionKind is the kind of a step.
type ActionKind uint8

// Protocol actions first, then faults (see Action.IsFault).
const (
	Submit         ActionKind = iota // the client sends a request; the router checks it and dispatches it
	PrefillRecv                      // prefill takes the next router message (Prefill or Abort) (Arg: the node, and under AnySourcePages its choice of source pages <<4)
	PrefillRecvQP                    // prefill takes the next message from decode (Grant or Abort)
	DecodeRecv                       // decode takes the next router message (Abort or PeerFailed)
	DecodeRecvQP                     // the next WRITE on the queue pair is placed, or the next SEND delivered
	PostWrite                        // prefill posts the next page's WRITE (Arg: Late, Corrupt bits)
	DecodeRead                       // decode attends over a ready request's pages and replies
	DetectCrash                      // the router notices a node is gone: a crashed prefill node, or a partitioned decode node whose lease expired (Arg: the node, DecodeNode|d for a decode node)
	Compute                          // prefill computes the next page of a request's KV into its source page (stream.go)
	RetryExceeded                    // with static peers, RC's retry limit errors prefill's end of a queue pair to a partitioned decode node that holds work outstanding (Arg: Route(p, d); static.go)
	Cancel                           // fault: the client disconnects
	Crash                            // fault: the prefill node crashes
	Timeout                          // fault: decode's timer for a reserved request fires
	Cut                              // fault: the queue pair breaks and flushes
	CorruptSend                      // fault: the SEND at the head of a queue-pair direction arrives with a count damaged (Arg: SendTokens or SendPages, plus SendBack for decode→prefill)
	LeaseLost                        // fault: a live node's registry lease expires (Arg: the node, DecodeNode for a decode node)
	Restart                          // fault: a crashed prefill node comes back under a new incarnation, or a decode node crashes and comes back under one (Arg: the node, DecodeNode|d for a decode node)
	RogueWrite                       // fault: r's prefill node WRITEs a page of r's decode node with the key of r's Grant, at any time (Arg: the page)
	RogueBootstrap                   // fault: a peer sends a decode node a Bootstrap for r, which the router never dispatched (Arg: the decode node)
	Partition                        // fault: a live decode node is cut off from the deployment for good, silently (Arg: DecodeNode|d; partition.go)
	DataplaneCut                     // fault: the queue pairs between a live decode node and every prefill node break for good, the node still listed (Arg: DecodeNode|d; dataplane.go)
	NumActionKinds                   // the number of action kinds
)

// PostWrite variants (Action.Arg bits); each is a fault. With Corrupt, the
// two bits above it say what is damaged: the payload (the default), or one
// field of the tag record (Config.Damage must allow it).
const (
	Late              = 1 << 0
	Corrupt           = 1 << 1
	CorruptTagRequest = 1 << 2 // the tag record names another request
	CorruptTagIndex   = 2 << 2 // the tag record names another page index
	CorruptTagEpoch   = 3 << 2 // the tag record carries another epoch
	corruptTagMask    = 3 << 2
)

// CorruptSend variants (Action.Arg).
const (
	SendTokens = 0 // the token count is damaged
	SendPages  = 1 // the page count is damaged
	SendBack   = 2 // the SEND is decode's Grant, not prefill's Done
)

// Node arguments. Submit's Arg is Route(p, d); PrefillRecv's (its low 4
// bits), Crash's, Restart's and DetectCrash's the prefill node; DecodeRecv's
// the decode node; PrefillRecvQP's and Cut's Route(p, d) of their queue
// pair; LeaseLost's the prefill node or DecodeNode|d. Every other action's
// node follows from its request's route. In a one-pair deployment every
// node argument is 0.
const DecodeNode = 1 << 8

// Route is the node argument of a (prefill p, decode d) pair.
func Route(p, d int) uint16 { return uint16(p)<<4 | uint16(d) }

// Action is one step: its kind, the request it concerns (or -1), and an argument
// (the WRITE variant, or which free pages a reservation takes).
type Action struct {
	Kind ActionKind
	Req  int8
	Arg  uint16
}

// IsFault reports whether a is a fault.
func (a Action) IsFault() bool {
	return a.Kind >= Cancel || (a.Kind == PostWrite && a.Arg != 0) || (a.Kind == Submit && a.Arg>>8 != 0) // a Submit naming a scope: a rogue client
}

func (a Action) String() string {
	s := a.Kind.String()
	if a.Req >= 0 {
		s += fmt.Sprintf("(r%d)", a.Req)
	}
	if a.Kind == PostWrite && a.Arg&Late != 0 {
		s += "+late"
	}
	if a.Kind == PostWrite && a.Arg&Corrupt != 0 {
		s += "+corrupt" + [...]string{"", "-tag-request", "-tag-index", "-tag-epoch"}[a.Arg&corruptTagMask>>2]
	}
	if a.Kind == CorruptSend {
		s += [...]string{"+tokens", "+pages"}[a.Arg&SendPages]
	}
	if a.Arg != 0 {
		switch a.Kind {
		case Submit, PrefillRecvQP, Cut, RetryExceeded:
			s += fmt.Sprintf("@p%d-d%d", a.Arg>>4&15, a.Arg&15)
			if a.Kind == Submit && a.Arg>>8 != 0 {
				s += fmt.Sprintf("+scope-%d", a.Arg>>8)
			}
		case PrefillRecv:
			if a.Arg&15 != 0 {
				s += fmt.Sprintf("@p%d", a.Arg&15)
			}
			if a.Arg>>4 != 0 {
				s += fmt.Sprintf("+source-choice-%d", a.Arg>>4)
			}
		case Crash, DetectCrash:
			if a.Arg&DecodeNode != 0 {
				s += fmt.Sprintf("@d%d", a.Arg&15)
			} else {
				s += fmt.Sprintf("@p%d", a.Arg)
			}
		case DecodeRecv, RogueBootstrap:
			s += fmt.Sprintf("@d%d", a.Arg)
		}
	}
	if a.Kind == RogueWrite {
		s += fmt.Sprintf("@page%d", a.Arg)
	}
	if a.Kind == LeaseLost || a.Kind == Restart || a.Kind == Partition || a.Kind == DataplaneCut {
		s += fmt.Sprintf("@%c%d", "pd"[a.Arg>>8], a.Arg&15)
	}
	return s
}

var actionNames = [NumActionKinds]string{"Submit", "PrefillRecv", "PrefillRecvQP", "DecodeRecv", "DecodeRecvQP",
	"PostWrite", "DecodeRead", "DetectCrash", "Compute", "RetryExceeded", "Cancel", "Crash", "Timeout", "Cut", "CorruptSend", "LeaseLost", "Restart",
	"RogueWrite", "RogueBootstrap", "Partition", "DataplaneCut"}

func (k ActionKind) String() string {
	if k < NumActionKinds {
		return actionNames[k]
	}
	return fmt.Sprintf("ActionKind(%d)", k)
}

// Successors emits every enabled action of s and its next state. The next
// state is a scratch state, valid only during the call to emit: emit copies
// it to keep it (the checker calls this for every state it explores, and a
// State is about 3 KB: passing it by value cost a third of the run), and
// must not change it: for an action that changes nothing it is s itself.
func (m *Model) Successors(s *State, emit func(Action, *State)) {
	m.successors(s, nil, nil, emit)
}

// SuccessorsWhere emits, as Successors does and in its order, only the
// successors whose action keep takes; keep is offered each one with its
// index in Successors' order, and once it answers more=false no other is
// offered. The others are not built (no copy, step or observation), and
// those after the last wanted are not enumerated: tracing a path back wants
// one successor of each state on it (the checker's rebuild of a trace, the
// defense matrix's replays, hundreds of thousands of them in its most
// filtered combinations), and building the rest was about two fifths of
// that cost. With coverage on, only the successors built count.
func (m *Model) SuccessorsWhere(s *State, keep func(n int, a Action) (take, more bool), emit func(Action, *State)) {
	m.successors(s, keep, nil, emit)
}

// SuccessorsIn is Successors with each successor built in the state next
// returns (the checker's Builder), so that the checker keeps a successor
// where it was built instead of copying it.
func (m *Model) SuccessorsIn(s *State, next func() *State, emit func(Action, *State)) {
	m.successors(s, nil, next, emit)
}

// successors emits the successors keep takes (all with a nil keep), each
// built in the state next returns, or in a scratch state with a nil next.
func (m *Model) successors(s *State, keep func(int, Action) (bool, bool), next func() *State, emit func(Action, *State)) {
	// The steps are called through function values, so the system they work
	// on escapes to the heap: it is a scratch one from a pool, not one
	// allocated per step (the checker calls this for every state it explores).
	x := scratch.Get().(*sys)
	own := x.s
	defer func() {
		x.s = own
		scratch.Put(x)
	}()
	x.m = m
	g := successors{m: m, c: &m.cfg, x: x, s: s, keep: keep, next: next, emit: emit}
	// Direct calls (a loop over the kinds cost 2% of the checker's
	// instructions); g.done is checked between groups of kinds, enough to
	// spare a rebuild or a replay most of the enumeration after the
	// successor it wants.
	g.submits()
	g.prefillRecvs()
	g.prefillRecvQPs()
	g.decodeRecvs()
	if g.done {
		return
	}
	g.decodeRecvQPs()
	g.postWrites()
	g.decodeReads()
	if g.done {
		return
	}
	g.detectCrashes()
	g.detectPartitions()
	g.computes()
	g.retriesExceeded()
	// Faults.
	if g.done || !m.faultAllowed(s) {
		return
	}
	g.cancels()
	g.crashes()
	g.timeouts()
	g.cuts()
	if g.done {
		return
	}
	g.corruptSends()
	g.restarts()
	g.rogues()
	g.leasesLost()
	g.partitions()
	g.dataplaneCuts()
}

// successors enumerates the actions enabled in one state, one method per
// action kind, in the order Successors calls them (the order is part of the
// checker's output: traces and state counts replay from it).
type successors struct {
	m    *Model
	c    *Config
	x    *sys
	s    *State
	keep func(n int, a Action) (take, more bool) // nil: every successor
	n    int                                     // successors offered to keep so far
	done bool                                    // keep wants no more
	next func() *State                           // nil: each successor is built in x's own state
	emit func(Action, *State)
}

// skip reports whether the next successor, whose action is a, is not to be
// built: keep refuses it, or wants no more.
func (g *successors) skip(a Action) bool {
	if g.keep == nil {
		return false
	}
	if g.done {
		return true
	}
	take, more := g.keep(g.n, a)
	g.n++
	g.done = !more
	return !take
}

// do applies f to a copy of g.s and emits a with the result. Each step gets
// the request, nodes and choice it is about (those it does not use are 0) as
// arguments, never captured: a closure that captures them reaches the tests'
// hook, escapes, and costs an allocation per transition (a sixth of the
// checker's time).
func (g *successors) do(a Action, r, p, d, n int, f step) {
	if g.skip(a) {
		return
	}
	m, x, s := g.m, g.x, g.s
	if g.next != nil {
		x.s = g.next()
	}
	if m.cov != nil || m.mutate != nil {
		m.hooked(x, s, a, func() { f(x, r, p, d, n) })
		g.emit(a, x.s)
		return
	}
	copyState(x.s, s)
	f(x, r, p, d, n)
	m.observe(s, a, x.s)
	g.emit(a, x.s)
}

// submits emits the router's Submit of each request not yet submitted.
func (g *successors) submits() {
	c, s := g.c, g.s
	np, nd := c.NumPrefills(), c.NumDecodes()
	for r := 0; r < len(c.Prompts); r++ {
		if s.Req[r].Submitted {
			continue
		}
		// The router picks any live node of each role that takes the prompt
		// (every node of a role has the same pools): protocol.Router's
		// policy is one of these choices. Refused, the choice is moot.
		routes := 0
		if c.Prompts[r] <= c.ContextLimit || c.Mutation == RouterIgnoresLimit {
			for p := 0; p < np; p++ {
				for d := 0; d < nd; d++ {
					if !s.CrashDetected[p] && !s.DecodeLost[d] {
						routes++
						g.do(Action{Submit, int8(r), Route(p, d)}, r, p, d, 0, func(x *sys, r, p, d, _ int) { x.submit(r, p, d) })
					}
				}
			}
		}
		if routes == 0 {
			g.do(Action{Submit, int8(r), 0}, r, 0, 0, 0, func(x *sys, r, _, _, _ int) { x.submit(r, -1, -1) })
		}
		g.scopeClaims(r)
	}
}

// prefillRecvs emits each live prefill node's receipt of the head of its
// queue from the router, once per source-page choice.
func (g *successors) prefillRecvs() {
	m, s := g.m, g.s
	for p := 0; p < g.c.NumPrefills(); p++ {
		if !s.PrefillCrashed[p] && s.ToPrefill[p].N > 0 {
			h := s.ToPrefill[p].Head()
			if n := m.sourceChoices(s, p); n > 1 {
				for i := 0; i < n; i++ {
					g.do(Action{PrefillRecv, h.Req, uint16(p) | uint16(i)<<4}, 0, p, 0, i, func(x *sys, _, p, _, i int) { x.prefillRecv(p, i) })
				}
			} else {
				g.do(Action{PrefillRecv, h.Req, uint16(p)}, 0, p, 0, 0, func(x *sys, _, p, _, _ int) { x.prefillRecv(p, 0) })
			}
		}
	}
}

// prefillRecvQPs emits each live prefill node's receipt of the head of a
// queue pair's back channel.
func (g *successors) prefillRecvQPs() {
	s, np, nd := g.s, g.c.NumPrefills(), g.c.NumDecodes()
	for p := 0; p < np; p++ {
		for d := 0; d < nd; d++ {
			if !s.PrefillCrashed[p] && s.QPBack[p][d].N > 0 {
				g.do(Action{PrefillRecvQP, s.QPBack[p][d].Head().Req, Route(p, d)}, 0, p, d, 0, func(x *sys, _, p, d, _ int) { x.prefillRecvQP(p, d) })
			}
		}
	}
}

// decodeRecvs emits each decode node's receipt of the head of its queue from
// the router.
func (g *successors) decodeRecvs() {
	s := g.s
	for d := 0; d < g.c.NumDecodes(); d++ {
		if s.ToDecode[d].N > 0 {
			g.do(Action{DecodeRecv, s.ToDecode[d].Head().Req, uint16(d)}, 0, 0, d, 0, func(x *sys, _, _, d, _ int) { x.decodeRecv(d) })
		}
	}
}

// decodeRecvQPs emits each decode node's receipt of the head of a queue
// pair, once per reservation choice.
func (g *successors) decodeRecvQPs() {
	m, s, np, nd := g.m, g.s, g.c.NumPrefills(), g.c.NumDecodes()
	for p := 0; p < np; p++ {
		for d := 0; d < nd; d++ {
			if s.QP[p][d].N == 0 {
				continue
			}
			h := s.QP[p][d].Head()
			if choices := m.reservations(s, d, h); choices > 0 {
				for i := 0; i < choices; i++ {
					g.do(Action{DecodeRecvQP, h.Req, uint16(i)}, 0, p, d, i, func(x *sys, _, p, d, i int) { x.decodeRecvQP(p, d, i) })
				}
			} else {
				g.do(Action{DecodeRecvQP, h.Req, 0}, 0, p, d, 0, func(x *sys, _, p, d, _ int) { x.decodeRecvQP(p, d, 0) })
			}
		}
	}
}

// postWrites emits each sender's next WRITE, once per variant (late,
// corrupt, tag damage) the fault budget allows.
func (g *successors) postWrites() {
	m, c, s := g.m, g.c, g.s
	for r := 0; r < len(c.Prompts); r++ {
		snd := &s.Req[r].S
		if s.PrefillCrashed[s.Req[r].P] || snd.Phase != SWriting || snd.Posted >= snd.Pages ||
			int(snd.Posted-snd.Completed) >= c.MaxInFlight || !m.writable(snd) {
			continue
		}
		for v := uint16(0); v < 16; v++ {
			if v&Corrupt == 0 && v&corruptTagMask != 0 {
				continue
			}
			if v&corruptTagMask != 0 && !c.Damage.Has(DamageTag) {
				continue
			}
			if v != 0 && !m.faultAllowed(s) || v&(Late|Corrupt) == Late|Corrupt && !m.faultsLeft(s, 2) {
				continue
			}
			if v&Late != 0 && s.Budget[FaultLate] == 0 || v&Corrupt != 0 && s.Budget[FaultCorrupt] == 0 {
				continue
			}
			g.do(Action{PostWrite, int8(r), v}, r, 0, 0, int(v), func(x *sys, r, _, _, v int) { x.postWrite(r, uint16(v)) })
		}
	}
}

// decodeReads emits the read of each request whose pages are ready.
func (g *successors) decodeReads() {
	s := g.s
	for r := 0; r < len(g.c.Prompts); r++ {
		if s.Req[r].R.Phase == RReady {
			g.do(Action{DecodeRead, int8(r), 0}, r, 0, 0, 0, func(x *sys, r, _, _, _ int) { x.decodeRead(r) })
		}
	}
}

// detectCrashes emits the router's detection of each crashed prefill node.
func (g *successors) detectCrashes() {
	s := g.s
	for p := 0; p < g.c.NumPrefills(); p++ {
		if s.PrefillCrashed[p] && !s.CrashDetected[p] {
			g.do(Action{DetectCrash, -1, uint16(p)}, 0, p, 0, 0, func(x *sys, _, p, _, _ int) { x.detectLoss(p) })
		}
	}
}

// cancels emits the client's cancel of each pending request.
func (g *successors) cancels() {
	s := g.s
	if s.Budget[FaultCancel] > 0 {
		for r := 0; r < len(g.c.Prompts); r++ {
			if s.Req[r].Submitted && s.Req[r].Outcome == Pending {
				g.do(Action{Cancel, int8(r), 0}, r, 0, 0, 0, func(x *sys, r, _, _, _ int) { x.cancel(r) })
			}
		}
	}
}

// crashes emits the crash of each live prefill node.
func (g *successors) crashes() {
	s := g.s
	for p := 0; p < g.c.NumPrefills(); p++ {
		if s.Budget[FaultCrash] > 0 && !s.PrefillCrashed[p] {
			g.do(Action{Crash, -1, uint16(p)}, 0, p, 0, 0, func(x *sys, _, p, _, _ int) { x.crash(p) })
		}
	}
}

// timeouts emits the reservation timeout of each reserved request the router
// dispatched. A rogue's reservation (unticketed-bootstrap) has no prefill
// leg to tell, and its request no prefill node (its timeout would tell node
// 0's, singling a node out); it exists only in a state that violates
// Ticketed already, which the checker does not expand.
func (g *successors) timeouts() {
	s := g.s
	if s.Budget[FaultTimeout] > 0 {
		for r := 0; r < len(g.c.Prompts); r++ {
			if s.Req[r].R.Phase == RReserved && s.Req[r].Dispatched {
				g.do(Action{Timeout, int8(r), 0}, r, 0, 0, 0, func(x *sys, r, _, _, _ int) { x.timeout(r) })
			}
		}
	}
}

// cuts emits the cut of each queue pair whose cut matters.
func (g *successors) cuts() {
	m, s, np, nd := g.m, g.s, g.c.NumPrefills(), g.c.NumDecodes()
	for p := 0; p < np; p++ {
		for d := 0; d < nd; d++ {
			if s.Budget[FaultCut] > 0 && m.cutMatters(s, p, d) {
				g.do(Action{Cut, -1, Route(p, d)}, 0, p, d, 0, func(x *sys, _, p, d, _ int) {
					x.s.Budget[FaultCut]--
					x.cutQP(p, d, Flushed)
				})
			}
		}
	}
}

// corruptSends emits the corruption of a field of each queue pair's head
// Done, and of each back channel's head Grant.
func (g *successors) corruptSends() {
	c, s, np, nd := g.c, g.s, g.c.NumPrefills(), g.c.NumDecodes()
	if s.Budget[FaultCorrupt] > 0 && c.Damage.Has(DamageSend) {
		for p := 0; p < np; p++ {
			for d := 0; d < nd; d++ {
				for _, back := range []bool{false, true} {
					q, kind, arg := &s.QP[p][d], MDone, uint16(0)
					if back {
						q, kind, arg = &s.QPBack[p][d], MGrant, SendBack
					}
					if q.N == 0 || q.Head().Kind != kind || back && s.PrefillCrashed[p] {
						continue
					}
					for _, field := range []uint16{SendTokens, SendPages} {
						g.do(Action{CorruptSend, q.Head().Req, arg | field}, 0, p, d, int(arg|field), func(x *sys, _, p, d, n int) { x.corruptSend(p, d, uint16(n)) })
					}
				}
			}
		}
	}
}

// restarts emits the restart of each crashed prefill node and, where the
// configuration has them, of each decode node.
func (g *successors) restarts() {
	m, c, s := g.m, g.c, g.s
	if s.Budget[FaultRestart] > 0 {
		for p := 0; p < c.NumPrefills(); p++ {
			if s.PrefillCrashed[p] {
				g.do(Action{Restart, -1, uint16(p)}, 0, p, 0, 0, func(x *sys, _, p, _, _ int) { x.restart(p) })
			}
		}
		if c.DecodeRestarts && !m.restartNewsPending(s) { // a bound of the model: see restartNewsPending
			for d := 0; d < c.NumDecodes(); d++ {
				if s.Partitioned[d] {
					continue // cut off for good: nothing of it reaches the deployment again
				}
				g.do(Action{Restart, -1, DecodeNode | uint16(d)}, 0, 0, d, 0, func(x *sys, _, _, d, _ int) { x.restartDecode(d) })
			}
		}
	}
}

// rogues emits each rogue WRITE worth exploring and the rogue bootstrap of
// each request not yet submitted.
func (g *successors) rogues() {
	s := g.s
	if s.Budget[FaultRogue] > 0 {
		g.m.rogueWrites(s, func(r, page int) {
			a := Action{RogueWrite, int8(r), uint16(page)}
			f := func(x *sys, r, _, _, page int) { x.rogueWrite(r, page) }
			if !g.m.keyLive(s, r) || !g.m.keyCovers(s, r, page) {
				g.unchanged(a, r, 0, 0, page, f) // refused: a remote access error
				return
			}
			g.do(a, r, 0, 0, page, f)
		})
		refused := g.m.ticketChecked() // a rogue's Bootstrap carries no ticket
		for r := 0; r < len(g.c.Prompts); r++ {
			if !s.Req[r].Submitted {
				for d := 0; d < g.c.NumDecodes(); d++ { // a peer may send it to any decode node
					a := Action{RogueBootstrap, int8(r), uint16(d)}
					f := func(x *sys, r, _, d, _ int) { x.rogueBootstrap(r, d) }
					if refused {
						g.unchanged(a, r, 0, d, 0, f)
					} else {
						g.do(a, r, 0, d, 0, f)
					}
				}
			}
		}
	}
}

// unchanged emits a, a step that changes nothing (a refusal: its step
// returns at once), with the state being expanded itself as its successor:
// no copy, step or fingerprint, and the checker, seeing its own state come
// back, takes the state for the successor (a fifth of the default bounds'
// transitions are rogue refusals). With coverage or the tests' hook the step
// runs, to count its defense or to be mutated.
// TestUnchangedStepsChangeNothing checks that the step does change nothing.
func (g *successors) unchanged(a Action, r, p, d, n int, f step) {
	if g.m.cov != nil || g.m.mutate != nil {
		g.do(a, r, p, d, n, f)
		return
	}
	if !g.skip(a) {
		g.emit(a, g.s)
	}
}

// leasesLost emits the loss of the lease of each node the router still
// counts live.
func (g *successors) leasesLost() {
	s := g.s
	if s.Budget[FaultLease] > 0 {
		for p := 0; p < g.c.NumPrefills(); p++ {
			if !s.PrefillCrashed[p] && !s.CrashDetected[p] {
				g.do(Action{LeaseLost, -1, uint16(p)}, 0, p, 0, 0, func(x *sys, _, p, _, _ int) {
					x.s.Budget[FaultLease]--
					x.detectLoss(p)
				})
			}
		}
		for d := 0; d < g.c.NumDecodes(); d++ {
			if !s.DecodeLost[d] && !s.Partitioned[d] { // a partitioned node's lease expires as a protocol step: DetectCrash
				g.do(Action{LeaseLost, -1, DecodeNode | uint16(d)}, 0, 0, d, 0, func(x *sys, _, _, d, _ int) { x.decodeLost(d) })
			}
		}
	}
}

// restartNewsPending reports whether some prefill node has yet to take the
// news of a decode node's restart. No decode node restarts until every
// prefill node has taken it: each restart queues a PeerFailed and a
// PeerRestarted (and Aborts) to every prefill node, and back-to-back
// restarts would overflow the router's queues (MaxQueue) at two requests, a
// bound of the model, not a finding. The restarts it leaves out are those
// that come before the prefill nodes have heard of the previous one.
func (m *Model) restartNewsPending(s *State) bool {
	for p := 0; p < m.cfg.NumPrefills(); p++ {
		for _, msg := range s.ToPrefill[p].Items() {
			if msg.Kind == MPeerRestarted {
				return true
			}
		}
	}
	return false
}

// A step is one action's effect on x.s, given the request r, the prefill and
// decode nodes p and d, and the choice or variant n it is about.
type step func(x *sys, r, p, d, n int)

// hooked is one step, on x's scratch state, with coverage counted or under
// the tests' mutate hook. It is apart from Successors' step so that the step
// stays small enough to be inlined at each action.
func (m *Model) hooked(x *sys, s *State, a Action, f func()) {
	if m.cov != nil {
		m.cov.actions[a.Kind].Add(1)
	}
	copyState(x.s, s)
	if m.mutate != nil {
		m.mutate(a, x.s, f)
	} else {
		f()
	}
	m.observe(s, a, x.s)
}

// corruptSend damages one count of the SEND at the head of a queue-pair
// direction, then delivers it.
func (x *sys) corruptSend(p, d int, arg uint16) {
	x.s.Budget[FaultCorrupt]--
	q := &x.s.QP[p][d]
	if arg&SendBack != 0 {
		q = &x.s.QPBack[p][d]
	}
	if arg&SendPages != 0 {
		q.Buf[0].Pages++
	} else {
		q.Buf[0].Tokens++
	}
	if arg&SendBack != 0 {
		x.prefillRecvQP(p, d)
	} else {
		x.decodeRecvQP(p, d, 0)
	}
}

// observe records the ghost history of the step a from prev to next: an
// outcome that changed after it was final, and, in a run that has had no
// fault, an outcome other than ok that the state before the step does not
// justify.
func (m *Model) observe(prev *State, a Action, next *State) {
	m.observePinned(prev, a, next)
	faultless := !a.IsFault() && m.faultsUsed(prev) == 0
	restarts := m.cfg.Faults[FaultRestart] > 0
	if restarts && !next.Ghost.OldInc && a.Req >= 0 && (a.Kind == DecodeRecvQP || a.Kind == CorruptSend && a.Arg&SendBack == 0) {
		// What decode takes off a queue pair was sent by an incarnation of
		// its prefill node: an earlier one than the queue pair decode has
		// accepted since is one whose queue pair should have been fenced.
		q := &prev.Req[a.Req]
		// And it was sent on a queue pair to an incarnation of decode: an
		// earlier one than decode's own is one that has gone.
		if h := prev.QP[q.P][q.D].Head(); h.Inc < prev.QPInc[q.P][q.D] || h.DInc != prev.DInc[q.D] {
			next.Ghost.OldInc, next.Ghost.OldIncReq, next.Ghost.OldIncWhat = true, h.Req, OldIncPlaced
		}
	}
	if restarts && m.cfg.DecodeRestarts && !next.Ghost.OldInc && (a.Kind == PrefillRecvQP || a.Kind == CorruptSend && a.Arg&SendBack != 0) {
		// What prefill takes off a queue pair was sent by an incarnation of
		// its decode node: one older than the queue pair prefill has
		// accepted since is one whose queue pair should have been cut.
		p, d := int(a.Arg>>4), int(a.Arg&15)
		if a.Kind == CorruptSend {
			p, d = int(prev.Req[a.Req].P), int(prev.Req[a.Req].D)
		}
		if h := prev.QPBack[p][d].Head(); h.DInc < prev.PQPInc[p][d] {
			next.Ghost.OldInc, next.Ghost.OldIncReq, next.Ghost.OldIncWhat = true, h.Req, OldIncGrant
		}
	}
	for r := range m.cfg.Prompts {
		// ReadAsVerified: a verified request's pages hold what decode
		// verified until they are freed (its record leaves RReady).
		q := &prev.Req[r]
		if q.R.Phase != RReady || next.Ghost.Tampered {
			continue
		}
		for i := 0; i < int(q.R.N); i++ {
			pg := q.R.Pages[i].Page
			if a, b := &prev.Pages[q.D][pg], &next.Pages[q.D][pg]; a.Data != b.Data || a.Tag != b.Tag {
				next.Ghost.Tampered, next.Ghost.TamperedReq = true, int8(r)
			}
		}
	}
	for r := range m.cfg.Prompts {
		p, n := &prev.Req[r], &next.Req[r]
		if p.Outcome == n.Outcome && p.Reason == n.Reason {
			continue
		}
		if restarts && n.Outcome == OK && (p.PInc != prev.Inc[p.P] || p.DInc != prev.DInc[p.D]) && !next.Ghost.OldInc {
			next.Ghost.OldInc, next.Ghost.OldIncReq, next.Ghost.OldIncWhat = true, int8(r), OldIncOK
		}
		if p.Outcome != Pending {
			if !next.Ghost.Changed {
				next.Ghost.Changed, next.Ghost.ChangedReq, next.Ghost.ChangedFrom = true, int8(r), p.Outcome
			}
			continue
		}
		if faultless && n.Outcome != OK && !next.Ghost.Spurious && !m.justified(prev, a, r, n) {
			next.Ghost.Spurious, next.Ghost.SpuriousReq = true, int8(r)
		}
	}
}

// justified reports whether the state before step a gave a reason for request
// r's outcome q: rejected because r is over the limit of the node that acted,
// or failed because that node's pool was really too full for r at that moment.
func (m *Model) justified(prev *State, a Action, r int, q *Request) bool {
	c := &m.cfg
	t := c.Prompts[r]
	switch {
	case q.Outcome == Rejected && q.Reason == OverLimit:
		switch a.Kind {
		case Submit:
			return t > c.ContextLimit
		case PrefillRecv:
			return t > c.PrefillLimit()
		case DecodeRecvQP:
			h := prev.QP[q.P][q.D].Head()
			return h.Kind == MBootstrap && int(h.Tokens) > c.DecodeLimit()
		}
	case q.Outcome == Failed && q.Reason == NoCapacity:
		switch a.Kind {
		case PrefillRecv:
			need := c.PagesFor(t)
			if t > c.PrefillLimit() {
				need = 1 // admit-finished's placeholder
			}
			free := 0
			for p := 0; p < c.PrefillPages; p++ {
				if prev.Src[q.P][p].Owner == Free {
					free++
				}
			}
			return free < need
		case DecodeRecvQP:
			h := prev.QP[q.P][q.D].Head()
			return h.Kind == MBootstrap && (freeSlot(prev, int(q.D), c.DecodeSlots) < 0 || !m.plan(prev, int(q.D), r, h, c.PagesFor(int(h.Tokens))).ok)
		}
	}
	return false
}

// faultAllowed reports whether one more fault fits in MaxFaults.
func (m *Model) faultAllowed(s *State) bool { return m.faultsLeft(s, 1) }

func (m *Model) faultsLeft(s *State, n int) bool {
	return m.cfg.MaxFaults == 0 || m.faultsUsed(s)+n <= m.cfg.MaxFaults
}

// faultsUsed is how many faults have happened on the way to s.
func (m *Model) faultsUsed(s *State) int {
	used := 0
	for f := range s.Budget {
		used += int(m.cfg.Faults[f]) - int(s.Budget[f])
	}
	return used
}

// cutMatters reports whether breaking queue pair (p, d) would affect anything:
// something in flight on it or a leg that uses it. Cutting an idle queue pair
// only costs budget, so it is not explored.
func (m *Model) cutMatters(s *State, p, d int) bool {
	if s.QP[p][d].N > 0 || s.QPBack[p][d].N > 0 {
		return true
	}
	for r := range m.cfg.Prompts {
		if !s.Req[r].onPair(p, d) {
			continue
		}
		if s.Req[r].S.Phase.Live() || s.Req[r].R.Phase == RReserved || s.Req[r].R.Phase == RQuarantine {
			return true
		}
	}
	return false
}

// sourceChoices returns how many ways prefill node p's intake can take
// source pages for the Prefill at the head of its router queue: with
// Config.AnySourcePages, every ordered tuple of free pages (0 when the option
// is off or the intake takes none).
func (m *Model) sourceChoices(s *State, p int) int {
	c := &m.cfg
	h := s.ToPrefill[p].Head()
	if !c.AnySourcePages || h.Kind != MPrefill {
		return 0
	}
	q := &s.Req[h.Req]
	t := c.Prompts[h.Req]
	if t > c.PrefillLimit() && !c.Bugs.Has(AdmitFinished) {
		return 0 // rejected; admitted, a one-page placeholder
	}
	pages := c.intakePages(t)
	if s.Fenced[q.P][q.D] || s.QPInc[q.P][q.D] != s.Inc[q.P] || s.Severed[q.D] {
		return 0
	}
	free := 0
	for i := 0; i < c.PrefillPages; i++ {
		if s.Src[p][i].Owner == Free {
			free++
		}
	}
	if free < pages {
		return 0
	}
	return orderings(free, pages)
}

// reservations returns how many ways decode can reserve pages for the Bootstrap
// at the head of the queue pair (0 if the head is not a Bootstrap that reserves).
// The spec lets the allocator pick any free pages, in any order.
func (m *Model) reservations(s *State, d int, h Msg) int {
	if h.Kind != MBootstrap {
		return 0
	}
	r := h.Req
	rec := &s.Req[r].R
	if rec.Phase != RNone || int(h.Tokens) > m.cfg.DecodeLimit() || freeSlot(s, d, m.cfg.DecodeSlots) < 0 {
		return 0
	}
	pl := m.plan(s, d, int(r), h, m.cfg.PagesFor(int(h.Tokens)))
	if !pl.ok {
		return 0
	}
	if m.cfg.LowestPages {
		return 1
	}
	return orderings(pl.cands.n, pl.fresh)
}

// onPair reports whether the request was routed to queue pair (p, d).
func (q *Request) onPair(p, d int) bool { return q.Submitted && int(q.P) == p && int(q.D) == d }

func freePages(s *State, d, n int) pageList {
	var out pageList
	for p := 0; p < n; p++ {
		if s.Pages[d][p].Owner == Free && !s.Pages[d][p].Cached {
			out.add(int8(p))
		}
	}
	return out
}

func freeSlot(s *State, d, n int) int8 {
	for i := 0; i < n; i++ {
		if s.Slots[d][i] == Free {
			return int8(i)
		}
	}
	return -1
}

// nthTuple returns the choice-th ordered tuple of n distinct elements of free,
// in lexicographic order of positions.
func nthTuple(free []int8, n, choice int) pageList {
	var pool pageList
	for _, p := range free {
		pool.add(p)
	}
	var out pageList
	for i := 0; i < n; i++ {
		rest := 1
		for j := i + 1; j < n; j++ {
			rest *= pool.n - 1 - (j - i - 1)
		}
		k := choice / rest
		choice %= rest
		out.add(pool.p[k])
		pool.remove(k)
	}
	return out
}

// pageList is a list of page numbers, decode or prefill pages, held by
// value: the steps that choose pages run for every transition the checker
// explores, and a slice would be an allocation each.
type pageList struct {
	n int
	p [max(MaxDecodePages, MaxPrefillPages)]int8
}

// list is the pages, in order.
func (l *pageList) list() []int8 { return l.p[:l.n] }

// add appends page p.
func (l *pageList) add(p int8) {
	l.p[l.n] = p
	l.n++
}

// remove removes the k-th page.
func (l *pageList) remove(k int) {
	copy(l.p[k:l.n], l.p[k+1:l.n])
	l.n--
}

// sys applies one step to a state. Its methods are the protocol of docs/protocol.md
// with the switches of docs/spec.md#the-switches-and-their-counterexamples.
type sys struct {
	m *Model
	s *State
}

// scratch holds the states Successors steps on.
var scratch = sync.Pool{New: func() any { return &sys{s: new(State)} }}

func (x *sys) bug(sw Switch) bool { return x.m.cfg.Bugs.Has(sw) }

// The parts of the deployment request r was routed to.
func (x *sys) qp(r int) *Queue     { q := &x.s.Req[r]; return &x.s.QP[q.P][q.D] }
func (x *sys) qpBack(r int) *Queue { q := &x.s.Req[r]; return &x.s.QPBack[q.P][q.D] }
func (x *sys) pool(r int) *[MaxDecodePages]DecodePage {
	return &x.s.Pages[x.s.Req[r].D]
}
func (x *sys) srcPool(r int) *[MaxPrefillPages]SourcePage { return &x.s.Src[x.s.Req[r].P] }
func (x *sys) slots(r int) *[MaxSlots]int8                { return &x.s.Slots[x.s.Req[r].D] }

// crashed reports whether r's prefill leg is gone: its node crashed, or
// came back under a new incarnation that has no record of r.
func (x *sys) crashed(r int) bool {
	q := &x.s.Req[r]
	return x.s.PrefillCrashed[q.P] || q.PInc != x.s.Inc[q.P]
}

// oldIncarnation reports whether r was dispatched to an incarnation of its
// prefill node that has since been replaced.
func (x *sys) oldIncarnation(r int) bool { q := &x.s.Req[r]; return q.PInc != x.s.Inc[q.P] }

func (x *sys) push(q *Queue, msg Msg) {
	if !q.Push(msg, x.m.cfg.QueueBound()) {
		x.s.Overflow = true
	}
}

// toQP sends on r's queue pair to decode, stamped with the incarnation of
// the prefill node that sends it; a fenced queue pair flushes it, and so does
// one that decode holds for another incarnation (there is none yet for this one).
func (x *sys) toQP(r int, msg Msg) {
	q := &x.s.Req[r]
	msg.Inc, msg.DInc = x.s.Inc[q.P], x.s.PQPInc[q.P][q.D]
	if x.qpLive(int(q.P), int(q.D)) {
		x.push(x.qp(r), msg)
	} else {
		x.postedIntoSilence(int(q.P), int(q.D))
	}
}

// qpLive reports whether queue pair (p, d) connects the live incarnations
// of both nodes: not fenced, and each end is the one the other holds. A
// message sent on a queue pair whose other end is a replaced incarnation
// (or is not yet accepted) is flushed; one to or from a partitioned decode
// node is lost, and neither end learns of it (partition.go).
func (x *sys) qpLive(p, d int) bool {
	return !x.s.Fenced[p][d] && x.s.QPInc[p][d] == x.s.Inc[p] && x.s.PQPInc[p][d] == x.s.DInc[d] && !x.s.Partitioned[d] && !x.s.Severed[d]
}

// toQPBack sends on r's queue pair to prefill, stamped with the decode
// incarnation that sends it: only while the queue pair is live (the other
// end of an older one is gone).
func (x *sys) toQPBack(r int, msg Msg) {
	q := &x.s.Req[r]
	msg.DInc = x.s.DInc[q.D]
	if x.qpLive(int(q.P), int(q.D)) {
		x.toPrefill(int(q.P), x.qpBack(r), msg)
	}
}

// toPrefill sends to prefill node p; a crashed node drops everything.
func (x *sys) toPrefill(p int, q *Queue, msg Msg) {
	if !x.s.PrefillCrashed[p] {
		x.push(q, msg)
	}
}

// report gives the client an outcome; the first one is final.
func (x *sys) report(r int, o Outcome, why Reason) {
	q := &x.s.Req[r]
	if q.Outcome == Pending {
		q.Outcome, q.Reason = o, why
		if o == Failed || o == Rejected {
			x.staticLegCancel(r)
		}
	}
}

// refuse is the router's own refusal of r at its intake: nothing was
// dispatched, so there is no leg to cancel.
func (x *sys) refuse(r int, o Outcome, why Reason) {
	if q := &x.s.Req[r]; q.Outcome == Pending {
		q.Outcome, q.Reason = o, why
	}
}

// --- router ---

// submit is the router's intake of r, dispatched to prefill node p and
// decode node d (-1: no live node of some role).
func (x *sys) submit(r, p, d int) {
	q := &x.s.Req[r]
	q.Submitted = true
	t := x.m.cfg.Prompts[r]
	switch {
	case t > x.m.cfg.ContextLimit && !x.mut(RouterIgnoresLimit):
		x.hit(RouterOverLimit)
		x.refuse(r, Rejected, OverLimit)
	case p < 0:
		x.hit(RouterPeerDead)
		x.refuse(r, Failed, PeerFailed)
	default:
		x.hit(RouterDispatch)
		q.Scope = x.m.cfg.routerScope(r) // the authenticated tenant's, or the public prefix's
		q.Dispatched, q.P, q.D, q.PInc, q.DInc = true, int8(p), int8(d), x.s.Inc[p], x.s.DInc[d]
		x.toPrefill(p, &x.s.ToPrefill[p], Msg{Kind: MPrefill, Req: int8(r), Tokens: uint8(t)})
	}
}

func (x *sys) cancel(r int) {
	x.s.Budget[FaultCancel]--
	x.report(r, Cancelled, ClientCancelled)
	q := &x.s.Req[r]
	x.toPrefill(int(q.P), &x.s.ToPrefill[q.P], Msg{Kind: MAbort, Req: int8(r)})
	x.toDecode(int(q.D), Msg{Kind: MAbort, Req: int8(r)})
}

// detectLoss is the router's reaction to prefill node p's expired lease
// (it crashed, or it lives on unreachable): every request routed to it fails,
// and each decode node is told, so that it cuts its queue pair to p, the
// fence for whatever p may still write.
func (x *sys) detectLoss(p int) {
	x.s.CrashDetected[p] = true
	for r := range x.m.cfg.Prompts {
		if q := &x.s.Req[r]; q.Submitted && int(q.P) == p {
			x.report(r, Failed, PeerFailed)
		}
	}
	if !x.bug(NoPeerCancel) {
		for d := 0; d < x.m.cfg.NumDecodes(); d++ {
			x.toDecode(d, Msg{Kind: MPeerFailed, Req: -1, Peer: int8(p)})
		}
	}
}

// decodeLost is the router's reaction to decode node d's expired lease: the
// node may live on, unreachable, so its pages are not touched. Every request
// routed to it fails, its prefill leg is cancelled if it has not ended
// (protocol.Router cancels open legs only), and each prefill node is
// told, so that it cuts its queue pair to d: until then the pages its
// requests hold on d stay granted or quarantined.
func (x *sys) decodeLost(d int) {
	x.s.Budget[FaultLease]--
	x.decodeLoss(d)
}

// decodeLoss is the router's loss of decode node d (its lease expired, or
// it registered a new incarnation): see decodeLost.
func (x *sys) decodeLoss(d int) {
	x.s.DecodeLost[d] = true
	for r := range x.m.cfg.Prompts {
		if q := &x.s.Req[r]; q.Submitted && int(q.D) == d && q.Outcome == Pending {
			x.report(r, Failed, PeerFailed)
			if (q.S.Phase == SNone || q.S.Phase.Live()) && !x.mut(NoRouterLegCancel) && !x.m.cfg.StaticPeers { // a leg that has ended needs no cancel (static peers: report sent it)
				x.toPrefill(int(q.P), &x.s.ToPrefill[q.P], Msg{Kind: MAbort, Req: int8(r)})
			}
		}
	}
	if !x.bug(NoPeerCancel) && !x.m.cfg.StaticPeers { // a static registry tells no prefill node (static.go)
		for p := 0; p < x.m.cfg.NumPrefills(); p++ {
			x.toPrefill(p, &x.s.ToPrefill[p], Msg{Kind: MPeerFailed, Req: -1, Peer: int8(d)})
		}
	}
}

// --- prefill (sender) ---

// prefillRecv takes the next router message; choice picks the source pages
// of a Prefill's intake under Config.AnySourcePages.
func (x *sys) prefillRecv(p, choice int) {
	msg := x.s.ToPrefill[p].Pop()
	if msg.Req >= 0 && x.oldIncarnation(int(msg.Req)) {
		// An Abort for a request of an earlier incarnation: this one has
		// no record of it.
		x.hit(PrefillOldIncarnation)
		return
	}
	switch msg.Kind {
	case MPrefill:
		x.prefillIntake(int(msg.Req), choice)
	case MAbort:
		x.prefillAbort(int(msg.Req))
	case MPeerFailed:
		x.hit(LostDecodeFence)
		if !x.mut(NoLostDecodeFence) {
			x.fenceQP(p, int(msg.Peer)) // the fence for a lost decode node
		}
	case MPeerRestarted:
		x.acceptDecodeIncarnation(p, int(msg.Peer), msg.DInc)
	}
}

func (x *sys) prefillIntake(r, choice int) {
	c := &x.m.cfg
	snd := &x.s.Req[r].S
	t := c.Prompts[r]
	pages := c.PagesFor(t)
	if t > c.PrefillLimit() && !x.mut(PrefillIgnoresLimit) {
		if !x.bug(AdmitFinished) {
			x.hit(PrefillOverLimit)
			snd.Phase = SRejected
			x.report(r, Rejected, OverLimit)
			return
		}
		// The incident: the prompt is swapped for a one-token placeholder and
		// marked rejected, but admission asks "finished?", so it goes on.
		x.hit(PrefillPlaceholder)
		snd.Placeholder = true
		pages = 1
	}
	src := x.srcPool(r)
	var got []int8 // the lowest free pages, or with AnySourcePages the choice-th tuple of free ones
	for p := 0; p < c.PrefillPages && (len(got) < pages || c.AnySourcePages); p++ {
		if src[p].Owner == Free {
			got = append(got, int8(p))
		}
	}
	if c.AnySourcePages && len(got) >= pages {
		tuple := nthTuple(got, pages, choice)
		got = append(got[:0], tuple.list()...)
	}
	if q := &x.s.Req[r]; x.s.Fenced[q.P][q.D] || x.s.QPInc[q.P][q.D] != x.s.Inc[q.P] || x.s.PQPInc[q.P][q.D] != q.DInc || x.s.Severed[q.D] {
		// The queue pair to the chosen decode node was cut for good when
		// one end was declared lost, or this incarnation has none yet
		// (decode has not accepted it): the Bootstrap is flushed, so the
		// leg fails. So does a request routed to a decode incarnation
		// other than the one this node's queue pair is to: the route
		// names the incarnation, and a replaced one is gone. And one
		// routed to a decode node whose data plane is cut: no queue pair
		// to it can be set up (transfer.ErrNoPeer; dataplane.go).
		snd.Phase = SFailed
		x.report(r, Failed, Flushed)
		return
	}
	if len(got) < pages {
		x.hit(PrefillNoCapacity)
		snd.Phase = SFailed
		x.report(r, Failed, NoCapacity)
		return
	}
	x.hit(PrefillAccept)
	for i, p := range got {
		src[p].Owner = int8(r) // its KV is whoever's was there before until Compute writes it (stream.go)
		snd.Src[i] = p
	}
	snd.Pages, snd.Computed, snd.SrcHeld, snd.Phase = uint8(pages), 0, true, SAwaitGrant
	x.toQP(r, Msg{Kind: MBootstrap, Req: int8(r), Tokens: uint8(t), Scope: x.s.Req[r].Scope})
}

func (x *sys) prefillRecvQP(p, d int) {
	msg := x.s.QPBack[p][d].Pop()
	r := int(msg.Req)
	if x.oldIncarnation(r) {
		x.hit(PrefillOldIncarnation) // unknown to this incarnation
		return
	}
	switch msg.Kind {
	case MGrant:
		x.admit(r, msg)
	case MAbort:
		x.prefillAbort(r)
	}
}

// admit checks a grant against the sender's own view of the request (step 3).
func (x *sys) admit(r int, g Msg) {
	c := &x.m.cfg
	snd := &x.s.Req[r].S
	switch snd.Phase {
	case SAwaitGrant:
		t := c.Prompts[r]
		n := c.PagesFor(t)
		if (int(g.Tokens) != t || int(g.Prefix) >= n || int(g.Pages) != n-int(g.Prefix)) && !x.mut(AdmitIgnoresGrant) {
			x.hit(AdmitGrantMismatch)
			x.freeSrc(r)
			snd.Phase = SFailed
			x.report(r, Failed, GrantMismatch)
			x.toQP(r, Msg{Kind: MAbortAck, Req: int8(r)})
			return
		}
		x.hit(AdmitGrant)
		if snd.Computed < snd.Pages {
			x.hit(AdmitMidStream)
		}
		snd.Grant = x.s.Req[r].R.Pages // a grant carries the reservation's (page, epoch) tags
		for i := 0; i < int(g.Prefix); i++ {
			snd.Grant[i] = PageRef{} // only the fresh pages: the prefix's are not in it
		}
		snd.Granted = true
		snd.Phase = SWriting
		skip := g.Prefix
		if x.bug(PrefixCountMismatch) && g.Prefix > 0 {
			skip = min(g.Prefix+1, snd.Pages) // it counts the prefix its own way: a page more
			// and WRITEs its first page past that into the grant's first page, and so on
			for i := int(snd.Pages) - 1; i >= int(skip); i-- {
				snd.Grant[i] = snd.Grant[i-int(skip-g.Prefix)]
			}
		}
		snd.Skip, snd.Posted, snd.Completed = skip, skip, skip
		x.doneIfComplete(r)
	case SAborted, SFailed:
		// Nothing was posted for r: tell decode it is fenced.
		x.hit(AdmitEndedGrant)
		x.toQP(r, Msg{Kind: MAbortAck, Req: int8(r)})
	}
}

func (x *sys) prefillAbort(r int) {
	snd := &x.s.Req[r].S
	switch snd.Phase {
	case SAwaitGrant:
		x.freeSrc(r)
		snd.Phase = SAborted
	case SWriting:
		if x.bug(AbortStillSends) {
			x.sendDone(r)
			return
		}
		x.abortSending(r)
	case SSent:
		x.abortSending(r)
	case SFinished:
		if snd.Granted {
			x.toQP(r, Msg{Kind: MAbortAck, Req: int8(r)})
		}
	}
}

// abortSending stops a sender that has posted WRITEs: it acks once they have
// all completed, and only then frees the source pages they read.
func (x *sys) abortSending(r int) {
	snd := &x.s.Req[r].S
	if snd.Completed != snd.Posted {
		x.hit(SenderAbortWaits)
		if x.bug(AbortFreesSource) {
			// The producer's timeout frees the blocks a WRITE still reads.
			x.freeSrc(r)
		}
	}
	snd.Phase = SAborting
	x.senderProgress(r)
}

func (x *sys) postWrite(r int, variant uint16) {
	snd := &x.s.Req[r].S
	i := snd.Posted
	w := Msg{Kind: MWrite, Req: int8(r), Index: int8(i), Target: snd.Grant[i], Src: snd.Src[i],
		Sum: x.srcPool(r)[snd.Src[i]].Data}
	if variant&Corrupt != 0 {
		w.Damage = uint8(variant&corruptTagMask>>2) + 1
	}
	snd.Posted++
	if variant&Corrupt != 0 {
		x.s.Budget[FaultCorrupt]--
	}
	switch {
	case variant&Late != 0:
		x.s.Budget[FaultLate]--
		x.toQP(r, w)
	case x.qp(r).N == 0 && x.qpLive(int(x.s.Req[r].P), int(x.s.Req[r].D)):
		x.place(w) // nothing ahead of it on the queue pair: placed at once
	default:
		x.toQP(r, w)
	}
	x.doneIfComplete(r)
}

// sendDone posts Done behind the WRITEs on the same queue pair (step 5).
func (x *sys) sendDone(r int) {
	snd := &x.s.Req[r].S
	tokens := x.m.cfg.Prompts[r]
	if snd.Placeholder {
		tokens = 1
	}
	x.toQP(r, Msg{Kind: MDone, Req: int8(r), Tokens: uint8(tokens), Pages: snd.Pages - snd.Skip, Prefix: snd.Skip, Slot: x.s.Req[r].R.Slot})
	snd.Phase = SSent
	if x.bug(PrefillEarlyFree) {
		x.freeSrc(r)
	}
	x.senderProgress(r)
}

// senderProgress ends a leg once every WRITE it posted has completed.
func (x *sys) senderProgress(r int) {
	snd := &x.s.Req[r].S
	if snd.Completed != snd.Posted {
		return
	}
	switch snd.Phase {
	case SSent:
		x.freeSrc(r)
		snd.Phase = SFinished
	case SAborting:
		x.freeSrc(r)
		snd.Phase = SAborted
		x.toQP(r, Msg{Kind: MAbortAck, Req: int8(r)})
	}
}

func (x *sys) freeSrc(r int) {
	snd := &x.s.Req[r].S
	if !snd.SrcHeld {
		return
	}
	if snd.Computed < snd.Pages {
		x.hit(EndMidStream)
	}
	for i := 0; i < int(snd.Pages); i++ {
		x.srcPool(r)[snd.Src[i]].Owner = Free
	}
	snd.SrcHeld = false
}

// restart brings crashed prefill node p back under a new incarnation, with
// fresh pools and no records (its memory went at the crash). It registers
// under the same name, and the registry's new record tells the router that
// the old incarnation is gone, as an expired lease would (unless that was
// already detected), and each decode node that p is back, so that it cuts
// the old incarnation's queue pair before it accepts the new one's. With
// peer-by-name the router knows p by name only: the new record is an
// advertisement update of the same node, and nothing of the old incarnation
// fails there.
func (x *sys) restart(p int) {
	x.s.Budget[FaultRestart]--
	x.s.Inc[p]++
	x.s.PrefillCrashed[p] = false
	if !x.s.CrashDetected[p] && !x.bug(PeerByName) {
		x.hit(RestartLoss)
		x.detectLoss(p)
	}
	x.s.CrashDetected[p] = false
	for d := 0; d < x.m.cfg.NumDecodes(); d++ {
		x.s.PQPInc[p][d] = x.s.DInc[d] // its new queue pairs are to the live incarnation of each decode node
		x.toDecode(d, Msg{Kind: MPeerRestarted, Req: -1, Peer: int8(p), Inc: x.s.Inc[p]})
	}
}

// restartDecode crashes decode node d and brings it back at once under a
// new incarnation (Config.DecodeRestarts): its memory is gone, so it has no
// records and a fresh pool, whose pages are all free and whose epochs start
// again from zero (the KV and tag records in the pages stay: pages are never
// zeroed); its slots are free. What was in flight to the old incarnation is
// flushed (its end of every queue pair went with it); what it sent before
// may still reach prefill. The new incarnation holds a queue pair for the
// live incarnation of each prefill node the registry lists, and registers
// under its name: the new record tells the router that the old incarnation
// is lost, as an expired lease would (unless that was already detected, or
// with peer-by-name), and each prefill node that d is back, so that it cuts
// its queue pair to the old incarnation before it accepts the new one's.
func (x *sys) restartDecode(d int) {
	x.s.Budget[FaultRestart]--
	if !x.mut(DecodeRestartSameIncarnation) {
		x.s.DInc[d]++
	}
	x.dropDecode(d)
	for p := 0; p < x.m.cfg.NumPrefills(); p++ {
		x.s.QP[p][d].Clear()
		x.s.QPInc[p][d], x.s.Fenced[p][d] = x.s.Inc[p], x.s.CrashDetected[p]
	}
	if !x.s.DecodeLost[d] && !x.bug(PeerByName) {
		x.hit(RestartLoss)
		x.decodeLoss(d)
	}
	x.s.DecodeLost[d] = false
	for p := 0; p < x.m.cfg.NumPrefills(); p++ {
		x.toPrefill(p, &x.s.ToPrefill[p], Msg{Kind: MPeerRestarted, Req: -1, Peer: int8(d), DInc: x.s.DInc[d]})
	}
}

// acceptDecodeIncarnation is prefill node p's reaction to decode node d's
// new incarnation inc: it cuts its queue pair to the old incarnation,
// failing the legs on it and flushing what the old one sent (a Grant of
// the old incarnation names pages of a pool that is gone), and only then
// holds a queue pair to the new one.
func (x *sys) acceptDecodeIncarnation(p, d int, inc uint8) {
	x.hit(RestartFence)
	if !x.mut(NoDecodeRestartFence) {
		x.cutQP(p, d, PeerFailed)
	}
	x.s.PQPInc[p][d] = inc
	x.s.Fenced[p][d] = x.s.CrashDetected[p]
}

func (x *sys) crash(p int) {
	x.s.Budget[FaultCrash]--
	x.s.PrefillCrashed[p] = true
	for r := range x.m.cfg.Prompts {
		if q := &x.s.Req[r]; q.Submitted && int(q.P) == p {
			if q.S.Phase.Live() {
				q.S.Phase = SFailed
			}
			q.S.SrcHeld = false
		}
	}
	for i := range x.s.Src[p] {
		x.s.Src[p][i].Owner = Free // the node's memory is gone; what the NIC already read is in flight
	}
	x.s.ToPrefill[p].Clear()
	for d := range x.s.QPBack[p] {
		x.s.QPBack[p][d].Clear()
	}
}

// --- the queue pair ---

// place lands a WRITE: payload first, then its tag record (RC order). The NIC
// reads the source page now, so a source page reused early ships its new content.
func (x *sys) place(w Msg) {
	r := int(w.Req)
	pg := &x.pool(r)[w.Target.Page]
	switch pg.Owner {
	case w.Req:
		x.hit(WriteLanded)
	case Free:
		x.hit(WriteLandedFree)
	default:
		x.hit(WriteLandedForeign)
		if !x.s.Foreign.Happened {
			x.s.Foreign = ForeignWrite{Happened: true, Req: w.Req, Page: w.Target.Page, Owner: pg.Owner, Node: x.s.Req[r].D}
		}
	}
	data := x.srcPool(r)[w.Src].Data
	data.Corrupt = data.Corrupt || w.Damage == DamagedPayload
	pg.Data = data
	pg.Tag = Tag{Req: w.Req, Index: w.Index, Epoch: w.Target.Epoch, Sum: w.Sum}
	switch w.Damage {
	case DamagedTagReq:
		pg.Tag.Req = Tenant
	case DamagedTagIndex:
		pg.Tag.Index++
	case DamagedTagEpoch:
		pg.Tag.Epoch++
	}
	if !x.crashed(r) {
		x.s.Req[w.Req].S.Completed++
		x.senderProgress(int(w.Req))
	}
}

// cutQP moves queue pair (p, d) to the error state: everything in flight on
// it is flushed and nothing more can land, so every request that used it is
// fenced. Requests on other queue pairs are untouched.
func (x *sys) cutQP(p, d int, why Reason) {
	x.s.QP[p][d].Clear()
	x.s.QPBack[p][d].Clear()
	x.purge(p, d) // the writer is caught: its cached pages go (prefix.go)
	for r := range x.m.cfg.Prompts {
		if !x.s.Req[r].onPair(p, d) {
			continue
		}
		if snd := &x.s.Req[r].S; snd.Phase.Live() {
			x.hit(CutFails)
			x.freeSrc(r)
			snd.Phase = SFailed
			x.report(r, Failed, why)
		}
		rec := &x.s.Req[r].R
		switch rec.Phase {
		case RReserved:
			x.closeReceiver(r, why)
			x.report(r, Failed, why)
		case RQuarantine:
			x.release(r)
			rec.Phase = RClosed
		}
	}
}

// fenceQP cuts queue pair (p, d) for good, because one end was declared
// lost: it stays in error, so nothing the lost node (still alive, perhaps)
// posts afterwards can land or be answered.
func (x *sys) fenceQP(p, d int) {
	x.s.Fenced[p][d] = true
	x.cutQP(p, d, PeerFailed)
}

// --- decode (receiver) ---

func (x *sys) decodeRecvQP(p, d, choice int) {
	msg := x.s.QP[p][d].Pop()
	r := int(msg.Req)
	switch msg.Kind {
	case MWrite:
		x.place(msg)
	case MBootstrap:
		x.reserve(r, msg, choice)
	case MDone:
		x.done(msg)
	case MAbortAck:
		x.fence(r, PeerFailed)
	}
}

func (x *sys) peerCancel(r int) {
	if !x.bug(NoPeerCancel) {
		x.toQPBack(r, Msg{Kind: MAbort, Req: int8(r)})
	}
}

// reserve is decode's intake and reservation (steps 1-2).
func (x *sys) reserve(r int, b Msg, choice int) {
	c := &x.m.cfg
	rec := &x.s.Req[r].R
	switch rec.Phase {
	case RTombstone:
		// Cancelled before it arrived: refuse, so the sender stops.
		x.hit(DecodeTombstone)
		x.toQPBack(r, Msg{Kind: MAbort, Req: int8(r)})
		return
	case RNone:
	default:
		x.hit(DecodeDuplicate)
		return // duplicate
	}
	t := int(b.Tokens)
	if t > c.DecodeLimit() && !x.mut(DecodeIgnoresLimit) {
		x.hit(DecodeOverLimit)
		rec.Phase, rec.Reason = RRejected, OverLimit
		x.report(r, Rejected, OverLimit)
		x.peerCancel(r)
		return
	}
	n := c.PagesFor(t)
	d := int(x.s.Req[r].D)
	slot := freeSlot(x.s, d, c.DecodeSlots)
	pl := x.m.plan(x.s, d, r, b, n)
	if pl.scopeMiss {
		x.hit(PrefixScopeMiss)
	}
	if pl.skipped {
		x.hit(EvictSkipsPinned)
	}
	if slot < 0 || !pl.ok {
		if slot < 0 {
			x.hit(DecodeNoSlot)
		} else {
			x.hit(DecodeNoPages)
			x.touchHit(d, &pl) // pinned and unpinned again: used, all the same
		}
		rec.Phase, rec.Reason, rec.Released = RClosed, NoCapacity, true
		x.report(r, Failed, NoCapacity)
		x.peerCancel(r)
		return
	}
	x.hit(DecodeReserve)
	if pl.cands.n == pl.fresh {
		x.hit(DecodeExactlyFull)
	}
	for q := range c.Prompts {
		if q != r && x.s.Req[q].D == int8(d) && x.s.Req[q].R.Slot == slot && x.s.Req[q].R.Phase != RNone {
			x.hit(DecodeReusedSlot)
			break
		}
	}
	x.takePrefix(r, d, &pl)
	reused := false
	fresh := nthTuple(pl.cands.list(), pl.fresh, choice)
	for j, p := range fresh.list() {
		pg := &x.pool(r)[p]
		reused = reused || pg.Epoch > 0
		pg.Epoch++
		pg.Owner, pg.Quarantined = int8(r), false
		rec.Pages[pl.k+j] = PageRef{Page: p, Epoch: pg.Epoch}
	}
	if reused {
		x.hit(DecodeReusedPage)
	}
	rec.N, rec.Slot, rec.Phase = uint8(n), slot, RReserved
	x.slots(r)[slot] = int8(r)
	grant := Msg{Kind: MGrant, Req: int8(r), Tokens: uint8(t), Pages: uint8(n - pl.k), Prefix: uint8(pl.k), Slot: slot}
	if x.bug(WriteShared) {
		grant.Pages, grant.Prefix = uint8(n), 0 // the pinned pages granted too
	}
	x.toQPBack(r, grant)
}

// done handles Done (step 6). RC ordering means every WRITE posted before it has
// been placed, so Done is also the sender's fence.
func (x *sys) done(d Msg) {
	r := int(d.Req)
	if x.bug(DoneUnmatched) {
		// Matched by slot: whoever holds the slot now gets it.
		r = -1
		if d.Slot >= 0 && int(d.Slot) < x.m.cfg.DecodeSlots {
			r = int(x.slots(int(d.Req))[d.Slot])
		}
		if r < 0 {
			return
		}
	}
	rec := &x.s.Req[r].R
	if rec.Phase != RReserved {
		x.hit(DoneFence)
		x.fence(r, PeerFailed)
		return
	}
	why := x.verify(r, d)
	if why == ChecksumMismatch && x.bug(ChecksumHangs) {
		return // the mismatch is logged, and the request waits for a Done that has come
	}
	if why != NoReason {
		x.closeReceiver(r, why)
		x.report(r, Failed, why)
		x.peerCancel(r)
		via := &x.s.Req[d.Req]          // the queue pair the Done came on
		x.purge(int(via.P), int(via.D)) // its KV is suspect: so is what it wrote before (prefix.go)
		return
	}
	x.hit(VerifyOK)
	rec.Phase = RReady
}

// verify checks a Done against the reservation: counts, tag records, checksums.
func (x *sys) verify(r int, d Msg) Reason {
	c := &x.m.cfg
	rec := &x.s.Req[r].R
	if !x.bug(NoTokenCheck) {
		switch {
		case int(d.Tokens) != c.Prompts[r]:
			x.hit(VerifyTokens)
			return TokenMismatch
		case d.Prefix != rec.Prefix && !x.mut(NoDonePrefixCheck):
			x.hit(VerifyPrefix)
			return TokenMismatch
		case d.Pages != rec.N-rec.Prefix:
			x.hit(VerifyPages)
			return TokenMismatch
		}
	}
	for i := 0; i < int(rec.Prefix); i++ {
		if !x.sharedOK(r, i) && !x.mut(NoPinnedCheck) {
			x.hit(VerifyPinned)
			return TagMismatch
		}
	}
	for i := int(rec.Prefix); i < int(rec.N); i++ {
		ref := rec.Pages[i]
		pg := &x.pool(r)[ref.Page]
		if !x.bug(NoTagCheck) {
			switch {
			case pg.Epoch != ref.Epoch && !x.mut(NoPoolEpochCheck):
				x.hit(VerifyPageEpoch)
				return TagMismatch
			case pg.Tag.Req != int8(r):
				x.hit(VerifyTagRequest)
				return TagMismatch
			case pg.Tag.Index != int8(i):
				x.hit(VerifyTagIndex)
				return TagMismatch
			case pg.Tag.Epoch != ref.Epoch:
				x.hit(VerifyTagEpoch)
				return TagMismatch
			}
		}
		if !x.bug(NoChecksum) && pg.Data != pg.Tag.Sum {
			if i == 0 {
				x.hit(VerifyChecksumFirst)
			} else {
				x.hit(VerifyChecksumLater)
			}
			return ChecksumMismatch
		}
	}
	return NoReason
}

// fence handles a signal that r's writer can write no more: Done for an aborted
// request, AbortAck, or a cut. A terminal record ignores it (idempotent).
func (x *sys) fence(r int, why Reason) {
	rec := &x.s.Req[r].R
	switch rec.Phase {
	case RQuarantine:
		x.hit(FenceQuarantine)
		x.release(r)
		rec.Phase = RClosed
	case RReserved:
		// The sender gave up on its own.
		x.hit(FenceReserved)
		x.closeReceiver(r, why)
		x.report(r, Failed, why)
	case RFinished, RClosed:
		x.hit(FenceEnded)
		if x.bug(DoubleFree) {
			x.release(r)
		}
	}
}

// closeReceiver ends a live record whose writer is fenced.
func (x *sys) closeReceiver(r int, why Reason) {
	rec := &x.s.Req[r].R
	x.freeSlotOf(r)
	x.release(r)
	rec.Phase, rec.Reason = RClosed, why
}

func (x *sys) freeSlotOf(r int) {
	rec := &x.s.Req[r].R
	if rec.Slot >= 0 && x.slots(r)[rec.Slot] == int8(r) {
		x.slots(r)[rec.Slot] = Free
	}
}

// release gives r's pages back: only pages r still owns at the epoch it was
// granted. With double-free, a second release frees the recorded pages blindly.
func (x *sys) release(r int) {
	rec := &x.s.Req[r].R
	if rec.Released {
		if x.bug(DoubleFree) {
			for i := 0; i < int(rec.N); i++ {
				pg := &x.pool(r)[rec.Pages[i].Page]
				pg.Owner, pg.Quarantined = Free, false
			}
		}
		return
	}
	if rec.Phase != RQuarantine { // a quarantined record unpinned as it was aborted
		x.unpin(r)
	}
	if x.mut(InsertUnverified) {
		x.insert(r) // at every end, verified or not
	}
	for i := int(rec.Prefix); i < int(rec.N); i++ {
		ref := rec.Pages[i]
		pg := &x.pool(r)[ref.Page]
		if pg.Owner == int8(r) && pg.Epoch == ref.Epoch || x.mut(ReleaseIgnoresEpoch) {
			pg.Owner, pg.Quarantined = Free, false
		}
	}
	rec.Released = true
}

// abortDecode ends r on the decode side before it was read. A writer may still be
// live, so pages stay quarantined until the fence, unless early is set (the
// eager-release and timeout-free bugs).
func (x *sys) abortDecode(r int, why Reason, cancelled, early bool) {
	rec := &x.s.Req[r].R
	leak := cancelled && x.bug(LeakOnCancel)
	switch rec.Phase {
	case RNone:
		if cancelled {
			x.hit(AbortTombstone)
			rec.Phase, rec.Reason = RTombstone, why
		}
	case RReserved:
		x.hit(AbortQuarantine)
		x.freeSlotOf(r)
		x.unpin(r) // the pins end with the slot: no writer can write a pinned page, so none waits for the fence
		rec.Reason = why
		if leak {
			rec.Phase, rec.Released = RClosed, true // the pages are forgotten, never returned
			return
		}
		rec.Phase = RQuarantine
		if early {
			x.release(r)
			return
		}
		for i := 0; i < int(rec.N); i++ {
			if pg := &x.pool(r)[rec.Pages[i].Page]; pg.Owner == int8(r) {
				pg.Quarantined = true
			}
		}
	case RReady:
		// Done arrived, so the writer is fenced: the pages can go back at once.
		x.hit(AbortReady)
		x.freeSlotOf(r)
		rec.Reason = why
		if leak {
			rec.Phase, rec.Released = RClosed, true
			return
		}
		x.release(r)
		rec.Phase = RClosed
	}
}

func (x *sys) decodeRecv(d int) {
	msg := x.s.ToDecode[d].Pop()
	switch msg.Kind {
	case MAbort:
		x.abortDecode(int(msg.Req), ClientCancelled, true, x.bug(EagerRelease))
	case MPeerFailed:
		x.fenceQP(int(msg.Peer), d) // the fence for a lost prefill node: move the queue pair to it to error
	case MPeerRestarted:
		x.acceptIncarnation(int(msg.Peer), d, msg.Inc)
	}
}

// acceptIncarnation is decode node d's reaction to prefill node p's new
// incarnation inc (the registry's new record, or the hello of its new
// connection): it cuts the queue pair of the old incarnation, failing its
// requests and fencing what the old one posted, and only then holds a
// queue pair for the new one. (No switch keeps the old queue pair: a
// reconnect is a new queue pair under a new protocol.PeerID in transfer, so
// the implementation cannot take one for the other.)
func (x *sys) acceptIncarnation(p, d int, inc uint8) {
	x.hit(RestartFence)
	if !x.mut(NoRestartFence) {
		x.cutQP(p, d, PeerFailed)
	}
	x.s.QPInc[p][d], x.s.Fenced[p][d] = inc, false
}

func (x *sys) timeout(r int) {
	x.s.Budget[FaultTimeout]--
	x.abortDecode(r, TimedOut, false, x.bug(TimeoutFree))
	x.report(r, Failed, TimedOut)
	x.peerCancel(r)
}

// decodeRead is step 7: attend over every page, checking each page's epoch.
func (x *sys) decodeRead(r int) {
	q := &x.s.Req[r]
	rec := &q.R
	for i := 0; i < int(rec.Prefix); i++ {
		if !x.sharedOK(r, i) && !x.mut(NoSharedReadCheck) {
			x.hit(ReadShared)
			x.closeReceiver(r, TagMismatch)
			x.report(r, Failed, TagMismatch)
			return
		}
	}
	if !x.bug(NoTagCheck) {
		for i := int(rec.Prefix); i < int(rec.N); i++ {
			if ref := rec.Pages[i]; x.pool(r)[ref.Page].Epoch != ref.Epoch && !x.mut(NoReadEpochCheck) {
				x.hit(ReadEpoch)
				x.closeReceiver(r, TagMismatch)
				x.report(r, Failed, TagMismatch)
				return
			}
		}
	}
	for i := 0; i < int(rec.N); i++ {
		q.ReadData[i] = x.pool(r)[rec.Pages[i].Page].Data
	}
	x.hit(ReadOK)
	q.Read, q.ReadN = true, rec.N
	x.freeSlotOf(r)
	x.insert(r)
	x.release(r)
	rec.Phase = RFinished
	x.report(r, OK, NoReason)
}

// dropDecode empties decode node d as a restart or a partition leaves it:
// no request records, every page free at epoch 0, no cache, no slot held,
// nothing in flight to it from the router.
func (x *sys) dropDecode(d int) {
	for r := range x.m.cfg.Prompts {
		if q := &x.s.Req[r]; q.Submitted && int(q.D) == d {
			q.R = Receiver{Slot: -1}
		}
	}
	for i := range x.s.Pages[d] {
		pg := &x.s.Pages[d][i]
		pg.Owner, pg.Quarantined, pg.Epoch = Free, false, 0
	}
	clearCache(x.s, d)
	for i := range x.s.Slots[d] {
		x.s.Slots[d][i] = Free
	}
	x.s.ToDecode[d].Clear()
}
