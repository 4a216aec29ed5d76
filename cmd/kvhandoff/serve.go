package main

import (
	"context"
	"crypto/ed25519"
	"crypto/tls"
	"errors"
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
default to kvhandoff certs' files beside --tls-ca. SIGTERM or SIGINT
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
	role := fs.String("role", "", "router, prefill or decode (required)")
	name := fs.String("name", "", "the node's name, as its certificate and the registry know it (default: the certificate's name, or the role)")
	provider := fs.String("provider", "socket", "RDMA provider: socket, or verbs in a -tags verbs build")
	listen := fs.String("listen", "127.0.0.1:8080", "router: the client API's address (HTTP)")
	control := fs.String("control", "127.0.0.1:0", "prefill, decode: the control API's address (HTTPS, mutual TLS)")
	transferAddr := fs.String("transfer", "127.0.0.1:0", "decode: the queue-pair setup listener's address")
	rdmaAddr := fs.String("rdma", "127.0.0.1:0", "prefill, decode: the socket provider's address; with --provider verbs, the device name (default: the first)")
	metricsAddr := fs.String("metrics", "", "prefill, decode: a plaintext /metrics listener's address (the router serves /metrics on --listen)")
	pages := fs.Int("pool-pages", 1024, "prefill, decode: KV pool pages")
	pageTokens := fs.Int("page-tokens", 16, "tokens per page")
	pageBytes := fs.Int("page-bytes", 0, "bytes per page (--model none only; with a model the model's geometry sets it); 0 means 4096")
	contextTokens := fs.Int("context-tokens", 0, "the longest prompt this node takes; 0 means the model's context")
	modelName := fs.String("model", "builtin", "builtin (the built-in copy model, --seed), none (generated KV, a digest as the answer), or a llama2.c checkpoint file")
	seed := fs.Uint64("seed", 1, "the built-in model's seed")
	modelID := fs.String("model-id", "", "the model's name in the registry and the client API (default: kvhandoff-builtin-SEED, or the file's name)")
	peers := fs.String("peers", "", "static registry: name=host:port of each peer's control API, comma-separated")
	etcd := fs.String("etcd", "", "etcd registry: host:port,... of the etcd cluster")
	etcdPrefix := fs.String("etcd-prefix", "/kvhandoff/nodes/", "etcd registry: the key prefix")
	etcdCA := fs.String("etcd-cacert", "", "etcd registry: the authority of the cluster's certificates (PEM): TLS to etcd, as etcdctl's --cacert")
	etcdCert := fs.String("etcd-cert", "", "etcd registry: the client certificate (PEM) a cluster with client-cert-auth requires, as etcdctl's --cert")
	etcdKey := fs.String("etcd-key", "", "etcd registry: the client certificate's key (PEM), as etcdctl's --key")
	lease := fs.Duration("lease", 5*time.Second, "etcd registry: the registration lease's time to live (a node that stops keeping it alive is lost after it)")
	tlsCert := fs.String("tls-cert", "", "the node's certificate (PEM)")
	tlsKey := fs.String("tls-key", "", "the node's key (PEM)")
	tlsCA := fs.String("tls-ca", "", "the deployment's authority (PEM)")
	insecure := fs.Bool("insecure", false, "plaintext between nodes, with no authentication (a warning is logged)")
	timeout := fs.Duration("timeout", 30*time.Second, "a request's timeout (router) or a leg's (nodes)")
	grace := fs.Duration("grace", 10*time.Second, "how long a stopping node waits for requests in flight")
	httpBodyTimeout := fs.Duration("http-body-timeout", 30*time.Second, "router: how long a client has to send a request's body once its headers are in (then 408, connection closed)")
	httpIdleTimeout := fs.Duration("http-idle-timeout", 60*time.Second, "router: how long a keep-alive connection may sit idle between requests")
	httpMaxBody := fs.Int64("http-max-body", 1<<20, "router: the largest request body, bytes (a longer one is a 400)")
	httpMaxConns := fs.Int("http-max-conns", 1024, "router: client connections open at once (more wait to be accepted)")
	chatTemplate := fs.String("chat-template", "", "router: /v1/chat/completions' layout: plain (role: text lines) or llama2 ([INST] ... [/INST]); default plain, llama2 for a checkpoint file")
	trustRequestID := fs.Bool("trust-request-id", false, "router: take a client's X-Request-Id (only where every client comes through a front proxy that sets it)")
	router := fs.String("router-name", "router", "prefill, decode: the name the router's certificate carries")
	ticketKey := fs.String("ticket-key", "", "router: the ticket signing key (default: ticket-key.pem beside --tls-ca)")
	ticketPub := fs.String("ticket-pub", "", "decode: the router's public ticket key (default: ticket.pem beside --tls-ca)")
	peerRequests := fs.Int("peer-requests", 0, "decode: the most open requests one prefill node may hold here; 0 means no bound but the pool's")
	peerPages := fs.Int("peer-pages", 0, "decode: the most pages one prefill node's requests may hold here; 0 means no bound but the pool's")
	logFormat := fs.String("log-format", "text", "text or json")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	if code := parseFlags(fs, args, stderr); code >= 0 {
		return code
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "kvhandoff serve: "+format+"\n", a...)
		return 2
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(*logLevel)); err != nil {
		return fail("--log-level %q: %v", *logLevel, err)
	}
	var log *slog.Logger
	switch *logFormat {
	case "text":
		log = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	case "json":
		log = slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level}))
	default:
		return fail("--log-format %q: text or json", *logFormat)
	}
	switch *role {
	case "router", "prefill", "decode":
	default:
		return fail("--role %q: router, prefill or decode", *role)
	}
	var sec node.Security
	switch {
	case *insecure && (*tlsCert != "" || *tlsKey != "" || *tlsCA != ""):
		return fail("--insecure and --tls-* exclude each other")
	case *insecure:
		sec.Insecure = true
		log.Warn("serve: --insecure: nodes talk in plaintext and accept anyone who reaches their ports")
	case *tlsCert == "" || *tlsKey == "" || *tlsCA == "":
		return fail("--tls-cert, --tls-key and --tls-ca are required (or --insecure)")
	default:
		tc, err := pki.Load(*tlsCert, *tlsKey, *tlsCA)
		if err != nil {
			return fail("%v", err)
		}
		sec.TLS = tc
		certName, err := pki.Name(tc)
		if err != nil {
			return fail("%v", err)
		}
		if *name == "" {
			*name = certName
		} else if *name != certName {
			return fail("--name %q, but the certificate names %q", *name, certName)
		}
		// Peers accept a node only in the role its certificate carries.
		certRole, err := pki.OwnRole(tc)
		if err != nil {
			return fail("%v (kvhandoff certs writes the role)", err)
		}
		if string(certRole) != *role {
			return fail("--role %s, but the certificate is a %s node's", *role, certRole)
		}
	}
	if *name == "" {
		*name = *role
	}
	// The router signs a ticket for each request it dispatches; a decode
	// node reserves pages only for a Bootstrap carrying a valid one.
	var signer ed25519.PrivateKey
	var verifier ed25519.PublicKey
	if sec.TLS != nil || *ticketKey != "" || *ticketPub != "" {
		var err error
		switch *role {
		case "router":
			if *ticketKey == "" {
				*ticketKey = filepath.Join(filepath.Dir(*tlsCA), pki.TicketKeyFile)
			}
			signer, err = pki.LoadTicketKey(*ticketKey)
		case "decode":
			if *ticketPub == "" {
				*ticketPub = filepath.Join(filepath.Dir(*tlsCA), pki.TicketPublicFile)
			}
			verifier, err = pki.LoadTicketPublic(*ticketPub)
		}
		if err != nil {
			return fail("the ticket key: %v", err)
		}
	}
	if *peers != "" && *etcd != "" {
		return fail("--peers and --etcd exclude each other")
	}
	if *peers == "" && *etcd == "" {
		// A decode node accepts queue pairs only from the prefill nodes the
		// registry lists: it needs one too.
		return fail("--peers or --etcd is required for a %s", *role)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	regCtx, stopReg := context.WithCancel(context.Background())
	defer stopReg()
	var reg node.Registry
	if *etcd != "" {
		ecfg := node.EtcdConfig{Endpoints: strings.Split(*etcd, ","), Prefix: *etcdPrefix, TTL: *lease, Log: log}
		if *etcdCA != "" || *etcdCert != "" || *etcdKey != "" {
			tc, err := node.EtcdTLS(*etcdCA, *etcdCert, *etcdKey)
			if err != nil {
				return fail("%v", err)
			}
			ecfg.TLS = tc
		}
		r, err := node.NewEtcdConfig(ecfg)
		if err != nil {
			return fail("--etcd: %v", err)
		}
		defer r.Close()
		reg = r
	} else {
		list, err := node.ParsePeers(*peers)
		if err != nil {
			return fail("--peers: %v", err)
		}
		reg = node.NewPeerList(regCtx, list, sec, log)
	}
	var m *llama.Model
	switch *modelName {
	case "none":
		if *modelID == "" {
			*modelID = "kvhandoff-generated"
		}
		if *pageBytes == 0 {
			*pageBytes = 4096
		}
	case "builtin":
		m = llama.Builtin(*seed)
		if *modelID == "" {
			*modelID = fmt.Sprintf("kvhandoff-builtin-%d", *seed)
		}
	default:
		var err error
		if m, err = llama.LoadCheckpoint(*modelName); err != nil {
			return fail("--model: %v", err)
		}
		if *modelID == "" {
			*modelID = *modelName
		}
	}
	err := func() error {
		if *role == "router" {
			cfg := node.RouterConfig{Name: *name, Registry: reg, Security: sec, ModelID: *modelID, Timeout: *timeout, Log: log,
				HTTP:           node.HTTPLimits{BodyTimeout: *httpBodyTimeout, IdleTimeout: *httpIdleTimeout, MaxBodyBytes: *httpMaxBody, MaxConns: *httpMaxConns},
				TrustRequestID: *trustRequestID, TicketKey: signer}
			switch {
			case *chatTemplate == "llama2", *chatTemplate == "" && m != nil && *modelName != "builtin":
				cfg.ChatTemplate = node.Llama2Chat
			case *chatTemplate == "plain", *chatTemplate == "":
				cfg.ChatTemplate = node.PlainChat
			default:
				return fmt.Errorf("--chat-template %q: plain or llama2", *chatTemplate)
			}
			return serveRouter(ctx, cfg, *listen, *grace)
		}
		open := providers[*provider]
		if open == nil {
			return fmt.Errorf("--provider %q: not in this build (socket; verbs needs -tags verbs)", *provider)
		}
		dev, err := open(*name, *rdmaAddr, sec.TLS, sec.Insecure, log)
		if err != nil {
			return fmt.Errorf("opening the %s device: %w", *provider, err)
		}
		defer dev.Close()
		cfg := node.NodeConfig{Name: *name, Device: dev, Pages: *pages, PageTokens: *pageTokens, PageBytes: *pageBytes,
			ContextTokens: *contextTokens, Model: m, ModelID: *modelID, Security: sec, Callers: []string{*router},
			Registry: reg, Metrics: node.NewMetrics(), Log: log, Timeout: *timeout, CheckJoin: true}
		ctl, err := net.Listen("tcp", *control)
		if err != nil {
			return err
		}
		if *metricsAddr != "" {
			ln, err := net.Listen("tcp", *metricsAddr)
			if err != nil {
				return err
			}
			log.Info("serve: metrics", "addr", ln.Addr().String())
			srv := &http.Server{Handler: cfg.Metrics.Handler(), ReadHeaderTimeout: 10 * time.Second}
			go srv.Serve(ln)
			defer srv.Close()
		}
		if *role == "prefill" {
			p, err := node.NewPrefill(cfg)
			if err != nil {
				return err
			}
			return p.Serve(ctx, ctl, *grace)
		}
		tl, err := net.Listen("tcp", *transferAddr)
		if err != nil {
			return err
		}
		d, err := node.NewDecode(node.DecodeConfig{NodeConfig: cfg, Stop: -1, TicketKey: verifier, PeerRequests: *peerRequests, PeerPages: *peerPages})
		if err != nil {
			return err
		}
		return d.Serve(ctx, ctl, tl, *grace)
	}()
	if errors.Is(err, node.ErrWouldBreak) {
		fmt.Fprintf(stderr, "kvhandoff serve: refusing to join: %v\n", err)
		return 1
	}
	if err != nil && !errors.Is(err, context.Canceled) {
		log.Error("serve: stopped", "err", err)
		return 1
	}
	log.Info("serve: stopped cleanly", "role", *role, "name", *name)
	return 0
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
