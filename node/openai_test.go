package node

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"math"
	"net/http"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/transfer"
)

type apiAnswer struct {
	code   int
	header http.Header
	raw    []byte
	body   map[string]any
}

func call(t *testing.T, method, url string, body any, header map[string]string) apiAnswer {
	t.Helper()
	var r io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			t.Fatal(err)
		}
		r = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, url, r)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	a := apiAnswer{code: resp.StatusCode, header: resp.Header}
	a.raw, _ = io.ReadAll(resp.Body)
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") {
		if err := json.Unmarshal(a.raw, &a.body); err != nil {
			t.Fatalf("%s %s: %d %q: %v", method, url, a.code, a.raw, err)
		}
	}
	return a
}

// errorOf is an error body's error object, or a test failure if the body
// is not one in the OpenAI shape.
func errorOf(t *testing.T, a apiAnswer) map[string]any {
	t.Helper()
	e, ok := a.body["error"].(map[string]any)
	if !ok {
		t.Fatalf("status %d: not an OpenAI error body: %q", a.code, a.raw)
	}
	for _, k := range []string{"message", "type", "code"} {
		if _, ok := e[k].(string); !ok {
			t.Fatalf("error body without a string %s: %q", k, a.raw)
		}
	}
	if _, ok := e["param"]; !ok {
		t.Fatalf("error body without param: %q", a.raw)
	}
	return e
}

// Every error the client API gives is an OpenAI-shaped JSON body with a
// stable code, every answer carries X-Request-Id, a 503 carries
// Retry-After, and no error body holds an address or an error chain (a
// failed handoff's detail is in the log, under the request id).
func TestErrorsAreOpenAIShapedAndNameNoInternals(t *testing.T) {
	// Nodes the router cannot reach: their calls fail to connect.
	_, api := frontDoor(t, HTTPLimits{}, 1024)
	base := "http://" + api
	cases := []struct {
		method, path string
		body         any
		status       int
		code, param  string
	}{
		{"GET", "/v1/nothing", nil, 404, "not_found", ""},
		{"GET", "/v1/completions", nil, 405, "method_not_allowed", ""},
		{"POST", "/v1/completions", map[string]any{"prompt": "hi", "frobnicate": 1}, 400, "unsupported_parameter", "frobnicate"},
		{"POST", "/v1/completions", map[string]any{"prompt": "hi", "logprobs": 9}, 400, "invalid_value", "logprobs"},
		{"POST", "/v1/completions", map[string]any{"prompt": "hi", "logprobs": 2, "echo": true}, 400, "unsupported_parameter", "echo"},
		{"POST", "/v1/completions", map[string]any{"prompt": "hi", "suffix": "x"}, 400, "unsupported_parameter", "suffix"},
		{"POST", "/v1/completions", map[string]any{"prompt": "hi", "presence_penalty": 0.5}, 400, "unsupported_parameter", "presence_penalty"},
		{"POST", "/v1/completions", map[string]any{"prompt": "hi", "max_tokens": 0}, 400, "invalid_value", "max_tokens"},
		{"POST", "/v1/completions", map[string]any{"prompt": "hi", "n": 99}, 400, "invalid_value", "n"},
		{"POST", "/v1/completions", map[string]any{"prompt": "hi", "stop": []string{"a", "b", "c", "d", "e"}}, 400, "invalid_value", "stop"},
		{"POST", "/v1/completions", map[string]any{"prompt": 7}, 400, "invalid_prompt", "prompt"},
		{"POST", "/v1/completions", map[string]any{"prompt": "hi", "model": "gpt-4"}, 400, "model_not_found", "model"},
		{"POST", "/v1/completions", map[string]any{"prompt": []int{65, 300}}, 400, "invalid_prompt", "prompt"},
		{"POST", "/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "user", "content": "hi"}}, "tools": []any{map[string]any{"type": "function"}}}, 400, "unsupported_parameter", "tools"},
		{"POST", "/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "wizard", "content": "hi"}}}, 400, "invalid_value", "messages"},
		{"POST", "/v1/completions", map[string]any{"prompt": "hi", "max_tokens": 2}, 503, "handoff_failed_peer", ""},
	}
	for _, c := range cases {
		a := call(t, c.method, base+c.path, c.body, nil)
		e := errorOf(t, a)
		param, _ := e["param"].(string)
		if a.code != c.status || e["code"] != c.code || param != c.param {
			t.Errorf("%s %s %v: %d %q; want %d code %q param %q", c.method, c.path, c.body, a.code, a.raw, c.status, c.code, c.param)
		}
		if a.header.Get(RequestIDHeader) == "" {
			t.Errorf("%s %s: no %s", c.method, c.path, RequestIDHeader)
		}
		if (a.code == 503) != (a.header.Get("Retry-After") != "") {
			t.Errorf("%s %s: %d with Retry-After %q", c.method, c.path, a.code, a.header.Get("Retry-After"))
		}
		if msg := e["message"].(string); strings.Contains(msg, "127.0.0.1") || strings.Contains(msg, "dial tcp") || strings.Contains(msg, "node: ") || strings.Contains(msg, "protocol: ") {
			t.Errorf("%s %s: the message names internals: %q", c.method, c.path, msg)
		}
	}
	// Without a trusted proxy a client's id is not taken; each answer has its own.
	a := call(t, "GET", base+"/healthz", nil, map[string]string{RequestIDHeader: "client-chosen"})
	b := call(t, "GET", base+"/healthz", nil, nil)
	if id := a.header.Get(RequestIDHeader); id == "client-chosen" || id == b.header.Get(RequestIDHeader) || len(id) != 32 {
		t.Fatalf("request ids %q and %q", id, b.header.Get(RequestIDHeader))
	}
}

// Behind a trusted front proxy (RouterConfig.TrustRequestID) its well-formed
// X-Request-Id is the request's; a malformed one is replaced.
func TestTrustedProxysRequestIDIsHonoured(t *testing.T) {
	rt, api := frontDoor(t, HTTPLimits{}, 0)
	rt.cfg.TrustRequestID = true
	for id, want := range map[string]bool{"proxy-42:eu": true, "bad id": false, strings.Repeat("x", 200): false} {
		req, _ := http.NewRequest("GET", "http://"+api+"/healthz", nil)
		req.Header[RequestIDHeader] = []string{id}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if got := resp.Header.Get(RequestIDHeader); (got == id) != want || got == "" {
			t.Fatalf("proxy id %q: answered with %q", id, got)
		}
	}
}

// /healthz says the router is alive whatever it knows; /readyz says it can
// place a request: 503 (with Retry-After) without a live prefill or decode
// node, or while it drains.
func TestReadyzNeedsANodeOfEachRoleAndNoDrain(t *testing.T) {
	rt, api := frontDoor(t, HTTPLimits{}, 0)
	base := "http://" + api
	if a := call(t, "GET", base+"/healthz", nil, nil); a.code != 200 {
		t.Fatalf("healthz: %d %q", a.code, a.raw)
	}
	a := call(t, "GET", base+"/readyz", nil, nil)
	if e := errorOf(t, a); a.code != 503 || e["code"] != "not_ready" || !strings.Contains(e["message"].(string), "no live prefill node") || a.header.Get("Retry-After") == "" {
		t.Fatalf("readyz with no node: %d %q", a.code, a.raw)
	}
	for _, m := range []Member{{Name: "prefill-0", Role: RolePrefill}, {Name: "decode-0", Role: RoleDecode}} {
		m.Control, m.PoolPages, m.PageTokens, m.ContextTokens, m.Model, m.Incarnation = "127.0.0.1:1", 64, 16, 1024, "m", 1
		rt.change(Change{Kind: Joined, Member: m})
	}
	if a := call(t, "GET", base+"/readyz", nil, nil); a.code != 200 {
		t.Fatalf("readyz with both roles: %d %q", a.code, a.raw)
	}
	rt.change(Change{Kind: Lost, Member: Member{Name: "prefill-0", Role: RolePrefill, Model: "m"}})
	if a := call(t, "GET", base+"/readyz", nil, nil); a.code != 503 {
		t.Fatalf("readyz with the prefill node lost: %d %q", a.code, a.raw)
	}
	rt.change(Change{Kind: Joined, Member: Member{Name: "prefill-0", Role: RolePrefill, Control: "127.0.0.1:1", PoolPages: 64, PageTokens: 16, ContextTokens: 1024, Model: "m", Incarnation: 2}})
	if a := call(t, "GET", base+"/readyz", nil, nil); a.code != 200 {
		t.Fatalf("readyz with the prefill node back: %d %q", a.code, a.raw)
	}
	rt.flight.drain()
	a = call(t, "GET", base+"/readyz", nil, nil)
	if e := errorOf(t, a); a.code != 503 || !strings.Contains(e["message"].(string), "draining") {
		t.Fatalf("readyz while draining: %d %q", a.code, a.raw)
	}
}

// localBuiltin is a deployment of the built-in model.
func localBuiltin(t *testing.T, cfg LocalConfig) *Local {
	t.Helper()
	cfg.Model, cfg.Log = llama.Builtin(1), quietLog()
	if cfg.PageTokens == 0 {
		cfg.PageTokens = 16
	}
	l, err := StartLocal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Stop)
	return l
}

type completionOut struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Choices []struct {
		Text         string `json:"text"`
		Index        int    `json:"index"`
		FinishReason string `json:"finish_reason"`
		Message      struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
	} `json:"choices"`
	Usage struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
		TotalTokens      int `json:"total_tokens"`
	} `json:"usage"`
}

// asJSONText is s as a JSON string carries it: each byte that is not UTF-8
// is U+FFFD.
func asJSONText(s string) string {
	var b strings.Builder
	for len(s) > 0 {
		r, n := utf8.DecodeRuneInString(s)
		if r == utf8.RuneError && n == 1 {
			b.WriteRune(utf8.RuneError)
		} else {
			b.WriteString(s[:n])
		}
		s = s[n:]
	}
	return b.String()
}

// colocatedSampled is what one process samples for prompt with s.
func colocatedSampled(t *testing.T, prompt string, n int, s *llama.Sampler) string {
	t.Helper()
	m := llama.Builtin(1)
	toks := llama.Bytes{}.Encode(prompt, true, false)
	g := engine.GeometryOf(m.Config, 16)
	cache, err := kv.New(g, g.PagesFor(len(toks)+n))
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.New(m, cpu.New(), cache, engine.Options{})
	if err != nil {
		t.Fatal(err)
	}
	refs, err := cache.Pool().Allocate(1, g.PagesFor(len(toks)+n))
	if err != nil {
		t.Fatal(err)
	}
	out, err := e.Generate(kv.Table(refs), toks, n, s, -1)
	if err != nil {
		t.Fatal(err)
	}
	return llama.Decode(llama.Bytes{}, out, toks[len(toks)-1])
}

func post(t *testing.T, l *Local, path string, body map[string]any) (completionOut, apiAnswer) {
	t.Helper()
	a := call(t, "POST", "http://"+l.API+path, body, nil)
	if a.code != 200 {
		t.Fatalf("%s %v: %d %q", path, body, a.code, a.raw)
	}
	var out completionOut
	if err := json.Unmarshal(a.raw, &out); err != nil {
		t.Fatal(err)
	}
	return out, a
}

// Every parameter is honoured: n choices, stop strings (a string or an
// array) cut the text with finish_reason "stop", max_tokens and the context
// window with "length", prompts as an array of strings (a choice each) or
// token ids (the same answer as the text), echo, and seeded sampling
// (the same seed the same text; greedy, the default, exact).
func TestEveryParameterIsHonoured(t *testing.T) {
	l := localBuiltin(t, LocalConfig{PrefillPages: 128, DecodePages: 128})
	const p = "the secret is QX7-zeta; again, the secret is "
	greedy, _ := post(t, l, "/v1/completions", map[string]any{"prompt": p, "max_tokens": 12})
	want := colocated(t, llama.Builtin(1), 16, p, 12)
	if len(greedy.Choices) != 1 || greedy.Choices[0].Text != want || greedy.Choices[0].FinishReason != "length" || greedy.Usage.CompletionTokens != 12 {
		t.Fatalf("greedy: %+v; want %q, length", greedy, want)
	}
	if !strings.HasPrefix(want, "QX7-zeta") {
		t.Fatalf("the built-in model's answer %q does not copy the secret", want)
	}

	two, a := post(t, l, "/v1/completions", map[string]any{"prompt": p, "max_tokens": 12, "n": 2})
	if len(two.Choices) != 2 || two.Choices[0].Text != want || two.Choices[1].Text != want || two.Choices[1].Index != 1 || two.Usage.CompletionTokens != 24 {
		t.Fatalf("n 2: %+v", two)
	}
	if a.header.Get(PrefillHeader) == "" || a.header.Get(DecodeHeader) == "" || a.header.Get(RequestIDHeader) == "" || !strings.HasPrefix(two.ID, "cmpl-") {
		t.Fatalf("provenance headers: %v, id %q", a.header, two.ID)
	}

	for _, stop := range []any{"-", []string{"zz", "-ze"}} {
		s, _ := post(t, l, "/v1/completions", map[string]any{"prompt": p, "max_tokens": 12, "stop": stop})
		if c := s.Choices[0]; c.Text != "QX7" || c.FinishReason != "stop" || s.Usage.CompletionTokens != 3 {
			t.Fatalf("stop %v: %+v", stop, s)
		}
	}

	arr, _ := post(t, l, "/v1/completions", map[string]any{"prompt": []string{p, "the code is 42; the code is "}, "max_tokens": 2})
	if len(arr.Choices) != 2 || arr.Choices[0].Text != want[:2] || arr.Choices[1].Text != "42" {
		t.Fatalf("an array of prompts: %+v", arr)
	}
	toks := llama.Bytes{}.Encode(p, false, false)
	byTokens, _ := post(t, l, "/v1/completions", map[string]any{"prompt": toks, "max_tokens": 12})
	if byTokens.Choices[0].Text != want || byTokens.Usage.PromptTokens != greedy.Usage.PromptTokens {
		t.Fatalf("token ids: %+v", byTokens)
	}
	echo, _ := post(t, l, "/v1/completions", map[string]any{"prompt": p, "max_tokens": 12, "echo": true})
	if echo.Choices[0].Text != p+want {
		t.Fatalf("echo: %q", echo.Choices[0].Text)
	}

	// Seeded sampling: the text a colocated run samples with the same
	// seed, and other seeds sample other texts.
	sampled := func(seed int) string {
		s, _ := post(t, l, "/v1/completions", map[string]any{"prompt": "hello", "max_tokens": 24, "temperature": 1.5, "top_p": 0.95, "seed": seed})
		return s.Choices[0].Text
	}
	texts := map[string]bool{}
	for seed := 1; seed <= 4; seed++ {
		got := sampled(seed)
		if want := asJSONText(colocatedSampled(t, "hello", 24, llama.NewSampler(1.5, 0.95, uint64(seed)))); got != want {
			t.Fatalf("seed %d sampled %q; a colocated run samples %q", seed, got, want)
		}
		texts[got] = true
	}
	if len(texts) < 3 {
		t.Fatalf("four seeds sampled %d texts: %v", len(texts), texts)
	}

	// The context window: the built-in model's 1,024 positions cut a
	// 1,000-token prompt's 100 tokens to 25 (the last prompt position
	// predicts the first): "length".
	long := strings.Repeat("abcdefghij", 100)[:999]
	cut, _ := post(t, l, "/v1/completions", map[string]any{"prompt": long, "max_tokens": 100})
	if c := cut.Choices[0]; c.FinishReason != "length" || cut.Usage.CompletionTokens != 1024-1000+1 {
		t.Fatalf("a context-cut answer: %q, %d tokens", c.FinishReason, cut.Usage.CompletionTokens)
	}
	allPagesBack(t, l)
}

// sseEvents reads a server-sent event stream's data lines up to [DONE].
func sseEvents(t *testing.T, r io.Reader) []map[string]any {
	t.Helper()
	events := newSSEReader(t, r)
	var out []map[string]any
	for ev := events.next(); ev != nil; ev = events.next() {
		out = append(out, ev)
	}
	return out
}

// /v1/models lists the deployment's model; chat completions run the
// conversation through the chat template; both endpoints stream by
// server-sent events the text they answer without streaming, with usage in
// a last chunk when asked.
func TestChatModelsAndStreaming(t *testing.T) {
	l := localBuiltin(t, LocalConfig{PrefillPages: 128, DecodePages: 128})
	models := call(t, "GET", "http://"+l.API+"/v1/models", nil, nil)
	data, _ := models.body["data"].([]any)
	if models.code != 200 || len(data) != 1 || data[0].(map[string]any)["id"] != l.Router.modelID("") {
		t.Fatalf("models: %d %q", models.code, models.raw)
	}
	messages := []map[string]any{{"role": "system", "content": "repeat the code"}, {"role": "user", "content": []map[string]any{{"type": "text", "text": "the code is QX7-zeta; the code is QX7-zeta"}}}}
	chat, _ := post(t, l, "/v1/chat/completions", map[string]any{"messages": messages, "max_tokens": 8})
	want := colocated(t, llama.Builtin(1), 16, PlainChat([]ChatMessage{{"system", "repeat the code"}, {"user", "the code is QX7-zeta; the code is QX7-zeta"}}), 8)
	if chat.Object != "chat.completion" || len(chat.Choices) != 1 || chat.Choices[0].Message.Role != "assistant" || chat.Choices[0].Message.Content != want {
		t.Fatalf("chat: %+v; want %q", chat, want)
	}
	p := "the secret is QX7-zeta; again, the secret is "
	plain, _ := post(t, l, "/v1/completions", map[string]any{"prompt": p, "max_tokens": 10})
	for _, c := range []struct {
		path string
		body map[string]any
		want string
		text func(map[string]any) string
	}{
		{"/v1/completions", map[string]any{"prompt": p, "max_tokens": 10}, plain.Choices[0].Text, func(ch map[string]any) string { s, _ := ch["text"].(string); return s }},
		{"/v1/chat/completions", map[string]any{"messages": messages, "max_tokens": 8}, want, func(ch map[string]any) string {
			d, _ := ch["delta"].(map[string]any)
			s, _ := d["content"].(string)
			return s
		}},
	} {
		c.body["stream"] = true
		c.body["stream_options"] = map[string]any{"include_usage": true}
		b, _ := json.Marshal(c.body)
		resp, err := http.Post("http://"+l.API+c.path, "application/json", bytes.NewReader(b))
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
			t.Fatalf("%s stream: %d %v", c.path, resp.StatusCode, resp.Header)
		}
		events := sseEvents(t, resp.Body)
		resp.Body.Close()
		var text, finish string
		var usage map[string]any
		for _, ev := range events {
			for _, ch := range ev["choices"].([]any) {
				ch := ch.(map[string]any)
				text += c.text(ch)
				if f, ok := ch["finish_reason"].(string); ok {
					finish = f
				}
			}
			if u, ok := ev["usage"].(map[string]any); ok {
				usage = u
			}
		}
		if text != c.want || finish != "length" || usage == nil || usage["completion_tokens"] != float64(c.body["max_tokens"].(int)) {
			t.Fatalf("%s stream: text %q finish %q usage %v; want %q", c.path, text, finish, usage, c.want)
		}
	}
	allPagesBack(t, l)
}

// A stream's client that disconnects before the answer (the prefill
// node's KV computation held, the status line not yet sent) cancels the request on both legs: neither
// leg succeeds, and every page comes back.
func TestStreamDisconnectCancelsBothLegs(t *testing.T) {
	var hold *holdKV
	l, err := StartLocal(LocalConfig{PrefillPages: 64, DecodePages: 64, PageTokens: 16, Log: quietLog(),
		prefillKV: func(_ int, src transfer.KVSource) transfer.KVSource {
			hold = &holdKV{src: src, armed: true, held: make(chan protocol.RequestID, 1), release: make(chan struct{})}
			return hold
		}})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	ctx, cancel := context.WithCancel(context.Background())
	b, _ := json.Marshal(map[string]any{"prompt": strings.Repeat("a long prompt. ", 30), "max_tokens": 64, "stream": true})
	req, _ := http.NewRequestWithContext(ctx, "POST", "http://"+l.API+"/v1/completions", bytes.NewReader(b))
	// The status line waits for the first tokens: the client goes while it
	// waits, the request on the prefill node.
	gone := make(chan error, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
			err = errors.New("an answer (" + resp.Status + ") to a request held on its prefill node")
		}
		gone <- err
	}()
	<-hold.held
	waitUntil(t, "the decode leg's call", func() bool { return len(l.Decodes[0].snapshot()) == 1 })
	cancel()
	if err := <-gone; !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
	waitUntil(t, "the prefill node's cancel call", func() bool { return l.Prefills[0].cancels.Load() == 1 })
	close(hold.release)
	for _, check := range []struct {
		m    *Metrics
		role string
	}{{l.Prefills[0].Metrics(), "prefill"}, {l.Decodes[0].Metrics(), "decode"}} {
		waitUntil(t, "the "+check.role+" leg to fail", func() bool {
			return counter(t, check.m, "kvhandoff_handoff_failures_total", "role", check.role) == 1
		})
		if s := counter(t, check.m, "kvhandoff_handoffs_total", "outcome", "success"); s != 0 {
			t.Fatalf("the %s leg succeeded %v times", check.role, s)
		}
	}
	waitUntil(t, "the router to count the client gone", func() bool {
		return counter(t, l.Router.Metrics(), "kvhandoff_client_requests_total", "code", "499") == 1
	})
	allPagesBack(t, l)
}

// logprobs are the decode node's: each generated token's log probability
// under the model and the most likely tokens', what a colocated run records
// for the same prompt; the tokens spell the text; greedy stays greedy. (The
// legacy shape keys top_logprobs by text: byte tokens that are not UTF-8
// all read U+FFFD in JSON, and the first of them is kept.)
func TestLogprobsAreTheModelsOwn(t *testing.T) {
	l := localBuiltin(t, LocalConfig{PrefillPages: 128, DecodePages: 128})
	const p = "the secret is QX7-zeta; again, the secret is "
	a := call(t, "POST", "http://"+l.API+"/v1/completions", map[string]any{"prompt": p, "max_tokens": 8, "logprobs": 3}, nil)
	var out struct {
		Choices []struct {
			Text     string `json:"text"`
			Logprobs struct {
				Tokens        []string             `json:"tokens"`
				TokenLogprobs []float64            `json:"token_logprobs"`
				TopLogprobs   []map[string]float64 `json:"top_logprobs"`
				TextOffset    []int                `json:"text_offset"`
			} `json:"logprobs"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(a.raw, &out); a.code != 200 || err != nil {
		t.Fatalf("%d %q %v", a.code, a.raw, err)
	}
	c := out.Choices[0]
	if c.Text != "QX7-zeta" || strings.Join(c.Logprobs.Tokens, "") != c.Text || len(c.Logprobs.TokenLogprobs) != 8 || len(c.Logprobs.TopLogprobs) != 8 || c.Logprobs.TextOffset[7] != 7 {
		t.Fatalf("logprobs of %q: %+v", c.Text, c.Logprobs)
	}
	s := llama.Greedy().RecordLogprobs(3)
	colocatedSampled(t, p, 8, s)
	for i, want := range s.Logprobs.Tokens {
		got := c.Logprobs.TokenLogprobs[i]
		if math.Abs(got-float64(want.Logprob)) > 1e-4 || got > 0 || len(c.Logprobs.TopLogprobs[i]) == 0 || len(c.Logprobs.TopLogprobs[i]) > 3 || math.Abs(c.Logprobs.TopLogprobs[i][c.Logprobs.Tokens[i]]-got) > 1e-6 {
			t.Fatalf("token %d: logprob %v, top %v; a colocated run records %+v", i, got, c.Logprobs.TopLogprobs[i], want)
		}
	}
	chat := call(t, "POST", "http://"+l.API+"/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "user", "content": p}}, "max_tokens": 4, "logprobs": true, "top_logprobs": 2}, nil)
	var cout struct {
		Choices []struct {
			Logprobs struct {
				Content []struct {
					Token       string  `json:"token"`
					Logprob     float64 `json:"logprob"`
					Bytes       []int   `json:"bytes"`
					TopLogprobs []struct {
						Token string `json:"token"`
					} `json:"top_logprobs"`
				} `json:"content"`
			} `json:"logprobs"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(chat.raw, &cout); chat.code != 200 || err != nil {
		t.Fatalf("chat: %d %q %v", chat.code, chat.raw, err)
	}
	if content := cout.Choices[0].Logprobs.Content; len(content) != 4 || len(content[0].TopLogprobs) != 2 || len(content[0].Bytes) != len(content[0].Token) {
		t.Fatalf("chat logprobs: %q", chat.raw)
	}
	allPagesBack(t, l)
}
