package node

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/pki"
)

// --peers: each peer's record is read from its own control API over mutual
// TLS, and only under the name its certificate carries: a peer listed under
// another node's name never joins.
func TestPeerListReadsEachPeersRecordUnderItsCertifiedName(t *testing.T) {
	l, err := StartLocal(LocalConfig{Log: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	pre, dec := l.Prefills[0], l.Decodes[0]
	pre.mu.Lock()
	preAddr := pre.self.Control
	pre.mu.Unlock()
	dec.mu.Lock()
	want := dec.self
	dec.mu.Unlock()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// A certificate of the deployment's CA: the one the router would carry.
	sec := l.Router.cfg.Security
	list := NewPeerList(ctx, []Peer{{Name: "decode-0", Control: want.Control}, {Name: "decode-9", Control: preAddr}}, sec, quietLog())
	changes, err := list.Watch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case ch := <-changes:
		if ch.Kind != Joined || ch.Member != want {
			t.Fatalf("joined %v %+v, want %+v", ch.Kind, ch.Member, want)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("decode-0 never joined")
	}
	select {
	case ch := <-changes:
		t.Fatalf("a peer listed under a name its certificate does not carry joined: %+v", ch)
	case <-time.After(500 * time.Millisecond):
	}
	// A node of the deployment that is not the router may read records but
	// not call the legs.
	err = newControlClient(pre.cfg.Security).call(ctx, "decode-0", want.Control, pathCancel, cancelCall{ID: 1}, nil)
	if err == nil || !strings.Contains(err.Error(), "403") {
		t.Fatalf("prefill-0 cancelled a request on decode-0: %v", err)
	}
	// A caller from another authority is refused at the handshake.
	other, err := pki.NewCA("other")
	if err != nil {
		t.Fatal(err)
	}
	tc, err := other.Config("router")
	if err != nil {
		t.Fatal(err)
	}
	var m Member
	cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
	defer ccancel()
	if err := newControlClient(Security{TLS: tc}).call(cctx, "decode-0", want.Control, pathInfo, nil, &m); err == nil {
		t.Fatalf("a stranger's certificate read decode-0's record: %+v", m)
	}
}
