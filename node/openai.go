package node

import (
	"bytes"
	"context"
	"encoding/json"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// The OpenAI-compatible surface (docs/nodes.md "The client API"): every
// parameter of a request is honoured or refused with a 400 naming it, never
// dropped.

// maxChoices bounds the choices of one request (prompts times n): each is a
// handoff of its own.
const maxChoices = 16

// maxLogprobs bounds the completions API's logprobs (OpenAI's bound), and
// maxTopLogprobs the chat API's top_logprobs.
const (
	maxLogprobs    = 5
	maxTopLogprobs = 20
)

// maxStops and maxStopBytes bound the stop strings, as OpenAI's API does.
const (
	maxStops     = 4
	maxStopBytes = 256
)

// genParams are the generation parameters common to both endpoints.
type genParams struct {
	model        string
	maxTokens    int
	n            int
	stop         []string
	temperature  float32
	topP         float32
	seed         *uint64
	echo         bool
	stream       bool
	includeUsage bool
	logprobs     *int // the most likely tokens to report a step; nil: none
	// bodyScope is the scope the body named (cache_salt): refused unless
	// the client-scope bug is on.
	bodyScope string
}

// fields is a request body's fields, each parsed by the endpoint or refused.
type fields map[string]json.RawMessage

func isNull(raw json.RawMessage) bool { return len(raw) == 0 || string(raw) == "null" }

// take parses field name into v (absent or null: v unchanged).
func (f fields) take(name string, v any) error {
	raw, ok := f[name]
	delete(f, name)
	if !ok || isNull(raw) {
		return nil
	}
	if err := json.Unmarshal(raw, v); err != nil {
		return badParam(name, "invalid_type", "%s: %s is not of the type the API takes", name, clip(raw))
	}
	return nil
}

// only accepts field name when it holds one of the values that mean "off"
// (the feature is not implemented): anything else is refused, naming it.
func (f fields) only(name string, off ...string) error {
	raw, ok := f[name]
	delete(f, name)
	if !ok || isNull(raw) {
		return nil
	}
	var compact bytes.Buffer
	if json.Compact(&compact, raw) == nil && slices.Contains(off, compact.String()) {
		return nil
	}
	return badParam(name, "unsupported_parameter", "%s is not supported by this deployment (only %s)", name, strings.Join(append([]string{"null"}, off...), ", "))
}

// rest refuses every field no one took.
func (f fields) rest() error {
	for _, k := range slices.Sorted(func(yield func(string) bool) {
		for k := range f {
			if !yield(k) {
				return
			}
		}
	}) {
		return badParam(k, "unsupported_parameter", "%.64q is not a parameter this deployment supports", k)
	}
	return nil
}

func clip(raw json.RawMessage) string {
	if len(raw) > 64 {
		return string(raw[:64]) + "..."
	}
	return string(raw)
}

// common parses the generation parameters both endpoints share.
func (rt *Router) common(f fields, maxTokensName string) (genParams, error) {
	p := genParams{maxTokens: defaultMaxTokens, n: 1, topP: 1}
	var maxTokens, n *int
	var temperature, topP *float64
	var seed *int64
	var stop json.RawMessage
	var streamOpts *struct {
		IncludeUsage bool `json:"include_usage"`
	}
	for _, e := range []error{f.take("model", &p.model), f.take(maxTokensName, &maxTokens), f.take("n", &n),
		f.take("temperature", &temperature), f.take("top_p", &topP), f.take("seed", &seed), f.take("stop", &stop),
		f.take("stream", &p.stream), f.take("stream_options", &streamOpts), f.take("user", new(string)),
		f.only("presence_penalty", "0", "0.0"), f.only("frequency_penalty", "0", "0.0"), f.only("logit_bias", "{}")} {
		if e != nil {
			return p, e
		}
	}
	for _, name := range scopeFields {
		// A request never names its own cache scope: the router sets it from
		// the authenticated tenant (scope.go). client-scope takes it.
		raw, present := f[name]
		delete(f, name)
		if !present || isNull(raw) {
			continue
		}
		if !rt.cfg.Research.Has(research.ClientScope) || json.Unmarshal(raw, &p.bodyScope) != nil {
			return p, scopeParam(name)
		}
	}
	if maxTokens != nil {
		if *maxTokens < 1 || *maxTokens > rt.cfg.MaxNewTokens {
			return p, badParam(maxTokensName, "invalid_value", "%s %d is outside 1..%d", maxTokensName, *maxTokens, rt.cfg.MaxNewTokens)
		}
		p.maxTokens = *maxTokens
	}
	if n != nil {
		if *n < 1 || *n > maxChoices {
			return p, badParam("n", "invalid_value", "n %d is outside 1..%d", *n, maxChoices)
		}
		p.n = *n
	}
	if temperature != nil {
		if *temperature < 0 || *temperature > 2 {
			return p, badParam("temperature", "invalid_value", "temperature %v is outside 0..2", *temperature)
		}
		p.temperature = float32(*temperature)
	}
	if topP != nil {
		if *topP <= 0 || *topP > 1 {
			return p, badParam("top_p", "invalid_value", "top_p %v is outside (0, 1]", *topP)
		}
		p.topP = float32(*topP)
	}
	if seed != nil {
		s := uint64(*seed)
		p.seed = &s
	}
	if !isNull(stop) {
		var one string
		if json.Unmarshal(stop, &one) == nil {
			p.stop = []string{one}
		} else if err := json.Unmarshal(stop, &p.stop); err != nil {
			return p, badParam("stop", "invalid_type", "stop is a string or an array of strings")
		}
		if len(p.stop) > maxStops {
			return p, badParam("stop", "invalid_value", "at most %d stop sequences", maxStops)
		}
		for _, s := range p.stop {
			if s == "" || len(s) > maxStopBytes {
				return p, badParam("stop", "invalid_value", "a stop sequence is 1 to %d bytes", maxStopBytes)
			}
		}
	}
	if streamOpts != nil {
		if !p.stream {
			return p, badParam("stream_options", "invalid_value", "stream_options is only for stream: true")
		}
		p.includeUsage = streamOpts.IncludeUsage
	}
	return p, nil
}

// prompt is one prompt of a request: text, or token ids.
type prompt struct {
	text   string
	tokens []int
}

func parsePrompt(raw json.RawMessage) ([]prompt, error) {
	bad := badParam("prompt", "invalid_prompt", "prompt is a non-empty string, an array of strings, an array of token ids, or an array of those")
	if isNull(raw) {
		return nil, bad
	}
	var one string
	if json.Unmarshal(raw, &one) == nil {
		return []prompt{{text: one}}, nil
	}
	var texts []string
	if json.Unmarshal(raw, &texts) == nil && len(texts) > 0 {
		out := make([]prompt, len(texts))
		for i, t := range texts {
			out[i] = prompt{text: t}
		}
		return out, nil
	}
	var toks []int
	if json.Unmarshal(raw, &toks) == nil && len(toks) > 0 {
		return []prompt{{tokens: toks}}, nil
	}
	var lists [][]int
	if json.Unmarshal(raw, &lists) == nil && len(lists) > 0 {
		out := make([]prompt, len(lists))
		for i, t := range lists {
			if len(t) == 0 {
				return nil, bad
			}
			out[i] = prompt{tokens: t}
		}
		return out, nil
	}
	return nil, bad
}

// choice is one generated choice, finished.
type choice struct {
	index  int
	text   string
	finish string
	tokens int // generated tokens, up to a stop
	res    Result
	steps  []step // each token's text and log probabilities, if asked for
}

// step is one generated token as logprobs report it: its text (after the
// token before it), its log probability, and the most likely tokens'.
type step struct {
	text    string
	logprob float32
	top     []stepAlt
}

type stepAlt struct {
	text    string
	logprob float32
}

// run generates every choice of a request (each prompt n times), each a
// handoff of its own, concurrently; the first failure fails the request and
// cancels the rest. With a relay (a stream), each choice's tokens go to it
// as they reach the router, then the choice's end.
func (rt *Router) run(ctx context.Context, r *http.Request, prompts []prompt, p genParams, tenant clientTenant, relay *relayQueue) ([]choice, error) {
	if len(prompts)*p.n > maxChoices {
		return nil, badParam("n", "invalid_value", "%d prompts times n %d is over %d choices", len(prompts), p.n, maxChoices)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	out := make([]choice, len(prompts)*p.n)
	errs := make([]error, len(out))
	var wg sync.WaitGroup
	for i := range out {
		pr := prompts[i/p.n]
		c := Completion{Prompt: pr.text, Tokens: pr.tokens, MaxTokens: p.maxTokens, Tenant: tenant.name, Authenticated: tenant.authenticated, Model: p.model,
			RequestID: requestIDOf(r.Context()), Temperature: p.temperature, TopP: p.topP, Logprobs: p.logprobs, BodyScope: p.bodyScope}
		if p.temperature > 0 {
			if p.seed != nil {
				c.Seed = *p.seed + uint64(i)
			} else {
				c.Seed = rand.Uint64()
			}
		}
		if len(out) > 1 {
			c.RequestID += "/" + strconv.Itoa(i)
		}
		// A stop string ends the generation on the decode node as soon as
		// the router sees it (the text after it is not the client's).
		// Without a stream, the client sees nothing until the end: the
		// search only watches, and a failed attempt whose answer had begun
		// may still be retried, the search starting again on the retry's
		// parts (a failed attempt's late parts are left out).
		var mu sync.Mutex
		var handoff protocol.RequestID
		var watch *choiceStream
		stopped := false
		parts := func(g Generated) {
			if relay != nil {
				relay.push(relayEvent{index: i, part: &g})
			}
			if len(p.stop) == 0 {
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if g.Handoff < handoff {
				return // an earlier attempt's (handoff ids grow)
			}
			if g.Handoff != handoff {
				handoff, watch, stopped = g.Handoff, &choiceStream{}, false
			}
			if stopped {
				return
			}
			watch.add(rt.cfg.Tokenizer, &g)
			upTo, stop := watch.release(p.stop, watch.eos)
			watch.sent = upTo
			if stop {
				stopped = true
				rt.enough(g.Handoff)
			}
		}
		if relay != nil {
			c.Stream = parts
		} else {
			c.Watch = parts
		}
		wg.Go(func() {
			res, err := rt.Complete(ctx, c)
			if err != nil {
				errs[i] = err
				cancel()
				return
			}
			out[i] = rt.finish(i, res, p.stop)
			if relay != nil {
				end := out[i]
				relay.push(relayEvent{index: i, end: &end})
			}
		})
	}
	wg.Wait()
	// The failure that failed the request, not the cancels it caused.
	var first error
	for _, err := range errs {
		if err != nil && !isCancel(err) {
			return nil, err
		}
		if first == nil {
			first = err
		}
	}
	if first != nil {
		return nil, first
	}
	return out, nil
}

func isCancel(err error) bool { return Reason(err) == "cancelled" }

// finish cuts a result at the end of sequence or the first stop string:
// finish_reason "stop"; otherwise it ran to max_tokens or the context
// window: "length".
func (rt *Router) finish(i int, res Result, stops []string) choice {
	c := choice{index: i, finish: "length", res: res, tokens: len(res.Tokens)}
	toks := res.Tokens
	if eos := rt.cfg.Tokenizer.EOS(); eos >= 0 {
		if at := slices.Index(toks, eos); at >= 0 {
			toks, c.finish = toks[:at], "stop"
		}
	}
	prev := -1
	if len(res.Prompt) > 0 {
		prev = res.Prompt[len(res.Prompt)-1]
	}
	c.text = llama.Decode(rt.cfg.Tokenizer, toks, prev)
	// (choiceStream releases a stream's text by the same rules.)
	cut := -1
	for _, s := range stops {
		if at := strings.Index(c.text, s); at >= 0 && (cut < 0 || at < cut) {
			cut = at
		}
	}
	if cut >= 0 {
		c.text, c.finish = c.text[:cut], "stop"
		// The tokens the client gets: those whose text precedes the stop.
		n, text := 0, 0
		for n < len(toks) && text < cut {
			text += len(rt.cfg.Tokenizer.Piece(prev, toks[n]))
			prev = toks[n]
			n++
		}
		toks = toks[:n]
	}
	c.tokens = len(toks)
	if res.Logprobs != nil {
		prev := -1
		if len(res.Prompt) > 0 {
			prev = res.Prompt[len(res.Prompt)-1]
		}
		for i, lp := range res.Logprobs[:min(c.tokens, len(res.Logprobs))] {
			c.steps = append(c.steps, stepOf(rt.cfg.Tokenizer, prev, lp))
			prev = toks[i]
		}
	}
	return c
}

// stepOf is a generated token's logprobs step, after prev.
func stepOf(tok llama.Tokenizer, prev int, lp llama.TokenLogprob) step {
	st := step{text: string(tok.Piece(prev, lp.Token)), logprob: lp.Logprob}
	for _, alt := range lp.Top {
		st.top = append(st.top, stepAlt{text: string(tok.Piece(prev, alt.Token)), logprob: alt.Logprob})
	}
	return st
}

// completionLogprobs is a completion choice's logprobs in the legacy
// completions shape.
type completionLogprobs struct {
	Tokens        []string             `json:"tokens"`
	TokenLogprobs []float32            `json:"token_logprobs"`
	TopLogprobs   []map[string]float32 `json:"top_logprobs"`
	TextOffset    []int                `json:"text_offset"`
}

func (c choice) completionLogprobs() any {
	if c.steps == nil && c.res.Logprobs == nil {
		return nil
	}
	return stepsAsCompletion(c.steps, 0)
}

// stepsAsCompletion is steps in the legacy completions shape, the first at
// text offset offset.
func stepsAsCompletion(steps []step, offset int) completionLogprobs {
	out := completionLogprobs{Tokens: []string{}, TokenLogprobs: []float32{}, TopLogprobs: []map[string]float32{}, TextOffset: []int{}}
	for _, st := range steps {
		out.Tokens = append(out.Tokens, st.text)
		out.TokenLogprobs = append(out.TokenLogprobs, st.logprob)
		top := map[string]float32{}
		for _, a := range st.top {
			if _, ok := top[a.text]; !ok {
				top[a.text] = a.logprob
			}
		}
		out.TopLogprobs = append(out.TopLogprobs, top)
		out.TextOffset = append(out.TextOffset, offset)
		offset += len(st.text)
	}
	return out
}

// chatLogprobs is a chat choice's logprobs.
type chatLogprobs struct {
	Content []chatTokenLogprob `json:"content"`
}

type chatTokenLogprob struct {
	Token       string             `json:"token"`
	Logprob     float32            `json:"logprob"`
	Bytes       []int              `json:"bytes"`
	TopLogprobs []chatTokenLogprob `json:"top_logprobs,omitempty"`
}

func bytesOf(s string) []int {
	out := make([]int, len(s))
	for i := range len(s) {
		out[i] = int(s[i])
	}
	return out
}

func (c choice) chatLogprobs() any {
	if c.steps == nil && c.res.Logprobs == nil {
		return nil
	}
	return stepsAsChat(c.steps)
}

// stepsAsChat is steps in the chat shape.
func stepsAsChat(steps []step) chatLogprobs {
	out := chatLogprobs{Content: []chatTokenLogprob{}}
	for _, st := range steps {
		t := chatTokenLogprob{Token: st.text, Logprob: st.logprob, Bytes: bytesOf(st.text), TopLogprobs: []chatTokenLogprob{}}
		for _, a := range st.top {
			t.TopLogprobs = append(t.TopLogprobs, chatTokenLogprob{Token: a.text, Logprob: a.logprob, Bytes: bytesOf(a.text)})
		}
		out.Content = append(out.Content, t)
	}
	return out
}

// handoffHex is the result's handoff id in hex: a completion's id names
// its (first) handoff, as the nodes' logs and a model-less decode node's
// digest do.
func (res Result) handoffHex() string { return strconv.FormatUint(uint64(res.ID), 16) }

// promptText is a prompt's text as echo returns it.
func (rt *Router) promptText(res Result) string {
	if len(res.Prompt) == 0 {
		return ""
	}
	return llama.Decode(rt.cfg.Tokenizer, res.Prompt[1:], res.Prompt[0])
}

type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
	// PromptDetails.CachedTokens are the prompt tokens the decode node
	// found in its prefix cache, in the tenant's own scope (or a public
	// one): OpenAI's field.
	PromptDetails promptDetails `json:"prompt_tokens_details"`
}

type promptDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

func usageOf(choices []choice, n int) usage {
	var u usage
	for i, c := range choices {
		if i%n == 0 {
			u.PromptTokens += c.res.PromptTokens
			u.PromptDetails.CachedTokens += c.res.CachedTokens
		}
		u.CompletionTokens += c.tokens
	}
	u.TotalTokens = u.PromptTokens + u.CompletionTokens
	return u
}

// servedBy names the nodes that served the choices in the response's headers.
func servedBy(w http.ResponseWriter, choices []choice) {
	pre, dec := nodesOf(choices)
	w.Header().Set(PrefillHeader, pre)
	w.Header().Set(DecodeHeader, dec)
}

// nodesOf lists the prefill and the decode nodes that served the choices,
// each once, comma-separated.
func nodesOf(choices []choice) (prefill, decode string) {
	var pre, dec []string
	for _, c := range choices {
		if !slices.Contains(pre, c.res.Prefill) {
			pre = append(pre, c.res.Prefill)
		}
		if !slices.Contains(dec, c.res.Decode) {
			dec = append(dec, c.res.Decode)
		}
	}
	return strings.Join(pre, ","), strings.Join(dec, ",")
}

func (rt *Router) modelID(asked string) string {
	if asked != "" {
		return asked
	}
	rt.mu.Lock()
	defer rt.mu.Unlock()
	return rt.cfg.ModelID
}

type completionChoice struct {
	Text         string  `json:"text"`
	Index        int     `json:"index"`
	Logprobs     any     `json:"logprobs"`
	FinishReason *string `json:"finish_reason"`
}

type completionResponse struct {
	ID      string             `json:"id"`
	Object  string             `json:"object"`
	Created int64              `json:"created"`
	Model   string             `json:"model"`
	Choices []completionChoice `json:"choices"`
	Usage   *usage             `json:"usage"`
}

// completions is POST /v1/completions.
func (rt *Router) completions(w http.ResponseWriter, r *http.Request) {
	var f fields
	if !rt.decodeBody(w, r, &f) {
		return
	}
	p, prompts, err := rt.completionRequest(f)
	if err != nil {
		rt.answerFailure(w, r, err)
		return
	}
	tenant, err := rt.tenantOf(r)
	if err != nil {
		rt.answerFailure(w, r, err)
		return
	}
	if p.stream {
		rt.streamAnswer(w, r, prompts, p, tenant, false)
		return
	}
	choices, err := rt.run(r.Context(), r, prompts, p, tenant, nil)
	if err != nil {
		rt.failed(w, r, err, nil)
		return
	}
	id, created, modelName := "cmpl-"+choices[0].res.handoffHex(), time.Now().Unix(), rt.modelID(p.model)
	u := usageOf(choices, p.n)
	rt.counted(choices, u)
	out := completionResponse{ID: id, Object: "text_completion", Created: created, Model: modelName, Usage: &u}
	for _, c := range choices {
		text := c.text
		if p.echo {
			text = rt.promptText(c.res) + text
		}
		out.Choices = append(out.Choices, completionChoice{Text: text, Index: c.index, Logprobs: c.completionLogprobs(), FinishReason: &c.finish})
	}
	servedBy(w, choices)
	writeJSON(w, http.StatusOK, out)
}

func (rt *Router) completionRequest(f fields) (genParams, []prompt, error) {
	p, err := rt.common(f, "max_tokens")
	if err != nil {
		return p, nil, err
	}
	raw := f["prompt"]
	delete(f, "prompt")
	prompts, err := parsePrompt(raw)
	if err != nil {
		return p, nil, err
	}
	for _, e := range []error{f.take("echo", &p.echo), f.take("logprobs", &p.logprobs), f.only("best_of", "1"), f.only("suffix", `""`), f.rest()} {
		if e != nil {
			return p, nil, e
		}
	}
	if p.logprobs != nil {
		if *p.logprobs < 0 || *p.logprobs > maxLogprobs {
			return p, nil, badParam("logprobs", "invalid_value", "logprobs %d is outside 0..%d", *p.logprobs, maxLogprobs)
		}
		if p.echo {
			return p, nil, badParam("echo", "unsupported_parameter", "echo with logprobs is not supported (the prompt's tokens have no log probabilities here)")
		}
	}
	return p, prompts, nil
}

// failed answers a request whose choices failed: an error body, or, once
// a stream has begun, an error event (the status line was sent).
func (rt *Router) failed(w http.ResponseWriter, r *http.Request, err error, stream *sse) {
	if r.Context().Err() != nil {
		rt.cfg.Metrics.requests.WithLabelValues("499").Inc() // the client went away: no one to answer
		rt.cfg.Log.Info("request abandoned by its client", "request_id", requestIDOf(r.Context()), "err", err)
		return
	}
	if stream == nil {
		rt.answerFailure(w, r, err)
		return
	}
	rec := &errorRecorder{header: http.Header{}}
	rt.answerFailure(rec, r, err)
	stream.event(rec.body.Bytes())
	stream.done()
}

// errorRecorder keeps an error body to send as a stream's last event.
type errorRecorder struct {
	header http.Header
	body   bytes.Buffer
}

func (e *errorRecorder) Header() http.Header         { return e.header }
func (e *errorRecorder) Write(b []byte) (int, error) { return e.body.Write(b) }
func (e *errorRecorder) WriteHeader(int)             {}

// sse writes server-sent events.
type sse struct {
	w  http.ResponseWriter
	rc *http.ResponseController
	// broken is the first write that failed (the client stopped reading
	// past HTTPLimits.WriteTimeout, or went): nothing more is sent.
	broken error
}

// startStream sends the status line and the event-stream headers at once
// (a client sees the request accepted), then events as they come.
func (rt *Router) startStream(w http.ResponseWriter) *sse {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	s := &sse{w: w, rc: http.NewResponseController(w)}
	s.write([]byte(": kvhandoff\n\n"))
	return s
}

func (s *sse) send(v any) {
	b, _ := json.Marshal(v)
	s.event(b)
}

func (s *sse) event(b []byte) {
	s.write([]byte("data: "), bytes.TrimSpace(b), []byte("\n\n"))
}

func (s *sse) done() { s.write([]byte("data: [DONE]\n\n")) }

func (s *sse) write(parts ...[]byte) {
	for _, p := range parts {
		if s.broken == nil {
			_, s.broken = s.w.Write(p)
		}
	}
	if s.broken == nil {
		s.broken = s.rc.Flush()
	}
}

// models is GET /v1/models: the model this deployment serves.
func (rt *Router) models(w http.ResponseWriter, r *http.Request) {
	type entry struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Created int64  `json:"created"`
		OwnedBy string `json:"owned_by"`
	}
	out := struct {
		Object string  `json:"object"`
		Data   []entry `json:"data"`
	}{Object: "list", Data: []entry{}}
	if id := rt.modelID(""); id != "" {
		out.Data = append(out.Data, entry{ID: id, Object: "model", OwnedBy: "kvhandoff"})
	}
	writeJSON(w, http.StatusOK, out)
}

// counted records an answered request's tokens.
func (rt *Router) counted(choices []choice, u usage) {
	rt.cfg.Metrics.requests.WithLabelValues("200").Inc()
	rt.cfg.Metrics.promptTok.Add(float64(u.PromptTokens))
	rt.cfg.Metrics.genTok.Add(float64(u.CompletionTokens))
}

// The streamed answer (stream: true). Each choice's tokens reach the router
// as the decode node generates them (Completion.Stream); the handler's
// goroutine, the only one that writes the response, turns them into text
// and sends each part as a server-sent event at once (flushed). What is
// held back is only what could still change: bytes that could begin a stop
// string, and an incomplete UTF-8 sequence at the end. The text a stream
// sends is the text the same request answers without streaming (a choice's
// end checks it against finish's).

// relayQueue carries a stream's choices' parts and ends from their legs'
// goroutines to the handler's. It holds at most what the choices generate
// (each bounded by max_tokens), and never blocks a leg.
type relayQueue struct {
	mu     sync.Mutex
	events []relayEvent
	wake   chan struct{}
}

type relayEvent struct {
	index int
	part  *Generated // tokens of choice index, or
	end   *choice    // its end, answered
}

func newRelayQueue() *relayQueue { return &relayQueue{wake: make(chan struct{}, 1)} }

func (q *relayQueue) push(e relayEvent) {
	q.mu.Lock()
	q.events = append(q.events, e)
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default: // a wake is pending: take reads everything then
	}
}

func (q *relayQueue) take() []relayEvent {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := q.events
	q.events = nil
	return out
}

// choiceStream is one choice's text as it streams: what was generated,
// and how much of it was sent.
type choiceStream struct {
	primed    bool   // prev is the prompt's last token
	begun     bool   // its first chunk was sent (echo, the chat role)
	ended     bool   // its finish_reason was sent
	eos       bool   // the end of sequence came: no more text
	prev      int    // the last token, for its successor's piece
	text      []byte // the generated text, up to the end of sequence
	starts    []int  // where each token's text starts in text
	sent      int    // bytes of text sent
	steps     []step // each token's logprobs, if asked for
	stepsSent int
	finish    string // "stop" once a stop string or the end of sequence ended it
}

// add takes generated tokens: their text, up to the end of sequence.
func (cs *choiceStream) add(tok llama.Tokenizer, g *Generated) {
	if !cs.primed && len(g.Prompt) > 0 {
		cs.prev, cs.primed = g.Prompt[len(g.Prompt)-1], true
	}
	for i, t := range g.Tokens {
		if cs.eos {
			return
		}
		if eos := tok.EOS(); eos >= 0 && t == eos {
			cs.eos = true
			return
		}
		if i < len(g.Logprobs) {
			cs.steps = append(cs.steps, stepOf(tok, cs.prev, g.Logprobs[i]))
		}
		cs.starts = append(cs.starts, len(cs.text))
		cs.text = append(cs.text, tok.Piece(cs.prev, t)...)
		cs.prev = t
	}
}

// release is how far the text may be sent now, and whether that ends the
// choice: at the first stop string, once no longer stop string could
// still begin before it; otherwise before the first bytes that could still
// begin a stop string and before an incomplete UTF-8 sequence at the end
// (whose bytes would each read as U+FFFD alone); all of it once no more
// text comes (final). Nothing before sent can begin a stop string: a byte
// is sent only once no stop string can start at it.
func (cs *choiceStream) release(stops []string, final bool) (upTo int, stopped bool) {
	text := cs.text
	match := -1
	for _, s := range stops {
		if at := bytes.Index(text[cs.sent:], []byte(s)); at >= 0 && (match < 0 || cs.sent+at < match) {
			match = cs.sent + at
		}
	}
	limit := len(text)
	if match >= 0 {
		limit = match
	}
	if !final {
		// The first position from which the rest of the text is a proper
		// prefix of a stop string: more text may complete it.
		longest := 0
		for _, s := range stops {
			longest = max(longest, len(s))
		}
		for q := max(cs.sent, len(text)-longest+1); q < limit; q++ {
			if slices.ContainsFunc(stops, func(s string) bool { return len(text)-q < len(s) && strings.HasPrefix(s, string(text[q:])) }) {
				limit, match = q, -1
				break
			}
		}
	}
	if match >= 0 {
		return match, true
	}
	if final {
		return len(text), false
	}
	// Whole runes only, as a decoder reads the whole text from its start.
	at := cs.sent
	for at < limit && utf8.FullRune(text[at:limit]) {
		_, w := utf8.DecodeRune(text[at:limit])
		at += w
	}
	return at, false
}

// tokensBefore is how many tokens' text starts before at (a stop's cut:
// the tokens the client is charged for, as finish counts them).
func (cs *choiceStream) tokensBefore(at int) int {
	n, _ := slices.BinarySearch(cs.starts, at)
	return n
}

// tokensWithin is how many tokens' text ends by at.
func (cs *choiceStream) tokensWithin(at int) int {
	n := cs.stepsSent
	for n < len(cs.starts) {
		end := len(cs.text)
		if n+1 < len(cs.starts) {
			end = cs.starts[n+1]
		}
		if end > at {
			break
		}
		n++
	}
	return n
}

// streamWriter writes one request's server-sent events.
type streamWriter struct {
	rt      *Router
	w       http.ResponseWriter
	s       *sse // nil until the first event: the status line waits for it
	p       genParams
	chat    bool
	id      string // the first handoff that streamed: cmpl- or chatcmpl- and its hex
	created int64
	model   string
	choices []*choiceStream
}

// streamAnswer answers a request with stream: true: the event stream's
// status line when the first choice has its first tokens (so that a
// failure before any, e.g. no node to place it on, is an HTTP error with
// its own status and Retry-After, and the headers can name the nodes
// serving it), then each choice's text as it is generated, its
// finish_reason when it ends, usage if asked for, [DONE]; a failure after
// the status line is an error event before [DONE]. The headers name the
// first choice's prefill and decode nodes; trailers name every choice's.
func (rt *Router) streamAnswer(w http.ResponseWriter, r *http.Request, prompts []prompt, p genParams, tenant clientTenant, chat bool) {
	sw := &streamWriter{rt: rt, w: w, p: p, chat: chat, created: time.Now().Unix(), model: rt.modelID(p.model)}
	for range len(prompts) * p.n {
		sw.choices = append(sw.choices, &choiceStream{})
	}
	relay := newRelayQueue()
	type ran struct {
		choices []choice
		err     error
	}
	done := make(chan ran, 1)
	// A client that stops reading is one that went: its request is
	// cancelled on both legs.
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	go func() {
		choices, err := rt.run(ctx, r, prompts, p, tenant, relay)
		done <- ran{choices, err}
	}()
	for {
		if sw.s != nil && sw.s.broken != nil {
			cancel()
			<-done
			rt.cfg.Metrics.requests.WithLabelValues("499").Inc()
			rt.cfg.Log.Info("request abandoned by its client: a write failed", "request_id", requestIDOf(r.Context()), "err", sw.s.broken)
			return
		}
		select {
		case <-relay.wake:
			sw.write(relay.take())
		case res := <-done:
			sw.write(relay.take())
			if res.err != nil {
				rt.failed(w, r, res.err, sw.s)
				return
			}
			u := usageOf(res.choices, p.n)
			rt.counted(res.choices, u)
			pre, dec := nodesOf(res.choices[:min(1, len(res.choices))])
			sw.begin(pre, dec)
			if p.includeUsage {
				sw.send(-1, "", nil, nil, &u)
			}
			sw.s.done()
			pre, dec = nodesOf(res.choices)
			w.Header().Set(http.TrailerPrefix+PrefillHeader, pre)
			w.Header().Set(http.TrailerPrefix+DecodeHeader, dec)
			return
		}
	}
}

func (sw *streamWriter) write(events []relayEvent) {
	for _, e := range events {
		if e.index < 0 || e.index >= len(sw.choices) {
			continue
		}
		cs := sw.choices[e.index]
		if cs.ended {
			continue // its stop came: the rest is not the client's
		}
		if sw.id == "" {
			h := protocol.RequestID(0)
			if e.part != nil {
				h = e.part.Handoff
				sw.begin(e.part.Prefill, e.part.Decode)
			} else {
				h = e.end.res.ID
				sw.begin(e.end.res.Prefill, e.end.res.Decode)
			}
			sw.id = strconv.FormatUint(uint64(h), 16)
			if sw.chat {
				sw.id = "chatcmpl-" + sw.id
			} else {
				sw.id = "cmpl-" + sw.id
			}
		}
		if e.part != nil {
			sw.part(e.index, cs, e.part)
		} else {
			sw.end(e.index, cs, e.end)
		}
	}
}

// begin sends the status line and the event-stream headers, naming the
// nodes of the choice that streamed first, unless they went already.
func (sw *streamWriter) begin(prefill, decode string) {
	if sw.s != nil {
		return
	}
	sw.w.Header().Set(PrefillHeader, prefill)
	sw.w.Header().Set(DecodeHeader, decode)
	sw.s = sw.rt.startStream(sw.w)
}

// part sends what a choice's new tokens release.
func (sw *streamWriter) part(i int, cs *choiceStream, g *Generated) {
	echo := ""
	if !cs.begun && sw.p.echo && !sw.chat {
		echo = sw.rt.promptText(Result{Prompt: g.Prompt})
	}
	cs.add(sw.rt.cfg.Tokenizer, g)
	upTo, stopped := cs.release(sw.p.stop, cs.eos)
	if stopped || cs.eos {
		cs.finish = "stop"
	}
	// The tokens whose logprobs go with this chunk: those whose text it
	// completes; at a stop, those whose text starts before it (finish's
	// count).
	var tokens int
	switch {
	case stopped:
		tokens = cs.tokensBefore(upTo)
	case cs.eos:
		tokens = len(cs.starts)
	default:
		tokens = cs.tokensWithin(upTo)
	}
	text := string(cs.text[cs.sent:upTo])
	if text != "" || echo != "" || (sw.chat && !cs.begun) {
		sw.text(i, cs, echo+text, cs.steps[min(cs.stepsSent, len(cs.steps)):min(tokens, len(cs.steps))])
		cs.stepsSent = max(cs.stepsSent, min(tokens, len(cs.steps)))
	}
	cs.sent = upTo
	if cs.finish != "" {
		cs.ended = true
		sw.send(i, cs.finish, nil, nil, nil)
	}
}

// end sends the rest of an answered choice and its finish_reason. The
// answer's text (finish's) begins with what was sent: a stream diverging
// from it is logged (a bug), and the rest still sent.
func (sw *streamWriter) end(i int, cs *choiceStream, c *choice) {
	sent := string(cs.text[:cs.sent])
	rest := ""
	if strings.HasPrefix(c.text, sent) {
		rest = c.text[len(sent):]
	} else {
		sw.rt.cfg.Log.Error("router: a stream's text is not the answer's", "choice", i, "sent", len(sent), "answer", len(c.text))
	}
	echo := ""
	if !cs.begun && sw.p.echo && !sw.chat {
		echo = sw.rt.promptText(c.res)
	}
	if steps := c.steps[min(cs.stepsSent, len(c.steps)):]; rest != "" || echo != "" || len(steps) > 0 || (sw.chat && !cs.begun) {
		sw.text(i, cs, echo+rest, steps)
	}
	cs.ended = true
	sw.send(i, c.finish, nil, nil, nil)
}

// text sends a chunk of choice i's text (its first: with the prompt if
// echo, the role in chat) and the logprobs of the tokens it completes.
func (sw *streamWriter) text(i int, cs *choiceStream, text string, steps []step) {
	var lp any
	if sw.p.logprobs != nil {
		if sw.chat {
			lp = stepsAsChat(steps)
		} else {
			offset := 0
			for _, st := range cs.steps[:min(cs.stepsSent, len(cs.steps))] {
				offset += len(st.text)
			}
			lp = stepsAsCompletion(steps, offset)
		}
	}
	sw.send(i, "", &text, lp, nil)
	cs.begun = true
}

// send writes one chunk: choice i's text, or its finish_reason, or (i < 0)
// the usage.
func (sw *streamWriter) send(i int, finish string, text *string, logprobs any, u *usage) {
	var fin *string
	if finish != "" {
		fin = &finish
	}
	if sw.chat {
		ev := chatResponse{ID: sw.id, Object: "chat.completion.chunk", Created: sw.created, Model: sw.model, Choices: []chatChoice{}, Usage: u}
		if i >= 0 {
			delta := &chatMessageOut{}
			if text != nil {
				delta.Content = *text
				if !sw.choices[i].begun {
					delta.Role = "assistant"
				}
			}
			ev.Choices = append(ev.Choices, chatChoice{Index: i, Delta: delta, Logprobs: logprobs, FinishReason: fin})
		}
		sw.s.send(ev)
		return
	}
	ev := completionResponse{ID: sw.id, Object: "text_completion", Created: sw.created, Model: sw.model, Choices: []completionChoice{}, Usage: u}
	if i >= 0 {
		c := completionChoice{Index: i, Logprobs: logprobs, FinishReason: fin}
		if text != nil {
			c.Text = *text
		}
		ev.Choices = append(ev.Choices, c)
	}
	sw.s.send(ev)
}
