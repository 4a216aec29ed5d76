package node

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/internal/trace"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// NodeConfig is what a prefill or a decode node is made of.
type NodeConfig struct {
	Name   string      // the node's identity (its certificate's name)
	Device rdma.Device // the RDMA device its queue pairs are made on
	// Pages, PageTokens and PageBytes size the KV pool. With a Model,
	// PageBytes is the model's (engine.GeometryOf) and may be left 0.
	Pages, PageTokens, PageBytes int
	// ContextTokens is the longest prompt this node takes; 0 means the
	// model's context (or no limit of its own without a model).
	ContextTokens int
	// Model computes the KV (prefill) and generates over it (decode); nil
	// means transfer.GeneratedKV on prefill and a digest of the verified KV
	// as the "generation" on decode.
	Model   *llama.Model
	ModelID string // the model's name in the registry and the client API
	// Backend computes the model; nil means engine/cpu.
	Backend backend.Backend
	// Security authenticates the control API and the queue pairs' setup.
	Security Security
	// Callers are the names a control caller's certificate must carry one
	// of; nil means {"router"}.
	Callers  []string
	Registry Registry
	Metrics  *Metrics     // nil means a fresh set
	Log      *slog.Logger // nil means slog.Default()
	// Research turns bugs of the catalogue on in the node's endpoint, its
	// engine and its own checks (kvhandoff demo --bug); only code inside
	// this module can set it.
	Research research.Switches
	// AdvertiseContext, if larger than ContextTokens, is the context the
	// node claims in the registry: the incident's deployment (kvhandoff
	// demo --incident), whose router admits prompts the node cannot hold.
	AdvertiseContext int
	// CheckJoin makes Serve run CheckJoin against the registry before the
	// node serves or registers anything, and return its ErrWouldBreak
	// rather than join a deployment it would break (kvhandoff serve).
	CheckJoin bool
	// Timeout bounds a leg on this node: decode's wait for Done, and for the
	// router's call after verification; 0 means 30 s.
	Timeout time.Duration
	// PrefillChunkPages is a prefill node's chunk, in pages, with a Model:
	// it computes each prompt a chunk at a time, sends each chunk's pages
	// while it computes the next, and stops a cancelled request at the
	// chunk's end (transfer.PrefillConfig.ChunkPages). 0 means
	// DefaultPrefillChunkPages; a negative value computes each prompt whole
	// before anything moves.
	PrefillChunkPages int
	// Trace, if set, receives the node's protocol events (kvhandoff serve
	// --trace; docs/trace.md).
	Trace *trace.Writer

	wrapKV func(transfer.KVSource) transfer.KVSource // tests: hold or fail a KV computation
	// unannounced: the node's stop is not announced (tests: the refusals
	// routers meet where a registry is slower than the node's drain).
	unannounced bool
}

func (c *NodeConfig) defaults() {
	if c.Log == nil {
		c.Log = slog.Default()
	}
	if c.Metrics == nil {
		c.Metrics = NewMetrics()
	}
	if c.Callers == nil {
		c.Callers = []string{"router"}
	}
	if c.Timeout == 0 {
		c.Timeout = 30 * time.Second
	}
	if c.Model != nil {
		c.PageBytes = engine.GeometryOf(c.Model.Config, c.PageTokens).PageBytes()
		if c.ContextTokens == 0 || c.ContextTokens > c.Model.SeqLen {
			c.ContextTokens = c.Model.SeqLen
		}
	}
	if c.ModelID == "" {
		c.ModelID = "kvhandoff-builtin"
	}
}

func (c *NodeConfig) backend() backend.Backend {
	if c.Backend != nil {
		return c.Backend
	}
	return cpu.New()
}

// flight tracks a node's calls in flight, for a graceful stop.
type flight struct {
	mu       sync.Mutex
	n        int
	draining bool
	idle     chan struct{}
}

func (f *flight) enter() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.draining {
		return false
	}
	f.n++
	return true
}

func (f *flight) leave() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n--
	if f.n == 0 && f.idle != nil {
		close(f.idle)
		f.idle = nil
	}
}

// isDraining is whether drain has stopped new calls.
func (f *flight) isDraining() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.draining
}

// drain stops new calls and returns a channel closed once none is in flight.
func (f *flight) drain() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.draining = true
	ch := make(chan struct{})
	if f.n == 0 {
		close(ch)
	} else {
		f.idle = ch
	}
	return ch
}

// waitForStop blocks until the node should stop: ctx ends, its control API
// stops serving, or its registration is lost. The error says which, nil for ctx.
func waitForStop(ctx context.Context, served <-chan error, lease <-chan struct{}) error {
	select {
	case <-ctx.Done():
		return nil
	case err := <-served:
		if err == nil {
			err = errors.New("node: control API stopped")
		}
		return err
	case <-lease:
		return errors.New("node: the registration was lost")
	}
}

// announceStopping registers self again, marked Stopping, as a graceful
// stop begins, before it drains: routers that watch the registry send the
// node no new request, rather than learning of the stop from a refused leg
// each, and retry elsewhere what the stop's end fails (*self, under mu, is
// the record it registered and answers its info with). A static peer list
// keeps records local: its peers read the record, marked so, from the
// node's info (PeerList follows it). Best effort: a registry it cannot
// reach is logged, and the stop goes on.
func announceStopping(ctx context.Context, reg Registry, mu *sync.Mutex, self *Member, unannounced bool, log *slog.Logger) {
	if unannounced {
		return
	}
	mu.Lock()
	self.Stopping = true
	m := *self
	mu.Unlock()
	settle := announceSettle
	if _, ok := reg.(*PeerList); ok {
		// A static peer list keeps this process's record local: its peers
		// read it from the node's info (which now says it stops), every
		// peerRefresh.
		settle = peerSettle
	} else if _, err := reg.Register(ctx, m); err != nil {
		log.Warn("node: announcing the stop in the registry", "node", m.Name, "err", err)
		return
	}
	// The routers hear of it through their watches, a moment later: until
	// then they may still dispatch to the node, which serves what comes
	// (a node whose stop ended first would fail those requests' other legs
	// before the routers knew to retry them elsewhere).
	select {
	case <-time.After(settle):
	case <-ctx.Done():
	}
}

// announceSettle is how long a node waits after announcing its stop before
// it drains: a registry watch's delivery (etcd's is milliseconds). With a
// static peer list it is peerSettle: two of the peers' reads of its record,
// and their round trips.
const (
	announceSettle = 100 * time.Millisecond
	peerSettle     = 2*peerRefresh + 50*time.Millisecond
)

// drainOrCancel stops intake and gives the calls in flight grace to end;
// past it, every request held() still names is cancelled. It returns how
// many were.
func (f *flight) drainOrCancel(grace time.Duration, held func() []protocol.RequestID, cancel func(protocol.RequestID)) int {
	select {
	case <-f.drain():
		return 0
	case <-time.After(grace):
	}
	ids := held()
	for _, id := range ids {
		cancel(id)
	}
	return len(ids)
}

// listenerAddr is the address peers reach ln at.
func listenerAddr(ln net.Listener) string { return ln.Addr().String() }

// waitPagesBack waits until the endpoint's pool is all free (every page
// fenced and released) or ctx ends.
func waitPagesBack(ctx context.Context, gauges func() transfer.Gauges) bool {
	for {
		g := gauges()
		if g.PagesFree+g.PagesCached == g.Pages { // cached pages are no request's
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(5 * time.Millisecond):
		}
	}
}
