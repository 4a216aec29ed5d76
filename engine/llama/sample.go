package llama

import (
	"math"
	"math/rand/v2"
	"slices"
	"sort"
)

// Sampler picks next tokens. At temperature 0 it is greedy (the highest
// logit, the lowest token on a tie); otherwise it samples from the softmax at
// the temperature, restricted to the smallest set of tokens whose probability
// reaches TopP (1 or 0: all), from a generator seeded by Seed.
type Sampler struct {
	Temperature float32
	TopP        float32
	// Logprobs, if not nil, records each sampled token's log probability
	// and the Logprobs.Top most likely tokens' (RecordLogprobs); recording
	// never changes which token is sampled.
	Logprobs *Logprobs
	rng      *rand.Rand
	probs    []float32
	order    []int
}

// Logprobs are the log probabilities of sampled tokens under the model's
// distribution (the softmax of the logits, before temperature and top_p:
// what the model assigns, as vLLM reports by default).
type Logprobs struct {
	Top    int // how many of the most likely tokens each step records
	Tokens []TokenLogprob
}

// TokenLogprob is one step: the sampled token, its log probability, and
// the most likely tokens' (highest first, the lowest token on a tie).
type TokenLogprob struct {
	Token   int          `json:"token"`
	Logprob float32      `json:"logprob"`
	Top     []TopLogprob `json:"top,omitempty"`
}

// TopLogprob is one of a step's most likely tokens.
type TopLogprob struct {
	Token   int     `json:"token"`
	Logprob float32 `json:"logprob"`
}

// RecordLogprobs makes s record log probabilities, with the top most
// likely tokens of each step.
func (s *Sampler) RecordLogprobs(top int) *Sampler {
	s.Logprobs = &Logprobs{Top: top}
	return s
}

// record appends the step whose logits sampled tok.
func (l *Logprobs) record(logits []float32, tok int) {
	hi := logits[Argmax(logits)]
	var sum float64
	for _, v := range logits {
		sum += math.Exp(float64(v - hi))
	}
	lse := float64(hi) + math.Log(sum)
	step := TokenLogprob{Token: tok, Logprob: float32(float64(logits[tok]) - lse)}
	for len(step.Top) < min(l.Top, len(logits)) {
		// The best token not taken yet: Top is small (OpenAI allows 20).
		best := -1
		for i, v := range logits {
			if slices.ContainsFunc(step.Top, func(t TopLogprob) bool { return t.Token == i }) {
				continue
			}
			if best < 0 || v > logits[best] {
				best = i
			}
		}
		step.Top = append(step.Top, TopLogprob{Token: best, Logprob: float32(float64(logits[best]) - lse)})
	}
	l.Tokens = append(l.Tokens, step)
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
	tok := s.sample(logits)
	if s.Logprobs != nil {
		s.Logprobs.record(logits, tok)
	}
	return tok
}

func (s *Sampler) sample(logits []float32) int {
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
