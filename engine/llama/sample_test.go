package llama

import "testing"

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
