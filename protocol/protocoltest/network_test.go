package protocoltest

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// runMany drives a deployment of 4 prefill and 3 decode nodes through
// requests with a seeded scheduler and faults, then drains it, and returns
// the network.
func runMany(t *testing.T, requests int, seed uint64, bugs research.Switches) *Network {
	t.Helper()
	cfg := Config{Research: bugs, RouterTimeout: 0}
	for range 4 {
		cfg.Prefill = append(cfg.Prefill, NodeConfig{Pages: 512, MaxInFlight: 8})
	}
	for range 3 {
		cfg.Decode = append(cfg.Decode, NodeConfig{Pages: 1024, Timeout: 30e9})
	}
	n, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(seed, 1))
	opts := EventOptions{Faults: true, Crashable: func(i int) bool { return i == 3 }}
	next := 1
	for step := 0; len(n.Violations) == 0 && step < 200*requests; step++ {
		if next <= requests && rng.IntN(20) == 0 {
			tokens := 1 + rng.IntN(64)
			if rng.IntN(10) == 0 {
				tokens = 1 + rng.IntN(4*300) // up to 300 pages
			}
			n.Submit(protocol.RequestID(next), tokens)
			next++
			continue
		}
		opts.Faults = next <= requests // faults stop with the last request
		proto, faults := n.Events(opts)
		switch {
		case len(faults) > 0 && rng.IntN(100) < 2:
			faults[rng.IntN(len(faults))].Do()
		case len(proto) > 0:
			proto[rng.IntN(len(proto))].Do()
		case next > requests:
			n.Quiescent()
			return n
		}
	}
	if len(n.Violations) == 0 {
		t.Fatalf("seed %d: did not settle", seed)
	}
	return n
}

// Thousands of requests over many nodes, with cancels, cuts, corruption, a
// crash and clock jumps: no property breaks, every request gets one outcome
// and every page comes back.
func TestManyNodesKeepEveryProperty(t *testing.T) {
	requests := 3000
	if testing.Short() {
		requests = 300
	}
	n := runMany(t, requests, 1, research.Switches{})
	if len(n.Violations) > 0 {
		t.Fatalf("%d violations, the first: %+v", len(n.Violations), n.Violations[0])
	}
	outcomes := map[string]int{}
	perPrefill := map[protocol.PeerID]int{}
	for _, q := range n.Requests() {
		if !q.Decided {
			t.Fatalf("r%d has no outcome", q.ID)
		}
		switch {
		case q.Outcome == nil:
			outcomes["ok"]++
		case errors.Is(q.Outcome, protocol.ErrCancelled):
			outcomes["cancelled"]++
		case errors.Is(q.Outcome, protocol.ErrNoCapacity):
			outcomes["no capacity"]++
		case errors.Is(q.Outcome, protocol.ErrNodeLost):
			outcomes["node lost"]++
		default:
			outcomes["failed"]++
		}
		perPrefill[q.Prefill]++
	}
	if outcomes["ok"] < requests/3 || len(perPrefill) < 3 {
		t.Fatalf("outcomes %v, requests per prefill node %v: the workload proves little", outcomes, perPrefill)
	}
	t.Logf("%d requests: %v; per prefill node %v", requests, outcomes, perPrefill)
}

// The same run with a defense off is caught.
func TestManyNodesCatchEagerRelease(t *testing.T) {
	for seed := uint64(1); seed <= 20; seed++ {
		if n := runMany(t, 300, seed, research.On(research.EagerRelease)); len(n.Violations) > 0 {
			t.Logf("seed %d: %+v", seed, n.Violations[0])
			return
		}
	}
	t.Fatal("eager-release was not caught in 20 seeds")
}
