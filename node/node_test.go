package node

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/transfer"
)

func quietLog() *slog.Logger { return slog.New(slog.DiscardHandler) }

// colocated is what one process gives for prompt: the same model, no handoff.
func colocated(t testing.TB, m *llama.Model, pageTokens int, prompt string, n int) string {
	t.Helper()
	toks := llama.Bytes{}.Encode(prompt, true, false)
	g := engine.GeometryOf(m.Config, pageTokens)
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
	out, err := e.Generate(kv.Table(refs), toks, n, llama.Greedy(), -1)
	if err != nil {
		t.Fatal(err)
	}
	return llama.Decode(llama.Bytes{}, out, toks[len(toks)-1])
}

type answer struct {
	code int
	text string
	err  string
}

func complete(ctx context.Context, api, tenant, prompt string, maxTokens int) (answer, error) {
	body, _ := json.Marshal(map[string]any{"prompt": prompt, "max_tokens": maxTokens})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+api+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return answer{}, err
	}
	req.Header.Set(TenantHeader, tenant)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var out struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
		Error *struct {
			Message string `json:"message"`
			Code    string `json:"code"`
		} `json:"error"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return answer{}, fmt.Errorf("status %d, body %q: %v", resp.StatusCode, b, err)
	}
	a := answer{code: resp.StatusCode}
	if len(out.Choices) == 1 {
		a.text = out.Choices[0].Text
	}
	if out.Error != nil {
		a.err = out.Error.Code + ": " + out.Error.Message
	}
	return a, nil
}

// prompts are tenants' texts with a secret each, repeated so that the
// built-in model's copy head completes it: a leak of another tenant's KV
// shows up as another tenant's secret.
func prompts(n int, seed uint64) []string {
	rng := rand.New(rand.NewPCG(seed, 1))
	out := make([]string, n)
	for i := range out {
		const letters = "ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz23456789"
		secret := make([]byte, 10)
		for j := range secret {
			secret[j] = letters[rng.IntN(len(letters))]
		}
		filler := strings.Repeat(fmt.Sprintf("tenant %d: words %d. ", i%7, rng.IntN(1000)), 1+rng.IntN(3))
		out[i] = fmt.Sprintf("the secret is %s; %s again, the secret is ", secret, filler)
	}
	return out
}

func allPagesBack(t *testing.T, l *Local) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var held []string
		for _, p := range l.Prefills {
			if g := p.Endpoint().Gauges(); g.PagesFree != g.Pages {
				held = append(held, fmt.Sprintf("%s %+v", p.cfg.Name, g))
			}
		}
		for _, d := range l.Decodes {
			if g := d.Endpoint().Gauges(); g.PagesFree != g.Pages {
				held = append(held, fmt.Sprintf("%s %+v", d.cfg.Name, g))
			}
			if d.pool != nil && d.pool.OwnFree() != d.cfg.GenPages {
				held = append(held, fmt.Sprintf("%s generation pool: %d of %d free", d.cfg.Name, d.pool.OwnFree(), d.cfg.GenPages))
			}
		}
		if len(held) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pages still held at the end: %v", held)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Hundreds of requests from concurrent clients through router, two
// prefill and two decode nodes answer exactly what one process running the
// same model answers: the KV that decode attends over is the prompt's own.
func TestCompletionsOverTheHandoffMatchAColocatedRun(t *testing.T) {
	m := llama.Builtin(5)
	l, err := StartLocal(LocalConfig{Prefills: 2, Decodes: 2, PrefillPages: 160, DecodePages: 160, PageTokens: 16, Model: m, Timeout: 2 * time.Minute, Log: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	requests, clients := 200, 16
	if testing.Short() {
		requests = 80
	}
	ps := prompts(requests, 1)
	want := make([]string, len(ps))
	for i, p := range ps {
		want[i] = colocated(t, m, 16, p, 8+i%9)
	}
	var wg sync.WaitGroup
	errs := make(chan error, requests)
	next := make(chan int, requests)
	for i := range ps {
		next <- i
	}
	close(next)
	for range clients {
		wg.Go(func() {
			for i := range next {
				a, err := complete(context.Background(), l.API, fmt.Sprintf("tenant-%d", i%7), ps[i], 8+i%9)
				switch {
				case err != nil:
					errs <- fmt.Errorf("request %d: %v", i, err)
				case a.code != http.StatusOK:
					errs <- fmt.Errorf("request %d: %d %s", i, a.code, a.err)
				case a.text != want[i]:
					errs <- fmt.Errorf("request %d: %q over the handoff, %q colocated", i, a.text, want[i])
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	copied := 0
	for i, p := range ps {
		secret := p[len("the secret is "):][:4]
		if strings.HasPrefix(want[i], secret) {
			copied++
		}
	}
	if copied < len(ps)/2 {
		t.Fatalf("the colocated run copies the secret in only %d of %d prompts: the comparison would not see a leak", copied, len(ps))
	}
	used := map[string]bool{}
	for _, p := range append(append([]*Prefill{}, l.Prefills...), nil) {
		if p != nil && counter(t, p.Metrics(), "kvhandoff_handoffs_total", "outcome", "success") > 0 {
			used[p.cfg.Name] = true
		}
	}
	for _, d := range l.Decodes {
		if counter(t, d.Metrics(), "kvhandoff_handoffs_total", "outcome", "success") > 0 {
			used[d.cfg.Name] = true
		}
	}
	if len(used) != 4 {
		t.Errorf("only %v carried requests", used)
	}
	allPagesBack(t, l)
}

// counter sums a counter family's values whose label has value.
func counter(t *testing.T, m *Metrics, family, label, value string) float64 {
	t.Helper()
	mfs, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != family {
			continue
		}
		for _, mt := range mf.GetMetric() {
			for _, lp := range mt.GetLabel() {
				if lp.GetName() == label && lp.GetValue() == value {
					sum += mt.GetCounter().GetValue()
				}
			}
		}
	}
	return sum
}

// An over-long prompt is refused at the router with 400, the limit named
// (the smallest pool: prefill's 40 pages of 16 tokens), and never reaches a node.
func TestOverLongPromptIsRejectedWithTheLimitNamed(t *testing.T) {
	l, err := StartLocal(LocalConfig{PrefillPages: 40, DecodePages: 64, PageTokens: 16, Log: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	// BOS and 640 bytes: 641 tokens.
	a, err := complete(context.Background(), l.API, "t", strings.Repeat("x", 640), 8)
	if err != nil {
		t.Fatal(err)
	}
	if a.code != http.StatusBadRequest || !strings.Contains(a.err, "640") || !strings.Contains(a.err, "context_length_exceeded") {
		t.Fatalf("over-long prompt: %d %q", a.code, a.err)
	}
	if a, err := complete(context.Background(), l.API, "t", strings.Repeat("x", 639), 1); err != nil || a.code != http.StatusOK {
		t.Fatalf("a prompt at the limit: %+v %v", a, err)
	}
	for _, p := range l.Prefills {
		if got := counter(t, p.Metrics(), "kvhandoff_handoffs_total", "outcome", "rejected"); got != 0 {
			t.Fatalf("prefill saw %v rejected requests: the router let one through", got)
		}
	}
	// The prefill node's own intake is a defense of its own: told to take
	// a prompt over its limit, it refuses it.
	_, err = l.Prefills[0].prefill(context.Background(), &prefillCall{ID: 99, Decode: "decode-0", Prompt: make([]int, 641)})
	if !errors.Is(err, protocol.ErrTooLong) || !strings.Contains(err.Error(), "1..640") {
		t.Fatalf("prefill's own intake: %v", err)
	}
	allPagesBack(t, l)
}

// Every prompt starts with BOS, the built-in model's attention sink, and a
// prompt cannot place one of its own: text holding the byte vocabulary's
// BOS byte is refused at the router with 400 (errors.Is-matchable through
// Complete), and reaches no node.
func TestAPromptCannotInjectABeginningOfSequence(t *testing.T) {
	l, err := StartLocal(LocalConfig{PrefillPages: 40, DecodePages: 64, PageTokens: 16, Log: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	const injected = "the secret is \x01 again, the secret is "
	a, err := complete(context.Background(), l.API, "t", injected, 8)
	if err != nil {
		t.Fatal(err)
	}
	if a.code != http.StatusBadRequest || !strings.Contains(a.err, "invalid_prompt") || !strings.Contains(a.err, "0x01 at offset 14") {
		t.Fatalf("a prompt holding BOS: %d %q", a.code, a.err)
	}
	_, err = l.Router.Complete(context.Background(), Completion{Prompt: injected, MaxTokens: 8})
	if !errors.Is(err, ErrBadRequest) || !errors.Is(err, llama.ErrText) {
		t.Fatalf("Complete of a prompt holding BOS: %v", err)
	}
	if _, err := l.Router.Complete(context.Background(), Completion{Prompt: "", MaxTokens: 8}); !errors.Is(err, ErrBadRequest) {
		t.Fatalf("Complete of an empty prompt: %v", err)
	}
	res, err := l.Router.Complete(context.Background(), Completion{Prompt: "the secret is ok", MaxTokens: 2})
	if err != nil || res.PromptTokens != 17 {
		t.Fatalf("an ordinary prompt: %+v %v; want BOS and its 16 bytes", res, err)
	}
	for _, p := range l.Prefills {
		if got := counter(t, p.Metrics(), "kvhandoff_handoffs_total", "outcome", "rejected"); got != 0 {
			t.Fatalf("prefill saw %v rejected requests", got)
		}
	}
	allPagesBack(t, l)
}

// A client that disconnects mid-request cancels it on both legs: each
// node's leg ends with an error (none succeeds), and every page comes back.
func TestClientDisconnectCancelsBothLegs(t *testing.T) {
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
	d := l.Decodes[0]
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := complete(ctx, l.API, "t", strings.Repeat("a long prompt. ", 30), 64)
		done <- err
	}()
	// The prefill node is computing the request's KV (held), and the decode
	// node has the router's call: the request is on both legs.
	<-hold.held
	waitUntil(t, "the decode leg's call", func() bool { return len(d.snapshot()) == 1 })
	cancel()
	if err := <-done; err == nil {
		t.Fatal("the client got an answer after disconnecting")
	}
	// The router's cancel has reached the prefill node (it waits there for
	// the KV computation's end): the transfer cannot finish before it.
	waitUntil(t, "the prefill node's cancel call", func() bool { return l.Prefills[0].cancels.Load() == 1 })
	close(hold.release)
	for _, check := range []struct {
		m    *Metrics
		role string
	}{{l.Prefills[0].Metrics(), "prefill"}, {d.Metrics(), "decode"}, {l.Router.Metrics(), "router"}} {
		waitUntil(t, "the "+check.role+" leg to fail", func() bool {
			return counter(t, check.m, "kvhandoff_handoff_failures_total", "role", check.role) == 1
		})
		if s := counter(t, check.m, "kvhandoff_handoffs_total", "outcome", "success"); s != 0 {
			t.Fatalf("the %s leg succeeded %v times", check.role, s)
		}
	}
	allPagesBack(t, l)
}

// A request whose prefill node is lost after its KV arrived and verified on
// the decode node, while the router's call to the decode leg has not reached
// the node yet (a hook holds it before it is sent), fails; the router cuts
// that call, which then never reaches the node, and cancels the leg instead:
// the decode node's verified pages come back at once, not when it gives up
// waiting for a prompt (its timeout, a minute here). This held 5 pages past
// the end of a kvhandoff demo run. (A call cut once it has reached the node
// ends there as the client-disconnect test shows.)
func TestLostPrefillNodeFreesTheDecodePagesOfACallThatNeverReachedIt(t *testing.T) {
	call := newHeldCall()
	l, err := StartLocal(LocalConfig{PrefillPages: 64, DecodePages: 64, PageTokens: 16, Timeout: time.Minute, Log: quietLog(),
		beforeDecodeCall: call.hold})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	defer call.free() // before Stop: a failed check must not leave the router's call held
	d := l.Decodes[0]
	done := completeLater(l, strings.Repeat("a long prompt. ", 30))
	id := <-call.ids
	waitUntil(t, "the request verified on the decode node", func() bool { return d.Endpoint().Status(id) == protocol.ReceiverReady })
	if err := l.CrashPrefill(0); err != nil {
		t.Fatal(err)
	}
	if a := <-done; !strings.Contains(a.err, "node lost") {
		t.Fatalf("the client got %+v, want the request failed with its prefill node lost", a)
	}
	call.free() // the router's call goes on, its context already ended
	allPagesBack(t, l)
	if st := d.Endpoint().Status(id); st != protocol.ReceiverClosed {
		t.Fatalf("the request is %v on the decode node, want closed (cancelled)", st)
	}
}

// heldCall holds the router's first decode call (LocalConfig's
// beforeDecodeCall: hold) until free: its request's KV verifies on the
// decode node while the call waits. ids gives the request's id.
type heldCall struct {
	ids      chan protocol.RequestID
	release  chan struct{}
	held     atomic.Bool
	released sync.Once
}

func newHeldCall() *heldCall {
	return &heldCall{ids: make(chan protocol.RequestID, 1), release: make(chan struct{})}
}

func (h *heldCall) hold(id protocol.RequestID) {
	// Not a sync.Once: its other callers would wait for the first.
	if h.held.Swap(true) {
		return
	}
	h.ids <- id
	<-h.release
}

func (h *heldCall) free() { h.released.Do(func() { close(h.release) }) }

// completeLater asks l's API for a completion of prompt (16 tokens) and
// gives its answer, its error in err, when it comes.
func completeLater(l *Local, prompt string) <-chan answer {
	done := make(chan answer, 1)
	go func() {
		a, err := complete(context.Background(), l.API, "t", prompt, 16)
		if err != nil {
			a.err = err.Error()
		}
		done <- a
	}()
	return done
}

func waitUntil(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// snapshot is the decode node's requests in flight.
func (n *Decode) snapshot() []protocol.RequestID {
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []protocol.RequestID
	for id, r := range n.reqs {
		if r.call != nil {
			out = append(out, id)
		}
	}
	return out
}
