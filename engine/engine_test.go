package engine_test

import (
	"bytes"
	"errors"
	"math"
	"testing"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// randomModel is a model of config c with seeded random weights.
func randomModel(t testing.TB, c llama.Config, seed uint64) *llama.Model {
	t.Helper()
	m, err := llama.Alloc(c)
	if err != nil {
		t.Fatal(err)
	}
	llama.Randomize(m, seed)
	return m
}

// checkpointRoundTrip writes m with our writer and reads it back with our
// reader, returning the file's bytes too.
func checkpointRoundTrip(t testing.TB, m *llama.Model) (*llama.Model, []byte) {
	t.Helper()
	var buf bytes.Buffer
	if err := llama.WriteCheckpoint(&buf, m); err != nil {
		t.Fatal(err)
	}
	file := buf.Bytes()
	got, err := llama.ReadCheckpoint(bytes.NewReader(file), int64(len(file)))
	if err != nil {
		t.Fatal(err)
	}
	return got, file
}

func newEngine(t testing.TB, m *llama.Model, pageTokens, pages int, opts engine.Options) *engine.Engine {
	t.Helper()
	cache, err := kv.New(engine.GeometryOf(m.Config, pageTokens), pages)
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.New(m, cpu.New(), cache, opts)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// The engine, over a checkpoint that our writer made and our reader read,
// reproduces the reference forward pass's generation token for token, with
// every step's logits within 1e-4: grouped and ungrouped kv heads, shared and
// unshared classifiers, full and partial rotary, pages smaller than the
// prompt and not dividing it.
func TestCheckpointGenerationMatchesTheReferenceForwardPass(t *testing.T) {
	for _, c := range []llama.Config{
		{Dim: 48, HiddenDim: 112, Layers: 3, Heads: 6, KVHeads: 2, Vocab: 70, SeqLen: 48},
		{Dim: 32, HiddenDim: 64, Layers: 2, Heads: 4, KVHeads: 4, Vocab: 50, SeqLen: 40, SharedClassifier: true},
		{Dim: 64, HiddenDim: 96, Layers: 2, Heads: 2, KVHeads: 1, Vocab: 40, SeqLen: 40, RotaryDims: 16},
	} {
		m, file := checkpointRoundTrip(t, randomModel(t, c, 7))
		ref := parseRef(file, c.RotaryDims)
		const pageTokens, n = 5, 24
		e := newEngine(t, m, pageTokens, 16, engine.Options{})
		prompt := []int{1, 17, 3, 33, 8, 29, 2, 11, 31, 5, 19}
		refs, err := e.Cache().Pool().Allocate(1, e.Cache().Geometry().PagesFor(len(prompt)+n))
		if err != nil {
			t.Fatal(err)
		}
		table := kv.Table(refs)
		// The reference: the prompt, then greedy tokens.
		var want []int
		var wantLogits [][]float64
		var logits []float64
		for pos, tok := range prompt {
			logits = ref.forward(tok, pos)
		}
		for pos := len(prompt); len(want) < n; pos++ {
			wantLogits = append(wantLogits, logits)
			tok := refArgmax(logits)
			want = append(want, tok)
			logits = ref.forward(tok, pos)
		}
		// The engine: prefill as one batch, then decode one token at a time.
		got, err := e.Prefill(table, prompt)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < n; i++ {
			for v := range got {
				if d := math.Abs(float64(got[v]) - wantLogits[i][v]); d > 1e-4 {
					t.Fatalf("%+v: step %d, logit %d: %g, reference %g", c, i, v, got[v], wantLogits[i][v])
				}
			}
			tok := llama.Argmax(got)
			if tok != want[i] {
				t.Fatalf("%+v: token %d is %d, reference %d", c, i, tok, want[i])
			}
			if got, err = e.Step(table, []int{tok}, len(prompt)+i); err != nil {
				t.Fatal(err)
			}
		}
		// Generate (prefill all but the last, decode from it) agrees.
		out, err := e.Generate(table, prompt, n, llama.Greedy(), -1)
		if err != nil || !equal(out, want) {
			t.Fatalf("%+v: Generate = %v, %v; want %v", c, out, err, want)
		}
	}
}

func equal(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// Seeded sampling replays: the same seed gives the same tokens, and the
// sampled tokens are not simply the greedy ones.
func TestSeededSamplingReplaysFromItsSeed(t *testing.T) {
	m := randomModel(t, llama.Config{Dim: 32, HiddenDim: 64, Layers: 2, Heads: 4, KVHeads: 2, Vocab: 60, SeqLen: 64}, 3)
	e := newEngine(t, m, 8, 8, engine.Options{})
	refs, _ := e.Cache().Pool().Allocate(1, 8)
	run := func(s *llama.Sampler) []int {
		out, err := e.Generate(kv.Table(refs), []int{1, 2, 3}, 40, s, -1)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	a, b := run(llama.NewSampler(1, 0.9, 42)), run(llama.NewSampler(1, 0.9, 42))
	if !equal(a, b) {
		t.Fatalf("same seed, different tokens:\n%v\n%v", a, b)
	}
	if g := run(llama.Greedy()); equal(a, g) {
		t.Fatalf("sampling at temperature 1 gave the greedy tokens %v", g)
	}
	if c := run(llama.NewSampler(1, 0.9, 43)); equal(a, c) {
		t.Fatalf("seeds 42 and 43 gave the same 40 tokens")
	}
}

// Bad requests get a clear error, never a panic: empty prompt, token outside
// the vocabulary, context longer than the model's, table too short.
func TestBadRequestsAreRefused(t *testing.T) {
	m := randomModel(t, llama.Config{Dim: 16, HiddenDim: 32, Layers: 1, Heads: 2, KVHeads: 1, Vocab: 10, SeqLen: 12}, 1)
	e := newEngine(t, m, 4, 4, engine.Options{})
	refs, _ := e.Cache().Pool().Allocate(1, 2)
	table := kv.Table(refs)
	for name, run := range map[string]func() error{
		"empty prompt":   func() error { _, err := e.Prefill(table, nil); return err },
		"token too big":  func() error { _, err := e.Prefill(table, []int{1, 10}); return err },
		"negative token": func() error { _, err := e.Prefill(table, []int{-1}); return err },
		"table too short": func() error {
			_, err := e.Prefill(table, []int{1, 2, 3, 4, 5, 6, 7, 8, 9})
			return err
		},
		"past the context": func() error {
			all, _ := e.Cache().Pool().Allocate(2, 2)
			_, err := e.Prefill(append(table, all...), make([]int, 13))
			return err
		},
		"page outside the pool": func() error { _, err := e.Prefill(kv.Table{{Page: 9}}, []int{1}); return err },
		"negative position":     func() error { _, err := e.Step(table, []int{1}, -1); return err },
	} {
		if err := run(); !errors.Is(err, engine.ErrBadRequest) && !errors.Is(err, kv.ErrGeometry) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func protocolID(id uint64) protocol.RequestID { return protocol.RequestID(id) }

// A position's KV is bit-identical whether a prefill batch or a single
// decode step computed it, so the decode node's recomputation of the last
// prompt position rewrites the bytes that were verified, unchanged.
func TestDecodeRecomputesTheLastPromptPositionBitForBit(t *testing.T) {
	m := randomModel(t, llama.Config{Dim: 40, HiddenDim: 72, Layers: 2, Heads: 4, KVHeads: 2, Vocab: 30, SeqLen: 64}, 9)
	for _, T := range []int{1, 5, 8, 13} {
		e := newEngine(t, m, 4, 16, engine.Options{})
		refs, _ := e.Cache().Pool().Allocate(1, 16)
		prompt := make([]int, T)
		for i := range prompt {
			prompt[i] = (i * 7) % 30
		}
		if _, err := e.Prefill(kv.Table(refs), prompt); err != nil {
			t.Fatal(err)
		}
		var before [][]byte
		for _, r := range refs {
			before = append(before, bytes.Clone(e.Cache().Payload(r.Page)))
		}
		if _, err := e.Step(kv.Table(refs), prompt[T-1:], T-1); err != nil {
			t.Fatal(err)
		}
		for i, r := range refs {
			if !bytes.Equal(before[i], e.Cache().Payload(r.Page)) {
				t.Fatalf("prompt of %d: page %d changed when decode recomputed position %d", T, i, T-1)
			}
		}
	}
}
