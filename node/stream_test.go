package node

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// tokenGate holds a decode node's generation after its first token, for the
// first request that reaches it, until released; it records the most
// tokens any generation reached.
type tokenGate struct {
	armed   atomic.Bool
	held    chan protocol.RequestID
	release chan struct{}
	mu      sync.Mutex
	most    map[protocol.RequestID]int
}

func gateDecode(d *Decode) *tokenGate {
	g := &tokenGate{held: make(chan protocol.RequestID, 1), release: make(chan struct{}), most: map[protocol.RequestID]int{}}
	g.armed.Store(true)
	hook := func(id protocol.RequestID, generated int) {
		g.mu.Lock()
		g.most[id] = max(g.most[id], generated)
		g.mu.Unlock()
		if generated == 1 && g.armed.CompareAndSwap(true, false) {
			g.held <- id
			<-g.release
		}
	}
	d.tokenHook.Store(&hook)
	return g
}

func (g *tokenGate) generated(id protocol.RequestID) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.most[id]
}

// sseReader reads a server-sent event stream an event at a time.
type sseReader struct {
	t  *testing.T
	sc *bufio.Scanner
}

func newSSEReader(t *testing.T, body io.Reader) *sseReader {
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	return &sseReader{t: t, sc: sc}
}

// next is the next event's data (nil after [DONE]).
func (s *sseReader) next() map[string]any {
	s.t.Helper()
	for s.sc.Scan() {
		line, ok := strings.CutPrefix(s.sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			return nil
		}
		var ev map[string]any
		if err := json.Unmarshal([]byte(line), &ev); err != nil {
			s.t.Fatalf("event %q: %v", line, err)
		}
		return ev
	}
	s.t.Fatalf("the stream ended without [DONE]: %v", s.sc.Err())
	return nil
}

// textOf is a chunk's text for choice index (completions' text, chat's
// delta content), its finish_reason, and whether the chunk has the choice.
func textOf(ev map[string]any, index int) (text, finish string, ok bool) {
	chs, _ := ev["choices"].([]any)
	for _, c := range chs {
		c := c.(map[string]any)
		if i, _ := c["index"].(float64); int(i) != index {
			continue
		}
		text, _ = c["text"].(string)
		if d, _ := c["delta"].(map[string]any); d != nil {
			text, _ = d["content"].(string)
		}
		finish, _ = c["finish_reason"].(string)
		return text, finish, true
	}
	return "", "", false
}

func startStream(t *testing.T, ctx context.Context, l *Local, path string, body map[string]any) *http.Response {
	t.Helper()
	body["stream"] = true
	b, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(ctx, "POST", "http://"+l.API+path, bytes.NewReader(b))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("%s: %d %v", path, resp.StatusCode, resp.Header)
	}
	return resp
}

// A stream is incremental: with the decode node's generation held after
// its first token, the client has that token's text already, on both
// endpoints; released, the stream ends with the text the request answers
// without streaming. No timing: the generation cannot go on until the
// client has read the first chunk.
func TestStreamSendsTheFirstTokenWhileGenerationIsHeld(t *testing.T) {
	l := localBuiltin(t, LocalConfig{PrefillPages: 128, DecodePages: 128})
	const p = "the secret is QX7-zeta; again, the secret is "
	messages := []map[string]any{{"role": "user", "content": "the code is QX7-zeta; the code is QX7-zeta"}}
	for _, c := range []struct {
		path string
		body func() map[string]any
	}{
		{"/v1/completions", func() map[string]any { return map[string]any{"prompt": p, "max_tokens": 12} }},
		{"/v1/chat/completions", func() map[string]any { return map[string]any{"messages": messages, "max_tokens": 12} }},
	} {
		plain, _ := post(t, l, c.path, c.body())
		want := plain.Choices[0].Text + plain.Choices[0].Message.Content
		gate := gateDecode(l.Decodes[0])
		resp := startStream(t, context.Background(), l, c.path, c.body())
		id := <-gate.held
		events := newSSEReader(t, resp.Body)
		var text string
		for text == "" {
			ev := events.next()
			if ev == nil {
				t.Fatalf("%s: [DONE] before any text", c.path)
			}
			text, _, _ = textOf(ev, 0)
		}
		if n := gate.generated(id); text != want[:1] || n != 1 {
			t.Fatalf("%s: the first chunk %q with %d tokens generated; want %q after 1", c.path, text, n, want[:1])
		}
		close(gate.release)
		chunks, finish := 1, ""
		for ev := events.next(); ev != nil; ev = events.next() {
			s, f, ok := textOf(ev, 0)
			if ok && s != "" {
				chunks++
			}
			text += s
			finish = max(finish, f)
		}
		resp.Body.Close()
		if text != want || finish != "length" || chunks < 2 {
			t.Fatalf("%s: streamed %q in %d chunks, finish %q; want %q, length", c.path, text, chunks, finish, want)
		}
	}
	allPagesBack(t, l)
}

// What a stream sends equals what the request answers without streaming:
// n choices each with its own text, stop strings (a string, or several,
// one of them spanning tokens and one a false start whose held-back bytes
// are sent after all), finish_reason and usage in the last chunk.
func TestStreamEqualsTheAnswerWithoutStreaming(t *testing.T) {
	l := localBuiltin(t, LocalConfig{PrefillPages: 128, DecodePages: 128})
	const p = "the secret is QX7-zeta; again, the secret is "
	for _, body := range []map[string]any{
		{"prompt": p, "max_tokens": 12, "n": 2},
		{"prompt": p, "max_tokens": 12, "stop": "-ze"},
		{"prompt": p, "max_tokens": 12, "stop": []string{"-zz", "eta;"}},
		{"prompt": p, "max_tokens": 12, "stop": []string{"7-zeta; x", "ze"}},
		{"prompt": p, "max_tokens": 8, "echo": true},
		{"prompt": p, "max_tokens": 8, "logprobs": 2, "stop": "zeta"},
		{"prompt": []string{p, "the code is 42; the code is "}, "max_tokens": 4},
	} {
		plain, _ := post(t, l, "/v1/completions", body)
		body["stream_options"] = map[string]any{"include_usage": true}
		resp := startStream(t, context.Background(), l, "/v1/completions", body)
		events := newSSEReader(t, resp.Body)
		texts, finishes := map[int]string{}, map[int]string{}
		var usage map[string]any
		var lpTokens []string
		ids := map[string]bool{}
		for ev := events.next(); ev != nil; ev = events.next() {
			ids[ev["id"].(string)] = true
			for _, c := range ev["choices"].([]any) {
				lp, _ := c.(map[string]any)["logprobs"].(map[string]any)
				toks, _ := lp["tokens"].([]any)
				for _, tok := range toks {
					lpTokens = append(lpTokens, tok.(string))
				}
			}
			for i := range plain.Choices {
				if s, f, ok := textOf(ev, i); ok {
					if finishes[i] != "" {
						t.Fatalf("%v: choice %d has a chunk after its finish_reason: %v", body, i, ev)
					}
					texts[i] += s
					finishes[i] = f
				}
			}
			if u, ok := ev["usage"].(map[string]any); ok {
				usage = u
			}
		}
		resp.Body.Close()
		for i, c := range plain.Choices {
			if texts[i] != c.Text || finishes[i] != c.FinishReason {
				t.Fatalf("%v: choice %d streamed %q, %q; answered %q, %q", body, i, texts[i], finishes[i], c.Text, c.FinishReason)
			}
		}
		if usage == nil || usage["completion_tokens"] != float64(plain.Usage.CompletionTokens) || usage["prompt_tokens"] != float64(plain.Usage.PromptTokens) || len(ids) != 1 {
			t.Fatalf("%v: usage %v, ids %v; answered %+v", body, usage, ids, plain.Usage)
		}
		// Logprobs: one a token charged, their texts the tokens' (the
		// stop's token included, as finish counts it).
		if _, ok := body["logprobs"]; ok && (len(lpTokens) != plain.Usage.CompletionTokens || !strings.HasPrefix(strings.Join(lpTokens, ""), texts[0])) {
			t.Fatalf("%v: logprobs tokens %q for %q, %d tokens", body, lpTokens, texts[0], plain.Usage.CompletionTokens)
		}
	}
	allPagesBack(t, l)
}

// The stream's release rule, a token at a time: a stop string is cut where
// it begins even when it spans tokens; bytes that could begin a stop string
// wait, and go once they cannot; of two stop strings the one that begins
// first wins even if the other is complete first; an incomplete UTF-8
// sequence waits for its last byte. Each answer is finish's.
func TestStreamHoldsBackOnlyWhatCouldStillBeAStop(t *testing.T) {
	rt := &Router{cfg: RouterConfig{Tokenizer: llama.Bytes{}}}
	for _, c := range []struct {
		text    string
		stops   []string
		sends   []string // after each byte
		stopped bool
	}{
		{"ab-zc", []string{"-ze"}, []string{"a", "b", "", "", "-zc"}, false},
		{"ab-zed", []string{"-ze"}, []string{"a", "b", "", "", ""}, true},
		{"abcd", []string{"abcd", "c"}, []string{"", "", "", ""}, true},
		{"xabce", []string{"abcd", "c"}, []string{"x", "", "", "", "ab"}, true},
		{"é!", nil, []string{"", "é", "!"}, false},
	} {
		cs := &choiceStream{}
		prompt := []int{llama.BOS}
		var got []string
		stopped := false
		for _, b := range []byte(c.text) {
			cs.add(llama.Bytes{}, &Generated{Prompt: prompt, Tokens: []int{int(b)}})
			upTo, stop := cs.release(c.stops, false)
			got = append(got, string(cs.text[cs.sent:upTo]))
			cs.sent = upTo
			if stop {
				stopped = true
				break
			}
		}
		for len(got) < len(c.sends) {
			got = append(got, "")
		}
		if strings.Join(got, "|") != strings.Join(c.sends, "|") || stopped != c.stopped {
			t.Errorf("%q stops %q: sent %q, stopped %v; want %q, %v", c.text, c.stops, got, stopped, c.sends, c.stopped)
		}
		toks := llama.Bytes{}.Encode(c.text, false, false)
		whole := rt.finish(0, Result{Prompt: prompt, Tokens: toks}, c.stops)
		if sent := string(cs.text[:cs.sent]); !stopped {
			upTo, _ := cs.release(c.stops, true)
			if sent = string(cs.text[:upTo]); sent != whole.text {
				t.Errorf("%q stops %q: the stream's text %q, finish's %q", c.text, c.stops, sent, whole.text)
			}
		} else if sent != whole.text || whole.finish != "stop" || cs.tokensBefore(cs.sent) != whole.tokens {
			t.Errorf("%q stops %q: the stream stopped at %q (%d tokens), finish's %q %s (%d)", c.text, c.stops, sent, cs.tokensBefore(cs.sent), whole.text, whole.finish, whole.tokens)
		}
	}
}

// A failure after the stream began (the prefill node lost while the decode
// node's generation is held after its first token: the router fails the
// request) is an error event in the OpenAI shape, then [DONE]: the client
// has the first token and an explicit error, not a broken stream.
func TestStreamFailureAfterTheFirstTokenIsAnErrorEvent(t *testing.T) {
	l := localBuiltin(t, LocalConfig{PrefillPages: 128, DecodePages: 128})
	gate := gateDecode(l.Decodes[0])
	resp := startStream(t, context.Background(), l, "/v1/completions", map[string]any{"prompt": "the secret is QX7-zeta; again, the secret is ", "max_tokens": 12})
	defer resp.Body.Close()
	<-gate.held
	events := newSSEReader(t, resp.Body)
	var text string
	for text == "" {
		ev := events.next()
		if ev == nil {
			t.Fatal("[DONE] before any text")
		}
		text, _, _ = textOf(ev, 0)
	}
	if err := l.CrashPrefill(0); err != nil {
		t.Fatal(err)
	}
	var last map[string]any
	for ev := events.next(); ev != nil; ev = events.next() {
		last = ev
	}
	close(gate.release)
	e, ok := last["error"].(map[string]any)
	if !ok || e["type"] != "server_error" || !strings.HasPrefix(e["code"].(string), "handoff_failed_") || strings.Contains(e["message"].(string), "127.0.0.1") {
		t.Fatalf("after %q the stream ended with %v", text, last)
	}
	if _, f, _ := textOf(last, 0); f != "" {
		t.Fatalf("a finish_reason with the error: %v", last)
	}
}

// A client that disconnects mid-stream stops the decode node's generation
// at the next token: held after its first token of 200, the generation
// computes no token after the cancel (at most one may be: the step in
// flight), and every page comes back.
func TestStreamDisconnectStopsDecodeAtTheNextToken(t *testing.T) {
	l := localBuiltin(t, LocalConfig{PrefillPages: 128, DecodePages: 128})
	gate := gateDecode(l.Decodes[0])
	ctx, cancel := context.WithCancel(context.Background())
	resp := startStream(t, ctx, l, "/v1/completions", map[string]any{"prompt": "the secret is QX7-zeta; again, the secret is ", "max_tokens": 200})
	id := <-gate.held
	events := newSSEReader(t, resp.Body)
	for text := ""; text == ""; {
		text, _, _ = textOf(events.next(), 0)
	}
	cancel()
	resp.Body.Close()
	dm := l.Decodes[0].Metrics()
	waitUntil(t, "the decode leg to fail", func() bool {
		return counter(t, dm, "kvhandoff_handoff_failures_total", "reason", "cancelled") == 1
	})
	close(gate.release)
	allPagesBack(t, l)
	if n, after := gate.generated(id), metricValue(t, dm, "kvhandoff_decode_tokens_after_cancel_total"); n > 2 || after > 1 {
		t.Fatalf("generated %d of 200 tokens, %v after the cancel; want at most 1 after it", n, after)
	}
	waitUntil(t, "the router to count the client gone", func() bool {
		return counter(t, l.Router.Metrics(), "kvhandoff_client_requests_total", "code", "499") == 1
	})
}

// What a decode node streams is bounded by what the router asked for, not
// by the node's word: no more tokens than max_tokens over all its frames,
// none outside the vocabulary, log probabilities only when asked for and
// then one a token (or none at all, a node without a model); a frame
// breaking a bound fails the leg with ErrPeerFailed and is not kept.
func TestStreamedTokensAreBoundedByTheRequest(t *testing.T) {
	static, err := NewStatic()
	if err != nil {
		t.Fatal(err)
	}
	rt, err := NewRouter(RouterConfig{Registry: static, Security: Security{Insecure: true}, Log: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	two := 2
	lp := func(n int) []llama.TokenLogprob { return make([]llama.TokenLogprob, n) }
	for _, c := range []struct {
		what     string
		logprobs *int
		frames   []legAnswer
		ok       int // frames taken before the bad one (all: none bad)
	}{
		{"max_tokens over frames", nil, []legAnswer{{Tokens: []int{65, 66}}, {Tokens: []int{67, 68}}, {Tokens: []int{69}}}, 2},
		{"a token outside the vocabulary", nil, []legAnswer{{Tokens: []int{65}}, {Tokens: []int{256}}}, 1},
		{"a negative token", nil, []legAnswer{{Tokens: []int{-1}}}, 0},
		{"log probabilities not asked for", nil, []legAnswer{{Tokens: []int{65}, Logprobs: lp(1)}}, 0},
		{"fewer log probabilities than tokens", &two, []legAnswer{{Tokens: []int{65, 66}, Logprobs: lp(1)}}, 0},
		{"log probabilities stopping", &two, []legAnswer{{Tokens: []int{65}, Logprobs: lp(1)}, {Tokens: []int{66}}}, 1},
		{"log probabilities as asked", &two, []legAnswer{{Tokens: []int{65}, Logprobs: lp(1)}, {Tokens: []int{66, 67}, Logprobs: lp(2)}}, 2},
		{"none from a node without a model", &two, []legAnswer{{Tokens: []int{65}}, {Tokens: []int{66}}}, 2},
	} {
		var relayed []int
		q := &routed{prompt: []int{llama.BOS}, completion: Completion{MaxTokens: 4, Logprobs: c.logprobs,
			Stream: func(g Generated) { relayed = append(relayed, g.Tokens...) }}}
		rt.pending[7] = q
		taken := 0
		var err error
		for _, f := range c.frames {
			if err = rt.relay(7, "decode-0", q, f); err != nil {
				break
			}
			taken++
		}
		if taken != c.ok || (taken < len(c.frames)) != errors.Is(err, protocol.ErrPeerFailed) || len(relayed) != len(q.tokens) {
			t.Errorf("%s: %d frames taken (want %d), err %v, %d tokens relayed, %d kept", c.what, taken, c.ok, err, len(relayed), len(q.tokens))
		}
	}
	// A frame still buffered once its request has its outcome (a failed
	// attempt, which the router may be retrying) is neither kept nor
	// passed to the client.
	var relayed []int
	q := &routed{prompt: []int{llama.BOS}, completion: Completion{MaxTokens: 4, Stream: func(g Generated) { relayed = append(relayed, g.Tokens...) }}}
	delete(rt.pending, 7)
	if err := rt.relay(7, "decode-0", q, legAnswer{Tokens: []int{65}}); err != nil || len(relayed) != 0 || len(q.tokens) != 0 {
		t.Errorf("a frame after the outcome: err %v, %d tokens relayed, %d kept; want none", err, len(relayed), len(q.tokens))
	}
}

// A stop string ends the generation on the decode node: once the router
// has the stop's text it tells the node (enough), which generates no
// further token and answers with those it has, a success. Held after the
// token that completes "-ze" until the node has been told, the generation
// ends there: 6 tokens of 200, streamed or not, the answer cut at the stop.
func TestAStopStringEndsTheGenerationOnTheDecodeNode(t *testing.T) {
	l := localBuiltin(t, LocalConfig{PrefillPages: 128, DecodePages: 128})
	d := l.Decodes[0]
	var mu sync.Mutex
	most := map[protocol.RequestID]int{}
	hook := func(id protocol.RequestID, generated int) {
		mu.Lock()
		most[id] = max(most[id], generated)
		mu.Unlock()
		// (Not waitUntil: this is the decode node's goroutine. Past the
		// deadline the generation goes on, and the test fails on its count.)
		for deadline := time.Now().Add(30 * time.Second); generated == 6 && time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			d.mu.Lock()
			r := d.reqs[id]
			told := r == nil || r.enough.Load()
			d.mu.Unlock()
			if told {
				break
			}
		}
	}
	d.tokenHook.Store(&hook)
	for _, stream := range []bool{false, true} {
		body := map[string]any{"prompt": "the secret is QX7-zeta; again, the secret is ", "max_tokens": 200, "stop": "-ze"}
		var text, finish string
		if stream {
			resp := startStream(t, context.Background(), l, "/v1/completions", body)
			events := newSSEReader(t, resp.Body)
			for ev := events.next(); ev != nil; ev = events.next() {
				s, f, _ := textOf(ev, 0)
				text += s
				finish = max(finish, f)
			}
			resp.Body.Close()
		} else {
			out, _ := post(t, l, "/v1/completions", body)
			text, finish = out.Choices[0].Text, out.Choices[0].FinishReason
		}
		mu.Lock()
		var generated []int
		for id, n := range most {
			generated = append(generated, n)
			delete(most, id)
		}
		mu.Unlock()
		if text != "QX7" || finish != "stop" || len(generated) != 1 || generated[0] != 6 {
			t.Fatalf("stream %v: %q, %q, generated %v of 200 tokens; want QX7, stop, 6", stream, text, finish, generated)
		}
	}
	if s := counter(t, d.Metrics(), "kvhandoff_handoffs_total", "outcome", "success"); s != 2 {
		t.Fatalf("decode legs succeeded %v times; want 2", s)
	}
	allPagesBack(t, l)
}

// streamText is a streamed completion's text, finish_reason and text
// chunks, or an error (an error event, or no [DONE]).
func streamText(ctx context.Context, api, tenant, prompt string, maxTokens int) (text, finish string, chunks int, err error) {
	b, _ := json.Marshal(map[string]any{"prompt": prompt, "max_tokens": maxTokens, "stream": true})
	req, err := http.NewRequestWithContext(ctx, "POST", "http://"+api+"/v1/completions", bytes.NewReader(b))
	if err != nil {
		return "", "", 0, err
	}
	req.Header.Set(TenantHeader, tenant)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", "", 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			return text, finish, chunks, nil
		}
		var ev map[string]any
		if err := json.Unmarshal([]byte(line), &ev); err != nil {
			return "", "", 0, err
		}
		if e, ok := ev["error"]; ok {
			return "", "", 0, fmt.Errorf("an error event: %v", e)
		}
		s, f, _ := textOf(ev, 0)
		if s != "" {
			chunks++
		}
		text += s
		finish = max(finish, f)
	}
	return "", "", 0, fmt.Errorf("no [DONE]: %v", sc.Err())
}

// At a realistic size: 100 streamed completions from 16 clients through 2
// prefill and 2 decode nodes, each stream's text what one process running
// the same model answers, finish_reason length, every page back.
func TestStreamedCompletionsOverTheHandoffMatchAColocatedRun(t *testing.T) {
	m := llama.Builtin(5)
	l, err := StartLocal(LocalConfig{Prefills: 2, Decodes: 2, PrefillPages: 160, DecodePages: 160, PageTokens: 16, Model: m, Timeout: 2 * time.Minute, Log: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	requests, clients := 100, 16
	if testing.Short() {
		requests = 40
	}
	ps := prompts(requests, 2)
	want := make([]string, len(ps))
	for i, p := range ps {
		want[i] = asJSONText(colocated(t, m, 16, p, 8+i%9))
	}
	var wg sync.WaitGroup
	errs := make(chan error, requests)
	next := make(chan int, requests)
	for i := range ps {
		next <- i
	}
	close(next)
	var chunks atomic.Int64
	for range clients {
		wg.Go(func() {
			for i := range next {
				text, finish, n, err := streamText(context.Background(), l.API, fmt.Sprintf("tenant-%d", i%7), ps[i], 8+i%9)
				chunks.Add(int64(n))
				switch {
				case err != nil:
					errs <- fmt.Errorf("request %d: %v", i, err)
				case text != want[i] || finish != "length":
					errs <- fmt.Errorf("request %d: %q (%s) streamed, %q colocated", i, text, finish, want[i])
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	t.Logf("%d streams, %d text chunks", requests, chunks.Load())
	allPagesBack(t, l)
}

// A stream's headers name the prefill and decode nodes of its first choice,
// as a response without streaming names them, and its trailers name every
// choice's: the status line waits for the first tokens, once the nodes are
// chosen.
func TestStreamNamesItsNodesInHeadersAndTrailers(t *testing.T) {
	l := localBuiltin(t, LocalConfig{PrefillPages: 128, DecodePages: 128, Prefills: 2, Decodes: 2})
	resp := startStream(t, context.Background(), l, "/v1/completions", map[string]any{"prompt": []string{"the secret is ", "again, the code is "}, "n": 2, "max_tokens": 6})
	defer resp.Body.Close()
	pre, dec := resp.Header.Get(PrefillHeader), resp.Header.Get(DecodeHeader)
	if !strings.HasPrefix(pre, "prefill-") || !strings.HasPrefix(dec, "decode-") || strings.Contains(pre, ",") || strings.Contains(dec, ",") {
		t.Fatalf("headers %s=%q %s=%q: want the first choice's one prefill and one decode node", PrefillHeader, pre, DecodeHeader, dec)
	}
	events := newSSEReader(t, resp.Body)
	for ev := events.next(); ev != nil; ev = events.next() {
	}
	io.Copy(io.Discard, resp.Body) // trailers come after the body
	tpre, tdec := resp.Trailer.Get(PrefillHeader), resp.Trailer.Get(DecodeHeader)
	if !strings.Contains(tpre, pre) || !strings.Contains(tdec, dec) {
		t.Fatalf("trailers %s=%q %s=%q do not name the headers' nodes %q, %q", PrefillHeader, tpre, DecodeHeader, tdec, pre, dec)
	}
	for _, n := range append(strings.Split(tpre, ","), strings.Split(tdec, ",")...) {
		if !strings.HasPrefix(n, "prefill-") && !strings.HasPrefix(n, "decode-") {
			t.Fatalf("trailers %q, %q: %q is no node", tpre, tdec, n)
		}
	}
}

// A stream that fails before its first token is an HTTP error with its own
// status, not a 200 whose only event is an error: with no prefill node to
// place it on, the client gets the 503 with Retry-After that it retries.
func TestStreamFailureBeforeAnyTokenIsAnHTTPError(t *testing.T) {
	l := localBuiltin(t, LocalConfig{PrefillPages: 128, DecodePages: 128})
	if err := l.CrashPrefill(0); err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(map[string]any{"prompt": "the secret is ", "max_tokens": 6, "stream": true})
	resp, err := http.Post("http://"+l.API+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" || resp.Header.Get("Content-Type") == "text/event-stream" {
		t.Fatalf("%d %v %s: want a 503 with Retry-After, not an event stream", resp.StatusCode, resp.Header, body)
	}
	var e struct {
		Error struct{ Code string } `json:"error"`
	}
	if err := json.Unmarshal(body, &e); err != nil || e.Error.Code == "" {
		t.Fatalf("body %s: not an OpenAI error (%v)", body, err)
	}
}

// A stream whose client stops reading is a client gone: past the write
// timeout its write fails, and the request is cancelled on both legs, the
// decode node's generation stopped at the next token. With a write timeout
// of a nanosecond no write can succeed: the status line's fails at once.
func TestStreamToAClientThatStopsReadingIsCancelledAtTheWriteTimeout(t *testing.T) {
	l := localBuiltin(t, LocalConfig{PrefillPages: 128, DecodePages: 128, HTTP: HTTPLimits{WriteTimeout: time.Nanosecond}})
	gate := gateDecode(l.Decodes[0])
	b, _ := json.Marshal(map[string]any{"prompt": "the secret is QX7-zeta; again, the secret is ", "max_tokens": 200, "stream": true})
	answered := make(chan error, 1)
	go func() {
		resp, err := http.Post("http://"+l.API+"/v1/completions", "application/json", bytes.NewReader(b))
		if err == nil {
			_, err = io.ReadAll(resp.Body)
			resp.Body.Close()
		}
		answered <- err
	}()
	id := <-gate.held
	// The first token's status line could not be written: the request is
	// cancelled while its generation is held after that token.
	waitUntil(t, "the router to count the client gone", func() bool {
		return counter(t, l.Router.Metrics(), "kvhandoff_client_requests_total", "code", "499") == 1
	})
	// The router's cancel reaches the decode node a moment later (a call,
	// or its leg's call closed): released before, the generation ran on
	// until it came (4 tokens in a loaded CI run).
	d := l.Decodes[0]
	waitUntil(t, "the decode node told of the cancel", func() bool {
		d.mu.Lock()
		defer d.mu.Unlock()
		r := d.reqs[id]
		return r == nil || r.halted.Load()
	})
	close(gate.release)
	dm := l.Decodes[0].Metrics()
	waitUntil(t, "the decode leg to fail", func() bool {
		return counter(t, dm, "kvhandoff_handoff_failures_total", "reason", "cancelled") == 1
	})
	allPagesBack(t, l)
	if n, after := gate.generated(id), metricValue(t, dm, "kvhandoff_decode_tokens_after_cancel_total"); n > 2 || after > 1 {
		t.Fatalf("generated %d of 200 tokens, %v after the cancel; want at most 1 after it", n, after)
	}
	if err := <-answered; err == nil {
		t.Fatal("the client read a whole answer through writes that cannot succeed")
	}
}
