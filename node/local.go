package node

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/internal/trace"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma/inproc"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// LocalConfig describes a deployment in one process: a router and
// prefill and decode nodes over the in-process provider, a static
// registry, and mutual TLS from a fresh in-memory CA, each node's control
// API on its own loopback port.
type LocalConfig struct {
	Prefills, Decodes int // nodes of each role; 0 means 1
	// PrefillPages and DecodePages size each node's pool; PageTokens the pages.
	PrefillPages, DecodePages, PageTokens int
	// PageBytes is the page size without a model (GeneratedKV and digests).
	PageBytes int
	Model     *llama.Model // nil: generated KV and digests
	ModelID   string
	Timeout   time.Duration // the router's request timeout and the nodes' leg timeout
	Log       *slog.Logger
	// Registry is where the nodes register and the router watches; nil
	// means a fresh Static. NewRegistry, if set, gives each node its own
	// client of one (an etcd client per node, as across processes).
	Registry    Registry
	NewRegistry func(node string) (Registry, error)

	// prefillKV wraps prefill node i's KV source (tests: hold a transfer).
	prefillKV func(i int, src transfer.KVSource) transfer.KVSource
	// decodeBackend, if set, is decode node i's backend (tests: a backend
	// that checks what a device backend needs).
	decodeBackend func(i int) backend.Backend
	// beforeDecodeCall is the router's RouterConfig.beforeDecodeCall.
	beforeDecodeCall func(protocol.RequestID)
	// decodeGrace, if set, is how long a decode node's stop waits for
	// calls and for its pages (grace otherwise): tests of a leak, whose
	// pages never come back, need not wait twice grace.
	decodeGrace time.Duration
	// routerGrace, if set, is how long the router's stop waits for
	// requests in flight (grace otherwise).
	routerGrace time.Duration
	// unannouncedStops: the nodes' stops are not announced
	// (NodeConfig.unannounced).
	unannouncedStops bool
	// ContextTokens is every node's own limit (NodeConfig.ContextTokens),
	// PrefillContextTokens the prefill nodes' instead if not 0,
	// AdvertiseContext what the prefill nodes claim (NodeConfig.AdvertiseContext),
	// and Research the bugs every node runs with: kvhandoff demo's
	// deployments, the incident's among them.
	ContextTokens, PrefillContextTokens, AdvertiseContext int
	Research                                              research.Switches
	// PeerRequests and PeerPages are the decode nodes' per-peer quotas
	// (DecodeConfig); 0 means their defaults.
	PeerRequests, PeerPages int
	// PrefillChunkPages is the prefill nodes' (NodeConfig.PrefillChunkPages).
	PrefillChunkPages int
	// PrefixCache turns the decode nodes' prefix cache on (the router
	// scopes every request, with a fresh scope key); PublicPrefixes are the
	// router's declared public prefixes.
	PrefixCache    bool
	PublicPrefixes []PublicPrefix
	// TrustTenantHeader is the router's (RouterConfig): the deployment's
	// clients are a harness that sets X-Tenant itself, as a front proxy
	// would. Without it no tenant is authenticated and nothing is reused.
	TrustTenantHeader bool
	// APIKeys, if set, authenticate the router's clients (RouterConfig).
	APIKeys *APIKeys
	// HTTP bounds the router's API clients (RouterConfig.HTTP).
	HTTP HTTPLimits
	// Trace, if set, receives every node's protocol events, each node
	// (and each restarted prefill node) under a Writer of its own
	// (docs/trace.md).
	Trace *trace.Sink
}

// Local is a running in-process deployment.
type Local struct {
	Router   *Router
	Prefills []*Prefill
	Decodes  []*Decode
	Registry *Static // the static registry, unless LocalConfig named another
	// API is the router's client API address (host:port).
	API string

	cancel context.CancelFunc
	wg     sync.WaitGroup

	// what CrashPrefill and RestartPrefill need
	cfg       LocalConfig
	ctx       context.Context
	fabric    *inproc.Fabric
	security  func(name string) (Security, error)
	registry  func(name string) (Registry, error)
	ca        *pki.CA            // the deployment's authority (tests: a peer of their own)
	ticketKey ed25519.PrivateKey // the router's (tests: tickets of their own)
	mu        sync.Mutex
	stopped   []chan struct{} // per prefill node: closed when its Serve returned
	// per prefill node: what ends its Serve (a graceful stop)
	prefillStops []context.CancelFunc
	// per decode node: what ends its Serve, and closed when it returned
	decodeStops   []context.CancelFunc
	decodeStopped []chan struct{}
}

// StartLocal starts a deployment in one process; Stop ends it.
func StartLocal(cfg LocalConfig) (*Local, error) {
	if cfg.Prefills == 0 {
		cfg.Prefills = 1
	}
	if cfg.Decodes == 0 {
		cfg.Decodes = 1
	}
	if cfg.PageTokens == 0 {
		cfg.PageTokens = 16
	}
	if cfg.PrefillPages == 0 {
		cfg.PrefillPages = 256
	}
	if cfg.DecodePages == 0 {
		cfg.DecodePages = 256
	}
	if cfg.PageBytes == 0 {
		cfg.PageBytes = 4096
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	ca, err := pki.NewCA("kvhandoff-local")
	if err != nil {
		return nil, err
	}
	_, ticketKey, err := pki.NewTicketKey()
	if err != nil {
		return nil, err
	}
	static, err := NewStatic()
	if err != nil {
		return nil, err
	}
	registry := func(string) (Registry, error) {
		if cfg.Registry != nil {
			return cfg.Registry, nil
		}
		return static, nil
	}
	if cfg.NewRegistry != nil {
		registry = cfg.NewRegistry
	}
	fabric := inproc.NewFabric(fmt.Sprintf("local-%d", time.Now().UnixNano()))
	ctx, cancel := context.WithCancel(context.Background())
	l := &Local{Registry: static, cancel: cancel, cfg: cfg, ctx: ctx, fabric: fabric, registry: registry,
		ca: ca, ticketKey: ticketKey}
	fail := func(err error) (*Local, error) {
		l.Stop()
		return nil, err
	}
	listen := func() (net.Listener, error) { return net.Listen("tcp", "127.0.0.1:0") }
	security := func(name string) (Security, error) {
		tc, err := ca.Config(name)
		return Security{TLS: tc}, err
	}
	l.security = security
	for i := range cfg.Decodes {
		l.Decodes = append(l.Decodes, nil)
		l.decodeStops = append(l.decodeStops, nil)
		l.decodeStopped = append(l.decodeStopped, nil)
		if err := l.startDecode(i); err != nil {
			return fail(err)
		}
	}
	for i := range cfg.Prefills {
		l.Prefills = append(l.Prefills, nil)
		l.stopped = append(l.stopped, nil)
		l.prefillStops = append(l.prefillStops, nil)
		if err := l.startPrefill(i); err != nil {
			return fail(err)
		}
	}
	sec, err := security("router")
	if err != nil {
		return fail(err)
	}
	reg, err := registry("router")
	if err != nil {
		return fail(err)
	}
	// The router scopes every request (as kvhandoff serve's does); only
	// decode nodes with the cache on reuse anything.
	scopeKey := make([]byte, 32)
	rand.Read(scopeKey)
	if l.Router, err = NewRouter(RouterConfig{Name: "router", Registry: reg, Security: sec, ModelID: cfg.ModelID, Timeout: cfg.Timeout, Log: cfg.Log, TicketKey: ticketKey,
		ScopeKey: scopeKey, PublicPrefixes: cfg.PublicPrefixes, TrustTenantHeader: cfg.TrustTenantHeader, APIKeys: cfg.APIKeys, HTTP: cfg.HTTP, Research: cfg.Research, beforeDecodeCall: cfg.beforeDecodeCall,
		Trace: cfg.Trace.NewWriter("router", string(RoleRouter))}); err != nil {
		return fail(err)
	}
	api, err := listen()
	if err != nil {
		return fail(err)
	}
	l.API = api.Addr().String()
	runCtx, stopRun := context.WithCancel(context.Background())
	l.wg.Go(func() {
		<-ctx.Done()
		stopRun()
	})
	l.wg.Go(func() { l.Router.Run(runCtx, graceOr(cfg.routerGrace)) })
	l.wg.Go(func() { l.Router.ServeAPI(ctx, api) })
	if err := l.WaitReady(10 * time.Second); err != nil {
		return fail(err)
	}
	return l, nil
}

// grace is how long a local node's stop waits for calls in flight.
const grace = 5 * time.Second

// graceOr is d, a test's grace for one node's stop, where set; grace
// otherwise.
func graceOr(d time.Duration) time.Duration {
	if d > 0 {
		return d
	}
	return grace
}

// startDecode makes decode node i and serves it until the deployment
// stops or StopDecode stops it.
func (l *Local) startDecode(i int) error {
	cfg := l.cfg
	name := fmt.Sprintf("decode-%d", i)
	sec, err := l.security(name)
	if err != nil {
		return err
	}
	reg, err := l.registry(name)
	if err != nil {
		return err
	}
	var be backend.Backend // nil: NodeConfig's default
	if cfg.decodeBackend != nil {
		be = cfg.decodeBackend(i)
	}
	d, err := NewDecode(DecodeConfig{NodeConfig: NodeConfig{Name: name, Device: l.fabric.Device(name), Pages: cfg.DecodePages,
		PageTokens: cfg.PageTokens, PageBytes: cfg.PageBytes, Model: cfg.Model, ModelID: cfg.ModelID, Security: sec,
		Registry: reg, Log: cfg.Log, Timeout: cfg.Timeout, ContextTokens: cfg.ContextTokens, Research: cfg.Research, Backend: be,
		Trace: cfg.Trace.NewWriter(name, string(RoleDecode)), unannounced: cfg.unannouncedStops}, Stop: -1,
		TicketKey: l.ticketKey.Public().(ed25519.PublicKey), PeerRequests: cfg.PeerRequests, PeerPages: cfg.PeerPages, PrefixCache: cfg.PrefixCache})
	if err != nil {
		return err
	}
	ctl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	tl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		ctl.Close()
		return err
	}
	g := graceOr(cfg.decodeGrace)
	ctx, stop := context.WithCancel(l.ctx)
	done := make(chan struct{})
	l.mu.Lock()
	l.Decodes[i], l.decodeStops[i], l.decodeStopped[i] = d, stop, done
	l.mu.Unlock()
	l.serve(name, done, stop, func() error { return d.Serve(ctx, ctl, tl, g) })
	return nil
}

// serve runs a node's Serve until it returns, then ends its context (stop)
// and closes done, the mark its stop (or crash) ended.
func (l *Local) serve(name string, done chan struct{}, stop context.CancelFunc, serve func() error) {
	l.wg.Go(func() {
		defer close(done)
		defer stop()
		// A node that ends by itself is a crash the caller may not see
		// (a restarted node's end is not the deployment's): say so. (A
		// CrashPrefill ends its node so too.)
		if err := serve(); err != nil && !errors.Is(err, context.Canceled) {
			l.cfg.Log.Warn("node: a local node ended", "node", name, "err", err)
		}
	})
}

// StopDecode stops decode node i gracefully, as SIGTERM stops kvhandoff
// serve (its calls in flight finish, it takes no new one, its pages come
// back, its registration goes last), and waits for its stop to end. For
// tests of a rolling restart; RestartDecode brings it back.
func (l *Local) StopDecode(i int) error {
	if i < 0 || i >= len(l.Decodes) {
		return fmt.Errorf("node: no decode node %d", i)
	}
	l.mu.Lock()
	stop, done := l.decodeStops[i], l.decodeStopped[i]
	l.mu.Unlock()
	return stopAndWait(fmt.Sprintf("decode-%d", i), stop, done)
}

// stopAndWait ends a node's Serve by stop and waits until done, the stop's
// end, for at most four graces (two of them a decode node's page waits).
func stopAndWait(name string, stop context.CancelFunc, done <-chan struct{}) error {
	stop()
	select {
	case <-done:
		return nil
	case <-time.After(4 * grace):
		return fmt.Errorf("node: %s did not stop", name)
	}
}

// RestartDecode starts a fresh decode node i under the same name, once the
// one before has stopped: a new incarnation, new queue pairs, registered
// again.
func (l *Local) RestartDecode(i int) error {
	if i < 0 || i >= len(l.Decodes) {
		return fmt.Errorf("node: no decode node %d", i)
	}
	l.mu.Lock()
	done := l.decodeStopped[i]
	l.mu.Unlock()
	select {
	case <-done:
	default:
		return fmt.Errorf("node: decode-%d still runs", i)
	}
	if l.ctx.Err() != nil {
		return l.ctx.Err()
	}
	return l.startDecode(i)
}

// Decode is decode node i as it runs now (a restart replaces it).
func (l *Local) Decode(i int) *Decode {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.Decodes[i]
}

// startPrefill makes prefill node i and serves it until the deployment stops
// or the node crashes.
func (l *Local) startPrefill(i int) error {
	name := fmt.Sprintf("prefill-%d", i)
	sec, err := l.security(name)
	if err != nil {
		return err
	}
	cfg := l.cfg
	if cfg.PrefillContextTokens > 0 {
		cfg.ContextTokens = cfg.PrefillContextTokens
	}
	reg, err := l.registry(name)
	if err != nil {
		return err
	}
	nc := NodeConfig{Name: name, Device: l.fabric.Device(name), Pages: cfg.PrefillPages, PageTokens: cfg.PageTokens,
		PageBytes: cfg.PageBytes, Model: cfg.Model, ModelID: cfg.ModelID, Security: sec, Registry: reg, Log: cfg.Log, Timeout: cfg.Timeout,
		ContextTokens: cfg.ContextTokens, AdvertiseContext: cfg.AdvertiseContext, Research: cfg.Research, PrefillChunkPages: cfg.PrefillChunkPages,
		Trace: cfg.Trace.NewWriter(name, string(RolePrefill))}
	nc.unannounced = cfg.unannouncedStops
	if cfg.prefillKV != nil {
		nc.wrapKV = func(src transfer.KVSource) transfer.KVSource { return cfg.prefillKV(i, src) }
	}
	p, err := NewPrefill(nc)
	if err != nil {
		return err
	}
	ctl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	done := make(chan struct{})
	ctx, stop := context.WithCancel(l.ctx)
	l.mu.Lock()
	l.Prefills[i], l.stopped[i], l.prefillStops[i] = p, done, stop
	l.mu.Unlock()
	l.serve(name, done, stop, func() error { return p.Serve(ctx, ctl, grace) })
	return nil
}

// CrashPrefill makes prefill node i vanish as a crashed node does: its
// registration is gone (a lease that expired), so the router fails its
// requests on every leg and each decode node cuts its queue pair, the
// fence for what it may still write; the node itself winds down. For tests
// and kvhandoff demo; RestartPrefill brings it back.
func (l *Local) CrashPrefill(i int) error {
	if i < 0 || i >= len(l.Prefills) {
		return fmt.Errorf("node: no prefill node %d", i)
	}
	if l.cfg.Registry != nil || l.cfg.NewRegistry != nil {
		return errors.New("node: CrashPrefill needs the static registry")
	}
	l.Registry.Remove(fmt.Sprintf("prefill-%d", i))
	return nil
}

// StopPrefill stops prefill node i gracefully, as SIGTERM stops kvhandoff
// serve, and waits for its stop to end. For tests of a rolling restart;
// RestartPrefill brings it back.
func (l *Local) StopPrefill(i int) error {
	if i < 0 || i >= len(l.Prefills) {
		return fmt.Errorf("node: no prefill node %d", i)
	}
	l.mu.Lock()
	stop, done := l.prefillStops[i], l.stopped[i]
	l.mu.Unlock()
	return stopAndWait(fmt.Sprintf("prefill-%d", i), stop, done)
}

// RestartPrefill waits for crashed or stopped prefill node i to have stopped, then
// starts a fresh one under the same name: new queue pairs, a new control
// address, registered again.
func (l *Local) RestartPrefill(i int) error {
	if i < 0 || i >= len(l.Prefills) {
		return fmt.Errorf("node: no prefill node %d", i)
	}
	l.mu.Lock()
	done := l.stopped[i]
	l.mu.Unlock()
	select {
	case <-done:
	case <-time.After(2 * grace):
		return fmt.Errorf("node: prefill-%d did not stop", i)
	}
	if l.ctx.Err() != nil {
		return l.ctx.Err()
	}
	return l.startPrefill(i)
}

// Prefill is prefill node i as it runs now (a restart replaces it).
func (l *Local) Prefill(i int) *Prefill {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.Prefills[i]
}

// WaitReady waits until the router knows every node and every prefill
// node has a queue pair to every decode node.
func (l *Local) WaitReady(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	select {
	case <-l.Router.Ready():
	case <-time.After(timeout):
		return errors.New("node: the router found no prefill and decode node in time")
	}
	for {
		ok := len(l.Router.nodes()) == len(l.Prefills)+len(l.Decodes)
		for _, p := range l.Prefills {
			ok = ok && len(p.Endpoint().Peers()) == len(l.Decodes)
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("node: the deployment's queue pairs did not come up in time")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Stop ends every node (gracefully: see the Serve methods) and waits.
func (l *Local) Stop() {
	if l.cancel != nil {
		l.cancel()
	}
	l.wg.Wait()
}

// nodes is the router's live nodes.
func (rt *Router) nodes() []string {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	var out []string
	for _, n := range rt.r.Nodes() {
		out = append(out, rt.members[n.Info.ID].Name)
	}
	return out
}
