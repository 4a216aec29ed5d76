package node

import (
	"context"
	"strings"
	"sync"
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
