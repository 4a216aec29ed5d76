package cpu

import (
	"fmt"
	"math"
	"runtime"

	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
)

// Backend is the CPU backend. The zero value is not usable; call New.
type Backend struct {
	m       *llama.Model
	cache   *kv.Cache
	epochs  []uint64 // the mirror of the pool's current epochs, by page
	workers int
	team    *team     // workers-1 goroutines, started by the first parallel product
	cos     []float32 // rotary tables: (seqLen, rotary/2)
	sin     []float32
	// The weights' bytes Load advised and collapsed onto huge pages.
	hugeAdvised, hugeCollapsed int

	// Scratch, grown to the longest step seen.
	x, xb, xb2, q, k, v, hb, hb2 []float32
	att                          []float32 // (tokens*heads, seqLen)
	pages                        [][]float32
	fail                         []int
	group                        [3]product // matmuls' products, kept here so that a group costs no allocation
}

var _ backend.Backend = (*Backend)(nil)

// New returns a CPU backend that uses every core.
func New() *Backend { return &Backend{workers: runtime.GOMAXPROCS(0)} }

// NewThreads returns a CPU backend that splits each product over at most
// threads goroutines (1: every step on the caller's goroutine, as a
// single-threaded C engine computes it).
func NewThreads(threads int) *Backend { return &Backend{workers: max(threads, 1)} }

// Name is "cpu".
func (b *Backend) Name() string { return "cpu" }

// Load keeps m's arrays (no copy), asks the operating system to back them
// with huge pages (adviseHugePages: a hint), and precomputes the rotary
// tables.
func (b *Backend) Load(m *llama.Model) error {
	if err := m.Validate(); err != nil {
		return err
	}
	b.m = m
	b.hugeAdvised, b.hugeCollapsed = adviseHugePages(m.TokenEmbedding, m.RMSAttention, m.WQ, m.WK, m.WV, m.WO,
		m.RMSFFN, m.W1, m.W2, m.W3, m.RMSFinal, m.Classifier)
	half := m.Rotary() / 2
	b.cos, b.sin = make([]float32, m.SeqLen*half), make([]float32, m.SeqLen*half)
	for pos := 0; pos < m.SeqLen; pos++ {
		for i := 0; i < half; i++ {
			a := float64(pos) * llama.RotaryFrequency(i, m.Rotary())
			b.cos[pos*half+i], b.sin[pos*half+i] = float32(math.Cos(a)), float32(math.Sin(a))
		}
	}
	return nil
}

// AttachPool uses the cache's region as the pool.
func (b *Backend) AttachPool(c *kv.Cache) error {
	if b.m == nil {
		return fmt.Errorf("cpu: AttachPool before Load")
	}
	g := c.Geometry()
	if g.Layers != b.m.Layers || g.KVHeads != b.m.KVHeads || g.HeadDim != b.m.HeadDim() {
		return fmt.Errorf("%w: pool %+v for a model of %d layers, %d kv heads of %d", kv.ErrGeometry, g, b.m.Layers, b.m.KVHeads, b.m.HeadDim())
	}
	b.cache, b.epochs = c, make([]uint64, c.Pages())
	return nil
}

// SetEpochs updates the epoch mirror.
func (b *Backend) SetEpochs(pages []uint32, epochs []uint64) error {
	if len(pages) != len(epochs) {
		return fmt.Errorf("cpu: %d pages, %d epochs", len(pages), len(epochs))
	}
	for i, p := range pages {
		if int(p) >= len(b.epochs) {
			return fmt.Errorf("%w: page %d of a pool of %d", kv.ErrGeometry, p, len(b.epochs))
		}
		b.epochs[p] = epochs[i]
	}
	return nil
}

// UploadPages does nothing: the host region is the pool.
func (b *Backend) UploadPages([]uint32) error { return nil }

// DownloadPages does nothing: the host region is the pool.
func (b *Backend) DownloadPages([]uint32) error { return nil }

// Close stops the backend's worker goroutines, if it started any; a later
// step starts them again.
func (b *Backend) Close() error {
	if b.team != nil {
		b.team.close()
		b.team = nil
	}
	return nil
}

func grow(s []float32, n int) []float32 {
	if cap(s) < n {
		return make([]float32, n)
	}
	return s[:n]
}

// serial says whether work over n items of cost each runs on the caller's
// goroutine alone: one thread, or too little work to be worth a goroutine.
func (b *Backend) serial(n, cost int) bool {
	return b.workers <= 1 || n*cost < 1<<15 || n < 2
}

// parallel calls f over [0, n) split into one chunk per core; the caller
// runs the first, the team's workers the others. Callers check serial first
// and call their loop directly when it holds, so that one thread makes no
// closure (no allocation) and starts no goroutine. A backend computes one
// step at a time (its scratch is shared), so one team serves every call.
func (b *Backend) parallel(n int, f func(lo, hi int)) {
	if b.team == nil {
		b.team = newTeam(b.workers - 1)
		// A backend dropped without Close stops its workers when collected:
		// they hold the team, not the backend.
		runtime.AddCleanup(b, (*team).close, b.team)
	}
	b.team.run(n, min(n, b.workers), f)
}

// matmul: out[t*d+i] = Σ_j w[i*n+j]·x[t*n+j] for T tokens, by the vector
// kernels where the CPU has them (matmulSIMD). On the pure-Go path each
// weight row is read once for every token, and the inner products go four at
// a time (four rows for one token, or one row for four tokens), so each value
// loaded serves four products.
func (b *Backend) matmul(out, x, w []float32, T, n, d int) {
	if b.serial(d, n*T) {
		matmulRows(out, x, w, T, n, d, 0, d)
		return
	}
	b.parallel(d, func(lo, hi int) { matmulRows(out, x, w, T, n, d, lo, hi) })
}

// product is one of a group of matrix products that share their input:
// out (T, d) = x (T, n) times w (d, n) transposed.
type product struct {
	out, w []float32
	d      int
}

// matmuls computes products of the same input (a layer's queries, keys and
// values; its gate and up projections) with their rows split over the
// threads together: one hand-off to the other threads for the group, not
// one per product.
func (b *Backend) matmuls(x []float32, T, n int, ps []product) {
	rows := 0
	for _, p := range ps {
		rows += p.d
	}
	if b.serial(rows, n*T) {
		productRows(x, T, n, ps, 0, rows)
		return
	}
	b.parallel(rows, func(lo, hi int) { productRows(x, T, n, ps, lo, hi) })
}

// productRows is rows [lo, hi) of the products' rows one after another.
func productRows(x []float32, T, n int, ps []product, lo, hi int) {
	off := 0
	for _, p := range ps {
		if l, h := max(lo, off), min(hi, off+p.d); l < h {
			matmulRows(p.out, x, p.w, T, n, p.d, l-off, h-off)
		}
		off += p.d
	}
}

// matmulRows is matmul's output rows [lo, hi).
func matmulRows(out, x, w []float32, T, n, d, lo, hi int) {
	if simd {
		matmulSIMD(out, x, w, T, n, d, lo, hi)
		return
	}
	if T == 1 {
		i := lo
		for ; i+4 <= hi; i += 4 {
			out[i], out[i+1], out[i+2], out[i+3] = dot4(x[:n], w[i*n:(i+1)*n], w[(i+1)*n:(i+2)*n], w[(i+2)*n:(i+3)*n], w[(i+3)*n:(i+4)*n])
		}
		for ; i < hi; i++ {
			out[i] = dot(w[i*n:(i+1)*n], x[:n])
		}
		return
	}
	for i := lo; i < hi; i++ {
		row := w[i*n : (i+1)*n]
		t := 0
		for ; t+4 <= T; t += 4 {
			out[t*d+i], out[(t+1)*d+i], out[(t+2)*d+i], out[(t+3)*d+i] = dot4(row, x[t*n:(t+1)*n], x[(t+1)*n:(t+2)*n], x[(t+2)*n:(t+3)*n], x[(t+3)*n:(t+4)*n])
		}
		for ; t < T; t++ {
			out[t*d+i] = dot(row, x[t*n:(t+1)*n])
		}
	}
}

// tileFloats bounds the tokens' inputs that one pass over a block of weight
// rows reads (128 KiB), so that they stay in the core's L2 cache while every
// row block of the matrix goes past them.
const tileFloats = 32 << 10

// matmulSIMD is matmul's rows [lo, hi) by the vector kernels: four rows at
// a time, for one token (gemv4) or three tokens (gemm4x3: each weight row
// loaded once serves three tokens, each token's chunk four rows), the tokens
// in tiles of at most tileFloats inputs. Every product is computed the same
// way by every kernel (see asmgen), so a token's outputs do not depend on
// the batch it came in.
func matmulSIMD(out, x, w []float32, T, n, d, lo, hi int) {
	groups := (hi - lo) / 4
	if T == 1 {
		gemv4SIMD(out[lo:hi], x[:n], w[lo*n:hi*n], n, groups)
		for i := lo + 4*groups; i < hi; i++ {
			out[i] = dotSIMD(w[i*n:(i+1)*n], x[:n])
		}
		return
	}
	tile := max(3, tileFloats/max(n, 1)/3*3)
	for t0 := 0; t0 < T; t0 += tile {
		t1 := min(T, t0+tile)
		tg := (t1 - t0) / 3
		for i := lo; i < lo+4*groups; i += 4 {
			rows := w[i*n : (i+4)*n]
			if tg > 0 {
				gemm4x3SIMD(out[t0*d+i:], x[t0*n:(t0+3*tg)*n], rows, n, d, tg)
			}
			for t := t0 + 3*tg; t < t1; t++ {
				gemv4SIMD(out[t*d+i:t*d+i+4], x[t*n:(t+1)*n], rows, n, 1)
			}
		}
		for i := lo + 4*groups; i < hi; i++ {
			for t := t0; t < t1; t++ {
				out[t*d+i] = dotSIMD(w[i*n:(i+1)*n], x[t*n:(t+1)*n])
			}
		}
	}
}

// dot4 is the inner products of a with each of b0..b3.
func dot4(a, b0, b1, b2, b3 []float32) (s0, s1, s2, s3 float32) {
	n := len(a)
	b0, b1, b2, b3 = b0[:n], b1[:n], b2[:n], b3[:n]
	j := 0
	for ; j+2 <= n; j += 2 {
		a0, a1 := a[j], a[j+1]
		s0 += float32(a0*b0[j]) + float32(a1*b0[j+1])
		s1 += float32(a0*b1[j]) + float32(a1*b1[j+1])
		s2 += float32(a0*b2[j]) + float32(a1*b2[j+1])
		s3 += float32(a0*b3[j]) + float32(a1*b3[j+1])
	}
	for ; j < n; j++ {
		s0 += float32(a[j] * b0[j])
		s1 += float32(a[j] * b1[j])
		s2 += float32(a[j] * b2[j])
		s3 += float32(a[j] * b3[j])
	}
	return
}

// dot is one lane of dot4, in the same order, so a product comes out
// bit-identical whichever path computed it: a position's KV is the same from
// a prefill batch as from a single decode step. The explicit float32
// conversions keep every product rounded on its own: Go may fuse x*y+z into
// one multiply-add where the CPU has it (arm64 always, amd64 with GOAMD64=v3),
// and it fused dot and dot4 differently on arm64.
func dot(a, b []float32) float32 {
	b = b[:len(a)]
	var s float32
	j := 0
	for ; j+2 <= len(a); j += 2 {
		s += float32(a[j]*b[j]) + float32(a[j+1]*b[j+1])
	}
	for ; j < len(a); j++ {
		s += float32(a[j] * b[j])
	}
	return s
}

func rmsnorm(out, x, w []float32) {
	var ss float32
	for _, v := range x {
		ss += v * v
	}
	ss = ss/float32(len(x)) + llama.NormEps
	inv := float32(1 / math.Sqrt(float64(ss)))
	for i := range x {
		out[i] = w[i] * (inv * x[i])
	}
}

// rotate applies rotary positions to the leading rotary dims of every head
// of vec (heads*hd wide) at position pos.
func (b *Backend) rotate(vec []float32, heads, pos int) {
	hd, half := b.m.HeadDim(), b.m.Rotary()/2
	cs, sn := b.cos[pos*half:(pos+1)*half], b.sin[pos*half:(pos+1)*half]
	for h := 0; h < heads; h++ {
		v := vec[h*hd : h*hd+2*half]
		for i := 0; i < half; i++ {
			v0, v1 := v[2*i], v[2*i+1]
			v[2*i], v[2*i+1] = v0*cs[i]-v1*sn[i], v0*sn[i]+v1*cs[i]
		}
	}
}

// Forward runs one step.
func (b *Backend) Forward(s *backend.Step) error {
	m, g := b.m, b.cache.Geometry()
	T, end := len(s.Tokens), s.Pos+len(s.Tokens)
	if T == 0 || s.Pos < 0 || end > m.SeqLen || g.PagesFor(end) > len(s.Table) || len(s.Logits) != m.Vocab {
		return fmt.Errorf("cpu: step of %d tokens at %d over %d pages (context %d, logits %d)", T, s.Pos, len(s.Table), m.SeqLen, len(s.Logits))
	}
	table := s.Table[:g.PagesFor(end)]
	check := !s.Unchecked
	b.pages = b.pages[:0]
	for _, ref := range table {
		if int(ref.Page) >= len(b.epochs) {
			return fmt.Errorf("%w: page %d of a pool of %d", kv.ErrGeometry, ref.Page, len(b.epochs))
		}
		b.pages = append(b.pages, b.cache.Floats(ref.Page))
	}
	// The pages the step writes are checked before anything is written.
	if check {
		for i := s.Pos / g.PageTokens; i < len(table); i++ {
			if err := b.check(table, i); err != nil {
				return err
			}
		}
	}
	dim, kvDim, hidden := m.Dim, m.KVDim(), m.HiddenDim
	b.x, b.xb, b.xb2, b.q = grow(b.x, T*dim), grow(b.xb, T*dim), grow(b.xb2, T*dim), grow(b.q, T*dim)
	b.k, b.v = grow(b.k, T*kvDim), grow(b.v, T*kvDim)
	b.hb, b.hb2 = grow(b.hb, T*hidden), grow(b.hb2, T*hidden)
	b.att = grow(b.att, T*m.Heads*m.SeqLen)
	for t, tok := range s.Tokens {
		if tok < 0 || tok >= m.Vocab {
			return fmt.Errorf("cpu: token %d outside the vocabulary of %d", tok, m.Vocab)
		}
		copy(b.x[t*dim:(t+1)*dim], m.TokenEmbedding[tok*dim:(tok+1)*dim])
	}
	for l := 0; l < m.Layers; l++ {
		for t := 0; t < T; t++ {
			rmsnorm(b.xb[t*dim:(t+1)*dim], b.x[t*dim:(t+1)*dim], m.RMSAttention[l*dim:(l+1)*dim])
		}
		b.group[0] = product{b.q, m.WQ[l*dim*dim : (l+1)*dim*dim], dim}
		b.group[1] = product{b.k, m.WK[l*kvDim*dim : (l+1)*kvDim*dim], kvDim}
		b.group[2] = product{b.v, m.WV[l*kvDim*dim : (l+1)*kvDim*dim], kvDim}
		b.matmuls(b.xb, T, dim, b.group[:3])
		for t := 0; t < T; t++ {
			pos := s.Pos + t
			b.rotate(b.q[t*dim:(t+1)*dim], m.Heads, pos)
			b.rotate(b.k[t*kvDim:(t+1)*kvDim], m.KVHeads, pos)
			page, j := b.pages[pos/g.PageTokens], pos%g.PageTokens
			copy(page[g.KeyOffset(l, j):g.KeyOffset(l, j)+kvDim], b.k[t*kvDim:(t+1)*kvDim])
			copy(page[g.ValueOffset(l, j):g.ValueOffset(l, j)+kvDim], b.v[t*kvDim:(t+1)*kvDim])
		}
		if err := b.attention(l, s.Pos, T, table, check); err != nil {
			return err
		}
		b.matmul(b.xb2, b.xb, m.WO[l*dim*dim:(l+1)*dim*dim], T, dim, dim)
		for i := range b.x {
			b.x[i] += b.xb2[i]
		}
		for t := 0; t < T; t++ {
			rmsnorm(b.xb[t*dim:(t+1)*dim], b.x[t*dim:(t+1)*dim], m.RMSFFN[l*dim:(l+1)*dim])
		}
		b.group[0] = product{b.hb, m.W1[l*hidden*dim : (l+1)*hidden*dim], hidden}
		b.group[1] = product{b.hb2, m.W3[l*hidden*dim : (l+1)*hidden*dim], hidden}
		b.matmuls(b.xb, T, dim, b.group[:2])
		for i, g := range b.hb {
			b.hb[i] = g / (1 + float32(math.Exp(float64(-g)))) * b.hb2[i]
		}
		b.matmul(b.xb, b.hb, m.W2[l*dim*hidden:(l+1)*dim*hidden], T, hidden, dim)
		for i := range b.x {
			b.x[i] += b.xb[i]
		}
	}
	last := b.x[(T-1)*dim : T*dim]
	rmsnorm(last, last, m.RMSFinal)
	b.matmul(s.Logits, last, m.Classifier, 1, dim, m.Vocab)
	return nil
}

// check is the read-time check of table entry i against the mirror.
func (b *Backend) check(table kv.Table, i int) error {
	if ref := table[i]; b.epochs[ref.Page] != ref.Epoch {
		return &kv.TagError{Index: i, Page: ref.Page, Held: ref.Epoch, Current: b.epochs[ref.Page]}
	}
	return nil
}

// attention computes every (token, head) pair's attention over the pages,
// writing the heads' outputs into xb. Each page's tag is checked where its
// keys and values are read.
func (b *Backend) attention(l, pos0, T int, table kv.Table, check bool) error {
	m := b.m
	// Per (token, head) pair: 1 + the table index that failed, or 0.
	if cap(b.fail) < T*m.Heads {
		b.fail = make([]int, T*m.Heads)
	}
	fail := b.fail[:T*m.Heads]
	clear(fail)
	if b.serial(T*m.Heads, (pos0+T)*m.HeadDim()*2) {
		b.attend(l, pos0, table, check, fail, 0, T*m.Heads)
	} else {
		b.parallel(T*m.Heads, func(lo, hi int) { b.attend(l, pos0, table, check, fail, lo, hi) })
	}
	first := -1
	for _, f := range fail {
		if f != 0 && (first < 0 || f-1 < first) {
			first = f - 1
		}
	}
	if first >= 0 {
		return b.check(table, first)
	}
	return nil
}

// attend is attention's (token, head) pairs [lo, hi) in layer l, a failed
// tag check recorded in fail. A token's heads in the range go through the
// pages together, page by page: the page's rows hold every head's keys (and
// values) of a position side by side, so the heads read each page's keys,
// then its values, as one run of memory instead of one strided pass per
// head. Each head's products and sums are the same, in the same order.
func (b *Backend) attend(l, pos0 int, table kv.Table, check bool, fail []int, lo, hi int) {
	m, g := b.m, b.cache.Geometry()
	hd, kvDim, dim, pt := m.HeadDim(), m.KVDim(), m.Dim, g.PageTokens
	group := m.Heads / m.KVHeads
	scale := float32(1 / math.Sqrt(float64(hd)))
	kOff, vOff := g.KeyOffset(l, 0), g.ValueOffset(l, 0)
	score, sum := scores, weightedSum
	if simd {
		score, sum = scoresSIMD, weightedSumSIMD
	}
	for first := lo; first < hi; {
		t := first / m.Heads
		last := min(hi, (t+1)*m.Heads) // pairs [first, last) are token t's
		pos := pos0 + t
		att := func(pair int) []float32 { return b.att[pair*m.SeqLen : pair*m.SeqLen+pos+1] }
		failed := func(i int) bool {
			if check && b.epochs[table[i].Page] != table[i].Epoch {
				for pair := first; pair < last; pair++ {
					fail[pair] = i + 1
				}
				return true
			}
			return false
		}
		ok := true
		for p := 0; p <= pos && ok; p += pt {
			i := p / pt
			if ok = !failed(i); ok {
				for pair := first; pair < last; pair++ {
					h := pair % m.Heads
					q := b.q[t*dim+h*hd : t*dim+(h+1)*hd]
					score(att(pair)[p:min(p+pt, pos+1)], q, b.pages[i][kOff+(h/group)*hd:], kvDim)
				}
			}
		}
		for pair := first; pair < last && ok; pair++ {
			a := att(pair)
			top := float32(math.Inf(-1))
			for i, x := range a {
				a[i] = x * scale
				top = max(top, a[i])
			}
			var total float32
			for i, x := range a {
				e := float32(math.Exp(float64(x - top)))
				a[i] = e
				total += e
			}
			inv := 1 / total
			for i := range a {
				a[i] *= inv
			}
			h := pair % m.Heads
			clear(b.xb[t*dim+h*hd : t*dim+(h+1)*hd])
		}
		for p := 0; p <= pos && ok; p += pt {
			i := p / pt
			if ok = !failed(i); ok {
				for pair := first; pair < last; pair++ {
					h := pair % m.Heads
					sum(b.xb[t*dim+h*hd:t*dim+(h+1)*hd], b.pages[i][vOff+(h/group)*hd:], att(pair)[p:min(p+pt, pos+1)], kvDim)
				}
			}
		}
		first = last
	}
}

// scores sets out[j] = q·k[j*ld:j*ld+len(q)] for j < len(out): a query's
// products with a page's keys, which are ld floats apart.
func scores(out, q, k []float32, ld int) {
	for j := range out {
		out[j] = dot(q, k[j*ld:j*ld+len(q)])
	}
}

// weightedSum adds c[j]·v[j*ld:j*ld+len(out)] to out for j = 0..len(c)-1
// in order: the values of a page weighted by their attention.
func weightedSum(out, v, c []float32, ld int) {
	for j, a := range c {
		axpy(out, v[j*ld:j*ld+len(out)], a)
	}
}

func axpy(out, v []float32, a float32) {
	v = v[:len(out)]
	for i := range out {
		out[i] += a * v[i]
	}
}
