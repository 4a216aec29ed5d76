package llama

import (
	"math"
	"testing"
)

// Greedy takes the highest logit (the lowest token on a tie); top-p keeps
// sampling inside the smallest set of tokens whose probability reaches p;
// temperature sampling reaches every token over many draws.
func TestSamplerKeepsToItsNucleus(t *testing.T) {
	logits := []float32{0, 3, 3, 1, 2.5, -1}
	if got := Greedy().Sample(logits); got != 1 {
		t.Fatalf("greedy picked %d", got)
	}
	// Probabilities at temperature 1: tokens 1 and 2 about 0.35 each, 4
	// about 0.21: together 0.92; top-p 0.9 keeps exactly {1, 2, 4}.
	s := NewSampler(1, 0.9, 7)
	seen := map[int]int{}
	for range 3000 {
		seen[s.Sample(logits)]++
	}
	for tok := range seen {
		if tok != 1 && tok != 2 && tok != 4 {
			t.Fatalf("top-p 0.9 sampled token %d: %v", tok, seen)
		}
	}
	if seen[1] < 800 || seen[2] < 800 || seen[4] < 400 {
		t.Fatalf("nucleus tokens drawn %v", seen)
	}
	all := NewSampler(2, 1, 7)
	seen = map[int]int{}
	for range 3000 {
		seen[all.Sample(logits)]++
	}
	if len(seen) != len(logits) {
		t.Fatalf("temperature 2 without top-p reached only %v", seen)
	}
}

// Recorded log probabilities are the log-softmax of the logits: the
// sampled token's and the top k's, highest first (the lowest token on a
// tie); recording leaves the sampled tokens as they were, greedy and seeded.
func TestSamplerRecordsLogSoftmaxWithoutChangingTheSample(t *testing.T) {
	logits := []float32{0, 3, 3, 1, 2.5, -1}
	var z float64
	for _, v := range logits {
		z += math.Exp(float64(v))
	}
	lp := func(tok int) float32 { return float32(float64(logits[tok]) - math.Log(z)) }
	g := Greedy().RecordLogprobs(3)
	if got := g.Sample(logits); got != 1 {
		t.Fatalf("greedy with logprobs picked %d", got)
	}
	step := g.Logprobs.Tokens[0]
	near := func(a, b float32) bool { return math.Abs(float64(a-b)) < 1e-5 }
	if step.Token != 1 || !near(step.Logprob, lp(1)) || len(step.Top) != 3 ||
		step.Top[0].Token != 1 || step.Top[1].Token != 2 || step.Top[2].Token != 4 || !near(step.Top[2].Logprob, lp(4)) {
		t.Fatalf("recorded %+v; want token 1 at %v, top 1, 2, 4", step, lp(1))
	}
	plain, rec := NewSampler(1.3, 0.95, 11), NewSampler(1.3, 0.95, 11).RecordLogprobs(5)
	for i := range 500 {
		a, b := plain.Sample(logits), rec.Sample(logits)
		if a != b {
			t.Fatalf("draw %d: %d without recording, %d with", i, a, b)
		}
		if r := rec.Logprobs.Tokens[i]; r.Token != b || !near(r.Logprob, lp(b)) {
			t.Fatalf("draw %d recorded %+v for token %d", i, r, b)
		}
	}
}
