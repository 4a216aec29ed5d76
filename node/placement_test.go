package node

import (
	"fmt"
	"testing"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// The placement takes the node with the least outstanding work, and breaks
// ties at random: every tied candidate is chosen, no other one.
func TestPlacementTakesTheLeastOutstandingWorkTiesAtRandom(t *testing.T) {
	c := []protocol.NodeLoad{{PagesInUse: 3}, {PagesInUse: 1}, {PagesInUse: 5}, {PagesInUse: 1}}
	seen := map[int]int{}
	for range 400 {
		seen[LeastOutstanding{}.Choose(protocol.RolePrefill, 1, c)]++
	}
	if len(seen) != 2 || seen[1] < 100 || seen[3] < 100 {
		t.Fatalf("choices among 3,1,5,1 pages in use: %v; want 1 and 3, each often", seen)
	}
	if got := (LeastOutstanding{IntN: func(int) int { return 0 }}).Choose(protocol.RolePrefill, 1, c); got != 1 {
		t.Fatalf("the first tied candidate is %d", got)
	}
}

// Sequential requests (every node idle at each) spread over both prefill
// nodes of a deployment: 40 requests, each node serves some (all 40 on one
// is a chance of 2 in 2^40).
func TestSequentialRequestsSpreadOverThePrefillNodes(t *testing.T) {
	l, err := StartLocal(LocalConfig{Prefills: 2, PrefillPages: 64, DecodePages: 64, PageTokens: 16, Log: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	for i := range 40 {
		a := call(t, "POST", "http://"+l.API+"/v1/completions", map[string]any{"prompt": fmt.Sprintf("request %d", i), "max_tokens": 2}, nil)
		if a.code != 200 {
			t.Fatalf("request %d: %d %q", i, a.code, a.raw)
		}
	}
	for i, p := range l.Prefills {
		n := counter(t, p.Metrics(), "kvhandoff_handoffs_total", "outcome", "success")
		t.Logf("prefill-%d served %v of 40", i, n)
		if n == 0 {
			t.Fatalf("prefill-%d served none of 40 sequential requests", i)
		}
	}
	allPagesBack(t, l)
}
