package cpu

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
)

// unaligned is n normal floats that start 4 bytes past a 32-byte boundary
// or less, so no kernel can count on an aligned load.
func unaligned(rng *rand.Rand, n int) []float32 {
	s := make([]float32, n+1)[1:]
	for i := range s {
		s[i] = float32(rng.NormFloat64())
	}
	return s
}

// Every product of the matrix product comes out with the same bits whether
// its token came alone or in a batch of any size, and whichever rows the
// threads' split grouped it with, on both paths: lengths that are not
// multiples of the vector width (8) or of the blocks (4 rows, 3 tokens),
// unaligned slices, batches longer than a cache tile. The products are
// within 1e-5 (relative to the sum of the terms' magnitudes) of float64's.
func TestMatmulComputesEveryProductTheSameWayInABatchAsAlone(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	shapes := []struct{ T, n, d int }{
		{1, 1, 1}, {4, 0, 5}, {2, 7, 3}, {3, 8, 4}, {4, 9, 5}, {5, 15, 9}, {7, 16, 12}, {13, 17, 17},
		{6, 33, 8}, {11, 288, 13}, {40, 100, 6}, {1, 288, 64}, {130, 768, 7}, // 130 tokens of 768: three tiles
	}
	paths(func(path string) {
		for _, c := range shapes {
			for _, threads := range []int{1, 3} {
				b := NewThreads(threads)
				x, w := unaligned(rng, c.T*c.n), unaligned(rng, c.d*c.n)
				batch := unaligned(rng, c.T*c.d)
				b.matmul(batch, x, w, c.T, c.n, c.d)
				alone := make([]float32, c.d)
				for tk := 0; tk < c.T; tk++ {
					b.matmul(alone, x[tk*c.n:(tk+1)*c.n], w, 1, c.n, c.d)
					for i := 0; i < c.d; i++ {
						got := batch[tk*c.d+i]
						if math.Float32bits(got) != math.Float32bits(alone[i]) {
							t.Fatalf("%s %+v threads %d: token %d row %d: %g in the batch, %g alone", path, c, threads, tk, i, got, alone[i])
						}
						var want, mag float64
						for j := 0; j < c.n; j++ {
							p := float64(w[i*c.n+j]) * float64(x[tk*c.n+j])
							want, mag = want+p, mag+math.Abs(p)
						}
						if math.Abs(float64(got)-want) > 1e-5*mag+1e-30 {
							t.Fatalf("%s %+v: out[%d][%d] = %g, want %g", path, c, tk, i, got, want)
						}
					}
				}
			}
		}
	})
}

// The attention kernels: the vector inner product, a query's products with
// a page's keys (rows ld apart) and the weighted sum of its values equal the
// scalar ones within rounding and the float64 sums within 1e-5 of their
// terms' magnitudes, at head sizes up to 40 (not multiples of 8, 16 or 32
// too), up to 17 positions (not multiples of the 4-key blocks), strides
// wider than a head, on unaligned slices.
func TestVectorAttentionKernelsMatchTheScalarOnes(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for n := 0; n <= 40; n++ {
		a, b := unaligned(rng, n), unaligned(rng, n)
		var mag float64
		for i := range a {
			mag += math.Abs(float64(a[i]) * float64(b[i]))
		}
		if d := math.Abs(float64(dotSIMD(a, b) - dot(a, b))); d > 1e-5*mag {
			t.Fatalf("n %d: dot %g, scalar %g", n, dotSIMD(a, b), dot(a, b))
		}
		for _, cnt := range []int{0, 1, 3, 4, 5, 8, 16, 17} {
			ld := n + rng.IntN(9)
			kv, q, c := unaligned(rng, cnt*ld+n), unaligned(rng, n), unaligned(rng, cnt)
			got, want := unaligned(rng, cnt), unaligned(rng, cnt)
			scoresSIMD(got, q, kv, ld)
			scores(want, q, kv, ld)
			for j := range got {
				var ref, mag float64
				for i := 0; i < n; i++ {
					p := float64(q[i]) * float64(kv[j*ld+i])
					ref, mag = ref+p, mag+math.Abs(p)
				}
				if math.Abs(float64(got[j]-want[j])) > 1e-5*mag || math.Abs(float64(got[j])-ref) > 1e-5*mag {
					t.Fatalf("n %d cnt %d ld %d: score %d %g, scalar %g, float64 %g", n, cnt, ld, j, got[j], want[j], ref)
				}
			}
			out1 := unaligned(rng, n)
			out2 := append([]float32(nil), out1...)
			start := append([]float32(nil), out1...)
			weightedSumSIMD(out1, kv, c, ld)
			weightedSum(out2, kv, c, ld)
			for i := range out1 {
				ref, mag := float64(start[i]), math.Abs(float64(start[i]))
				for j := 0; j < cnt; j++ {
					p := float64(c[j]) * float64(kv[j*ld+i])
					ref, mag = ref+p, mag+math.Abs(p)
				}
				if math.Abs(float64(out1[i]-out2[i])) > 1e-5*mag || math.Abs(float64(out1[i])-ref) > 1e-5*mag {
					t.Fatalf("n %d cnt %d ld %d: weighted sum [%d] %g, scalar %g, float64 %g", n, cnt, ld, i, out1[i], out2[i], ref)
				}
			}
		}
	}
}

// On both paths a whole model agrees: the vector path's logits are within
// 1e-4 of the pure-Go path's at every step of a generation, its greedy
// tokens equal, and on each path a prefill batch writes the KV bytes that
// decode steps of its tokens one by one write.
func TestBothPathsGenerateTheSameTokensAndBatchesWriteTheSameKV(t *testing.T) {
	m, _ := llama.Alloc(llama.Config{Dim: 72, HiddenDim: 136, Layers: 2, Heads: 6, KVHeads: 2, Vocab: 301, SeqLen: 64})
	llama.Randomize(m, 21)
	prompt := []int{1, 40, 7, 255, 3, 99, 12, 18, 200, 5, 6}
	const n = 30
	run := func() (toks []int, logits [][]float32, batchKV, stepKV [][]byte) {
		g := engine.GeometryOf(m.Config, 4)
		for _, batched := range []bool{true, false} {
			cache, _ := kv.New(g, 16)
			e, err := engine.New(m, NewThreads(2), cache, engine.Options{})
			if err != nil {
				t.Fatal(err)
			}
			refs, _ := cache.Pool().Allocate(1, 16)
			table := kv.Table(refs)
			var l []float32
			if batched {
				l, err = e.Prefill(table, prompt)
			} else {
				for pos, tok := range prompt {
					l, err = e.Step(table, []int{tok}, pos)
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			var kvBytes [][]byte
			for _, r := range refs[:g.PagesFor(len(prompt))] {
				kvBytes = append(kvBytes, bytes.Clone(cache.Payload(r.Page)))
			}
			if !batched {
				stepKV = kvBytes
				continue
			}
			batchKV = kvBytes
			for i := 0; i < n; i++ {
				logits = append(logits, append([]float32(nil), l...))
				tok := llama.Argmax(l)
				toks = append(toks, tok)
				if l, err = e.Step(table, []int{tok}, len(prompt)+i); err != nil {
					t.Fatal(err)
				}
			}
		}
		return
	}
	type result struct {
		toks            []int
		logits          [][]float32
		batchKV, stepKV [][]byte
	}
	var got []result
	paths(func(path string) {
		var r result
		r.toks, r.logits, r.batchKV, r.stepKV = run()
		for i := range r.batchKV {
			if !bytes.Equal(r.batchKV[i], r.stepKV[i]) {
				t.Fatalf("%s: page %d of the prompt differs between a prefill batch and single steps", path, i)
			}
		}
		got = append(got, r)
	})
	if len(got) < 2 {
		t.Skip("this CPU has no vector kernels (amd64 without AVX2+FMA): the pure-Go path alone ran")
	}
	for i := range got[0].toks {
		if got[0].toks[i] != got[1].toks[i] {
			t.Fatalf("token %d: %d on the vector path, %d on the Go path", i, got[0].toks[i], got[1].toks[i])
		}
		for v := range got[0].logits[i] {
			if d := math.Abs(float64(got[0].logits[i][v] - got[1].logits[i][v])); d > 1e-4 {
				t.Fatalf("step %d logit %d: %g vs %g", i, v, got[0].logits[i][v], got[1].logits[i][v])
			}
		}
	}
}

// BenchmarkDecodeThreads decodes a stories15M-shaped model (seeded random
// weights; positions 1 to 255 after the first) on one thread and on two,
// alternating every round, and reports each one's tokens per wall second
// and per CPU-second of the process, and the wall speedup of two threads
// (best round of each). On a machine shared with other work the wall
// figures carry its load; equal CPU-second rates say the split costs
// nothing in work.
func BenchmarkDecodeThreads(b *testing.B) {
	m, err := llama.Alloc(llama.Config{Dim: 288, HiddenDim: 768, Layers: 6, Heads: 6, KVHeads: 6, Vocab: 32000, SeqLen: 256, SharedClassifier: true})
	if err != nil {
		b.Fatal(err)
	}
	llama.Randomize(m, 15)
	g := engine.GeometryOf(m.Config, 16)
	type run struct {
		e           *engine.Engine
		table       kv.Table
		wall, cpu   time.Duration
		bestWall    time.Duration
		totalTokens int
	}
	var runs []*run
	for _, threads := range []int{1, 2} {
		cache, _ := kv.New(g, g.PagesFor(256))
		e, err := engine.New(m, NewThreads(threads), cache, engine.Options{})
		if err != nil {
			b.Fatal(err)
		}
		refs, _ := cache.Pool().Allocate(1, cache.Pages())
		runs = append(runs, &run{e: e, table: kv.Table(refs)})
	}
	for b.Loop() {
		for _, r := range runs {
			if _, err := r.e.Step(r.table, []int{1}, 0); err != nil {
				b.Fatal(err)
			}
			start, c0 := time.Now(), cpuTime()
			for pos := 1; pos < 256; pos++ {
				if _, err := r.e.Step(r.table, []int{(pos * 7919) % 32000}, pos); err != nil {
					b.Fatal(err)
				}
			}
			w := time.Since(start)
			r.wall, r.cpu, r.totalTokens = r.wall+w, r.cpu+cpuTime()-c0, r.totalTokens+255
			if r.bestWall == 0 || w < r.bestWall {
				r.bestWall = w
			}
		}
	}
	for i, r := range runs {
		b.ReportMetric(255/r.bestWall.Seconds(), fmt.Sprintf("tok/s-%dthread", i+1))
		b.ReportMetric(float64(r.totalTokens)/r.cpu.Seconds(), fmt.Sprintf("tok/CPU-s-%dthread", i+1))
	}
	b.ReportMetric(float64(runs[0].bestWall)/float64(runs[1].bestWall), "speedup-2threads")
}

// A group of products of one input, split over threads together (a layer's
// queries, keys and values), computes each product with the bits it has
// alone, on both paths, whichever threads' chunk boundaries fall inside a
// product.
func TestAGroupOfProductsSplitTogetherComputesEachAsAlone(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	const n = 288
	paths(func(path string) {
		for _, T := range []int{1, 7} {
			x := unaligned(rng, T*n)
			var ps []product
			for _, d := range []int{100, 37, 50} {
				ps = append(ps, product{out: make([]float32, T*d), w: unaligned(rng, d*n), d: d})
			}
			for _, threads := range []int{1, 2, 3} {
				b := NewThreads(threads)
				b.matmuls(x, T, n, ps)
				for i, p := range ps {
					alone := make([]float32, T*p.d)
					NewThreads(1).matmul(alone, x, p.w, T, n, p.d)
					for j := range alone {
						if math.Float32bits(alone[j]) != math.Float32bits(p.out[j]) {
							t.Fatalf("%s T %d threads %d: product %d output %d is %g in the group, %g alone", path, T, threads, i, j, p.out[j], alone[j])
						}
					}
					clear(p.out)
				}
			}
		}
	})
}

// fma32 is x*y+z rounded once to float32, as FMLA, FMADDS and VFMADD231PS
// round it. x*y is exact in float64; the sum is rounded to odd (the float64
// result, moved to its odd neighbour toward the exact sum when it is even and
// inexact), so the one rounding to float32 that follows is the correct one
// (53 bits hold float32's 24 and two more). Normal finite operands only.
func fma32(x, y, z float32) float32 {
	p, c := float64(x)*float64(y), float64(z)
	s := p + c
	b := s - p
	if e := (p - (s - b)) + (c - b); e != 0 && math.Float64bits(s)&1 == 0 {
		s = math.Nextafter(s, math.Copysign(math.Inf(1), e))
	}
	return float32(s)
}

// kernelDot is an inner product in the order every vector kernel computes
// it on amd64 and arm64 (asmgen, kernels_arm64.s): eight lanes by fused
// multiply-add over the multiples of 8, the lanes summed as
// ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), the tail by fused multiply-add in
// order.
func kernelDot(a, b []float32) float32 {
	var acc [8]float32
	j := 0
	for ; j+8 <= len(a); j += 8 {
		for l := range acc {
			acc[l] = fma32(a[j+l], b[j+l], acc[l])
		}
	}
	s := ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
	for ; j < len(a); j++ {
		s = fma32(a[j], b[j], s)
	}
	return s
}

// Every vector kernel computes the order kernelDot spells out, bit for bit:
// the single product, the matrix-vector block (four rows), the
// matrix-matrix block (four rows by three tokens), a query's scores over a
// page's keys, and the weighted sum (each output c[j]·v[j] added by fused
// multiply-add in order of j). Since the AVX2 kernels and the NEON ones
// both pass it, an amd64 node and an arm64 node compute a matrix product or
// an attention kernel with the same bits. Lengths 0 to 70 (every tail of the
// 8-lane loop, the 16- and 4-wide blocks of the weighted sum), 288 and 768
// (stories15M's), unaligned.
func TestEveryVectorKernelComputesTheDocumentedOrderBitForBit(t *testing.T) {
	if !simd {
		t.Skip("this CPU has no vector kernels: the pure-Go path has its own order")
	}
	rng := rand.New(rand.NewPCG(9, 10))
	same := func(what string, n int, got, want float32) {
		t.Helper()
		if math.Float32bits(got) != math.Float32bits(want) {
			t.Fatalf("%s, n %d: %g (%#08x), the documented order gives %g (%#08x)", what, n, got, math.Float32bits(got), want, math.Float32bits(want))
		}
	}
	lengths := []int{288, 768}
	for n := 0; n <= 70; n++ {
		lengths = append(lengths, n)
	}
	for _, n := range lengths {
		a, b := unaligned(rng, n), unaligned(rng, n)
		same("dot", n, dotSIMD(a, b), kernelDot(a, b))

		const groups = 2
		x, w := unaligned(rng, 3*groups*n), unaligned(rng, 4*n)
		out := unaligned(rng, 4*groups)
		ws := unaligned(rng, 4*groups*n)
		gemv4SIMD(out, x[:n], ws, n, groups)
		for r := range out {
			same(fmt.Sprintf("gemv4 row %d", r), n, out[r], kernelDot(ws[r*n:(r+1)*n], x[:n]))
		}
		const ldo = 5
		out = unaligned(rng, (3*groups-1)*ldo+4)
		gemm4x3SIMD(out, x, w, n, ldo, groups)
		for c := 0; c < 3*groups; c++ {
			for r := 0; r < 4; r++ {
				same(fmt.Sprintf("gemm4x3 row %d token %d", r, c), n, out[r+c*ldo], kernelDot(w[r*n:(r+1)*n], x[c*n:(c+1)*n]))
			}
		}

		const cnt = 7
		ld := n + 3
		kv, q, weights := unaligned(rng, cnt*ld+n), unaligned(rng, n), unaligned(rng, cnt)
		scoresOut := unaligned(rng, cnt)
		scoresSIMD(scoresOut, q, kv, ld)
		for j := range scoresOut {
			same(fmt.Sprintf("scores key %d", j), n, scoresOut[j], kernelDot(q, kv[j*ld:j*ld+n]))
		}
		sum := unaligned(rng, n)
		want := append([]float32(nil), sum...)
		weightedSumSIMD(sum, kv, weights, ld)
		for i := range want {
			for j := range weights {
				want[i] = fma32(weights[j], kv[j*ld+i], want[i])
			}
			same(fmt.Sprintf("weighted sum output %d", i), n, sum[i], want[i])
		}
	}
}
