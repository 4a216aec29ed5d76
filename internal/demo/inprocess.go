package demo

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/internal/trace"
	"github.com/kvhandoff/kvhandoff/node"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// Deployment sizes the demo's deployment, a router with prefill and decode
// nodes of the built-in model (node.StartLocal: in-process provider, static
// registry, mutual TLS).
type Deployment struct {
	Prefills, Decodes int
	PageTokens        int
	// PrefillPages and DecodePages are each node's pool.
	PrefillPages, DecodePages int
	// ContextTokens is the longest prompt each node takes (its own intake),
	// advertised to the router.
	ContextTokens int
	// PrefillContextTokens, if not 0, is the prefill nodes' own limit
	// instead, and AdvertiseContext, if larger, the context they advertise:
	// the incident's deployment, whose router checks a context the prefill
	// nodes cannot hold.
	PrefillContextTokens, AdvertiseContext int
	Research                               research.Switches
	Seed                                   uint64 // the built-in model's
	Timeout                                time.Duration
	// PrefixCache turns the decode nodes' prefix cache on, with
	// PublicSystem declared public ("desk"), and the workload's prefix
	// traffic (Spec.Prefixes).
	PrefixCache bool
	// Trace, if set, is where the nodes write their protocol events
	// (docs/trace.md): in process every node's in this file; as processes
	// each node's in Trace.<node> (kvhandoff serve --trace).
	Trace string
}

// Default is the demo's default deployment: 2 prefill and 2 decode nodes,
// pages of 16 tokens, each node taking prompts of up to 128 tokens.
func Default() Deployment {
	return Deployment{Prefills: 2, Decodes: 2, PageTokens: 16, PrefillPages: 128, DecodePages: 48, ContextTokens: 128, Seed: 1, Timeout: 10 * time.Second,
		PrefixCache: true}
}

// Incident is the incident's deployment in miniature: the prefill nodes
// take prompts of up to 512 tokens (their KV budget) but advertise the
// model's context of 1,024, so the router admits prompts the prefill nodes
// cannot hold (the incident: 681,280 tokens under an advertised 1,048,576).
func Incident() Deployment {
	d := Default()
	d.Prefills, d.Decodes = 1, 1
	d.PrefillPages, d.DecodePages = 128, 96
	d.ContextTokens, d.PrefillContextTokens, d.AdvertiseContext = 0, 512, 1024
	d.PrefixCache = false // the incident's traffic, as it was
	return d
}

// Limit is the longest prompt the deployment honestly takes, and Context
// what its router checks.
func (d Deployment) Limit() int {
	l := d.PrefillPages * d.PageTokens
	if d.ContextTokens > 0 {
		l = min(l, d.ContextTokens)
	}
	if d.PrefillContextTokens > 0 {
		l = min(l, d.PrefillContextTokens)
	}
	return l
}

// Faults is what the demo injects while the workload runs, each at random
// moments from a seed.
type Faults struct {
	Cuts        int // queue-pair cuts (decode side)
	Late        int // queue pairs paused for a few milliseconds: late placements
	Corruptions int // payloads damaged in transit
	Crash       bool
	// Rolling, as processes only: every prefill and decode node stopped
	// as an operator stops it (SIGTERM), and restarted, one after the
	// other. It explains no failure: a graceful stop fails no request.
	Rolling bool
}

// DefaultFaults are the demo's default faults.
func DefaultFaults() Faults { return Faults{Cuts: 4, Late: 10, Corruptions: 6, Crash: true} }

// InProcess is a running in-process deployment the workload can go through.
type InProcess struct {
	Local *node.Local
	Model *llama.Model
	cfg   Deployment
	log   *slog.Logger
	trace *trace.Sink
}

// Start starts d in this process.
func Start(d Deployment, log *slog.Logger) (*InProcess, error) {
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	m := llama.Builtin(d.Seed)
	var sink *trace.Sink
	if d.Trace != "" {
		if err := freshTrace(d.Trace); err != nil {
			return nil, err
		}
		var err error
		if sink, err = trace.Create(d.Trace); err != nil {
			return nil, err
		}
	}
	l, err := node.StartLocal(node.LocalConfig{
		Prefills: d.Prefills, Decodes: d.Decodes, PrefillPages: d.PrefillPages, DecodePages: d.DecodePages,
		PageTokens: d.PageTokens, ContextTokens: d.ContextTokens, PrefillContextTokens: d.PrefillContextTokens, AdvertiseContext: d.AdvertiseContext,
		Model: m, Timeout: d.Timeout, Log: log, Research: d.Research, PrefixCache: d.PrefixCache, PublicPrefixes: d.publicPrefixes(),
		// The demo's traffic is its own front proxy: it names each request's tenant.
		TrustTenantHeader: true,
		Trace:             sink,
	})
	if err != nil {
		sink.Close()
		return nil, err
	}
	return &InProcess{Local: l, Model: m, cfg: d, log: log, trace: sink}, nil
}

// freshTrace removes the trace file a previous run left at path: a node
// appends to its file (a restarted process continues its predecessor's), so
// a second run into the same file would be merged with the first.
func freshTrace(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("demo: a fresh trace: %w", err)
	}
	return nil
}

// publicPrefixes are the deployment's declared public prefixes.
func (d Deployment) publicPrefixes() []node.PublicPrefix {
	if !d.PrefixCache {
		return nil
	}
	return []node.PublicPrefix{{Name: "desk", Text: PublicSystem}}
}

// Complete implements Client through the router (its Complete: what the
// HTTP API calls, without the HTTP).
func (p *InProcess) Complete(ctx context.Context, r Request) ([]int, string, error) {
	tokens, text, _, err := p.CompleteCached(ctx, r)
	return tokens, text, err
}

// CompleteCached implements CachedClient.
func (p *InProcess) CompleteCached(ctx context.Context, r Request) ([]int, string, int, error) {
	res, err := p.Local.Router.Complete(ctx, node.Completion{Prompt: r.Prompt, MaxTokens: r.MaxTokens, Tenant: fmt.Sprintf("tenant-%d", r.Tenant),
		Authenticated: true, BodyScope: r.BodyScope}) // the demo's traffic is its own front proxy
	if err != nil {
		return nil, "", 0, err
	}
	return res.Tokens, res.Text, res.CachedTokens, nil
}

// ClassifyNode names an outcome by node.Reason.
func ClassifyNode(err error) (Kind, string) {
	reason := node.Reason(err)
	switch {
	case errors.Is(err, protocol.ErrRejected), errors.Is(err, node.ErrBadRequest):
		return Rejected, reason
	case errors.Is(err, protocol.ErrCancelled), errors.Is(err, context.Canceled):
		return Cancelled, "cancelled"
	}
	return Failed, reason
}

// Inject runs faults at seeded points of the workload, each once finished()
// (the requests done so far) reaches its point, over the middle of total
// requests, until ctx ends or they are all done; it returns what it did, one
// line each. Points in requests rather than in time spread the faults over
// the whole run however fast the machine is. The crash comes a third of the
// way in, and the node comes back a twelfth of the requests later. It
// also counts what it did, for Check to explain failures by.
func (p *InProcess) Inject(ctx context.Context, f Faults, seed uint64, total int, finished func() int) ([]string, Faults) {
	rng := rand.New(rand.NewPCG(seed, 0x6661756c7473))
	type fault struct {
		at   int // requests finished
		kind string
	}
	var plan []fault
	add := func(n int, kind string) {
		for range n {
			plan = append(plan, fault{total/20 + rng.IntN(max(1, total*9/10)), kind})
		}
	}
	add(f.Cuts, "cut")
	add(f.Late, "late")
	add(f.Corruptions, "corrupt")
	if f.Crash {
		plan = append(plan, fault{total / 3, "crash"})
	}
	slices.SortStableFunc(plan, func(a, b fault) int { return a.at - b.at })
	// reached waits until at requests are finished, or ctx ends.
	reached := func(at int) bool {
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		for finished() < at {
			select {
			case <-ctx.Done():
				return false
			case <-tick.C:
			}
		}
		return true
	}
	var done []string
	var did Faults
	var wg sync.WaitGroup
	defer wg.Wait()
	for _, ft := range plan {
		if !reached(ft.at) {
			return done, did
		}
		pi := rng.IntN(len(p.Local.Prefills))
		di := rng.IntN(len(p.Local.Decodes))
		pre := p.Local.Prefill(pi)
		dec := p.Local.Decodes[di]
		pname, dname := fmt.Sprintf("prefill-%d", pi), fmt.Sprintf("decode-%d", di)
		switch ft.kind {
		case "cut":
			if err := dec.Endpoint().Cut(pname); err == nil {
				done = append(done, fmt.Sprintf("cut the queue pair %s -> %s", pname, dname))
				did.Cuts++
			}
		case "late":
			if q, err := pre.Endpoint().Faults(dname); err == nil {
				q.Pause()
				d := time.Duration(2+rng.IntN(20)) * time.Millisecond
				wg.Go(func() {
					time.Sleep(d)
					q.Resume()
				})
				done = append(done, fmt.Sprintf("held the placements %s -> %s for %v", pname, dname, d))
				did.Late++
			}
		case "corrupt":
			if q, err := pre.Endpoint().Faults(dname); err == nil {
				q.CorruptNext()
				done = append(done, fmt.Sprintf("corrupted the next payload %s -> %s", pname, dname))
				did.Corruptions++
			}
		case "crash":
			if err := p.Local.CrashPrefill(pi); err != nil {
				done = append(done, fmt.Sprintf("crashing %s: %v", pname, err))
				continue
			}
			done = append(done, fmt.Sprintf("crashed %s", pname))
			did.Crash = true
			if !reached(ft.at + max(1, total/12)) {
				return done, did
			}
			if err := p.Local.RestartPrefill(pi); err != nil {
				done = append(done, fmt.Sprintf("restarting %s: %v", pname, err))
				continue
			}
			done = append(done, fmt.Sprintf("restarted %s", pname))
		}
	}
	return done, did
}

// PagesLeft waits up to wait for every node's pages to come back (fences
// take a moment after the last outcome), then reports the pages each node
// still holds owned or quarantined.
func (p *InProcess) PagesLeft(wait time.Duration) map[string]int {
	deadline := time.Now().Add(wait)
	for {
		left := map[string]int{}
		total := 0
		for i := range p.Local.Prefills {
			g := p.Local.Prefill(i).Endpoint().Gauges()
			left[fmt.Sprintf("prefill-%d", i)] = g.Pages - g.PagesFree
			total += g.Pages - g.PagesFree
		}
		for i, n := range p.Local.Decodes {
			g := n.Endpoint().Gauges()
			// Cached pages are the prefix cache's, no request's.
			left[fmt.Sprintf("decode-%d", i)] = g.Pages - g.PagesFree - g.PagesCached
			total += g.Pages - g.PagesFree - g.PagesCached
		}
		if total == 0 || time.Now().After(deadline) {
			return left
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Stop ends the deployment.
func (p *InProcess) Stop() {
	p.Local.Stop()
	p.trace.Close()
}

// WatchCache polls every decode node's prefix cache until ctx ends and
// returns each cached page seen written while cached: a page cached at one
// epoch whose tag record changed between two looks at that same epoch. No
// grant names a cached page, so nothing may write one (docs/protocol.md
// rule 24; write-shared is the bug where the pinned pages are granted,
// which the written pages' checks catch only when two writers of a page
// race, since every writer of one chain writes the same KV).
func (p *InProcess) WatchCache(ctx context.Context, every time.Duration) []string {
	type key struct {
		node int
		ref  protocol.PageRef
	}
	seen := map[key][]byte{}
	var written []string
	reported := map[key]bool{}
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		for i, n := range p.Local.Decodes {
			n.Endpoint().CachedTagRecords(func(ref protocol.PageRef, record []byte) {
				k := key{i, ref}
				was, ok := seen[k]
				switch {
				case !ok:
					seen[k] = record
				case !bytes.Equal(was, record) && !reported[k]:
					reported[k] = true
					written = append(written, fmt.Sprintf("decode-%d: page %d, cached at epoch %d, was written while cached (its tag record changed)", i, ref.Page, ref.Epoch))
				}
			})
		}
		select {
		case <-ctx.Done():
			return written
		case <-tick.C:
		}
	}
}
