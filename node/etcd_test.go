package node

import (
	"context"
	"encoding/json"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kvhandoff/kvhandoff/internal/etcdtest"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// startEtcd starts a real etcd server on 127.0.0.1 for the test and returns
// its client address.
func startEtcd(t *testing.T) string { return etcdtest.Start(t) }

// holdKV blocks FillKV of the requests it is armed for until released.
type holdKV struct {
	src     transfer.KVSource
	mu      sync.Mutex
	armed   bool
	held    chan protocol.RequestID
	release chan struct{}
	last    protocol.RequestID
}

func (h *holdKV) FillKV(id protocol.RequestID, tokens int, pages []uint32, memory [][]byte) error {
	h.mu.Lock()
	armed := h.armed
	h.last = id
	h.mu.Unlock()
	if armed {
		h.held <- id
		<-h.release
	}
	return h.src.FillKV(id, tokens, pages, memory)
}

// Nodes register in a real etcd under leases; the router adds them as they
// appear. When a prefill node's lease goes (revoked here, as an expiry
// would), the router loses it: the request it held fails with an explicit
// error naming the lost node, and new requests flow through the survivor.
func TestEtcdRegistryLosesANodeWhoseLeaseEnds(t *testing.T) {
	addr := startEtcd(t)
	var hold *holdKV
	var regs []*Etcd
	defer func() {
		for _, r := range regs {
			r.Close()
		}
	}()
	l, err := StartLocal(LocalConfig{Prefills: 2, Decodes: 1, PrefillPages: 64, DecodePages: 64, PageTokens: 16, Log: quietLog(), Timeout: 20 * time.Second,
		NewRegistry: func(string) (Registry, error) {
			r, err := NewEtcd([]string{addr}, "/test/nodes", 2*time.Second, quietLog())
			if err == nil {
				regs = append(regs, r)
			}
			return r, err
		},
		prefillKV: func(i int, src transfer.KVSource) transfer.KVSource {
			if i != 0 {
				return src
			}
			hold = &holdKV{src: src, held: make(chan protocol.RequestID, 1), release: make(chan struct{})}
			return hold
		}})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	for i := range 6 {
		if a, err := complete(context.Background(), l.API, "t", strings.Repeat("warm up. ", 3+i), 4); err != nil || a.code != 200 {
			t.Fatalf("before the loss: %+v %v", a, err)
		}
	}
	hold.mu.Lock()
	hold.armed = true
	hold.mu.Unlock()
	// Requests until one is held on prefill-0 (the policy spreads them).
	type result struct {
		a   answer
		err error
	}
	results := make(chan result, 8)
	var held protocol.RequestID
	for held == 0 {
		go func() {
			a, err := complete(context.Background(), l.API, "t", "a request on the node about to be lost. ", 4)
			results <- result{a, err}
		}()
		select {
		case held = <-hold.held:
		case r := <-results:
			if r.err != nil || r.a.code != 200 {
				t.Fatalf("a request on the survivor: %+v %v", r.a, r.err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no request reached prefill-0")
		}
	}
	// Kill prefill-0's lease, as its expiry would.
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{addr}, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	resp, err := cli.Get(context.Background(), "/test/nodes/prefill-0")
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("prefill-0's record: %v %v", resp, err)
	}
	if _, err := cli.Revoke(context.Background(), clientv3.LeaseID(resp.Kvs[0].Lease)); err != nil {
		t.Fatal(err)
	}
	r := <-results
	if r.err != nil || r.a.code != 503 || !strings.Contains(r.a.err, "node lost") || !strings.Contains(r.a.err, "prefill-0") {
		t.Fatalf("the request on the lost node: %+v %v", r.a, r.err)
	}
	close(hold.release)
	hold.mu.Lock()
	hold.armed = false
	hold.mu.Unlock()
	for i := range 8 {
		a, err := complete(context.Background(), l.API, "t", strings.Repeat("after the loss. ", 2+i), 4)
		if err != nil || a.code != 200 {
			t.Fatalf("after the loss: %+v %v", a, err)
		}
	}
	if nodes := strings.Join(l.Router.nodes(), ","); strings.Contains(nodes, "prefill-0") {
		t.Fatalf("the router still routes to the lost node: %s", nodes)
	}
	// prefill-0 lost its registration and stopped; the rest hold no page.
	for _, d := range l.Decodes {
		deadline := time.Now().Add(10 * time.Second)
		for g := d.Endpoint().Gauges(); g.PagesFree != g.Pages; g = d.Endpoint().Gauges() {
			if time.Now().After(deadline) {
				t.Fatalf("decode pages held: %+v", g)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}

// A watch that breaks is not the end of the registry's news: Watch lists
// the registry again, reports what changed while it was broken (a member
// gone, a member new), and watches on. Before, the channel closed for good
// and a prefill node never dialled a decode node that joined afterwards.
func TestEtcdWatchResumesAfterItBreaks(t *testing.T) {
	addr := startEtcd(t)
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{addr}, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	const prefix = "/test/watch/"
	put := func(name string) {
		m := Member{Name: name, Role: RoleDecode, Control: "127.0.0.1:1", Transfer: "127.0.0.1:2", PoolPages: 4, PageTokens: 16, PageBytes: 64}
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Put(context.Background(), prefix+name, string(b)); err != nil {
			t.Fatal(err)
		}
	}
	put("decode-a")
	put("decode-b")
	reg, err := NewEtcd([]string{addr}, prefix, 2*time.Second, quietLog())
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Close()
	broken := make(chan clientv3.WatchResponse, 1)
	var calls atomic.Int32
	reg.watchHook = func(ctx context.Context, rev int64) clientv3.WatchChan {
		if calls.Add(1) == 1 {
			return broken // breaks when the test says
		}
		return reg.cli.Watch(clientv3.WithRequireLeader(ctx), reg.prefix, clientv3.WithPrefix(), clientv3.WithRev(rev))
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	changes, err := reg.Watch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	next := func() Change {
		t.Helper()
		select {
		case c, ok := <-changes:
			if !ok {
				t.Fatal("the watch ended")
			}
			return c
		case <-time.After(10 * time.Second):
			t.Fatal("no change within 10 s")
		}
		return Change{}
	}
	for _, want := range []string{"decode-a", "decode-b"} {
		if c := next(); c.Kind != Joined || c.Member.Name != want {
			t.Fatalf("listed first: %+v, want %s joined", c, want)
		}
	}
	// While the watch is broken, a node leaves and another joins.
	if _, err := cli.Delete(context.Background(), prefix+"decode-a"); err != nil {
		t.Fatal(err)
	}
	put("decode-c")
	broken <- clientv3.WatchResponse{CompactRevision: 1} // ErrCompacted
	got := map[string]ChangeKind{}
	for range 2 {
		c := next()
		got[c.Member.Name] = c.Kind
	}
	if got["decode-a"] != Lost || got["decode-c"] != Joined || len(got) != 2 {
		t.Fatalf("after the break: %v, want decode-a lost and decode-c joined", got)
	}
	// And it watches on.
	put("decode-d")
	if c := next(); c.Kind != Joined || c.Member.Name != "decode-d" {
		t.Fatalf("after the relisting: %+v, want decode-d joined", c)
	}
	if n := calls.Load(); n != 2 {
		t.Fatalf("%d watches started, want 2", n)
	}
}
