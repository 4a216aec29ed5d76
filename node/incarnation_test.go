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
	rt, err := NewRouter(RouterConfig{Security: Security{Insecure: true}, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	pre := Member{Name: "prefill-1", Role: RolePrefill, Control: "127.0.0.1:1", PoolPages: 8, PageTokens: 4, Model: "m", Incarnation: 1}
	dec := Member{Name: "decode-1", Role: RoleDecode, Control: "127.0.0.1:1", Transfer: "127.0.0.1:1", PoolPages: 8, PageTokens: 4, Model: "m", Incarnation: 1}
	rt.change(Change{Kind: Joined, Member: pre})
	rt.change(Change{Kind: Joined, Member: dec})
	rt.mu.Lock()
	if _, err := rt.r.Submit(1, 4, time.Now()); err != nil {
		rt.mu.Unlock()
		t.Fatal(err)
	}
	rt.r.Effects() // the dispatch is not sent: no node listens
	rt.mu.Unlock()
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
