package demo

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/llama"
)

// Config is one demo run.
type Config struct {
	Deployment Deployment
	Faults     Faults
	Workload   Spec // Limit and Context are the deployment's when 0
	// Concurrency is the clients sending at once; 0 means 16.
	Concurrency int
	Progress    func() // once per finished request
	Log         *slog.Logger
	// Etcd, for RunProcs: the nodes register in this etcd cluster
	// (host:port,...) instead of static peers.
	Etcd string
}

// Result is a run's report and what was injected.
type Result struct {
	Report   *Report
	Workload Workload
	Faults   []string
}

// RunInProcess starts the deployment, runs the workload through it with
// the faults, stops it and checks everything against the colocated run.
func RunInProcess(ctx context.Context, cfg Config) (*Result, error) {
	d := cfg.Deployment
	w, ref, err := prepare(&cfg)
	if err != nil {
		return nil, err
	}
	p, err := Start(d, cfg.Log)
	if err != nil {
		return nil, fmt.Errorf("demo: starting the deployment: %w", err)
	}
	defer p.Stop()
	concurrency := cfg.Concurrency
	runCtx, stopFaults := context.WithCancel(ctx)
	type did struct {
		lines []string
		f     Faults
	}
	faultsDone := make(chan did, 1)
	// The faults come at points of the workload (requests finished); any
	// still planned when it ends are dropped.
	var finished atomic.Int64
	progress := func() {
		finished.Add(1)
		if cfg.Progress != nil {
			cfg.Progress()
		}
	}
	go func() {
		lines, f := p.Inject(runCtx, cfg.Faults, cfg.Workload.Seed, len(w.Requests), func() int { return int(finished.Load()) })
		faultsDone <- did{lines, f}
	}()
	watched := make(chan []string, 1)
	go func() { watched <- p.WatchCache(runCtx, 2*time.Millisecond) }()
	start := time.Now()
	outs := Run(ctx, w, p, ClassifyNode, concurrency, progress)
	elapsed := time.Since(start)
	stopFaults()
	injected := <-faultsDone
	written := <-watched
	left := p.PagesLeft(5 * time.Second)
	rep, err := Check(w, outs, ref, injected.f, left, elapsed)
	if err != nil {
		return nil, err
	}
	rep.CachedWritten = written
	return &Result{Report: rep, Workload: w, Faults: injected.lines}, nil
}

// prepare fills cfg's defaults from its deployment and draws the workload
// and the colocated reference.
func prepare(cfg *Config) (Workload, *Reference, error) {
	d := cfg.Deployment
	m := llama.Builtin(d.Seed)
	if cfg.Workload.Limit == 0 {
		cfg.Workload.Limit = min(d.Limit(), 128)
	}
	if cfg.Workload.Context == 0 {
		cfg.Workload.Context = m.SeqLen
	}
	if cfg.Workload.OverLimitTokens == 0 {
		cfg.Workload.OverLimitTokens = d.Limit() + d.Limit()/2
	}
	if cfg.Workload.Align == 0 {
		cfg.Workload.Align = d.PageTokens
	}
	if cfg.Concurrency == 0 {
		cfg.Concurrency = 16
	}
	ref, err := NewReference(m, llama.Bytes{}, d.PageTokens, -1)
	if err != nil {
		return Workload{}, nil, err
	}
	if d.PrefixCache {
		cfg.Workload.Prefixes = true
		cfg.Workload.Answer = func(prompt string, n int) (string, error) {
			out, err := ref.Tokens(prompt, n)
			return ref.Text(prompt, out), err
		}
	}
	w, err := NewWorkload(cfg.Workload)
	return w, ref, err
}
