package spec

import "testing"

// rogue reports the successor of w's state by the rogue WRITE of page with
// r's key, and whether that action is enabled.
func (w *world) rogue(r, page int) (State, bool) {
	var out State
	found := false
	cur := w.s
	w.m.Successors(&cur, func(a Action, n *State) {
		if a.Kind == RogueWrite && int(a.Req) == r && int(a.Arg) == page {
			out, found = *n, true
		}
	})
	return out, found
}

// tryRogue applies the rogue WRITE of page with r's key as a step (enabled
// or not: the step is the rule) and returns the state after it.
func (w *world) tryRogue(r, page int) State {
	n := w.s
	(&sys{m: w.m, s: &n}).rogueWrite(r, page)
	return n
}

func TestRevokedKeyWriteDoesNotLand(t *testing.T) {
	w := newWorld(t, 0).granted(0)
	w.do(PostWrite, 0, 0).do(DecodeRecvQP, 0, 0) // Done: the key is revoked, then r0 verified
	if w.s.Req[0].R.Phase != RReady {
		t.Fatalf("r0 should be verified, is %v", w.s.Req[0].R.Phase)
	}
	page := int(w.s.Req[0].R.Pages[0].Page)
	if n := w.tryRogue(0, page); n != w.s {
		t.Fatal("a WRITE with r0's revoked key changed the state")
	}
	if n, ok := w.rogue(0, page); !ok || n != w.s {
		t.Fatalf("the late writer's refused WRITE must be explored as a step back to the same state (enabled %v)", ok)
	}
	w.do(DecodeRead, 0, 0)
	if !w.holds(Isolation) || !w.holds(ReadAsVerified) || w.s.Req[0].Outcome != OK {
		t.Fatal("r0 must be read as verified")
	}
}

func TestVerifyBeforeRevokeLetsAVerifiedPageChange(t *testing.T) {
	w := newWorld(t, Switches(VerifyBeforeRevoke)).granted(0)
	w.do(PostWrite, 0, 0).do(DecodeRecvQP, 0, 0)
	page := int(w.s.Req[0].R.Pages[0].Page)
	n, ok := w.rogue(0, page)
	if !ok {
		t.Fatal("with the key live after verification, the rogue WRITE must land")
	}
	w.s = n
	if w.holds(ReadAsVerified) {
		t.Fatal("ReadAsVerified must catch a verified page that changed")
	}
}

func TestKeyCoversOnlyItsRequestsPages(t *testing.T) {
	w := newWorld(t, 0).granted(0)
	w.do(Submit, 1, 0).do(PrefillRecv, 1, 0).do(DecodeRecvQP, 1, 0).do(PrefillRecvQP, 1, 0)
	other := int(w.s.Req[1].R.Pages[0].Page)
	if n := w.tryRogue(0, other); n != w.s {
		t.Fatal("r0's live key reached r1's page")
	}
	// The same WRITE with one key for the pool lands in r1's page.
	w.m.cfg.Bugs = Switches(PoolWideKey)
	if n := w.tryRogue(0, other); n.Pages[0][other].Data.Req != Rogue || !n.Foreign.Happened {
		t.Fatal("pool-wide-key: the WRITE must land in r1's page, a foreign write")
	}
}

func TestKeyRevokedAtAbort(t *testing.T) {
	w := newWorld(t, 0).granted(0)
	w.do(PostWrite, 0, Late).do(Cancel, 0, 0).do(DecodeRecv, 0, 0)
	if w.s.Req[0].R.Phase != RQuarantine {
		t.Fatalf("r0 should be quarantined, is %v", w.s.Req[0].R.Phase)
	}
	if n := w.tryRogue(0, int(w.s.Req[0].R.Pages[0].Page)); n != w.s {
		t.Fatal("the abort must revoke the key")
	}
}

func TestDecodeReservesOnlyForDispatchedRequests(t *testing.T) {
	w := newWorld(t, 0)
	w.do(RogueBootstrap, 0, 0)
	if w.s.Req[0].R.Phase != RNone || w.s.Budget[FaultRogue] != 1 || !w.holds(Ticketed) {
		t.Fatal("decode must refuse a Bootstrap without the router's ticket and reserve nothing")
	}
	w = newWorld(t, Switches(UnticketedBootstrap))
	w.do(RogueBootstrap, 0, 0)
	if w.s.Req[0].R.Phase != RReserved || w.holds(Ticketed) {
		t.Fatal("unticketed-bootstrap: decode must reserve, and Ticketed catch it")
	}
}
