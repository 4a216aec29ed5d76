package node

import (
	"context"
	"errors"
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

// A static peer list follows a peer as a registry's watch does: the stop
// its record announces is registered again (routers then send it nothing
// new), and the stop's end, its control API gone, is its loss at once (the
// router's retry and deferred loss key on both). A peer that announced no
// stop is lost only once it has not answered for peerLoseAfter: a node
// that merely missed a read keeps its requests.
func TestPeerListFollowsAPeersStopToItsLoss(t *testing.T) {
	for _, announced := range []bool{true, false} {
		t.Run(map[bool]string{true: "announced", false: "unannounced"}[announced], func(t *testing.T) {
			l, err := StartLocal(LocalConfig{Log: quietLog(), unannouncedStops: !announced})
			if err != nil {
				t.Fatal(err)
			}
			defer l.Stop()
			dec := l.Decode(0)
			dec.mu.Lock()
			want := dec.self
			dec.mu.Unlock()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			list := NewPeerList(ctx, []Peer{{Name: "decode-0", Control: want.Control}}, l.Router.cfg.Security, quietLog())
			changes, err := list.Watch(ctx)
			if err != nil {
				t.Fatal(err)
			}
			next := func() Change {
				t.Helper()
				select {
				case ch := <-changes:
					return ch
				case <-time.After(15 * time.Second):
					t.Fatal("no change from the peer list")
					return Change{}
				}
			}
			if ch := next(); ch.Kind != Joined || ch.Member != want {
				t.Fatalf("first %v %+v, want joined %+v", ch.Kind, ch.Member, want)
			}
			if announced {
				// As announceStopping marks it (its settle, long enough for
				// a peer list's reads, is the process test's to show:
				// TestARollingRestartOfServeProcessesFailsNoRequest).
				dec.mu.Lock()
				dec.self.Stopping = true
				dec.mu.Unlock()
				stopping := want
				stopping.Stopping = true
				if ch := next(); ch.Kind != Joined || ch.Member != stopping {
					t.Fatalf("as the stop began: %v %+v, want its record again, stopping", ch.Kind, ch.Member)
				}
			}
			asked := time.Now()
			stopped := make(chan error, 1)
			go func() { stopped <- l.StopDecode(0) }()
			ch := next()
			if ch.Kind != Lost || ch.Member.Name != "decode-0" {
				t.Fatalf("after the stop: %v %+v, want decode-0 lost", ch.Kind, ch.Member)
			}
			if lost := time.Since(asked); !announced && lost < peerLoseAfter {
				t.Fatalf("a peer that announced no stop was lost %v after its stop began, before peerLoseAfter (%v)", lost, peerLoseAfter)
			}
			if err := <-stopped; err != nil {
				t.Fatal(err)
			}
		})
	}
}

// A listed peer that a static list loses stays admitted, its role unknown,
// as at start-up: deleted, two nodes that lost each other (a partition of
// over 5 s) would each refuse the other's read of its record, which needs
// the name, and never find each other again.
func TestALostListedPeerIsStillAdmitted(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Nothing answers there: the list's own reads change nothing.
	list := NewPeerList(ctx, []Peer{{Name: "prefill-0", Control: "127.0.0.1:1"}}, Security{}, quietLog())
	r, err := watchRoster(ctx, list)
	if err != nil {
		t.Fatal(err)
	}
	m := Member{Name: "prefill-0", Role: RolePrefill, Control: "127.0.0.1:1", PoolPages: 1, PageTokens: 1, PageBytes: 1}
	if _, err := list.Static.Register(ctx, m); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the roster seeing prefill-0 join", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.roles["prefill-0"] == RolePrefill
	})
	list.Static.Remove("prefill-0")
	waitUntil(t, "the roster seeing prefill-0 lost", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.roles["prefill-0"] == ""
	})
	if err := r.admit("prefill-0", pki.Role(RolePrefill), 0); err != nil {
		t.Fatalf("a listed peer, lost: %v", err)
	}
	if err := r.admit("prefill-9", pki.Role(RolePrefill), 0); err == nil {
		t.Fatal("an unlisted name admitted")
	}
}

// A roster admits a queue pair's hello only as the life the registry
// lists for the node (its record's incarnation): another life is refused
// once the wait for the registry's news of it runs out, and a restart
// whose record arrives while its hello waits is admitted. Where no record
// has answered (a listed peer lost) any life is admitted, as any name of
// the list is: such a peer may connect again after any cut. So the life a
// cut spares (a later one) is one the registry names.
func TestARosterAdmitsOnlyTheLifeTheRegistryLists(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s, err := NewStatic()
	if err != nil {
		t.Fatal(err)
	}
	r, err := watchRoster(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	m := Member{Name: "prefill-0", Role: RolePrefill, Control: "127.0.0.1:1", PoolPages: 1, PageTokens: 1, PageBytes: 1, Incarnation: 7}
	if _, err := s.Register(ctx, m); err != nil {
		t.Fatal(err)
	}
	prefill := pki.Role(RolePrefill)
	if err := r.admit("prefill-0", prefill, 7); err != nil {
		t.Fatalf("the registered life: %v", err)
	}
	if err := r.admit("prefill-0", prefill, 8); !errors.Is(err, pki.ErrUnknownPeer) {
		t.Fatalf("a life the registry does not list: %v, want pki.ErrUnknownPeer", err)
	}
	// A restart: its hello comes before the registry's news of it.
	admitted := make(chan error, 1)
	go func() { admitted <- r.admit("prefill-0", prefill, 9) }()
	next := m
	next.Incarnation = 9
	if _, err := s.Register(ctx, next); err != nil {
		t.Fatal(err)
	}
	if err := <-admitted; err != nil {
		t.Fatalf("a restart whose record came as its hello waited: %v", err)
	}
	if err := r.admit("prefill-0", prefill, 7); !errors.Is(err, pki.ErrUnknownPeer) {
		t.Fatalf("the old life after the restart: %v, want pki.ErrUnknownPeer", err)
	}

	list := NewPeerList(ctx, []Peer{{Name: "prefill-1", Control: "127.0.0.1:1"}}, Security{}, quietLog())
	lr, err := watchRoster(ctx, list)
	if err != nil {
		t.Fatal(err)
	}
	if err := lr.admit("prefill-1", prefill, 12345); err != nil {
		t.Fatalf("a listed peer whose record has not answered: %v", err)
	}
}
