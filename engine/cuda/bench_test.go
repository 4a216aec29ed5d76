//go:build cuda || cudaemu

package cuda

import (
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
)

// stories15MShape is llama2.c's stories15M architecture (random weights from our writer's
// Randomize): dim 288, 6 layers, 6 heads, seq 256, vocab 32000.
var stories15MShape = llama.Config{Dim: 288, HiddenDim: 768, Layers: 6, Heads: 6, KVHeads: 6, Vocab: 32000, SeqLen: 256, SharedClassifier: true}

// benchBackends runs f on the CPU backend and on this package's, same run, so that the
// figures are read as a ratio.
func benchBackends(b *testing.B, f func(b *testing.B, be backend.Backend)) {
	b.Run("backend=cpu", func(b *testing.B) { f(b, cpu.New()) })
	b.Run("backend=cuda/"+deviceName(), func(b *testing.B) {
		g := openTest(b)
		defer g.Close()
		f(b, g)
	})
}

func benchEngine(b *testing.B, be backend.Backend, c llama.Config, pages int) *engine.Engine {
	m := randomModel(b, c, 1)
	cache, err := kv.New(engine.GeometryOf(c, 16), pages)
	if err != nil {
		b.Fatal(err)
	}
	e, err := engine.New(m, be, cache, engine.Options{})
	if err != nil {
		b.Fatal(err)
	}
	return e
}

// BenchmarkDecode: decode tokens/s of the stories15M shape at a context of 128 positions.
func BenchmarkDecode(b *testing.B) {
	benchBackends(b, func(b *testing.B, be backend.Backend) {
		e := benchEngine(b, be, stories15MShape, 16)
		table := allocate(b, e, 1, 256)
		prompt := make([]int, 128)
		for i := range prompt {
			prompt[i] = (i * 31) % stories15MShape.Vocab
		}
		if _, err := e.Prefill(table, prompt); err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		start := time.Now()
		for i := 0; i < b.N; i++ {
			if _, err := e.Step(table, []int{5}, 128); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "tokens/s")
	})
}

// BenchmarkPrefill: prefill tokens/s of the stories15M shape, prompts of 128 tokens.
func BenchmarkPrefill(b *testing.B) {
	benchBackends(b, func(b *testing.B, be backend.Backend) {
		e := benchEngine(b, be, stories15MShape, 16)
		table := allocate(b, e, 1, 128)
		prompt := make([]int, 128)
		for i := range prompt {
			prompt[i] = (i * 31) % stories15MShape.Vocab
		}
		b.ResetTimer()
		start := time.Now()
		for i := 0; i < b.N; i++ {
			if _, err := e.Prefill(table, prompt); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.N*len(prompt))/time.Since(start).Seconds(), "tokens/s")
	})
}

// BenchmarkPageCopy: device-to-device bytes/s of the gather kernel over scattered pages of
// the stories15M shape (what DownloadPages and UploadPages launch) against cuMemcpyDtoD of
// the same bytes, contiguous, same run; and the host-to-device upload path end to end.
func BenchmarkPageCopy(b *testing.B) {
	g := openTest(b)
	defer g.Close()
	const pages = 512
	e := benchEngine(b, g, stories15MShape, pages)
	list := make([]uint32, 0, pages/2)
	for p := 0; p < pages; p += 2 { // every other page: scattered
		list = append(list, uint32(p))
	}
	bytes := len(list) * e.Cache().Geometry().PageBytes()
	var kernelS, dtodS float64
	err := g.dev.do(func() error {
		idx, data, err := g.stage(list)
		if err != nil {
			return err
		}
		timeIt := func(f func() error) (float64, error) {
			if err := f(); err != nil { // warm
				return 0, err
			}
			if err := g.dev.sync(); err != nil {
				return 0, err
			}
			start := time.Now()
			for i := 0; i < b.N; i++ {
				if err := f(); err != nil {
					return 0, err
				}
			}
			if err := g.dev.sync(); err != nil {
				return 0, err
			}
			return time.Since(start).Seconds(), nil
		}
		b.ResetTimer()
		if kernelS, err = timeIt(func() error { return g.copyPages(kGatherPages, data, idx, len(list)) }); err != nil {
			return err
		}
		dtodS, err = timeIt(func() error { return g.dev.dtod(data, g.pool, bytes) })
		return err
	})
	if err != nil {
		b.Fatal(err)
	}
	kernel, dtod := float64(b.N*bytes)/kernelS, float64(b.N*bytes)/dtodS
	b.ReportMetric(kernel/1e9, "gather-GB/s")
	b.ReportMetric(dtod/1e9, "dtod-GB/s")
	b.ReportMetric(kernel/dtod, "gather/dtod")
}

// BenchmarkUploadPages: verified pages from host memory to the device, end to end (pack, one
// copy, scatter), in bytes/s.
func BenchmarkUploadPages(b *testing.B) {
	g := openTest(b)
	defer g.Close()
	const pages = 512
	e := benchEngine(b, g, stories15MShape, pages)
	list := make([]uint32, 0, pages/2)
	for p := 0; p < pages; p += 2 {
		list = append(list, uint32(p))
	}
	b.SetBytes(int64(len(list) * e.Cache().Geometry().PageBytes()))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := g.UploadPages(list); err != nil {
			b.Fatal(err)
		}
	}
}
