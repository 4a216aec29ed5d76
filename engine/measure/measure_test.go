package measure

import (
	"testing"

	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/llama"
)

func newCPU() (backend.Backend, error) { return cpu.New(), nil }

// A small run produces every figure, positive and finite, and the ratios are
// the ratios of the figures.
func TestRunReportsEveryFigure(t *testing.T) {
	m, _ := llama.Alloc(llama.Config{Dim: 32, HiddenDim: 64, Layers: 2, Heads: 4, KVHeads: 2, Vocab: 50, SeqLen: 64})
	llama.Randomize(m, 1)
	r, err := Run("small", m, newCPU, Config{Prompt: 20, Decode: 10, PageTokens: 4, Rounds: 2})
	if err != nil {
		t.Fatal(err)
	}
	if r.PrefillTokensPerS <= 0 || r.DecodeTokensPerS <= 0 || r.DecodeTokensPerSUnchecked <= 0 || r.ContiguousTokensPerS <= 0 {
		t.Fatalf("%+v", r)
	}
	if r.TagCheckCost != 1-r.DecodeTokensPerS/r.DecodeTokensPerSUnchecked || r.PagedOverContiguous != r.DecodeTokensPerS/r.ContiguousTokensPerS {
		t.Fatalf("ratios do not match the figures: %+v", r)
	}
	if _, err := Run("small", m, newCPU, Config{Prompt: 60, Decode: 10, PageTokens: 4, Rounds: 1}); err == nil {
		t.Fatal("a run past the context was accepted")
	}
}

// BenchmarkEngine reports each model's figures, as kvhandoff bench engine
// prints them in JSON: one Run per iteration, the last one's figures.
func BenchmarkEngine(b *testing.B) {
	models, err := Models()
	if err != nil {
		b.Fatal(err)
	}
	for _, n := range models {
		b.Run(n.Name, func(b *testing.B) {
			var r Row
			for i := 0; i < b.N; i++ {
				if r, err = Run(n.Name, n.Model, newCPU, n.Config); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(r.PrefillTokensPerS, "prefill-tokens/s")
			b.ReportMetric(r.DecodeTokensPerS, "decode-tokens/s")
			b.ReportMetric(r.DecodeTokensPerSUnchecked, "unchecked-decode-tokens/s")
			b.ReportMetric(r.TagCheckCost, "tag-check-cost")
			b.ReportMetric(r.PagedOverContiguous, "paged/contiguous")
		})
	}
}
