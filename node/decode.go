package node

import (
	"context"
	"crypto/ed25519"
	"crypto/sha256"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/internal/trace"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// DecodeConfig is a decode node's configuration beyond NodeConfig.
type DecodeConfig struct {
	NodeConfig
	// GenPages is the pool of the node's own pages for the tokens it
	// generates past the pages the transfer granted; 0 means Pages.
	GenPages int
	// Stop is the token that ends generation early (-1: none).
	Stop int
	// TicketKey is the public half of the router's ticket key: a Bootstrap
	// reserves pages only with a valid ticket (TicketChecker). Required with
	// TLS; without TLS (Insecure), nil checks no ticket.
	TicketKey ed25519.PublicKey
	// PeerRequests and PeerPages bound what one prefill node may hold here:
	// its open requests, and its requests' pages not yet back in the pool
	// (protocol.ReceiverConfig). 0 means no bound but the node's own slots
	// and pool, which an honest deployment never passes; a peer over its
	// quota is refused with protocol.AbortOverQuota, which the router
	// retries as it does a full pool (docs/security.md).
	PeerRequests, PeerPages int
	// PrefixCache turns on the prefix cache (transfer.DecodeConfig's;
	// docs/nodes.md, "Prefix reuse"): verified full prompt pages stay cached
	// under the request's scope, and a later request of that scope whose
	// prompt starts with them reads them instead of having them transferred.
	// It needs TicketKey: the scope and chain must be the router's.
	PrefixCache bool
	// PrefixScopePages caps each scope's cached pages (0: no cap; a scope
	// at its cap evicts its own pages first, docs/security.md).
	PrefixScopePages int
}

// Decode is a decode node: a transfer.Decode endpoint that prefill nodes
// set up queue pairs with (transfer.Serve), and, once a request's KV has
// arrived and verified, the engine generating over the very pages the
// WRITEs placed (every read checked against the endpoint's epochs). The
// router tells it each request's prompt and length through the control
// API; the two arrive in either order.
type Decode struct {
	incarnation uint64 // this life's, in its registry record
	cfg         DecodeConfig
	ep          *transfer.Decode
	ctl         *controlServer
	flight      flight

	gen    sync.Mutex // the engine runs one request at a time
	engine *engine.Engine
	pool   *kv.DecodePool // the endpoint's pages, then pages of its own for generated tokens

	// tokenHook, if set, runs after each generated token is published
	// (tests: hold a generation between two tokens).
	tokenHook atomic.Pointer[func(id protocol.RequestID, generated int)]

	mu     sync.Mutex
	public map[protocol.Scope]string // the declared public scopes the router named, by their metrics label
	reqs   map[protocol.RequestID]*decodeReq
	ended  map[protocol.RequestID]endedReq // outcomes no call has collected yet
	fences map[protocol.RequestID]time.Time
	self   Member // the record it registered
}

type decodeReq struct {
	call     *decodeCall
	answer   chan legAnswer // set with call
	verified time.Time      // zero until Verified
	started  time.Time
	tokens   []int                // generated so far (mu)
	logprobs []llama.TokenLogprob // when the call asked for them
	prefix   int                  // prompt tokens read from the prefix cache
	local    error                // why this node ended it (it overrides the endpoint's "cancelled")
	running  bool
	// more wakes the call's stream when tokens were added (set with call).
	more chan struct{}
	// halted: no one waits for the answer any more (the router's call ended,
	// a cancel came, the request failed): generation stops before its next
	// token.
	halted atomic.Bool
	// enough: the router has what it wants (a stop string came):
	// generation ends before its next token, and the leg succeeds.
	enough atomic.Bool
}

// halt stops r's generation before its next token.
func (r *decodeReq) halt() { r.halted.Store(true) }

type endedReq struct {
	err error
	at  time.Time
}

// NewDecode makes a decode node; Serve runs it.
func NewDecode(cfg DecodeConfig) (*Decode, error) {
	cfg.defaults()
	if err := cfg.Security.check(cfg.Log, "decode "+cfg.Name); err != nil {
		return nil, err
	}
	if cfg.GenPages == 0 {
		cfg.GenPages = cfg.Pages
	}
	if cfg.TicketKey == nil && cfg.Security.TLS != nil {
		return nil, fmt.Errorf("node: decode %s: no ticket key (the router's public ticket key: kvhandoff certs writes it)", cfg.Name)
	}

	if cfg.PrefixCache && cfg.TicketKey == nil {
		return nil, fmt.Errorf("node: decode %s: the prefix cache needs the router's ticket key (the scope must be the router's)", cfg.Name)
	}
	n := &Decode{incarnation: uint64(time.Now().UnixNano()), cfg: cfg, reqs: map[protocol.RequestID]*decodeReq{}, ended: map[protocol.RequestID]endedReq{},
		fences: map[protocol.RequestID]time.Time{}, public: map[protocol.Scope]string{}}
	dc := transfer.DecodeConfig{Pages: cfg.Pages, PageTokens: cfg.PageTokens, PageBytes: cfg.PageBytes, Timeout: cfg.Timeout, Horizon: time.Minute, Research: cfg.Research, Trace: cfg.Trace,
		Admission: transfer.Admission{PeerRequests: cfg.PeerRequests, PeerPages: cfg.PeerPages}, PrefixCache: cfg.PrefixCache, PrefixScopePages: cfg.PrefixScopePages}
	if cfg.TicketKey != nil {
		dc.Authorize = NewTicketChecker(cfg.TicketKey, cfg.Name).Check
	}
	if cfg.ContextTokens > 0 {
		dc.MaxRequestPages = min(cfg.Pages, protocol.MaxGrantPages, protocol.PagesFor(uint32(cfg.ContextTokens), cfg.PageTokens))
	}
	var err error
	if n.ep, err = transfer.NewDecode(cfg.Device, dc); err != nil {
		return nil, err
	}
	if cfg.Model != nil {
		if n.pool, err = kv.NewDecodePool(engine.GeometryOf(cfg.Model.Config, cfg.PageTokens), n.ep, cfg.GenPages); err != nil {
			return nil, err
		}
		if n.engine, err = engine.New(cfg.Model, cfg.backend(), n.pool.Cache(), engine.Options{Research: cfg.Research}); err != nil {
			return nil, err
		}
	}
	cfg.Metrics.prime(RoleDecode)
	cfg.Metrics.endpointGauges(RoleDecode, n.ep.Gauges)
	cfg.Metrics.prefixGauges(n.prefixGauges)
	n.ctl = newControlServer(cfg.Security, cfg.Callers, cfg.Log)
	handleFor(n.ctl, pathInfo, true, func(context.Context, *struct{}) (any, error) {
		n.mu.Lock()
		defer n.mu.Unlock()
		return n.self, nil
	})
	handleStream(n.ctl, pathDecode, n.decode)
	handle(n.ctl, pathCancel, func(_ context.Context, c *cancelCall) (any, error) {
		n.mu.Lock()
		if r := n.reqs[c.ID]; r != nil {
			r.halt()
		}
		n.mu.Unlock()
		n.ep.CancelBecause(c.ID, "call")
		// A request cancelled before its Bootstrap came leaves only a
		// tombstone and no outcome: a call waiting for it ends here.
		if n.ep.Status(c.ID) == protocol.ReceiverTombstone {
			n.mu.Lock()
			if r := n.reqs[c.ID]; r != nil && r.verified.IsZero() {
				n.outcomeLocked(transfer.Event{Kind: transfer.Outcome, Request: c.ID,
					Err: fmt.Errorf("%w: by the router before the transfer began", protocol.ErrCancelled)}, r)
			}
			n.mu.Unlock()
		}
		return struct{}{}, nil
	})
	handle(n.ctl, pathEnough, func(_ context.Context, c *cancelCall) (any, error) {
		n.mu.Lock()
		if r := n.reqs[c.ID]; r != nil {
			r.enough.Store(true)
		}
		n.mu.Unlock()
		return struct{}{}, nil
	})
	handle(n.ctl, pathPeerLost, func(_ context.Context, c *peerLostCall) (any, error) {
		// The router lost the prefill node: cut the queue pair of the life
		// it lost, the fence for every page that life may still write. A
		// queue pair of its next life stays: it replaced the lost one's
		// (cutting it), and may be up before the router tells of the loss
		// (a crash and a quick restart), as the spec's restart fences the
		// old life's queue pair before the new life's is taken.
		var err error
		if err = n.ep.CutIncarnation(c.Peer, c.Incarnation); errors.Is(err, transfer.ErrOtherIncarnation) {
			n.cfg.Log.Info("decode: prefill node's life lost; its next life's queue pair stays", "decode", n.cfg.Name, "prefill", c.Peer, "lost", c.Incarnation)
			return struct{}{}, nil
		}
		n.cfg.Trace.Emit(trace.Event{Kind: trace.Cut, Peer: c.Peer, Cause: "peer-lost"})
		if err != nil && !errors.Is(err, transfer.ErrNoPeer) {
			return nil, err
		}
		n.cfg.Log.Warn("decode: prefill node lost, queue pair cut", "decode", n.cfg.Name, "prefill", c.Peer)
		return struct{}{}, nil
	})
	return n, nil
}

// Endpoint is the node's transfer endpoint (for tests and gauges).
func (n *Decode) Endpoint() *transfer.Decode { return n.ep }

// Metrics are the node's metrics.
func (n *Decode) Metrics() *Metrics { return n.cfg.Metrics }

// Member is the node's registry record.
func (n *Decode) Member(control, transferAddr string) Member {
	return Member{Name: n.cfg.Name, Role: RoleDecode, Control: control, Transfer: transferAddr, PoolPages: n.cfg.Pages,
		PageTokens: n.cfg.PageTokens, PageBytes: n.cfg.PageBytes, ContextTokens: max(n.cfg.ContextTokens, n.cfg.AdvertiseContext), Model: n.cfg.ModelID,
		Incarnation: n.incarnation, Wire: protocol.Version}
}

// decode is the router's decode call: it waits for the request's KV to
// verify, and streams the tokens to the router as the engine generates
// them (each batch a frame, sent as soon as it is there), then the leg's
// outcome. A call that ends (the router went away) halts the generation
// before its next token and cancels the leg.
func (n *Decode) decode(ctx context.Context, c *decodeCall, send func(legAnswer) error) error {
	if !n.flight.enter() {
		return fmt.Errorf("%w: decode node %q", ErrShuttingDown, n.cfg.Name)
	}
	defer n.flight.leave()
	if c.MaxTokens < 1 {
		return fmt.Errorf("%w: max_tokens %d", ErrBadRequest, c.MaxTokens)
	}
	// max_tokens sizes what this node allocates and generates: it is bounded
	// by the node's own context (or its pool), never by the caller's word, as
	// a model's generation already stops at its context.
	limit := n.cfg.ContextTokens
	if limit == 0 {
		limit = n.cfg.Pages * n.cfg.PageTokens
	}
	c.MaxTokens = min(c.MaxTokens, limit)
	n.mu.Lock()
	if e, ok := n.ended[c.ID]; ok {
		// The leg ended before the router's call came (it failed early).
		delete(n.ended, c.ID)
		n.mu.Unlock()
		return e.err
	}
	r := n.reqs[c.ID]
	if r == nil {
		r = &decodeReq{}
		n.reqs[c.ID] = r
	}
	if r.call != nil {
		n.mu.Unlock()
		return fmt.Errorf("%w: request %d is already on decode node %q", protocol.ErrDuplicate, c.ID, n.cfg.Name)
	}
	r.call, r.answer, r.more, r.started = c, make(chan legAnswer, 1), make(chan struct{}, 1), time.Now()
	answer := r.answer
	n.startLocked(c.ID, r)
	n.mu.Unlock()
	sent := 0 // tokens streamed
	// flush sends the tokens generated since the last frame.
	flush := func(tokens []int, logprobs []llama.TokenLogprob, prefix int) error {
		if len(tokens) <= sent {
			return nil
		}
		f := legAnswer{Tokens: tokens[sent:], PrefixTokens: prefix}
		if len(logprobs) >= len(tokens) {
			f.Logprobs = logprobs[sent:len(tokens)]
		}
		sent = len(tokens)
		return send(f)
	}
	gone := func() error {
		r.halt()
		n.ep.CancelBecause(c.ID, "call-ended") // the router went away: the leg is cancelled
		return fmt.Errorf("%w: the router's call ended", protocol.ErrCancelled)
	}
	for {
		select {
		case a := <-answer:
			if a.Error != nil {
				return a.Error.err()
			}
			if flush(a.Tokens, a.Logprobs, a.PrefixTokens) != nil {
				return gone()
			}
			return nil
		case <-r.more:
			n.mu.Lock()
			tokens, logprobs, prefix := r.tokens, r.logprobs, r.prefix
			n.mu.Unlock()
			if flush(tokens, logprobs, prefix) != nil {
				return gone()
			}
		case <-ctx.Done():
			return gone()
		}
	}
}

// startLocked starts generation once the request has both its call and its
// verified KV. The caller holds mu.
func (n *Decode) startLocked(id protocol.RequestID, r *decodeReq) {
	if r.call == nil || r.verified.IsZero() || r.running {
		return
	}
	r.running = true
	go n.generate(id, r)
}

// generate reads the verified pages (Acquire: the read-time check) and
// generates over them, then releases them (Finish): the outcome event
// answers the call.
func (n *Decode) generate(id protocol.RequestID, r *decodeReq) {
	n.gen.Lock()
	defer n.gen.Unlock()
	c := r.call
	refs, shared, err := n.ep.AcquireShared(id)
	if err != nil {
		n.fail(id, r, err) // the outcome event follows (or came already)
		return
	}
	n.mu.Lock()
	r.prefix = shared * n.cfg.PageTokens
	n.mu.Unlock()
	if shared > 0 {
		n.countHit(c, shared)
	}
	// From here the read holds the pages (and the prefix's pins): every
	// path ends at Finish, which gives them back, whatever failed.
	if want := protocol.PagesFor(uint32(len(c.Prompt)), n.cfg.PageTokens); len(refs) != want && !n.cfg.Research.Has(research.NoTokenCheck) {
		n.fail(id, r, fmt.Errorf("%w: %d pages arrived for a prompt of %d tokens (%d pages)", protocol.ErrTokenMismatch, len(refs), len(c.Prompt), want))
	} else if n.engine == nil {
		n.publish(r, n.digest(refs, c.MaxTokens), nil)
	} else if err := n.run(id, refs, shared, c, r); err != nil {
		// The outcome is this error (or the cancel's that halted it); the
		// pages the read holds go back at Finish.
		n.fail(id, r, err)
	}
	if err := n.ep.Finish(id); err != nil {
		n.fail(id, r, err)
	}
}

// publish adds generated tokens to r's answer and wakes its call's stream.
func (n *Decode) publish(r *decodeReq, tokens []int, logprobs []llama.TokenLogprob) {
	n.mu.Lock()
	r.tokens = append(r.tokens, tokens...)
	r.logprobs = append(r.logprobs, logprobs...)
	n.mu.Unlock()
	select {
	case r.more <- struct{}{}:
	default: // a wake is pending: the stream reads everything then
	}
}

// run generates over the acquired pages, at the epochs they were granted
// (every read checks the page is still at it), and pages of the node's own
// for the generated tokens past them (the first shared pages are the
// cached prefix: read, never written); each token is published to the call's
// stream as it is sampled. A halted request stops before its next token:
// at most the step in flight when the halt came is computed after it
// (counted in kvhandoff_decode_tokens_after_cancel_total).
func (n *Decode) run(id protocol.RequestID, acquired []protocol.PageRef, shared int, c *decodeCall, r *decodeReq) error {
	end := min(len(c.Prompt)+c.MaxTokens, n.cfg.Model.SeqLen)
	table, err := n.pool.Table(id, acquired, end)
	if err != nil {
		return fmt.Errorf("decode node %q: pages for %d generated tokens: %w", n.cfg.Name, c.MaxTokens, err)
	}
	defer n.pool.Release(id, table)
	// The pages arrived in host memory: a device backend copies them into
	// its own pool before anything reads them (the CPU backend reads them
	// where they are).
	if err := n.engine.Arrived(table[:len(acquired)]); err != nil {
		return err
	}
	sampler := llama.Greedy()
	if c.Temperature > 0 {
		sampler = llama.NewSampler(c.Temperature, c.TopP, c.Seed)
	}
	if c.Logprobs != nil {
		sampler.RecordLogprobs(*c.Logprobs)
	}
	if len(c.Prompt) == 0 {
		return fmt.Errorf("%w: no tokens", engine.ErrBadRequest)
	}
	// engine.Decode's loop, a token at a time, so that each is streamed as
	// it is sampled and a halt is seen between two.
	tok, pos := c.Prompt[len(c.Prompt)-1], len(c.Prompt)-1
	for generated := 0; generated < c.MaxTokens && pos < n.cfg.Model.SeqLen; generated++ {
		if r.halted.Load() {
			return fmt.Errorf("%w: halted after %d tokens: no one waits for the answer", protocol.ErrCancelled, generated)
		}
		if r.enough.Load() {
			break // the router has its answer: a stop string came
		}
		logits, err := n.engine.StepShared(table, shared, []int{tok}, pos)
		if err != nil {
			return err
		}
		tok = sampler.Sample(logits)
		if r.halted.Load() {
			n.cfg.Metrics.afterCancel.Inc()
		}
		var lp []llama.TokenLogprob
		if sampler.Logprobs != nil {
			lp = sampler.Logprobs.Tokens[len(sampler.Logprobs.Tokens)-1:]
		}
		n.publish(r, []int{tok}, lp)
		if hook := n.tokenHook.Load(); hook != nil {
			(*hook)(id, generated+1)
		}
		if tok == n.cfg.Stop {
			break
		}
		pos++
	}
	return nil
}

// digest is the "generation" of a node without a model: the SHA-256 of the
// verified KV, its bytes as tokens (repeated to n), so the end-to-end path
// is real and any foreign or stale page changes the answer.
func (n *Decode) digest(acquired []protocol.PageRef, tokens int) []int {
	h := sha256.New()
	for _, ref := range acquired {
		h.Write(n.ep.Payload(ref.Page))
	}
	sum := h.Sum(nil)
	out := make([]int, tokens)
	for i := range out {
		out[i] = int(sum[i%len(sum)])
	}
	return out
}

// fail ends a request for a reason of this node's: the endpoint cancels it
// (its pages are released or quarantined there), and the call gets err.
func (n *Decode) fail(id protocol.RequestID, r *decodeReq, err error) {
	n.mu.Lock()
	if r.local == nil {
		r.local = err
	}
	n.mu.Unlock()
	n.ep.CancelBecause(id, "failed")
}

// events handles the endpoint's events: Verified starts generation (once
// the router's call is here), Outcome answers the call.
func (n *Decode) events(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-n.ep.Notify():
		}
		for _, ev := range n.ep.Events() {
			n.mu.Lock()
			r := n.reqs[ev.Request]
			switch ev.Kind {
			case transfer.Verified:
				if r == nil {
					r = &decodeReq{}
					n.reqs[ev.Request] = r
				}
				r.verified = time.Now()
				n.startLocked(ev.Request, r)
			case transfer.Outcome:
				n.outcomeLocked(ev, r)
			}
			n.mu.Unlock()
		}
	}
}

func (n *Decode) outcomeLocked(ev transfer.Event, r *decodeReq) {
	delete(n.reqs, ev.Request)
	err := ev.Err
	if r != nil && r.local != nil {
		err = r.local
	}
	if err != nil {
		n.fences[ev.Request] = time.Now()
		if r != nil {
			r.halt() // failed or cancelled: no one will take more tokens
		}
	}
	var c *decodeCall
	var started time.Time
	if r != nil {
		c, started = r.call, r.started
	}
	if c == nil {
		// No call yet: keep the outcome for it (or for the sweep to forget).
		n.ended[ev.Request] = endedReq{err: err, at: time.Now()}
		n.cfg.Metrics.leg(RoleDecode, err, 0, 0)
		if err != nil {
			n.cfg.Log.Info("decode leg failed before the router's call", "handoff_id", idString(ev.Request), "decode", n.cfg.Name, "prefill", ev.Peer, "reason", Reason(err), "err", err)
		}
		return
	}
	log := n.cfg.Log.With("request_id", c.RequestID, "handoff_id", idString(ev.Request), "tenant", c.Tenant, "model", c.Model, "prefill", c.Prefill, "decode", n.cfg.Name)
	took := time.Since(started)
	n.cfg.Metrics.leg(RoleDecode, err, took, protocol.PagesFor(uint32(len(c.Prompt)), n.cfg.PageTokens)*n.cfg.PageBytes)
	if err != nil {
		log.Info("decode leg failed", "tokens", len(c.Prompt), "reason", Reason(err), "err", err, "seconds", took.Seconds())
		r.answer <- legAnswer{Error: toWire(err)}
		return
	}
	log.Debug("decode leg done", "tokens", len(c.Prompt), "generated", len(r.tokens), "seconds", took.Seconds())
	r.answer <- legAnswer{Tokens: r.tokens, Logprobs: r.logprobs, PrefixTokens: r.prefix}
}

// maxPublicScopes bounds the public scopes a decode node names in its
// metrics (the router's declared ones; the router is the only caller).
const maxPublicScopes = 64

// scopeLabel is a request's scope as the metrics name it: the router's
// label, "public:NAME" for a declared public prefix (remembered, so that
// its cached pages are named too) or "tenant".
func (n *Decode) scopeLabel(c *decodeCall) string {
	if c.ScopeLabel == "" || c.ScopeLabel == "tenant" || c.Scope == 0 {
		return "tenant"
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if _, ok := n.public[c.Scope]; !ok && len(n.public) >= maxPublicScopes {
		return "tenant"
	}
	n.public[c.Scope] = c.ScopeLabel
	return c.ScopeLabel
}

// countHit counts a read that reused shared cached pages: the tokens of
// the declared public prefix's pages under its label, those past them (the
// tenant's own pages, salted with its scope though cached under the public
// one) under "tenant", and the hit once, under the label of the last page
// it reused. A tenant's own hits never show under a public label.
func (n *Decode) countHit(c *decodeCall, shared int) {
	label := n.scopeLabel(c)
	public := 0
	if label != "tenant" {
		public = min(shared, max(c.PublicPages, 0))
	}
	if public > 0 {
		n.cfg.Metrics.prefixTok.WithLabelValues(label).Add(float64(public * n.cfg.PageTokens))
	}
	if own := shared - public; own > 0 {
		n.cfg.Metrics.prefixTok.WithLabelValues("tenant").Add(float64(own * n.cfg.PageTokens))
		label = "tenant"
	}
	n.cfg.Metrics.prefixHits.WithLabelValues(label).Inc()
}

// prefixGauges reads the prefix cache's evictions, its pages purged for a
// caught writer, and its pages by scope label.
func (n *Decode) prefixGauges() (evicted, purged uint64, cached map[string]int) {
	by := n.ep.CachedByScope()
	out := map[string]int{}
	n.mu.Lock()
	defer n.mu.Unlock()
	for scope, pages := range by {
		label, ok := n.public[scope]
		if !ok {
			label = "tenant"
		}
		out[label] += pages
	}
	st := n.ep.Stats().Prefix
	return st.PrefixEvictions, st.PrefixPurged, out
}

// sweep, every few milliseconds: a verified request whose prompt never
// came fails after the node's timeout; outcomes no call collected are
// forgotten after it; a failed request's fence wait is measured when its
// pages leave quarantine.
func (n *Decode) sweep(ctx context.Context) {
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		now := time.Now()
		var orphans []protocol.RequestID
		noCall := map[protocol.RequestID]bool{} // orphans verified with no call: the trace tells them apart
		n.mu.Lock()
		for id, r := range n.reqs {
			if r.call == nil && !r.verified.IsZero() && now.Sub(r.verified) > n.cfg.Timeout && r.local == nil {
				r.local = fmt.Errorf("%w: request %d verified, no prompt from the router within %v", ErrNoPrompt, id, n.cfg.Timeout)
				orphans = append(orphans, id)
				noCall[id] = true
			}
			if r.call != nil && r.verified.IsZero() && now.Sub(r.started) > n.cfg.Timeout && r.local == nil {
				// The router's call waits for a transfer that never came
				// (its prefill node never bootstrapped it).
				r.local = fmt.Errorf("%w: request %d: no transfer from prefill node %q within %v", protocol.ErrTimedOut, id, r.call.Prefill, n.cfg.Timeout)
				orphans = append(orphans, id)
			}
		}
		for id, e := range n.ended {
			if now.Sub(e.at) > n.cfg.Timeout {
				delete(n.ended, id)
			}
		}
		fences := make(map[protocol.RequestID]time.Time, len(n.fences))
		for id, t := range n.fences {
			fences[id] = t
		}
		n.mu.Unlock()
		for _, id := range orphans {
			cause := "sweep-no-transfer"
			if noCall[id] {
				cause = "sweep-no-call"
			}
			n.ep.CancelBecause(id, cause)
			// Cancelled before any Bootstrap: only a tombstone, no outcome
			// event; the call is answered here.
			if n.ep.Status(id) == protocol.ReceiverTombstone {
				n.mu.Lock()
				if r := n.reqs[id]; r != nil {
					n.outcomeLocked(transfer.Event{Kind: transfer.Outcome, Request: id, Err: protocol.ErrCancelled}, r)
				}
				n.mu.Unlock()
			}
		}
		for id, t := range fences {
			if n.ep.Status(id) != protocol.ReceiverQuarantine {
				n.cfg.Metrics.fenceWait.Observe(now.Sub(t).Seconds())
				n.mu.Lock()
				delete(n.fences, id)
				n.mu.Unlock()
			}
		}
	}
}

// Serve runs the node until ctx ends: the endpoint's loop, queue-pair setup
// on transferLn (transfer.Serve), the control API on control (with
// /metrics), and its registration. When ctx ends it stops gracefully (see
// Prefill.Serve) and returns once no page is owned or quarantined.
func (n *Decode) Serve(ctx context.Context, control, transferLn net.Listener, grace time.Duration) error {
	if n.cfg.CheckJoin {
		if err := CheckJoin(ctx, n.cfg.Registry, n.Member(listenerAddr(control), listenerAddr(transferLn))); err != nil {
			return err
		}
	}
	run, stop := context.WithCancel(context.Background())
	defer stop()
	// Who may be a peer: the prefill nodes the registry lists, in that role.
	peers, err := watchRoster(run, n.cfg.Registry)
	if err != nil {
		return err
	}
	n.ctl.admit = peers.admit
	var wg sync.WaitGroup
	wg.Go(func() { n.ep.Run(run) })
	wg.Go(func() { n.events(run) })
	wg.Go(func() { n.sweep(run) })
	setupCtx, stopSetup := context.WithCancel(run)
	wg.Go(func() {
		n.ep.Serve(setupCtx, transferLn, transfer.SetupConfig{Name: n.cfg.Name, Incarnation: n.incarnation, TLS: n.cfg.Security.TLS, Insecure: n.cfg.Security.TLS == nil,
			Admit: peers.admit, Log: n.cfg.Log})
	})
	serveCtx, stopServe := context.WithCancel(run)
	served, servedDone := make(chan error, 1), make(chan struct{})
	go func() {
		served <- n.ctl.serve(serveCtx, control, map[string]http.Handler{"/metrics": n.cfg.Metrics.Handler()})
		close(servedDone)
	}()
	regCtx, deregister := context.WithCancel(run)
	n.mu.Lock()
	n.self = n.Member(listenerAddr(control), listenerAddr(transferLn))
	n.mu.Unlock()
	lease, err := Join(regCtx, n.cfg.Registry, n.self, n.cfg.CheckJoin)
	if err != nil {
		deregister()
		stopServe()
		stopSetup()
		return err
	}
	n.cfg.Log.Info("decode node up", "decode", n.cfg.Name, "control", listenerAddr(control), "transfer", listenerAddr(transferLn), "pages", n.cfg.Pages, "page_tokens", n.cfg.PageTokens)
	err = waitForStop(ctx, served, lease)
	if err == nil { // asked to stop (not its registration lost, as in a crash)
		announceStopping(regCtx, n.cfg.Registry, &n.mu, &n.self, n.cfg.unannounced, n.cfg.Log)
	}
	n.shutdown(grace)
	deregister()
	stopSetup()
	stopServe()
	<-servedDone // the answers still being written reach their callers first
	stop()
	n.ep.Close()
	wg.Wait()
	return err
}

func (n *Decode) shutdown(grace time.Duration) {
	held := func() []protocol.RequestID {
		n.mu.Lock()
		defer n.mu.Unlock()
		return slices.Collect(maps.Keys(n.reqs))
	}
	if k := n.flight.drainOrCancel(grace, held, func(id protocol.RequestID) { n.ep.CancelBecause(id, "shutdown") }); k > 0 {
		n.cfg.Log.Warn("decode: cancelled requests at shutdown", "decode", n.cfg.Name, "requests", k)
	}
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	if n.stoppedIdle(ctx) {
		return
	}
	// Quarantined pages wait for their writers' fence: cutting every queue
	// pair is that fence.
	for _, p := range n.ep.Peers() {
		n.ep.Cut(p)
	}
	ctx, cancel = context.WithTimeout(context.Background(), grace)
	defer cancel()
	if n.stoppedIdle(ctx) {
		return
	}
	n.ep.TraceStopped(true)
	n.cfg.Log.Error("decode: pages still held at shutdown", "decode", n.cfg.Name, "gauges", fmt.Sprintf("%+v", n.ep.Gauges()))
}

// stoppedIdle waits until every page is back, and traces the stop (its last
// check of the pool and the event at once: the trace check holds every
// page a Grant of this incarnation named to be freed or cached by then). A
// Bootstrap granted in between, as the node still takes them, makes it
// wait again, until ctx ends: false then.
func (n *Decode) stoppedIdle(ctx context.Context) bool {
	for waitPagesBack(ctx, n.ep.Gauges) {
		if n.ep.TraceStopped(false) {
			return true
		}
	}
	return false
}
