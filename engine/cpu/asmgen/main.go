//go:build asmgen

// Command asmgen writes the CPU backend's AVX2+FMA kernels
// (engine/cpu/kernels_amd64.s) and their Go declarations
// (kernels_amd64.go) with avo:
//
//	cd engine/cpu && go run -tags asmgen ./asmgen -out kernels_amd64.s -stubs kernels_amd64.go -pkg cpu
//
// TestCommittedAssemblyIsWhatTheGeneratorWrites checks that the committed
// files are what this writes.
//
// Every inner product in every kernel is computed the same way, so that a
// product's bits do not depend on which kernel computed it (a position's KV
// is the same from a prefill batch as from a decode step): one 8-lane
// accumulator, acc += a[j:j+8]*b[j:j+8] by fused multiply-add over the
// multiples of 8; then its lanes summed as (l0+l4)+(l2+l6) + (l1+l5)+(l3+l7)
// (halves, then pairs, then the two); then s += a[j]*b[j] by scalar fused
// multiply-add over the tail, in order. The arm64 kernels (kernels_arm64.s,
// by hand) follow the same order, and
// TestEveryVectorKernelComputesTheDocumentedOrderBitForBit holds both to it.
package main

import (
	"fmt"

	. "github.com/mmcloughlin/avo/build"
	. "github.com/mmcloughlin/avo/operand"
	. "github.com/mmcloughlin/avo/reg"
)

func main() {
	ConstraintExpr("amd64")
	dot()
	gemv4()
	gemm4x3()
	scores()
	weightedSum()
	Generate()
}

// prefetchAhead is how far ahead of the rows it reads gemv4 asks for the
// weights, in bytes: one decode step streams every weight matrix from
// memory once (stories15M's 61 MB do not fit the L3 cache), and four rows
// read side by side are four short streams (a row of 288 floats is 18 cache
// lines) that the hardware prefetchers follow poorly; one linear stream of
// software prefetches over the same bytes, 8 KiB (64 iterations of the four
// rows) ahead, keeps more lines in flight. Measured with the kernel
// generated without the prefetch and with other distances (an experiment,
// not kept), on a classifier-shaped product (32000x288) from memory: about
// 1.5 billion multiply-adds per CPU-second without, 2.2 to 2.5 with 4 to 16
// KiB; in a whole stories15M decode, 4 to 32 KiB equal within the noise, 2
// KiB slower. go test -bench Matmul/classifier ./engine/cpu measures this
// kernel as it is.
const prefetchAhead = 8 << 10

// block computes the R×C inner products of rows w[r] with vectors x[c],
// each n long, leaving each in the low lane of its accumulator. If pf is
// not nil it is a pointer that advances with the rows, R×32 bytes per
// iteration of 8 floats, each of its cache lines prefetched as it passes:
// a linear stream over the rows' bytes when the rows are consecutive.
func block(name string, w, x []GPVirtual, n GPVirtual, pf GPVirtual) [][]VecVirtual {
	R, C := len(w), len(x)
	acc := make([][]VecVirtual, R)
	for r := range acc {
		acc[r] = make([]VecVirtual, C)
		for c := range acc[r] {
			acc[r][c] = YMM()
			VXORPS(acc[r][c], acc[r][c], acc[r][c])
		}
	}
	j, nvec := GP64(), GP64()
	XORQ(j, j)
	MOVQ(n, nvec)
	ANDQ(I32(-8), nvec)
	Label(name + "_vec")
	CMPQ(j, nvec)
	JGE(LabelRef(name + "_reduce"))
	if pf != nil {
		for o := 0; o < 32*R; o += 64 {
			PREFETCHT0(Mem{Base: pf, Disp: o})
		}
		ADDQ(U8(32*R), pf)
	}
	xs := make([]VecVirtual, C)
	for c := range xs {
		xs[c] = YMM()
		VMOVUPS(Mem{Base: x[c], Index: j, Scale: 4}, xs[c])
	}
	for r := range w {
		if C == 1 {
			VFMADD231PS(Mem{Base: w[r], Index: j, Scale: 4}, xs[0], acc[r][0])
			continue
		}
		wr := YMM()
		VMOVUPS(Mem{Base: w[r], Index: j, Scale: 4}, wr)
		for c := range xs {
			VFMADD231PS(xs[c], wr, acc[r][c])
		}
	}
	ADDQ(U8(8), j)
	JMP(LabelRef(name + "_vec"))

	Label(name + "_reduce")
	for r := range acc {
		for c := range acc[r] {
			a, hi, t := acc[r][c], XMM(), XMM()
			VEXTRACTF128(U8(1), a, hi)
			VADDPS(hi, a.AsX(), a.AsX()) // l0+l4, l1+l5, l2+l6, l3+l7
			VMOVHLPS(a.AsX(), a.AsX(), t)
			VADDPS(t, a.AsX(), a.AsX()) // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
			VMOVSHDUP(a.AsX(), t)
			VADDSS(t, a.AsX(), a.AsX())
		}
	}

	Label(name + "_tail")
	CMPQ(j, n)
	JGE(LabelRef(name + "_done"))
	xt := make([]VecVirtual, C)
	for c := range xt {
		xt[c] = XMM()
		VMOVSS(Mem{Base: x[c], Index: j, Scale: 4}, xt[c])
	}
	for r := range w {
		if C == 1 {
			VFMADD231SS(Mem{Base: w[r], Index: j, Scale: 4}, xt[0], acc[r][0].AsX())
			continue
		}
		wr := XMM()
		VMOVSS(Mem{Base: w[r], Index: j, Scale: 4}, wr)
		for c := range xt {
			VFMADD231SS(xt[c], wr, acc[r][c].AsX())
		}
	}
	INCQ(j)
	JMP(LabelRef(name + "_tail"))
	Label(name + "_done")
	return acc
}

// param loads the named integer or pointer argument into a register.
func param(name string) GPVirtual {
	r := GP64()
	Load(Param(name), r)
	return r
}

func dot() {
	TEXT("dotAVX", NOSPLIT, "func(a, b *float32, n int) float32")
	Doc("dotAVX is the inner product of a[:n] and b[:n].")
	a, b, n := param("a"), param("b"), param("n")
	acc := block("dot", []GPVirtual{a}, []GPVirtual{b}, n, nil)
	VZEROUPPER()
	Store(acc[0][0].AsX(), ReturnIndex(0))
	RET()
}

func gemv4() {
	TEXT("gemv4AVX", NOSPLIT, "func(w, x, out *float32, n, groups int)")
	Doc("gemv4AVX sets out[i] = w[i*n:(i+1)*n]·x[:n] for i < 4*groups.")
	w, x, out := param("w"), param("x"), param("out")
	n, groups := param("n"), param("groups")
	stride := GP64()
	MOVQ(n, stride)
	SHLQ(U8(2), stride)
	pf := GP64()
	LEAQ(Mem{Base: w, Disp: prefetchAhead}, pf)
	Label("gemv_group")
	CMPQ(groups, Imm(0))
	JE(LabelRef("gemv_end"))
	rows := []GPVirtual{w, GP64(), GP64(), GP64()}
	for r := 1; r < 4; r++ {
		LEAQ(Mem{Base: rows[r-1], Index: stride, Scale: 1}, rows[r])
	}
	acc := block("gemv", rows, []GPVirtual{x}, n, pf)
	for r := range acc {
		VMOVSS(acc[r][0].AsX(), Mem{Base: out, Disp: 4 * r})
	}
	LEAQ(Mem{Base: rows[3], Index: stride, Scale: 1}, w)
	ADDQ(U8(16), out)
	DECQ(groups)
	JMP(LabelRef("gemv_group"))
	Label("gemv_end")
	VZEROUPPER()
	RET()
}

func gemm4x3() {
	TEXT("gemm4x3AVX", NOSPLIT, "func(w, x, out *float32, n, ldx, ldo, groups int)")
	Doc("gemm4x3AVX sets out[r+c*ldo] = w[r*n:(r+1)*n]·x[c*ldx:c*ldx+n] for r < 4, c < 3*groups.")
	w, x, out := param("w"), param("x"), param("out")
	n, groups := param("n"), param("groups")
	ldx, ldo := param("ldx"), param("ldo")
	SHLQ(U8(2), ldx)
	SHLQ(U8(2), ldo)
	Label("gemm_group")
	CMPQ(groups, Imm(0))
	JE(LabelRef("gemm_end"))
	stride := GP64()
	MOVQ(n, stride)
	SHLQ(U8(2), stride)
	rows := []GPVirtual{GP64(), GP64(), GP64(), GP64()}
	MOVQ(w, rows[0])
	for r := 1; r < 4; r++ {
		LEAQ(Mem{Base: rows[r-1], Index: stride, Scale: 1}, rows[r])
	}
	xs := []GPVirtual{GP64(), GP64(), GP64()}
	MOVQ(x, xs[0])
	for c := 1; c < 3; c++ {
		LEAQ(Mem{Base: xs[c-1], Index: ldx, Scale: 1}, xs[c])
	}
	acc := block("gemm", rows, xs, n, nil)
	o := GP64()
	MOVQ(out, o)
	for c := 0; c < 3; c++ {
		for r := 0; r < 4; r++ {
			VMOVSS(acc[r][c].AsX(), Mem{Base: o, Disp: 4 * r})
		}
		ADDQ(ldo, o)
	}
	MOVQ(o, out)
	LEAQ(Mem{Base: xs[2], Index: ldx, Scale: 1}, x)
	DECQ(groups)
	JMP(LabelRef("gemm_group"))
	Label("gemm_end")
	VZEROUPPER()
	RET()
}

// scores is attention's query-key products over one page: the keys are rows
// ldk floats apart (a page holds every kv head's keys of a position side by
// side), four at a time, then one at a time.
func scores() {
	TEXT("scoresAVX", NOSPLIT, "func(q, k, out *float32, n, ldk, cnt int)")
	Doc("scoresAVX sets out[j] = q[:n]·k[j*ldk:j*ldk+n] for j < cnt.")
	q, k, out := param("q"), param("k"), param("out")
	n, ldk, cnt := param("n"), param("ldk"), param("cnt")
	SHLQ(U8(2), ldk)
	Label("scores_group")
	CMPQ(cnt, Imm(4))
	JL(LabelRef("scores_single"))
	rows := []GPVirtual{k, GP64(), GP64(), GP64()}
	for r := 1; r < 4; r++ {
		LEAQ(Mem{Base: rows[r-1], Index: ldk, Scale: 1}, rows[r])
	}
	acc := block("scores4", rows, []GPVirtual{q}, n, nil)
	for r := range acc {
		VMOVSS(acc[r][0].AsX(), Mem{Base: out, Disp: 4 * r})
	}
	LEAQ(Mem{Base: rows[3], Index: ldk, Scale: 1}, k)
	ADDQ(U8(16), out)
	SUBQ(U8(4), cnt)
	JMP(LabelRef("scores_group"))
	Label("scores_single")
	CMPQ(cnt, Imm(0))
	JE(LabelRef("scores_end"))
	acc = block("scores1", []GPVirtual{k}, []GPVirtual{q}, n, nil)
	VMOVSS(acc[0][0].AsX(), Mem{Base: out})
	ADDQ(ldk, k)
	ADDQ(U8(4), out)
	DECQ(cnt)
	JMP(LabelRef("scores_single"))
	Label("scores_end")
	VZEROUPPER()
	RET()
}

// weightedSum is attention's weighted sum of the values over one page: each
// output element gets c[j]·v[j] added in order of j by fused multiply-add,
// the outputs held in registers across the page, 32, 16 and 8 at a time,
// then one at a time.
func weightedSum() {
	TEXT("weightedSumAVX", NOSPLIT, "func(out, v, c *float32, n, ldv, cnt int)")
	Doc("weightedSumAVX adds c[j]*v[j*ldv+i] to out[i] for i < n, for j = 0 to cnt-1 in order.")
	out, v, c := param("out"), param("v"), param("c")
	n, ldv, cnt := param("n"), param("ldv"), param("cnt")
	SHLQ(U8(2), ldv)
	i := GP64()
	XORQ(i, i)
	for _, width := range []int{4, 2, 1} {
		name := fmt.Sprintf("wsum%d", width)
		end := GP64()
		MOVQ(n, end)
		SUBQ(U8(8*width-1), end) // i+8*width <= n, i.e. i < n-8*width+1
		Label(name + "_cols")
		CMPQ(i, end)
		JGE(LabelRef(name + "_next"))
		acc := make([]VecVirtual, width)
		for w := range acc {
			acc[w] = YMM()
			VMOVUPS(Mem{Base: out, Index: i, Scale: 4, Disp: 32 * w}, acc[w])
		}
		row, j := GP64(), GP64()
		LEAQ(Mem{Base: v, Index: i, Scale: 4}, row)
		XORQ(j, j)
		Label(name + "_rows")
		CMPQ(j, cnt)
		JGE(LabelRef(name + "_store"))
		cj := YMM()
		VBROADCASTSS(Mem{Base: c, Index: j, Scale: 4}, cj)
		for w := range acc {
			VFMADD231PS(Mem{Base: row, Disp: 32 * w}, cj, acc[w])
		}
		ADDQ(ldv, row)
		INCQ(j)
		JMP(LabelRef(name + "_rows"))
		Label(name + "_store")
		for w := range acc {
			VMOVUPS(acc[w], Mem{Base: out, Index: i, Scale: 4, Disp: 32 * w})
		}
		ADDQ(U8(8*width), i)
		JMP(LabelRef(name + "_cols"))
		Label(name + "_next")
	}
	Label("wsum_tail")
	CMPQ(i, n)
	JGE(LabelRef("wsum_end"))
	t, row, j := XMM(), GP64(), GP64()
	VMOVSS(Mem{Base: out, Index: i, Scale: 4}, t)
	LEAQ(Mem{Base: v, Index: i, Scale: 4}, row)
	XORQ(j, j)
	Label("wsum_tail_rows")
	CMPQ(j, cnt)
	JGE(LabelRef("wsum_tail_store"))
	cj := XMM()
	VMOVSS(Mem{Base: c, Index: j, Scale: 4}, cj)
	VFMADD231SS(Mem{Base: row}, cj, t)
	ADDQ(ldv, row)
	INCQ(j)
	JMP(LabelRef("wsum_tail_rows"))
	Label("wsum_tail_store")
	VMOVSS(t, Mem{Base: out, Index: i, Scale: 4})
	INCQ(i)
	JMP(LabelRef("wsum_tail"))
	Label("wsum_end")
	VZEROUPPER()
	RET()
}
