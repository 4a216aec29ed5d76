package node

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"runtime/metrics"
	"strings"
	"sync"
	"testing"
	"time"
)

// frontDoor is a router's client API alone (no Run, no node calls) under
// limits, with a prefill and a decode node of ctxTokens known to it (0:
// none), on a loopback port.
func frontDoor(t *testing.T, limits HTTPLimits, ctxTokens int) (*Router, string) {
	t.Helper()
	rt := testRouter(t, RouterConfig{HTTP: limits})
	if ctxTokens > 0 {
		joinPair(rt, "127.0.0.1:1", ctxTokens)
		if rt.Limit() != ctxTokens {
			t.Fatalf("router limit %d, want %d", rt.Limit(), ctxTokens)
		}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rt.ServeAPI(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return rt, ln.Addr().String()
}

// testRouter is a router of cfg over an empty static registry, insecure
// and quiet, that nobody runs.
func testRouter(tb testing.TB, cfg RouterConfig) *Router {
	tb.Helper()
	static, err := NewStatic()
	if err != nil {
		tb.Fatal(err)
	}
	cfg.Registry, cfg.Security, cfg.Log = static, Security{Insecure: true}, quietLog()
	rt, err := NewRouter(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	return rt
}

// joinPair tells rt of a prefill and a decode node, both of ctxTokens in
// pages of 16 tokens, whose control API is at control, and returns their
// records.
func joinPair(rt *Router, control string, ctxTokens int) []Member {
	members := []Member{{Name: "prefill-0", Role: RolePrefill}, {Name: "decode-0", Role: RoleDecode, Transfer: "127.0.0.1:1"}}
	for i := range members {
		m := &members[i]
		m.Control, m.PoolPages, m.PageTokens, m.PageBytes, m.ContextTokens, m.Model, m.Incarnation = control, ctxTokens/16, 16, 64, ctxTokens, "m", 1
		rt.change(Change{Kind: Joined, Member: *m})
	}
	return members
}

// openAIErrorCode is the code of the OpenAI error object w's body must be
// (a message, a type and a code), for a request of body to path.
func openAIErrorCode(t *testing.T, path string, body []byte, w *httptest.ResponseRecorder) string {
	t.Helper()
	var e struct {
		Error struct {
			Message, Type string
			Code          *string
		}
	}
	if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || e.Error.Message == "" || e.Error.Type == "" || e.Error.Code == nil {
		t.Fatalf("%s %q: %d %q, want an OpenAI error object", path, body, w.Code, w.Body.Bytes())
	}
	return *e.Error.Code
}

// settledGoroutines waits (bounded) for the goroutine count to fall to at
// most want, and returns the last count.
func settledGoroutines(want int, wait time.Duration) int {
	deadline := time.Now().Add(wait)
	for {
		n := runtime.NumGoroutine()
		if n <= want || time.Now().After(deadline) {
			return n
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// bodyless opens n connections that each send a completion request's
// headers, promising a body that never comes.
func bodyless(t *testing.T, api string, n int) []net.Conn {
	t.Helper()
	conns := make([]net.Conn, 0, n)
	for range n {
		c, err := net.Dial("tcp", api)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		if _, err := io.WriteString(c, "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	return conns
}

// A client that sends a request's headers and never its body is answered
// 408 and its connection closed once the body timeout passes: 500 of them
// at once are all closed, the goroutines serving them end, and with the
// body timeout off (the defense switched off) the same connections are
// still held long after it.
func TestBodylessConnectionsAreClosedAtTheBodyTimeout(t *testing.T) {
	const n, bodyTimeout = 500, time.Second
	base := runtime.NumGoroutine()
	_, api := frontDoor(t, HTTPLimits{BodyTimeout: bodyTimeout}, 0)
	start := time.Now()
	conns := bodyless(t, api, n)
	var wg sync.WaitGroup
	closed := make(chan string, n)
	for _, c := range conns {
		wg.Go(func() {
			c.SetReadDeadline(time.Now().Add(60 * time.Second)) // a hang guard, not a timing claim
			b, err := io.ReadAll(c)
			if err != nil {
				closed <- fmt.Sprintf("not closed by the router: %v after %q", err, b)
				return
			}
			if !bytes.HasPrefix(b, []byte("HTTP/1.1 408")) || !bytes.Contains(b, []byte(`"request_timeout"`)) {
				closed <- fmt.Sprintf("answered %q", b)
			}
		})
	}
	wg.Wait()
	close(closed)
	for why := range closed {
		t.Fatal(why)
	}
	// Every connection waited at least the timeout (the router waited for
	// the body), then all closed; the serving goroutines are gone.
	if took := time.Since(start); took < bodyTimeout {
		t.Fatalf("closed after %v, before the body timeout %v", took, bodyTimeout)
	}
	if g := settledGoroutines(base+10, 30*time.Second); g > base+10 {
		t.Fatalf("%d goroutines after the connections closed, %d before", g, base)
	}

	// The defense off: the same connections are held past three timeouts.
	_, api = frontDoor(t, HTTPLimits{BodyTimeout: -1}, 0)
	held := bodyless(t, api, 50)
	time.Sleep(3 * bodyTimeout)
	for i, c := range held {
		c.SetReadDeadline(time.Now().Add(10 * time.Millisecond))
		if _, err := c.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("without a body timeout, connection %d ended: %v", i, err)
		}
	}
}

// The connections open at once are bounded (MaxConns), and with them the
// goroutines: 500 body-less connections against a limit of 100 hold at most
// about 100 goroutines of the router's, and all of them are served in turn.
func TestConnectionsOpenAtOnceAreBounded(t *testing.T) {
	const n, limit = 500, 100
	base := runtime.NumGoroutine()
	_, api := frontDoor(t, HTTPLimits{BodyTimeout: 500 * time.Millisecond, MaxConns: limit}, 0)
	conns := bodyless(t, api, n)
	time.Sleep(200 * time.Millisecond)
	// Each served connection: its goroutine (and the test's reader below is
	// not running yet). The listener's own: Serve and the shutdown watcher.
	if g := runtime.NumGoroutine(); g > base+limit+10 {
		t.Fatalf("%d goroutines with %d connections held against a limit of %d (base %d)", g, n, limit, base)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	answered := 0
	for _, c := range conns {
		wg.Go(func() {
			c.SetReadDeadline(time.Now().Add(120 * time.Second))
			b, _ := io.ReadAll(c)
			if bytes.HasPrefix(b, []byte("HTTP/1.1 408")) {
				mu.Lock()
				answered++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if answered != n {
		t.Fatalf("%d of %d connections answered 408", answered, n)
	}
}

// A keep-alive connection left idle is closed at the idle timeout; with the
// timeout off (the defense switched off) it is held.
func TestIdleKeepAliveConnectionsAreClosed(t *testing.T) {
	for _, idle := range []time.Duration{300 * time.Millisecond, -1} {
		_, api := frontDoor(t, HTTPLimits{IdleTimeout: idle}, 0)
		conns := make([]net.Conn, 50)
		for i := range conns {
			c, err := net.Dial("tcp", api)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: router\r\n\r\n")
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.Close {
				t.Fatalf("the router closed a keep-alive connection after a request")
			}
			conns[i] = c
		}
		if idle < 0 {
			time.Sleep(time.Second)
			for i, c := range conns {
				c.SetReadDeadline(time.Now().Add(10 * time.Millisecond))
				if _, err := c.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
					t.Fatalf("without an idle timeout, connection %d ended: %v", i, err)
				}
			}
			continue
		}
		for i, c := range conns {
			c.SetReadDeadline(time.Now().Add(60 * time.Second)) // a hang guard
			if n, err := c.Read(make([]byte, 1)); n != 0 || err != io.EOF {
				t.Fatalf("idle connection %d: %d bytes, %v; want EOF from the router", i, n, err)
			}
		}
	}
}

// heldBytes is the memory the Go runtime holds from the OS (mapped and not
// released): what the process's RSS is made of, less the binary.
func heldBytes() uint64 {
	s := []metrics.Sample{{Name: "/memory/classes/total:bytes"}, {Name: "/memory/classes/heap/released:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64() - s[1].Value.Uint64()
}

// Eight concurrent 16 MiB prompts are each answered 400 and cost the router
// a bounded amount of memory: the body limit stops the read, and a prompt
// inside it but over the deployment's token limit is refused before it is
// tokenized. The memory the runtime holds stays within 50 MB of where it
// started, at its peak (sampled throughout) and after.
func TestLargePromptsLeaveTheRoutersMemoryBounded(t *testing.T) {
	_, api := frontDoor(t, HTTPLimits{}, 1024)
	huge, err := json.Marshal(map[string]any{"prompt": strings.Repeat("x", 16<<20), "max_tokens": 4})
	if err != nil {
		t.Fatal(err)
	}
	inside, err := json.Marshal(map[string]any{"prompt": strings.Repeat("x", 900<<10), "max_tokens": 4})
	if err != nil {
		t.Fatal(err)
	}
	runtime.GC()
	start := heldBytes()
	var peak uint64
	stop, sampled := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			peak = max(peak, heldBytes())
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()
	for _, round := range []struct {
		body []byte
		code string
	}{{huge, "request_too_large"}, {inside, "context_length_exceeded"}} {
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for range 8 {
			wg.Go(func() {
				resp, err := http.Post("http://"+api+"/v1/completions", "application/json", bytes.NewReader(round.body))
				if err != nil {
					errs <- err
					return
				}
				defer resp.Body.Close()
				b, _ := io.ReadAll(resp.Body)
				if resp.StatusCode != http.StatusBadRequest || !bytes.Contains(b, []byte(round.code)) {
					errs <- fmt.Errorf("a %d-byte prompt: %d %s", len(round.body), resp.StatusCode, b)
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
	}
	close(stop)
	<-sampled
	runtime.GC()
	after := heldBytes()
	t.Logf("runtime-held memory: %d MB at the start, %d MB at the peak, %d MB after", start>>20, peak>>20, after>>20)
	if peak > start+50<<20 || after > start+50<<20 {
		t.Fatalf("eight 16 MiB prompts took the router from %d MB to a peak of %d MB (%d MB after): over 50 MB more", start>>20, peak>>20, after>>20)
	}
}

// The tenant header is bounded in length and characters: one over the limit
// or holding another byte is a 400 naming the header.
func TestTenantHeaderIsBoundedInLengthAndCharacters(t *testing.T) {
	_, api := frontDoor(t, HTTPLimits{}, 1024)
	for _, tenant := range []string{strings.Repeat("a", maxTenantLen+1), strings.Repeat("a", 1<<20), "acme\" level=ERROR", "a b", "ténant"} {
		req, _ := http.NewRequest(http.MethodPost, "http://"+api+"/v1/completions", strings.NewReader(`{"prompt":"hi","max_tokens":1}`))
		req.Header.Set(TenantHeader, tenant)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if len(tenant) > 60<<10 {
			// Over MaxHeaderBytes: net/http answers 431 before the handler.
			if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
				t.Fatalf("a 1 MiB tenant: %d %s", resp.StatusCode, b)
			}
			continue
		}
		if resp.StatusCode != http.StatusBadRequest || !bytes.Contains(b, []byte(`"invalid_tenant"`)) || !bytes.Contains(b, []byte(TenantHeader)) {
			t.Fatalf("tenant %.20q: %d %s", tenant, resp.StatusCode, b)
		}
	}
	if err := checkTenant("acme-prod_2:eu.west"); err != nil {
		t.Fatal(err)
	}
}

// The client API answers any body with a status and, for a refusal, an
// OpenAI error object (message, type, code), never a panic: a completion's
// and a chat completion's body, as they come, at a router whose prefill and
// decode node cannot be reached (a request that parses is refused with 503
// once its calls fail). CI fuzzes it (.ci/run); go test runs the seeds.
func FuzzClientAPIBodies(f *testing.F) {
	rt := testRouter(f, RouterConfig{Timeout: time.Second})
	joinPair(rt, "127.0.0.1:1", 1024)
	h := rt.Handler()
	for _, seed := range []string{
		`{"prompt": "hi", "max_tokens": 2}`,
		`{"prompt": ["a", "b"], "n": 2, "logprobs": 2, "stop": ["x", "yy"], "temperature": 0.5, "seed": 3}`,
		`{"prompt": [1, 2, 3], "echo": true, "stream": true, "stream_options": {"include_usage": true}}`,
		`{"prompt": [[1, 2], [3]], "max_tokens": 1e9, "top_p": -1}`,
		`{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "logprobs": true, "top_logprobs": 2}`,
		`{"messages": [{"role": "system", "content": [{"type": "text", "text": "be brief"}]}, {"role": "user", "content": "q"}], "stream": true}`,
		`{"messages": [], "cache_salt": "t"}`,
		`{"prompt": "x", "stop": 5}`,
		`[]`, `null`, `{"prompt": "\u0000"}`,
	} {
		f.Add([]byte(seed), false)
		f.Add([]byte(seed), true)
	}
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		path := "/v1/completions"
		if chat {
			path = "/v1/chat/completions"
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest("POST", path, bytes.NewReader(body)))
		if w.Code != http.StatusOK { // 200: a stream that began, its error an event
			openAIErrorCode(t, path, body, w)
		}
	})
}
