// Package cuda is the engine's CUDA backend (build tag cuda): the model's weights and the KV
// pool in device memory, the forward pass as kernels of our own written in CUDA C
// (kernels.cu), the read-time tag check inside the attention kernel. It is the only importer
// of gorgonia.org/cu (v0.9.6) in the module. Without a build tag this package is empty, so a
// plain build links no CUDA library and needs no CUDA headers.
//
// # Using it
//
//	b, err := cuda.New(0)                       // device 0; built with -tags cuda
//	e, err := engine.New(m, b, cache, opts)     // Load: weights to the device; AttachPool: the pool
//	out, err := e.Generate(table, prompt, n, sampler, stop)
//	b.UploadPages(pages)                        // decode node: pages verified in host memory, to the device
//	b.DownloadPages(pages)                      // prefill node: pages computed on the device, to host memory
//	b.Close()
//
// A binary built with -tags cuda needs a GPU: gorgonia.org/cu calls cuInit in its package
// init and exits the process when that fails (no device, or no driver), so it
// cannot fall back to the CPU; build without the tag for that.
//
// # The context thread
//
// One OS thread owns the CUDA context for the backend's life: New starts a goroutine that
// locks itself to its thread, retains the device's primary context (cuDevicePrimaryCtxRetain,
// not cuInit or cuCtxCreate, which CUDA 13 changed), makes it current, and loads the kernels;
// every later driver call runs there, sent as a closure. A whole forward step is one closure.
//
// # A step on the device
//
// Forward copies the step's input (the table's held epochs and pages, the tokens) to the
// device in one copy, then launches on the context's default stream: embed; per layer
// rmsnorm, the q/k/v matmuls, rope, store_kv (the new positions' keys and values into their
// pages through the table), attention (over every position through the table), the output
// matmul with the residual add as its epilogue, rmsnorm, the gate and up matmuls, swiglu, the
// down matmul with its residual add; then the final rmsnorm and the classifier over the last
// token. Matrix products are our own kernels (no cuBLAS): one warp per output row for short
// steps (a decode step reads each weight once), a tiled kernel through shared memory for long
// ones (prefill). Prompts longer than 256 tokens run in chunks, so scratch stays small. The
// step's only synchronisation is its last call: one device-to-host copy of the logits and,
// right after them in the same buffer, two status words.
//
// # The tag check on the device
//
// The device holds a mirror of the pool's current epoch of every page (SetEpochs copies the
// span that changed). store_kv reads the tag of the page it writes once per block and
// compares the epoch the request holds with the mirror's; a page that fails is not written,
// and the lowest failing table index goes into status word 0. attention checks every page it
// is about to read, each page once per block, before reading any of them; if one fails, the
// block reads none and records the lowest failing index in status word 1. Both words come
// back with the logits, so the check costs no extra synchronisation: Forward then returns a
// *kv.TagError naming the page (word 0 first, as the CPU backend checks written pages first)
// and the logits are discarded. With Step.Unchecked (research switch no-tag-check) the
// kernels skip the comparison and read whatever the pages hold.
//
// # Pages and the transport
//
// Pages that arrive over the transport land in host memory (the kv.Cache region registered
// with the RDMA provider), are verified there by the protocol, and only then copied to the
// device by UploadPages: packed into one host buffer, one host-to-device copy, one scatter
// kernel into the pool. DownloadPages is the reverse for a prefill node. The NIC writing
// straight into device memory (GPUDirect RDMA) needs a GPU and an RDMA NIC on the same PCIe
// root and the nvidia-peermem driver, which we do not have; with it, the receiver would also
// have to flush the NIC's writes before verifying (docs/protocol.md#the-happy-path).
//
// # The kernels, compiled ahead of time
//
// kernels.cu is compiled to PTX for compute_90 (sm_90: H100, H200) by ./ptxgen, which imports
// only gorgonia.org/cu/nvrtc (NVRTC runs without a GPU), and the PTX is committed and embedded;
// cu.LoadData hands it to the driver, which compiles it for the device (newer drivers JIT
// PTX of older versions). So the GPU machine needs only its driver's libcuda.so.1. After
// changing kernels.cu, regenerate (NVRTC 11.8 from Debian's non-free packages, fetched by
// scripts/cuda-stubs.sh --nvrtc; a dev step, not a CI step):
//
//	cuda_env=$(scripts/cuda-stubs.sh /tmp/kvh-cuda --nvrtc) && eval "$cuda_env"
//	go generate ./engine/cuda
//
// CI checks that kernels.ptx is what kernels.cu compiles to.
//
// Every kernel parameter is 8 bytes (pointers, long long, double), because cu's
// Function.Launch copies 8 bytes per parameter.
//
// # Testing without a GPU
//
// The backend's device calls go through a small interface with two implementations: the
// driver (tag cuda) and an emulator (tag cudaemu, emu.cc) that compiles kernels.cu as C++ and
// runs a launch's blocks one after another on the CPU, with a block's threads as coroutines
// switched at __syncthreads and warp shuffles. `go test -tags cudaemu ./engine/cuda` runs the
// same tests as on a GPU (both backends give the same tokens, stale pages fail naming the
// page, page copies round-trip) against the emulator; CI runs them under AddressSanitizer,
// which reports any kernel access outside its allocations:
//
//	CGO_CXXFLAGS="-fsanitize=address -O1 -g" go test -asan -tags cudaemu ./engine/cuda
//
// gpucheck.sh runs the same tests, and the benchmarks, on a real GPU.
package cuda

//go:generate go run -tags nvrtc ./ptxgen -in kernels.cu -out kernels.ptx
