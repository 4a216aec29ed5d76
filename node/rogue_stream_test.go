package node

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// Whatever a decode node streams back, the router never panics and the
// client gets either an answer within what it asked (no more tokens than
// max_tokens) or an OpenAI error object: the fuzzer is the decode node's
// answer, frames or not, behind a prefill node that takes every call. CI
// fuzzes it (.ci/run); go test runs the seeds.
func FuzzADecodeNodesAnswerStream(f *testing.F) {
	var mu sync.Mutex
	var answer []byte
	nodes := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if r.URL.Path != pathDecode {
			writeJSON(w, http.StatusOK, struct{}{}) // the prefill call, a cancel, a peer's loss: taken
			return
		}
		mu.Lock()
		b := answer
		mu.Unlock()
		w.Header().Set("Content-Type", frameType)
		w.WriteHeader(http.StatusOK)
		w.Write(b)
	}))
	f.Cleanup(nodes.Close)
	rt := testRouter(f, RouterConfig{Timeout: time.Second})
	members := joinPair(rt, strings.TrimPrefix(nodes.URL, "http://"), 1024)
	// A stream that breaks off makes its node unreachable, out of rotation
	// until it answers the router's probe: each input gets both nodes back,
	// as that probe's answer would bring them (suspectLocked).
	revive := func() {
		rt.mu.Lock()
		var back []Member
		for _, m := range members {
			if id := rt.ids[m.Name]; rt.lost[id] {
				delete(rt.suspect, id)
				back = append(back, m)
			}
		}
		rt.mu.Unlock()
		for _, m := range back {
			rt.change(Change{Kind: Joined, Member: m})
		}
	}
	h := rt.Handler()
	for _, seed := range []string{
		"{\"tokens\":[104,105]}\n{\"end\":true}\n",
		"{\"tokens\":[104],\"logprobs\":[{\"token\":104,\"logprob\":-0.5}]}\n{\"end\":true}\n",
		"{\"error\":{\"message\":\"no\",\"codes\":[\"peer_failed\"]},\"end\":true}\n",
		"{\"tokens\":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}\n{\"end\":true}\n",
		"{\"tokens\":[-1]}\n{\"end\":true}\n",
		"{\"tokens\":[1000000]}\n{\"end\":true}\n",
		"{\"tokens\":[104]}\n",
		"{\"tokens\":[104],\"x\":1}\n{\"end\":true}\n",
		"not json",
		"",
	} {
		f.Add([]byte(seed), uint8(4), false)
		f.Add([]byte(seed), uint8(1), true)
	}
	f.Fuzz(func(t *testing.T, stream []byte, maxTokens uint8, logprobs bool) {
		revive()
		mu.Lock()
		answer = stream
		mu.Unlock()
		max := int(maxTokens%16) + 1
		body := fmt.Sprintf(`{"prompt": "hi", "max_tokens": %d}`, max)
		if logprobs {
			body = fmt.Sprintf(`{"prompt": "hi", "max_tokens": %d, "logprobs": 1}`, max)
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest("POST", "/v1/completions", strings.NewReader(body)))
		if w.Code != http.StatusOK {
			if openAIErrorCode(t, "the stream", stream, w) == "no_node" {
				t.Fatalf("stream %q: no_node: the nodes were out of rotation, and the stream went unread", stream)
			}
			return
		}
		var out struct {
			Choices []struct{ Text string }
			Usage   struct {
				CompletionTokens int `json:"completion_tokens"`
			}
		}
		if err := json.Unmarshal(w.Body.Bytes(), &out); err != nil || len(out.Choices) != 1 {
			t.Fatalf("stream %q: 200 %q, want one choice", stream, w.Body.Bytes())
		}
		if n := out.Usage.CompletionTokens; n < 0 || n > max || len(out.Choices[0].Text) > 4*max {
			t.Fatalf("stream %q: %d tokens, %q, for max_tokens %d", stream, n, out.Choices[0].Text, max)
		}
	})
}
