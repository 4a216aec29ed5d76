package node

import (
	"errors"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// A node that restarts before its old lease expired registers again under
// its name with a larger incarnation: the router takes that for the loss of
// the old life, whose requests fail, not for an advertisement update. The
// same incarnation registering again changes nothing.
func TestRouterTakesANewIncarnationForTheLossOfTheOld(t *testing.T) {
	pre := Member{Name: "prefill-1", Role: RolePrefill, Control: "127.0.0.1:1", PoolPages: 8, PageTokens: 4, Model: "m", Incarnation: 1}
	rt := routerWithRequestOn(t, pre)
	status := func() protocol.RouteInfo {
		rt.mu.Lock()
		defer rt.mu.Unlock()
		return rt.r.Request(1)
	}
	rt.change(Change{Kind: Joined, Member: pre}) // the same life advertising again
	if st := status(); st.Status != protocol.RouteRunning {
		t.Fatalf("an advertisement update decided request 1: %+v", st)
	}
	pre.Incarnation = 2
	rt.change(Change{Kind: Joined, Member: pre})
	if st := status(); st.Status == protocol.RouteRunning || !errors.Is(st.Err, protocol.ErrNodeLost) {
		t.Fatalf("after the restart request 1 is %+v, want failed with ErrNodeLost", st)
	}
}

// Incarnations are start times, and a wall clock can step back (NTP, a
// migrated VM) across a restart. The registry's record is the current one,
// so a smaller incarnation is a restart too: the old life's requests fail and
// the node is routed to again, instead of being refused for ever.
func TestRouterTakesASmallerIncarnationFromTheRegistryForARestart(t *testing.T) {
	pre := Member{Name: "prefill-1", Role: RolePrefill, Control: "127.0.0.1:1", PoolPages: 8, PageTokens: 4, Model: "m", Incarnation: 100}
	rt := routerWithRequestOn(t, pre)
	pre.Incarnation = 40 // restarted after the clock went back
	rt.change(Change{Kind: Joined, Member: pre})
	rt.mu.Lock()
	defer rt.mu.Unlock()
	if st := rt.r.Request(1); st.Status == protocol.RouteRunning || !errors.Is(st.Err, protocol.ErrNodeLost) {
		t.Fatalf("after the restart request 1 is %+v, want failed with ErrNodeLost", st)
	}
	if got := rt.members[rt.ids["prefill-1"]].Incarnation; got != 40 {
		t.Fatalf("the router knows prefill-1 as incarnation %d, want 40", got)
	}
	live := false
	for _, n := range rt.r.Nodes() {
		live = live || n.Info.ID == rt.ids["prefill-1"] && n.Info.Incarnation == 40
	}
	if !live {
		t.Fatalf("prefill-1 under its new incarnation is not routed to: %+v", rt.r.Nodes())
	}
}

// routerWithRequestOn makes a router that knows pre and a decode node, with
// request 1 dispatched (not sent: no node listens).
func routerWithRequestOn(t *testing.T, pre Member) *Router {
	t.Helper()
	rt, err := NewRouter(RouterConfig{Security: Security{Insecure: true}, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	dec := Member{Name: "decode-1", Role: RoleDecode, Control: "127.0.0.1:1", Transfer: "127.0.0.1:1", PoolPages: 8, PageTokens: 4, Model: "m", Incarnation: 1}
	rt.change(Change{Kind: Joined, Member: pre})
	rt.change(Change{Kind: Joined, Member: dec})
	rt.mu.Lock()
	defer rt.mu.Unlock()
	if _, err := rt.r.Submit(1, 4, time.Now()); err != nil {
		t.Fatal(err)
	}
	rt.r.Effects()
	return rt
}
