package engine_test

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// prefixWorld is a decode node's cache, a prefill node's engine over a cache
// of its own (the handoff's source pages), and a colocated engine for the
// answers a whole fresh run gives.
type prefixWorld struct {
	t                  *testing.T
	m                  *llama.Model
	g                  kv.Geometry
	decode, prefill    *engine.Engine
	colocated          *engine.Engine
	nextID             protocol.RequestID
	prefillPool, cache *protocol.Pool
}

func newPrefixWorld(t *testing.T, pageTokens, pages int) *prefixWorld {
	m := llama.Builtin(3)
	w := &prefixWorld{t: t, m: m, g: engine.GeometryOf(m.Config, pageTokens)}
	w.decode = newEngine(t, m, pageTokens, pages, engine.Options{})
	w.prefill = newEngine(t, m, pageTokens, 64, engine.Options{})
	w.colocated = newEngine(t, m, pageTokens, 64, engine.Options{})
	w.cache, w.prefillPool = w.decode.Cache().Pool(), w.prefill.Cache().Pool()
	return w
}

// handoff is what a decode node holds for prompt after a handoff that found
// the prefix pages cached: the shared pages as its table's first entries (at
// the epochs they were pinned at), then fresh pages holding the KV that a
// prefill node computed over the whole prompt in its own pages and the
// WRITEs copied, page for page, for pages len(shared).. only.
func (w *prefixWorld) handoff(prompt []int, shared kv.Table, n int) (kv.Table, protocol.RequestID) {
	w.t.Helper()
	w.nextID++
	id := w.nextID
	np := w.g.PagesFor(len(prompt))
	src, err := w.prefillPool.Allocate(id, np)
	if err != nil {
		w.t.Fatal(err)
	}
	defer w.prefillPool.Release(id, src)
	if _, err := w.prefill.Prefill(kv.Table(src), prompt); err != nil {
		w.t.Fatal(err)
	}
	fresh, err := w.cache.Allocate(id, w.g.PagesFor(len(prompt)+n)-len(shared))
	if err != nil {
		w.t.Fatal(err)
	}
	table := append(slices.Clone(shared), fresh...)
	for i := len(shared); i < np; i++ {
		copy(w.decode.Cache().Payload(table[i].Page), w.prefill.Cache().Payload(src[i].Page))
	}
	return table, id
}

// fresh is the colocated run's answer: the whole prompt prefilled and
// decoded on one node, no page shared.
func (w *prefixWorld) fresh(prompt []int, n int) []int {
	w.t.Helper()
	w.nextID++
	pool := w.colocated.Cache().Pool()
	refs, err := pool.Allocate(w.nextID, w.g.PagesFor(len(prompt)+n))
	if err != nil {
		w.t.Fatal(err)
	}
	defer pool.Release(w.nextID, refs)
	out, err := w.colocated.Generate(kv.Table(refs), prompt, n, llama.Greedy(), -1)
	if err != nil {
		w.t.Fatal(err)
	}
	return out
}

// position is the KV of position pos in table's pages: every layer's keys,
// then its values.
func (w *prefixWorld) position(table kv.Table, pos int) []float32 {
	f := w.decode.Cache().Floats(table[pos/w.g.PageTokens].Page)
	var out []float32
	for l := range w.g.Layers {
		k, v := w.g.KeyOffset(l, pos%w.g.PageTokens), w.g.ValueOffset(l, pos%w.g.PageTokens)
		out = append(append(out, f[k:k+w.g.KVDim()]...), f[v:v+w.g.KVDim()]...)
	}
	return out
}

func text(prefix string, i int) string {
	return fmt.Sprintf("%s Turn %d of the account: the code word is Qx%02d-k%d, remember it. Later: the code word is ", prefix, i, i*7%100, i%9)
}

// A decode node's prefix cache hit: the table's first pages are pages
// another request's handoff wrote (read-only, at the epochs they were
// pinned at), then the pages this request's handoff wrote, then the node's
// own; decoding over it equals a whole fresh run token for token, the
// shared pages' bytes never change, and a table whose shared pages would
// hold the last prompt position (decode's first write) is refused before
// anything is computed.
func TestDecodeOverSharedPrefixPagesEqualsAWholeFreshRun(t *testing.T) {
	const pageTokens, n = 16, 24
	w := newPrefixWorld(t, pageTokens, 64)
	system := "System: you are the archive's assistant. Answer with the code word only, exactly as it was given, nothing more."
	a := llama.Bytes{}.Encode(text(system, 1), true, false)
	b := llama.Bytes{}.Encode(text(system, 2), true, false)
	k := len(llama.Bytes{}.Encode(system, true, false)) / pageTokens // full pages of the system prompt
	if k < 2 || !slices.Equal(a[:k*pageTokens], b[:k*pageTokens]) || w.g.PagesFor(len(b)) <= k {
		t.Fatalf("the prompts share %d pages", k)
	}
	// Request a: a whole handoff; its first k pages then stay cached.
	tableA, _ := w.handoff(a, nil, n)
	outA, err := w.decode.Decode(tableA, a, n, llama.Greedy(), -1)
	if err != nil {
		t.Fatal(err)
	}
	if want := w.fresh(a, n); !slices.Equal(outA, want) {
		t.Fatalf("request a: %q, colocated %q", llama.Decode(llama.Bytes{}, outA, -1), llama.Decode(llama.Bytes{}, want, -1))
	}
	shared := slices.Clone(tableA[:k])
	before := make([][]byte, k)
	for i, ref := range shared {
		before[i] = bytes.Clone(w.decode.Cache().Payload(ref.Page))
	}
	// Request b hits them.
	tableB, _ := w.handoff(b, shared, n)
	outB, err := w.decode.DecodeShared(tableB, k, b, n, llama.Greedy(), -1)
	if err != nil {
		t.Fatal(err)
	}
	want := w.fresh(b, n)
	if !slices.Equal(outB, want) {
		t.Fatalf("over %d shared pages: %q, colocated %q", k, llama.Decode(llama.Bytes{}, outB, -1), llama.Decode(llama.Bytes{}, want, -1))
	}
	for i, ref := range shared {
		if !bytes.Equal(before[i], w.decode.Cache().Payload(ref.Page)) {
			t.Fatalf("shared page %d changed while request b read it", i)
		}
	}
	// Shared pages up to the last prompt position: refused, nothing written.
	short := b[:k*pageTokens]
	if _, err := w.decode.DecodeShared(tableB, k, short, n, llama.Greedy(), -1); !errors.Is(err, engine.ErrSharedWrite) {
		t.Fatalf("decode's first write into a shared page: %v, want ErrSharedWrite", err)
	}
	if _, err := w.decode.DecodeShared(tableB, len(tableB)+1, b, n, llama.Greedy(), -1); !errors.Is(err, engine.ErrBadRequest) {
		t.Fatalf("more shared pages than the table: %v", err)
	}
	for i, ref := range shared {
		if !bytes.Equal(before[i], w.decode.Cache().Payload(ref.Page)) {
			t.Fatalf("shared page %d changed by a refused step", i)
		}
	}
}

// A shared page reallocated under a reader (evicted while it was pinned:
// the evict-pinned bug) fails the read with a tag error naming it, as any
// page does: one table, one epoch check, shared or written.
func TestASharedPageReallocatedUnderItsReaderFailsTheTagCheck(t *testing.T) {
	const pageTokens, n = 16, 8
	w := newPrefixWorld(t, pageTokens, 32)
	system := "System: the same words every tenant's request starts with, two pages of them at least."
	a := llama.Bytes{}.Encode(text(system, 1), true, false)
	b := llama.Bytes{}.Encode(text(system, 2), true, false)
	k := len(llama.Bytes{}.Encode(system, true, false)) / pageTokens
	tableA, idA := w.handoff(a, nil, n)
	tableB, _ := w.handoff(b, tableA[:k], n)
	// Page 0 goes back to the pool and to another request: a new epoch.
	w.cache.Release(idA, tableA[:1])
	if _, err := w.cache.Allocate(999, w.cache.Free()); err != nil {
		t.Fatal(err)
	}
	_, err := w.decode.DecodeShared(tableB, k, b, n, llama.Greedy(), -1)
	var te *kv.TagError
	if !errors.As(err, &te) || te.Index != 0 || te.Page != tableA[0].Page || !errors.Is(err, protocol.ErrTagMismatch) {
		t.Fatalf("reading a reallocated shared page: %v, want a tag error for index 0", err)
	}
}

// A prefill that finds the prefix's KV present computes only the positions
// past it: its pages past the prefix hold the very bytes a whole prefill
// writes, and the prefix's pages are read, never written.
func TestPrefillFromAPrefixWritesOnlyThePagesPastIt(t *testing.T) {
	const pageTokens = 16
	w := newPrefixWorld(t, pageTokens, 64)
	system := "System: a prompt long enough to fill several pages of sixteen tokens, shared by every turn."
	a := llama.Bytes{}.Encode(text(system, 1), true, false)
	b := llama.Bytes{}.Encode(text(system, 2), true, false)
	k := len(llama.Bytes{}.Encode(system, true, false)) / pageTokens
	tableA, _ := w.handoff(a, nil, 0)
	shared := tableA[:k]
	before := make([][]byte, k)
	for i, ref := range shared {
		before[i] = bytes.Clone(w.decode.Cache().Payload(ref.Page))
	}
	fresh, err := w.cache.Allocate(500, w.g.PagesFor(len(b))-k)
	if err != nil {
		t.Fatal(err)
	}
	table := append(slices.Clone(shared), fresh...)
	if _, err := w.decode.PrefillFrom(table, b, k*pageTokens); err != nil {
		t.Fatal(err)
	}
	whole, _ := w.handoff(b, nil, 0)
	for pos := k * pageTokens; pos < len(b); pos++ {
		if !slices.Equal(w.position(table, pos), w.position(whole, pos)) {
			t.Fatalf("position %d past the prefix differs from a whole prefill's", pos)
		}
	}
	for i, ref := range shared {
		if !bytes.Equal(before[i], w.decode.Cache().Payload(ref.Page)) {
			t.Fatalf("prefix page %d written", i)
		}
	}
	for _, start := range []int{-pageTokens, 5, w.g.PagesFor(len(b)) * pageTokens} {
		if _, err := w.decode.PrefillFrom(table, b, start); !errors.Is(err, engine.ErrBadRequest) {
			t.Fatalf("a prefix of %d tokens of %d: %v, want ErrBadRequest", start, len(b), err)
		}
	}
}

// At a realistic size: a pool of hundreds of pages, sixty requests of six
// system prompts, each request's table its system prompt's pages (written
// by the first request of that prompt, shared by every later one) and the
// pages of its own handoff: every answer equals a whole fresh run's.
func TestManyRequestsOverSharedPrefixesEqualFreshRuns(t *testing.T) {
	if testing.Short() {
		t.Skip("sixty generations; the shorter tests above cover the rule")
	}
	const pageTokens, n, requests = 16, 6, 60
	w := newPrefixWorld(t, pageTokens, 400)
	type cached struct {
		pages kv.Table
		k     int
	}
	systems := map[int]cached{}
	for i := range requests {
		s := i % 6
		system := fmt.Sprintf("System %d: the deployment's shared instructions, the same for every turn of this kind: %s", s, "answer with the code word "+string(rune('a'+s)))
		prompt := llama.Bytes{}.Encode(text(system, i), true, false)
		k := len(llama.Bytes{}.Encode(system, true, false)) / pageTokens
		c, hit := systems[s]
		var shared kv.Table
		if hit {
			shared = c.pages
		}
		table, id := w.handoff(prompt, shared, n)
		out, err := w.decode.DecodeShared(table, len(shared), prompt, n, llama.Greedy(), -1)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if want := w.fresh(prompt, n); !slices.Equal(out, want) {
			t.Fatalf("request %d over %d shared pages: %v, fresh %v", i, len(shared), out, want)
		}
		keep := len(shared)
		if !hit {
			systems[s] = cached{pages: slices.Clone(table[:k]), k: k}
			keep = k
		}
		w.cache.Release(id, table[keep:])
	}
}
