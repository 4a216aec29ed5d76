// Package cpu is the engine's CPU backend: the llama forward pass in Go (no
// cgo), parallel over output rows in the matrix products and over (token,
// head) pairs in attention.
//
// On amd64 with AVX2 and FMA the matrix products and attention's inner
// products run in assembly (kernels_amd64.s, written by the avo generator in
// asmgen: go generate), on arm64 in NEON assembly written by hand
// (kernels_arm64.s), elsewhere pure Go. Every kernel computes an inner
// product in the same order (see asmgen), so a product's bits do not depend
// on the kernel, the batch, the split over threads or the architecture.
//
// Decode is bound by memory bandwidth: each step reads every weight. So
// Load asks Linux to back the weights with huge pages (a hint; see
// adviseHugePages), and the matrix-vector kernel prefetches the rows' bytes
// ahead of its reads. One thread computes on the caller's goroutine with no
// allocation; more split each product with a team of worker goroutines that
// spin briefly between products and park when idle (team.go), stopped by
// Close.
//
// Its KV pool is the cache's host region itself, so the pages it writes are
// the bytes the transport moves, with no copy (UploadPages and DownloadPages
// do nothing). Prefill processes the prompt's tokens as one batch, each weight
// row read once for all of them; decode is the same code with one token.
//
// The read-time tag check: Forward compares the mirrored current epoch of
// every page it is about to write before it writes anything, and, inside
// attention, of every page it reads keys or values from, at the read. A
// mismatch fails the step with a *kv.TagError naming the page. The check
// costs one comparison per page read per token and layer (a token's heads
// read a page together).
package cpu

//go:generate go run -tags asmgen ./asmgen -out kernels_amd64.s -stubs kernels_amd64.go -pkg cpu
