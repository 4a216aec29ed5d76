package spec

import (
	"slices"
	"testing"

	"github.com/kvhandoff/kvhandoff/spec/checker"
)

// explore runs the checker over m, looking for every property's first violation.
func explore(t *testing.T, m *Model) []string {
	t.Helper()
	var p checker.Properties[State]
	for _, inv := range Invariants {
		p.Invariants = append(p.Invariants, checker.Invariant[State]{Name: inv.Name, Holds: func(s *State) bool { return inv.Holds(m, s) }})
	}
	for _, g := range Goals {
		p.Goals = append(p.Goals, checker.Goal[State]{Name: g.Name, Reached: func(s *State) bool { return g.Reached(m, s) }})
	}
	res, err := checker.Check(m, p, checker.Options{All: true, DeadlockName: Termination, MaxStates: 2_000_000})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, v := range res.Violations {
		out = append(out, v.Property)
	}
	return out
}

// mutant is cfg's model with one deliberate mistake, injected around each step
// by the test hook. The same configuration without it must pass, so that the
// violation is the mistake's.
func mutant(t *testing.T, cfg Config, mistake func(a Action, s *State, step func())) *Model {
	t.Helper()
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if got := explore(t, m); len(got) > 0 {
		t.Fatalf("the unmutated configuration already violates %v", got)
	}
	m.mutate = mistake
	return m
}

func wantViolated(t *testing.T, m *Model, prop string) {
	t.Helper()
	if got := explore(t, m); !slices.Contains(got, prop) {
		t.Fatalf("violated %v, want %s among them", got, prop)
	}
}

// A request served ok is not failed later: here detecting the crash reports
// every dispatched request failed, even one already served.
func TestOutcomeFinalCatchesAnOKReportedFailedAfterACrash(t *testing.T) {
	cfg := DefaultConfig()
	cfg.MaxFaults = 1
	m := mutant(t, cfg, func(a Action, s *State, step func()) {
		step()
		if a.Kind == DetectCrash {
			for r := range s.Req {
				if s.Req[r].Outcome == OK {
					s.Req[r].Outcome, s.Req[r].Reason = Failed, PeerFailed
				}
			}
		}
	})
	wantViolated(t, m, OutcomeFinal)
}

// A slot that is never given back leaks, even when every page comes back.
func TestNoLeakCatchesASlotNeverReturned(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Faults = Budget{}
	m := mutant(t, cfg, func(a Action, s *State, step func()) {
		slot := s.Req[max(a.Req, 0)].R.Slot
		step()
		if a.Kind == DecodeRead && s.Req[a.Req].R.Phase == RFinished {
			s.Slots[0][slot] = a.Req
		}
	})
	wantViolated(t, m, NoLeak)
}

// A record that still says it holds source pages leaks, though the pages are free.
func TestNoLeakCatchesARecordThatStillHoldsItsSourcePages(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Faults = Budget{}
	m := mutant(t, cfg, func(a Action, s *State, step func()) {
		step()
		for r := range s.Req {
			if s.Req[r].S.Phase == SFinished {
				s.Req[r].S.SrcHeld = true
			}
		}
	})
	wantViolated(t, m, NoLeak)
}

// exactlyFull is a pool one request fills exactly: two prompts of two pages
// each, two decode pages, two source pages, one slot.
func exactlyFull() Config {
	c := NewConfig(2, 2, 2)
	c.Prompts = []int{4, 4}
	c.PrefillPages, c.DecodeSlots = 2, 1
	c.Faults = Budget{}
	return c
}

// Capacity checks off by one refuse a request that fits exactly.
func TestNoSpuriousFailureCatchesACapacityCheckOffByOne(t *testing.T) {
	t.Run("decode", func(t *testing.T) {
		m := mutant(t, exactlyFull(), func(a Action, s *State, step func()) {
			hidden := int8(-1)
			if h := s.QP[0][0].Head(); a.Kind == DecodeRecvQP && s.QP[0][0].N > 0 && h.Kind == MBootstrap {
				if free := freePages(s, 0, 2); free.n == (int(h.Tokens)+1)/2 {
					hidden = free.p[0] // the check counts one page fewer than there is
					s.Pages[0][hidden].Owner = MaxRequests
				}
			}
			step()
			if hidden >= 0 {
				s.Pages[0][hidden].Owner = Free
			}
		})
		wantViolated(t, m, NoSpuriousFailure)
	})
	t.Run("prefill", func(t *testing.T) {
		m := mutant(t, exactlyFull(), func(a Action, s *State, step func()) {
			hidden := -1
			if a.Kind == PrefillRecv && s.ToPrefill[0].Head().Kind == MPrefill && s.Src[0][0].Owner == Free && s.Src[0][1].Owner == Free {
				hidden = 0
				s.Src[0][0].Owner = MaxRequests
			}
			step()
			if hidden >= 0 {
				s.Src[0][hidden].Owner = Free
			}
		})
		wantViolated(t, m, NoSpuriousFailure)
	})
	t.Run("router", func(t *testing.T) {
		m := mutant(t, exactlyFull(), func(a Action, s *State, step func()) {
			step()
			if a.Kind == Submit && exactlyFull().Prompts[a.Req] >= exactlyFull().ContextLimit { // > written as >=
				s.ToPrefill[0].N-- // the Prefill message it just sent is not sent
				s.ToPrefill[0].Buf[s.ToPrefill[0].N] = Msg{}
				s.Req[a.Req].Outcome, s.Req[a.Req].Reason = Rejected, OverLimit
			}
		})
		wantViolated(t, m, NoSpuriousFailure)
	})
}

// A failure a fault explains is no spurious failure, and neither is a refusal
// for a pool that is really full; the unmutated runs above show the second.
func TestNoSpuriousFailureAllowsFailuresAfterAFault(t *testing.T) {
	w := newWorld(t, 0).granted(0)
	w.do(PostWrite, 0, Corrupt).do(DecodeRecvQP, 0, 0)
	if w.s.Req[0].Outcome != Failed || !w.holds(NoSpuriousFailure) {
		t.Fatalf("a checksum failure after a corrupt fault is explained: %+v %+v", w.s.Req[0], w.s.Ghost)
	}
}

// restarts is a one-pair deployment whose prefill node may crash and come
// back once under a new incarnation.
func restarts() Config {
	c := NewConfig(2, 2, 2)
	c.Faults = Budget{}
	c.Faults[FaultCrash], c.Faults[FaultRestart], c.Faults[FaultLate] = 1, 1, 1
	return c
}

// A decode node that accepts the new incarnation's queue pair but keeps what
// the old one had in flight on it (at the router's PeerFailed, and again at
// the news of the restart) lets the old incarnation's messages land.
func TestNoOldIncarnationCatchesAQueuePairKeptAcrossARestart(t *testing.T) {
	m := mutant(t, restarts(), func(a Action, s *State, step func()) {
		restarted := a.Kind == DecodeRecv && s.ToDecode[a.Arg].Head().Kind != MAbort
		kept := s.QP[0][0]
		step()
		if restarted {
			s.QP[0][0] = kept // the cut forgot the queue
		}
	})
	wantViolated(t, m, NoOldIncarnation)
}

// A router that does not fail the requests of the incarnation a restart
// replaced lets one of them reach the client as ok.
func TestNoOldIncarnationCatchesARequestOfTheOldIncarnationServed(t *testing.T) {
	m := mutant(t, restarts(), func(a Action, s *State, step func()) {
		before := s.Req
		step()
		if a.Kind == Restart {
			for r := range s.Req {
				if before[r].Outcome == Pending {
					s.Req[r].Outcome, s.Req[r].Reason = Pending, NoReason
				}
			}
		}
	})
	wantViolated(t, m, NoOldIncarnation)
}

// decodeRestarts is one pair, two one-page requests, a late WRITE and a
// restart of the decode node: an old incarnation's WRITE can be in flight
// at the restart, and the new pool's page numbers and epochs (from zero
// again) are the old one's.
func decodeRestarts() Config {
	c := NewConfig(2, 2, 2)
	c.Prompts = []int{2, 2}
	c.Faults = Budget{}
	c.Faults[FaultRestart], c.Faults[FaultLate] = 1, 1
	c.DecodeRestarts = true
	return c
}

// shortViolation explores m and returns the length of NoOldIncarnation's
// counterexample, failing unless there is one.
func shortViolation(t *testing.T, m *Model) int {
	t.Helper()
	var p checker.Properties[State]
	for _, inv := range Invariants {
		p.Invariants = append(p.Invariants, checker.Invariant[State]{Name: inv.Name, Holds: func(s *State) bool { return inv.Holds(m, s) }})
	}
	res, err := checker.Check(m, p, checker.Options{All: true, DeadlockName: Termination, MaxStates: 2_000_000})
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range res.Violations {
		if v.Property == NoOldIncarnation {
			return len(v.Trace)
		}
	}
	var got []string
	for _, v := range res.Violations {
		got = append(got, v.Property)
	}
	t.Fatalf("NoOldIncarnation holds; violated: %v", got)
	return 0
}

// A decode node that restarts but keeps its old queue pair's inbound queue
// (the new incarnation takes over the old connection) lets a WRITE posted
// to the old incarnation, at the old grant's page and epoch, land in the new
// pool, where page numbers and epochs start again.
func TestNoOldIncarnationCatchesADecodeRestartThatKeepsTheOldQueuePair(t *testing.T) {
	m := mutant(t, decodeRestarts(), func(a Action, s *State, step func()) {
		kept := s.QP[0][0]
		step()
		if a.Kind == Restart && a.Arg&DecodeNode != 0 {
			s.QP[0][0] = kept
		}
	})
	if n := shortViolation(t, m); n > 12 {
		t.Fatalf("counterexample of %d steps, want at most 12", n)
	} else {
		t.Logf("counterexample of %d steps", n)
	}
}

// A prefill node that cuts its queue pair to a restarted decode node's old
// incarnation but keeps what the old one had sent on it takes a Grant of the
// old incarnation once it holds the new one's queue pair: its WRITEs then go
// to pages of a pool that is gone, on the new incarnation's queue pair.
func TestNoOldIncarnationCatchesAGrantOfTheOldDecodeIncarnationAccepted(t *testing.T) {
	cfg := decodeRestarts()
	cfg.Faults[FaultLate] = 0
	m := mutant(t, cfg, func(a Action, s *State, step func()) {
		kept := s.QPBack[0][0]
		cut := a.Kind == PrefillRecv && (s.ToPrefill[0].Head().Kind == MPeerRestarted || s.ToPrefill[0].Head().Kind == MPeerFailed)
		step()
		if cut {
			s.QPBack[0][0] = kept
		}
	})
	if n := shortViolation(t, m); n > 12 {
		t.Fatalf("counterexample of %d steps, want at most 12", n)
	} else {
		t.Logf("counterexample of %d steps", n)
	}
}
