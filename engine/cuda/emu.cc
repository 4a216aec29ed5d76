//go:build cudaemu && !cuda

// A CUDA emulator for kernels.cu, so that the backend's host code and its kernels are tested
// on machines without a GPU (build tag cudaemu). kernels.cu is compiled as C++ with the
// CUDA built-ins it uses defined below; a launch runs the grid's blocks one after another,
// and a block's threads as coroutines on one OS thread, switched at __syncthreads
// and at warp shuffles, so barriers and shuffles have CUDA's semantics for the kernels'
// (convergent) use of them. __shared__ variables become function statics: shared by the
// threads of a block, and blocks never run at the same time.
//
// What it does not emulate: concurrency between blocks (none of the kernels rely on it),
// the GPU's memory model and timing, and float rounding of the GPU's fused multiply-adds
// (the emulator's compiler decides its own contractions). It checks every host copy against
// the allocations, every launch's parameter count, and (at compile time) that every kernel
// parameter is 8 bytes, the convention gorgonia.org/cu's Function.Launch imposes. Under
// `go test -asan -tags cudaemu` a kernel's access outside an allocation is reported.

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <type_traits>
#include <utility>
#include <vector>

struct emu_uint3 {
	unsigned x, y, z;
};
struct float4 {
	float x, y, z, w;
};

static emu_uint3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

static inline float __int_as_float(int i) {
	float f;
	std::memcpy(&f, &i, sizeof f);
	return f;
}
static inline unsigned atomicMin(unsigned* a, unsigned v) {
	unsigned old = *a;
	if (v < old) *a = v;
	return old;
}
static void __syncthreads();
static float __shfl_down_sync(unsigned mask, float v, int delta);

#include "kernels.cu"

// ---- coroutines: a minimal stack switch on x86-64 (ucontext's swapcontext makes two
// system calls per switch, for the signal mask, which dominated the emulator's time) ----

namespace {

#if defined(__x86_64__)
extern "C" void emu_switch(void** save_sp, void* load_sp);
asm(".pushsection .text\n"
    ".globl emu_switch\n"
    ".type emu_switch,@function\n"
    "emu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size emu_switch, .-emu_switch\n"
    ".popsection\n");

struct coro {
	void* sp;
};

// coro_init prepares c to start in entry (which never returns) on the given stack: the
// callee-saved registers emu_switch pops, then entry as the return address, aligned as if
// entry had been called.
void coro_init(coro& c, char* stack, size_t size, void (*entry)()) {
	uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
	void** sp = reinterpret_cast<void**>(top);
	*--sp = nullptr; // entry's own return address: never used
	*--sp = reinterpret_cast<void*>(entry);
	for (int i = 0; i < 6; i++) *--sp = nullptr;
	c.sp = sp;
}

inline void coro_switch(coro& from, coro& to) { emu_switch(&from.sp, to.sp); }
#else
struct coro {
	ucontext_t ctx;
};

void coro_init(coro& c, char* stack, size_t size, void (*entry)()) {
	getcontext(&c.ctx);
	c.ctx.uc_stack.ss_sp = stack;
	c.ctx.uc_stack.ss_size = size;
	c.ctx.uc_link = nullptr;
	makecontext(&c.ctx, entry, 0);
}

inline void coro_switch(coro& from, coro& to) { swapcontext(&from.ctx, &to.ctx); }
#endif

// ---- the block scheduler ----

enum wait_kind { running, at_block_barrier, at_warp_barrier };

struct thread {
	coro ctx;
	emu_uint3 tid;
	bool done;
	wait_kind wait;     // what the thread waits for; the scheduler skips it until released
	unsigned long gen;  // the barrier generation it arrived at
};

constexpr size_t stack_bytes = 64 << 10;
constexpr unsigned max_threads = 1024;
constexpr long max_rounds = 50000000; // a block that stops making progress is a deadlock

std::vector<thread> threads;
std::vector<char*> stacks;
coro scheduler;
unsigned current;
void (*block_body)(const uint64_t*);
const uint64_t* block_params;
unsigned live, arrived;
unsigned long generation;
std::vector<unsigned> warp_live, warp_arrived;
std::vector<unsigned long> warp_generation;
std::vector<float> warp_slots; // two buffers per warp, alternating by shuffle generation

inline unsigned linear(const emu_uint3& t) { return t.x + blockDim.x * (t.y + blockDim.y * t.z); }

void yield() { coro_switch(threads[current].ctx, scheduler); }

void release_block_if_complete() {
	if (arrived > 0 && arrived == live) {
		arrived = 0;
		generation++;
	}
}

void release_warp_if_complete(unsigned w) {
	if (warp_arrived[w] > 0 && warp_arrived[w] == warp_live[w]) {
		warp_arrived[w] = 0;
		warp_generation[w]++;
	}
}

void warp_barrier(unsigned w) {
	unsigned long g = warp_generation[w];
	warp_arrived[w]++;
	release_warp_if_complete(w);
	if (warp_generation[w] != g) return;
	threads[current].wait = at_warp_barrier;
	threads[current].gen = g;
	yield();
}

// released: the barrier thread t waits at has opened.
bool released(const thread& t) {
	switch (t.wait) {
	case at_block_barrier:
		return generation != t.gen;
	case at_warp_barrier:
		return warp_generation[linear(t.tid) / 32] != t.gen;
	default:
		return true;
	}
}

void trampoline() {
	block_body(block_params);
	thread& t = threads[current];
	t.done = true;
	live--;
	unsigned w = linear(t.tid) / 32;
	warp_live[w]--;
	release_block_if_complete();
	release_warp_if_complete(w);
	coro_switch(t.ctx, scheduler); // never resumed
}

// run_block runs one block to completion; false if it deadlocked.
bool run_block() {
	unsigned n = blockDim.x * blockDim.y * blockDim.z;
	unsigned warps = (n + 31) / 32;
	threads.assign(n, thread{});
	while (stacks.size() < n) stacks.push_back(static_cast<char*>(std::malloc(stack_bytes)));
	warp_live.assign(warps, 0);
	warp_arrived.assign(warps, 0);
	warp_generation.assign(warps, 0);
	warp_slots.assign(warps * 64, 0.0f);
	for (unsigned i = 0; i < n; i++) {
		thread& t = threads[i];
		t.tid = {i % blockDim.x, (i / blockDim.x) % blockDim.y, i / (blockDim.x * blockDim.y)};
		coro_init(t.ctx, stacks[i], stack_bytes, trampoline);
		warp_live[i / 32]++;
	}
	live = n;
	arrived = 0;
	generation = 0;
	for (long round = 0; live > 0; round++) {
		if (round > max_rounds) return false;
		for (unsigned i = 0; i < n; i++) {
			if (threads[i].done || !released(threads[i])) continue;
			threads[i].wait = running;
			current = i;
			threadIdx = threads[i].tid;
			coro_switch(scheduler, threads[i].ctx);
		}
	}
	return true;
}

// ---- kernel parameters: 8 bytes each, from the launch's uint64 array ----

template <typename T>
T from_u64(uint64_t v) {
	static_assert(sizeof(T) == 8, "a kernel parameter is not 8 bytes: Function.Launch copies 8 bytes per parameter");
	if constexpr (std::is_pointer_v<T>) {
		return reinterpret_cast<T>(static_cast<uintptr_t>(v));
	} else if constexpr (std::is_same_v<T, double>) {
		double d;
		std::memcpy(&d, &v, sizeof d);
		return d;
	} else {
		return static_cast<T>(v);
	}
}

template <typename... A, size_t... I>
void invoke(void (*f)(A...), const uint64_t* p, std::index_sequence<I...>) {
	f(from_u64<A>(p[I])...);
}

struct entry {
	const char* name;
	int arity;
	void (*body)(const uint64_t*);
};

template <auto F>
struct bind;
template <typename... A, void (*F)(A...)>
struct bind<F> {
	static void body(const uint64_t* p) { invoke(F, p, std::index_sequence_for<A...>{}); }
	static constexpr int arity = sizeof...(A);
};

#define KERNEL(f) entry{#f, bind<f>::arity, bind<f>::body}
const entry kernels[] = {
	KERNEL(embed),   KERNEL(rmsnorm),   KERNEL(matvec),        KERNEL(matmul),
	KERNEL(rope),    KERNEL(store_kv),  KERNEL(attention),     KERNEL(swiglu),
	KERNEL(scatter_pages), KERNEL(gather_pages),
};
constexpr int num_kernels = sizeof kernels / sizeof kernels[0];

std::map<uintptr_t, size_t> allocations;

// inside: [p, p+n) lies in one allocation.
bool inside(uintptr_t p, size_t n) {
	auto it = allocations.upper_bound(p);
	if (it == allocations.begin()) return false;
	--it;
	return p >= it->first && p + n <= it->first + it->second && p + n >= p;
}

} // namespace

extern "C" {

int emu_kernel(const char* name) {
	for (int i = 0; i < num_kernels; i++)
		if (std::strcmp(kernels[i].name, name) == 0) return i;
	return -1;
}

uint64_t emu_alloc(size_t n) {
	// Exactly n bytes (aligned like cuMemAlloc's), so that under -asan a kernel's access past
	// an allocation is reported.
	void* p = nullptr;
	if (n == 0 || posix_memalign(&p, 256, n) != 0) return 0;
	// Fresh device memory holds garbage; make it loud garbage (NaN) rather than zeros, so a
	// read of something never written shows.
	std::memset(p, 0xFF, n);
	allocations[reinterpret_cast<uintptr_t>(p)] = n;
	return reinterpret_cast<uintptr_t>(p);
}

int emu_free(uint64_t p) {
	auto it = allocations.find(p);
	if (it == allocations.end()) return -1;
	allocations.erase(it);
	std::free(reinterpret_cast<void*>(p));
	return 0;
}

int emu_htod(uint64_t dst, const void* src, size_t n) {
	if (!inside(dst, n)) return -1;
	std::memcpy(reinterpret_cast<void*>(dst), src, n);
	return 0;
}

int emu_dtoh(void* dst, uint64_t src, size_t n) {
	if (!inside(src, n)) return -1;
	std::memcpy(dst, reinterpret_cast<const void*>(src), n);
	return 0;
}

int emu_dtod(uint64_t dst, uint64_t src, size_t n) {
	if (!inside(dst, n) || !inside(src, n)) return -1;
	std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
	return 0;
}

// emu_launch: 0 ok; -1 unknown kernel; -2 wrong parameter count; -3 bad shape; -4 deadlock.
int emu_launch(int k, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
               const uint64_t* params, int n) {
	if (k < 0 || k >= num_kernels) return -1;
	if (n != kernels[k].arity) return -2;
	if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || bx * by * bz > max_threads ||
	    gy > 65535 || gz > 65535)
		return -3;
	std::vector<uint64_t> copy(params, params + n);
	block_body = kernels[k].body;
	block_params = copy.data();
	gridDim = {gx, gy, gz};
	blockDim = {bx, by, bz};
	for (unsigned z = 0; z < gz; z++)
		for (unsigned y = 0; y < gy; y++)
			for (unsigned x = 0; x < gx; x++) {
				blockIdx = {x, y, z};
				if (!run_block()) return -4;
			}
	return 0;
}

} // extern "C"

static void __syncthreads() {
	unsigned long g = generation;
	arrived++;
	release_block_if_complete();
	if (generation != g) return;
	threads[current].wait = at_block_barrier;
	threads[current].gen = g;
	yield();
}

// A shuffle is one warp barrier: lanes write their value into the buffer of this shuffle's
// parity and read after the barrier. A lane cannot reach the next shuffle of the same parity
// (and overwrite the buffer) before every lane has passed the shuffle in between.
static float __shfl_down_sync(unsigned, float v, int delta) {
	unsigned id = linear(threads[current].tid), w = id / 32, lane = id % 32;
	float* slots = &warp_slots[w * 64 + 32 * (warp_generation[w] & 1)];
	slots[lane] = v;
	warp_barrier(w);
	unsigned src = lane + delta;
	unsigned n = blockDim.x * blockDim.y * blockDim.z;
	return (src < 32 && w * 32 + src < n) ? slots[src] : v;
}
