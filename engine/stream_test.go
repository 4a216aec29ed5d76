package engine_test

import (
	"bytes"
	"errors"
	"testing"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/protocol"
	"github.com/kvhandoff/kvhandoff/transfer"
)

// streamSource is a Source over pages of memory the test reads.
func streamSource(t *testing.T, m *llama.Model, pageTokens, pages int) (*engine.Source, [][]byte) {
	t.Helper()
	g := engine.GeometryOf(m.Config, pageTokens)
	memory := make([][]byte, pages)
	for i := range memory {
		memory[i] = make([]byte, g.PageBytes())
	}
	cache, err := kv.OverPages(g, memory, kv.Unversioned)
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.New(m, cpu.New(), cache, engine.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s := engine.NewSource()
	s.Use(e)
	return s, memory
}

func pageRange(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}

// A prompt computed in chunks of 1, 3 and 5 pages (each chunk one batched
// step attending over the chunks before it) leaves in every page the bytes
// the whole prompt computed at once leaves, and computed is told each
// chunk's pages in order, the last call all of them.
func TestStreamingPrefillComputesTheKVOfTheWholePrompt(t *testing.T) {
	m := llama.Builtin(5)
	const pageTokens = 4
	prompt := llama.Bytes{}.Encode("Chunked prefill must compute the same KV as the whole prompt at once.", true, false)
	n := (len(prompt) + pageTokens - 1) / pageTokens
	s, memory := streamSource(t, m, pageTokens, 4*n)
	s.Expect(1, prompt)
	if err := s.FillKV(1, len(prompt), pageRange(0, n), nil); err != nil {
		t.Fatal(err)
	}
	for k, chunk := range []int{1, 3, 5} {
		id := protocol.RequestID(2 + k)
		s.Expect(id, prompt)
		var calls []int
		if err := s.FillKVChunks(id, len(prompt), pageRange((k+1)*n, n), nil, chunk, func(p int) bool { calls = append(calls, p); return true }); err != nil {
			t.Fatal(err)
		}
		for i, c := range calls {
			if want := min((i+1)*chunk, n); c != want {
				t.Fatalf("chunks of %d: computed calls %v, want multiples of %d up to %d", chunk, calls, chunk, n)
			}
		}
		if len(calls) == 0 || calls[len(calls)-1] != n {
			t.Fatalf("chunks of %d: computed calls %v, the last must be %d", chunk, calls, n)
		}
		for i := range n {
			if !bytes.Equal(memory[i], memory[(k+1)*n+i]) {
				t.Fatalf("chunks of %d: page %d of the prompt differs from the whole prompt's", chunk, i)
			}
		}
	}
}

// A request that ends while a chunk is computed stops at that chunk's end:
// FillKVChunks returns transfer.ErrStopped, the pages of later chunks are
// never touched, and the source counts the chunks it computed (the one in
// progress at the end included, none after it) and the stop.
func TestStreamingPrefillStopsWithinAChunkOfTheEnd(t *testing.T) {
	m := llama.Builtin(5)
	const pageTokens, chunk = 4, 2
	prompt := llama.Bytes{}.Encode("A long prompt whose client goes away after the second chunk of its prefill.", true, false)
	n := (len(prompt) + pageTokens - 1) / pageTokens
	s, memory := streamSource(t, m, pageTokens, n)
	for _, p := range memory {
		for i := range p {
			p[i] = 0xA5 // what a page held before: it must still hold it
		}
	}
	s.Expect(1, prompt)
	ended := false
	err := s.FillKVChunks(1, len(prompt), pageRange(0, n), nil, chunk, func(p int) bool {
		if p == 2*chunk {
			ended = true // the cancel arrived during the second chunk
		}
		return !ended
	})
	if !errors.Is(err, transfer.ErrStopped) {
		t.Fatalf("FillKVChunks: %v, want transfer.ErrStopped", err)
	}
	if st := s.Stats(); st.Chunks != 2 || st.Stopped != 1 {
		t.Fatalf("stats %+v, want 2 chunks and 1 stop", st)
	}
	for i := 2 * chunk; i < n; i++ {
		if !allBytes(memory[i], 0xA5) {
			t.Fatalf("page %d, past the chunk in progress at the end, was written", i)
		}
	}
	if allBytes(memory[0], 0xA5) {
		t.Fatal("page 0, of the first chunk, was never written")
	}
}

func allBytes(p []byte, b byte) bool {
	for _, x := range p {
		if x != b {
			return false
		}
	}
	return true
}
