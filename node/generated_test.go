package node

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// Without a model, a decode node answers with a digest of the KV it
// verified: requests of hundreds of pages each, from concurrent clients,
// get exactly the digest of their own request's generated KV, so a page
// that landed in the wrong place, or a stale one, changes the answer.
func TestGeneratedKVOfHundredsOfPagesArrivesIntact(t *testing.T) {
	const pageTokens, pageBytes = 16, 4096
	l, err := StartLocal(LocalConfig{Prefills: 2, Decodes: 2, PrefillPages: 1024, DecodePages: 1024, PageTokens: pageTokens, PageBytes: pageBytes, Log: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	requests := 48
	if testing.Short() {
		requests = 16
	}
	var wg sync.WaitGroup
	errs := make(chan error, requests)
	next := make(chan int, requests)
	for i := range requests {
		next <- i
	}
	close(next)
	for range 8 {
		wg.Go(func() {
			for i := range next {
				tokens := 1600 + 97*i // 100 to about 380 pages
				if err := digestRequest(l.API, tokens, pageTokens, pageBytes); err != nil {
					errs <- fmt.Errorf("request %d (%d tokens): %v", i, tokens, err)
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	allPagesBack(t, l)
}

func digestRequest(api string, tokens, pageTokens, pageBytes int) error {
	// tokens counts BOS, which the router puts before the text.
	body, _ := json.Marshal(map[string]any{"prompt": strings.Repeat("k", tokens-1), "max_tokens": 24})
	resp, err := http.Post("http://"+api+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", resp.Status, b)
	}
	var out struct {
		ID      string `json:"id"`
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(b, &out); err != nil || len(out.Choices) != 1 {
		return fmt.Errorf("answer %s: %v", b, err)
	}
	id, err := strconv.ParseUint(strings.TrimPrefix(out.ID, "cmpl-"), 16, 64)
	if err != nil {
		return err
	}
	h := sha256.New()
	page := make([]byte, pageBytes)
	for i := range protocol.PagesFor(uint32(tokens), pageTokens) {
		transfer.GenerateKV(protocol.RequestID(id), i, pageTokens, page)
		h.Write(page)
	}
	sum := h.Sum(nil)
	toks := make([]int, 24)
	for i := range toks {
		toks[i] = int(sum[i%len(sum)])
	}
	want := llama.Decode(llama.Bytes{}, toks, 'k')
	// The answer crossed JSON, which replaces invalid UTF-8: compare alike.
	wj, _ := json.Marshal(want)
	var wantText string
	json.Unmarshal(wj, &wantText)
	if out.Choices[0].Text != wantText {
		return fmt.Errorf("answer %q, the digest of its own KV is %q", out.Choices[0].Text, wantText)
	}
	return nil
}
