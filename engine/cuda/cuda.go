//go:build cuda

package cuda

import (
	_ "embed"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"unsafe"

	"gorgonia.org/cu"
)

// kernelsPTX is kernels.cu compiled for compute_90 by ptxgen (see doc.go).
//
//go:embed kernels.ptx
var kernelsPTX string

// New opens CUDA device ordinal and returns a backend on it. The device's primary context is
// retained (not created) and owned by one locked OS thread for the backend's life; the
// kernels are loaded from the embedded PTX, which the driver compiles for the device.
func New(ordinal int) (*Backend, error) {
	d, err := openCU(ordinal)
	if err != nil {
		return nil, err
	}
	return newBackend(d), nil
}

// DeviceName is device ordinal's name, for reports.
func DeviceName(ordinal int) (string, error) {
	dev, err := cu.GetDevice(ordinal)
	if err != nil {
		return "", err
	}
	return dev.Name()
}

// cuDevice runs every driver call on one locked OS thread, where the context is current.
type cuDevice struct {
	calls chan func()
	quit  chan struct{} // closed by close: the thread stops taking calls
	stop  sync.Once
	done  chan struct{} // closed when the thread has released the context
	dev   cu.Device
	ctx   cu.CUContext
	mod   cu.Module
	fns   [numKernels]cu.Function
}

func openCU(ordinal int) (*cuDevice, error) {
	d := &cuDevice{calls: make(chan func()), quit: make(chan struct{}), done: make(chan struct{})}
	ready := make(chan error, 1)
	go d.loop(ordinal, ready)
	if err := <-ready; err != nil {
		return nil, fmt.Errorf("%w: open device %d: %v", ErrDevice, ordinal, err)
	}
	return d, nil
}

// loop is the context's thread: it binds the primary context, loads the module, then runs
// calls until close.
func (d *cuDevice) loop(ordinal int, ready chan<- error) {
	runtime.LockOSThread()
	defer close(d.done)
	err := d.open(ordinal)
	ready <- err
	if err != nil {
		return
	}
	for running := true; running; {
		select {
		case f := <-d.calls:
			f()
		case <-d.quit:
			running = false
		}
	}
	if d.mod != (cu.Module{}) {
		_ = d.mod.Unload()
	}
	_ = d.dev.ReleasePrimaryCtx()
}

func (d *cuDevice) open(ordinal int) error {
	n, err := cu.NumDevices()
	if err != nil {
		return err
	}
	if ordinal < 0 || ordinal >= n {
		return fmt.Errorf("no device %d of %d", ordinal, n)
	}
	if d.dev, err = cu.GetDevice(ordinal); err != nil {
		return err
	}
	if d.ctx, err = d.dev.RetainPrimaryCtx(); err != nil {
		return err
	}
	if err := cu.SetCurrentContext(d.ctx); err != nil {
		_ = d.dev.ReleasePrimaryCtx()
		return err
	}
	if d.mod, err = cu.LoadData(kernelsPTX); err != nil {
		_ = d.dev.ReleasePrimaryCtx()
		return fmt.Errorf("load kernels.ptx: %v", err)
	}
	for k, name := range kernelNames {
		if d.fns[k], err = d.mod.Function(name); err != nil {
			return fmt.Errorf("kernel %s: %v", name, err)
		}
	}
	return nil
}

var errClosed = errors.New("cuda: device closed")

func (d *cuDevice) do(f func() error) (err error) {
	res := make(chan error, 1)
	select {
	case d.calls <- func() { res <- f() }:
	case <-d.done:
		return errClosed
	}
	return <-res
}

func (d *cuDevice) alloc(bytes int) (devptr, error) {
	p, err := cu.MemAlloc(int64(bytes))
	return devptr(p), err
}

func (d *cuDevice) free(p devptr) error { return cu.MemFree(cu.DevicePtr(p)) }

func (d *cuDevice) htod(dst devptr, src unsafe.Pointer, bytes int) error {
	return cu.MemcpyHtoD(cu.DevicePtr(dst), src, int64(bytes))
}

func (d *cuDevice) dtoh(dst unsafe.Pointer, src devptr, bytes int) error {
	return cu.MemcpyDtoH(dst, cu.DevicePtr(src), int64(bytes))
}

func (d *cuDevice) dtod(dst, src devptr, bytes int) error {
	return cu.MemcpyDtoD(cu.DevicePtr(dst), cu.DevicePtr(src), int64(bytes))
}

func (d *cuDevice) launch(k kernel, grid, block dim3, params ...uint64) error {
	args := make([]unsafe.Pointer, len(params))
	for i := range params {
		args[i] = unsafe.Pointer(&params[i])
	}
	return d.fns[k].Launch(grid.x, grid.y, grid.z, block.x, block.y, block.z, 0, cu.NoStream, args)
}

func (d *cuDevice) sync() error { return cu.Synchronize() }

func (d *cuDevice) close() error {
	d.stop.Do(func() { close(d.quit) })
	<-d.done
	return nil
}
