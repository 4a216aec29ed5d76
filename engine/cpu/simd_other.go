//go:build !amd64 && !arm64

package cpu

// simd is false: the vector kernels are amd64's and arm64's (see
// simd_amd64.go, simd_arm64.go); the functions below are the pure-Go
// products, in case a test sets it.
var simd = false

func dotSIMD(a, b []float32) float32 { return dot(a, b) }

func gemv4SIMD(out, x, w []float32, n, groups int) {
	for r := 0; r < 4*groups; r++ {
		out[r] = dot(w[r*n:(r+1)*n], x[:n])
	}
}

func gemm4x3SIMD(out, x, w []float32, n, ldo, groups int) {
	for c := 0; c < 3*groups; c++ {
		for r := 0; r < 4; r++ {
			out[r+c*ldo] = dot(w[r*n:(r+1)*n], x[c*n:(c+1)*n])
		}
	}
}

func scoresSIMD(out, q, k []float32, ld int) { scores(out, q, k, ld) }

func weightedSumSIMD(out, v, c []float32, ld int) { weightedSum(out, v, c, ld) }
