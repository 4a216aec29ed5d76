package checker

import (
	"errors"
	"runtime"
	"runtime/metrics"
	"unsafe"
)

// ErrMemoryLimit is returned (in a LimitError) when the live heap exceeds
// Options.MaxMemory.
var ErrMemoryLimit = errors.New("checker: memory limit exceeded")

func sizeOf[S any]() int {
	var s S
	return int(unsafe.Sizeof(s))
}

// heap measures the Go heap with runtime/metrics.
type heap struct {
	samples []metrics.Sample
	peak    uint64
}

func newHeap() *heap {
	return &heap{samples: []metrics.Sample{
		{Name: "/memory/classes/heap/objects:bytes"}, // live and not yet swept dead objects
		{Name: "/gc/heap/live:bytes"},                // live objects at the last GC
	}}
}

func (h *heap) read() (objects, live uint64) {
	metrics.Read(h.samples)
	for i, s := range h.samples {
		if s.Value.Kind() != metrics.KindUint64 {
			continue
		}
		if i == 0 {
			objects = s.Value.Uint64()
		} else {
			live = s.Value.Uint64()
		}
	}
	return objects, live
}

// over reports whether the live heap exceeds limit. Objects include garbage
// not yet collected, so past the limit it collects and measures again.
func (h *heap) over(limit uint64) (bool, uint64) {
	objects, _ := h.read()
	h.peak = max(h.peak, objects)
	if limit == 0 || objects <= limit {
		return false, objects
	}
	runtime.GC()
	_, live := h.read()
	return live > limit, live
}
