package node

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

// pressureOutcome is what the pool-pressure workload saw.
type pressureOutcome struct {
	codes   map[int]int
	seconds []float64
}

// poolPressure runs issue 20's pool-pressure workload on l: six
// concurrent 1,000-token prompts (BOS and 999 bytes), each asking for
// maxTokens, with stream as given; with leave, a streaming client
// disconnects once it has its first text.
func poolPressure(t *testing.T, l *Local, maxTokens int, stream, leave bool) pressureOutcome {
	t.Helper()
	out := pressureOutcome{codes: map[int]int{}}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := range 6 {
		prompt := strings.Repeat(string(rune('a'+i))+"bcdefghij", 100)[:999]
		wg.Go(func() {
			ctx := context.Background()
			start := time.Now()
			code := 499
			if a, err := completeStream(ctx, l.API, prompt, maxTokens, stream, leave); err == nil {
				code = a
			}
			mu.Lock()
			out.codes[code]++
			out.seconds = append(out.seconds, time.Since(start).Seconds())
			mu.Unlock()
		})
	}
	wg.Wait()
	return out
}

// Under issue 20's pool pressure (six concurrent 1,000-token prompts, a
// 70-page decode pool that holds one of them at a time, the router's
// timeout 6 s) every request ends with a 200 or an explicit 503, none
// hangs, every page comes back, and a request the router gave up on stops
// its decode generation at once: at most one token after each cancel
// (kvhandoff_decode_tokens_after_cancel_total), and its prefill computation
// within one chunk: no prefill node computes more than a chunk's pages of a
// request after its end (transfer.Stats.MostPagesComputedAfterEnd, summed in
// kvhandoff_prefill_pages_after_end_total). The successes are logged
// (docs/nodes.md has the figures).
func TestPoolPressureEndsEveryRequestAndStopsCancelledWork(t *testing.T) {
	if testing.Short() {
		t.Skip("the pool-pressure workload computes six 1,000-token prefills (seconds on a loaded machine)")
	}
	chunk := *pressureChunkPages
	l := localBuiltin(t, LocalConfig{PrefillPages: 256, DecodePages: 70, Timeout: 6 * time.Second, PrefillChunkPages: chunk})
	for _, c := range []struct {
		name      string
		maxTokens int
		stream    bool
		leave     bool
	}{
		{"router timeout", 16, false, false},
		{"streaming clients that leave after their first text", 24, true, true},
	} {
		before := metricValue(t, l.Decodes[0].Metrics(), "kvhandoff_decode_tokens_after_cancel_total")
		cancelledBefore := counter(t, l.Decodes[0].Metrics(), "kvhandoff_handoff_failures_total", "role", "decode")
		start := time.Now()
		out := poolPressure(t, l, c.maxTokens, c.stream, c.leave)
		ended := time.Since(start)
		// The prefill nodes' computations of requests the router gave up
		// on run to their end (chunked prefill would stop them: issue 19).
		waitUntil(t, "every page back", func() bool { return pagesFree(l) })
		after := metricValue(t, l.Decodes[0].Metrics(), "kvhandoff_decode_tokens_after_cancel_total") - before
		failed := counter(t, l.Decodes[0].Metrics(), "kvhandoff_handoff_failures_total", "role", "decode") - cancelledBefore
		t.Logf("%s: %v in %.1f s (each %.1f s), every page back %.1f s after the last answer; decode legs failed %v, tokens after a cancel %v",
			c.name, out.codes, ended.Seconds(), out.seconds, (time.Since(start) - ended).Seconds(), failed, after)
		if out.codes[200]+out.codes[503]+out.codes[499] != 6 || (!c.leave && out.codes[499] > 0) {
			t.Fatalf("%s: answers %v", c.name, out.codes)
		}
		if after > failed {
			t.Fatalf("%s: %v tokens generated after a cancel over %v failed decode legs", c.name, after, failed)
		}
		for _, p := range l.Prefills {
			st := p.Endpoint().Stats()
			t.Logf("%s: %s computed %d chunks, %d pages after their request's end (at most %d for one request)",
				c.name, p.cfg.Name, st.ChunksComputed, st.PagesComputedAfterEnd, st.MostPagesComputedAfterEnd)
			if chunk > 0 && st.MostPagesComputedAfterEnd > uint64(chunk) {
				t.Errorf("%s: %s computed %d pages of one request after its end, more than a chunk of %d", c.name, p.cfg.Name, st.MostPagesComputedAfterEnd, chunk)
			}
		}
	}
}

// pressureChunkPages is the pool-pressure test's prefill chunk
// (LocalConfig.PrefillChunkPages): the node's default; -1 computes each
// prompt whole, as before streaming (docs/nodes.md's "before" figures).
var pressureChunkPages = flag.Int("pressure-chunk-pages", DefaultPrefillChunkPages, "the pool-pressure test's prefill chunk in pages; -1: whole prompts")

// pagesFree: every node's pages are free.
func pagesFree(l *Local) bool {
	for _, p := range l.Prefills {
		if g := p.Endpoint().Gauges(); g.PagesFree != g.Pages {
			return false
		}
	}
	for _, d := range l.Decodes {
		if g := d.Endpoint().Gauges(); g.PagesFree != g.Pages {
			return false
		}
	}
	return true
}

// completeStream posts one completion and is its outcome as a status: a
// stream's is 200 if it ended with [DONE] and no error event, else 503;
// with leave, 499 once the stream has text (the client goes).
func completeStream(ctx context.Context, api, prompt string, maxTokens int, stream, leave bool) (int, error) {
	if !stream {
		a, err := complete(ctx, api, "t", prompt, maxTokens)
		return a.code, err
	}
	body, _ := json.Marshal(map[string]any{"prompt": prompt, "max_tokens": maxTokens, "stream": true})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+api+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	code := 200
	for sc.Scan() {
		line := sc.Text()
		if line == "data: [DONE]" {
			return code, nil
		}
		if strings.HasPrefix(line, `data: {"error"`) {
			code = 503
		}
		if leave && strings.Contains(line, `"text":"`) && !strings.Contains(line, `"text":""`) {
			return 499, nil
		}
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, io.ErrUnexpectedEOF
}
