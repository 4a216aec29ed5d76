package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/model"
	"github.com/kvhandoff/kvhandoff/internal/pki"
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
	Model     *model.Model // nil: generated KV and digests
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
	errs   chan error
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
	l := &Local{Registry: static, cancel: cancel, errs: make(chan error, 1+cfg.Prefills+cfg.Decodes)}
	fail := func(err error) (*Local, error) {
		l.Stop()
		return nil, err
	}
	listen := func() (net.Listener, error) { return net.Listen("tcp", "127.0.0.1:0") }
	security := func(name string) (Security, error) {
		tc, err := ca.Config(name)
		return Security{TLS: tc}, err
	}
	const grace = 5 * time.Second
	for i := range cfg.Decodes {
		name := fmt.Sprintf("decode-%d", i)
		sec, err := security(name)
		if err != nil {
			return fail(err)
		}
		reg, err := registry(name)
		if err != nil {
			return fail(err)
		}
		d, err := NewDecode(DecodeConfig{NodeConfig: NodeConfig{Name: name, Device: fabric.Device(name), Pages: cfg.DecodePages,
			PageTokens: cfg.PageTokens, PageBytes: cfg.PageBytes, Model: cfg.Model, ModelID: cfg.ModelID, Security: sec,
			Registry: reg, Log: cfg.Log, Timeout: cfg.Timeout}, Stop: -1})
		if err != nil {
			return fail(err)
		}
		ctl, err := listen()
		if err != nil {
			return fail(err)
		}
		tl, err := listen()
		if err != nil {
			ctl.Close()
			return fail(err)
		}
		l.Decodes = append(l.Decodes, d)
		l.wg.Go(func() { l.errs <- d.Serve(ctx, ctl, tl, grace) })
	}
	for i := range cfg.Prefills {
		name := fmt.Sprintf("prefill-%d", i)
		sec, err := security(name)
		if err != nil {
			return fail(err)
		}
		reg, err := registry(name)
		if err != nil {
			return fail(err)
		}
		nc := NodeConfig{Name: name, Device: fabric.Device(name), Pages: cfg.PrefillPages, PageTokens: cfg.PageTokens,
			PageBytes: cfg.PageBytes, Model: cfg.Model, ModelID: cfg.ModelID, Security: sec, Registry: reg, Log: cfg.Log, Timeout: cfg.Timeout}
		if cfg.prefillKV != nil {
			nc.wrapKV = func(src transfer.KVSource) transfer.KVSource { return cfg.prefillKV(i, src) }
		}
		p, err := NewPrefill(nc)
		if err != nil {
			return fail(err)
		}
		ctl, err := listen()
		if err != nil {
			return fail(err)
		}
		l.Prefills = append(l.Prefills, p)
		l.wg.Go(func() { l.errs <- p.Serve(ctx, ctl, grace) })
	}
	sec, err := security("router")
	if err != nil {
		return fail(err)
	}
	reg, err := registry("router")
	if err != nil {
		return fail(err)
	}
	if l.Router, err = NewRouter(RouterConfig{Name: "router", Registry: reg, Security: sec, ModelID: cfg.ModelID, Timeout: cfg.Timeout, Log: cfg.Log}); err != nil {
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
	l.wg.Go(func() { l.Router.Run(runCtx, grace) })
	l.wg.Go(func() { l.Router.ServeAPI(ctx, api) })
	if err := l.WaitReady(10 * time.Second); err != nil {
		return fail(err)
	}
	return l, nil
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
