package measure

import (
	"fmt"
	"time"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// Config sizes a measurement.
type Config struct {
	Prompt     int // prompt tokens
	Decode     int // decoded tokens per round
	PageTokens int // positions per page
	Rounds     int // rounds; the best counts
}

// Row is one model's figures, in the JSON shape of kvhandoff bench engine.
type Row struct {
	Model                     string  `json:"model"`
	Backend                   string  `json:"backend"`
	PrefillTokensPerS         float64 `json:"prefill_tokens_per_s"`
	DecodeTokensPerS          float64 `json:"decode_tokens_per_s"`
	DecodeTokensPerSUnchecked float64 `json:"decode_tokens_per_s_unchecked"`
	TagCheckCost              float64 `json:"tag_check_cost"`
	PagedOverContiguous       float64 `json:"paged_over_contiguous"`
	// ContiguousTokensPerS is the baseline behind PagedOverContiguous.
	ContiguousTokensPerS float64 `json:"-"`
}

// StoriesShape is llama2.c's stories15M architecture (dim 288, 6 layers, 6
// heads, seq 256, its 32000-token vocabulary, shared classifier).
var StoriesShape = llama.Config{Dim: 288, HiddenDim: 768, Layers: 6, Heads: 6, KVHeads: 6, Vocab: 32000, SeqLen: 256, SharedClassifier: true}

// Run measures m on backends that newBackend makes: one for the paged cache
// (checked and unchecked share it), one for the contiguous one.
func Run(name string, m *llama.Model, newBackend func() (backend.Backend, error), cfg Config) (Row, error) {
	if cfg.Prompt < 1 || cfg.Decode < 1 || cfg.PageTokens < 1 || cfg.Rounds < 1 || cfg.Prompt+cfg.Decode > m.SeqLen {
		return Row{}, fmt.Errorf("measure: prompt %d + decode %d must fit the context of %d; pages and rounds positive", cfg.Prompt, cfg.Decode, m.SeqLen)
	}
	ctx := cfg.Prompt + cfg.Decode
	g := engine.GeometryOf(m.Config, cfg.PageTokens)
	paged, err := kv.New(g, g.PagesFor(ctx))
	if err != nil {
		return Row{}, err
	}
	cg := engine.GeometryOf(m.Config, m.SeqLen)
	contiguous, err := kv.New(cg, 1)
	if err != nil {
		return Row{}, err
	}
	mk := func(c *kv.Cache, opts engine.Options) (*engine.Engine, error) {
		b, err := newBackend()
		if err != nil {
			return nil, err
		}
		return engine.New(m, b, c, opts)
	}
	checked, err := mk(paged, engine.Options{})
	if err != nil {
		return Row{}, err
	}
	defer checked.Backend().Close()
	// The same backend, scratch and all: only the check differs.
	unchecked := checked.WithOptions(engine.Options{Research: research.On(research.NoTagCheck)})
	flat, err := mk(contiguous, engine.Options{})
	if err != nil {
		return Row{}, err
	}
	defer flat.Backend().Close()
	const id = protocol.RequestID(1)
	refs, err := paged.Pool().Allocate(id, paged.Pages())
	if err != nil {
		return Row{}, err
	}
	flatRefs, err := contiguous.Pool().Allocate(id, 1)
	if err != nil {
		return Row{}, err
	}
	tokens := make([]int, ctx)
	for i := range tokens {
		tokens[i] = (i*7919 + 13) % m.Vocab
	}
	prefill := func(e *engine.Engine, table kv.Table) (time.Duration, error) {
		start := time.Now()
		_, err := e.Prefill(table, tokens[:cfg.Prompt])
		return time.Since(start), err
	}
	row := Row{Model: name, Backend: checked.Backend().Name()}
	// Warm up: the prompt's KV in both caches, scratch grown.
	if _, err := prefill(flat, kv.Table(flatRefs)); err != nil {
		return Row{}, err
	}
	runs := []struct {
		e     *engine.Engine
		table kv.Table
	}{{checked, kv.Table(refs)}, {unchecked, kv.Table(refs)}, {flat, kv.Table(flatRefs)}}
	// best[v][i]: the fastest step of variant v at decode position i over
	// every round. The variants alternate at every position, so load that
	// drifts during a run hits them alike, in orders that cycle through all
	// six permutations. A step is faster right after one on the same backend
	// and pages (the paged variants share them), so each timed step runs
	// right after the same step untimed: every variant is timed warm.
	orders := [][3]int{{0, 1, 2}, {1, 0, 2}, {2, 0, 1}, {0, 2, 1}, {1, 2, 0}, {2, 1, 0}}
	best := make([][]time.Duration, len(runs))
	for v := range best {
		best[v] = make([]time.Duration, cfg.Decode)
	}
	var bestPrefill time.Duration
	for r := 0; r < cfg.Rounds; r++ {
		p, err := prefill(checked, kv.Table(refs))
		if err != nil {
			return Row{}, err
		}
		if r == 0 || p < bestPrefill {
			bestPrefill = p
		}
		for i := 0; i < cfg.Decode; i++ {
			pos := cfg.Prompt + i
			for _, v := range orders[(i+r)%len(orders)] {
				if _, err := runs[v].e.Step(runs[v].table, tokens[pos:pos+1], pos); err != nil {
					return Row{}, err
				}
				start := time.Now()
				if _, err := runs[v].e.Step(runs[v].table, tokens[pos:pos+1], pos); err != nil {
					return Row{}, err
				}
				if d := time.Since(start); r == 0 || d < best[v][i] {
					best[v][i] = d
				}
			}
		}
	}
	rate := func(steps []time.Duration) float64 {
		var sum time.Duration
		for _, d := range steps {
			sum += d
		}
		return float64(len(steps)) / sum.Seconds()
	}
	row.PrefillTokensPerS = float64(cfg.Prompt) / bestPrefill.Seconds()
	row.DecodeTokensPerS, row.DecodeTokensPerSUnchecked, row.ContiguousTokensPerS = rate(best[0]), rate(best[1]), rate(best[2])
	row.TagCheckCost = 1 - row.DecodeTokensPerS/row.DecodeTokensPerSUnchecked
	row.PagedOverContiguous = row.DecodeTokensPerS / row.ContiguousTokensPerS
	return row, nil
}

// Models are the models kvhandoff bench engine measures: the built-in one
// and a stories15M-shaped checkpoint with seeded random weights, written and
// read back by the checkpoint code, with configurations sized to each.
func Models() ([]Named, error) {
	stories, err := llama.Alloc(StoriesShape)
	if err != nil {
		return nil, err
	}
	llama.Randomize(stories, 15)
	stories, err = roundTrip(stories)
	if err != nil {
		return nil, err
	}
	return []Named{
		{"builtin", llama.Builtin(1), Config{Prompt: 256, Decode: 128, PageTokens: 16, Rounds: 5}},
		{"stories15M-shape", stories, Config{Prompt: 128, Decode: 128, PageTokens: 16, Rounds: 5}},
	}, nil
}

// Named is a model to measure, with its sizes.
type Named struct {
	Name   string
	Model  *llama.Model
	Config Config
}
