//go:build cuda || cudaemu

package cuda

import "unsafe"

// devptr is an address in device memory.
type devptr uint64

// dim3 is a launch's grid or block shape.
type dim3 struct{ x, y, z int }

// kernel names one of kernels.cu's entry points.
type kernel int

const (
	kEmbed kernel = iota
	kRMSNorm
	kMatvec
	kMatmul
	kRope
	kStoreKV
	kAttention
	kSwiGLU
	kScatterPages
	kGatherPages
	numKernels
)

// kernelNames are the entry points' names in kernels.ptx.
var kernelNames = [numKernels]string{
	kEmbed: "embed", kRMSNorm: "rmsnorm", kMatvec: "matvec", kMatmul: "matmul", kRope: "rope",
	kStoreKV: "store_kv", kAttention: "attention", kSwiGLU: "swiglu",
	kScatterPages: "scatter_pages", kGatherPages: "gather_pages",
}

// device is what the backend needs of a GPU. Two implementations: the CUDA driver through
// gorgonia.org/cu (build tag cuda), and an emulator that runs kernels.cu's CUDA C on the CPU
// (build tag cudaemu) so that the backend's host code and its kernels are tested where there
// is no GPU.
//
// The methods other than do and close must be called inside do, which runs f on the one OS
// thread that owns the device's context. Copies are synchronous and ordered after the
// kernels launched before them (the context's default stream); launches are asynchronous.
type device interface {
	do(f func() error) error
	alloc(bytes int) (devptr, error)
	free(p devptr) error
	htod(dst devptr, src unsafe.Pointer, bytes int) error
	dtoh(dst unsafe.Pointer, src devptr, bytes int) error
	dtod(dst, src devptr, bytes int) error
	// launch runs k over grid × block; every parameter is 8 bytes (pointers, integers, and
	// float64 bits), as Function.Launch copies 8 bytes per parameter.
	launch(k kernel, grid, block dim3, params ...uint64) error
	// sync waits for every launched kernel.
	sync() error
	close() error
}
