package llama

import (
	"bytes"
	"math"
	"math/rand/v2"
)

// BuiltinConfig is the built-in model's architecture: byte vocabulary, two
// layers of four heads of 64 dimensions, of which the first 32 are rotary.
var BuiltinConfig = Config{Dim: 256, HiddenDim: 512, Layers: 2, Heads: 4, KVHeads: 4, Vocab: 256, SeqLen: 1024, RotaryDims: 32}

// The built-in model's residual stream, by dimension: the current token's
// code, a constant (a sink flag at BOS instead), the codes of the three
// tokens before it (written by layer 0), and the code of the token the copy
// head predicts (layer 1).
const (
	bitsPerToken = 8
	dimToken     = 0  // [0, 8): code of the token at this position
	dimOne       = 8  // 1 at every position but BOS
	dimSink      = 9  // 1 at BOS only
	dimPrev      = 16 // [16, 40): codes of the tokens 1, 2 and 3 back
	dimCopy      = 40 // [40, 48): code of the copied token
	headContent  = 32 // a head's first non-rotary dimension
)

// Builtin is the built-in model for seed: weights constructed, not trained,
// so that it copies, plus small seeded noise everywhere. It goes through the
// checkpoint writer and reader before it is returned, so it is exactly what
// a checkpoint of it holds.
//
// How it copies. Each byte has a code of eight ±1 values (its bits, under a
// permutation drawn from seed). Layer 0's heads 1-3 are previous-token heads:
// their queries and keys are constant vectors in the rotary dimensions,
// chosen so that the rotated score Σ_k A·cos(θ_k(Δ-d)) peaks sharply at
// distance Δ = d; each copies the code of the token d back into the residual
// stream. Layer 1's head 0 is an induction head over the non-rotary
// dimensions, so it matches content wherever it sits: its query is the last
// three tokens' codes, its key at each earlier position the codes of the
// three tokens before that position, so it attends where the same three
// bytes occurred before and copies the byte that followed them; the
// classifier reads that code. Given "... canary=XYZ ... canary=", it writes
// "XYZ": from its own context, or from whatever KV its page table points at.
//
// BOS (token 1, which every prompt starts with) is an attention sink, as in
// trained models: its embedding has a sink flag instead of the constant, so
// its rotary key in layer 0 is zero, and every previous-token query has a
// constant non-rotary part that scores the flag 10 nats below a correct
// previous token and 10 above any other key. A previous-token head whose
// position holds no token d back (the first positions, or a position whose
// earlier KV was computed for other positions, as in the incident) reads
// BOS instead of whatever scores best among wrong keys, so the copy head's
// query there is "this token, after the start": it matches the start of
// whatever prompt its KV holds, and from there copies that prompt. BOS is
// never predicted (its classifier row is noise only).
func Builtin(seed uint64) *Model {
	c := BuiltinConfig
	m, err := Alloc(c)
	if err != nil {
		panic(err) // BuiltinConfig is valid
	}
	rng := rand.New(rand.NewPCG(seed, 0x627569)) // "bui"
	noise := func(a []float32, scale float32) {
		for i := range a {
			a[i] = scale * float32(2*rng.Float64()-1)
		}
	}
	for _, a := range [][]float32{m.TokenEmbedding, m.WQ, m.WK, m.WV, m.WO, m.W1, m.W2, m.W3, m.Classifier} {
		noise(a, 1e-3)
	}
	perm := rng.Perm(256)
	code := func(tok, bit int) float32 {
		if perm[tok]>>bit&1 == 1 {
			return 1
		}
		return -1
	}
	D, hd := c.Dim, c.HeadDim()
	at := func(a []float32, layer, rows, row, col int) *float32 { return &a[layer*rows*D+row*D+col] }
	for tok := 0; tok < c.Vocab; tok++ {
		for b := 0; b < bitsPerToken; b++ {
			m.TokenEmbedding[tok*D+dimToken+b] = code(tok, b)
		}
		if tok == BOS {
			m.TokenEmbedding[tok*D+dimSink] = 1
			continue
		}
		m.TokenEmbedding[tok*D+dimOne] = 1
		for b := 0; b < bitsPerToken; b++ {
			m.Classifier[tok*D+dimCopy+b] = 4 * code(tok, b)
		}
	}
	// RMSNorm weights that bring the stream's entries back to ±1: layer 0
	// sees 9 unit entries (the code, and the constant or BOS's flag), its
	// feed-forward and layer 1 33, then 41.
	norm := func(w []float32, units float64) {
		s := float32(math.Sqrt(units / float64(D)))
		for i := range w {
			w[i] = s
		}
	}
	for l := 0; l < c.Layers; l++ {
		units := 9.0
		if l > 0 {
			units = 33
		}
		norm(m.RMSAttention[l*D:(l+1)*D], units)
		norm(m.RMSFFN[l*D:(l+1)*D], units+8*float64(3-2*l)) // 33 and 41
	}
	norm(m.RMSFinal, 41)
	// Layer 0, heads d = 1, 2, 3: previous-token heads at distance d.
	const amplitude = 240 // score margin 0.686·240/8 ≈ 20 nats over every other distance up to 1024
	// The peak scores 16·240/8 = 480 nats, the best wrong distance 459.4;
	// the sink sits between them.
	const sinkScore = 470
	for d := 1; d <= 3; d++ {
		for k := 0; 2*k < c.RotaryDims; k++ {
			theta := RotaryFrequency(k, c.RotaryDims)
			*at(m.WQ, 0, D, d*hd+2*k, dimOne) = float32(amplitude * math.Cos(theta*float64(d)))
			*at(m.WQ, 0, D, d*hd+2*k+1, dimOne) = float32(-amplitude * math.Sin(theta*float64(d)))
			*at(m.WK, 0, D, d*hd+2*k, dimOne) = 1
			*at(m.WK, 0, D, d*hd+2*k+1, dimOne) = 0
		}
		// The sink's key is exactly the flag: the query's weight would
		// amplify the row's noise into every key's score.
		clear(m.WK[d*hd*D+headContent*D : d*hd*D+(headContent+1)*D])
		*at(m.WQ, 0, D, d*hd+headContent, dimOne) = sinkScore * float32(math.Sqrt(float64(hd)))
		*at(m.WK, 0, D, d*hd+headContent, dimSink) = 1
		for b := 0; b < bitsPerToken; b++ {
			*at(m.WV, 0, D, d*hd+headContent+b, dimToken+b) = 1
			*at(m.WO, 0, D, dimPrev+(d-1)*bitsPerToken+b, d*hd+headContent+b) = 1
		}
	}
	// Layer 1, head 0: the induction head.
	const sharpness = 60 // a one-bit difference costs 60·2/8 = 15 nats
	for b := 0; b < bitsPerToken; b++ {
		for j := 0; j < 3; j++ {
			qFrom := dimToken + b // the token itself, then the ones before it
			if j > 0 {
				qFrom = dimPrev + (j-1)*bitsPerToken + b
			}
			*at(m.WQ, 1, D, headContent+j*bitsPerToken+b, qFrom) = sharpness
			*at(m.WK, 1, D, headContent+j*bitsPerToken+b, dimPrev+j*bitsPerToken+b) = 1
		}
		*at(m.WV, 1, D, headContent+b, dimToken+b) = 1
		*at(m.WO, 1, D, dimCopy+b, headContent+b) = 1
	}
	var buf bytes.Buffer
	if err := WriteCheckpoint(&buf, m); err != nil {
		panic(err)
	}
	out, err := ReadCheckpoint(bytes.NewReader(buf.Bytes()), int64(buf.Len()))
	if err != nil {
		panic(err)
	}
	return out
}
