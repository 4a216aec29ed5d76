package node

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// TenantHeader is the client API's header naming the request's tenant.
const TenantHeader = "X-Tenant"

// RequestIDHeader carries a request's id on every answer of the client API
// (and from a trusted front proxy, RouterConfig.TrustRequestID).
const RequestIDHeader = "X-Request-Id"

// The headers naming the nodes that served a request, and the router's
// build (the model is in the body).
const (
	PrefillHeader = "X-Kvhandoff-Prefill"
	DecodeHeader  = "X-Kvhandoff-Decode"
	VersionHeader = "X-Kvhandoff-Version"
)

// apiError is an error body in the OpenAI shape.
type apiError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    string  `json:"code"`
}

// RequestError is a client request refused for a reason the client can
// fix: the parameter at fault (or ""), a stable code, and a message for the
// client (no internal detail). It matches ErrBadRequest and Err.
type RequestError struct {
	Param, Code, Message string
	Err                  error
}

func (e *RequestError) Error() string { return "node: bad request: " + e.Message }

// Unwrap is ErrBadRequest and the cause, if any.
func (e *RequestError) Unwrap() []error {
	if e.Err != nil {
		return []error{ErrBadRequest, e.Err}
	}
	return []error{ErrBadRequest}
}

func badParam(param, code, format string, a ...any) *RequestError {
	return &RequestError{Param: param, Code: code, Message: fmt.Sprintf(format, a...)}
}

// retryAfter is the Retry-After of a 503: the router's pools and nodes
// change in seconds.
const retryAfter = "1"

// defaultMaxTokens is max_tokens when a request leaves it out (as OpenAI's API does).
const defaultMaxTokens = 16

type ctxKey int

const requestIDKey ctxKey = 0

// requestIDOf is the client request's id that withRequestID gave it.
func requestIDOf(ctx context.Context) string {
	id, _ := ctx.Value(requestIDKey).(string)
	return id
}

// newRequestID is a fresh request id: 16 random bytes in hex, a string
// (no JSON number rounding), unique without coordination between routers.
func newRequestID() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// checkRequestID accepts a front proxy's id: 1 to 128 bytes of letters,
// digits and . _ - : (it is logged and echoed as a header).
func checkRequestID(id string) bool {
	if id == "" || len(id) > 128 {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-' || c == ':') {
			return false
		}
	}
	return true
}

// withRequestID gives every request an id (a trusted front proxy's, if
// configured and well formed, else a fresh one), in its context and in the
// X-Request-Id header of whatever answers it.
func (rt *Router) withRequestID(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := r.Header.Get(RequestIDHeader)
		if !rt.cfg.TrustRequestID || !checkRequestID(id) {
			id = newRequestID()
		}
		w.Header().Set(RequestIDHeader, id)
		w.Header().Set(VersionHeader, Version())
		start := time.Now()
		rec := &statusRecorder{ResponseWriter: w}
		h.ServeHTTP(rec, r.WithContext(context.WithValue(r.Context(), requestIDKey, id)))
		if strings.HasPrefix(r.URL.Path, "/v1/") {
			code := rec.code
			if code == 0 {
				code = http.StatusOK
				if r.Context().Err() != nil {
					code = 499 // the client went away before an answer
				}
			}
			rt.cfg.Metrics.latency.WithLabelValues(strconv.Itoa(code)).Observe(time.Since(start).Seconds())
		}
	})
}

// statusRecorder keeps the status an answer was given (for the latency by
// status); Unwrap lets http.ResponseController reach the connection.
type statusRecorder struct {
	http.ResponseWriter
	code int
}

func (s *statusRecorder) WriteHeader(code int) {
	if s.code == 0 {
		s.code = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusRecorder) Write(b []byte) (int, error) {
	if s.code == 0 {
		s.code = http.StatusOK
	}
	return s.ResponseWriter.Write(b)
}

func (s *statusRecorder) Unwrap() http.ResponseWriter { return s.ResponseWriter }

// Handler is the router's client API in the OpenAI-compatible shape:
// POST /v1/completions and /v1/chat/completions, GET /v1/models, and
// GET /metrics, /healthz (the router is alive) and /readyz (it can place a
// request). Every answer carries X-Request-Id; every error is a JSON body
// {"error": {message, type, param, code}} with a stable code and no
// internal detail (that goes to the log under the request id); a 503
// carries Retry-After. Never 200 without a verified handoff. A client that
// disconnects cancels its request on both legs.
func (rt *Router) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", rt.completions)
	mux.HandleFunc("POST /v1/chat/completions", rt.chatCompletions)
	mux.HandleFunc("GET /v1/models", rt.models)
	mux.Handle("GET /metrics", rt.cfg.Metrics.Handler())
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "alive"})
	})
	mux.HandleFunc("GET /readyz", rt.readyz)
	known := map[string]string{"/v1/completions": "POST", "/v1/chat/completions": "POST", "/v1/models": "GET",
		"/metrics": "GET", "/healthz": "GET", "/readyz": "GET"}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if m, ok := known[r.URL.Path]; ok {
			w.Header().Set("Allow", m)
			rt.answerError(w, r, http.StatusMethodNotAllowed, "invalid_request_error", "", "method_not_allowed",
				fmt.Sprintf("%s takes %s, not %s", r.URL.Path, m, r.Method), nil)
			return
		}
		rt.answerError(w, r, http.StatusNotFound, "invalid_request_error", "", "not_found",
			fmt.Sprintf("no such endpoint: %s %.100q", r.Method, r.URL.Path), nil)
	})
	return rt.withRequestID(mux)
}

// readyz is 200 when the router can place a request: not draining, and at
// least one live node of each role; else 503 with what is missing.
func (rt *Router) readyz(w http.ResponseWriter, r *http.Request) {
	var pre, dec int
	rt.mu.Lock()
	for _, n := range rt.r.Nodes() {
		if n.Info.Role == protocol.RolePrefill {
			pre++
		} else {
			dec++
		}
	}
	rt.mu.Unlock()
	var why []string
	if rt.flight.isDraining() {
		why = append(why, "the router is draining (shutting down)")
	}
	if pre == 0 {
		why = append(why, "no live prefill node")
	}
	if dec == 0 {
		why = append(why, "no live decode node")
	}
	if len(why) > 0 {
		rt.answerError(w, r, http.StatusServiceUnavailable, "server_error", "", "not_ready", "not ready: "+strings.Join(why, "; "), nil)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": "ready", "prefill_nodes": pre, "decode_nodes": dec})
}

// answerFailure answers a request that Complete failed: the client sees a
// stable code and a message of its own (no addresses, no error chain); the
// log has the whole error under the request id.
func (rt *Router) answerFailure(w http.ResponseWriter, r *http.Request, err error) {
	var re *RequestError
	switch {
	case errors.As(err, &re):
		rt.answerError(w, r, http.StatusBadRequest, "invalid_request_error", re.Param, re.Code, re.Message, err)
	case errors.Is(err, ErrUnauthenticated):
		w.Header().Set("WWW-Authenticate", `Bearer realm="kvhandoff"`)
		rt.answerError(w, r, http.StatusUnauthorized, "invalid_request_error", "", "invalid_api_key",
			"no valid API key: send one of this deployment's as Authorization: Bearer KEY", err)
	case errors.Is(err, protocol.ErrTooLong), errors.Is(err, protocol.ErrTooManyPages):
		rt.answerError(w, r, http.StatusBadRequest, "invalid_request_error", "prompt", "context_length_exceeded",
			fmt.Sprintf("the prompt is over this deployment's limit of %d tokens", rt.Limit()), err)
	case errors.Is(err, ErrBadRequest), errors.Is(err, protocol.ErrRejected):
		rt.answerError(w, r, http.StatusBadRequest, "invalid_request_error", "", "invalid_request",
			"a node refused the request at its intake", err)
	case errors.Is(err, ErrShuttingDown):
		says := "the router is shutting down"
		var he *HandoffError
		if errors.As(err, &he) {
			// A node of the handoff refused its leg as it stops.
			says = fmt.Sprintf("a node of the handoff is shutting down (prefill node %q, decode node %q); nothing was answered, and the request may be retried", he.Prefill, he.Decode)
		}
		rt.answerError(w, r, http.StatusServiceUnavailable, "server_error", "", "shutting_down", says, err)
	case errors.Is(err, protocol.ErrNoNode):
		rt.answerError(w, r, http.StatusServiceUnavailable, "server_error", "", "no_node",
			"the router knows no live prefill and decode node", err)
	default:
		why := Reason(err)
		for _, c := range failureCauses {
			if errors.Is(err, c.err) {
				why += ": " + c.says
				break
			}
		}
		var he *HandoffError
		if errors.As(err, &he) {
			why += fmt.Sprintf("; prefill node %q, decode node %q", he.Prefill, he.Decode)
		}
		rt.answerError(w, r, http.StatusServiceUnavailable, "server_error", "", "handoff_failed_"+Reason(err),
			fmt.Sprintf("the handoff failed (%s); nothing was answered from unverified data, and the request may be retried", why), err)
	}
}

// failureCauses are what a client is told of a failed handoff's cause: the
// sentinel's plain words, never the error's chain (which may hold addresses).
var failureCauses = []struct {
	err  error
	says string
}{
	{protocol.ErrNodeLost, "node lost"},
	{ErrUnreachable, "node unreachable"},
	{protocol.ErrTimedOut, "timed out"},
	{protocol.AbortTimedOut, "timed out"},
	{protocol.ErrChecksumMismatch, "checksum mismatch"},
	{protocol.ErrTagMismatch, "tag mismatch"},
	{protocol.ErrTagMalformed, "tag malformed"},
	{protocol.ErrFenced, "fenced"},
	{protocol.ErrTokenMismatch, "token mismatch"},
	{protocol.ErrNoCapacity, "no room in a pool"},
	{protocol.AbortNoCapacity, "no room in a pool"},
	{protocol.ErrPeerFailed, "the other leg failed"},
	{protocol.ErrCancelled, "cancelled"},
	{protocol.AbortCancelled, "cancelled"},
	{transfer.ErrNoPeer, "no queue pair between the nodes"},
	{ErrNoPrompt, "the prompt never reached the decode node"},
}

// HandoffError is a dispatched request's failure: the nodes that served it
// (for the client's answer), and the cause, whose message it keeps as its
// own (the logs already name the nodes).
type HandoffError struct {
	Prefill, Decode string
	Err             error
}

func (e *HandoffError) Error() string { return e.Err.Error() }

// Unwrap is the cause.
func (e *HandoffError) Unwrap() error { return e.Err }

// answerError writes an error body; err (the internal detail) goes to the
// log with the request's id, never to the client. A 503 carries Retry-After.
func (rt *Router) answerError(w http.ResponseWriter, r *http.Request, code int, typ, param, errCode, msg string, err error) {
	rt.cfg.Metrics.requests.WithLabelValues(strconv.Itoa(code)).Inc()
	if code == http.StatusServiceUnavailable {
		w.Header().Set("Retry-After", retryAfter)
	}
	if r != nil {
		rt.cfg.Log.Info("request answered with an error", "request_id", requestIDOf(r.Context()), "tenant", r.Header.Get(TenantHeader),
			"path", r.URL.Path, "status", code, "code", errCode, "param", param, "message", msg, "err", err)
	}
	e := apiError{Message: msg, Type: typ, Code: errCode}
	if param != "" {
		e.Param = &param
	}
	writeJSON(w, code, struct {
		Error apiError `json:"error"`
	}{e})
}

// decodeBody reads r's JSON body into v, at most HTTPLimits.MaxBodyBytes of
// it within BodyTimeout, then lifts the read deadline (the connection's
// read from then on only watches for the client going away). A body that is
// not one is answered here (400; 408 for one too slow) and decodeBody is
// false.
func (rt *Router) decodeBody(w http.ResponseWriter, r *http.Request, v any) bool {
	body := http.MaxBytesReader(w, r.Body, rt.cfg.HTTP.MaxBodyBytes)
	err := json.NewDecoder(body).Decode(v)
	if err == nil {
		// Whitespace after the value; reading to the end starts net/http's
		// watch for a disconnect.
		_, err = io.Copy(io.Discard, body)
	}
	var tooLarge *http.MaxBytesError
	var netErr net.Error
	switch {
	case err == nil:
		http.NewResponseController(w).SetReadDeadline(time.Time{})
		return true
	case errors.As(err, &tooLarge):
		rt.answerError(w, r, http.StatusBadRequest, "invalid_request_error", "", "request_too_large",
			fmt.Sprintf("the request body is over this router's limit of %d bytes", tooLarge.Limit), err)
	case errors.As(err, &netErr) && netErr.Timeout():
		rt.answerError(w, r, http.StatusRequestTimeout, "invalid_request_error", "", "request_timeout",
			fmt.Sprintf("the request body did not arrive within %v", rt.cfg.HTTP.BodyTimeout), err)
	default:
		rt.answerError(w, r, http.StatusBadRequest, "invalid_request_error", "", "invalid_json", "the body is not a JSON object", err)
	}
	return false
}

// ServeAPI serves the client API on ln (plaintext HTTP) until ctx ends,
// under RouterConfig.HTTP's limits.
func (rt *Router) ServeAPI(ctx context.Context, ln net.Listener) error {
	return serveAPI(ctx, ln, rt.Handler(), rt.cfg.HTTP, rt.cfg.Log)
}
