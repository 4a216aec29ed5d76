//go:build cuda || cudaemu

package cuda

import (
	"bytes"
	"testing"
	"unsafe"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
)

// On a prefill node, engine.Source computes a request's KV into the transport's source pages
// (a cache over pages someone else holds, kv.OverPages): with this backend the KV is computed
// on the device and must be in the host pages when FillKV returns, as the CPU backend leaves
// it, since the WRITEs send host memory.
func TestSourceLeavesTheDevicesKVInTheHostPages(t *testing.T) {
	m := randomModel(t, llama.Config{Dim: 32, HiddenDim: 64, Layers: 2, Heads: 4, KVHeads: 2, Vocab: 50, SeqLen: 40}, 8)
	const pageTokens, pages = 4, 6
	g := engine.GeometryOf(m.Config, pageTokens)
	fill := func(b backend.Backend) [][]byte {
		host := make([][]byte, pages)
		for i := range host {
			words := make([]uint32, g.PageBytes()/4) // 4-byte aligned
			for j := range words {
				words[j] = 0xdeadbeef // what the transport's memory held before
			}
			host[i] = bytesOf(words)
		}
		cache, err := kv.OverPages(g, host, kv.Unversioned)
		if err != nil {
			t.Fatal(err)
		}
		e, err := engine.New(m, b, cache, engine.Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		src := engine.NewSource()
		src.Use(e)
		prompt := []int{5, 4, 3, 2, 1, 9, 8, 7, 6, 10, 11}
		src.Expect(7, prompt)
		// The request's source pages, out of order.
		if err := src.FillKV(7, len(prompt), []uint32{4, 1, 3}, [][]byte{host[4], host[1], host[3]}); err != nil {
			t.Fatal(err)
		}
		return host
	}
	want, got := fill(cpu.New()), fill(openTest(t))
	for p := range want {
		// Compare as floats within rounding: the backends sum in different orders.
		w, g := floatsOf(want[p]), floatsOf(got[p])
		for i := range w {
			if d := w[i] - g[i]; d > 1e-4 || d < -1e-4 || (w[i] != w[i]) != (g[i] != g[i]) {
				t.Fatalf("page %d float %d: cuda left %g in host memory, cpu %g", p, i, g[i], w[i])
			}
		}
	}
	if !bytes.Equal(got[0], want[0]) {
		t.Fatal("a page outside the request changed")
	}
}

func bytesOf(w []uint32) []byte { return unsafe.Slice((*byte)(unsafe.Pointer(&w[0])), 4*len(w)) }

func floatsOf(b []byte) []float32 {
	return unsafe.Slice((*float32)(unsafe.Pointer(&b[0])), len(b)/4)
}
