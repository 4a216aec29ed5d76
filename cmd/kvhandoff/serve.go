package main

import (
	"context"
	"crypto/ed25519"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/node"
	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/rdma/socket"
)

const serveUsage = `usage: kvhandoff serve --role router|prefill|decode [flags]

Runs one node of a deployment (docs/nodes.md). The router answers clients on
--listen (the OpenAI-compatible /v1/completions, /v1/chat/completions and
/v1/models; /metrics, /healthz, /readyz); prefill and decode nodes answer
the router on --control (mutual TLS) and serve /metrics on --metrics. Nodes
find each other through --peers (static: name=host:port of each peer's
control API) or --etcd (a registry under leases). A node is a peer only
under the name and in the role the registry lists for it, its certificate's
(kvhandoff certs writes the role): a decode node needs --peers (its prefill
nodes) or --etcd too.

At start-up a prefill or decode node reads what the registry holds, adds
itself and runs kvhandoff preflight's check: if it would add a problem (its
pool smaller than the context length, its page size or model differing from
a registered node's) it refuses to start, exit 1, naming each problem.

Every connection between nodes is mutual TLS 1.3 (--tls-cert, --tls-key,
--tls-ca; kvhandoff certs makes them), unless --insecure. The router signs a
ticket for each request it dispatches (--ticket-key), and a decode node
reserves pages only for a Bootstrap with a valid one (--ticket-pub); both
default to kvhandoff certs' files beside --tls-ca. With --prefix-cache a decode
node keeps verified prompt pages for later requests of the same scope, which
the router sets from the tenant (--public-prefix declares shared ones; a
request never names its own). SIGTERM or SIGINT
stops the node gracefully: no new request, those in flight drained for
--grace, then failed explicitly, and no page left owned.

`

// providers opens an RDMA device for a node by provider name; the verbs
// build adds its own.
var providers = map[string]func(name, listen string, tc *tls.Config, insecure bool, log *slog.Logger) (rdma.Device, error){
	"socket": func(_, listen string, tc *tls.Config, insecure bool, log *slog.Logger) (rdma.Device, error) {
		return socket.Listen("tcp", listen, socket.Config{TLS: tc, Insecure: insecure, Logger: log})
	},
}

// runServe is `kvhandoff serve`.
func runServe(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("serve", serveUsage, stderr)
	o := defineServeFlags(fs)
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "kvhandoff serve: "+format+"\n", a...)
		return 2
	}
	log, err := o.logger(stderr)
	if err != nil {
		return fail("%v", err)
	}
	switch o.role {
	case "router", "prefill", "decode":
	default:
		return fail("--role %q: router, prefill or decode", o.role)
	}
	if o.prefillChunk < 0 {
		return fail("--prefill-chunk-pages %d: 0 (whole prompts) or more", o.prefillChunk)
	}
	sec, err := o.security(log)
	if err != nil {
		return fail("%v", err)
	}
	if o.name == "" {
		o.name = o.role
	}
	keys, err := o.loadTicketKeys(sec)
	if err != nil {
		return fail("the ticket key: %v", err)
	}
	if o.peers != "" && o.etcd != "" {
		return fail("--peers and --etcd exclude each other")
	}
	if o.peers == "" && o.etcd == "" {
		// A decode node accepts queue pairs only from the prefill nodes the
		// registry lists: it needs one too.
		return fail("--peers or --etcd is required for a %s", o.role)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	regCtx, stopReg := context.WithCancel(context.Background())
	defer stopReg()
	reg, closeReg, err := o.registry(regCtx, sec, log)
	if err != nil {
		return fail("%v", err)
	}
	defer closeReg()
	m, err := o.model()
	if err != nil {
		return fail("%v", err)
	}
	if o.role == "router" {
		err = o.runRouter(ctx, reg, sec, m, keys, log)
	} else {
		err = o.runNode(ctx, reg, sec, m, keys, log)
	}
	if errors.Is(err, node.ErrWouldBreak) {
		fmt.Fprintf(stderr, "kvhandoff serve: refusing to join: %v\n", err)
		return 1
	}
	if err != nil && !errors.Is(err, context.Canceled) {
		log.Error("serve: stopped", "err", err)
		return 1
	}
	log.Info("serve: stopped cleanly", "role", o.role, "name", o.name)
	return 0
}

// serveFlags is what `kvhandoff serve`'s flags set.
type serveFlags struct {
	role, name, provider                        string
	listen, control, transferAddr, rdmaAddr     string
	metricsAddr                                 string
	pages, pageTokens, pageBytes, contextTokens int
	modelName                                   string
	seed                                        uint64
	modelID                                     string
	peers, etcd, etcdPrefix                     string
	etcdCA, etcdCert, etcdKey                   string
	lease                                       time.Duration
	tlsCert, tlsKey, tlsCA                      string
	insecure                                    bool
	timeout, grace                              time.Duration
	httpBodyTimeout, httpIdleTimeout            time.Duration
	httpMaxBody                                 int64
	httpMaxConns                                int
	chatTemplate                                string
	trustRequestID                              bool
	trustTenantHeader                           bool
	apiKeys                                     string
	router, ticketKey, ticketPub                string
	peerRequests, peerPages                     int
	logFormat, logLevel                         string
	prefixCache                                 bool
	prefillChunk                                int
	scopeKey                                    string
	publicPrefixes                              []node.PublicPrefix
}

// defineServeFlags defines serve's flags on fs, to be read once fs has
// parsed the arguments.
func defineServeFlags(fs *flag.FlagSet) *serveFlags {
	o := new(serveFlags)
	fs.StringVar(&o.role, "role", "", "router, prefill or decode (required)")
	fs.StringVar(&o.name, "name", "", "the node's name, as its certificate and the registry know it (default: the certificate's name, or the role)")
	fs.StringVar(&o.provider, "provider", "socket", "RDMA provider: socket, or verbs in a -tags verbs build")
	fs.StringVar(&o.listen, "listen", "127.0.0.1:8080", "router: the client API's address (HTTP)")
	fs.StringVar(&o.control, "control", "127.0.0.1:0", "prefill, decode: the control API's address (HTTPS, mutual TLS)")
	fs.StringVar(&o.transferAddr, "transfer", "127.0.0.1:0", "decode: the queue-pair setup listener's address")
	fs.StringVar(&o.rdmaAddr, "rdma", "127.0.0.1:0", "prefill, decode: the socket provider's address; with --provider verbs, the device name (default: the first)")
	fs.StringVar(&o.metricsAddr, "metrics", "", "prefill, decode: a plaintext /metrics listener's address (the router serves /metrics on --listen)")
	fs.IntVar(&o.pages, "pool-pages", 1024, "prefill, decode: KV pool pages")
	fs.IntVar(&o.pageTokens, "page-tokens", 16, "tokens per page")
	fs.IntVar(&o.pageBytes, "page-bytes", 0, "bytes per page (--model none only; with a model the model's geometry sets it); 0 means 4096")
	fs.IntVar(&o.contextTokens, "context-tokens", 0, "the longest prompt this node takes; 0 means the model's context")
	fs.IntVar(&o.prefillChunk, "prefill-chunk-pages", node.DefaultPrefillChunkPages, "prefill: compute each prompt in chunks of this many pages, sending each chunk's pages while the next is computed and stopping a cancelled request at the chunk's end; 0 computes each prompt whole first")
	fs.StringVar(&o.modelName, "model", "builtin", "builtin (the built-in copy model, --seed), none (generated KV, a digest as the answer), or a llama2.c checkpoint file")
	fs.Uint64Var(&o.seed, "seed", 1, "the built-in model's seed")
	fs.StringVar(&o.modelID, "model-id", "", "the model's name in the registry and the client API (default: kvhandoff-builtin-SEED, or the file's name)")
	fs.StringVar(&o.peers, "peers", "", "static registry: name=host:port of each peer's control API, comma-separated")
	fs.StringVar(&o.etcd, "etcd", "", "etcd registry: host:port,... of the etcd cluster")
	fs.StringVar(&o.etcdPrefix, "etcd-prefix", "/kvhandoff/nodes/", "etcd registry: the key prefix")
	fs.StringVar(&o.etcdCA, "etcd-cacert", "", "etcd registry: the authority of the cluster's certificates (PEM): TLS to etcd, as etcdctl's --cacert")
	fs.StringVar(&o.etcdCert, "etcd-cert", "", "etcd registry: the client certificate (PEM) a cluster with client-cert-auth requires, as etcdctl's --cert")
	fs.StringVar(&o.etcdKey, "etcd-key", "", "etcd registry: the client certificate's key (PEM), as etcdctl's --key")
	fs.DurationVar(&o.lease, "lease", 5*time.Second, "etcd registry: the registration lease's time to live (a node that stops keeping it alive is lost after it)")
	fs.StringVar(&o.tlsCert, "tls-cert", "", "the node's certificate (PEM)")
	fs.StringVar(&o.tlsKey, "tls-key", "", "the node's key (PEM)")
	fs.StringVar(&o.tlsCA, "tls-ca", "", "the deployment's authority (PEM)")
	fs.BoolVar(&o.insecure, "insecure", false, "plaintext between nodes, with no authentication (a warning is logged)")
	fs.DurationVar(&o.timeout, "timeout", 30*time.Second, "a request's timeout (router) or a leg's (nodes)")
	fs.DurationVar(&o.grace, "grace", 10*time.Second, "how long a stopping node waits for requests in flight")
	fs.DurationVar(&o.httpBodyTimeout, "http-body-timeout", 30*time.Second, "router: how long a client has to send a request's body once its headers are in (then 408, connection closed)")
	fs.DurationVar(&o.httpIdleTimeout, "http-idle-timeout", 60*time.Second, "router: how long a keep-alive connection may sit idle between requests")
	fs.Int64Var(&o.httpMaxBody, "http-max-body", 1<<20, "router: the largest request body, bytes (a longer one is a 400)")
	fs.IntVar(&o.httpMaxConns, "http-max-conns", 1024, "router: client connections open at once (more wait to be accepted)")
	fs.StringVar(&o.chatTemplate, "chat-template", "", "router: /v1/chat/completions' layout: plain (role: text lines) or llama2 ([INST] ... [/INST]); default plain, llama2 for a checkpoint file")
	fs.BoolVar(&o.trustTenantHeader, "trust-tenant-header", false, "router: take X-Tenant as the authenticated tenant (only where every client comes through a front proxy that authenticates it and sets the header); without it or --api-keys no tenant is authenticated and the prefix cache reuses nothing")
	fs.StringVar(&o.apiKeys, "api-keys", "", "router: a file of \"KEY TENANT\" lines: every request must carry one of the keys as its bearer key (401 otherwise) and its tenant is the key's")
	fs.BoolVar(&o.trustRequestID, "trust-request-id", false, "router: take a client's X-Request-Id (only where every client comes through a front proxy that sets it)")
	fs.StringVar(&o.router, "router-name", "router", "prefill, decode: the name the router's certificate carries")
	fs.StringVar(&o.ticketKey, "ticket-key", "", "router: the ticket signing key (default: ticket-key.pem beside --tls-ca)")
	fs.StringVar(&o.ticketPub, "ticket-pub", "", "decode: the router's public ticket key (default: ticket.pem beside --tls-ca)")
	fs.IntVar(&o.peerRequests, "peer-requests", 0, "decode: the most open requests one prefill node may hold here; 0 means no bound but the pool's")
	fs.IntVar(&o.peerPages, "peer-pages", 0, "decode: the most pages one prefill node's requests may hold here; 0 means no bound but the pool's")
	fs.BoolVar(&o.prefixCache, "prefix-cache", false, "decode: keep verified full prompt pages cached for later requests of the same scope (docs/nodes.md, Prefix reuse); needs the ticket key")
	fs.StringVar(&o.scopeKey, "scope-key", "", "router: a file of 32 or more secret bytes keying the prefix cache's scopes (default: derived from the ticket key, which every router of a deployment shares)")
	fs.Func("public-prefix", "router: NAME=TEXT, a prompt prefix every tenant may share in the prefix cache (a declared system prompt); repeatable", func(v string) error {
		name, text, ok := strings.Cut(v, "=")
		if !ok || name == "" || text == "" {
			return fmt.Errorf("%q: NAME=TEXT", v)
		}
		o.publicPrefixes = append(o.publicPrefixes, node.PublicPrefix{Name: name, Text: text})
		return nil
	})
	fs.StringVar(&o.logFormat, "log-format", "text", "text or json")
	fs.StringVar(&o.logLevel, "log-level", "info", "debug, info, warn or error")
	return o
}

// logger is the node's logger, as --log-format and --log-level ask.
func (o *serveFlags) logger(stderr io.Writer) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(o.logLevel)); err != nil {
		return nil, fmt.Errorf("--log-level %q: %v", o.logLevel, err)
	}
	switch o.logFormat {
	case "text":
		return slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level})), nil
	case "json":
		return slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level})), nil
	default:
		return nil, fmt.Errorf("--log-format %q: text or json", o.logFormat)
	}
}

// security loads the node's certificates (or takes --insecure) and checks
// that --name and --role are those the certificate carries; a certificate
// names the node when --name does not.
func (o *serveFlags) security(log *slog.Logger) (node.Security, error) {
	var sec node.Security
	switch {
	case o.insecure && (o.tlsCert != "" || o.tlsKey != "" || o.tlsCA != ""):
		return sec, errors.New("--insecure and --tls-* exclude each other")
	case o.insecure:
		sec.Insecure = true
		log.Warn("serve: --insecure: nodes talk in plaintext and accept anyone who reaches their ports")
	case o.tlsCert == "" || o.tlsKey == "" || o.tlsCA == "":
		return sec, errors.New("--tls-cert, --tls-key and --tls-ca are required (or --insecure)")
	default:
		tc, err := pki.Load(o.tlsCert, o.tlsKey, o.tlsCA)
		if err != nil {
			return sec, err
		}
		sec.TLS = tc
		certName, err := pki.Name(tc)
		if err != nil {
			return sec, err
		}
		if o.name == "" {
			o.name = certName
		} else if o.name != certName {
			return sec, fmt.Errorf("--name %q, but the certificate names %q", o.name, certName)
		}
		// Peers accept a node only in the role its certificate carries.
		certRole, err := pki.OwnRole(tc)
		if err != nil {
			return sec, fmt.Errorf("%v (kvhandoff certs writes the role)", err)
		}
		if string(certRole) != o.role {
			return sec, fmt.Errorf("--role %s, but the certificate is a %s node's", o.role, certRole)
		}
	}
	return sec, nil
}

// ticketKeys are the router's key that signs a ticket for each request it
// dispatches and a decode node's key that checks them: a decode node
// reserves pages only for a Bootstrap carrying a valid one.
type ticketKeys struct {
	signer   ed25519.PrivateKey
	verifier ed25519.PublicKey
}

// loadTicketKeys loads the key the node's role uses, by default from beside
// --tls-ca.
func (o *serveFlags) loadTicketKeys(sec node.Security) (ticketKeys, error) {
	var keys ticketKeys
	if sec.TLS != nil || o.ticketKey != "" || o.ticketPub != "" {
		var err error
		switch o.role {
		case "router":
			if o.ticketKey == "" {
				o.ticketKey = filepath.Join(filepath.Dir(o.tlsCA), pki.TicketKeyFile)
			}
			keys.signer, err = pki.LoadTicketKey(o.ticketKey)
		case "decode":
			if o.ticketPub == "" {
				o.ticketPub = filepath.Join(filepath.Dir(o.tlsCA), pki.TicketPublicFile)
			}
			keys.verifier, err = pki.LoadTicketPublic(o.ticketPub)
		}
		if err != nil {
			return keys, err
		}
	}
	return keys, nil
}

// registry opens the registry --etcd or --peers names; closeReg closes it.
func (o *serveFlags) registry(ctx context.Context, sec node.Security, log *slog.Logger) (reg node.Registry, closeReg func(), err error) {
	if o.etcd != "" {
		ecfg := node.EtcdConfig{Endpoints: strings.Split(o.etcd, ","), Prefix: o.etcdPrefix, TTL: o.lease, Log: log}
		if o.etcdCA != "" || o.etcdCert != "" || o.etcdKey != "" {
			tc, err := node.EtcdTLS(o.etcdCA, o.etcdCert, o.etcdKey)
			if err != nil {
				return nil, nil, err
			}
			ecfg.TLS = tc
		}
		r, err := node.NewEtcdConfig(ecfg)
		if err != nil {
			return nil, nil, fmt.Errorf("--etcd: %v", err)
		}
		return r, func() { r.Close() }, nil
	}
	list, err := node.ParsePeers(o.peers)
	if err != nil {
		return nil, nil, fmt.Errorf("--peers: %v", err)
	}
	return node.NewPeerList(ctx, list, sec, log), func() {}, nil
}

// model loads the model --model names (nil for none) and fills in the
// defaults that depend on it.
func (o *serveFlags) model() (*llama.Model, error) {
	var m *llama.Model
	switch o.modelName {
	case "none":
		if o.modelID == "" {
			o.modelID = "kvhandoff-generated"
		}
		if o.pageBytes == 0 {
			o.pageBytes = 4096
		}
	case "builtin":
		m = llama.Builtin(o.seed)
		if o.modelID == "" {
			o.modelID = fmt.Sprintf("kvhandoff-builtin-%d", o.seed)
		}
	default:
		var err error
		if m, err = llama.LoadCheckpoint(o.modelName); err != nil {
			return nil, fmt.Errorf("--model: %v", err)
		}
		if o.modelID == "" {
			o.modelID = o.modelName
		}
	}
	return m, nil
}

// runRouter runs the router until ctx is done.
func (o *serveFlags) runRouter(ctx context.Context, reg node.Registry, sec node.Security, m *llama.Model, keys ticketKeys, log *slog.Logger) error {
	cfg := node.RouterConfig{Name: o.name, Registry: reg, Security: sec, ModelID: o.modelID, Timeout: o.timeout, Log: log,
		HTTP:           node.HTTPLimits{BodyTimeout: o.httpBodyTimeout, IdleTimeout: o.httpIdleTimeout, MaxBodyBytes: o.httpMaxBody, MaxConns: o.httpMaxConns},
		TrustRequestID: o.trustRequestID, TicketKey: keys.signer, PublicPrefixes: o.publicPrefixes, TrustTenantHeader: o.trustTenantHeader}
	if o.apiKeys != "" {
		f, err := os.Open(o.apiKeys)
		if err != nil {
			return fmt.Errorf("--api-keys: %v", err)
		}
		cfg.APIKeys, err = node.ParseAPIKeys(f)
		f.Close()
		if err != nil {
			return fmt.Errorf("--api-keys %s: %v", o.apiKeys, err)
		}
	}
	switch {
	case o.scopeKey != "":
		b, err := os.ReadFile(o.scopeKey)
		if err != nil {
			return fmt.Errorf("--scope-key: %v", err)
		}
		if len(b) < 32 {
			return fmt.Errorf("--scope-key %s: %d bytes, at least 32", o.scopeKey, len(b))
		}
		cfg.ScopeKey = b
	case keys.signer != nil:
		cfg.ScopeKey = node.ScopeKeyFromTicketKey(keys.signer)
	}
	switch {
	case o.chatTemplate == "llama2", o.chatTemplate == "" && m != nil && o.modelName != "builtin":
		cfg.ChatTemplate = node.Llama2Chat
	case o.chatTemplate == "plain", o.chatTemplate == "":
		cfg.ChatTemplate = node.PlainChat
	default:
		return fmt.Errorf("--chat-template %q: plain or llama2", o.chatTemplate)
	}
	return serveRouter(ctx, cfg, o.listen, o.grace)
}

// runNode runs a prefill or decode node until ctx is done: the set-up they
// share (the device, the control listener, the metrics listener), then the
// role's own.
func (o *serveFlags) runNode(ctx context.Context, reg node.Registry, sec node.Security, m *llama.Model, keys ticketKeys, log *slog.Logger) error {
	open := providers[o.provider]
	if open == nil {
		return fmt.Errorf("--provider %q: not in this build (socket; verbs needs -tags verbs)", o.provider)
	}
	dev, err := open(o.name, o.rdmaAddr, sec.TLS, sec.Insecure, log)
	if err != nil {
		return fmt.Errorf("opening the %s device: %w", o.provider, err)
	}
	defer dev.Close()
	cfg := node.NodeConfig{Name: o.name, Device: dev, Pages: o.pages, PageTokens: o.pageTokens, PageBytes: o.pageBytes,
		ContextTokens: o.contextTokens, Model: m, ModelID: o.modelID, Security: sec, Callers: []string{o.router},
		Registry: reg, Metrics: node.NewMetrics(), Log: log, Timeout: o.timeout, CheckJoin: true, PrefillChunkPages: o.prefillChunk}
	if o.prefillChunk == 0 {
		cfg.PrefillChunkPages = -1 // the flag's 0 is NodeConfig's "whole prompts"
	}
	ctl, err := net.Listen("tcp", o.control)
	if err != nil {
		return err
	}
	if o.metricsAddr != "" {
		ln, err := net.Listen("tcp", o.metricsAddr)
		if err != nil {
			return err
		}
		log.Info("serve: metrics", "addr", ln.Addr().String())
		srv := &http.Server{Handler: cfg.Metrics.Handler(), ReadHeaderTimeout: 10 * time.Second}
		go srv.Serve(ln)
		defer srv.Close()
	}
	if o.role == "prefill" {
		return o.runPrefill(ctx, cfg, ctl)
	}
	return o.runDecode(ctx, cfg, ctl, keys)
}

// runPrefill runs a prefill node on its control listener ctl.
func (o *serveFlags) runPrefill(ctx context.Context, cfg node.NodeConfig, ctl net.Listener) error {
	p, err := node.NewPrefill(cfg)
	if err != nil {
		return err
	}
	return p.Serve(ctx, ctl, o.grace)
}

// runDecode runs a decode node on its control listener ctl and its own
// queue-pair setup listener.
func (o *serveFlags) runDecode(ctx context.Context, cfg node.NodeConfig, ctl net.Listener, keys ticketKeys) error {
	tl, err := net.Listen("tcp", o.transferAddr)
	if err != nil {
		return err
	}
	d, err := node.NewDecode(node.DecodeConfig{NodeConfig: cfg, Stop: -1, TicketKey: keys.verifier, PeerRequests: o.peerRequests, PeerPages: o.peerPages,
		PrefixCache: o.prefixCache})
	if err != nil {
		return err
	}
	return d.Serve(ctx, ctl, tl, o.grace)
}

func serveRouter(ctx context.Context, cfg node.RouterConfig, listen string, grace time.Duration) error {
	log := cfg.Log
	rt, err := node.NewRouter(cfg)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	log.Info("serve: router client API", "addr", ln.Addr().String())
	apiCtx, stopAPI := context.WithCancel(context.Background())
	defer stopAPI()
	served := make(chan error, 1)
	go func() { served <- rt.ServeAPI(apiCtx, ln) }()
	// Run drains on ctx's end (intake stops, requests in flight finish or
	// fail explicitly); the API closes after it.
	err = rt.Run(ctx, grace)
	stopAPI()
	if e := <-served; err == nil {
		err = e
	}
	return err
}
