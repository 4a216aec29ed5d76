package engine

import (
	"errors"
	"fmt"

	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/research"
)

// Options configure an Engine.
type Options struct {
	// Research turns bugs of the catalogue on; the engine knows
	// no-tag-check (reads unchecked) and admit-finished (Source computes the
	// placeholder's KV). Only code inside this module can set it.
	Research research.Switches
}

// Errors of a request.
var (
	// ErrBadRequest: an empty prompt, a token outside the vocabulary, a
	// context longer than the model's, or a table too short for it.
	ErrBadRequest = errors.New("engine: bad request")
	// ErrSharedWrite: a step would write KV into a page the request shares
	// read-only (a prefix page another request wrote: docs/engine.md
	// "Shared prefix pages"). Nothing is computed.
	ErrSharedWrite = errors.New("engine: a write into a shared prefix page")
)

// Engine runs requests of one model on one backend over one KV cache.
type Engine struct {
	model   *llama.Model
	backend backend.Backend
	cache   *kv.Cache
	opts    Options
	logits  []float32
	pages   []uint32
	epochs  []uint64
}

// GeometryOf is the KV page geometry of a model with pageTokens positions per page.
func GeometryOf(c llama.Config, pageTokens int) kv.Geometry {
	return kv.Geometry{Layers: c.Layers, KVHeads: c.KVHeads, HeadDim: c.HeadDim(), PageTokens: pageTokens}
}

// New loads m into b and attaches the cache, whose geometry must be m's.
func New(m *llama.Model, b backend.Backend, cache *kv.Cache, opts Options) (*Engine, error) {
	if err := m.Validate(); err != nil {
		return nil, err
	}
	g := cache.Geometry()
	if want := GeometryOf(m.Config, g.PageTokens); g != want {
		return nil, fmt.Errorf("%w: cache geometry %+v, model needs %+v", kv.ErrGeometry, g, want)
	}
	if err := b.Load(m); err != nil {
		return nil, err
	}
	if err := b.AttachPool(cache); err != nil {
		return nil, err
	}
	return &Engine{model: m, backend: b, cache: cache, opts: opts, logits: make([]float32, m.Vocab)}, nil
}

// Model is the engine's model.
func (e *Engine) Model() *llama.Model { return e.model }

// Cache is the engine's KV cache.
func (e *Engine) Cache() *kv.Cache { return e.cache }

// Backend is the engine's backend.
func (e *Engine) Backend() backend.Backend { return e.backend }

// check validates a step's tokens, positions and table before a backend sees them.
func (e *Engine) check(table kv.Table, tokens []int, pos int) error {
	end := pos + len(tokens)
	switch {
	case len(tokens) == 0:
		return fmt.Errorf("%w: no tokens", ErrBadRequest)
	case pos < 0:
		return fmt.Errorf("%w: position %d", ErrBadRequest, pos)
	case end > e.model.SeqLen:
		return fmt.Errorf("%w: %d positions exceed the model's context of %d", ErrBadRequest, end, e.model.SeqLen)
	case e.cache.Geometry().PagesFor(end) > len(table):
		return fmt.Errorf("%w: %d positions need %d pages, the table has %d", ErrBadRequest, end, e.cache.Geometry().PagesFor(end), len(table))
	}
	for i, t := range tokens {
		if t < 0 || t >= e.model.Vocab {
			return fmt.Errorf("%w: token %d at position %d is outside the vocabulary of %d", ErrBadRequest, t, pos+i, e.model.Vocab)
		}
	}
	return e.cache.ValidTable(table)
}

// Step runs tokens at positions pos.. over table and returns the last
// token's logits (valid until the next step).
func (e *Engine) Step(table kv.Table, tokens []int, pos int) ([]float32, error) {
	return e.step(table, 0, tokens, pos)
}

// StepShared is Step over a table whose first shared pages are a cached
// prefix other requests wrote: a step that would write a position inside
// them is refused (ErrSharedWrite) before the backend sees it.
func (e *Engine) StepShared(table kv.Table, shared int, tokens []int, pos int) ([]float32, error) {
	if shared < 0 || shared > len(table) {
		return nil, fmt.Errorf("%w: %d shared pages of a table of %d", ErrBadRequest, shared, len(table))
	}
	return e.step(table, shared, tokens, pos)
}

// step is Step over a table whose first shared pages are read-only: a
// step that would write a position inside them is refused before the
// backend sees it.
func (e *Engine) step(table kv.Table, shared int, tokens []int, pos int) ([]float32, error) {
	if err := e.check(table, tokens, pos); err != nil {
		return nil, err
	}
	if pt := e.cache.Geometry().PageTokens; shared > 0 && pos < shared*pt {
		return nil, fmt.Errorf("%w: position %d is in page %d, the request shares pages 0..%d read-only", ErrSharedWrite, pos, pos/pt, shared-1)
	}
	used := table[:e.cache.Geometry().PagesFor(pos+len(tokens))]
	e.pages, e.epochs = e.pages[:0], e.cache.Epochs(e.epochs[:0], used)
	for _, ref := range used {
		e.pages = append(e.pages, ref.Page)
	}
	if err := e.backend.SetEpochs(e.pages, e.epochs); err != nil {
		return nil, err
	}
	s := backend.Step{Tokens: tokens, Pos: pos, Table: used, Unchecked: e.opts.Research.Has(research.NoTagCheck), Logits: e.logits}
	if err := e.backend.Forward(&s); err != nil {
		return nil, err
	}
	return e.logits, nil
}

// Prefill writes the prompt's KV into the table's pages and returns the
// last position's logits.
func (e *Engine) Prefill(table kv.Table, prompt []int) ([]float32, error) {
	return e.Step(table, prompt, 0)
}

// PrefillFrom writes the KV of the prompt's positions start.. into the
// table's pages and returns the last position's logits: positions [0, start)
// already hold the prompt's KV in the table's first start/PageTokens pages,
// shared read-only (a cached prefix: docs/engine.md "Shared prefix pages"),
// so they are read, never computed or written. start is a multiple of
// PageTokens below len(prompt) (ErrBadRequest otherwise): the page holding
// the last position is always the request's own.
func (e *Engine) PrefillFrom(table kv.Table, prompt []int, start int) ([]float32, error) {
	pt := e.cache.Geometry().PageTokens
	if start < 0 || start%pt != 0 || start >= len(prompt) {
		return nil, fmt.Errorf("%w: a prefix of %d tokens: a multiple of the page's %d below the prompt's %d", ErrBadRequest, start, pt, len(prompt))
	}
	return e.step(table, start/pt, prompt[start:], start)
}

// Decode generates up to n tokens after prompt, whose KV (all positions but
// possibly the last) is already in the table's pages: it steps the last
// prompt token, then each token it samples. It stops early at stop (if stop
// >= 0) or at the model's context. On an error it returns the tokens
// generated so far with it.
func (e *Engine) Decode(table kv.Table, prompt []int, n int, s *llama.Sampler, stop int) ([]int, error) {
	return e.DecodeShared(table, 0, prompt, n, s, stop)
}

// DecodeShared is Decode over a table whose first shared pages hold a
// prefix of the prompt that other requests wrote (a decode node's prefix
// cache hit: pinned pages, then the pages the handoff wrote, then its own):
// they are read like any page, through the same table and the same epoch
// check, and never written. Decode's first write is the last prompt
// position's KV, so the shared pages must end before it: shared*PageTokens
// < len(prompt), else ErrSharedWrite and nothing is computed.
func (e *Engine) DecodeShared(table kv.Table, shared int, prompt []int, n int, s *llama.Sampler, stop int) ([]int, error) {
	if len(prompt) == 0 {
		return nil, fmt.Errorf("%w: no tokens", ErrBadRequest)
	}
	if shared < 0 || shared > len(table) {
		return nil, fmt.Errorf("%w: %d shared pages of a table of %d", ErrBadRequest, shared, len(table))
	}
	var out []int
	tok, pos := prompt[len(prompt)-1], len(prompt)-1
	for len(out) < n && pos < e.model.SeqLen {
		logits, err := e.step(table, shared, []int{tok}, pos)
		if err != nil {
			return out, err
		}
		tok = s.Sample(logits)
		out = append(out, tok)
		if tok == stop {
			break
		}
		pos++
	}
	return out, nil
}

// Generate prefills the prompt and decodes up to n tokens after it, on one node.
func (e *Engine) Generate(table kv.Table, prompt []int, n int, s *llama.Sampler, stop int) ([]int, error) {
	if len(prompt) > 1 {
		if _, err := e.Step(table, prompt[:len(prompt)-1], 0); err != nil {
			return nil, err
		}
	}
	return e.Decode(table, prompt, n, s, stop)
}

// WithOptions is an engine over the same model, backend and cache with other
// options: measurements compare switches on one backend in one run.
func (e *Engine) WithOptions(opts Options) *Engine {
	c := *e
	c.opts, c.logits, c.pages, c.epochs = opts, make([]float32, len(e.logits)), nil, nil
	return &c
}

// Arrived tells the backend that the pages of table were written in host
// memory by the transport and verified there: a device backend copies them
// into its own pool (the CPU backend reads host memory itself). A decode
// node calls it after Acquire, before Decode.
func (e *Engine) Arrived(table kv.Table) error {
	if err := e.cache.ValidTable(table); err != nil {
		return err
	}
	ids := make([]uint32, len(table))
	for i, ref := range table {
		ids[i] = ref.Page
	}
	return e.backend.UploadPages(ids)
}
