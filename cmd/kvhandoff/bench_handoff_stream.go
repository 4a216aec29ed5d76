package main

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/rdma"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// streamRow is a prompt length's time to first token with the prefill
// computed whole before its pages move and streamed in chunks, in the same
// run: the engine (the built-in model on the CPU) computes the KV on the
// prefill node and the first token on the decode node.
type streamRow struct {
	Provider string `json:"provider"`
	// LinkGbps is the emulated link's rate (pacedDevice), 0 for the
	// provider's own speed.
	LinkGbps     float64 `json:"link_gbps"`
	PromptTokens int     `json:"prompt_tokens"`
	ChunkPages   int     `json:"chunk_pages"`
	Pages        int     `json:"pages"`
	PageBytes    int     `json:"page_bytes"`
	Requests     int     `json:"requests"` // per mode, over every round
	// Time to first token, p50 over the requests: Submit on the prefill
	// node to the decode node's first generated token.
	WholeTTFTMicros  float64 `json:"whole_ttft_p50_us"`
	StreamTTFTMicros float64 `json:"stream_ttft_p50_us"`
	// Ratio is stream over whole: below 1, streaming's transfer hid
	// behind the computation.
	Ratio float64 `json:"ratio"`
}

// parseLinkRates reads --stream-link: rates in Gbit/s, 0 for none.
func parseLinkRates(list string) ([]float64, error) {
	var out []float64
	for _, f := range strings.Split(list, ",") {
		r, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
		if err != nil || r < 0 || r > 1e4 {
			return nil, fmt.Errorf("--stream-link: %q is not a rate in Gbit/s (0..10000; 0: the provider's own)", f)
		}
		out = append(out, r)
	}
	return out, nil
}

// parsePromptLengths reads --stream-prompts: token counts, or none.
func parsePromptLengths(list string, limit int) ([]int, error) {
	if list == "" || list == "none" {
		return nil, nil
	}
	var out []int
	for _, f := range strings.Split(list, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 2 || n > limit {
			return nil, fmt.Errorf("--stream-prompts: %q is not a prompt length in 2..%d", f, limit)
		}
		out = append(out, n)
	}
	return out, nil
}

// streamPipeline is a prefill node whose engine computes into its source
// pages (streaming or not) and a decode node whose engine generates from
// the pages that land, on two devices of a provider.
type streamPipeline struct {
	p      *transfer.Prefill
	d      *transfer.Decode
	source *engine.Source
	dp     *kv.DecodePool
	decode *engine.Engine
	stop   func()
}

func newStreamPipeline(mk func() (rdma.Device, rdma.Device, func(), error), m *llama.Model, pages, chunkPages int) (*streamPipeline, error) {
	g := engine.GeometryOf(m.Config, benchPageTokens)
	devP, devD, closeDevs, err := mk()
	if err != nil {
		return nil, err
	}
	sp := &streamPipeline{source: engine.NewSource()}
	fail := func(err error) (*streamPipeline, error) {
		if sp.p != nil {
			sp.p.Close()
		}
		if sp.d != nil {
			sp.d.Close()
		}
		closeDevs()
		return nil, err
	}
	if sp.p, err = transfer.NewPrefill(devP, transfer.PrefillConfig{Pages: pages, PageTokens: benchPageTokens, PageBytes: g.PageBytes(),
		KV: sp.source, ChunkPages: chunkPages}); err != nil {
		return fail(err)
	}
	if sp.d, err = transfer.NewDecode(devD, transfer.DecodeConfig{Pages: pages, PageTokens: benchPageTokens, PageBytes: g.PageBytes(), Timeout: time.Minute}); err != nil {
		return fail(err)
	}
	if err := transfer.ConnectLocal(sp.p, "prefill", sp.d, "decode"); err != nil {
		return fail(err)
	}
	cache, err := kv.OverPages(g, sp.p.Pages(), kv.Unversioned)
	if err != nil {
		return fail(err)
	}
	e, err := engine.New(m, cpu.New(), cache, engine.Options{})
	if err != nil {
		return fail(err)
	}
	sp.source.Use(e)
	if sp.dp, err = kv.NewDecodePool(g, sp.d, 1); err != nil {
		return fail(err)
	}
	if sp.decode, err = engine.New(m, cpu.New(), sp.dp.Cache(), engine.Options{}); err != nil {
		return fail(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { sp.p.Run(ctx) })
	wg.Go(func() { sp.d.Run(ctx) })
	sp.stop = func() { cancel(); wg.Wait(); sp.p.Close(); sp.d.Close(); closeDevs() }
	return sp, nil
}

// ttft hands prompt off as request id and is the time from Submit to the
// decode node's first token, which it returns too.
func (sp *streamPipeline) ttft(id protocol.RequestID, prompt []int) (time.Duration, int, error) {
	sp.source.Expect(id, prompt)
	start := time.Now()
	submitted := make(chan error, 1)
	go func() { submitted <- sp.p.Submit(id, "decode", len(prompt)) }()
	ctx := context.Background()
	if err := waitEvent(ctx, sp.d, id, transfer.Verified); err != nil {
		return 0, 0, err
	}
	refs, err := sp.d.Acquire(id)
	if err != nil {
		return 0, 0, err
	}
	table, err := sp.dp.Table(id, refs, len(prompt)+1)
	if err != nil {
		return 0, 0, err
	}
	if err := sp.decode.Arrived(table[:len(refs)]); err != nil {
		return 0, 0, err
	}
	out, err := sp.decode.Decode(table, prompt, 1, llama.Greedy(), -1)
	took := time.Since(start)
	if err != nil {
		return 0, 0, err
	}
	sp.dp.Release(id, table)
	if err := sp.d.Finish(id); err != nil {
		return 0, 0, err
	}
	if err := <-submitted; err != nil {
		return 0, 0, err
	}
	if err := waitEvent(ctx, sp.p, id, transfer.Outcome); err != nil {
		return 0, 0, err
	}
	return took, out[0], nil
}

// measureStreaming is the time to first token of requests prompts of tokens
// tokens each, the prefill computed whole and in chunks of chunkPages, in
// reps rounds that alternate the two; both must generate the same token.
func measureStreaming(mk func() (rdma.Device, rdma.Device, func(), error), linkGbps float64, tokens, chunkPages, requests, reps int) (streamRow, error) {
	if linkGbps > 0 { // the prefill node's sends paced: the link from it to the decode node
		own := mk
		mk = func() (rdma.Device, rdma.Device, func(), error) {
			p, d, closeDevs, err := own()
			if err != nil {
				return nil, nil, nil, err
			}
			return pacedDevice{p, linkGbps * 1e9 / 8}, d, closeDevs, nil
		}
	}
	m := llama.Builtin(1)
	pages := protocol.PagesFor(uint32(tokens), benchPageTokens)
	row := streamRow{LinkGbps: linkGbps, PromptTokens: tokens, ChunkPages: chunkPages, Pages: pages,
		PageBytes: engine.GeometryOf(m.Config, benchPageTokens).PageBytes(), Requests: requests * reps}
	var pipes [2]*streamPipeline // whole, streaming
	for i, chunk := range []int{0, chunkPages} {
		sp, err := newStreamPipeline(mk, m, pages+1, chunk)
		if err != nil {
			return row, err
		}
		defer sp.stop()
		pipes[i] = sp
	}
	prompt := make([]int, tokens)
	var lat [2][]time.Duration
	id := protocol.RequestID(0)
	for range reps {
		for k := range requests {
			prompt[0] = 1 // BOS, then printable bytes: the k-th prompt of each round
			for j := 1; j < tokens; j++ {
				prompt[j] = 32 + (k*31+j*7)%95
			}
			var toks [2]int
			for mode, sp := range pipes { // alternating: both see the same moments of a shared machine
				id++
				took, tok, err := sp.ttft(id, prompt)
				if err != nil {
					return row, fmt.Errorf("request %d (chunk %d): %w", id, []int{0, chunkPages}[mode], err)
				}
				lat[mode], toks[mode] = append(lat[mode], took), tok
			}
			if toks[0] != toks[1] {
				return row, fmt.Errorf("prompt %d: computed whole, the first token is %d; streamed, %d", k, toks[0], toks[1])
			}
		}
	}
	p50 := func(l []time.Duration) float64 {
		slices.Sort(l)
		return float64(l[len(l)/2].Microseconds())
	}
	row.WholeTTFTMicros, row.StreamTTFTMicros = p50(lat[0]), p50(lat[1])
	row.Ratio = row.StreamTTFTMicros / row.WholeTTFTMicros
	return row, nil
}
