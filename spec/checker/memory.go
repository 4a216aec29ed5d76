package checker

import (
	"errors"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
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

// gcPercent is the collector's GOGC while explorations run and the heap is
// large. With the default of 100 the heap grows to twice what was live at
// the last collection before the next one: the model's steps leave garbage
// behind every transition, so the peak was twice the live heap (50 bytes per
// state live, 100 at the peak, at the two-page bounds). The checker's own
// memory is large pointer-free arrays, which the collector does not scan, so
// collecting four times as often costs little CPU.
const gcPercent = 25

// gcPercentSmall is GOGC while the heap is under smallHeap: a small heap at
// 25 is collected every few megabytes, and each collection stops the
// workers twice and takes a share of their cores while it marks. At the
// default bounds (GODEBUG=gctrace=1) 100 makes 10 collections instead of 39,
// 12 ms of the collector's CPU instead of 41 and 1.6 ms of stopped world
// instead of 6.8, for a peak RSS of 130-146 MB instead of 126-129; doubling
// a heap this small matters to no run's limit.
const gcPercentSmall = 100

// smallHeap is the heap (live and not yet swept objects, the whole
// program's) under which explorations run at gcPercentSmall. Back under
// half of it (the defense matrix's explorations end and start), it returns.
const smallHeap = 256 << 20

// collector is the program's collector settings, kept while explorations
// run (the defense matrix runs one per core) and restored when the last ends.
var collector struct {
	sync.Mutex
	running int
	percent int   // the program's GOGC
	limit   int64 // the program's soft memory limit
	current int   // GOGC now, while explorations run
}

// tuneCollector lowers GOGC to gcPercentSmall (never raising it, nor turning
// a disabled collector on; adaptCollector lowers it further for a large
// heap) and the soft memory limit to maxMemory (0: none) for one
// exploration; the returned function ends it.
func tuneCollector(maxMemory uint64) (restore func()) {
	collector.Lock()
	defer collector.Unlock()
	if collector.running == 0 {
		collector.percent = debug.SetGCPercent(gcPercentSmall)
		collector.current = gcPercentSmall
		if collector.percent < gcPercentSmall {
			debug.SetGCPercent(collector.percent)
			collector.current = collector.percent
		}
		collector.limit = debug.SetMemoryLimit(-1)
	}
	collector.running++
	if maxMemory > 0 {
		debug.SetMemoryLimit(min(debug.SetMemoryLimit(-1), int64(min(maxMemory, 1<<62))))
	}
	return func() {
		collector.Lock()
		defer collector.Unlock()
		if collector.running--; collector.running == 0 {
			debug.SetGCPercent(collector.percent)
			debug.SetMemoryLimit(collector.limit)
		}
	}
}

// adaptCollector sets GOGC for a heap of objects bytes while explorations
// run: gcPercent from smallHeap up, gcPercentSmall under half of it, never
// above the program's own.
func adaptCollector(objects uint64) {
	collector.Lock()
	defer collector.Unlock()
	want := collector.current
	switch {
	case collector.running == 0:
		return
	case objects >= smallHeap:
		want = gcPercent
	case objects < smallHeap/2:
		want = gcPercentSmall
	}
	if collector.percent < want {
		want = collector.percent
	}
	if want != collector.current {
		debug.SetGCPercent(want)
		collector.current = want
	}
}
