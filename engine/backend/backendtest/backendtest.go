// Package backendtest is the conformance suite every engine backend passes:
// the same tokens and logits as the CPU backend on the same prompts, the
// read-time tag check failing a stale page by name, and, with the check off,
// the stale page's content read as the CPU backend reads it. The CUDA
// backend runs it from its own cuda-tagged test where a GPU is.
package backendtest

import (
	"errors"
	"math"
	"testing"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// Tolerance is how far a backend's logits may be from the CPU backend's.
const Tolerance = 1e-3

// Models are the models the suite runs: grouped and ungrouped kv heads,
// shared and unshared classifiers, partial rotary (the built-in model).
func Models() map[string]*llama.Model {
	out := map[string]*llama.Model{"builtin": llama.Builtin(1)}
	for name, c := range map[string]llama.Config{
		"gqa":    {Dim: 64, HiddenDim: 160, Layers: 3, Heads: 8, KVHeads: 2, Vocab: 300, SeqLen: 96},
		"shared": {Dim: 48, HiddenDim: 96, Layers: 2, Heads: 4, KVHeads: 4, Vocab: 100, SeqLen: 96, SharedClassifier: true},
	} {
		m, err := llama.Alloc(c)
		if err != nil {
			panic(err)
		}
		llama.Randomize(m, 11)
		out[name] = m
	}
	return out
}

func newEngine(t *testing.T, m *llama.Model, b backend.Backend, pageTokens, pages int, opts engine.Options) *engine.Engine {
	t.Helper()
	c, err := kv.New(engine.GeometryOf(m.Config, pageTokens), pages)
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.New(m, b, c, opts)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// Conformance runs the suite on backends newBackend makes.
func Conformance(t *testing.T, newBackend func() (backend.Backend, error)) {
	mk := func(t *testing.T) backend.Backend {
		b, err := newBackend()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Close() })
		return b
	}
	for name, m := range Models() {
		t.Run("same-tokens-as-cpu/"+name, func(t *testing.T) { sameTokens(t, m, mk(t)) })
	}
	t.Run("stale-page-fails-by-name", func(t *testing.T) { stalePage(t, mk(t), engine.Options{}) })
	t.Run("unchecked-reads-the-stale-page", func(t *testing.T) {
		stalePage(t, mk(t), engine.Options{Research: research.On(research.NoTagCheck)})
	})
}

// sameTokens: prefill as one step, then greedy decode, against the CPU
// backend step by step.
func sameTokens(t *testing.T, m *llama.Model, b backend.Backend) {
	const pageTokens, n = 7, 30
	want := newEngine(t, m, cpu.New(), pageTokens, 16, engine.Options{})
	got := newEngine(t, m, b, pageTokens, 16, engine.Options{})
	prompt := make([]int, 41)
	for i := range prompt {
		prompt[i] = (i*31 + 5) % m.Vocab
	}
	refs, _ := want.Cache().Pool().Allocate(1, 16)
	grefs, _ := got.Cache().Pool().Allocate(1, 16)
	wl, err := want.Prefill(kv.Table(refs), prompt)
	if err != nil {
		t.Fatal(err)
	}
	gl, err := got.Prefill(kv.Table(grefs), prompt)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < n; i++ {
		for v := range wl {
			if d := math.Abs(float64(wl[v] - gl[v])); d > Tolerance || math.IsNaN(float64(gl[v])) {
				t.Fatalf("step %d, logit %d: %g, cpu %g", i, v, gl[v], wl[v])
			}
		}
		tok, gtok := llama.Argmax(wl), llama.Argmax(gl)
		if tok != gtok {
			t.Fatalf("token %d: %d, cpu %d", i, gtok, tok)
		}
		pos := len(prompt) + i
		if wl, err = want.Step(kv.Table(refs), []int{tok}, pos); err != nil {
			t.Fatal(err)
		}
		if gl, err = got.Step(kv.Table(grefs), []int{tok}, pos); err != nil {
			t.Fatal(err)
		}
	}
}

// stalePage: request 2 prefills into three pages, its second page is freed
// and written for request 1, then request 2 decodes through its old table.
// Checked, the step fails naming the page; unchecked, it reads request 1's
// KV exactly as the CPU backend does, and answers request 1's secret.
func stalePage(t *testing.T, b backend.Backend, opts engine.Options) {
	m := llama.Builtin(2)
	run := func(b backend.Backend) ([]int, protocol.PageRef, error) {
		e := newEngine(t, m, b, 16, 6, opts)
		pool, tok := e.Cache().Pool(), llama.Bytes{}
		promptB := tok.Encode("B's own words, then the question: the secret=", true, false)
		refsB, _ := pool.Allocate(2, 4)
		if _, err := e.Prefill(kv.Table(refsB), promptB[:len(promptB)-1]); err != nil {
			t.Fatal(err)
		}
		pool.Release(2, refsB[1:2])
		refsA, _ := pool.Allocate(1, 1)
		if _, err := e.Prefill(kv.Table(refsA), tok.Encode("secret=Zq81-k", true, false)); err != nil {
			t.Fatal(err)
		}
		out, err := e.Decode(kv.Table(refsB), promptB, 6, llama.Greedy(), -1)
		return out, refsB[1], err
	}
	out, stale, err := run(b)
	if !opts.Research.Has(research.NoTagCheck) {
		var te *kv.TagError
		if !errors.As(err, &te) || !errors.Is(err, protocol.ErrTagMismatch) || te.Page != stale.Page || te.Index != 1 ||
			te.Held != stale.Epoch || te.Current != stale.Epoch+1 || len(out) != 0 {
			t.Fatalf("stale read: tokens %v, error %v; want a *kv.TagError for page %d (index 1)", out, err, stale.Page)
		}
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	want, _, _ := run(cpu.New())
	if got := llama.Decode(llama.Bytes{}, out, -1); got != llama.Decode(llama.Bytes{}, want, -1) || got != "Zq81-k" {
		t.Fatalf("unchecked: %q, cpu %q, want the other request's Zq81-k", llama.Decode(llama.Bytes{}, out, -1), llama.Decode(llama.Bytes{}, want, -1))
	}
}
