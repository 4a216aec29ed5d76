package cpu

import (
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
)

// paths runs f on the vector kernels (where the CPU has them) and on the
// pure-Go products, restoring the selection after.
func paths(f func(name string)) {
	saved := simd
	defer func() { simd = saved }()
	for _, on := range []bool{true, false} {
		if on && !saved {
			continue
		}
		simd = on
		name := "go"
		if on {
			name = "simd"
		}
		f(name)
	}
}

// The products of stories15M's shapes, one thread: the classifier's matvec
// (32000x288, 37 MB, from memory), a layer's FFN matvec (768x288, from
// cache) and a 64-token prefill product, on both paths, in multiply-adds per
// CPU-second of the process, the weights on huge pages where Linux allows.
func BenchmarkMatmul(b *testing.B) {
	for _, c := range []struct {
		name    string
		T, n, d int
	}{{"classifier", 1, 288, 32000}, {"matvec", 1, 288, 768}, {"prefill64", 64, 288, 768}} {
		paths(func(path string) {
			b.Run(c.name+"/"+path, func(b *testing.B) {
				bk := NewThreads(1)
				x, w, out := make([]float32, c.T*c.n), make([]float32, c.d*c.n), make([]float32, c.T*c.d)
				adviseHugePages(w) // as Load does a model's weights
				for i := range w {
					w[i] = float32(i%7) - 3
				}
				for i := range x {
					x[i] = float32(i%5) - 2
				}
				bk.matmul(out, x, w, c.T, c.n, c.d)
				start := cpuTime()
				for b.Loop() {
					bk.matmul(out, x, w, c.T, c.n, c.d)
				}
				b.ReportMetric(float64(c.T*c.n*c.d)*float64(b.N)/(cpuTime()-start).Seconds()/1e9, "GMAC/CPU-s")
			})
		})
	}
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

// On one thread a decode step allocates nothing: the products and attention
// run on the caller's goroutine with no closure for a split that does not
// happen, and the scratch buffers are kept from the step before.
func TestOneThreadDecodeStepAllocatesNothing(t *testing.T) {
	m, _ := llama.Alloc(llama.Config{Dim: 288, HiddenDim: 768, Layers: 2, Heads: 6, KVHeads: 2, Vocab: 512, SeqLen: 64})
	llama.Randomize(m, 2)
	bk := NewThreads(1)
	if err := bk.Load(m); err != nil {
		t.Fatal(err)
	}
	c, _ := kv.New(kv.Geometry{Layers: 2, KVHeads: 2, HeadDim: 48, PageTokens: 16}, 4)
	if err := bk.AttachPool(c); err != nil {
		t.Fatal(err)
	}
	refs, _ := c.Pool().Allocate(1, 4)
	for _, r := range refs {
		if err := bk.SetEpochs([]uint32{r.Page}, []uint64{r.Epoch}); err != nil {
			t.Fatal(err)
		}
	}
	logits := make([]float32, 512)
	step := backend.Step{Tokens: []int{7}, Table: kv.Table(refs), Logits: logits}
	for step.Pos = 0; step.Pos < 40; step.Pos++ { // the buffers grow to the longest step
		if err := bk.Forward(&step); err != nil {
			t.Fatal(err)
		}
	}
	if n := testing.AllocsPerRun(20, func() {
		if err := bk.Forward(&step); err != nil {
			t.Fatal(err)
		}
	}); n != 0 {
		t.Fatalf("a one-thread decode step allocates %v times", n)
	}
}
