package engine_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/engine"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
)

// generateText runs the built-in model greedily on prompt over fresh pages.
func generateText(t *testing.T, e *engine.Engine, id uint64, prompt string, n int) string {
	t.Helper()
	tok := llama.Bytes{}
	p := tok.Encode(prompt, true, false)
	refs, err := e.Cache().Pool().Allocate(protocolID(id), e.Cache().Geometry().PagesFor(len(p)+n))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Cache().Pool().Release(protocolID(id), refs)
	out, err := e.Generate(kv.Table(refs), p, n, llama.Greedy(), -1)
	if err != nil {
		t.Fatal(err)
	}
	return llama.Decode(tok, out, -1)
}

// The built-in model copies: text that occurred earlier in its context comes
// out again when the three bytes before it recur, whatever the seed.
func TestBuiltinModelContinuesWithTheCopiedCanary(t *testing.T) {
	for _, seed := range []uint64{1, 99} {
		e := newEngine(t, llama.Builtin(seed), 16, 64, engine.Options{})
		for _, c := range []struct{ prompt, want string }{
			{"Account notes. The canary is 7f3a-Q9zK-w2. Later: The canary is ", "7f3a-Q9zK-w2."},
			{"user=alice; token=ZX81-spectrum-48k; ... token=", "ZX81-spectrum-48k;"},
			{strings.Repeat("filler text without the secret. ", 8) + "[id:8c2e77] and again [id:", "8c2e77]"},
		} {
			got := generateText(t, e, 1, c.prompt, len(c.want))
			if got != c.want {
				t.Fatalf("seed %d: %q -> %q, want %q", seed, c.prompt, got, c.want)
			}
		}
	}
}

// BOS is the built-in model's attention sink: a previous-token head falls
// back on it only where the token it looks for is missing, so a prompt
// whose answer is copied from earlier in it answers the same with BOS first
// and without it, for every seed tried, and BOS is never generated.
func TestTheSinkLeavesHonestAnswersAsTheyWere(t *testing.T) {
	tok := llama.Bytes{}
	prompts := []string{
		"Account notes. The canary is 7f3a-Q9zK-w2. Later: The canary is ",
		"user=alice; token=ZX81-spectrum-48k; ... token=",
		strings.Repeat("filler text without the secret. ", 8) + "[id:8c2e77] and again [id:",
		" Key is Q7xk-Abcd-Efgh. Account of tenant-1. Quarterly notes for the account. Later: the key is ",
	}
	for _, seed := range []uint64{1, 5, 99} {
		e := newEngine(t, llama.Builtin(seed), 16, 64, engine.Options{})
		for _, p := range prompts {
			var got [2][]int
			for i, bos := range []bool{true, false} {
				ids := tok.Encode(p, bos, false)
				refs, err := e.Cache().Pool().Allocate(1, e.Cache().Geometry().PagesFor(len(ids)+16))
				if err != nil {
					t.Fatal(err)
				}
				if got[i], err = e.Generate(kv.Table(refs), ids, 16, llama.Greedy(), -1); err != nil {
					t.Fatal(err)
				}
				e.Cache().Pool().Release(1, refs)
			}
			if !slices.Equal(got[0], got[1]) {
				t.Fatalf("seed %d, %q: %q after BOS, %q without", seed, p, llama.Decode(tok, got[0], -1), llama.Decode(tok, got[1], -1))
			}
			if slices.Contains(got[0], llama.BOS) {
				t.Fatalf("seed %d, %q: BOS generated: %v", seed, p, got[0])
			}
		}
	}
}
