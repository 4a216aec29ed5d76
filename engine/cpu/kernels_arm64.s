//go:build arm64

#include "textflag.h"

// The CPU backend's NEON kernels, written by hand (avo writes amd64 only).
//
// Every inner product is computed the way asmgen's amd64 kernels compute
// it, so a product's bits do not depend on the kernel, the batch or the
// threads' split, and equal amd64's: an 8-lane accumulator (two 4-lane
// registers, lo for elements j..j+3, hi for j+4..j+7), acc += a[j:j+8] *
// b[j:j+8] by fused multiply-add (FMLA) over the multiples of 8; its lanes
// summed as ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) (REDUCE); then
// s += a[j]*b[j] by scalar fused multiply-add (FMADDS) over the tail, in
// order. The weighted sum adds c[j]*v[j] to each output by fused
// multiply-add in order of j.
//
// Go's assembler has no vector FADD or scalar FADDP; the macros below
// encode them (and EXT, to keep REDUCE in one style) as instruction words,
// registers given by number. A wrong word computes wrong sums, which the
// kernels' tests catch (simd_test.go, run under qemu-aarch64 on amd64).

// FADD Vd.4S, Vn.4S, Vm.4S: Vd = Vn + Vm, lane by lane.
#define FADD4S(d, n, m) WORD $(0x4E20D400 | (m)<<16 | (n)<<5 | (d))

// EXT Vd.16B, Vn.16B, Vm.16B, #8: Vd = Vn's high half, then Vm's low half.
#define EXT8(d, n, m) WORD $(0x6E004000 | (m)<<16 | (n)<<5 | (d))

// FADDP Sd, Vn.2S: Sd = Vn.S[0] + Vn.S[1].
#define FADDP2S(d, n) WORD $(0x7E30D800 | (n)<<5 | (d))

// REDUCE sums the 8-lane accumulator lo (l0..l3), hi (l4..l7) into lo's
// lane 0 (Flo), in amd64's order; t is scratch. Step by step:
// lo = [l0+l4, l1+l5, l2+l6, l3+l7] = [a0, a1, a2, a3]; t = [a2, a3, a0, a1];
// lo = [a0+a2, a1+a3, ...]; Slo = (a0+a2) + (a1+a3).
#define REDUCE(lo, hi, t) \
	FADD4S(lo, lo, hi) \
	EXT8(t, lo, lo)    \
	FADD4S(lo, lo, t)  \
	FADDP2S(lo, lo)

// func dotsNEON(x, rows, out *float32, n, ld, cnt int)
//
// out[j] = x[:n]·rows[j*ld:j*ld+n] for j < cnt: four rows at a time, then
// one at a time. It is the matrix-vector product (rows n apart), attention's
// scores (a page's keys, kv_dim apart) and the single inner product (cnt 1).
//
// R0 x, R1 the next rows, R2 out, R3 n, R4 ld in bytes, R5 rows left,
// R6 floats in the vector loop (n rounded down to 8), R7 floats in the tail,
// R8-R11 the four rows' pointers, R12 x's pointer, R13 the loop's count.
// V0:V1, V2:V3, V4:V5, V6:V7 the rows' accumulators; V16:V17 x's 8 floats,
// V18-V25 the rows'.
TEXT ·dotsNEON(SB), NOSPLIT, $0-48
	MOVD x+0(FP), R0
	MOVD rows+8(FP), R1
	MOVD out+16(FP), R2
	MOVD n+24(FP), R3
	MOVD ld+32(FP), R4
	MOVD cnt+40(FP), R5
	LSL  $2, R4
	AND  $-8, R3, R6
	AND  $7, R3, R7

dots4:
	CMP  $4, R5
	BLT  dots1
	MOVD R1, R8
	ADD  R4, R8, R9
	ADD  R4, R9, R10
	ADD  R4, R10, R11
	ADD  R4, R11, R1
	MOVD R0, R12
	VEOR V0.B16, V0.B16, V0.B16
	VEOR V1.B16, V1.B16, V1.B16
	VEOR V2.B16, V2.B16, V2.B16
	VEOR V3.B16, V3.B16, V3.B16
	VEOR V4.B16, V4.B16, V4.B16
	VEOR V5.B16, V5.B16, V5.B16
	VEOR V6.B16, V6.B16, V6.B16
	VEOR V7.B16, V7.B16, V7.B16
	CBZ  R6, dots4_reduce
	MOVD R6, R13

dots4_vec:
	VLD1.P 32(R12), [V16.S4, V17.S4]
	VLD1.P 32(R8), [V18.S4, V19.S4]
	VLD1.P 32(R9), [V20.S4, V21.S4]
	VLD1.P 32(R10), [V22.S4, V23.S4]
	VLD1.P 32(R11), [V24.S4, V25.S4]
	VFMLA  V16.S4, V18.S4, V0.S4
	VFMLA  V17.S4, V19.S4, V1.S4
	VFMLA  V16.S4, V20.S4, V2.S4
	VFMLA  V17.S4, V21.S4, V3.S4
	VFMLA  V16.S4, V22.S4, V4.S4
	VFMLA  V17.S4, V23.S4, V5.S4
	VFMLA  V16.S4, V24.S4, V6.S4
	VFMLA  V17.S4, V25.S4, V7.S4
	SUBS   $8, R13, R13
	BNE    dots4_vec

dots4_reduce:
	REDUCE(0, 1, 16)
	REDUCE(2, 3, 17)
	REDUCE(4, 5, 18)
	REDUCE(6, 7, 19)
	CBZ  R7, dots4_store
	MOVD R7, R13

dots4_tail:
	FMOVS.P 4(R12), F16
	FMOVS.P 4(R8), F17
	FMOVS.P 4(R9), F18
	FMOVS.P 4(R10), F19
	FMOVS.P 4(R11), F20
	FMADDS  F16, F0, F17, F0 // F0 += x[j]*row0[j]
	FMADDS  F16, F2, F18, F2
	FMADDS  F16, F4, F19, F4
	FMADDS  F16, F6, F20, F6
	SUBS    $1, R13, R13
	BNE     dots4_tail

dots4_store:
	FMOVS F0, (R2)
	FMOVS F2, 4(R2)
	FMOVS F4, 8(R2)
	FMOVS F6, 12(R2)
	ADD   $16, R2
	SUB   $4, R5
	B     dots4

dots1:
	CBZ  R5, dots_end
	MOVD R1, R8
	ADD  R4, R1
	MOVD R0, R12
	VEOR V0.B16, V0.B16, V0.B16
	VEOR V1.B16, V1.B16, V1.B16
	CBZ  R6, dots1_reduce
	MOVD R6, R13

dots1_vec:
	VLD1.P 32(R12), [V16.S4, V17.S4]
	VLD1.P 32(R8), [V18.S4, V19.S4]
	VFMLA  V16.S4, V18.S4, V0.S4
	VFMLA  V17.S4, V19.S4, V1.S4
	SUBS   $8, R13, R13
	BNE    dots1_vec

dots1_reduce:
	REDUCE(0, 1, 16)
	CBZ  R7, dots1_store
	MOVD R7, R13

dots1_tail:
	FMOVS.P 4(R12), F16
	FMOVS.P 4(R8), F17
	FMADDS  F16, F0, F17, F0
	SUBS    $1, R13, R13
	BNE     dots1_tail

dots1_store:
	FMOVS.P F0, 4(R2)
	SUB     $1, R5
	B       dots1

dots_end:
	RET

// func gemm4x3NEON(w, x, out *float32, n, ldx, ldo, groups int)
//
// out[r+c*ldo] = w[r*n:(r+1)*n]·x[c*ldx:c*ldx+n] for r < 4 and c <
// 3*groups: a register block of four rows by three tokens, each row's 8
// floats loaded once for three tokens, each token's for four rows.
//
// R0 w, R1 the next group's first token, R2 out, R3 n, R4 ldx in bytes,
// R5 ldo in bytes, R6 groups left, R7 a row's bytes, R14 floats in the
// vector loop, R15 in the tail, R8-R11 the rows' pointers, R12, R13, R19 the
// tokens' pointers, R20 the loop's count. Row r and token c accumulate in
// V(6r+2c):V(6r+2c+1) (V0-V23); V24-V29 the tokens' 8 floats, V30:V31 a
// row's: all 32 vector registers.
TEXT ·gemm4x3NEON(SB), NOSPLIT, $0-56
	MOVD w+0(FP), R0
	MOVD x+8(FP), R1
	MOVD out+16(FP), R2
	MOVD n+24(FP), R3
	MOVD ldx+32(FP), R4
	MOVD ldo+40(FP), R5
	MOVD groups+48(FP), R6
	LSL  $2, R4
	LSL  $2, R5
	LSL  $2, R3, R7
	AND  $-8, R3, R14
	AND  $7, R3, R15

gemm_group:
	CBZ  R6, gemm_end
	MOVD R0, R8
	ADD  R7, R8, R9
	ADD  R7, R9, R10
	ADD  R7, R10, R11
	MOVD R1, R12
	ADD  R4, R12, R13
	ADD  R4, R13, R19
	ADD  R4, R19, R1
	VEOR V0.B16, V0.B16, V0.B16
	VEOR V1.B16, V1.B16, V1.B16
	VEOR V2.B16, V2.B16, V2.B16
	VEOR V3.B16, V3.B16, V3.B16
	VEOR V4.B16, V4.B16, V4.B16
	VEOR V5.B16, V5.B16, V5.B16
	VEOR V6.B16, V6.B16, V6.B16
	VEOR V7.B16, V7.B16, V7.B16
	VEOR V8.B16, V8.B16, V8.B16
	VEOR V9.B16, V9.B16, V9.B16
	VEOR V10.B16, V10.B16, V10.B16
	VEOR V11.B16, V11.B16, V11.B16
	VEOR V12.B16, V12.B16, V12.B16
	VEOR V13.B16, V13.B16, V13.B16
	VEOR V14.B16, V14.B16, V14.B16
	VEOR V15.B16, V15.B16, V15.B16
	VEOR V16.B16, V16.B16, V16.B16
	VEOR V17.B16, V17.B16, V17.B16
	VEOR V18.B16, V18.B16, V18.B16
	VEOR V19.B16, V19.B16, V19.B16
	VEOR V20.B16, V20.B16, V20.B16
	VEOR V21.B16, V21.B16, V21.B16
	VEOR V22.B16, V22.B16, V22.B16
	VEOR V23.B16, V23.B16, V23.B16
	CBZ  R14, gemm_reduce
	MOVD R14, R20

gemm_vec:
	VLD1.P 32(R12), [V24.S4, V25.S4]
	VLD1.P 32(R13), [V26.S4, V27.S4]
	VLD1.P 32(R19), [V28.S4, V29.S4]
	VLD1.P 32(R8), [V30.S4, V31.S4]  // row 0
	VFMLA  V24.S4, V30.S4, V0.S4
	VFMLA  V25.S4, V31.S4, V1.S4
	VFMLA  V26.S4, V30.S4, V2.S4
	VFMLA  V27.S4, V31.S4, V3.S4
	VFMLA  V28.S4, V30.S4, V4.S4
	VFMLA  V29.S4, V31.S4, V5.S4
	VLD1.P 32(R9), [V30.S4, V31.S4]  // row 1
	VFMLA  V24.S4, V30.S4, V6.S4
	VFMLA  V25.S4, V31.S4, V7.S4
	VFMLA  V26.S4, V30.S4, V8.S4
	VFMLA  V27.S4, V31.S4, V9.S4
	VFMLA  V28.S4, V30.S4, V10.S4
	VFMLA  V29.S4, V31.S4, V11.S4
	VLD1.P 32(R10), [V30.S4, V31.S4] // row 2
	VFMLA  V24.S4, V30.S4, V12.S4
	VFMLA  V25.S4, V31.S4, V13.S4
	VFMLA  V26.S4, V30.S4, V14.S4
	VFMLA  V27.S4, V31.S4, V15.S4
	VFMLA  V28.S4, V30.S4, V16.S4
	VFMLA  V29.S4, V31.S4, V17.S4
	VLD1.P 32(R11), [V30.S4, V31.S4] // row 3
	VFMLA  V24.S4, V30.S4, V18.S4
	VFMLA  V25.S4, V31.S4, V19.S4
	VFMLA  V26.S4, V30.S4, V20.S4
	VFMLA  V27.S4, V31.S4, V21.S4
	VFMLA  V28.S4, V30.S4, V22.S4
	VFMLA  V29.S4, V31.S4, V23.S4
	SUBS   $8, R20, R20
	BNE    gemm_vec

gemm_reduce:
	REDUCE(0, 1, 24)
	REDUCE(2, 3, 24)
	REDUCE(4, 5, 24)
	REDUCE(6, 7, 24)
	REDUCE(8, 9, 24)
	REDUCE(10, 11, 24)
	REDUCE(12, 13, 24)
	REDUCE(14, 15, 24)
	REDUCE(16, 17, 24)
	REDUCE(18, 19, 24)
	REDUCE(20, 21, 24)
	REDUCE(22, 23, 24)
	CBZ  R15, gemm_store
	MOVD R15, R20

gemm_tail:
	FMOVS.P 4(R12), F24
	FMOVS.P 4(R13), F25
	FMOVS.P 4(R19), F26
	FMOVS.P 4(R8), F27
	FMOVS.P 4(R9), F28
	FMOVS.P 4(R10), F29
	FMOVS.P 4(R11), F30
	FMADDS  F24, F0, F27, F0   // row 0
	FMADDS  F25, F2, F27, F2
	FMADDS  F26, F4, F27, F4
	FMADDS  F24, F6, F28, F6   // row 1
	FMADDS  F25, F8, F28, F8
	FMADDS  F26, F10, F28, F10
	FMADDS  F24, F12, F29, F12 // row 2
	FMADDS  F25, F14, F29, F14
	FMADDS  F26, F16, F29, F16
	FMADDS  F24, F18, F30, F18 // row 3
	FMADDS  F25, F20, F30, F20
	FMADDS  F26, F22, F30, F22
	SUBS    $1, R20, R20
	BNE     gemm_tail

gemm_store:
	FMOVS F0, (R2) // token 0's four rows
	FMOVS F6, 4(R2)
	FMOVS F12, 8(R2)
	FMOVS F18, 12(R2)
	ADD   R5, R2
	FMOVS F2, (R2) // token 1's
	FMOVS F8, 4(R2)
	FMOVS F14, 8(R2)
	FMOVS F20, 12(R2)
	ADD   R5, R2
	FMOVS F4, (R2) // token 2's
	FMOVS F10, 4(R2)
	FMOVS F16, 8(R2)
	FMOVS F22, 12(R2)
	ADD   R5, R2
	SUB   $1, R6
	B     gemm_group

gemm_end:
	RET

// func weightedSumNEON(out, v, c *float32, n, ldv, cnt int)
//
// out[i] += c[j]*v[j*ldv+i] for i < n, for j = 0 to cnt-1 in order: the
// outputs held in registers across the rows, 16 at a time, then 4, then 1.
//
// R0 out's next column, R1 v's, R2 c, R3 columns left, R4 ldv in bytes,
// R5 cnt, R6 the row's pointer, R7 c's, R8 rows left. V0-V3 the outputs,
// V4 c[j] in every lane, V5-V8 the row's floats.
TEXT ·weightedSumNEON(SB), NOSPLIT, $0-48
	MOVD out+0(FP), R0
	MOVD v+8(FP), R1
	MOVD c+16(FP), R2
	MOVD n+24(FP), R3
	MOVD ldv+32(FP), R4
	MOVD cnt+40(FP), R5
	LSL  $2, R4

wsum16:
	CMP  $16, R3
	BLT  wsum4
	VLD1 (R0), [V0.S4, V1.S4, V2.S4, V3.S4]
	MOVD R1, R6
	MOVD R2, R7
	MOVD R5, R8
	CBZ  R8, wsum16_store

wsum16_rows:
	VLD1R.P 4(R7), [V4.S4]
	VLD1    (R6), [V5.S4, V6.S4, V7.S4, V8.S4]
	ADD     R4, R6
	VFMLA   V4.S4, V5.S4, V0.S4
	VFMLA   V4.S4, V6.S4, V1.S4
	VFMLA   V4.S4, V7.S4, V2.S4
	VFMLA   V4.S4, V8.S4, V3.S4
	SUBS    $1, R8, R8
	BNE     wsum16_rows

wsum16_store:
	VST1.P [V0.S4, V1.S4, V2.S4, V3.S4], 64(R0)
	ADD    $64, R1
	SUB    $16, R3
	B      wsum16

wsum4:
	CMP  $4, R3
	BLT  wsum1
	VLD1 (R0), [V0.S4]
	MOVD R1, R6
	MOVD R2, R7
	MOVD R5, R8
	CBZ  R8, wsum4_store

wsum4_rows:
	VLD1R.P 4(R7), [V4.S4]
	VLD1    (R6), [V5.S4]
	ADD     R4, R6
	VFMLA   V4.S4, V5.S4, V0.S4
	SUBS    $1, R8, R8
	BNE     wsum4_rows

wsum4_store:
	VST1.P [V0.S4], 16(R0)
	ADD    $16, R1
	SUB    $4, R3
	B      wsum4

wsum1:
	CBZ   R3, wsum_end
	FMOVS (R0), F0
	MOVD  R1, R6
	MOVD  R2, R7
	MOVD  R5, R8
	CBZ   R8, wsum1_store

wsum1_rows:
	FMOVS.P 4(R7), F4
	FMOVS   (R6), F5
	ADD     R4, R6
	FMADDS  F4, F0, F5, F0 // F0 += c[j]*v[j][i]
	SUBS    $1, R8, R8
	BNE     wsum1_rows

wsum1_store:
	FMOVS.P F0, 4(R0)
	ADD     $4, R1
	SUB     $1, R3
	B       wsum1

wsum_end:
	RET
