//go:build cudaemu && !cuda

package cuda

/*
#cgo CXXFLAGS: -std=c++17 -O2 -Wno-unknown-pragmas
#include <stdint.h>
#include <stdlib.h>
int emu_kernel(const char* name);
uint64_t emu_alloc(size_t n);
int emu_free(uint64_t p);
int emu_htod(uint64_t dst, const void* src, size_t n);
int emu_dtoh(void* dst, uint64_t src, size_t n);
int emu_dtod(uint64_t dst, uint64_t src, size_t n);
int emu_launch(int k, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
               const uint64_t* params, int n);
*/
import "C"

import (
	_ "embed"
	"fmt"
	"sync"
	"unsafe"
)

// kernelsSource is kernels.cu, which emu.cc includes. Embedding it makes it an input of this
// package's build, so that the go command recompiles the emulator when it changes (it does
// not track files it does not know, such as .cu, otherwise).
//
//go:embed kernels.cu
var kernelsSource string

// NewEmulated returns a backend on the CUDA emulator (emu.cc): kernels.cu's kernels run on
// the CPU, one block at a time. It exists so that tests exercise the backend's host code and
// kernels where there is no GPU; it is far slower than the CPU backend.
func NewEmulated() *Backend {
	d := &emuDevice{}
	for k, name := range kernelNames {
		cs := C.CString(name)
		d.fns[k] = C.emu_kernel(cs)
		C.free(unsafe.Pointer(cs))
	}
	return newBackend(d)
}

// emuMu serialises the emulator: its scheduler state is global.
var emuMu sync.Mutex

type emuDevice struct {
	fns    [numKernels]C.int
	closed bool
}

func (d *emuDevice) do(f func() error) error {
	emuMu.Lock()
	defer emuMu.Unlock()
	if d.closed {
		return fmt.Errorf("cuda: device closed")
	}
	return f()
}

func (d *emuDevice) alloc(bytes int) (devptr, error) {
	p := C.emu_alloc(C.size_t(bytes))
	if p == 0 {
		return 0, fmt.Errorf("emulator: out of memory for %d bytes", bytes)
	}
	return devptr(p), nil
}

func (d *emuDevice) free(p devptr) error {
	if C.emu_free(C.uint64_t(p)) != 0 {
		return fmt.Errorf("emulator: free of %#x, not an allocation", uint64(p))
	}
	return nil
}

func (d *emuDevice) htod(dst devptr, src unsafe.Pointer, bytes int) error {
	if C.emu_htod(C.uint64_t(dst), src, C.size_t(bytes)) != 0 {
		return fmt.Errorf("emulator: copy of %d bytes to %#x leaves its allocation", bytes, uint64(dst))
	}
	return nil
}

func (d *emuDevice) dtoh(dst unsafe.Pointer, src devptr, bytes int) error {
	if C.emu_dtoh(dst, C.uint64_t(src), C.size_t(bytes)) != 0 {
		return fmt.Errorf("emulator: copy of %d bytes from %#x leaves its allocation", bytes, uint64(src))
	}
	return nil
}

func (d *emuDevice) dtod(dst, src devptr, bytes int) error {
	if C.emu_dtod(C.uint64_t(dst), C.uint64_t(src), C.size_t(bytes)) != 0 {
		return fmt.Errorf("emulator: device copy of %d bytes leaves an allocation", bytes)
	}
	return nil
}

func (d *emuDevice) launch(k kernel, grid, block dim3, params ...uint64) error {
	var p *C.uint64_t
	if len(params) > 0 {
		p = (*C.uint64_t)(unsafe.Pointer(&params[0]))
	}
	rc := C.emu_launch(d.fns[k], C.uint(grid.x), C.uint(grid.y), C.uint(grid.z),
		C.uint(block.x), C.uint(block.y), C.uint(block.z), p, C.int(len(params)))
	switch rc {
	case 0:
		return nil
	case -2:
		return fmt.Errorf("emulator: %s launched with %d parameters, not its own count", kernelNames[k], len(params))
	case -3:
		return fmt.Errorf("emulator: %s launched with grid %v block %v", kernelNames[k], grid, block)
	case -4:
		return fmt.Errorf("emulator: %s deadlocked", kernelNames[k])
	default:
		return fmt.Errorf("emulator: %s: launch failed (%d)", kernelNames[k], int(rc))
	}
}

func (d *emuDevice) sync() error { return nil }

func (d *emuDevice) close() error {
	emuMu.Lock()
	defer emuMu.Unlock()
	d.closed = true
	return nil
}
