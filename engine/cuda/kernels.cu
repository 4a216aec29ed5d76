// The CUDA backend's kernels: one forward step of the llama architecture over a paged KV
// cache, float32 throughout. Compiled ahead of time to PTX for compute_90 (H200) by
// ./ptxgen (see doc.go for the command); the backend loads kernels.ptx with cu.LoadData.
//
// Conventions, shared with backend.go:
//   - every kernel parameter is 8 bytes (gorgonia.org/cu's Function.Launch copies 8 bytes per
//     parameter): pointers, long long, double;
//   - a matrix W of shape (out, in) is row-major, out[i] = sum_j W[i*in+j] * x[j] (llama2.c);
//   - activations are row-major [token][width];
//   - the device KV pool holds pages at a stride of page_floats floats; within a page the
//     layout is engine/kv's: layer-major, keys before values, then token, then kv dims;
//   - a request's page table is two arrays, table_pages[i] (the pool page of entry i) and
//     table_epochs[i] (the epoch the request holds for it); epochs[page] mirrors the pool's
//     current epoch of every page;
//   - status[2] are the step's tag-check words: status[0] for the pages the step writes
//     (store_kv), status[1] for the pages it reads (attention); each is NO_MISMATCH or the
//     lowest table index whose page failed the check. They sit right after the logits in one
//     buffer, so they come back with them in the step's one device-to-host copy, with no
//     extra synchronisation. embed resets them at the start of a step.

typedef long long i64;
typedef unsigned long long u64;

#define NO_MISMATCH 0xFFFFFFFFu
#define CUDART_INF_F __int_as_float(0x7f800000)

__device__ __forceinline__ float warp_sum(float v) {
	for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, o);
	return v;
}

__device__ __forceinline__ float warp_max(float v) {
	for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(0xFFFFFFFFu, v, o));
	return v;
}

// block_sum and block_max reduce over the whole block (blockDim.x a multiple of 32, at most
// 1024) and return the result to every thread. scratch holds 32 floats.
__device__ float block_sum(float v, float* scratch) {
	int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	v = warp_sum(v);
	__syncthreads(); // scratch may still be read by a previous reduction
	if (lane == 0) scratch[warp] = v;
	__syncthreads();
	int warps = blockDim.x >> 5;
	v = (threadIdx.x < warps) ? scratch[threadIdx.x] : 0.0f;
	if (warp == 0) v = warp_sum(v);
	if (threadIdx.x == 0) scratch[0] = v;
	__syncthreads();
	return scratch[0];
}

__device__ float block_max(float v, float* scratch) {
	int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	v = warp_max(v);
	__syncthreads();
	if (lane == 0) scratch[warp] = v;
	__syncthreads();
	int warps = blockDim.x >> 5;
	v = (threadIdx.x < warps) ? scratch[threadIdx.x] : -CUDART_INF_F;
	if (warp == 0) v = warp_max(v);
	if (threadIdx.x == 0) scratch[0] = v;
	__syncthreads();
	return scratch[0];
}

// tag_ok is the read-time ownership check of one table entry (design.md §3 step 7): the
// epoch the request holds against the page's current epoch. A failure lowers *status to the
// entry's index, so the host reports the first failing page whichever block saw it.
__device__ __forceinline__ bool tag_ok(const unsigned int* table_pages, const u64* table_epochs,
                                       const u64* epochs, i64 entry, unsigned int* status) {
	if (epochs[table_pages[entry]] == table_epochs[entry]) return true;
	atomicMin(status, (unsigned int)entry);
	return false;
}

// embed: x[t] = embedding[tokens[t]]. Grid (ceil(dim/block), T). With reset != 0 (the first
// launch of a step) it also resets the status word, so the step needs no separate memset.
extern "C" __global__ void embed(float* x, const float* embedding, const int* tokens, i64 dim,
                                 unsigned int* status, i64 reset) {
	i64 t = blockIdx.y;
	i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
	if (reset && t == 0 && i == 0) status[0] = status[1] = NO_MISMATCH;
	if (i < dim) x[t * dim + i] = embedding[(i64)tokens[t] * dim + i];
}

// rmsnorm: out[t] = w * x[t] / sqrt(mean(x[t]^2) + eps). Grid (T), one block per row.
extern "C" __global__ void rmsnorm(float* out, const float* x, const float* w, i64 dim, double eps) {
	__shared__ float scratch[32];
	const float* xr = x + (i64)blockIdx.x * dim;
	float* o = out + (i64)blockIdx.x * dim;
	float ss = 0.0f;
	for (i64 i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
	ss = block_sum(ss, scratch);
	float scale = 1.0f / sqrtf(ss / (float)dim + (float)eps);
	for (i64 i = threadIdx.x; i < dim; i += blockDim.x) o[i] = w[i] * (scale * xr[i]);
}

// matvec: out[t][r] = (accumulate ? out[t][r] : 0) + sum_k w[r][k] * x[t][k], one warp per
// output row r: a row of w is read once, coalesced, which is what bounds a decode step.
// accumulate != 0 is the residual add (x += W·h). Grid (ceil(rows/warps per block), T).
extern "C" __global__ void matvec(float* out, const float* x, const float* w, i64 rows, i64 cols,
                                  i64 accumulate) {
	i64 warps = blockDim.x >> 5;
	i64 r = (i64)blockIdx.x * warps + (threadIdx.x >> 5);
	int lane = threadIdx.x & 31;
	if (r >= rows) return;
	const float* xr = x + (i64)blockIdx.y * cols;
	const float* wr = w + r * cols;
	float s = 0.0f;
	for (i64 k = lane; k < cols; k += 32) s += wr[k] * xr[k];
	s = warp_sum(s);
	if (lane == 0) {
		float* o = out + (i64)blockIdx.y * rows + r;
		*o = accumulate ? *o + s : s;
	}
}

// matmul: out[t][r] = (accumulate ? out[t][r] : 0) + sum_k w[r][k] * x[t][k] for many tokens
// at once (prefill), tiled through shared memory so that each weight is read once per tile of
// TILE tokens. Block (TILE, TILE); grid (ceil(rows/TILE), ceil(T/TILE)).
#define TILE 16
extern "C" __global__ void matmul(float* out, const float* x, const float* w, i64 T, i64 rows,
                                  i64 cols, i64 accumulate) {
	__shared__ float xs[TILE][TILE + 1];
	__shared__ float ws[TILE][TILE + 1];
	int tx = threadIdx.x, ty = threadIdx.y;
	i64 r = (i64)blockIdx.x * TILE + tx;  // output column (weight row)
	i64 t = (i64)blockIdx.y * TILE + ty;  // output row (token)
	i64 wrow = (i64)blockIdx.x * TILE + ty; // the weight row this thread loads
	float s = 0.0f;
	for (i64 k0 = 0; k0 < cols; k0 += TILE) {
		xs[ty][tx] = (t < T && k0 + tx < cols) ? x[t * cols + k0 + tx] : 0.0f;
		ws[ty][tx] = (wrow < rows && k0 + tx < cols) ? w[wrow * cols + k0 + tx] : 0.0f;
		__syncthreads();
#pragma unroll
		for (int k = 0; k < TILE; k++) s += xs[ty][k] * ws[tx][k];
		__syncthreads();
	}
	if (t < T && r < rows) {
		float* o = out + t * rows + r;
		*o = accumulate ? *o + s : s;
	}
}

// rope rotates the leading rotary dims of every head of q (heads) and k (kv_heads) of token t
// at position pos0+t by the angles in rope_cos/rope_sin[pos][pair] (computed on the host with
// the CPU backend's formula, so both backends rotate alike). Grid (T); block threads stride
// over the (head, pair) couples.
extern "C" __global__ void rope(float* q, float* k, const float* rope_cos, const float* rope_sin,
                                i64 pos0, i64 heads, i64 kv_heads, i64 head_dim, i64 rotary) {
	i64 t = blockIdx.x;
	i64 pos = pos0 + t;
	i64 pairs = rotary / 2;
	const float* c = rope_cos + pos * pairs;
	const float* s = rope_sin + pos * pairs;
	for (i64 j = threadIdx.x; j < (heads + kv_heads) * pairs; j += blockDim.x) {
		i64 h = j / pairs, i = j % pairs;
		float* v = (h < heads) ? q + t * heads * head_dim + h * head_dim
		                       : k + t * kv_heads * head_dim + (h - heads) * head_dim;
		float v0 = v[2 * i], v1 = v[2 * i + 1];
		v[2 * i] = v0 * c[i] - v1 * s[i];
		v[2 * i + 1] = v0 * s[i] + v1 * c[i];
	}
}

// store_kv writes token t's keys and values of layer into its page through the table,
// position pos0+t. The page's tag is read once per block (one block row per token) and
// checked first: a page that fails the check is not written (status[0]). Grid (ceil(kv_dim/block), T).
extern "C" __global__ void store_kv(float* pool, const float* k, const float* v, i64 layer,
                                    i64 pos0, i64 kv_dim, i64 page_tokens, i64 page_floats,
                                    const unsigned int* table_pages, const u64* table_epochs,
                                    const u64* epochs, unsigned int* status, i64 check) {
	__shared__ int ok;
	i64 t = blockIdx.y;
	i64 pos = pos0 + t;
	i64 entry = pos / page_tokens, slot = pos % page_tokens;
	if (threadIdx.x == 0) ok = !check || tag_ok(table_pages, table_epochs, epochs, entry, &status[0]);
	__syncthreads();
	if (!ok) return;
	i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
	if (i >= kv_dim) return;
	float* page = pool + (i64)table_pages[entry] * page_floats;
	page[(layer * 2 * page_tokens + slot) * kv_dim + i] = k[t * kv_dim + i];
	page[((layer * 2 + 1) * page_tokens + slot) * kv_dim + i] = v[t * kv_dim + i];
}

#define ATTENTION_THREADS 128

// attention: causal multi-head attention of query head h of token t (position pos0+t) over
// positions [0, pos0+t] of layer, reading keys and values through the page table. The block
// first checks the tag of every page it is about to read, each page once: if any fails, the
// block reads none of them, records the lowest failing entry in status[1] and writes zeros (the
// host then fails the step naming the page; the logits are discarded). With check == 0 (the
// research switch no-tag-check) it reads whatever the pages hold.
// Scores go through scratch att[t][h][seq_len]. Grid (heads, T); block ATTENTION_THREADS.
extern "C" __global__ void attention(float* out, const float* q, const float* pool, float* att,
                                     i64 layer, i64 pos0, i64 heads, i64 kv_heads, i64 head_dim,
                                     i64 page_tokens, i64 page_floats, i64 seq_len,
                                     const unsigned int* table_pages, const u64* table_epochs,
                                     const u64* epochs, unsigned int* status, i64 check) {
	__shared__ float partial[ATTENTION_THREADS];
	__shared__ float scratch[32];
	__shared__ int bad;
	i64 h = blockIdx.x, t = blockIdx.y;
	i64 n = pos0 + t + 1; // positions attended over
	i64 pages = (n + page_tokens - 1) / page_tokens;
	i64 kv_dim = kv_heads * head_dim;
	i64 kvh = h / (heads / kv_heads);
	float* o = out + t * heads * head_dim + h * head_dim;

	if (threadIdx.x == 0) bad = 0;
	__syncthreads();
	if (check) {
		for (i64 e = threadIdx.x; e < pages; e += blockDim.x)
			if (!tag_ok(table_pages, table_epochs, epochs, e, &status[1])) bad = 1;
	}
	__syncthreads();
	if (bad) {
		for (i64 d = threadIdx.x; d < head_dim; d += blockDim.x) o[d] = 0.0f;
		return;
	}

	const float* qh = q + t * heads * head_dim + h * head_dim;
	float* a = att + (t * heads + h) * seq_len;
	float scale = 1.0f / sqrtf((float)head_dim);
	float m = -CUDART_INF_F;
	for (i64 p = threadIdx.x; p < n; p += blockDim.x) {
		const float* key = pool + (i64)table_pages[p / page_tokens] * page_floats +
		                   (layer * 2 * page_tokens + p % page_tokens) * kv_dim + kvh * head_dim;
		float s = 0.0f;
		for (i64 d = 0; d < head_dim; d++) s += qh[d] * key[d];
		s *= scale;
		a[p] = s;
		m = fmaxf(m, s);
	}
	m = block_max(m, scratch);
	float sum = 0.0f;
	for (i64 p = threadIdx.x; p < n; p += blockDim.x) {
		float e = expf(a[p] - m);
		a[p] = e;
		sum += e;
	}
	sum = block_sum(sum, scratch); // its barriers also publish a[] to the whole block

	// out[d] = sum_p a[p] * v[p][d] / sum: the block splits into groups of `width` threads,
	// each group sums a share of the positions for `width` consecutive dims.
	for (i64 d0 = 0; d0 < head_dim; d0 += blockDim.x) {
		i64 width = head_dim - d0 < (i64)blockDim.x ? head_dim - d0 : (i64)blockDim.x;
		i64 groups = blockDim.x / width;
		i64 g = threadIdx.x / width, d = d0 + threadIdx.x % width;
		float acc = 0.0f;
		if (g < groups) {
			for (i64 p = g; p < n; p += groups) {
				const float* val = pool + (i64)table_pages[p / page_tokens] * page_floats +
				                   ((layer * 2 + 1) * page_tokens + p % page_tokens) * kv_dim +
				                   kvh * head_dim;
				acc += a[p] * val[d];
			}
		}
		partial[threadIdx.x] = acc;
		__syncthreads();
		if (threadIdx.x < width) {
			float s = 0.0f;
			for (i64 j = 0; j < groups; j++) s += partial[j * width + threadIdx.x];
			o[d0 + threadIdx.x] = s / sum;
		}
		__syncthreads();
	}
}

// swiglu: gate[i] = silu(gate[i]) * up[i] over n values.
extern "C" __global__ void swiglu(float* gate, const float* up, i64 n) {
	i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
	if (i >= n) return;
	float g = gate[i];
	gate[i] = g * (1.0f / (1.0f + expf(-g))) * up[i];
}

// scatter_pages copies n packed pages from staging into the pool pages listed in pages (pages
// that arrived over the transport, after verification); gather_pages is the reverse (pages
// computed on the device, on their way to the transport). A page is page_vec4 float4s (a page
// always holds a multiple of 4 floats: head dims are even, and keys and values double them).
// Grid (x, y): y strides over pages, x over a page's float4s.
extern "C" __global__ void scatter_pages(float4* pool, const float4* staging,
                                         const unsigned int* pages, i64 n, i64 page_vec4) {
	for (i64 j = blockIdx.y; j < n; j += gridDim.y) {
		float4* dst = pool + (i64)pages[j] * page_vec4;
		const float4* src = staging + j * page_vec4;
		for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < page_vec4; i += (i64)gridDim.x * blockDim.x)
			dst[i] = src[i];
	}
}

extern "C" __global__ void gather_pages(float4* staging, const float4* pool,
                                        const unsigned int* pages, i64 n, i64 page_vec4) {
	for (i64 j = blockIdx.y; j < n; j += gridDim.y) {
		const float4* src = pool + (i64)pages[j] * page_vec4;
		float4* dst = staging + j * page_vec4;
		for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < page_vec4; i += (i64)gridDim.x * blockDim.x)
			dst[i] = src[i];
	}
}
