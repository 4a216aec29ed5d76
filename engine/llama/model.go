package llama

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
)

// Config is a model's architecture.
type Config struct {
	Dim       int // residual stream width
	HiddenDim int // feed-forward width
	Layers    int
	Heads     int // query heads
	KVHeads   int // key/value heads; Heads is a multiple of it
	Vocab     int
	SeqLen    int // longest context
	// SharedClassifier: the output classifier is the token embedding
	// (llama2.c's positive vocab_size).
	SharedClassifier bool
	// RotaryDims is how many of each head's leading dimensions rotary
	// positions rotate, in pairs; 0 means all of them (llama2.c). The rest
	// carry no position, which the built-in model's copy head relies on.
	RotaryDims int
}

// NormEps is RMSNorm's epsilon, llama2.c's.
const NormEps = 1e-5

// RopeTheta is the base of the rotary frequencies, llama2.c's.
const RopeTheta = 10000

// ErrConfig: an architecture that cannot be run.
var ErrConfig = errors.New("model: invalid config")

// HeadDim is the width of one head.
func (c Config) HeadDim() int { return c.Dim / c.Heads }

// KVDim is the width of one position's keys (or values).
func (c Config) KVDim() int { return c.KVHeads * c.HeadDim() }

// Rotary is the number of rotated dimensions per head.
func (c Config) Rotary() int {
	if c.RotaryDims == 0 {
		return c.HeadDim()
	}
	return c.RotaryDims
}

// maxDim bounds every size so that counts fit in int32 and a hostile header
// cannot make the reader allocate without limit (the reader also checks the
// file's size against the header before it allocates).
const maxDim = 1 << 24

// Validate checks that the architecture is runnable.
func (c Config) Validate() error {
	for _, f := range []struct {
		name string
		v    int
	}{{"dim", c.Dim}, {"hidden_dim", c.HiddenDim}, {"n_layers", c.Layers}, {"n_heads", c.Heads},
		{"n_kv_heads", c.KVHeads}, {"vocab_size", c.Vocab}, {"seq_len", c.SeqLen}} {
		if f.v <= 0 || f.v > maxDim {
			return fmt.Errorf("%w: %s = %d", ErrConfig, f.name, f.v)
		}
	}
	switch {
	case c.Dim%c.Heads != 0:
		return fmt.Errorf("%w: dim %d is not a multiple of n_heads %d", ErrConfig, c.Dim, c.Heads)
	case c.Heads%c.KVHeads != 0:
		return fmt.Errorf("%w: n_heads %d is not a multiple of n_kv_heads %d", ErrConfig, c.Heads, c.KVHeads)
	case c.HeadDim()%2 != 0:
		return fmt.Errorf("%w: head size %d is odd (rotary works in pairs)", ErrConfig, c.HeadDim())
	case c.RotaryDims < 0 || c.RotaryDims > c.HeadDim() || c.RotaryDims%2 != 0:
		return fmt.Errorf("%w: rotary dims %d for head size %d", ErrConfig, c.RotaryDims, c.HeadDim())
	}
	return nil
}

// Weights are a model's parameters in llama2.c's order. Per-layer arrays are
// the layers' matrices one after the other.
type Weights struct {
	TokenEmbedding []float32 // (vocab, dim)
	RMSAttention   []float32 // (layers, dim)
	WQ             []float32 // (layers, dim, dim): (out, in)
	WK             []float32 // (layers, kvDim, dim)
	WV             []float32 // (layers, kvDim, dim)
	WO             []float32 // (layers, dim, dim)
	RMSFFN         []float32 // (layers, dim)
	W1             []float32 // (layers, hidden, dim): gate
	W2             []float32 // (layers, dim, hidden): down
	W3             []float32 // (layers, hidden, dim): up
	RMSFinal       []float32 // (dim)
	Classifier     []float32 // (vocab, dim); the embedding itself when shared
}

// Model is an architecture with its weights.
type Model struct {
	Config
	Weights
}

// arrays lists the weight arrays in checkpoint order with their sizes.
func (m *Model) arrays() []struct {
	p *[]float32
	n int
} {
	c := m.Config
	d, h, l, kv := c.Dim, c.HiddenDim, c.Layers, c.KVDim()
	return []struct {
		p *[]float32
		n int
	}{
		{&m.TokenEmbedding, c.Vocab * d},
		{&m.RMSAttention, l * d},
		{&m.WQ, l * d * d},
		{&m.WK, l * kv * d},
		{&m.WV, l * kv * d},
		{&m.WO, l * d * d},
		{&m.RMSFFN, l * d},
		{&m.W1, l * h * d},
		{&m.W2, l * d * h},
		{&m.W3, l * h * d},
		{&m.RMSFinal, d},
	}
}

// Validate checks the config and that every array has its size.
func (m *Model) Validate() error {
	if err := m.Config.Validate(); err != nil {
		return err
	}
	for i, a := range m.arrays() {
		if len(*a.p) != a.n {
			return fmt.Errorf("%w: weight array %d has %d values, want %d", ErrConfig, i, len(*a.p), a.n)
		}
	}
	if len(m.Classifier) != m.Vocab*m.Dim {
		return fmt.Errorf("%w: classifier has %d values, want %d", ErrConfig, len(m.Classifier), m.Vocab*m.Dim)
	}
	return nil
}

// Alloc returns a model of config c with every weight zero. The arrays are
// consecutive pieces of one allocation, in checkpoint order (the classifier
// last), so a backend can ask for them to be backed by large pages as one
// range (package cpu does).
func Alloc(c Config) (*Model, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	m := &Model{Config: c}
	arrays, total := m.arrays(), 0
	for _, a := range arrays {
		total += a.n
	}
	if !c.SharedClassifier {
		total += c.Vocab * c.Dim
	}
	all := make([]float32, total)
	for _, a := range arrays {
		*a.p, all = all[:a.n:a.n], all[a.n:]
	}
	if c.SharedClassifier {
		m.Classifier = m.TokenEmbedding
	} else {
		m.Classifier = all
	}
	return m, nil
}

// Randomize fills m's weights with seeded values of a trained model's scale:
// matrices uniform in ±1/sqrt(in), norms near 1.
func Randomize(m *Model, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 0x6b766861))
	fill := func(a []float32, scale float64, center float64) {
		for i := range a {
			a[i] = float32(center + scale*(2*rng.Float64()-1))
		}
	}
	d, h := float64(m.Dim), float64(m.HiddenDim)
	fill(m.TokenEmbedding, 1, 0)
	fill(m.RMSAttention, 0.2, 1)
	fill(m.WQ, 1/math.Sqrt(d), 0)
	fill(m.WK, 1/math.Sqrt(d), 0)
	fill(m.WV, 1/math.Sqrt(d), 0)
	fill(m.WO, 1/math.Sqrt(d), 0)
	fill(m.RMSFFN, 0.2, 1)
	fill(m.W1, 1/math.Sqrt(d), 0)
	fill(m.W2, 1/math.Sqrt(h), 0)
	fill(m.W3, 1/math.Sqrt(d), 0)
	fill(m.RMSFinal, 0.2, 1)
	if !m.SharedClassifier {
		fill(m.Classifier, 1/math.Sqrt(d), 0)
	}
}
