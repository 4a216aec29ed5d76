package cpu

import (
	"math/rand/v2"
	"testing"
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
