//go:build cuda || cudaemu

package cuda

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
)

func randomModel(t testing.TB, c llama.Config, seed uint64) *llama.Model {
	t.Helper()
	m, err := llama.Alloc(c)
	if err != nil {
		t.Fatal(err)
	}
	llama.Randomize(m, seed)
	return m
}

// pair is the same model on both backends, each over its own cache.
type pair struct {
	cpu, gpu *engine.Engine
}

func newPair(t testing.TB, m *llama.Model, pageTokens, pages int, opts engine.Options) pair {
	t.Helper()
	mk := func(b backend.Backend) *engine.Engine {
		cache, err := kv.New(engine.GeometryOf(m.Config, pageTokens), pages)
		if err != nil {
			t.Fatal(err)
		}
		e, err := engine.New(m, b, cache, opts)
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	g := openTest(t)
	t.Cleanup(func() {
		if err := g.Close(); err != nil {
			t.Error(err)
		}
	})
	return pair{cpu: mk(cpu.New()), gpu: mk(g)}
}

func allocate(t testing.TB, e *engine.Engine, id protocol.RequestID, positions int) kv.Table {
	t.Helper()
	refs, err := e.Cache().Pool().Allocate(id, e.Cache().Geometry().PagesFor(positions))
	if err != nil {
		t.Fatal(err)
	}
	return kv.Table(refs)
}

// closeLogits fails unless a and b agree within tol of the larger magnitude (float32 sums
// in another order).
func closeLogits(t *testing.T, what string, a, b []float32, tol float64) {
	t.Helper()
	scale := 1.0
	for _, v := range a {
		scale = max(scale, math.Abs(float64(v)))
	}
	for i := range a {
		if d := math.Abs(float64(a[i]) - float64(b[i])); d > tol*scale || math.IsNaN(float64(b[i])) {
			t.Fatalf("%s: logit %d: cpu %g, cuda %g", what, i, a[i], b[i])
		}
	}
}

// The CUDA backend generates the CPU backend's tokens for the same prompts, with prefill
// logits within 1e-4 of the largest: grouped and ungrouped kv heads, shared and unshared
// classifiers, full and partial rotary, widths that are not multiples of the tile, prompts
// shorter than a page and spanning several, short steps (one warp per row) and long ones
// (the tiled matmul).
func TestBothBackendsGiveTheSameTokens(t *testing.T) {
	configs := []llama.Config{
		{Dim: 48, HiddenDim: 112, Layers: 2, Heads: 6, KVHeads: 2, Vocab: 70, SeqLen: 48},
		{Dim: 32, HiddenDim: 64, Layers: 2, Heads: 4, KVHeads: 4, Vocab: 50, SeqLen: 40, SharedClassifier: true},
		{Dim: 64, HiddenDim: 96, Layers: 1, Heads: 2, KVHeads: 1, Vocab: 40, SeqLen: 40, RotaryDims: 16},
		// Widths that are not multiples of the matmul's tile of 16, a head size not of 4.
		{Dim: 40, HiddenDim: 72, Layers: 2, Heads: 4, KVHeads: 2, Vocab: 45, SeqLen: 40},
	}
	prompts := [][]int{
		{7},
		{1, 17, 3},
		{1, 17, 3, 33, 8, 29, 2, 11, 31, 5, 19},
		{4, 4, 4, 4, 9, 9, 9, 9, 2, 2, 2, 2, 30, 31, 32, 33, 34, 35, 36, 37, 1},
	}
	const pageTokens, n = 5, 10
	for ci, c := range configs {
		m := randomModel(t, c, uint64(11+ci))
		p := newPair(t, m, pageTokens, 16, engine.Options{})
		for pi, prompt := range prompts {
			ct := allocate(t, p.cpu, 1, len(prompt)+n)
			gt := allocate(t, p.gpu, 1, len(prompt)+n)
			cl, err := p.cpu.Prefill(ct, prompt)
			if err != nil {
				t.Fatal(err)
			}
			cl = append([]float32(nil), cl...)
			gl, err := p.gpu.Prefill(gt, prompt)
			if err != nil {
				t.Fatal(err)
			}
			closeLogits(t, "prefill", cl, gl, 1e-4)
			want, err := p.cpu.Generate(ct, prompt, n, llama.Greedy(), -1)
			if err != nil {
				t.Fatal(err)
			}
			got, err := p.gpu.Generate(gt, prompt, n, llama.Greedy(), -1)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != n || len(want) != n {
				t.Fatalf("config %d prompt %d: %d and %d tokens, want %d", ci, pi, len(want), len(got), n)
			}
			for i := range want {
				if got[i] != want[i] {
					t.Fatalf("config %d prompt %d: cuda generated %v, cpu %v", ci, pi, got, want)
				}
			}
			p.cpu.Cache().Pool().Release(1, ct)
			p.gpu.Cache().Pool().Release(1, gt)
		}
	}
}

// At a realistic length: a prompt longer than the backend's launch chunk of 256 tokens (so
// prefill runs in three chunks, each attending over the ones before), over 67 pages, and
// decode past it; two requests in one pool; the same tokens as the CPU.
func TestLongPromptsOverManyPagesGiveTheSameTokens(t *testing.T) {
	m := randomModel(t, llama.Config{Dim: 32, HiddenDim: 48, Layers: 2, Heads: 4, KVHeads: 2, Vocab: 50, SeqLen: 600}, 21)
	const pageTokens, n = 8, 6
	p := newPair(t, m, pageTokens, 2*m.SeqLen/pageTokens, engine.Options{})
	rng := rand.New(rand.NewPCG(3, 4))
	prompts := make([][]int, 2)
	for i := range prompts {
		prompts[i] = make([]int, 530+7*i)
		for j := range prompts[i] {
			prompts[i][j] = rng.IntN(m.Vocab)
		}
	}
	var want, got [2][]int
	for i, prompt := range prompts {
		ct := allocate(t, p.cpu, protocol.RequestID(i+1), len(prompt)+n)
		gt := allocate(t, p.gpu, protocol.RequestID(i+1), len(prompt)+n)
		var err error
		if want[i], err = p.cpu.Generate(ct, prompt, n, llama.Greedy(), -1); err != nil {
			t.Fatal(err)
		}
		if got[i], err = p.gpu.Generate(gt, prompt, n, llama.Greedy(), -1); err != nil {
			t.Fatal(err)
		}
		if len(got[i]) != n || !slices.Equal(got[i], want[i]) {
			t.Fatalf("prompt %d of %d tokens: cuda generated %v, cpu %v", i, len(prompt), got[i], want[i])
		}
	}
}

// A request whose page was freed and given to another request fails at its next step with a
// *kv.TagError naming that page, on the CUDA backend as on the CPU one; with the tag check off
// (no-tag-check), the step reads the other request's KV and succeeds silently, which is what
// the check prevents.
func TestAStalePageFailsTheStepNamingIt(t *testing.T) {
	m := randomModel(t, llama.Config{Dim: 32, HiddenDim: 64, Layers: 2, Heads: 4, KVHeads: 2, Vocab: 50, SeqLen: 40}, 3)
	for _, unchecked := range []bool{false, true} {
		opts := engine.Options{}
		if unchecked {
			opts.Research = research.On(research.NoTagCheck)
		}
		p := newPair(t, m, 4, 8, opts)
		for _, e := range []*engine.Engine{p.cpu, p.gpu} {
			prompt := []int{3, 1, 4, 1, 5, 9, 2, 6, 5, 3}
			table := allocate(t, e, 1, len(prompt)+4)
			if _, err := e.Prefill(table, prompt); err != nil {
				t.Fatal(err)
			}
			// Page 1 of the table goes back to the pool and to request 2.
			pool := e.Cache().Pool()
			pool.Release(1, table[1:2])
			other := allocate(t, e, 2, 4)
			if other[0].Page != table[1].Page {
				t.Fatalf("%s: the pool gave request 2 page %d, not the freed page %d", e.Backend().Name(), other[0].Page, table[1].Page)
			}
			if _, err := e.Prefill(other, []int{7, 7, 7, 7}); err != nil {
				t.Fatal(err)
			}
			_, err := e.Step(table, []int{8}, len(prompt))
			if unchecked {
				if err != nil {
					t.Fatalf("%s: unchecked step over a stale page: %v", e.Backend().Name(), err)
				}
				continue
			}
			var te *kv.TagError
			if !errors.As(err, &te) || !errors.Is(err, protocol.ErrTagMismatch) {
				t.Fatalf("%s: step over a stale page: %v, want a *kv.TagError", e.Backend().Name(), err)
			}
			if te.Index != 1 || te.Page != table[1].Page || te.Held != table[1].Epoch || te.Current != other[0].Epoch {
				t.Fatalf("%s: %+v, want index 1, page %d, held %d, current %d", e.Backend().Name(), te, table[1].Page, table[1].Epoch, other[0].Epoch)
			}
		}
	}
}

// When a step's table has stale pages both among those it writes and those it only reads, the
// error names the first written one, on both backends (the CPU backend checks the pages it
// writes before anything else; the CUDA backend's status word 0 is reported first).
func TestTheWrittenStalePageIsReportedFirst(t *testing.T) {
	m := randomModel(t, llama.Config{Dim: 32, HiddenDim: 64, Layers: 1, Heads: 4, KVHeads: 2, Vocab: 50, SeqLen: 40}, 9)
	p := newPair(t, m, 4, 6, engine.Options{})
	for _, e := range []*engine.Engine{p.cpu, p.gpu} {
		table := allocate(t, e, 1, 12)
		if _, err := e.Prefill(table, []int{1, 2, 3, 4, 5, 6, 7, 8}); err != nil {
			t.Fatal(err)
		}
		pool := e.Cache().Pool()
		pool.Release(1, []protocol.PageRef{table[0], table[2]})
		allocate(t, e, 2, pool.Free()*4) // every free page, so both come back at new epochs
		var te *kv.TagError
		if _, err := e.Step(table, []int{9}, 8); !errors.As(err, &te) || te.Index != 2 {
			t.Fatalf("%s: step writing stale entry 2 and reading stale entry 0: %v, want entry 2", e.Backend().Name(), err)
		}
	}
}

// A step that would write into a stale page fails before the page changes: the other
// request's KV in it survives.
func TestAStalePageIsNotWritten(t *testing.T) {
	m := randomModel(t, llama.Config{Dim: 32, HiddenDim: 64, Layers: 2, Heads: 4, KVHeads: 2, Vocab: 50, SeqLen: 40}, 5)
	p := newPair(t, m, 4, 8, engine.Options{})
	e := p.gpu
	b := e.Backend()
	table := allocate(t, e, 1, 8)
	if _, err := e.Prefill(table, []int{1, 2, 3, 4}); err != nil {
		t.Fatal(err)
	}
	pool := e.Cache().Pool()
	pool.Release(1, table[1:2])
	other := allocate(t, e, 2, 4)
	if _, err := e.Prefill(other, []int{9, 8, 7, 6}); err != nil {
		t.Fatal(err)
	}
	page := other[0].Page
	if err := b.DownloadPages([]uint32{page}); err != nil {
		t.Fatal(err)
	}
	before := append([]byte(nil), e.Cache().Payload(page)...)
	var te *kv.TagError
	if _, err := e.Step(table, []int{5}, 4); !errors.As(err, &te) || te.Index != 1 {
		t.Fatalf("step writing a stale page: %v, want a TagError at index 1", err)
	}
	if err := b.DownloadPages([]uint32{page}); err != nil {
		t.Fatal(err)
	}
	if string(before) != string(e.Cache().Payload(page)) {
		t.Fatal("the step wrote into a page that failed its tag check")
	}
}

// Pages go to the device and come back byte for byte, in any order, including a pool's worth.
func TestUploadedPagesComeBackUnchanged(t *testing.T) {
	m := randomModel(t, llama.Config{Dim: 32, HiddenDim: 64, Layers: 2, Heads: 4, KVHeads: 2, Vocab: 50, SeqLen: 40}, 5)
	const pages = 300
	p := newPair(t, m, 4, pages, engine.Options{})
	c, b := p.gpu.Cache(), p.gpu.Backend()
	rng := rand.New(rand.NewPCG(1, 2))
	want := make([][]byte, pages)
	for pg := range want {
		f := c.Floats(uint32(pg))
		for i := range f {
			f[i] = rng.Float32()
		}
		want[pg] = append([]byte(nil), c.Payload(uint32(pg))...)
	}
	order := rng.Perm(pages)
	list := make([]uint32, pages)
	for i, pg := range order {
		list[i] = uint32(pg)
	}
	if err := b.UploadPages(list); err != nil {
		t.Fatal(err)
	}
	for pg := range want {
		clear(c.Payload(uint32(pg)))
	}
	if err := b.DownloadPages(list[:7]); err != nil {
		t.Fatal(err)
	}
	if err := b.DownloadPages(list[7:]); err != nil {
		t.Fatal(err)
	}
	for pg := range want {
		if string(c.Payload(uint32(pg))) != string(want[pg]) {
			t.Fatalf("page %d came back changed", pg)
		}
	}
	// Pages outside the pool are refused, not copied.
	if err := b.UploadPages([]uint32{pages}); !errors.Is(err, kv.ErrGeometry) {
		t.Fatalf("upload of page %d of %d: %v", pages, pages, err)
	}
	if err := b.DownloadPages([]uint32{0, pages + 5}); !errors.Is(err, kv.ErrGeometry) {
		t.Fatalf("download of page %d of %d: %v", pages+5, pages, err)
	}
}

// Bad steps are refused with an error before anything reaches the device.
func TestBadStepsAreRefused(t *testing.T) {
	m := randomModel(t, llama.Config{Dim: 32, HiddenDim: 64, Layers: 1, Heads: 4, KVHeads: 2, Vocab: 50, SeqLen: 16}, 5)
	p := newPair(t, m, 4, 4, engine.Options{})
	b := p.gpu.Backend()
	table := allocate(t, p.gpu, 1, 8)
	logits := make([]float32, m.Vocab)
	for name, s := range map[string]backend.Step{
		"no tokens":           {Pos: 0, Table: table, Logits: logits},
		"token outside vocab": {Tokens: []int{50}, Table: table, Logits: logits},
		"negative token":      {Tokens: []int{-1}, Table: table, Logits: logits},
		"negative position":   {Tokens: []int{1}, Pos: -1, Table: table, Logits: logits},
		"past the context":    {Tokens: []int{1}, Pos: 16, Table: table, Logits: logits},
		"table too short":     {Tokens: []int{1, 2, 3, 4, 5}, Table: table[:1], Logits: logits},
		"page outside pool":   {Tokens: []int{1}, Table: kv.Table{{Page: 4, Epoch: 1}}, Logits: logits},
		"logits too short":    {Tokens: []int{1}, Table: table, Logits: logits[:3]},
	} {
		if err := b.Forward(&s); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if err := b.SetEpochs([]uint32{9}, []uint64{1}); !errors.Is(err, kv.ErrGeometry) {
		t.Errorf("SetEpochs of a page outside the pool: %v", err)
	}
	if err := b.SetEpochs([]uint32{1, 2}, []uint64{1}); err == nil {
		t.Error("SetEpochs with more pages than epochs: accepted")
	}
}

// After Close every method refuses with ErrOrder, and a second Close does nothing.
func TestAClosedBackendRefusesEverything(t *testing.T) {
	m := randomModel(t, llama.Config{Dim: 32, HiddenDim: 64, Layers: 1, Heads: 4, KVHeads: 2, Vocab: 50, SeqLen: 16}, 5)
	b := openTest(t)
	cache, err := kv.New(engine.GeometryOf(m.Config, 4), 4)
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.New(m, b, cache, engine.Options{})
	if err != nil {
		t.Fatal(err)
	}
	table := allocate(t, e, 1, 4)
	if _, err := e.Prefill(table, []int{1, 2}); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	logits := make([]float32, m.Vocab)
	for name, err := range map[string]error{
		"Load":          b.Load(m),
		"AttachPool":    b.AttachPool(cache),
		"SetEpochs":     b.SetEpochs([]uint32{0}, []uint64{1}),
		"Forward":       b.Forward(&backend.Step{Tokens: []int{3}, Pos: 2, Table: table, Logits: logits}),
		"UploadPages":   b.UploadPages([]uint32{0}),
		"DownloadPages": b.DownloadPages([]uint32{0}),
	} {
		if !errors.Is(err, ErrOrder) {
			t.Errorf("%s after Close: %v, want ErrOrder", name, err)
		}
	}
}
