//go:build cuda || cudaemu

package cuda

import (
	"errors"
	"fmt"
	"math"
	"unsafe"

	"github.com/kvhandoff/kvhandoff/engine/backend"
	"github.com/kvhandoff/kvhandoff/engine/kv"
	"github.com/kvhandoff/kvhandoff/engine/llama"
)

// ErrDevice: the device failed an operation (allocation, copy, launch). The CUDA context may be
// unusable afterwards; the backend should be closed.
var ErrDevice = errors.New("cuda: device error")

// ErrOrder: a method called out of order (Forward before Load and AttachPool, a second Load),
// or after Close.
var ErrOrder = errors.New("cuda: backend used out of order")

// noMismatch is the status word's "every page passed" (kernels.cu's NO_MISMATCH).
const noMismatch = 0xFFFFFFFF

// Launch shapes; kernels.cu states what each kernel expects.
const (
	rowThreads       = 256 // rmsnorm, embed, store_kv, swiglu, page copies
	matvecThreads    = 256 // 8 warps, one output row each
	matvecRows       = matvecThreads / 32
	tile             = 16 // matmul's tile (kernels.cu's TILE)
	attentionThreads = 128
	ropeThreads      = 128
	// matmulFrom is the step length from which the tiled matmul beats one warp per row and
	// token (it reads each weight once per tile of tokens instead of once per token).
	matmulFrom = 4
	// maxChunk bounds the tokens one launch sequence processes, so that a prompt as long as
	// the context does not need scratch of context² size; a longer step runs in chunks.
	maxChunk = 256
	// pageGridY bounds the y dimension of the page-copy grids (CUDA allows 65535).
	pageGridY = 65535
)

// Backend is the CUDA backend: the model's weights and the KV pool in device memory, a
// forward step as a sequence of kernel launches on the context's default stream, and the
// step's logits and tag-check status coming back in one copy. See the package doc.
type Backend struct {
	dev device

	m    *llama.Model
	geom kv.Geometry

	// Host state.
	pages  int      // pool pages
	mirror []uint64 // the epochs the device mirror holds, by page
	cache  *kv.Cache
	step   []byte   // packed step input: held epochs, table pages, tokens
	out    []uint32 // the logits' bits, then the two status words
	pack   []byte   // page-copy staging on the host

	// Device memory.
	w       weights
	pool    devptr // pages × PageBytes
	epochs  devptr // pages × 8: the pool's current epochs
	ropeCos devptr // SeqLen × rotary/2
	ropeSin devptr
	x, xb   devptr // chunk × dim
	q       devptr // chunk × dim
	k, v    devptr // chunk × kvDim
	hb, hb2 devptr // chunk × hidden
	att     devptr // chunk × heads × SeqLen
	stepBuf devptr // the packed step input
	outBuf  devptr // logits and status
	staging devptr // page copies: the page list, then the packed pages

	stagingBytes int      // staging's size
	chunk        int      // the most tokens one launch sequence processes
	allocs       []devptr // everything Close frees
}

// weights are the model's arrays in device memory; per-layer arrays hold every layer's
// matrix one after the other, as in llama.Weights.
type weights struct {
	emb, rmsAtt, wq, wk, wv, wo, rmsFFN, w1, w2, w3, rmsFinal, cls devptr
}

var _ backend.Backend = (*Backend)(nil)

func newBackend(d device) *Backend { return &Backend{dev: d} }

// Name is "cuda".
func (b *Backend) Name() string { return "cuda" }

func (b *Backend) alloc(bytes int) (devptr, error) {
	p, err := b.dev.alloc(bytes)
	if err != nil {
		return 0, fmt.Errorf("%w: allocate %d bytes: %v", ErrDevice, bytes, err)
	}
	b.allocs = append(b.allocs, p)
	return p, nil
}

// upload allocates device memory for a and copies it there.
func (b *Backend) upload(a []float32) (devptr, error) {
	p, err := b.alloc(4 * len(a))
	if err != nil {
		return 0, err
	}
	if err := b.dev.htod(p, unsafe.Pointer(unsafe.SliceData(a)), 4*len(a)); err != nil {
		return 0, fmt.Errorf("%w: copy weights: %v", ErrDevice, err)
	}
	return p, nil
}

// Load copies m's weights to the device and allocates the activations of one chunk.
func (b *Backend) Load(m *llama.Model) error {
	if b.dev == nil || b.m != nil {
		return fmt.Errorf("%w: Load after Close, or twice", ErrOrder)
	}
	if err := m.Validate(); err != nil {
		return err
	}
	return b.dev.do(func() error {
		var err error
		up := func(dst *devptr, a []float32) {
			if err == nil {
				*dst, err = b.upload(a)
			}
		}
		w := &b.w
		up(&w.emb, m.TokenEmbedding)
		up(&w.rmsAtt, m.RMSAttention)
		up(&w.wq, m.WQ)
		up(&w.wk, m.WK)
		up(&w.wv, m.WV)
		up(&w.wo, m.WO)
		up(&w.rmsFFN, m.RMSFFN)
		up(&w.w1, m.W1)
		up(&w.w2, m.W2)
		up(&w.w3, m.W3)
		up(&w.rmsFinal, m.RMSFinal)
		if m.SharedClassifier {
			w.cls = w.emb
		} else {
			up(&w.cls, m.Classifier)
		}
		cos, sin := ropeTables(m)
		up(&b.ropeCos, cos)
		up(&b.ropeSin, sin)
		if err != nil {
			return err
		}
		b.chunk = min(m.SeqLen, maxChunk)
		c := b.chunk
		for _, a := range []struct {
			p     *devptr
			bytes int
		}{
			{&b.x, 4 * c * m.Dim}, {&b.xb, 4 * c * m.Dim}, {&b.q, 4 * c * m.Dim},
			{&b.k, 4 * c * m.KVDim()}, {&b.v, 4 * c * m.KVDim()},
			{&b.hb, 4 * c * m.HiddenDim}, {&b.hb2, 4 * c * m.HiddenDim},
			{&b.att, 4 * c * m.Heads * m.SeqLen},
			{&b.outBuf, 4*m.Vocab + 8},
		} {
			if *a.p, err = b.alloc(a.bytes); err != nil {
				return err
			}
		}
		b.m = m
		b.out = make([]uint32, m.Vocab+2)
		return nil
	})
}

// ropeTables are the rotary angles' cosines and sines by position and pair, computed as the
// CPU backend computes them, so that both backends rotate by the same float32 values.
func ropeTables(m *llama.Model) (cos, sin []float32) {
	half := m.Rotary() / 2
	cos, sin = make([]float32, m.SeqLen*half), make([]float32, m.SeqLen*half)
	for pos := 0; pos < m.SeqLen; pos++ {
		for i := 0; i < half; i++ {
			a := float64(pos) * llama.RotaryFrequency(i, m.Rotary())
			cos[pos*half+i], sin[pos*half+i] = float32(math.Cos(a)), float32(math.Sin(a))
		}
	}
	return cos, sin
}

// AttachPool allocates the device pool and its epoch mirror, and copies the host region's
// pages and the pool's current epochs there.
func (b *Backend) AttachPool(c *kv.Cache) error {
	if b.dev == nil || b.m == nil || b.cache != nil {
		return fmt.Errorf("%w: AttachPool before Load, after Close, or twice", ErrOrder)
	}
	g, m := c.Geometry(), b.m
	if g.Layers != m.Layers || g.KVHeads != m.KVHeads || g.HeadDim != m.HeadDim() {
		return fmt.Errorf("%w: pool %+v for a model of %d layers, %d kv heads of %d", kv.ErrGeometry, g, m.Layers, m.KVHeads, m.HeadDim())
	}
	n := c.Pages()
	mirror := make([]uint64, n)
	for p := range mirror {
		mirror[p] = c.Epoch(uint32(p)) // the pool's, or a transport endpoint's (kv.OverPages)
	}
	maxPages := g.PagesFor(m.SeqLen)
	return b.dev.do(func() error {
		var err error
		if b.pool, err = b.alloc(n * g.PageBytes()); err != nil {
			return err
		}
		if b.epochs, err = b.alloc(8 * n); err != nil {
			return err
		}
		if err := b.dev.htod(b.epochs, unsafe.Pointer(&mirror[0]), 8*n); err != nil {
			return fmt.Errorf("%w: copy epochs: %v", ErrDevice, err)
		}
		b.step = make([]byte, 12*maxPages+4*m.SeqLen)
		if b.stepBuf, err = b.alloc(len(b.step)); err != nil {
			return err
		}
		b.geom, b.pages, b.mirror, b.cache = g, n, mirror, c
		all := make([]uint32, n)
		for p := range all {
			all[p] = uint32(p)
		}
		return b.uploadPages(all)
	})
}

// SetEpochs copies the pages' epochs into the device mirror: one copy of the span of pages
// that changed.
func (b *Backend) SetEpochs(pages []uint32, epochs []uint64) error {
	if b.dev == nil || b.cache == nil {
		return fmt.Errorf("%w: SetEpochs before AttachPool or after Close", ErrOrder)
	}
	if len(pages) != len(epochs) {
		return fmt.Errorf("cuda: %d pages, %d epochs", len(pages), len(epochs))
	}
	lo, hi := b.pages, -1
	for i, p := range pages {
		if int(p) >= b.pages {
			return fmt.Errorf("%w: page %d of a pool of %d", kv.ErrGeometry, p, b.pages)
		}
		if b.mirror[p] != epochs[i] {
			b.mirror[p] = epochs[i]
			lo, hi = min(lo, int(p)), max(hi, int(p))
		}
	}
	if hi < lo {
		return nil
	}
	return b.dev.do(func() error {
		if err := b.dev.htod(b.epochs+devptr(8*lo), unsafe.Pointer(&b.mirror[lo]), 8*(hi-lo+1)); err != nil {
			return fmt.Errorf("%w: copy epochs: %v", ErrDevice, err)
		}
		return nil
	})
}

// Forward runs one step on the device. Its only synchronisation is the copy of the logits
// and the status words at the end, which waits for the step's kernels on the same stream.
func (b *Backend) Forward(s *backend.Step) error {
	if b.dev == nil || b.cache == nil {
		return fmt.Errorf("%w: Forward before AttachPool or after Close", ErrOrder)
	}
	m, g := b.m, b.geom
	T, end := len(s.Tokens), s.Pos+len(s.Tokens)
	if T == 0 || s.Pos < 0 || end > m.SeqLen || g.PagesFor(end) > len(s.Table) || len(s.Logits) != m.Vocab {
		return fmt.Errorf("cuda: step of %d tokens at %d over %d pages (context %d, logits %d)", T, s.Pos, len(s.Table), m.SeqLen, len(s.Logits))
	}
	table := s.Table[:g.PagesFor(end)]
	for i, ref := range table {
		if int(ref.Page) >= b.pages {
			return fmt.Errorf("%w: table entry %d names page %d of a pool of %d", kv.ErrGeometry, i, ref.Page, b.pages)
		}
	}
	for _, tok := range s.Tokens {
		if tok < 0 || tok >= m.Vocab {
			return fmt.Errorf("cuda: token %d outside the vocabulary of %d", tok, m.Vocab)
		}
	}
	// The packed input, one copy: held epochs (8-aligned, first), pages, tokens.
	n := len(table)
	pagesOff, tokensOff := 8*n, 12*n
	for i, ref := range table {
		putU64(b.step[8*i:], ref.Epoch)
		putU32(b.step[pagesOff+4*i:], ref.Page)
	}
	for t, tok := range s.Tokens {
		putU32(b.step[tokensOff+4*t:], uint32(tok))
	}
	check := uint64(1)
	if s.Unchecked {
		check = 0
	}
	err := b.dev.do(func() error {
		if err := b.dev.htod(b.stepBuf, unsafe.Pointer(&b.step[0]), tokensOff+4*T); err != nil {
			return err
		}
		for c0 := 0; c0 < T; c0 += b.chunk {
			c1 := min(T, c0+b.chunk)
			tokens := b.stepBuf + devptr(tokensOff+4*c0)
			if err := b.chunkForward(c1-c0, s.Pos+c0, c0 == 0, c1 == T, check, tokens, b.stepBuf+devptr(pagesOff), b.stepBuf); err != nil {
				return err
			}
		}
		return b.dev.dtoh(unsafe.Pointer(&b.out[0]), b.outBuf, 4*len(b.out))
	})
	if err != nil {
		return fmt.Errorf("%w: forward: %v", ErrDevice, err)
	}
	for i, bits := range b.out[:m.Vocab] {
		s.Logits[i] = math.Float32frombits(bits)
	}
	// The pages the step writes first (as the CPU backend checks them first), then the
	// pages it reads.
	for _, st := range b.out[m.Vocab:] {
		if st == noMismatch {
			continue
		}
		if int(st) >= n {
			return fmt.Errorf("%w: status word names table entry %d of %d", ErrDevice, st, n)
		}
		ref := table[st]
		return &kv.TagError{Index: int(st), Page: ref.Page, Held: ref.Epoch, Current: b.mirror[ref.Page]}
	}
	return nil
}

// chunkForward launches one chunk of T tokens at positions pos.. through every layer; last
// says to finish with the classifier over its last token.
func (b *Backend) chunkForward(T, pos int, first, last bool, check uint64, tokens, tablePages, tableEpochs devptr) error {
	m, g, w := b.m, b.geom, b.w
	dim, kvDim, hidden := m.Dim, m.KVDim(), m.HiddenDim
	u := func(v int) uint64 { return uint64(v) }
	status := b.outBuf + devptr(4*m.Vocab)
	eps := math.Float64bits(llama.NormEps)
	reset := uint64(0)
	if first {
		reset = 1
	}
	l1 := func(k kernel, gx, gy, bx int, params ...uint64) error {
		return b.dev.launch(k, dim3{gx, gy, 1}, dim3{bx, 1, 1}, params...)
	}
	if err := l1(kEmbed, ceil(dim, rowThreads), T, rowThreads, uint64(b.x), uint64(w.emb), uint64(tokens), u(dim), uint64(status), reset); err != nil {
		return err
	}
	for l := 0; l < m.Layers; l++ {
		f := devptr(4 * l) // bytes per float, times the layer
		steps := []func() error{
			func() error {
				return l1(kRMSNorm, T, 1, rowThreads, uint64(b.xb), uint64(b.x), uint64(w.rmsAtt+f*devptr(dim)), u(dim), eps)
			},
			func() error { return b.matmul(b.q, b.xb, w.wq+f*devptr(dim*dim), T, dim, dim, false) },
			func() error { return b.matmul(b.k, b.xb, w.wk+f*devptr(kvDim*dim), T, kvDim, dim, false) },
			func() error { return b.matmul(b.v, b.xb, w.wv+f*devptr(kvDim*dim), T, kvDim, dim, false) },
			func() error {
				return l1(kRope, T, 1, ropeThreads, uint64(b.q), uint64(b.k), uint64(b.ropeCos), uint64(b.ropeSin),
					u(pos), u(m.Heads), u(m.KVHeads), u(m.HeadDim()), u(m.Rotary()))
			},
			func() error {
				return l1(kStoreKV, ceil(kvDim, rowThreads), T, rowThreads, uint64(b.pool), uint64(b.k), uint64(b.v),
					u(l), u(pos), u(kvDim), u(g.PageTokens), u(g.PageFloats()),
					uint64(tablePages), uint64(tableEpochs), uint64(b.epochs), uint64(status), check)
			},
			func() error {
				return l1(kAttention, m.Heads, T, attentionThreads, uint64(b.xb), uint64(b.q), uint64(b.pool), uint64(b.att),
					u(l), u(pos), u(m.Heads), u(m.KVHeads), u(m.HeadDim()), u(g.PageTokens), u(g.PageFloats()), u(m.SeqLen),
					uint64(tablePages), uint64(tableEpochs), uint64(b.epochs), uint64(status), check)
			},
			// The residual adds are the matmuls' accumulate epilogue: x += Wo·attention.
			func() error { return b.matmul(b.x, b.xb, w.wo+f*devptr(dim*dim), T, dim, dim, true) },
			func() error {
				return l1(kRMSNorm, T, 1, rowThreads, uint64(b.xb), uint64(b.x), uint64(w.rmsFFN+f*devptr(dim)), u(dim), eps)
			},
			func() error { return b.matmul(b.hb, b.xb, w.w1+f*devptr(hidden*dim), T, hidden, dim, false) },
			func() error { return b.matmul(b.hb2, b.xb, w.w3+f*devptr(hidden*dim), T, hidden, dim, false) },
			func() error {
				return l1(kSwiGLU, ceil(T*hidden, rowThreads), 1, rowThreads, uint64(b.hb), uint64(b.hb2), u(T*hidden))
			},
			func() error { return b.matmul(b.x, b.hb, w.w2+f*devptr(dim*hidden), T, dim, hidden, true) },
		}
		for _, step := range steps {
			if err := step(); err != nil {
				return err
			}
		}
	}
	if !last {
		return nil
	}
	lastX := b.x + devptr(4*(T-1)*dim)
	if err := l1(kRMSNorm, 1, 1, rowThreads, uint64(b.xb), uint64(lastX), uint64(w.rmsFinal), u(dim), eps); err != nil {
		return err
	}
	return b.matmul(b.outBuf, b.xb, w.cls, 1, m.Vocab, dim, false)
}

// matmul launches out[t][r] (+)= Σ_k w[r][k]·x[t][k] for T tokens: one warp per row and token
// for short steps (decode), the tiled kernel for long ones (prefill).
func (b *Backend) matmul(out, x, w devptr, T, rows, cols int, accumulate bool) error {
	acc := uint64(0)
	if accumulate {
		acc = 1
	}
	if T < matmulFrom {
		return b.dev.launch(kMatvec, dim3{ceil(rows, matvecRows), T, 1}, dim3{matvecThreads, 1, 1},
			uint64(out), uint64(x), uint64(w), uint64(rows), uint64(cols), acc)
	}
	return b.dev.launch(kMatmul, dim3{ceil(rows, tile), ceil(T, tile), 1}, dim3{tile, tile, 1},
		uint64(out), uint64(x), uint64(w), uint64(T), uint64(rows), uint64(cols), acc)
}

// UploadPages copies pages of the host region (that arrived over the transport and were
// verified there) into the device pool: packed on the host, one copy, one scatter kernel.
func (b *Backend) UploadPages(pages []uint32) error {
	if b.dev == nil || b.cache == nil {
		return fmt.Errorf("%w: UploadPages before AttachPool or after Close", ErrOrder)
	}
	if err := b.validPages(pages); err != nil || len(pages) == 0 {
		return err
	}
	return b.dev.do(func() error { return b.uploadPages(pages) })
}

// DownloadPages copies pages of the device pool into the host region (to be sent over the
// transport): one gather kernel, one copy, unpacked on the host.
func (b *Backend) DownloadPages(pages []uint32) error {
	if b.dev == nil || b.cache == nil {
		return fmt.Errorf("%w: DownloadPages before AttachPool or after Close", ErrOrder)
	}
	if err := b.validPages(pages); err != nil || len(pages) == 0 {
		return err
	}
	return b.dev.do(func() error {
		pb := b.geom.PageBytes()
		idx, data, err := b.stage(pages)
		if err != nil {
			return err
		}
		if err := b.copyPages(kGatherPages, data, idx, len(pages)); err != nil {
			return err
		}
		if err := b.dev.dtoh(unsafe.Pointer(&b.pack[0]), data, pb*len(pages)); err != nil {
			return fmt.Errorf("%w: copy pages: %v", ErrDevice, err)
		}
		for i, p := range pages {
			copy(b.cache.Payload(p), b.pack[i*pb:(i+1)*pb])
		}
		return nil
	})
}

func (b *Backend) validPages(pages []uint32) error {
	for _, p := range pages {
		if int(p) >= b.pages {
			return fmt.Errorf("%w: page %d of a pool of %d", kv.ErrGeometry, p, b.pages)
		}
	}
	return nil
}

// uploadPages runs on the context's thread.
func (b *Backend) uploadPages(pages []uint32) error {
	pb := b.geom.PageBytes()
	idx, data, err := b.stage(pages)
	if err != nil {
		return err
	}
	for i, p := range pages {
		copy(b.pack[i*pb:(i+1)*pb], b.cache.Payload(p))
	}
	if err := b.dev.htod(data, unsafe.Pointer(&b.pack[0]), pb*len(pages)); err != nil {
		return fmt.Errorf("%w: copy pages: %v", ErrDevice, err)
	}
	return b.copyPages(kScatterPages, data, idx, len(pages))
}

// stage makes room for n pages in the staging buffers, writes the page list to the device and
// returns where the list and the packed pages are. The list precedes the pages, padded so the
// pages stay 16-byte aligned for the float4 copies.
func (b *Backend) stage(pages []uint32) (idx, data devptr, err error) {
	pb := b.geom.PageBytes()
	listBytes := (4*len(pages) + 15) &^ 15
	need := listBytes + pb*len(pages)
	if need > b.stagingBytes {
		if b.staging != 0 {
			if err := b.free(b.staging); err != nil {
				return 0, 0, err
			}
		}
		b.staging, b.stagingBytes = 0, 0
		if b.staging, err = b.alloc(need); err != nil {
			return 0, 0, err
		}
		b.stagingBytes = need
	}
	if len(b.pack) < max(need, 4*len(pages)) {
		b.pack = make([]byte, need)
	}
	for i, p := range pages {
		putU32(b.pack[4*i:], p)
	}
	if err := b.dev.htod(b.staging, unsafe.Pointer(&b.pack[0]), 4*len(pages)); err != nil {
		return 0, 0, fmt.Errorf("%w: copy page list: %v", ErrDevice, err)
	}
	return b.staging, b.staging + devptr(listBytes), nil
}

// copyPages launches the scatter or gather kernel over n pages.
func (b *Backend) copyPages(k kernel, data, idx devptr, n int) error {
	vec4 := b.geom.PageFloats() / 4
	grid := dim3{min(ceil(vec4, rowThreads), 64), min(n, pageGridY), 1}
	var dst, src devptr
	if k == kScatterPages {
		dst, src = b.pool, data
	} else {
		dst, src = data, b.pool
	}
	if err := b.dev.launch(k, grid, dim3{rowThreads, 1, 1}, uint64(dst), uint64(src), uint64(idx), uint64(n), uint64(vec4)); err != nil {
		return fmt.Errorf("%w: copy pages: %v", ErrDevice, err)
	}
	return nil
}

func (b *Backend) free(p devptr) error {
	for i, a := range b.allocs {
		if a == p {
			b.allocs = append(b.allocs[:i], b.allocs[i+1:]...)
			break
		}
	}
	if err := b.dev.free(p); err != nil {
		return fmt.Errorf("%w: free: %v", ErrDevice, err)
	}
	return nil
}

// Close frees the device memory and releases the device.
func (b *Backend) Close() error {
	if b.dev == nil {
		return nil
	}
	err := b.dev.do(func() error {
		var first error
		for _, p := range b.allocs {
			if err := b.dev.free(p); err != nil && first == nil {
				first = fmt.Errorf("%w: free: %v", ErrDevice, err)
			}
		}
		return first
	})
	b.allocs = nil
	if cerr := b.dev.close(); err == nil {
		err = cerr
	}
	b.dev = nil
	return err
}

func ceil(n, d int) int { return (n + d - 1) / d }

func putU32(b []byte, v uint32) {
	_ = b[3]
	b[0], b[1], b[2], b[3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
}

func putU64(b []byte, v uint64) {
	putU32(b, uint32(v))
	putU32(b[4:], uint32(v>>32))
}
