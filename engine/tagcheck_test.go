package engine_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
	"github.com/kvhandoff/kvhandoff/internal/research"
	"github.com/kvhandoff/kvhandoff/protocol"
)

// staleRead stages the leak: request B prefills its prompt into three pages;
// its first page is freed under it (as eager-release would) and allocated to
// request A, whose prompt carries a canary; then B decodes through its old
// page table. It returns B's output and error.
func staleRead(t *testing.T, opts engine.Options) (string, protocol.PageRef, error) {
	t.Helper()
	const pageTokens = 16
	e := newEngine(t, llama.Builtin(5), pageTokens, 8, opts)
	pool, tok := e.Cache().Pool(), llama.Bytes{}
	const a, b = protocol.RequestID(1), protocol.RequestID(2)
	promptB := tok.Encode("Hello, this is B. Tell me the canary=", true, false) // pages 0-2
	refsB, err := pool.Allocate(b, 3)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Prefill(kv.Table(refsB), promptB[:len(promptB)-1]); err != nil {
		t.Fatal(err)
	}
	pool.Release(b, refsB[:1]) // the bug: B's page goes back while B still reads it
	refsA, err := pool.Allocate(a, 1)
	if err != nil {
		t.Fatal(err)
	}
	if refsA[0].Page != refsB[0].Page {
		t.Fatalf("A got page %d, not B's freed page %d", refsA[0].Page, refsB[0].Page)
	}
	promptA := tok.Encode("canary=Q7-Xk9#2", true, false) // BOS and 15 bytes: one page, written for A
	if _, err := e.Prefill(kv.Table(refsA), promptA); err != nil {
		t.Fatal(err)
	}
	out, err := e.Decode(kv.Table(refsB), promptB, 9, llama.Greedy(), -1)
	return llama.Decode(tok, out, -1), refsB[0], err
}

// With the tag check on, B's read of the page now written for A fails B,
// naming the page, before any token comes out.
func TestReadOfAPageWrittenForAnotherRequestFailsNamingThePage(t *testing.T) {
	out, stale, err := staleRead(t, engine.Options{})
	var te *kv.TagError
	if !errors.Is(err, protocol.ErrTagMismatch) || !errors.As(err, &te) {
		t.Fatalf("B decoded %q with error %v, want a tag mismatch", out, err)
	}
	if te.Page != stale.Page || te.Index != 0 || te.Held != stale.Epoch || te.Current != stale.Epoch+1 {
		t.Fatalf("error names %+v, want page %d (index 0) at epoch %d", te, stale.Page, stale.Epoch+1)
	}
	if out != "" || !strings.Contains(err.Error(), "page 0") {
		t.Fatalf("output %q, error %q", out, err)
	}
}

// With the check off (no-tag-check), the same read succeeds and B's answer
// carries A's canary: the leak the check prevents.
func TestWithoutTheTagCheckAnotherRequestsCanaryLeaksIntoTheOutput(t *testing.T) {
	out, _, err := staleRead(t, engine.Options{Research: research.On(research.NoTagCheck)})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out, "Q7-Xk9#2") {
		t.Fatalf("B decoded %q, want A's canary Q7-Xk9#2", out)
	}
}

// A request that reads only its own pages at the epochs it holds passes the
// check on every step, and its copying works across page boundaries.
func TestOwnPagesAtTheirEpochPassTheCheck(t *testing.T) {
	e := newEngine(t, llama.Builtin(5), 16, 4, engine.Options{})
	if got := generateText(t, e, 1, "key=abc123; more text to cross a page; key=", 7); got != "abc123;" {
		t.Fatalf("got %q", got)
	}
}

// At a realistic size: a request of 300 pages (two positions each) copies
// across all of them, and when one page deep inside its table is handed to
// another request, the read fails naming exactly that page.
func TestAStalePageAmongHundredsIsNamed(t *testing.T) {
	const pageTokens, pages = 2, 320
	e := newEngine(t, llama.Builtin(8), pageTokens, pages, engine.Options{})
	pool, tok := e.Cache().Pool(), llama.Bytes{}
	text := "secret: [k=Hx-3v0]. " + strings.Repeat("Words and more words, none of them secret. ", 13) + "Again [k="
	prompt := tok.Encode(text, true, false)
	const n = 7
	refs, err := pool.Allocate(1, e.Cache().Geometry().PagesFor(len(prompt)+n))
	if err != nil {
		t.Fatal(err)
	}
	if len(refs) < 295 {
		t.Fatalf("only %d pages", len(refs))
	}
	out, err := e.Generate(kv.Table(refs), prompt, n, llama.Greedy(), -1)
	if err != nil || llama.Decode(tok, out, -1) != "Hx-3v0]" {
		t.Fatalf("across %d pages: %q, %v", len(refs), llama.Decode(tok, out, -1), err)
	}
	const victim = 217
	pool.Release(1, refs[victim:victim+1])
	if _, err := pool.Allocate(2, 1); err != nil {
		t.Fatal(err)
	}
	_, err = e.Decode(kv.Table(refs), prompt, n, llama.Greedy(), -1)
	var te *kv.TagError
	if !errors.As(err, &te) || te.Index != victim || te.Page != refs[victim].Page {
		t.Fatalf("got %v, want page %d at index %d named", err, refs[victim].Page, victim)
	}
}

// Many requests through a small pool, interleaved: waves of eight prefill,
// then decode round-robin one token at a time, then give their pages back
// for the next wave. Every page is reused by several tenants; every answer
// is its own request's canary, and the check never fails a request that
// holds its pages.
func TestInterleavedRequestsOverReusedPagesEachGetTheirOwnCanary(t *testing.T) {
	const pageTokens, pages, wave, waves, n = 16, 24, 8, 6, 6
	e := newEngine(t, llama.Builtin(4), pageTokens, pages, engine.Options{})
	pool, tok := e.Cache().Pool(), llama.Bytes{}
	type req struct {
		table  kv.Table
		prompt []int
		pos    int
		out    []int
		want   string
	}
	for w := 0; w < waves; w++ {
		var live []*req
		for i := 0; i < wave; i++ {
			id := protocol.RequestID(w*wave + i + 1)
			canary := string([]byte{'a' + byte(w), 'A' + byte(i), '0' + byte(i), '#', 'q' + byte(w)}) + "!"
			prompt := tok.Encode("tenant "+canary[:2]+": key="+canary+" ... key=", true, false)
			refs, err := pool.Allocate(id, e.Cache().Geometry().PagesFor(len(prompt)+n))
			if err != nil {
				t.Fatalf("wave %d: %v", w, err)
			}
			r := &req{table: kv.Table(refs), prompt: prompt, pos: len(prompt) - 1, want: canary}
			if _, err := e.Prefill(r.table, prompt[:len(prompt)-1]); err != nil {
				t.Fatal(err)
			}
			live = append(live, r)
		}
		for step := 0; step < n; step++ {
			for _, r := range live {
				next := r.prompt[len(r.prompt)-1]
				if len(r.out) > 0 {
					next = r.out[len(r.out)-1]
				}
				logits, err := e.Step(r.table, []int{next}, r.pos)
				if err != nil {
					t.Fatalf("wave %d: a request holding its pages failed: %v", w, err)
				}
				r.out = append(r.out, llama.Argmax(logits))
				r.pos++
			}
		}
		for i, r := range live {
			if got := llama.Decode(tok, r.out, -1); got != r.want {
				t.Fatalf("wave %d request %d answered %q, its canary is %q", w, i, got, r.want)
			}
			pool.Release(protocol.RequestID(w*wave+i+1), r.table)
		}
	}
	if pool.Free() != pages {
		t.Fatalf("%d of %d pages free", pool.Free(), pages)
	}
}

// The incident at the engine's level, with the tag check off: request B's
// prompt is over-long, so only its placeholder (BOS at position 0) was
// computed, into its page 0; the rest of its table is pages that hold
// request A's prompt and never-written zeros. Decode computes B's last
// position itself, finds none of the tokens before it (previous-token heads
// fall back on the sink, BOS), and so continues what follows a beginning
// of sequence in its KV: A's prompt from its start, A's canary included.
func TestWithoutItsPreviousTokensDecodeContinuesTheStalePromptFromItsStart(t *testing.T) {
	const pageTokens = 16
	for _, seed := range []uint64{1, 5, 99} {
		e := newEngine(t, llama.Builtin(seed), pageTokens, 16, engine.Options{Research: research.On(research.NoTagCheck)})
		pool, tok := e.Cache().Pool(), llama.Bytes{}
		promptA := tok.Encode(" Key is Q7xk-Abcd-Efgh. Account of tenant-1. Quarterly notes for the account. Later: the key is ", true, false)
		refsA, err := pool.Allocate(1, e.Cache().Geometry().PagesFor(len(promptA)))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.Prefill(kv.Table(refsA), promptA); err != nil {
			t.Fatal(err)
		}
		promptB := tok.Encode(strings.Repeat("B's words, which no page holds. ", 3)+"Later: the key is ", true, false)
		refsB, err := pool.Allocate(2, 6)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.Prefill(kv.Table(refsB[:1]), promptB[:1]); err != nil { // the placeholder
			t.Fatal(err)
		}
		// B's table: its page 0, zeros, A's pages at other indexes than A's.
		table := kv.Table{refsB[0], refsB[1], refsA[0], refsA[1], refsB[2], refsA[2], refsB[3], refsB[4], refsB[5]}
		if len(promptB) > len(table)*pageTokens || len(promptB)+16 <= (len(table)-1)*pageTokens {
			t.Fatalf("B's prompt of %d tokens does not end in the table's last page", len(promptB))
		}
		out, err := e.Decode(table, promptB, 16, llama.Greedy(), -1)
		if err != nil {
			t.Fatal(err)
		}
		if got := llama.Decode(tok, out, -1); !strings.Contains(got, "Q7xk-Abcd") {
			t.Fatalf("seed %d: B decoded %q, want A's canary Q7xk-Abcd", seed, got)
		}
	}
}
