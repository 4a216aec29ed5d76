package cpu

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
)

// matmul's blocked paths (four rows for one token, one row for four tokens,
// and the remainders) compute the plain product.
func TestMatmulEqualsThePlainProduct(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	b := New()
	for _, c := range []struct{ T, n, d int }{{1, 7, 9}, {1, 64, 300}, {5, 33, 6}, {9, 128, 257}} {
		x, w := make([]float32, c.T*c.n), make([]float32, c.d*c.n)
		for i := range x {
			x[i] = float32(rng.NormFloat64())
		}
		for i := range w {
			w[i] = float32(rng.NormFloat64())
		}
		out := make([]float32, c.T*c.d)
		b.matmul(out, x, w, c.T, c.n, c.d)
		for tk := 0; tk < c.T; tk++ {
			for i := 0; i < c.d; i++ {
				var want float64
				for j := 0; j < c.n; j++ {
					want += float64(w[i*c.n+j]) * float64(x[tk*c.n+j])
				}
				if d := float64(out[tk*c.d+i]) - want; d > 1e-3 || d < -1e-3 {
					t.Fatalf("%+v: out[%d][%d] = %g, want %g", c, tk, i, out[tk*c.d+i], want)
				}
			}
		}
	}
}

func BenchmarkMatvecStoriesClassifier(b *testing.B) {
	bk := New()
	x, w, out := make([]float32, 288), make([]float32, 32000*288), make([]float32, 32000)
	for i := 0; i < b.N; i++ {
		bk.matmul(out, x, w, 1, 288, 32000)
	}
	b.SetBytes(int64(len(w) * 4))
}

func BenchmarkMatmulPrefill64(b *testing.B) {
	bk := New()
	x, w, out := make([]float32, 64*288), make([]float32, 768*288), make([]float32, 64*768)
	for i := 0; i < b.N; i++ {
		bk.matmul(out, x, w, 64, 288, 768)
	}
	b.ReportMetric(float64(64*288*768)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GMAC/s")
}

func BenchmarkMatvec(b *testing.B) {
	bk := New()
	x, w, out := make([]float32, 288), make([]float32, 768*288), make([]float32, 768)
	for i := 0; i < b.N; i++ {
		bk.matmul(out, x, w, 1, 288, 768)
	}
	b.ReportMetric(float64(288*768)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GMAC/s")
}

// BenchmarkAttentionTagCheck isolates where the check lives: one decode
// step's attention over 16 pages (stories15M's shape, position 255), with the
// check and without, interleaved, the fastest of each over b.N rounds. It
// reports the check's cost as a fraction of attention alone, an upper bound
// on its share of a whole decode step.
func BenchmarkAttentionTagCheck(b *testing.B) {
	m, _ := llama.Alloc(llama.Config{Dim: 288, HiddenDim: 768, Layers: 6, Heads: 6, KVHeads: 6, Vocab: 512, SeqLen: 256})
	llama.Randomize(m, 1)
	bk := New()
	if err := bk.Load(m); err != nil {
		b.Fatal(err)
	}
	c, _ := kv.New(kv.Geometry{Layers: 6, KVHeads: 6, HeadDim: 48, PageTokens: 16}, 16)
	if err := bk.AttachPool(c); err != nil {
		b.Fatal(err)
	}
	refs, _ := c.Pool().Allocate(1, 16)
	table := kv.Table(refs)
	pages, epochs := make([]uint32, 16), make([]uint64, 16)
	for i, r := range refs {
		pages[i], epochs[i] = r.Page, r.Epoch
	}
	bk.SetEpochs(pages, epochs)
	for _, ref := range table {
		bk.pages = append(bk.pages, c.Floats(ref.Page))
	}
	bk.q, bk.xb, bk.att = make([]float32, 288), make([]float32, 288), make([]float32, 6*256)
	var best [2]time.Duration
	for i := 0; i < b.N; i++ {
		for _, check := range []bool{i%2 == 0, i%2 == 1} {
			start := time.Now()
			for l := 0; l < 6; l++ {
				if err := bk.attention(l, 255, 1, table, check); err != nil {
					b.Fatal(err)
				}
			}
			d := time.Since(start)
			idx := 0
			if !check {
				idx = 1
			}
			if best[idx] == 0 || d < best[idx] {
				best[idx] = d
			}
		}
	}
	b.ReportMetric(1-float64(best[1])/float64(best[0]), "check-cost")
}

// Forward called directly (not through the engine) refuses a table naming a
// page outside the pool, a step past the context, and bad tokens, with errors.
func TestForwardRefusesBadStepsWithoutPanicking(t *testing.T) {
	m, _ := llama.Alloc(llama.Config{Dim: 16, HiddenDim: 16, Layers: 1, Heads: 2, KVHeads: 1, Vocab: 8, SeqLen: 8})
	bk := New()
	bk.Load(m)
	c, _ := kv.New(kv.Geometry{Layers: 1, KVHeads: 1, HeadDim: 8, PageTokens: 4}, 2)
	bk.AttachPool(c)
	logits := make([]float32, 8)
	for name, s := range map[string]backend.Step{
		"page outside":  {Tokens: []int{1}, Table: kv.Table{{Page: 5}}, Logits: logits},
		"past context":  {Tokens: []int{1}, Pos: 8, Table: kv.Table{{Page: 0}, {Page: 1}, {Page: 0}}, Logits: logits},
		"bad token":     {Tokens: []int{8}, Table: kv.Table{{Page: 0}}, Logits: logits},
		"short logits":  {Tokens: []int{1}, Table: kv.Table{{Page: 0}}, Logits: logits[:3]},
		"short table":   {Tokens: []int{1, 2, 3, 4, 5}, Table: kv.Table{{Page: 0}}, Logits: logits},
		"negative pos":  {Tokens: []int{1}, Pos: -1, Table: kv.Table{{Page: 0}}, Logits: logits},
		"stale written": {Tokens: []int{1}, Table: kv.Table{{Page: 0, Epoch: 3}}, Logits: logits},
	} {
		if err := bk.Forward(&s); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}
