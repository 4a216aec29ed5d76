package node

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/pki"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// The control API: the router's calls to prefill and decode nodes, JSON
// over HTTPS with mutual TLS. A node answers only a caller whose certificate
// names one of its allowed callers (the router); the router checks that the
// node's certificate names the node the registry knows.
const (
	pathInfo     = "/control/v1/info"
	pathPrefill  = "/control/v1/prefill"
	pathDecode   = "/control/v1/decode"
	pathCancel   = "/control/v1/cancel"
	pathPeerLost = "/control/v1/peer-lost"
	// pathEnough tells a decode node the client has what it wants of a
	// request (a stop string came): generation ends, and the leg succeeds
	// with the tokens so far.
	pathEnough = "/control/v1/enough"
	// maxControlBody bounds what a node reads of a control call: a prompt of
	// protocol.MaxTokens tokens as JSON numbers, and nothing sized by the caller.
	maxControlBody = 32 << 20
)

// Security is how a process authenticates its control and client
// connections.
type Security struct {
	// TLS is the process's certificate and the authority it trusts
	// (pki.Config, pki.Load). Required unless Insecure.
	TLS *tls.Config
	// Insecure runs the control API in plaintext, with a warning: anyone who
	// reaches the port can then submit and cancel requests.
	Insecure bool
}

func (s Security) check(log *slog.Logger, what string) error {
	if s.TLS == nil && !s.Insecure {
		return fmt.Errorf("node: %s: no TLS configuration (and Insecure not asked for)", what)
	}
	if s.TLS == nil {
		log.Warn("node: plaintext control API (insecure): anyone who reaches it can submit and cancel requests", "what", what)
	}
	return nil
}

// prefillCall is the router's request to a prefill node: run request ID's
// prefill and hand it to Decode.
type prefillCall struct {
	ID     protocol.RequestID `json:"id"`
	Decode string             `json:"decode"`
	Prompt []int              `json:"prompt"`
	Tenant string             `json:"tenant,omitempty"`
	Model  string             `json:"model,omitempty"`
	// RequestID is the client's request id, for the logs.
	RequestID string `json:"request_id,omitempty"`
	// Ticket is the router's signed ticket for the request (ticket.go),
	// which the Bootstrap carries to the decode node.
	Ticket []byte `json:"ticket,omitempty"`
	// Scope and Chain are the request's prefix cache scope and its prompt's
	// chain, as the router set them (scope.go) and its ticket binds them:
	// the Bootstrap carries both.
	Scope protocol.Scope       `json:"scope,omitempty"`
	Chain []protocol.ChainHash `json:"chain,omitempty"`
}

// decodeCall is the router's request to a decode node: generate MaxTokens
// tokens after Prompt once request ID's KV has arrived and verified.
type decodeCall struct {
	ID        protocol.RequestID `json:"id"`
	RequestID string             `json:"request_id,omitempty"` // the client's, for the logs
	Prefill   string             `json:"prefill"`
	Prompt    []int              `json:"prompt"`
	MaxTokens int                `json:"max_tokens"`
	Tenant    string             `json:"tenant,omitempty"`
	Model     string             `json:"model,omitempty"`
	// Temperature, TopP and Seed are the sampling (llama.NewSampler);
	// temperature 0 is greedy.
	Temperature float32 `json:"temperature,omitempty"`
	TopP        float32 `json:"top_p,omitempty"`
	Seed        uint64  `json:"seed,omitempty"`
	// Logprobs, if set, asks for each generated token's log probability and
	// this many most likely tokens' (llama.Sampler.Logprobs).
	Logprobs *int `json:"logprobs,omitempty"`
	// Scope is the request's cache scope, and ScopeLabel the scope as
	// metrics name it: "public:NAME" or "tenant" (never a tenant's name).
	Scope      protocol.Scope `json:"scope,omitempty"`
	ScopeLabel string         `json:"scope_label,omitempty"`
	// PublicPages are the full pages of the declared public prefix a
	// "public:NAME" request starts with: the metrics count a hit's tokens
	// in them under that label, and those past them (the tenant's own,
	// salted with its scope) under "tenant".
	PublicPages int `json:"public_pages,omitempty"`
}

type cancelCall struct {
	ID protocol.RequestID `json:"id"`
}

type peerLostCall struct {
	Peer string `json:"peer"`
	// Incarnation is the life lost (0: whichever is live).
	Incarnation uint64 `json:"incarnation,omitempty"`
}

// legAnswer is a node's answer to a prefill or decode call: the leg's
// outcome. A decode node streams its answer as a sequence of them, one JSON
// line each (handleStream): the tokens generated since the last, with
// their log probabilities if asked for, and End on the last, with the
// leg's error if it failed after the first.
type legAnswer struct {
	Tokens   []int                `json:"tokens,omitempty"`
	Logprobs []llama.TokenLogprob `json:"logprobs,omitempty"`
	// PrefixTokens are the prompt tokens decode found in its prefix cache
	// (on the first frame).
	PrefixTokens int        `json:"prefix_tokens,omitempty"`
	Error        *wireError `json:"error,omitempty"`
	End          bool       `json:"end,omitempty"`
}

// controlServer is the HTTP side of a node's control API.
type controlServer struct {
	sec     Security
	callers []string // names a router's certificate must carry one of
	log     *slog.Logger
	mux     *http.ServeMux
	// admit is the registry's word on a prefill or decode peer (a roster's
	// admit): such a peer may read the node's record, nothing else. Set
	// before serve; nil refuses every peer but the router.
	admit func(name string, role pki.Role, incarnation uint64) error
}

func newControlServer(sec Security, callers []string, log *slog.Logger) *controlServer {
	return &controlServer{sec: sec, callers: callers, log: log, mux: http.NewServeMux()}
}

// handle registers a JSON call: body into in, handler's answer as JSON.
// Only an allowed caller may make it.
func handle[In any](s *controlServer, path string, h func(ctx context.Context, in *In) (any, error)) {
	handleFor(s, path, false, h)
}

// handleFor registers a JSON call; with anyPeer, any peer whose certificate
// the deployment's authority signed may make it (the node's own record,
// which prefill nodes read from decode nodes).
func handleFor[In any](s *controlServer, path string, anyPeer bool, h func(ctx context.Context, in *In) (any, error)) {
	s.mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
		if anyPeer {
			// The TLS handshake verified the certificate against the CA.
		} else if err := s.authorized(r); err != nil {
			http.Error(w, err.Error(), http.StatusForbidden)
			return
		}
		in := new(In)
		if r.Method == http.MethodPost {
			dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxControlBody))
			dec.DisallowUnknownFields()
			if err := dec.Decode(in); err != nil {
				http.Error(w, fmt.Sprintf("malformed call: %v", err), http.StatusBadRequest)
				return
			}
		}
		out, err := h(r.Context(), in)
		if err != nil {
			writeJSON(w, http.StatusBadRequest, legAnswer{Error: toWire(err)})
			return
		}
		writeJSON(w, http.StatusOK, out)
	})
}

// handleStream registers a call answered as a stream of frames, one JSON
// line each, flushed as it is sent (a decode node's tokens as it generates
// them). Only an allowed caller may make it. h sends frames through send,
// which fails once the caller has gone; an error h returns before its
// first frame is the answer handle gives (400, legAnswer), after it a last
// frame holding it; a stream that ends well ends with a frame of End.
func handleStream[In any](s *controlServer, path string, h func(ctx context.Context, in *In, send func(legAnswer) error) error) {
	s.mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
		if err := s.authorized(r); err != nil {
			http.Error(w, err.Error(), http.StatusForbidden)
			return
		}
		in := new(In)
		dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxControlBody))
		dec.DisallowUnknownFields()
		if err := dec.Decode(in); err != nil {
			http.Error(w, fmt.Sprintf("malformed call: %v", err), http.StatusBadRequest)
			return
		}
		rc := http.NewResponseController(w)
		started := false
		enc := json.NewEncoder(w)
		send := func(f legAnswer) error {
			if !started {
				w.Header().Set("Content-Type", frameType)
				w.WriteHeader(http.StatusOK)
				started = true
			}
			if err := enc.Encode(f); err != nil {
				return err
			}
			return rc.Flush()
		}
		err := h(r.Context(), in, send)
		switch {
		case err != nil && !started:
			writeJSON(w, http.StatusBadRequest, legAnswer{Error: toWire(err)})
		case err != nil:
			send(legAnswer{Error: toWire(err), End: true})
		default:
			send(legAnswer{End: true})
		}
	})
}

// frameType is a streamed answer's content type: JSON lines.
const frameType = "application/x-ndjson"

func (s *controlServer) authorized(r *http.Request) error {
	if s.sec.TLS == nil {
		return nil
	}
	if r.TLS == nil || len(r.TLS.PeerCertificates) == 0 {
		return errors.New("node: control API: no client certificate")
	}
	return s.router(r.TLS.PeerCertificates[0])
}

// router is nil if cert is an allowed caller's, in the router role.
func (s *controlServer) router(cert *x509.Certificate) error {
	for _, name := range s.callers {
		if pki.CheckPeer(cert, name, pki.RoleRouter) == nil {
			return nil
		}
	}
	return fmt.Errorf("node: control API: %w: the certificate of %q is not an allowed caller's (%v, in the router role)", pki.ErrUnknownPeer, cert.Subject.CommonName, s.callers)
}

// verifyPeer is the control API's check at the TLS handshake: the client's
// certificate carries a role, and is an allowed router's, or a prefill or
// decode node's that the registry lists in that role. Anyone else is
// refused before any call is read.
func (s *controlServer) verifyPeer(cs tls.ConnectionState) error {
	if len(cs.PeerCertificates) == 0 {
		return errors.New("node: control API: no client certificate")
	}
	cert := cs.PeerCertificates[0]
	role, err := pki.RoleOf(cert)
	switch {
	case err != nil:
		return fmt.Errorf("node: control API: %w", err)
	case role == pki.RoleRouter:
		return s.router(cert)
	case s.admit == nil || len(cert.DNSNames) == 0:
		return fmt.Errorf("node: control API: %w: %q as %s", pki.ErrUnknownPeer, cert.Subject.CommonName, role)
	}
	if err := s.admit(cert.DNSNames[0], role, 0); err != nil {
		return fmt.Errorf("node: control API: %w", err)
	}
	return nil
}

// serve runs the control API on ln until ctx ends.
func (s *controlServer) serve(ctx context.Context, ln net.Listener, extra map[string]http.Handler) error {
	mux := http.NewServeMux()
	mux.Handle("/control/", s.mux)
	for p, h := range extra {
		mux.Handle(p, h)
	}
	cfg := s.sec.TLS
	if cfg != nil {
		cfg = cfg.Clone()
		cfg.VerifyConnection = s.verifyPeer
	}
	return serveHTTP(ctx, ln, mux, cfg, s.log)
}

// serveHTTP serves h on ln (TLS 1.3 with client certificates when cfg is
// set) until ctx ends, then shuts down, giving calls in flight a moment
// (serveUntil).
func serveHTTP(ctx context.Context, ln net.Listener, h http.Handler, cfg *tls.Config, log *slog.Logger) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	if cfg != nil {
		c := cfg.Clone()
		c.MinVersion = tls.VersionTLS13
		c.ClientAuth = tls.RequireAndVerifyClientCert
		if c.ClientCAs == nil {
			c.ClientCAs = c.RootCAs
		}
		ln = tls.NewListener(ln, c)
	}
	return serveUntil(ctx, srv, ln)
}

// serveUntil serves srv on ln until ctx ends, then shuts it down: no new
// connection, and the answers being written finish (a second, then what
// is left is closed). It returns once they have: srv.Serve returns as the
// shutdown begins, and a node whose stop ended then exited with answers
// still on their way (a decode node's last tokens to the router, an
// "unexpected EOF" there in a rolling restart of serve processes).
func serveUntil(ctx context.Context, srv *http.Server, ln net.Listener) error {
	shut := make(chan struct{})
	go func() {
		defer close(shut)
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		srv.Shutdown(sctx)
		srv.Close()
	}()
	err := srv.Serve(ln)
	if errors.Is(err, http.ErrServerClosed) {
		<-shut
		return nil
	}
	return err
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(v)
}

// controlClient calls nodes' control APIs, each checked to be the node the
// registry names, in a role.
type controlClient struct {
	sec Security
	// expect is the role the registry gives a node, if it knows the node:
	// its certificate must carry that role. nil: any role.
	expect  func(name string) (Role, bool)
	mu      sync.Mutex
	clients map[string]*http.Client // by node name
	roles   map[string]pki.Role     // the role each node's certificate carried at its last handshake
}

func newControlClient(sec Security) *controlClient {
	return &controlClient{sec: sec, clients: map[string]*http.Client{}, roles: map[string]pki.Role{}}
}

// certRole is the role node name's certificate carried at its last
// handshake (false before any, or without TLS).
func (c *controlClient) certRole(name string) (pki.Role, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.roles[name]
	return r, ok
}

func (c *controlClient) client(name string) *http.Client {
	c.mu.Lock()
	defer c.mu.Unlock()
	if cl := c.clients[name]; cl != nil {
		return cl
	}
	tr := &http.Transport{MaxIdleConnsPerHost: 256, IdleConnTimeout: time.Minute,
		DialContext: (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 5 * time.Second}).DialContext}
	if c.sec.TLS != nil {
		cfg := c.sec.TLS.Clone()
		cfg.MinVersion = tls.VersionTLS13
		cfg.ServerName = name // the node's certificate must name it
		cfg.VerifyConnection = func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return errors.New("node: control API: no server certificate")
			}
			role, err := pki.RoleOf(cs.PeerCertificates[0])
			if err != nil {
				return fmt.Errorf("node: %q: %w", name, err)
			}
			if c.expect != nil {
				if want, ok := c.expect(name); ok && pki.Role(want) != role {
					return fmt.Errorf("node: %w: %q is certified as %s; the registry lists it as %s", pki.ErrWrongRole, name, role, want)
				}
			}
			c.mu.Lock()
			c.roles[name] = role
			c.mu.Unlock()
			return nil
		}
		tr.TLSClientConfig = cfg
		tr.ForceAttemptHTTP2 = true
	}
	cl := &http.Client{Transport: tr}
	c.clients[name] = cl
	return cl
}

func (c *controlClient) scheme() string {
	if c.sec.TLS != nil {
		return "https://"
	}
	return "http://"
}

// call posts in to node's path at addr and decodes the answer into out. A
// node that does not answer is ErrUnreachable (with ErrPeerFailed: the leg
// failed because its node did).
func (c *controlClient) call(ctx context.Context, name, addr, path string, in, out any) error {
	resp, err := c.send(ctx, name, addr, path, in)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := readAnswer(name, io.LimitReader(resp.Body, maxControlBody))
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return refusal(name, resp.Status, b)
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			return fmt.Errorf("%w: %s: a malformed answer: %v", protocol.ErrPeerFailed, name, err)
		}
	}
	return nil
}

// send makes a control call: a POST of in as JSON, or a GET if in is nil.
// Failing to get an answer is the caller's cancel if ctx ended, else the
// node unreachable (with ErrPeerFailed).
func (c *controlClient) send(ctx context.Context, name, addr, path string, in any) (*http.Response, error) {
	var body io.Reader
	method := http.MethodGet
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return nil, err
		}
		body, method = bytes.NewReader(b), http.MethodPost
	}
	req, err := http.NewRequestWithContext(ctx, method, c.scheme()+addr+path, body)
	if err != nil {
		return nil, err
	}
	resp, err := c.client(name).Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%w: call to %q ended: %w", protocol.ErrCancelled, name, ctx.Err())
		}
		return nil, fmt.Errorf("%w: %w: %s at %s: %v", protocol.ErrPeerFailed, ErrUnreachable, name, addr, err)
	}
	return resp, nil
}

// readAnswer reads a whole (bounded) answer; breaking off is the node
// unreachable.
func readAnswer(name string, r io.Reader) ([]byte, error) {
	b, err := io.ReadAll(r)
	if err != nil {
		return nil, fmt.Errorf("%w: %w: %s: reading the answer: %v", protocol.ErrPeerFailed, ErrUnreachable, name, err)
	}
	return b, nil
}

// refusal is the error of an answer that is not a success: the node's own
// error when it sent one (its wire codes kept), else its status and body.
func refusal(name, status string, b []byte) error {
	var a legAnswer
	if json.Unmarshal(b, &a) == nil && a.Error != nil {
		return a.Error.err()
	}
	return fmt.Errorf("%w: %s answered %s: %s", protocol.ErrPeerFailed, name, status, bytes.TrimSpace(b))
}

// stream posts in to node's path at addr and reads its answer as a
// stream of frames (handleStream), each to onFrame as it arrives, until the
// last (End): its error, or nil. An answer that is not a stream is read as
// call reads one. What is read is bounded as call's answer is (the whole
// stream at most maxControlBody); onFrame bounds what it keeps, and its
// error ends the call. A stream that breaks off before its End is
// ErrUnreachable, with ErrPeerFailed.
func (c *controlClient) stream(ctx context.Context, name, addr, path string, in any, onFrame func(legAnswer) error) error {
	resp, err := c.send(ctx, name, addr, path, in)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body := io.LimitReader(resp.Body, maxControlBody)
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != frameType {
		b, err := readAnswer(name, body)
		if err != nil {
			return err
		}
		return refusal(name, resp.Status, b)
	}
	dec := json.NewDecoder(body)
	dec.DisallowUnknownFields()
	for {
		var f legAnswer
		if err := dec.Decode(&f); err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("%w: call to %q ended: %w", protocol.ErrCancelled, name, ctx.Err())
			}
			var syntax *json.SyntaxError
			var typ *json.UnmarshalTypeError
			if errors.As(err, &syntax) || errors.As(err, &typ) || strings.HasPrefix(err.Error(), "json: unknown field") {
				return fmt.Errorf("%w: %s: a malformed frame: %v", protocol.ErrPeerFailed, name, err)
			}
			return fmt.Errorf("%w: %w: %s: the answer broke off: %v", protocol.ErrPeerFailed, ErrUnreachable, name, err)
		}
		if len(f.Tokens) > 0 || len(f.Logprobs) > 0 {
			if err := onFrame(f); err != nil {
				return err
			}
		}
		if f.End {
			if f.Error != nil {
				return f.Error.err()
			}
			return nil
		}
	}
}

func (c *controlClient) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, cl := range c.clients {
		cl.CloseIdleConnections()
	}
}
