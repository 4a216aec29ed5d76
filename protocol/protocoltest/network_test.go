package protocoltest

import (
	"errors"
	"math/rand/v2"
	"slices"
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
	perPrefill := map[protocol.NodeID]int{}
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

// restarted is a deployment of one prefill and one decode node where r1 is
// verified at decode when the prefill node crashes and restarts before the
// router detected the crash (its lease had not expired).
func restarted(t *testing.T, bugs research.Switches) *Network {
	t.Helper()
	n, err := New(Config{Research: bugs, Prefill: []NodeConfig{{Pages: 8}}, Decode: []NodeConfig{{Pages: 8}}})
	if err != nil {
		t.Fatal(err)
	}
	n.ComputeAtIntake = true
	n.Submit(1, 4)
	n.DeliverRouter(PrefillID(0))
	for qp := n.QPs[0]; len(qp.Fwd) > 0 || len(qp.Back) > 0; {
		if len(qp.Back) > 0 {
			n.DeliverBack(qp)
		} else {
			n.Deliver(qp)
		}
	}
	if d := n.Decode[0]; len(d.Verified) != 1 {
		t.Fatalf("r1 is not verified: %v", n.Violations)
	}
	n.Crash(n.Prefill[0])
	n.Restart(n.Prefill[0])
	return n
}

// A restart is the loss of the old incarnation: its requests fail, decode
// cuts the old queue pair before it holds one for the new incarnation, and
// a request dispatched before that fails; after it, requests are served.
func TestRestartIsTheLossOfTheOldIncarnation(t *testing.T) {
	n := restarted(t, research.Switches{})
	if q := n.Request(1); !q.Decided || !errors.Is(q.Outcome, protocol.ErrNodeLost) {
		t.Fatalf("r1 after the restart: decided %v, %v; want failed with ErrNodeLost", q.Decided, q.Outcome)
	}
	n.Read(1) // decode still reads it: the client's outcome stays the router's first
	n.Submit(2, 4)
	n.DeliverRouter(PrefillID(0))
	if q := n.Request(2); !q.Decided || !errors.Is(q.Outcome, protocol.ErrPeerFailed) {
		t.Fatalf("r2, before decode accepted the new incarnation: %v, want ErrPeerFailed", q.Outcome)
	}
	for len(n.Decode[0].Inbox) > 0 {
		n.DeliverRouter(DecodeID(0))
	}
	if qp := n.QPs[0]; qp.Incarnation != 1 {
		t.Fatalf("decode holds the queue pair for incarnation %d, want 1", qp.Incarnation)
	}
	n.Submit(3, 4)
	if !n.Run() {
		t.Fatal("did not settle")
	}
	if q := n.Request(3); !q.Decided || q.Outcome != nil {
		t.Fatalf("r3 on the new incarnation: %v %v, want ok", q.Decided, q.Outcome)
	}
	if n.Quiescent(); len(n.Violations) > 0 {
		t.Fatalf("violations: %+v", n.Violations)
	}
}

// With peer-by-name the router takes the restart for an advertisement
// update: r1, of the old incarnation, is served after it, which the
// network reports.
func TestRestartCatchesPeerByName(t *testing.T) {
	n := restarted(t, research.On(research.PeerByName))
	n.Read(1)
	if len(n.Violations) == 0 || n.Violations[0].Property != "NoOldIncarnation" {
		t.Fatalf("violations %+v, want NoOldIncarnation", n.Violations)
	}
}

// decodeRestarted is one prefill and one decode node with r1 granted (its
// Grant still on its way back) when the decode node crashes and restarts.
func decodeRestarted(t *testing.T) *Network {
	t.Helper()
	n, err := New(Config{Prefill: []NodeConfig{{Pages: 8}}, Decode: []NodeConfig{{Pages: 8}}})
	if err != nil {
		t.Fatal(err)
	}
	n.ComputeAtIntake = true
	n.Submit(1, 8)
	n.DeliverRouter(PrefillID(0))
	n.Deliver(n.QPs[0]) // the Bootstrap: decode reserves and grants
	if len(n.QPs[0].Back) != 1 {
		t.Fatalf("back: %v, want r1's Grant", n.QPs[0].Back)
	}
	n.RestartDecode(n.Decode[0])
	return n
}

// A decode node's restart is the loss of its old incarnation: its requests
// fail at the router, the new incarnation has a fresh pool (every page free,
// epochs from zero) and no records, what the old one granted is never
// written into the new pool (the Sender's WRITEs on the old queue pair are
// flushed), the prefill node cuts that queue pair on the news (its leg
// fails) before it holds one to the new incarnation, and after that
// requests are served by the new incarnation.
func TestDecodeRestartIsTheLossOfTheOldIncarnation(t *testing.T) {
	n := decodeRestarted(t)
	d, qp := n.Decode[0], n.QPs[0]
	if q := n.Request(1); !q.Decided || !errors.Is(q.Outcome, protocol.ErrNodeLost) {
		t.Fatalf("r1 after the restart: decided %v, %v; want failed with ErrNodeLost", q.Decided, q.Outcome)
	}
	pool := d.Receiver.Pool()
	for p := range uint32(8) {
		if _, _, free := pool.Owner(p); !free || pool.Epoch(p) != 0 {
			t.Fatalf("page %d of the new incarnation: free %v, epoch %d; want free at epoch 0", p, free, pool.Epoch(p))
		}
	}
	if st := d.Receiver.Status(1); st != protocol.ReceiverNone {
		t.Fatalf("the new incarnation's record of r1: %v, want none", st)
	}
	before := append([]byte(nil), d.Mem.payloads[0]...)
	n.DeliverBack(qp) // the old incarnation's Grant reaches prefill before the news
	if len(qp.Fwd) != 0 {
		t.Fatalf("prefill's WRITEs for the old incarnation's grant reached the wire: %d ops", len(qp.Fwd))
	}
	if !slices.Equal(d.Mem.payloads[0], before) {
		t.Fatal("a page of the new incarnation changed")
	}
	for len(n.Prefill[0].Inbox) > 0 { // the router's cancel of r1, then the registry's news
		n.DeliverRouter(PrefillID(0))
	}
	if qp.DecodeIncarnation != 1 || n.Request(1).PrefillEnded != true {
		t.Fatalf("prefill holds the queue pair to incarnation %d, r1's leg ended %v; want 1 and true", qp.DecodeIncarnation, n.Request(1).PrefillEnded)
	}
	n.Submit(2, 8)
	if !n.Run() {
		t.Fatal("did not settle")
	}
	if q := n.Request(2); !q.Decided || q.Outcome != nil || q.DecodeInc != 1 {
		t.Fatalf("r2 on the new incarnation: %v %v (incarnation %d), want ok on 1", q.Decided, q.Outcome, q.DecodeInc)
	}
	if n.Quiescent(); len(n.Violations) > 0 {
		t.Fatalf("violations: %+v", n.Violations)
	}
}

// The network's NoOldIncarnation check can fail: a prefill node that takes
// the news but keeps what the old incarnation had sent (a test-only
// mutation of its cut) takes the old incarnation's Grant by the new queue
// pair, which the network reports.
func TestDecodeRestartCatchesAGrantOfTheOldIncarnationTakenAfterTheNews(t *testing.T) {
	n := decodeRestarted(t)
	qp := n.QPs[0]
	kept := slices.Clone(qp.Back)
	for len(n.Prefill[0].Inbox) > 0 {
		n.DeliverRouter(PrefillID(0))
	}
	qp.Back, qp.oldBack = kept, len(kept) // the cut kept what the old incarnation sent
	n.DeliverBack(qp)
	if len(n.Violations) == 0 || n.Violations[0].Property != "NoOldIncarnation" {
		t.Fatalf("violations %+v, want NoOldIncarnation", n.Violations)
	}
}
