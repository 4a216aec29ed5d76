package demo

import (
	"fmt"
	"slices"
	"sync"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/cpu"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// Reference is the colocated run: the same model on one node, the engine
// called directly over a KV cache of its own, no handoff. A handed-off
// success must equal it token for token. Results are kept per prompt, so a
// workload's repeated prompts are computed once.
type Reference struct {
	mu     sync.Mutex
	e      *engine.Engine
	tok    llama.Tokenizer
	stop   int
	memo   map[refKey][]int
	nextID protocol.RequestID
}

type refKey struct {
	prompt string
	n      int
}

// NewReference runs m greedily (as the decode node does) with pages of
// pageTokens tokens; stop is the decode node's stop token (-1: none).
func NewReference(m *llama.Model, tok llama.Tokenizer, pageTokens, stop int) (*Reference, error) {
	g := engine.GeometryOf(m.Config, pageTokens)
	cache, err := kv.New(g, g.PagesFor(m.SeqLen))
	if err != nil {
		return nil, err
	}
	e, err := engine.New(m, cpu.New(), cache, engine.Options{})
	if err != nil {
		return nil, err
	}
	return &Reference{e: e, tok: tok, stop: stop, memo: map[refKey][]int{}}, nil
}

// Tokens is what one node generates for prompt, up to n tokens.
func (r *Reference) Tokens(prompt string, n int) ([]int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	k := refKey{prompt, n}
	if out, ok := r.memo[k]; ok {
		return out, nil
	}
	p := r.tok.Encode(prompt, true, false)
	n = min(n, r.e.Model().SeqLen-len(p))
	if n < 1 {
		return nil, fmt.Errorf("demo: a prompt of %d tokens leaves no room in a context of %d", len(p), r.e.Model().SeqLen)
	}
	pool := r.e.Cache().Pool()
	r.nextID++
	refs, err := pool.Allocate(r.nextID, r.e.Cache().Geometry().PagesFor(len(p)+n))
	if err != nil {
		return nil, err
	}
	defer pool.Release(r.nextID, refs)
	out, err := r.e.Generate(kv.Table(refs), p, n, llama.Greedy(), r.stop)
	if err != nil {
		return nil, err
	}
	r.memo[k] = slices.Clone(out)
	return out, nil
}

// Text is tokens as text, as the router decodes them after prompt.
func (r *Reference) Text(prompt string, tokens []int) string {
	p := r.tok.Encode(prompt, true, false)
	prev := -1
	if len(p) > 0 {
		prev = p[len(p)-1]
	}
	return llama.Decode(r.tok, tokens, prev)
}
