package node

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/transfer"
	"github.com/prometheus/client_golang/prometheus"
)

// Prefill is a prefill node: a transfer.Prefill endpoint whose KV is
// computed by the engine (engine.Source) or generated (transfer.GeneratedKV),
// the queue pairs it dials to every decode node the registry lists, and the
// control API through which the router submits and cancels requests.
type Prefill struct {
	incarnation uint64 // this life's, in its registry record
	cfg         NodeConfig
	ep          *transfer.Prefill
	source      *engine.Source // nil without a model
	ctl         *controlServer
	flight      flight

	mu      sync.Mutex
	waiters map[protocol.RequestID]chan error
	decodes map[string]Member // decode nodes the registry lists
	self    Member            // the record it registered
	cancels atomic.Int64      // cancel calls taken (tests)
}

// DefaultPrefillChunkPages is a prefill node's chunk when its NodeConfig
// names none: 4 pages (64 tokens in pages of 16), for the cancel: no request
// has more than 64 tokens computed after its end. Its cost in time to first
// token is below what this project's loaded 2-core machine can resolve:
// `kvhandoff bench handoff --stream-prompts 1024 --chunk-pages N`, built-in
// model, N of 2, 4, 8 and 16, gives streamed/whole ratios of 0.79 to 1.16,
// with no order by N (docs/engine.md, "Streaming prefill").
const DefaultPrefillChunkPages = 4

// NewPrefill makes a prefill node; Serve runs it.
func NewPrefill(cfg NodeConfig) (*Prefill, error) {
	cfg.defaults()
	if err := cfg.Security.check(cfg.Log, "prefill "+cfg.Name); err != nil {
		return nil, err
	}
	n := &Prefill{cfg: cfg, waiters: map[protocol.RequestID]chan error{}, decodes: map[string]Member{}, incarnation: uint64(time.Now().UnixNano())}
	pc := transfer.PrefillConfig{Pages: cfg.Pages, PageTokens: cfg.PageTokens, PageBytes: cfg.PageBytes, Research: cfg.Research, MaxTokens: cfg.ContextTokens, Trace: cfg.Trace}
	if cfg.Model != nil {
		n.source = engine.NewSource()
		pc.KV = n.source
		switch {
		case cfg.PrefillChunkPages == 0:
			pc.ChunkPages = DefaultPrefillChunkPages
		case cfg.PrefillChunkPages > 0:
			pc.ChunkPages = cfg.PrefillChunkPages
		}
	}
	if cfg.wrapKV != nil {
		if pc.KV == nil {
			pc.KV = transfer.GeneratedKV{PageTokens: cfg.PageTokens}
		}
		pc.KV = cfg.wrapKV(pc.KV)
	}
	if cfg.ContextTokens > 0 {
		// Receive buffers hold the Grant of the longest prompt the node
		// advertises; its intake (MaxTokens) takes what it can hold.
		pc.MaxRequestPages = min(cfg.Pages, protocol.MaxGrantPages, protocol.PagesFor(uint32(max(cfg.ContextTokens, cfg.AdvertiseContext)), cfg.PageTokens))
	}
	var err error
	if n.ep, err = transfer.NewPrefill(cfg.Device, pc); err != nil {
		return nil, err
	}
	if cfg.Model != nil {
		cache, err := kv.OverPages(engine.GeometryOf(cfg.Model.Config, cfg.PageTokens), n.ep.Pages(), kv.Unversioned)
		if err != nil {
			return nil, err
		}
		e, err := engine.New(cfg.Model, cfg.backend(), cache, engine.Options{Research: cfg.Research})
		if err != nil {
			return nil, err
		}
		n.source.Use(e)
	}
	cfg.Metrics.prime(RolePrefill)
	cfg.Metrics.endpointGauges(RolePrefill, n.ep.Gauges)
	cfg.Metrics.prefillCounters(n.ep.Stats)
	n.ctl = newControlServer(cfg.Security, cfg.Callers, cfg.Log)
	handleFor(n.ctl, pathInfo, true, func(context.Context, *struct{}) (any, error) {
		n.mu.Lock()
		defer n.mu.Unlock()
		return n.self, nil
	})
	handle(n.ctl, pathPrefill, n.prefill)
	handle(n.ctl, pathCancel, func(_ context.Context, c *cancelCall) (any, error) {
		n.cancels.Add(1)
		n.ep.Cancel(c.ID)
		return struct{}{}, nil
	})
	return n, nil
}

// Endpoint is the node's transfer endpoint (for tests and gauges).
func (n *Prefill) Endpoint() *transfer.Prefill { return n.ep }

// Metrics are the node's metrics.
func (n *Prefill) Metrics() *Metrics { return n.cfg.Metrics }

// Member is the node's registry record, its control API at control.
func (n *Prefill) Member(control string) Member {
	return Member{Name: n.cfg.Name, Role: RolePrefill, Control: control, PoolPages: n.cfg.Pages, PageTokens: n.cfg.PageTokens,
		PageBytes: n.cfg.PageBytes, ContextTokens: max(n.cfg.ContextTokens, n.cfg.AdvertiseContext), Model: n.cfg.ModelID,
		Incarnation: n.incarnation, Wire: protocol.Version}
}

// limit is the longest prompt this node's own intake takes.
func (n *Prefill) limit() int {
	l := min(n.cfg.Pages, protocol.MaxGrantPages) * n.cfg.PageTokens
	if n.cfg.ContextTokens > 0 {
		l = min(l, n.cfg.ContextTokens)
	}
	return l
}

func (n *Prefill) prefill(ctx context.Context, c *prefillCall) (any, error) {
	if !n.flight.enter() {
		return nil, fmt.Errorf("%w: prefill node %q", ErrShuttingDown, n.cfg.Name)
	}
	defer n.flight.leave()
	log := n.cfg.Log.With("request_id", c.RequestID, "handoff_id", idString(c.ID), "tenant", c.Tenant, "model", c.Model, "prefill", n.cfg.Name, "decode", c.Decode)
	start := time.Now()
	// The node's own intake: the router's view of the limits is not trusted alone.
	// admit-finished: the over-long prompt goes on to the Sender, which swaps
	// in the one-token placeholder (the incident).
	if len(c.Prompt) < 1 || (len(c.Prompt) > n.limit() && !n.cfg.Research.Has(research.AdmitFinished)) {
		err := fmt.Errorf("%w: %w: %d tokens, prefill node %q takes 1..%d", protocol.ErrRejected, protocol.ErrTooLong, len(c.Prompt), n.cfg.Name, n.limit())
		n.ended(log, c, err, start)
		return nil, err
	}
	if c.Model != "" && c.Model != n.cfg.ModelID {
		err := fmt.Errorf("%w: %w: model %q, prefill node %q serves %q", protocol.ErrRejected, ErrBadRequest, c.Model, n.cfg.Name, n.cfg.ModelID)
		n.ended(log, c, err, start)
		return nil, err
	}
	done := make(chan error, 1)
	n.mu.Lock()
	if n.waiters[c.ID] != nil {
		n.mu.Unlock()
		return nil, fmt.Errorf("%w: request %d is already on prefill node %q", protocol.ErrDuplicate, c.ID, n.cfg.Name)
	}
	n.waiters[c.ID] = done
	n.mu.Unlock()
	if n.source != nil {
		n.source.Expect(c.ID, c.Prompt)
	}
	if err := n.ep.SubmitWith(c.ID, c.Decode, len(c.Prompt), protocol.SubmitOptions{Ticket: c.Ticket, Scope: c.Scope, Chain: c.Chain}); err != nil {
		if n.source != nil {
			n.source.Forget(c.ID)
		}
		n.mu.Lock()
		delete(n.waiters, c.ID)
		n.mu.Unlock()
		n.ended(log, c, err, start)
		return nil, err
	}
	var err error
	select {
	case err = <-done:
	case <-ctx.Done():
		// The router went away (its call ended): the leg is cancelled, and
		// its outcome still comes (the sender's fence), bounded by the node's timeout.
		n.ep.Cancel(c.ID)
		select {
		case err = <-done:
		case <-time.After(n.cfg.Timeout):
			err = fmt.Errorf("%w: the router's call ended and no outcome came within %v", protocol.ErrTimedOut, n.cfg.Timeout)
		}
	}
	n.ended(log, c, err, start)
	if err != nil {
		return nil, err
	}
	return legAnswer{}, nil
}

func (n *Prefill) ended(log *slog.Logger, c *prefillCall, err error, start time.Time) {
	took := time.Since(start)
	n.cfg.Metrics.leg(RolePrefill, err, took, protocol.PagesFor(uint32(len(c.Prompt)), n.cfg.PageTokens)*n.cfg.PageBytes)
	if err != nil {
		log.Info("prefill leg failed", "tokens", len(c.Prompt), "reason", Reason(err), "err", err, "seconds", took.Seconds())
	} else {
		log.Debug("prefill leg done", "tokens", len(c.Prompt), "seconds", took.Seconds())
	}
}

// events relays the endpoint's outcomes to the calls waiting for them.
func (n *Prefill) events(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-n.ep.Notify():
		}
		for _, ev := range n.ep.Events() {
			if ev.Kind != transfer.Outcome {
				continue
			}
			n.mu.Lock()
			w := n.waiters[ev.Request]
			delete(n.waiters, ev.Request)
			n.mu.Unlock()
			if w != nil {
				w <- ev.Err
			}
		}
	}
}

// dialer keeps a queue pair to every decode node the registry lists:
// it dials the ones without a live queue pair, and cuts the ones lost.
func (n *Prefill) dialer(ctx context.Context, changes <-chan Change) {
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	next := map[string]time.Time{} // a peer that failed to dial waits before the next try
	for {
		select {
		case <-ctx.Done():
			return
		case ch, ok := <-changes:
			if !ok {
				n.cfg.Log.Warn("prefill: the registry watch ended", "prefill", n.cfg.Name)
				changes = nil
				continue
			}
			if ch.Member.Role != RoleDecode {
				continue
			}
			n.mu.Lock()
			was := n.decodes[ch.Member.Name]
			if ch.Kind == Joined {
				n.decodes[ch.Member.Name] = ch.Member
			} else {
				delete(n.decodes, ch.Member.Name)
			}
			n.mu.Unlock()
			switch {
			case ch.Kind == Lost:
				// The lost life's queue pair, or an earlier one's: a next
				// life's, if it is up already, stays (CutIncarnation).
				n.ep.CutIncarnation(ch.Member.Name, ch.Member.Incarnation)
				continue
			case was.Incarnation != 0 && was.Incarnation != ch.Member.Incarnation:
				// A new life with no loss first (etcd lets a restart
				// register before the old lease ends): the old life's
				// queue pair goes, and the dialer below connects the new.
				n.ep.CutIncarnation(ch.Member.Name, was.Incarnation)
			}
		case <-tick.C:
		}
		live := map[string]bool{}
		for _, p := range n.ep.Peers() {
			live[p] = true
		}
		n.mu.Lock()
		var todo []Member
		for name, m := range n.decodes {
			if !live[name] && time.Now().After(next[name]) {
				todo = append(todo, m)
			}
		}
		n.mu.Unlock()
		for _, m := range todo {
			err := n.ep.Dial(ctx, m.Name, m.Transfer, transfer.SetupConfig{Name: n.cfg.Name, Incarnation: n.incarnation, PeerIncarnation: m.Incarnation, TLS: n.cfg.Security.TLS,
				Insecure: n.cfg.Security.TLS == nil, Log: n.cfg.Log})
			if err != nil {
				next[m.Name] = time.Now().Add(time.Second)
				n.cfg.Log.Warn("prefill: dialling a decode node", "prefill", n.cfg.Name, "decode", m.Name, "err", err)
			} else {
				n.cfg.Log.Info("prefill: queue pair up", "prefill", n.cfg.Name, "decode", m.Name)
			}
		}
	}
}

// Serve runs the node until ctx ends: the endpoint's loop, the control API
// on control (and extra handlers there, /metrics), its registration, and
// the queue pairs to every decode node. When ctx ends it stops gracefully:
// no new request, those in flight drained for up to grace then cancelled,
// and it returns once every source page is free (or grace ran out twice).
func (n *Prefill) Serve(ctx context.Context, control net.Listener, grace time.Duration) error {
	if n.cfg.CheckJoin {
		if err := CheckJoin(ctx, n.cfg.Registry, n.Member(listenerAddr(control))); err != nil {
			return err
		}
	}
	run, stop := context.WithCancel(context.Background())
	defer stop()
	var wg sync.WaitGroup
	wg.Go(func() { n.ep.Run(run) })
	wg.Go(func() { n.events(run) })
	changes, err := n.cfg.Registry.Watch(run)
	if err != nil {
		return err
	}
	peers, err := watchRoster(run, n.cfg.Registry)
	if err != nil {
		return err
	}
	n.ctl.admit = peers.admit
	wg.Go(func() { n.dialer(run, changes) })
	serveCtx, stopServe := context.WithCancel(run)
	served, servedDone := make(chan error, 1), make(chan struct{})
	go func() {
		served <- n.ctl.serve(serveCtx, control, map[string]http.Handler{"/metrics": n.cfg.Metrics.Handler()})
		close(servedDone)
	}()
	regCtx, deregister := context.WithCancel(run)
	n.mu.Lock()
	n.self = n.Member(listenerAddr(control))
	n.mu.Unlock()
	lease, err := Join(regCtx, n.cfg.Registry, n.self, n.cfg.CheckJoin)
	if err != nil {
		deregister()
		stopServe()
		return err
	}
	n.cfg.Log.Info("prefill node up", "prefill", n.cfg.Name, "control", listenerAddr(control), "pages", n.cfg.Pages, "page_tokens", n.cfg.PageTokens)
	err = waitForStop(ctx, served, lease)
	if err == nil { // asked to stop (not its registration lost, as in a crash)
		announceStopping(regCtx, n.cfg.Registry, &n.mu, &n.self, n.cfg.unannounced, n.cfg.Log)
	}
	n.shutdown(grace)
	deregister()
	stopServe()
	<-servedDone // the answers still being written reach their callers first
	stop()
	n.ep.Close()
	wg.Wait()
	return err
}

// shutdown stops intake and drains: calls in flight get grace to end, then
// every request still on the node is cancelled; it waits for the pages.
func (n *Prefill) shutdown(grace time.Duration) {
	held := func() []protocol.RequestID {
		n.mu.Lock()
		defer n.mu.Unlock()
		return slices.Collect(maps.Keys(n.waiters))
	}
	if k := n.flight.drainOrCancel(grace, held, func(id protocol.RequestID) { n.ep.CancelBecause(id, "shutdown") }); k > 0 {
		n.cfg.Log.Warn("prefill: cancelled requests at shutdown", "prefill", n.cfg.Name, "requests", k)
	}
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	if !waitPagesBack(ctx, n.ep.Gauges) {
		n.cfg.Log.Error("prefill: source pages still held at shutdown", "prefill", n.cfg.Name, "gauges", fmt.Sprintf("%+v", n.ep.Gauges()))
	}
}

// prefillCounters exports a prefill node's computation: the chunks its KV
// source computed, and the pages it computed after their request had ended
// (a cancel, decode's Abort or a cut arrived while they were computed), read
// when scraped.
func (m *Metrics) prefillCounters(stats func() transfer.Stats) {
	labels := prometheus.Labels{"role": string(RolePrefill)}
	chunks := prometheus.NewDesc("kvhandoff_prefill_chunks_total", "Prefill: chunks of prompt pages computed (a prompt computed whole is one).", nil, labels)
	after := prometheus.NewDesc("kvhandoff_prefill_pages_after_end_total",
		"Prefill: pages computed after their request ended (cancelled, aborted, its queue pair cut): at most the chunk in progress at the end, per request.", nil, labels)
	m.reg.MustRegister(collectorFunc{descs: []*prometheus.Desc{chunks, after}, collect: func(ch chan<- prometheus.Metric) {
		st := stats()
		ch <- prometheus.MustNewConstMetric(chunks, prometheus.CounterValue, float64(st.ChunksComputed))
		ch <- prometheus.MustNewConstMetric(after, prometheus.CounterValue, float64(st.PagesComputedAfterEnd))
	}})
}
