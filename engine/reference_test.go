package engine_test

// The reference forward pass: llama2.c's architecture written straight from
// its equations over contiguous arrays, reading the checkpoint file's bytes by
// their offsets in llama2.c's layout. It shares no code with the engine: not
// the reader, not the kernels, not the KV layout.

import (
	"encoding/binary"
	"math"
)

type refModel struct {
	dim, hidden, layers, heads, kvHeads, vocab, seqLen, rotary     int
	emb, rmsAtt, wq, wk, wv, wo, rmsFFN, w1, w2, w3, rmsFinal, cls []float64
	kCache, vCache                                                 [][]float64 // [layer][pos*kvDim]
}

// parseRef reads a llama2.c checkpoint from raw bytes. rotary is the number of
// rotated dims per head (0: all), which a llama2.c file does not carry.
func parseRef(b []byte, rotary int) *refModel {
	i32 := func(i int) int { return int(int32(binary.LittleEndian.Uint32(b[4*i:]))) }
	m := &refModel{dim: i32(0), hidden: i32(1), layers: i32(2), heads: i32(3), kvHeads: i32(4), vocab: i32(5), seqLen: i32(6)}
	shared := m.vocab > 0
	if m.vocab < 0 {
		m.vocab = -m.vocab
	}
	hs := m.dim / m.heads
	m.rotary = rotary
	if rotary == 0 {
		m.rotary = hs
	}
	kv := m.kvHeads * hs
	off := 28
	take := func(n int) []float64 {
		out := make([]float64, n)
		for i := range out {
			out[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(b[off+4*i:])))
		}
		off += 4 * n
		return out
	}
	L, d, h := m.layers, m.dim, m.hidden
	m.emb = take(m.vocab * d)
	m.rmsAtt = take(L * d)
	m.wq = take(L * d * d)
	m.wk = take(L * kv * d)
	m.wv = take(L * kv * d)
	m.wo = take(L * d * d)
	m.rmsFFN = take(L * d)
	m.w1 = take(L * h * d)
	m.w2 = take(L * d * h)
	m.w3 = take(L * h * d)
	m.rmsFinal = take(d)
	off += 4 * m.seqLen * hs // freq_cis_real and freq_cis_imag: seq_len*head_size/2 each
	if shared {
		m.cls = m.emb
	} else {
		m.cls = take(m.vocab * d)
	}
	m.kCache, m.vCache = make([][]float64, L), make([][]float64, L)
	for l := range L {
		m.kCache[l], m.vCache[l] = make([]float64, m.seqLen*kv), make([]float64, m.seqLen*kv)
	}
	return m
}

func refRMSNorm(x, w []float64) []float64 {
	ss := 0.0
	for _, v := range x {
		ss += v * v
	}
	s := 1 / math.Sqrt(ss/float64(len(x))+1e-5)
	out := make([]float64, len(x))
	for i := range x {
		out[i] = w[i] * x[i] * s
	}
	return out
}

// refMatVec: W is (out, in) row-major.
func refMatVec(w, x []float64, out int) []float64 {
	in := len(x)
	y := make([]float64, out)
	for i := range out {
		for j := range in {
			y[i] += w[i*in+j] * x[j]
		}
	}
	return y
}

// rope rotates each head's pairs (2i, 2i+1), i < rotary/2, by pos/10000^(2i/rotary).
func (m *refModel) rope(v []float64, pos int) {
	hs := m.dim / m.heads
	for h := 0; h < len(v)/hs; h++ {
		for i := 0; 2*i < m.rotary; i++ {
			theta := float64(pos) / math.Pow(10000, float64(2*i)/float64(m.rotary))
			a, b := v[h*hs+2*i], v[h*hs+2*i+1]
			v[h*hs+2*i] = a*math.Cos(theta) - b*math.Sin(theta)
			v[h*hs+2*i+1] = a*math.Sin(theta) + b*math.Cos(theta)
		}
	}
}

// forward runs token at pos and returns the logits.
func (m *refModel) forward(token, pos int) []float64 {
	d, hs := m.dim, m.dim/m.heads
	kv := m.kvHeads * hs
	x := append([]float64(nil), m.emb[token*d:(token+1)*d]...)
	for l := range m.layers {
		xn := refRMSNorm(x, m.rmsAtt[l*d:(l+1)*d])
		q := refMatVec(m.wq[l*d*d:(l+1)*d*d], xn, d)
		k := refMatVec(m.wk[l*kv*d:(l+1)*kv*d], xn, kv)
		v := refMatVec(m.wv[l*kv*d:(l+1)*kv*d], xn, kv)
		m.rope(q, pos)
		m.rope(k, pos)
		copy(m.kCache[l][pos*kv:], k)
		copy(m.vCache[l][pos*kv:], v)
		att := make([]float64, d)
		for h := range m.heads {
			g := h / (m.heads / m.kvHeads) // the kv head this query head shares
			scores := make([]float64, pos+1)
			hi := math.Inf(-1)
			for t := 0; t <= pos; t++ {
				s := 0.0
				for i := range hs {
					s += q[h*hs+i] * m.kCache[l][t*kv+g*hs+i]
				}
				scores[t] = s / math.Sqrt(float64(hs))
				hi = math.Max(hi, scores[t])
			}
			sum := 0.0
			for t := range scores {
				scores[t] = math.Exp(scores[t] - hi)
				sum += scores[t]
			}
			for t := range scores {
				for i := range hs {
					att[h*hs+i] += scores[t] / sum * m.vCache[l][t*kv+g*hs+i]
				}
			}
		}
		o := refMatVec(m.wo[l*d*d:(l+1)*d*d], att, d)
		for i := range x {
			x[i] += o[i]
		}
		xn = refRMSNorm(x, m.rmsFFN[l*d:(l+1)*d])
		a := refMatVec(m.w1[l*m.hidden*d:(l+1)*m.hidden*d], xn, m.hidden)
		b := refMatVec(m.w3[l*m.hidden*d:(l+1)*m.hidden*d], xn, m.hidden)
		for i := range a {
			a[i] = a[i] / (1 + math.Exp(-a[i])) * b[i]
		}
		f := refMatVec(m.w2[l*d*m.hidden:(l+1)*d*m.hidden], a, d)
		for i := range x {
			x[i] += f[i]
		}
	}
	x = refRMSNorm(x, m.rmsFinal)
	return refMatVec(m.cls, x, m.vocab)
}

func refArgmax(x []float64) int {
	best := 0
	for i, v := range x {
		if v > x[best] {
			best = i
		}
	}
	return best
}
