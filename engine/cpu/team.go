package cpu

import (
	"runtime"
	"sync/atomic"
	"time"
)

// A team is the goroutines a multi-threaded backend splits its products
// over: workers started once and kept, each waiting for its next share by
// spinning for a while before it parks.
//
// Why not a goroutine per product: a decode step of a stories15M-shaped
// model is about 31 products of 100 µs each on two cores, and a fresh
// goroutine reaches the idle core only after the runtime wakes a parked
// thread for it (tens of µs on a virtual machine), then the caller parks in
// Wait until it is done. That cost 24% more CPU per token on two threads
// than on one (measured 2026-12-02: 186.8 against 231.5 tokens per
// CPU-second, BenchmarkDecodeThreads). A worker that spins between products
// picks up the next one in well under a µs; OpenMP's runtimes do the same
// (GOMP_SPINCOUNT). It parks after spinWait with nothing to do, so an idle
// backend costs nothing.
type team struct {
	workers []*worker
	stop    atomic.Bool
	live    atomic.Int32 // workers not yet returned
}

// spinWait is how long a worker spins for its next share before it parks:
// longer than the serial stretches of a decode step (a norm, rotary, the
// sampling over the vocabulary between tokens), far shorter than a
// scheduler's time slice.
const spinWait = 100 * time.Microsecond

type worker struct {
	seq  atomic.Uint64 // bumped by the caller once the share below is set
	done atomic.Uint64 // the last seq the worker finished
	// The share: f over [lo, hi). Written before seq's bump, read after
	// the worker sees it (the atomics order them).
	f      func(lo, hi int)
	lo, hi int
	parked atomic.Bool
	wake   chan struct{} // a token when the caller finds the worker parked
	// The caller's side of the same: it parks when the worker is late
	// (descheduled on a loaded machine), instead of spinning on the core
	// the worker needs.
	callerParked atomic.Bool
	finished     chan struct{}
}

func newTeam(n int) *team {
	t := &team{workers: make([]*worker, n)}
	for i := range t.workers {
		w := &worker{wake: make(chan struct{}, 1), finished: make(chan struct{}, 1)}
		t.workers[i] = w
		t.live.Add(1)
		go func() {
			defer t.live.Add(-1)
			w.run(&t.stop)
		}()
	}
	return t
}

// close ends the workers; a parked one is woken to see it.
func (t *team) close() {
	t.stop.Store(true)
	for _, w := range t.workers {
		select {
		case w.wake <- struct{}{}:
		default:
		}
	}
}

func (w *worker) run(stop *atomic.Bool) {
	var last uint64
	for {
		if !w.await(last, stop) {
			return
		}
		last = w.seq.Load()
		w.f(w.lo, w.hi)
		w.f = nil // the closure holds the caller's buffers: not past its step
		w.done.Store(last)
		if w.callerParked.Load() {
			select {
			case w.finished <- struct{}{}:
			default:
			}
		}
	}
}

// await waits until the caller publishes a share past last: it reports
// false when the team stops.
func (w *worker) await(last uint64, stop *atomic.Bool) bool {
	spinThenPark(func() bool { return stop.Load() || w.seq.Load() != last }, &w.parked, w.wake)
	return !stop.Load()
}

// spinThenPark returns once ready holds: it spins, yielding to other
// goroutines every 64 tries, for spinWait, then parks on wake with parked
// set. Whoever makes ready hold stores that first and then reads parked,
// sending a token if it is set: either that read sees parked, or ready's
// check after parked is set sees the store.
func spinThenPark(ready func() bool, parked *atomic.Bool, wake <-chan struct{}) {
	var since time.Time
	for spins := 1; !ready(); spins++ {
		if spins%64 != 0 {
			continue
		}
		runtime.Gosched()
		if since.IsZero() {
			since = time.Now()
			continue
		}
		if time.Since(since) < spinWait {
			continue
		}
		parked.Store(true)
		if !ready() {
			<-wake // may be a stale token: the loop checks again
		}
		parked.Store(false)
		since = time.Time{}
	}
}

// run calls f over [0, n) in chunks, one per worker and the caller's first;
// it returns when every chunk has. chunks is at most len(workers)+1.
func (t *team) run(n, chunks int, f func(lo, hi int)) {
	active := t.workers[:chunks-1]
	for i, w := range active {
		c := i + 1
		w.f, w.lo, w.hi = f, c*n/chunks, (c+1)*n/chunks
		w.seq.Add(1)
		if w.parked.Load() {
			select {
			case w.wake <- struct{}{}:
			default: // a token is already there
			}
		}
	}
	f(0, n/chunks)
	for _, w := range active {
		w.wait(w.seq.Load())
	}
}

// wait returns once the worker finished share want: spinning, then parked
// (the worker stores done, then reads callerParked).
func (w *worker) wait(want uint64) {
	spinThenPark(func() bool { return w.done.Load() == want }, &w.callerParked, w.finished)
}
