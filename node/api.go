package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/kvhandoff/kvhandoff/protocol"
)

// TenantHeader is the client API's header naming the request's tenant.
const TenantHeader = "X-Tenant"

// maxClientBody bounds a completion request's body.
const maxClientBody = 16 << 20

type completionRequest struct {
	Model     string `json:"model"`
	Prompt    string `json:"prompt"`
	MaxTokens *int   `json:"max_tokens"`
	Stream    bool   `json:"stream"`
	User      string `json:"user"`
}

type completionChoice struct {
	Text         string `json:"text"`
	Index        int    `json:"index"`
	Logprobs     any    `json:"logprobs"`
	FinishReason string `json:"finish_reason"`
}

type completionUsage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

type completionResponse struct {
	ID      string             `json:"id"`
	Object  string             `json:"object"`
	Created int64              `json:"created"`
	Model   string             `json:"model"`
	Choices []completionChoice `json:"choices"`
	Usage   completionUsage    `json:"usage"`
}

type apiError struct {
	Message string `json:"message"`
	Type    string `json:"type"`
	Param   string `json:"param,omitempty"`
	Code    string `json:"code"`
}

// defaultMaxTokens is max_tokens when a request leaves it out (as OpenAI's API does).
const defaultMaxTokens = 16

// Handler is the router's client API: POST /v1/completions in the
// OpenAI-compatible shape (model, prompt, max_tokens; the tenant from the
// X-Tenant header), and GET /metrics. A completion answers 200 with the
// generated text, 400 for a prompt over the deployment's limit (the limit
// named) or a malformed request, and 503 with the reason when the handoff
// failed: never 200 without a verified handoff. A client that disconnects
// cancels its request on both legs.
func (rt *Router) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", rt.completions)
	mux.Handle("GET /metrics", rt.cfg.Metrics.Handler())
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-rt.ready:
			fmt.Fprintln(w, "ok")
		default:
			http.Error(w, "no prefill and decode node yet", http.StatusServiceUnavailable)
		}
	})
	return mux
}

func (rt *Router) completions(w http.ResponseWriter, r *http.Request) {
	var req completionRequest
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxClientBody))
	if err := dec.Decode(&req); err != nil {
		rt.answerError(w, http.StatusBadRequest, "invalid_request_error", "", "invalid_json", fmt.Sprintf("the body is not a completion request: %v", err))
		return
	}
	switch {
	case req.Stream:
		rt.answerError(w, http.StatusBadRequest, "invalid_request_error", "stream", "unsupported", "streaming is not supported")
		return
	case req.Prompt == "":
		rt.answerError(w, http.StatusBadRequest, "invalid_request_error", "prompt", "invalid_prompt", "prompt must be a non-empty string")
		return
	}
	maxTokens := defaultMaxTokens
	if req.MaxTokens != nil {
		maxTokens = *req.MaxTokens
	}
	tenant := r.Header.Get(TenantHeader)
	if tenant == "" {
		tenant = "default"
	}
	res, err := rt.Complete(r.Context(), Completion{Prompt: req.Prompt, MaxTokens: maxTokens, Tenant: tenant, Model: req.Model})
	if err != nil {
		if r.Context().Err() != nil {
			rt.cfg.Metrics.requests.WithLabelValues("499").Inc() // the client went away: no one to answer
			return
		}
		rt.answerFailure(w, res, err)
		return
	}
	rt.cfg.Metrics.requests.WithLabelValues("200").Inc()
	finish := "length"
	if len(res.Tokens) < maxTokens {
		finish = "stop"
	}
	model := req.Model
	if model == "" {
		rt.mu.Lock()
		model = rt.cfg.ModelID
		rt.mu.Unlock()
	}
	writeJSON(w, http.StatusOK, completionResponse{ID: "cmpl-" + strconv.FormatUint(uint64(res.ID), 16), Object: "text_completion",
		Created: time.Now().Unix(), Model: model, Choices: []completionChoice{{Text: res.Text, FinishReason: finish}},
		Usage: completionUsage{PromptTokens: res.PromptTokens, CompletionTokens: len(res.Tokens), TotalTokens: res.PromptTokens + len(res.Tokens)}})
}

func (rt *Router) answerFailure(w http.ResponseWriter, res Result, err error) {
	switch {
	case errors.Is(err, protocol.ErrTooLong), errors.Is(err, protocol.ErrTooManyPages):
		rt.answerError(w, http.StatusBadRequest, "invalid_request_error", "prompt", "context_length_exceeded",
			fmt.Sprintf("prompt of %d tokens is over this deployment's limit of %d tokens: %v", res.PromptTokens, rt.Limit(), err))
	case errors.Is(err, ErrBadRequest), errors.Is(err, protocol.ErrRejected):
		rt.answerError(w, http.StatusBadRequest, "invalid_request_error", "", "invalid_request", err.Error())
	case errors.Is(err, ErrShuttingDown):
		rt.answerError(w, http.StatusServiceUnavailable, "server_error", "", "shutting_down", err.Error())
	default:
		rt.answerError(w, http.StatusServiceUnavailable, "server_error", "", "handoff_failed_"+Reason(err),
			fmt.Sprintf("the handoff failed (%s; prefill %q, decode %q): %v", Reason(err), res.Prefill, res.Decode, err))
	}
}

func (rt *Router) answerError(w http.ResponseWriter, code int, typ, param, errCode, msg string) {
	rt.cfg.Metrics.requests.WithLabelValues(strconv.Itoa(code)).Inc()
	writeJSON(w, code, struct {
		Error apiError `json:"error"`
	}{apiError{Message: msg, Type: typ, Param: param, Code: errCode}})
}

// ServeAPI serves the client API on ln (plaintext HTTP) until ctx ends.
func (rt *Router) ServeAPI(ctx context.Context, ln net.Listener) error {
	return serveHTTP(ctx, ln, rt.Handler(), nil, rt.cfg.Log)
}
