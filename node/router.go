package node

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/internal/trace"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// RouterConfig configures a Router node.
type RouterConfig struct {
	Name     string // the router's identity (its certificate's name)
	Registry Registry
	// Security authenticates the router to the nodes' control APIs (its
	// certificate must be one of their allowed callers) and checks theirs.
	Security Security
	// Tokenizer turns a prompt into tokens and tokens into text; nil means
	// llama.Bytes (the built-in model's).
	Tokenizer llama.Tokenizer
	// ModelID is the model the deployment serves: nodes of another model are
	// not routed to, and a request naming another is refused. "" takes the
	// first node's.
	ModelID string
	// Timeout fails a request without an outcome this long after intake;
	// 0 means 60 s.
	Timeout time.Duration
	// MaxNewTokens bounds a request's max_tokens; 0 means 4096.
	MaxNewTokens int
	// HTTP bounds the client API's connections and requests.
	HTTP HTTPLimits
	// TrustRequestID honours a client's X-Request-Id (a front proxy's,
	// well formed) instead of making a fresh one: only where every client
	// reaches the router through that proxy.
	TrustRequestID bool
	// APIKeys, if set, authenticate the client API (tenant.go): every
	// request carries one as its bearer key (401 otherwise), and its tenant
	// is the key's.
	APIKeys *APIKeys
	// TrustTenantHeader takes the X-Tenant header as authenticated: only
	// where every client reaches the router through a front proxy that
	// authenticates it and sets the header. Without it or APIKeys, no
	// tenant is authenticated and no request gets a prefix cache scope.
	TrustTenantHeader bool
	// ChatTemplate lays out /v1/chat/completions' messages as a prompt; nil
	// means PlainChat.
	ChatTemplate ChatTemplate
	// TicketKey signs a ticket for each dispatched request (ticket.go), the
	// only Bootstrap a decode node reserves for. Required with TLS; without
	// TLS (Insecure), nil signs none.
	TicketKey ed25519.PrivateKey
	// ScopeKey keys the prefix cache's scopes (scope.go): a request's scope
	// is HMAC(ScopeKey, "tenant:"+tenant), or a public prefix's. nil: every
	// request has scope 0 and no prefix is reused.
	ScopeKey []byte
	// PublicPrefixes are prompt prefixes every tenant may share (declared
	// system prompts), each cached under a public scope of its own.
	PublicPrefixes []PublicPrefix
	// Research turns bugs of the catalogue on in the router: client-scope
	// takes a request's scope from its body. Only code inside this module
	// can set it.
	Research research.Switches
	Metrics  *Metrics
	Log      *slog.Logger

	// Trace, if set, receives the router's protocol events (kvhandoff serve
	// --trace; docs/trace.md).
	Trace *trace.Writer

	// beforeDecodeCall, if set, runs before the router calls a request's
	// decode leg (tests: hold the call in flight).
	beforeDecodeCall func(protocol.RequestID)
}

// Router is the router node: protocol.Router driven by a run loop with its
// clock, the registry's view of the nodes, and the legs of every request as
// calls to the nodes' control APIs. The client API (HTTP) is in api.go.
type Router struct {
	cfg    RouterConfig
	client *controlClient
	flight flight
	scopes *scopes // nil: no key, scope 0 for every request

	mu      sync.Mutex
	r       *protocol.Router
	ids     map[string]protocol.NodeID
	members map[protocol.NodeID]Member
	lost    map[protocol.NodeID]bool
	suspect map[protocol.NodeID]bool // lost because its control API stopped answering; probed until it does
	// stopping: the life of the node it knows stops gracefully: its loss is
	// its stop's end, and the requests that loss fails are retried
	// elsewhere. True where its record announced it (the registry will say
	// when it is gone); false where only a leg it refused told (a registry
	// slower than the node's drain, or a node that announced nothing).
	stopping map[protocol.NodeID]bool
	// losing: nodes whose loss loseAfterStop holds back, each with the
	// registration of its new life that came meanwhile (nil if none).
	losing  map[protocol.NodeID]*Change
	pending map[protocol.RequestID]*routed
	// cut is closed when the shutdown's grace has run out: requests
	// waiting to retry (for room, a queue pair or a next life) end then
	// with their last error, as the pending ones are cancelled.
	cut      chan struct{}
	cutOnce  sync.Once // a second Run's shutdown closes cut no second time
	nextID   protocol.RequestID
	nextPeer protocol.NodeID
	ready    chan struct{} // closed once both roles have a node
}

// routed is a request the router accepted and has not answered yet.
type routed struct {
	completion Completion
	prompt     []int
	prefill    string
	decode     string
	tokens     []int                // as the decode node streams them (mu)
	logprobs   []llama.TokenLogprob // one a token, when asked for
	firstToken time.Time            // when the first token came (mu)
	deadline   time.Time            // the client's request's, across attempts
	bytes      int                  // the KV the handoff moves: the prompt's pages on the decode node
	cached     int                  // prompt tokens the decode node had cached (its prefix hit; mu)
	done       chan error           // the client-visible outcome, once
	legs       map[protocol.NodeID]context.CancelFunc
	cancelled  map[protocol.NodeID]bool // legs the router sent a cancel call
}

// Completion is a client's request.
type Completion struct {
	Prompt string
	// Tokens, if not nil, is the prompt as token ids instead of Prompt
	// (BOS is put first unless it is there).
	Tokens    []int
	MaxTokens int
	Tenant    string
	Model     string
	// RequestID is the client request's id in the logs, the same across
	// the router's retries (each attempt a handoff of its own).
	RequestID string
	// Temperature, TopP and Seed are the decode node's sampling
	// (llama.NewSampler); temperature 0 is greedy, exact.
	Temperature, TopP float32
	Seed              uint64
	// Logprobs, if set, asks decode for each generated token's log
	// probability and this many most likely tokens' (Result.Logprobs).
	Logprobs *int
	// BodyScope is the scope a request body named (cache_salt): refused at
	// the API, taken as the tenant of the scope only under the
	// client-scope bug.
	BodyScope string
	// Authenticated says Tenant was authenticated (an API key, or a trusted
	// front proxy's header): only then does the request get a prefix cache
	// scope. A tenant any client can name is a label for the logs.
	Authenticated bool
	// Stream, if set, is given the answer as the decode node generates it,
	// a part at a time, in order, each as soon as it reaches the router
	// (Complete's Result still holds it all). It must not block: the
	// decode leg's stream waits for it. A request that streamed a token is
	// not retried.
	Stream func(Generated)
	// Watch, if set, is given each part as Stream is, for the router's own
	// use (a stop string's search), not the client's: a request watched
	// but not streamed is retried as one with neither, its retry's parts
	// following a failed attempt's (Generated.Handoff is the attempt's).
	// It must not block either.
	Watch func(Generated)
}

// Generated is a part of a completion's answer as it is generated.
type Generated struct {
	Handoff  protocol.RequestID   // the attempt's handoff
	Prefill  string               // the attempt's prefill node
	Decode   string               // and its decode node
	Prompt   []int                // the prompt's tokens, BOS first
	Tokens   []int                // generated since the last part
	Logprobs []llama.TokenLogprob // theirs, when asked for
}

// Result is a completion's answer.
type Result struct {
	ID           protocol.RequestID // the last attempt's handoff
	Prompt       []int              // the prompt's tokens, BOS first
	Text         string
	Tokens       []int
	PromptTokens int
	Prefill      string
	Decode       string
	Logprobs     []llama.TokenLogprob // one a generated token, if asked for
	// CachedTokens are the prompt tokens the decode node found in its
	// prefix cache (not transferred).
	CachedTokens int
	// streamed: tokens of this attempt reached the router (relay), and so
	// may have reached a streaming client: such a failed attempt is not
	// retried.
	streamed bool
}

// NewRouter makes a router node; Run drives it.
func NewRouter(cfg RouterConfig) (*Router, error) {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewMetrics()
	}
	if cfg.Tokenizer == nil {
		cfg.Tokenizer = llama.Bytes{}
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 60 * time.Second
	}
	if cfg.MaxNewTokens == 0 {
		cfg.MaxNewTokens = 4096
	}
	if cfg.Name == "" {
		cfg.Name = "router"
	}
	cfg.HTTP.defaults()
	if cfg.ChatTemplate == nil {
		cfg.ChatTemplate = PlainChat
	}
	if err := cfg.Security.check(cfg.Log, "router "+cfg.Name); err != nil {
		return nil, err
	}
	if cfg.TicketKey == nil && cfg.Security.TLS != nil {
		return nil, fmt.Errorf("node: router %s: no ticket key (kvhandoff certs writes it)", cfg.Name)
	}
	cfg.Metrics.prime(RoleRouter)
	var sc *scopes
	if cfg.ScopeKey != nil {
		var err error
		if sc, err = newScopes(cfg.ScopeKey, cfg.PublicPrefixes, cfg.Tokenizer); err != nil {
			return nil, err
		}
	} else if len(cfg.PublicPrefixes) > 0 {
		return nil, fmt.Errorf("node: router %s: public prefixes without a scope key (or ticket key)", cfg.Name)
	}
	rt := &Router{scopes: sc, cfg: cfg, client: newControlClient(cfg.Security),
		r:   protocol.NewRouter(protocol.RouterConfig{Timeout: cfg.Timeout, Horizon: time.Minute, Policy: LeastOutstanding{}}),
		ids: map[string]protocol.NodeID{}, members: map[protocol.NodeID]Member{}, lost: map[protocol.NodeID]bool{},
		suspect: map[protocol.NodeID]bool{}, stopping: map[protocol.NodeID]bool{}, losing: map[protocol.NodeID]*Change{}, pending: map[protocol.RequestID]*routed{}, cut: make(chan struct{}), nextID: protocol.RequestID(time.Now().UnixNano()), ready: make(chan struct{})}
	rt.client.expect = func(name string) (Role, bool) {
		// A node's certificate must carry the role its registry record gives it.
		rt.mu.Lock()
		defer rt.mu.Unlock()
		id, ok := rt.ids[name]
		if !ok || rt.members[id].Role == "" {
			return "", false
		}
		return rt.members[id].Role, true
	}
	cfg.Metrics.routerGauges(func() (prefills, decodes, inFlight int) {
		rt.mu.Lock()
		defer rt.mu.Unlock()
		for _, n := range rt.r.Nodes() {
			if n.Info.Role == protocol.RolePrefill {
				prefills++
			} else {
				decodes++
			}
		}
		return prefills, decodes, len(rt.pending)
	})
	return rt, nil
}

// Metrics are the router's metrics.
func (rt *Router) Metrics() *Metrics { return rt.cfg.Metrics }

// Ready is closed once the router knows a prefill and a decode node.
func (rt *Router) Ready() <-chan struct{} { return rt.ready }

// Limit is the longest prompt the deployment takes now, in tokens.
func (rt *Router) Limit() int {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	return rt.r.Limit()
}

// Run drives the router until ctx ends: the registry's changes, and the
// clock (timeouts, the records' horizon). On the way out it stops intake and
// waits up to grace for the requests in flight, then fails the rest.
func (rt *Router) Run(ctx context.Context, grace time.Duration) error {
	changes, err := rt.cfg.Registry.Watch(ctx)
	if err != nil {
		return err
	}
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case ch, ok := <-changes:
			if !ok {
				if ctx.Err() == nil {
					rt.cfg.Log.Error("router: the registry watch ended")
				}
				changes = nil
				continue
			}
			rt.change(ch)
		case now := <-tick.C:
			rt.mu.Lock()
			rt.r.Tick(now)
			rt.effectsLocked()
			rt.mu.Unlock()
		}
	}
	rt.shutdown(grace)
	return nil
}

func (rt *Router) shutdown(grace time.Duration) {
	idle := rt.flight.drain()
	select {
	case <-idle:
	case <-time.After(grace):
		rt.cutOnce.Do(func() { close(rt.cut) }) // before mu: an attempt that registers after the cancels below sees it
		rt.mu.Lock()
		n := len(rt.pending)
		for id := range rt.pending {
			rt.r.Cancel(id)
		}
		rt.effectsLocked()
		rt.mu.Unlock()
		rt.cfg.Log.Warn("router: cancelled requests at shutdown", "requests", n)
		select {
		case <-idle:
		case <-time.After(grace):
		}
	}
	rt.client.close()
}

func (rt *Router) change(ch Change) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	rt.changeLocked(ch)
}

// changeLocked is change; the caller holds mu.
func (rt *Router) changeLocked(ch Change) {
	m := ch.Member
	if m.Role != RolePrefill && m.Role != RoleDecode {
		return
	}
	if rt.cfg.ModelID == "" {
		rt.cfg.ModelID = m.Model
	}
	if m.Model != rt.cfg.ModelID {
		rt.cfg.Log.Warn("router: a node of another model is not routed to", "node", m.Name, "model", m.Model, "serving", rt.cfg.ModelID)
		return
	}
	id, ok := rt.ids[m.Name]
	if !ok {
		if ch.Kind == Lost {
			return
		}
		rt.nextPeer++
		id = rt.nextPeer
		rt.ids[m.Name] = id
	}
	switch ch.Kind {
	case Joined:
		if _, waiting := rt.losing[id]; waiting && m.Incarnation != rt.members[id].Incarnation {
			// A new life while the old one's loss waits for its requests
			// (loseAfterStop): it joins once that loss is taken. Taken
			// now, through AddNode, the loss would fail the old life's
			// requests still being decoded.
			rt.losing[id] = &ch
			return
		}
		if old := rt.members[id]; m.Incarnation > old.Incarnation && rt.stopping[id] && !rt.lost[id] && rt.r.Undecided(id) > 0 {
			// A new life before the registry told of the old one's loss
			// (a static peer list sees a quick restart so, etcd a new
			// life registered before the old lease's end): the old life
			// stopped as it announced, and its loss, the stop's end, waits
			// for its requests' other legs as if the registry had told it.
			rt.losing[id] = &ch
			go rt.loseAfterStop(id, old)
			return
		}
		if old := rt.members[id]; m.Stopping && old.Role == m.Role && old.Incarnation == m.Incarnation && !rt.lost[id] {
			// The life it knows announces its graceful stop: no new
			// request goes to it for the rest of that life.
			rt.members[id] = m
			rt.stoppingLocked(id, time.Now().Add(announcedStop), true)
			return
		}
		if rt.members[id].Role != "" && rt.members[id].Role != m.Role {
			rt.cfg.Log.Error("router: a node changed role; ignored", "node", m.Name)
			return
		}
		if old := rt.members[id]; old.Role != "" && m.Incarnation < old.Incarnation {
			// The registry's record is the current one (etcd's watch is in
			// revision order; a static peer answers for the process it is), so
			// a smaller incarnation is a restart whose wall clock stepped back
			// (NTP, a migrated VM), not a stale registration: the old life is
			// lost, and the node joins again rather than being refused forever.
			rt.cfg.Log.Warn("router: node restarted under a smaller incarnation (its clock went back); its old life is lost", "node", m.Name, "incarnation", m.Incarnation, "was", old.Incarnation)
			rt.cfg.Trace.Emit(trace.Event{Kind: trace.NodeLost, Peer: m.Name, Role: string(m.Role), Cause: "restarted"})
			if err := rt.r.RemoveNode(id); err != nil {
				rt.cfg.Log.Error("router: node lost", "node", m.Name, "err", err)
			}
			rt.effectsLocked()
		}
		if err := rt.r.AddNode(m.nodeInfo(id)); err != nil {
			rt.cfg.Log.Error("router: node refused", "node", m.Name, "err", err)
			return
		}
		// A larger incarnation is a restart: the old life's requests fail.
		if old := rt.members[id]; old.Role != "" && m.Incarnation > old.Incarnation && !rt.lost[id] {
			rt.cfg.Trace.Emit(trace.Event{Kind: trace.NodeLost, Peer: m.Name, Role: string(m.Role), Cause: "restarted"})
		}
		rt.effectsLocked()
		event := "joined"
		if rt.members[id].Role != "" {
			event = "rejoined"
		}
		rt.cfg.Metrics.nodeEvents.WithLabelValues(string(m.Role), event).Inc()
		if old := rt.members[id]; old.Incarnation != m.Incarnation {
			delete(rt.stopping, id) // a new life
		}
		rt.members[id] = m
		delete(rt.lost, id)
		delete(rt.suspect, id)
		if m.Stopping {
			// Stopping when first seen (a router that came up meanwhile).
			rt.stoppingLocked(id, time.Now().Add(announcedStop), true)
		}
		rt.cfg.Log.Info("router: node joined", "node", m.Name, "role", m.Role, "control", m.Control, "pool_tokens", m.PoolTokens(), "context_tokens", m.ContextTokens)
		rt.checkReadyLocked()
	case Lost:
		if _, waiting := rt.losing[id]; waiting {
			if m.Incarnation != rt.members[id].Incarnation {
				rt.losing[id] = nil // the new life, held back, left again
			}
			return
		}
		if rt.stopping[id] && !rt.lost[id] && rt.r.Undecided(id) > 0 {
			rt.losing[id] = nil
			go rt.loseAfterStop(id, m)
			return
		}
		rt.loseLocked(id, m)
	}
}

// loseLocked takes node id's loss (the registry lost m): every request
// dispatched to it without an outcome fails. The caller holds mu.
func (rt *Router) loseLocked(id protocol.NodeID, m Member) {
	if !rt.lost[id] {
		rt.cfg.Metrics.nodeEvents.WithLabelValues(string(m.Role), "lost").Inc()
	}
	delete(rt.suspect, id)
	rt.lost[id] = true
	rt.cfg.Trace.Emit(trace.Event{Kind: trace.NodeLost, Peer: m.Name, Role: string(m.Role), Cause: "registry"})
	if err := rt.r.NodeLost(id); err != nil {
		rt.cfg.Log.Error("router: node lost", "node", m.Name, "err", err)
	}
	rt.cfg.Log.Warn("router: node lost; its requests fail on every leg", "node", m.Name, "role", m.Role)
	rt.effectsLocked()
}

// loseAfterStop takes the loss of a node that stopped gracefully once the
// requests dispatched to it have their outcomes, or after the router's
// timeout. Its stop drained its own legs, but not the other legs of its
// requests: a prefill node's requests still being decoded, a decode node's
// answers still on their way to the router. Taken at once, the loss would
// fail them (a lost node fails every request dispatched to it, rule 14),
// though nothing of theirs needs the node any more. A stop that ended has
// its pages back (it waited for them); a node that crashed as it stopped
// keeps decode's pages for it quarantined until the loss's fence, so the
// wait delays that fence, never breaks it. A new life registered
// meanwhile joins once the loss is taken (change).
func (rt *Router) loseAfterStop(id protocol.NodeID, m Member) {
	deadline := time.Now().Add(max(rt.cfg.Timeout, time.Second))
	for {
		time.Sleep(20 * time.Millisecond)
		rt.mu.Lock()
		if !rt.lost[id] && rt.r.Undecided(id) > 0 && time.Now().Before(deadline) {
			rt.mu.Unlock()
			continue
		}
		joined := rt.losing[id]
		if !rt.lost[id] {
			// With a new life registered, decode nodes cut the old life's
			// queue pair only (PeerLost names the life): the new life's,
			// if up, replaced it and stays.
			rt.loseLocked(id, m)
		}
		delete(rt.losing, id)
		if joined != nil {
			// The new life, held back meanwhile, joins under the same
			// lock: a request between the two would find neither life
			// (nextLifeDue) and fail with no_node.
			rt.changeLocked(*joined)
		}
		rt.mu.Unlock()
		return
	}
}

func (rt *Router) checkReadyLocked() {
	var pre, dec bool
	for _, n := range rt.r.Nodes() {
		pre = pre || n.Info.Role == protocol.RolePrefill
		dec = dec || n.Info.Role == protocol.RoleDecode
	}
	if pre && dec {
		select {
		case <-rt.ready:
		default:
			close(rt.ready)
		}
	}
}

// Complete runs one completion: intake (an over-long prompt is refused with
// protocol.ErrRejected and ErrTooLong, the limit named), a prefill and a
// decode node chosen, both legs called, and the first outcome. When ctx
// ends first (the client went away) the request is cancelled on both legs.
//
// A request that failed only because a pool had no room (no capacity on
// prefill or decode, or over the prefill node's quota on decode: nothing was
// transferred) is retried under a new ID,
// with backoff, until the router's timeout: full pools make clients wait,
// not fail, while room comes back. So is one whose prefill node had no
// queue pair to its decode node yet (one just joined), one a node
// refused as it stops (or whose stop's end failed it), while other nodes
// take it, and one no node took while a node of the role stops
// (nextLifeDue): a rolling restart fails no request.
func (rt *Router) Complete(ctx context.Context, c Completion) (Result, error) {
	if !rt.flight.enter() {
		return Result{}, ErrShuttingDown
	}
	defer rt.flight.leave()
	deadline := time.Now().Add(rt.cfg.Timeout)
	backoff := 2 * time.Millisecond
	var streamed atomic.Bool
	if to := c.Stream; to != nil {
		c.Stream = func(g Generated) {
			streamed.Store(true)
			to(g)
		}
	}
	for attempt := 1; ; attempt++ {
		res, err := rt.complete(ctx, c, attempt, deadline)
		// Over a peer's quota is no room for that peer now, as a full pool
		// is. No queue pair yet between the two nodes is as passing: one
		// of them has just joined, and its peers dial it once they see its
		// record (prefill refuses at its intake, before anything is sent).
		full := errors.Is(err, protocol.ErrNoCapacity) || errors.Is(err, protocol.AbortNoCapacity) || errors.Is(err, protocol.AbortOverQuota) ||
			errors.Is(err, transfer.ErrNoPeer)
		// No node to take it, where a node of that role is stopping
		// gracefully or its next life is held back: a rolling restart
		// whose next step came before the router saw the last step's new
		// life (a static list's read, a watch event away). It waits for
		// that life, as for room.
		nextLife := errors.Is(err, protocol.ErrNoNode) && rt.nextLifeDue(len(res.Prompt))
		// Tokens that reached the router reach a streaming client: such an
		// attempt is not retried. A client that is not streaming has seen
		// nothing: a decode node's answer begun as the other leg failed (a
		// WRITE that landed, its completion flushed as the decode node
		// stopped) is dropped, and the retry answers it.
		began := streamed.Load() || res.streamed && c.Stream != nil
		if !full && !nextLife && !rt.elsewhere(err, len(res.Prompt)) || began || time.Now().Add(backoff).After(deadline) {
			return res, err
		}
		rt.cfg.Metrics.retries.Inc()
		rt.cfg.Trace.Emit(trace.Event{Kind: trace.Retry, Req: uint64(res.ID), Reason: Reason(err), Err: trace.ErrText(err)})
		says := "request waits for room"
		switch {
		case errors.Is(err, transfer.ErrNoPeer):
			says = "request waits for a queue pair between its nodes"
		case nextLife:
			says = "request waits for a stopping node's next life"
		case !full:
			says = "request retried elsewhere: a node of its handoff is stopping"
		}
		rt.cfg.Log.Info(says, "request_id", c.RequestID, "attempt", attempt, "handoff_id", idString(res.ID), "reason", Reason(err))
		rt.cfg.Metrics.waiting.Inc()
		select {
		case <-ctx.Done():
			rt.cfg.Metrics.waiting.Dec()
			return res, err
		case <-rt.cut:
		case <-time.After(backoff):
		}
		rt.cfg.Metrics.waiting.Dec()
		if rt.isCut() {
			// The router's stop has cancelled the pending requests: a
			// waiting one ends too. (An attempt begun as cut closes is
			// refused by complete.)
			return res, fmt.Errorf("%w (the router stopped as the request waited)", err)
		}
		backoff = min(2*backoff, 100*time.Millisecond)
	}
}

// isCut reports whether the router's stop has cut its requests short
// (cut closed).
func (rt *Router) isCut() bool {
	select {
	case <-rt.cut:
		return true
	default:
		return false
	}
}

// elsewhere reports whether err is a node's refusal of a leg as it stops,
// or the end of a node known to stop (lost, unreachable, its queue pairs
// flushed: a request dispatched to it just before it said so, or whose
// answer was still on its way), and other nodes can take a request of
// tokens now: the client need not hear of one node's stop. Complete
// retries only what streamed no token to its client, and the attempt's legs are ended,
// so the retry is a new handoff, as for a full pool. With no other node,
// the client gets the error (503 shutting_down naming the nodes, for a
// refusal).
func (rt *Router) elsewhere(err error, tokens int) bool {
	var he *HandoffError
	if !errors.As(err, &he) {
		return false
	}
	rt.mu.Lock()
	defer rt.mu.Unlock()
	// A node of the handoff stopping: its loss, its queue pairs flushed or
	// its control API gone (the stop's end, before the router heard of
	// it) are the stop's too.
	// (Only a stop its record announced: one only a refusal told of is
	// out of rotation for a second, and its end is not known to be near.)
	stops := rt.stopping[rt.ids[he.Prefill]] || rt.stopping[rt.ids[he.Decode]]
	gone := errors.Is(err, protocol.ErrPeerFailed) || errors.Is(err, ErrUnreachable) // ErrNodeLost is an ErrPeerFailed
	if !errors.Is(err, ErrShuttingDown) && !(gone && stops) {
		return false
	}
	now := time.Now()
	return rt.r.Available(protocol.RolePrefill, tokens, now) && rt.r.Available(protocol.RoleDecode, tokens, now)
}

// nextLifeDue reports whether a request of tokens that no node took
// (protocol.ErrNoNode) may yet be taken by a node's next life: every role
// with no node to take it has a node that takes that many tokens and
// announced its stop and is still stopping, or whose next life is
// registered and held back until the old one's loss (loseAfterStop). A
// node whose stop has ended and whose next life is unknown is not waited
// for: the router cannot tell a restart from a node removed, and the
// client hears at once. So too where another role has no node at all.
func (rt *Router) nextLifeDue(tokens int) bool {
	if tokens < 1 {
		return false // refused before intake chose a node
	}
	rt.mu.Lock()
	defer rt.mu.Unlock()
	now := time.Now()
	short := 0
	for _, role := range [...]protocol.Role{protocol.RolePrefill, protocol.RoleDecode} {
		if rt.r.Available(role, tokens, now) {
			continue
		}
		short++
		due := false
		for id, m := range rt.members {
			info := m.nodeInfo(id)
			if info.Role == role && tokens <= info.Limit() && (rt.stopping[id] && !rt.lost[id] || rt.losing[id] != nil) {
				due = true
				break
			}
		}
		if !due {
			return false
		}
	}
	return short > 0
}

// complete is one attempt at c, which fails by deadline: the client's
// request's, the same for all its attempts.
func (rt *Router) complete(ctx context.Context, c Completion, attempt int, deadline time.Time) (Result, error) {
	if c.BodyScope != "" && !rt.cfg.Research.Has(research.ClientScope) {
		return Result{}, scopeParam("cache_salt") // a request never names its scope
	}
	if c.MaxTokens < 1 || c.MaxTokens > rt.cfg.MaxNewTokens {
		return Result{}, badParam("max_tokens", "invalid_value", "max_tokens %d is outside 1..%d", c.MaxTokens, rt.cfg.MaxNewTokens)
	}
	// The deployment's limit bounds what tokenizing costs: a prompt over it
	// is refused by its length before it is tokenized, or as soon as its
	// tokens pass the limit.
	limit := rt.Limit()
	if limit == 0 {
		return Result{}, fmt.Errorf("%w: the router knows no prefill and decode node yet", protocol.ErrNoNode)
	}
	prompt, err := rt.tokenize(c, limit)
	if err != nil {
		return Result{}, err
	}
	rt.mu.Lock()
	if rt.isCut() {
		// The router's stop has cancelled its pending requests (it closes
		// cut before it takes mu to do so): no attempt begins after.
		rt.mu.Unlock()
		return Result{Prompt: prompt, PromptTokens: len(prompt)}, ErrShuttingDown
	}
	if c.Model != "" && rt.cfg.ModelID != "" && c.Model != rt.cfg.ModelID {
		rt.mu.Unlock()
		return Result{}, badParam("model", "model_not_found", "model %.64q: this deployment serves %q", c.Model, rt.cfg.ModelID)
	}
	if c.Model == "" {
		c.Model = rt.cfg.ModelID
	}
	rt.nextID++
	id := rt.nextID
	if rt.r.Limit() == 0 {
		rt.mu.Unlock()
		return Result{Prompt: prompt, PromptTokens: len(prompt)}, fmt.Errorf("%w: the router knows no prefill and decode node yet", protocol.ErrNoNode)
	}
	if c.RequestID == "" {
		c.RequestID = strconv.FormatUint(uint64(id), 10)
	}
	q := &routed{completion: c, prompt: prompt, deadline: deadline, done: make(chan error, 1), legs: map[protocol.NodeID]context.CancelFunc{}, cancelled: map[protocol.NodeID]bool{}}
	rt.pending[id] = q
	d, err := rt.r.SubmitBy(id, len(prompt), time.Now(), deadline)
	if err != nil {
		rt.cfg.Trace.Emit(trace.Event{Kind: trace.Refuse, Req: uint64(id), Tokens: uint32(len(prompt)), Reason: Reason(err), Err: err.Error()})
		delete(rt.pending, id)
		rt.mu.Unlock()
		rt.cfg.Metrics.leg(RoleRouter, err, 0, 0)
		rt.cfg.Log.Info("request refused", "request_id", c.RequestID, "attempt", attempt, "handoff_id", idString(id), "tenant", c.Tenant, "model", c.Model, "prefill", "", "decode", "", "tokens", len(prompt), "reason", Reason(err), "err", err)
		return Result{ID: id, Prompt: prompt, PromptTokens: len(prompt)}, err
	}
	q.prefill, q.decode = rt.members[d.Prefill].Name, rt.members[d.Decode].Name
	dm := rt.members[d.Decode]
	q.bytes = protocol.PagesFor(uint32(len(prompt)), dm.PageTokens) * dm.PageBytes
	rt.effectsLocked()
	rt.mu.Unlock()
	start := time.Now()
	log := rt.cfg.Log.With("request_id", c.RequestID, "attempt", attempt, "handoff_id", idString(id), "tenant", c.Tenant, "model", c.Model, "prefill", q.prefill, "decode", q.decode)
	log.Debug("request dispatched", "tokens", len(prompt), "max_tokens", c.MaxTokens)
	select {
	case err = <-q.done:
	case <-ctx.Done():
		rt.mu.Lock()
		rt.cfg.Trace.Emit(trace.Event{Kind: trace.CancelLegs, Req: uint64(id), Cause: "client"})
		rt.r.Cancel(id)
		rt.effectsLocked()
		rt.mu.Unlock()
		err = <-q.done
	}
	took := time.Since(start)
	var bytes int
	rt.mu.Lock()
	tokens, logprobs, first, cached := q.tokens, q.logprobs, q.firstToken, q.cached
	rt.mu.Unlock()
	if err == nil {
		bytes = q.bytes
		if n := len(tokens); n > 0 {
			rt.cfg.Metrics.ttft.Observe(first.Sub(start).Seconds())
			if n > 1 {
				rt.cfg.Metrics.tpot.Observe(time.Since(first).Seconds() / float64(n-1))
			}
		}
	}
	rt.cfg.Metrics.leg(RoleRouter, err, took, bytes)
	res := Result{ID: id, Prompt: prompt, PromptTokens: len(prompt), Prefill: q.prefill, Decode: q.decode, streamed: len(tokens) > 0}
	if err != nil {
		log.Info("request failed", "tokens", len(prompt), "reason", Reason(err), "err", err, "seconds", took.Seconds())
		return res, &HandoffError{Prefill: q.prefill, Decode: q.decode, Err: err}
	}
	res.Tokens, res.Logprobs, res.CachedTokens = tokens, logprobs, cached
	res.Text = llama.Decode(rt.cfg.Tokenizer, tokens, prompt[len(prompt)-1])
	log.Info("request done", "tokens", len(prompt), "generated", len(tokens), "seconds", took.Seconds())
	return res, nil
}

// tokenize is c's prompt as tokens, BOS first, at most limit of them:
// text over the limit is refused before it is tokenized
// (Tokenizer.EncodeLimit), token ids before they are copied. Every prompt
// starts with BOS, the model's beginning of sequence; a prompt that would
// put another one inside it is refused.
func (rt *Router) tokenize(c Completion, limit int) ([]int, error) {
	tooLong := func(err error) error {
		return fmt.Errorf("%w: %w: %w", protocol.ErrRejected, protocol.ErrTooLong, err)
	}
	if c.Tokens != nil {
		toks := c.Tokens
		if len(toks) > 0 && toks[0] == llama.BOS {
			toks = toks[1:]
		}
		if len(toks)+1 > limit {
			return nil, tooLong(fmt.Errorf("%d prompt tokens and BOS, the limit is %d", len(toks), limit))
		}
		for i, t := range toks {
			if t < 0 || t >= rt.cfg.Tokenizer.Vocab() || t == llama.BOS {
				return nil, badParam("prompt", "invalid_prompt", "prompt token %d at %d is not a token of the vocabulary of %d (or is BOS)", t, i, rt.cfg.Tokenizer.Vocab())
			}
		}
		return append([]int{llama.BOS}, toks...), nil
	}
	if c.Prompt == "" {
		return nil, badParam("prompt", "invalid_prompt", "the prompt is empty")
	}
	if err := rt.cfg.Tokenizer.Check(c.Prompt); err != nil {
		return nil, &RequestError{Param: "prompt", Code: "invalid_prompt", Err: err,
			Message: "the prompt holds text the tokenizer will not encode: " + strings.TrimPrefix(err.Error(), llama.ErrText.Error()+": ")}
	}
	prompt, err := rt.cfg.Tokenizer.EncodeLimit(c.Prompt, true, false, limit)
	if err != nil {
		return nil, tooLong(err)
	}
	return prompt, nil
}

// idString is a handoff's id as logs carry it: a string (a JSON number
// above 2^53 is rounded by most readers).
func idString(id protocol.RequestID) string { return strconv.FormatUint(uint64(id), 10) }

// wireLives is the first wire version whose nodes know lives
// (incarnations): a /peer-lost call may name one.
const wireLives = 4

// tellPeerLost tells decode node node that prefill node peer's life, as
// peer names it, is lost: the decode node cuts that life's queue pair.
func tellPeerLost(ctx context.Context, client *controlClient, node, peer Member) error {
	call := peerLostCall{Peer: peer.Name, Incarnation: peer.Incarnation}
	if node.Wire < wireLives {
		// A decode node of wire version 3 (a rolling upgrade) knows no
		// lives, and refuses the field: its cut, by name, is still the
		// fence.
		call.Incarnation = 0
	}
	return client.call(ctx, node.Name, node.Control, pathPeerLost, call, nil)
}

// effectsLocked carries out the router's effects. The caller holds mu.
func (rt *Router) effectsLocked() {
	e := rt.r.Effects()
	for _, d := range e.Dispatches {
		rt.dispatchLocked(d)
	}
	for _, c := range e.Cancels {
		rt.cancelLegLocked(c)
	}
	for _, pl := range e.PeerLost {
		node, peer := rt.members[pl.Node], rt.members[pl.Lost]
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := tellPeerLost(ctx, rt.client, node, peer); err != nil {
				rt.cfg.Log.Warn("router: telling a decode node of a lost prefill node", "decode", node.Name, "prefill", peer.Name, "err", err)
			}
		}()
	}
	for _, o := range e.Outcomes {
		if q := rt.pending[o.Request]; q != nil {
			if rt.cfg.Trace != nil {
				rt.cfg.Trace.Emit(trace.Event{Kind: trace.ClientEnd, Req: uint64(o.Request), Err: trace.ErrText(o.Err)})
			}
			delete(rt.pending, o.Request)
			if o.Err != nil {
				// A failed request's legs end now, even one the router ended
				// without a cancel (the decode leg of a lost prefill node):
				// its call closes, and the node cancels what it holds; a
				// call cut before it reached the node is followed by a
				// cancel call (cancelCutCall).
				for _, stop := range q.legs {
					stop()
				}
			}
			q.done <- o.Err
		}
	}
}

func (rt *Router) dispatchLocked(d protocol.Dispatch) {
	q := rt.pending[d.Request]
	if q == nil {
		return
	}
	pre, dec := rt.members[d.Prefill], rt.members[d.Decode]
	rt.cfg.Trace.Emit(trace.Event{Kind: trace.Dispatch, Req: uint64(d.Request), Peer: pre.Name, Decode: dec.Name, Tokens: uint32(len(q.prompt)), PageTokens: uint32(dec.PageTokens)})
	c := q.completion
	scope, chain, label := rt.scopeOf(c, q.prompt, dec.PageTokens)
	var ticket []byte
	if rt.cfg.TicketKey != nil {
		// The decode node's proof that this router dispatched the request,
		// from this prefill node, with these tokens, in this scope with this
		// chain, for as long as it waits.
		var err error
		ticket, err = SignTicket(rt.cfg.TicketKey, Ticket{Request: d.Request, Tokens: uint32(len(q.prompt)), Prefill: pre.Name, Decode: dec.Name,
			Expires: q.deadline, Scope: scope, Chain: chainDigest(chain)})
		if err != nil {
			rt.cfg.Log.Error("router: signing a ticket", "request_id", uint64(d.Request), "err", err)
		}
	}
	preCtx, preCancel := context.WithCancel(context.Background())
	decCtx, decCancel := context.WithCancel(context.Background())
	q.legs[d.Prefill], q.legs[d.Decode] = preCancel, decCancel
	go func() {
		defer decCancel()
		if rt.cfg.beforeDecodeCall != nil {
			rt.cfg.beforeDecodeCall(d.Request)
		}
		err := rt.client.stream(decCtx, dec.Name, dec.Control, pathDecode,
			decodeCall{ID: d.Request, Prefill: pre.Name, Prompt: q.prompt, MaxTokens: c.MaxTokens, Tenant: c.Tenant, Model: c.Model,
				RequestID: c.RequestID, Temperature: c.Temperature, TopP: c.TopP, Seed: c.Seed, Logprobs: c.Logprobs, Scope: scope, ScopeLabel: label,
				PublicPages: rt.scopes.publicPages(label, dec.PageTokens)},
			func(f legAnswer) error { return rt.relay(d.Request, dec.Name, q, f) })
		fix := !rt.cfg.Research.Has(research.NoCutCallCancel)
		if err != nil && decCtx.Err() != nil && fix {
			rt.cancelCutCall(d.Decode, d.Request, q)
		}
		rt.legEnded(d.Decode, d.Request, err, q)
		if errors.Is(err, ErrShuttingDown) && fix {
			// The node refused the call as it stops: the call never
			// reached the leg, which may hold the request's verified
			// pages waiting for it. Once the request has failed (above),
			// a cancel call ends the leg, as for a cut call.
			rt.cancelCutCall(d.Decode, d.Request, q)
		}
	}()
	go func() {
		defer preCancel()
		err := rt.client.call(preCtx, pre.Name, pre.Control, pathPrefill,
			prefillCall{ID: d.Request, Decode: dec.Name, Prompt: q.prompt, Tenant: c.Tenant, Model: c.Model, RequestID: c.RequestID, Ticket: ticket,
				Scope: scope, Chain: chain}, nil)
		rt.legEnded(d.Prefill, d.Request, err, q)
	}()
}

// relay takes a frame of the tokens a decode node streams for request id:
// kept for the answer, and passed on to the client's stream at once. The
// node's word is bounded by what was asked: no more tokens than
// max_tokens, a log probability for each token or none at all, only when
// asked for, every token in the vocabulary; anything else fails the leg.
func (rt *Router) relay(id protocol.RequestID, node string, q *routed, f legAnswer) error {
	c := q.completion
	rt.mu.Lock()
	had := len(q.tokens)
	bad := ""
	switch {
	case had+len(f.Tokens) > c.MaxTokens:
		bad = fmt.Sprintf("%d tokens past %d, the max_tokens asked for", had+len(f.Tokens), c.MaxTokens)
	case len(f.Logprobs) > 0 && (c.Logprobs == nil || len(f.Logprobs) != len(f.Tokens) || len(q.logprobs) != had),
		len(f.Logprobs) == 0 && len(q.logprobs) > 0:
		// (A node without a model has none to give: it gives none at all.)
		bad = fmt.Sprintf("%d log probabilities for %d tokens", len(f.Logprobs), len(f.Tokens))
	}
	for _, t := range f.Tokens {
		if t < 0 || t >= rt.cfg.Tokenizer.Vocab() {
			bad = fmt.Sprintf("token %d outside the vocabulary", t)
		}
	}
	if bad != "" {
		rt.mu.Unlock()
		return fmt.Errorf("%w: decode node %q streamed %s", protocol.ErrPeerFailed, node, bad)
	}
	if rt.pending[id] != q {
		// The request has its outcome (a failure: the leg's call is being
		// closed): a frame still buffered is not the client's, which may
		// be getting a retry's answer.
		rt.mu.Unlock()
		return nil
	}
	if had == 0 {
		q.firstToken = time.Now()
	}
	q.tokens = append(q.tokens, f.Tokens...)
	q.logprobs = append(q.logprobs, f.Logprobs...)
	if f.PrefixTokens > 0 {
		q.cached = f.PrefixTokens
	}
	rt.mu.Unlock()
	if c.Stream != nil || c.Watch != nil {
		g := Generated{Handoff: id, Prefill: q.prefill, Decode: q.decode, Prompt: q.prompt, Tokens: f.Tokens, Logprobs: f.Logprobs}
		if c.Watch != nil {
			c.Watch(g)
		}
		if c.Stream != nil {
			c.Stream(g)
		}
	}
	return nil
}

// enough tells the decode node of request id's attempt that the client has
// its answer (a stop string came): the node ends the generation before its
// next token, and the leg succeeds with the tokens so far. Asynchronous,
// and harmless after the leg ended.
func (rt *Router) enough(id protocol.RequestID) {
	rt.mu.Lock()
	q := rt.pending[id]
	var m Member
	if q != nil {
		m = rt.members[rt.ids[q.decode]]
	}
	rt.mu.Unlock()
	if q == nil || m.Control == "" {
		return
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := rt.client.call(ctx, m.Name, m.Control, pathEnough, cancelCall{ID: id}, nil); err != nil {
			rt.cfg.Log.Info("router: ending a generation at its stop", "handoff_id", idString(id), "node", m.Name, "err", err)
		}
	}()
}

// scopeOf is a request's cache scope and chain for a decode node of
// pageTokens tokens a page, and the scope's metrics label: from the
// authenticated tenant (or a public prefix the prompt starts with), never
// from the request, except under the client-scope bug, which takes the
// tenant its body named. Without a scope key: scope 0, no chain, no reuse.
func (rt *Router) scopeOf(c Completion, prompt []int, pageTokens int) (protocol.Scope, []protocol.ChainHash, string) {
	if rt.scopes == nil || pageTokens < 1 {
		return 0, nil, "tenant"
	}
	tenant := c.Tenant
	switch {
	case c.BodyScope != "" && rt.cfg.Research.Has(research.ClientScope):
		tenant = c.BodyScope
	case !c.Authenticated:
		return 0, nil, "tenant"
	}
	return rt.scopes.of(tenant, prompt, pageTokens)
}

// cancelCutCall: the router cut a decode leg's call short (the request
// failed elsewhere, a lost prefill node's above all, which ends the decode
// leg without a cancel of the protocol's), or the node refused it as it
// stops. A call cut in flight may never have reached the node, and a
// refused one did not: the node may hold the request's verified pages
// waiting for it, and a cancel call says the request is over. Not for a
// leg whose cancel was sent already, nor for a lost node.
func (rt *Router) cancelCutCall(node protocol.NodeID, id protocol.RequestID, q *routed) {
	rt.mu.Lock()
	m, skip := rt.members[node], q.cancelled[node] || rt.lost[node]
	q.cancelled[node] = true
	if !skip {
		rt.cfg.Trace.Emit(trace.Event{Kind: trace.CutCall, Req: uint64(id), Peer: m.Name})
	}
	rt.mu.Unlock()
	if !skip {
		rt.callCancel(m, id)
	}
}

// callCancel asks node m to cancel request id (its /cancel, idempotent there).
func (rt *Router) callCancel(m Member, id protocol.RequestID) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := rt.client.call(ctx, m.Name, m.Control, pathCancel, cancelCall{ID: id}, nil); err != nil {
		rt.cfg.Log.Warn("router: cancelling a leg", "handoff_id", idString(id), "node", m.Name, "err", err)
	}
}

func (rt *Router) legEnded(node protocol.NodeID, id protocol.RequestID, err error, q *routed) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	rt.cfg.Trace.Emit(trace.Event{Kind: trace.LegEnd, Req: uint64(id), Peer: rt.members[node].Name, Err: trace.ErrText(err)})
	if e := rt.r.LegEnded(node, id, err); e != nil && !errors.Is(e, protocol.ErrUnknownRequest) {
		rt.cfg.Log.Warn("router: a leg's report refused", "handoff_id", idString(id), "node", rt.members[node].Name, "err", e)
	}
	if errors.Is(err, ErrUnreachable) && !rt.lost[node] && !rt.stopping[node] {
		// (A node whose record announced its stop is lost when the
		// registry says so: loseAfterStop lets its requests' other legs end.)
		rt.suspectLocked(node, err)
	}
	if errors.Is(err, ErrShuttingDown) && !rt.lost[node] {
		// The node refused the leg as it stops gracefully: no new request
		// goes to it for a while, even where its record did not say so (yet),
		// and Complete retries this one elsewhere.
		rt.stoppingLocked(node, time.Now().Add(stoppingWindow), false)
	}
	rt.effectsLocked()
}

// stoppingLocked takes node out of rotation until until, its requests
// running on (protocol.Router.Stopping), and remembers that this life of it
// stops (announced: by its record): its loss, the stop's end, is retried
// elsewhere. The caller holds mu.
func (rt *Router) stoppingLocked(node protocol.NodeID, until time.Time, announced bool) {
	m := rt.members[node]
	if err := rt.r.Stopping(node, until); err != nil {
		return
	}
	was, known := rt.stopping[node]
	rt.stopping[node] = was || announced
	if !known {
		rt.cfg.Metrics.nodeEvents.WithLabelValues(string(m.Role), "stopping").Inc()
		rt.cfg.Log.Info("router: node stopping; no new request to it", "node", m.Name, "role", m.Role, "until", until)
	}
}

// stoppingWindow is how long a node that refused a leg as it stops, its
// stop unannounced, gets no new request: long enough that a stop of
// seconds costs a few retries, short enough that a node restarted under
// the same name is back in rotation soon even if no registry tells the
// router of its new life. announcedStop is for a stop the node's record announced:
// the rest of its life, which its loss or a new incarnation ends.
const (
	stoppingWindow = time.Second
	announcedStop  = 24 * time.Hour
)

// suspectLocked takes a node whose control API stopped answering out of
// rotation at once, rather than when the registry loses it (a lease runs
// for seconds): it is lost to the router (its requests fail on every leg,
// decode nodes cut their queue pairs to it), and probed until it answers
// again, when it is back with nothing on it; or until the registry loses
// it for good. The caller holds mu.
func (rt *Router) suspectLocked(node protocol.NodeID, why error) {
	m := rt.members[node]
	rt.cfg.Metrics.nodeEvents.WithLabelValues(string(m.Role), "lost").Inc()
	rt.lost[node], rt.suspect[node] = true, true
	rt.cfg.Trace.Emit(trace.Event{Kind: trace.NodeLost, Peer: m.Name, Role: string(m.Role), Cause: "unreachable"})
	if err := rt.r.NodeLost(node); err != nil {
		rt.cfg.Log.Error("router: losing an unreachable node", "node", m.Name, "err", err)
	}
	rt.cfg.Log.Warn("router: node unreachable; out of rotation until it answers", "node", m.Name, "err", why)
	go func() {
		for {
			time.Sleep(200 * time.Millisecond)
			rt.mu.Lock()
			still := rt.suspect[node]
			rt.mu.Unlock()
			if !still {
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			var back Member
			err := rt.client.call(ctx, m.Name, m.Control, pathInfo, nil, &back)
			cancel()
			if err != nil || back.Name != m.Name {
				continue
			}
			back.Control = m.Control
			rt.mu.Lock()
			if rt.suspect[node] {
				delete(rt.suspect, node)
				rt.mu.Unlock()
				rt.change(Change{Kind: Joined, Member: back})
				rt.cfg.Log.Info("router: node answers again; back in rotation", "node", m.Name)
				return
			}
			rt.mu.Unlock()
		}
	}()
}

func (rt *Router) cancelLegLocked(c protocol.CancelLeg) {
	m := rt.members[c.Node]
	rt.cfg.Trace.Emit(trace.Event{Kind: trace.CancelLeg, Req: uint64(c.Request), Peer: m.Name})
	var stopCall context.CancelFunc
	if q := rt.pending[c.Request]; q != nil {
		stopCall = q.legs[c.Node]
		q.cancelled[c.Node] = true
	}
	if rt.lost[c.Node] {
		if stopCall != nil {
			stopCall()
		}
		return
	}
	go func() {
		rt.callCancel(m, c.Request)
		if stopCall != nil {
			stopCall()
		}
	}()
}
