package llama

import (
	"math"
	"math/rand/v2"
	"sort"
)

// Sampler picks next tokens. At temperature 0 it is greedy (the highest
// logit, the lowest token on a tie); otherwise it samples from the softmax at
// the temperature, restricted to the smallest set of tokens whose probability
// reaches TopP (1 or 0: all), from a generator seeded by Seed.
type Sampler struct {
	Temperature float32
	TopP        float32
	rng         *rand.Rand
	probs       []float32
	order       []int
}

// Greedy is a greedy sampler.
func Greedy() *Sampler { return &Sampler{} }

// NewSampler returns a seeded sampler.
func NewSampler(temperature, topP float32, seed uint64) *Sampler {
	return &Sampler{Temperature: temperature, TopP: topP, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

// Argmax is the index of the highest value, the lowest on a tie.
func Argmax(x []float32) int {
	best := 0
	for i, v := range x {
		if v > x[best] {
			best = i
		}
	}
	return best
}

// Sample picks a token from logits (which it leaves unchanged).
func (s *Sampler) Sample(logits []float32) int {
	if s.Temperature <= 0 || s.rng == nil {
		return Argmax(logits)
	}
	if cap(s.probs) < len(logits) {
		s.probs, s.order = make([]float32, len(logits)), make([]int, len(logits))
	}
	p := s.probs[:len(logits)]
	hi := logits[Argmax(logits)]
	var sum float64
	for i, l := range logits {
		p[i] = float32(math.Exp(float64((l - hi) / s.Temperature)))
		sum += float64(p[i])
	}
	order := s.order[:len(logits)]
	for i := range order {
		order[i] = i
	}
	n := len(order)
	if s.TopP > 0 && s.TopP < 1 {
		sort.Slice(order, func(a, b int) bool {
			if p[order[a]] != p[order[b]] {
				return p[order[a]] > p[order[b]]
			}
			return order[a] < order[b]
		})
		var cum float64
		for i, t := range order {
			cum += float64(p[t]) / sum
			if cum >= float64(s.TopP) {
				n = i + 1
				break
			}
		}
		sum = 0
		for _, t := range order[:n] {
			sum += float64(p[t])
		}
	}
	r := s.rng.Float64() * sum
	for _, t := range order[:n] {
		r -= float64(p[t])
		if r < 0 {
			return t
		}
	}
	return order[n-1]
}
