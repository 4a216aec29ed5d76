package cpu

import "golang.org/x/sys/cpu"

// simd selects the NEON kernels (kernels_arm64.s). ASIMD is mandatory in
// ARMv8-A, which Go's arm64 port requires, so it is on everywhere (x/sys/cpu
// reports it so where it cannot ask the OS); tests turn it off to run the
// pure-Go path. It is set once, before any Backend computes: the two paths
// round differently, so one process uses one.
var simd = cpu.ARM64.HasASIMD

func dotSIMD(a, b []float32) float32 {
	if len(a) == 0 {
		return 0
	}
	_ = b[len(a)-1]
	var s float32
	dotsNEON(&b[0], &a[0], &s, len(a), len(a), 1)
	return s
}

// gemv4SIMD sets out[r] = w[r*n:(r+1)*n]·x[:n] for r < 4*groups: the rows
// one after another, n apart.
func gemv4SIMD(out, x, w []float32, n, groups int) {
	if groups == 0 || n == 0 {
		clear(out[:4*groups])
		return
	}
	_, _, _ = out[4*groups-1], x[n-1], w[4*groups*n-1]
	dotsNEON(&x[0], &w[0], &out[0], n, n, 4*groups)
}

// gemm4x3SIMD sets out[r+c*ldo] = w[r*n:(r+1)*n]·x[c*n:(c+1)*n] for r < 4
// and c < 3*groups.
func gemm4x3SIMD(out, x, w []float32, n, ldo, groups int) {
	if groups == 0 {
		return
	}
	if n == 0 {
		for c := 0; c < 3*groups; c++ {
			clear(out[c*ldo : c*ldo+4])
		}
		return
	}
	_, _, _ = out[(3*groups-1)*ldo+3], x[3*groups*n-1], w[4*n-1]
	gemm4x3NEON(&w[0], &x[0], &out[0], n, n, ldo, groups)
}

// scoresSIMD sets out[j] = q·k[j*ld:j*ld+len(q)] for j < len(out).
func scoresSIMD(out, q, k []float32, ld int) {
	if len(out) == 0 {
		return
	}
	if len(q) == 0 {
		clear(out)
		return
	}
	_ = k[(len(out)-1)*ld+len(q)-1]
	dotsNEON(&q[0], &k[0], &out[0], len(q), ld, len(out))
}

// weightedSumSIMD adds c[j]·v[j*ld:j*ld+len(out)] to out for j =
// 0..len(c)-1 in order, each output element summed in order of j by fused
// multiply-add.
func weightedSumSIMD(out, v, c []float32, ld int) {
	if len(out) == 0 || len(c) == 0 {
		return
	}
	_ = v[(len(c)-1)*ld+len(out)-1]
	weightedSumNEON(&out[0], &v[0], &c[0], len(out), ld, len(c))
}
