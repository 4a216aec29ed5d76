package node

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// BenchmarkPrefixReuseWithTheModel hands off, through the router of a
// deployment with the built-in model (one prefill and one decode node,
// the decode node's prefix cache on), prompts of 8 pages whose first 6
// pages (75%) are one tenant's shared system text, alternating requests
// with reuse (an authenticated tenant: its scope) and without (scope 0,
// the same deployment), so both modes share the run's load. Reported, same
// run: each mode's time to first token (a completion of one token: prefill
// computes the prompt, the handoff, decode's first step) p50, and their
// ratio; and the scope check's share of decoding: Pool.CheckShared over a
// hit's pinned pages, twice (at Done and at Acquire), against decoding 16
// tokens (a 17-token completion's p50 less a 1-token one's, with reuse).
func BenchmarkPrefixReuseWithTheModel(b *testing.B) {
	const pageTokens, pages, shared = 16, 8, 6
	m := llama.Builtin(1)
	l, err := StartLocal(LocalConfig{Decodes: 1, PrefillPages: 256, DecodePages: 256, PageTokens: pageTokens, Model: m, Timeout: time.Minute, Log: quietLog(),
		PrefixCache: true, TrustTenantHeader: true})
	if err != nil {
		b.Fatal(err)
	}
	defer l.Stop()
	// BOS and bytes: the system text fills pages 0..5 exactly.
	system := strings.Repeat("Shared system text of the tenant. ", 4)[:shared*pageTokens-1]
	prompt := func(i int) string {
		tail := fmt.Sprintf(" Request %06d asks its own question, thirty-two bytes.", i)
		return system + tail[:(pages-shared)*pageTokens]
	}
	complete := func(i int, reuse bool, maxTokens int) (time.Duration, int) {
		start := time.Now()
		res, err := l.Router.Complete(context.Background(), Completion{Prompt: prompt(i), MaxTokens: maxTokens, Tenant: "tenant-a", Authenticated: reuse})
		if err != nil {
			b.Fatal(err)
		}
		return time.Since(start), res.CachedTokens
	}
	complete(0, true, 1) // the system pages cached
	var with, without, long []time.Duration
	b.ResetTimer()
	for i := range b.N {
		d, cached := complete(2*i+1, true, 1)
		if cached != shared*pageTokens {
			b.Fatalf("a reuse request read %d cached tokens, want %d", cached, shared*pageTokens)
		}
		with = append(with, d)
		d, cached = complete(2*i+2, false, 1)
		if cached != 0 {
			b.Fatalf("a request without reuse read %d cached tokens", cached)
		}
		without = append(without, d)
		d, _ = complete(2*i+1, true, 17) // the same prompt again, 16 tokens more
		long = append(long, d)
	}
	b.StopTimer()
	p50 := func(ds []time.Duration) float64 {
		s := slices.Clone(ds)
		slices.Sort(s)
		return float64(s[len(s)/2].Microseconds())
	}
	b.ReportMetric(p50(with), "ttft_reuse_p50_us")
	b.ReportMetric(p50(without), "ttft_no_reuse_p50_us")
	b.ReportMetric(p50(with)/p50(without), "ttft_ratio")
	decode := (p50(long) - p50(with)) * 1e3 // ns for 16 tokens
	b.ReportMetric(decode/16, "decode_ns/token")
	// The scope check, in this run: CheckShared over the pinned pages of a
	// hit, at Done and at Acquire.
	pool := protocol.NewPool(64)
	scope := protocol.Scope(7)
	chain := protocol.PrefixChain(make([]uint32, shared*pageTokens), pageTokens)
	refs, err := pool.Allocate(1, shared)
	if err != nil {
		b.Fatal(err)
	}
	for i, ref := range refs {
		pool.Insert(1, ref, scope, chain[i])
	}
	pinned := pool.Pin(1, scope, chain)
	const reps = 100000
	start := time.Now()
	for range reps {
		for range 2 {
			for _, ref := range pinned {
				if err := pool.CheckShared(scope, ref); err != nil {
					b.Fatal(err)
				}
			}
		}
	}
	check := float64(time.Since(start).Nanoseconds()) / reps
	b.ReportMetric(check, "scope_check_ns/request")
	if decode > 0 {
		b.ReportMetric(check/decode, "scope_check_share_of_16_tokens")
	}
}
