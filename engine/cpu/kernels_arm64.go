//go:build arm64

package cpu

// The NEON kernels of kernels_arm64.s, written by hand: avo, which writes
// the amd64 ones, does not write arm64.

// dotsNEON sets out[j] = x[:n]·rows[j*ld:j*ld+n] for j < cnt.
//
//go:noescape
func dotsNEON(x, rows, out *float32, n, ld, cnt int)

// gemm4x3NEON sets out[r+c*ldo] = w[r*n:(r+1)*n]·x[c*ldx:c*ldx+n] for r < 4, c < 3*groups.
//
//go:noescape
func gemm4x3NEON(w, x, out *float32, n, ldx, ldo, groups int)

// weightedSumNEON adds c[j]*v[j*ldv+i] to out[i] for i < n, for j = 0 to cnt-1 in order.
//
//go:noescape
func weightedSumNEON(out, v, c *float32, n, ldv, cnt int)
