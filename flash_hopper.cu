// flash_hopper.cu: chapter 3, the forward on Hopper's own instructions (NOTES.md section 17).
// FlashAttention-2's Algorithm 1 as chapter 2 runs it, with its two products on wgmma: a warpgroup
// (4 warps, 128 threads) multiplies a 64-row tile at once, its operands read from shared memory
// through 64-bit descriptors (or, for P~, from registers), asynchronously. The tiles arrive by the
// tensor memory accelerator (TMA), which one producer thread drives while the consumer warpgroups
// compute (warp specialisation; setmaxnreg moves registers to the consumers); mbarriers say when
// a stage is full and when it is free again. Each tile's softmax runs while the previous tile's
// O_i += P~ V_j is on the tensor cores. The grid is persistent: a block an SM, each taking tile
// after tile from a counter. Head dims: kFlashHopperHeadDims (flash.h); fp16 and bf16; compute
// capability 9.0 only. Not here: FlashAttention-3's O written by TMA, its ping-pong (slower here, NOTES.md section 17),
// its fp8.
//
// Build: wgmma exists only in the sm_90a target, so this file alone is compiled with
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -c flash_hopper.cu
// (the Makefile does it). Every helper below wraps one PTX instruction (load_tile: a tile's TMA
// copies), its PTX ISA section named beside it ("wgmma" is "Asynchronous Warpgroup Level Matrix
// Multiply-Accumulate").
#include "checks.h"
#include "flash.h"
#include "log2_units.h"

#include <cuda.h>          // CUtensorMap and its enums (types only: nothing links libcuda)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled_v12000
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

// Built for anything but sm_90a the kernel must not run silently empty: it traps (and the
// launcher refuses every GPU but compute capability 9.0 before that).
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HOPPER_ONLY(...) __trap()
#else
#define HOPPER_ONLY(...) __VA_ARGS__
#endif

constexpr int kWarpgroup = 128;  // threads in a warpgroup: 4 warps, which issue a wgmma together
constexpr int kRowBytes = 128;   // bytes of a swizzled row: 64 fp16 or bf16 elements (below)
// Consumer warpgroups, 64 rows of Q_i each (Br = 64 C): two, but three at d = 64, where a tile's
// products are short beside its softmax. Registers a thread, set with setmaxnreg: 65536 shared
// by the block's 128 (C + 1) threads, the producer keeping few.
__host__ __device__ constexpr int hopper_C(int head_dim) { return head_dim == 64 ? 3 : 2; }
__host__ __device__ constexpr int hopper_Br(int head_dim) { return 64 * hopper_C(head_dim); }
__host__ __device__ constexpr int producer_regs(int C) { return C == 2 ? 24 : 32; }
__host__ __device__ constexpr int consumer_regs(int C) { return C == 2 ? 240 : 160; }
// The threads that meet at named barrier 1 as a tile starts: the producer's first warp, which has
// fetched the tile's number, and the consumers, which take it.
__host__ __device__ constexpr int handout_threads(int C) { return 32 + kWarpgroup * C; }
// Keys a K/V tile: 128, but 48 at d = 256, where a consumer thread holds 128 floats of O_i and a
// K/V tile of 128 keys is 128 KiB.
__host__ __device__ constexpr int hopper_Bc(int head_dim) { return head_dim == 256 ? 48 : 128; }
// The pipeline's stages, K/V tiles in shared memory at once (227 KiB an SM): three, the same at
// every head dim (208 KiB with Q_i at d = 256; tiles of 64 keys there would leave room for two
// only, and two stages ran 17-32% slower: NOTES.md section 17). A function of the head dim all
// the same, as Br and Bc are, so that one head dim can be given its own count.
__host__ __device__ constexpr int hopper_stages(int /* head_dim: the same at all */) { return 3; }
// The grid: persistent, one block an SM looping over the tiles. -DHOPPER_PERSISTENT=0 gives every
// tile its own block instead, to measure what the persistent grid buys.
#ifndef HOPPER_PERSISTENT
#define HOPPER_PERSISTENT 1
#endif
constexpr bool kPersistent = HOPPER_PERSISTENT;
constexpr int kHopperHeadGroup = 16;                   // heads whose Q tiles go together (line 3)

// ---------------------------------------------------------------------------------------------
// Shared memory: the 128-byte swizzle. wgmma reads a tile as blocks of 64 columns of 16-bit
// elements (128 bytes a row), rows one after another, and in each row the 16-byte chunk c sits at
// chunk c ^ (row % 8): 8 rows that a read touches at one chunk then fall in 8 different banks.
// (Picture: NOTES.md section 17.) The swizzle works on address bits, so tiles start 1024-aligned.

// The tensor memory accelerator (TMA) writes that layout itself: a tensor map (made on the host,
// below) names the tensor and the box it copies, with the 128-byte swizzle, and rows past the
// tensor's end arrive as zeros. One thread issues a copy; it completes on an mbarrier, a 64-bit
// barrier in shared memory that counts arrivals and bytes (PTX ISA, "Parallel Synchronization and
// Communication Instructions: mbarrier"). Each use of a barrier is a phase; waiters name the
// phase's parity (0, 1, 0, ...).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return uint32_t(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int arrivals) {  // mbarrier.init
    HOPPER_ONLY(asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)),
                             "r"(arrivals)));
}
// mbarrier.arrive.expect_tx: one arrival, and `bytes` more to come from copies before the phase
// completes.
__device__ __forceinline__ void mbar_expect_bytes(uint64_t* bar, uint32_t bytes) {
    HOPPER_ONLY(asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                                 smem_addr(bar)), "r"(bytes) : "memory"));
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {  // mbarrier.try_wait.parity
    uint32_t done = 0;
    while (!done)
        HOPPER_ONLY(asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, "
                                 "[%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n" : "=r"(done)
                                 : "r"(smem_addr(bar)), "r"(parity) : "memory"));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {  // mbarrier.arrive: one arrival
    HOPPER_ONLY(asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar))
                             : "memory"));
}
// cp.async.bulk.tensor (PTX ISA, "Data Movement: cp.async.bulk.tensor"): the box of the tensor map
// at (column, row, head) to shared memory, its bytes counted on bar. The map is a __grid_constant__
// kernel parameter, named by its generic address.
__device__ __forceinline__ void tma_load(void* to, const CUtensorMap& map, int col, int row,
                                         int head, uint64_t* bar) {
    HOPPER_ONLY(asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(smem_addr(to)),
        "l"(reinterpret_cast<uint64_t>(&map)), "r"(col), "r"(row), "r"(head), "r"(smem_addr(bar))
        : "memory"));
}
// Rows [first, first + R) of one head's (len x D) matrix as blocks of 64 columns (R x 128 bytes
// each), D / 64 copies on bar.
template <int R, int D, typename T>
__device__ __forceinline__ void load_tile(T* to, const CUtensorMap& map, int first, int head,
                                          uint64_t* bar) {
#pragma unroll
    for (int c = 0; c < D / 64; c++) tma_load(to + c * R * 64, map, c * 64, first, head, bar);
}

// setmaxnreg (PTX ISA, "Miscellaneous Instructions: setmaxnreg"): a warpgroup gives back registers
// (inc = false) or takes them (true) up to R a thread. The block starts with 65536 / its threads
// (168 a thread with C = 2, 128 with C = 3) and the sums stay within 65536.
template <bool Inc, int R>
__device__ __forceinline__ void setmaxnreg() {
    if constexpr (Inc) HOPPER_ONLY(asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R)));
    else HOPPER_ONLY(asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R)));
}

// barrier.sync (PTX ISA, "Parallel Synchronization: bar, barrier"): named barrier `id` of `threads`
// threads (whole warps), which waits until all of them have reached it, as __syncthreads does for
// all. Not .aligned (bar.sync is): the producer's lanes may reach it apart (lane 0 issues copies).
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// A shared-memory matrix descriptor (wgmma, "Matrix Descriptor Format"): the start address, the
// leading and stride byte offsets (each >> 4) and the swizzle mode (1: 128 bytes). sbo: from one
// group of 8 rows to the next, 1024 bytes. lbo: for an operand read transposed (V_j), from one
// block of 64 columns to the next; K-major operands (Q_i, K_j) ignore it, and step through k by
// moving the start 32 bytes (16 elements) along the row.
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo) {
    const uint32_t a = smem_addr(p);
    return uint64_t((a & 0x3FFFF) >> 4) | uint64_t(lbo >> 4) << 16 | uint64_t(1024 >> 4) << 32 |
           uint64_t(1) << 62;
}
// wgmma.fence: registers written before it (accumulators, A) are what the next wgmma reads.
// wgmma.commit_group: closes the batch of wgmmas issued.
__device__ __forceinline__ void wgmma_fence() {
    HOPPER_ONLY(asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"));
}
__device__ __forceinline__ void wgmma_commit() {
    HOPPER_ONLY(asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"));
}
// wgmma.wait_group: until at most Pending of the latest batches run. Then the accumulators r
// are final, and an empty asm that claims to write them keeps the compiler from reading them
// before the wait, as it would for registers no instruction it knows of is still writing.
template <int Pending, int N>
__device__ __forceinline__ void wgmma_wait(float (&r)[N]) {
    HOPPER_ONLY(asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory"));
#pragma unroll
    for (int x = 0; x < N; x++) asm volatile("" : "+f"(r[x])::"memory");
}

// wgmma.mma_async m64nNk16 with fp32 accumulators d (N / 2 a thread, laid out as mma.m16n8's, a
// warp's 16 rows each). SS: A and B in shared memory, both K-major (S = Q_i K_j^T). RS: A in
// registers as mma.m16n8k16's A fragment (P~), B in shared memory read transposed (imm-trans-b 1:
// V_j is stored keys x columns).
#define ACC8(b) "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), \
                "+f"(d[b + 5]), "+f"(d[b + 6]), "+f"(d[b + 7])
#define ACC24 ACC8(0), ACC8(8), ACC8(16)
#define ACC32 ACC8(0), ACC8(8), ACC8(16), ACC8(24)
#define ACC64 ACC32, ACC8(32), ACC8(40), ACC8(48), ACC8(56)
#define REGS24 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21," \
               "%22,%23}"
#define REGS32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21," \
               "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define REGS64 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21," \
               "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41," \
               "%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61," \
               "%62,%63}"
#define AB32 "{%32,%33,%34,%35}, %36"  // RS: A's 4 registers, B's descriptor
#define AB64 "{%64,%65,%66,%67}, %68"
#define WGMMA_SS(N, REGS, ACC, AB, TY)                                                          \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", " AB    \
                 ", 1, 1, 1, 0, 0;\n" : ACC : "l"(a), "l"(b))
#define WGMMA_RS(N, REGS, ACC, AB, TY)                                                          \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", " AB    \
                 ", 1, 1, 1, 1;\n" : ACC : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float* d, uint64_t a, uint64_t b) {
    static_assert(N == 48 || N == 64 || N == 128, "wgmma_ss is written for N = 48, 64, 128");
    constexpr bool h = std::is_same<T, __half>::value;
    if constexpr (N == 48 && h) HOPPER_ONLY(WGMMA_SS(48, REGS24, ACC24, "%24, %25", "f16"));
    if constexpr (N == 48 && !h) HOPPER_ONLY(WGMMA_SS(48, REGS24, ACC24, "%24, %25", "bf16"));
    if constexpr (N == 64 && h) HOPPER_ONLY(WGMMA_SS(64, REGS32, ACC32, "%32, %33", "f16"));
    if constexpr (N == 64 && !h) HOPPER_ONLY(WGMMA_SS(64, REGS32, ACC32, "%32, %33", "bf16"));
    if constexpr (N == 128 && h) HOPPER_ONLY(WGMMA_SS(128, REGS64, ACC64, "%64, %65", "f16"));
    if constexpr (N == 128 && !h) HOPPER_ONLY(WGMMA_SS(128, REGS64, ACC64, "%64, %65", "bf16"));
}
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t* a, uint64_t b) {
    static_assert(N == 64 || N == 128, "wgmma_rs is written for N = 64, 128");
    constexpr bool h = std::is_same<T, __half>::value;
    if constexpr (N == 64 && h) HOPPER_ONLY(WGMMA_RS(64, REGS32, ACC32, AB32, "f16"));
    if constexpr (N == 64 && !h) HOPPER_ONLY(WGMMA_RS(64, REGS32, ACC32, AB32, "bf16"));
    if constexpr (N == 128 && h) HOPPER_ONLY(WGMMA_RS(128, REGS64, ACC64, AB64, "f16"));
    if constexpr (N == 128 && !h) HOPPER_ONLY(WGMMA_RS(128, REGS64, ACC64, AB64, "bf16"));
}
#undef ACC8
#undef ACC24
#undef ACC32
#undef ACC64
#undef REGS24
#undef REGS32
#undef REGS64
#undef AB32
#undef AB64
#undef WGMMA_SS
#undef WGMMA_RS
// Two floats as one 32-bit register of T pair, the A fragment's element pairs.
template <typename T>
__device__ __forceinline__ uint32_t pair_bits(float a, float b) {
    uint32_t bits;
    if constexpr (std::is_same<T, __half>::value) {
        const __half2 p = __floats2half2_rn(a, b);
        bits = *reinterpret_cast<const uint32_t*>(&p);
    } else {
        const __nv_bfloat162 p = __floats2bfloat162_rn(a, b);
        bits = *reinterpret_cast<const uint32_t*>(&p);
    }
    return bits;
}

// ---------------------------------------------------------------------------------------------
// The kernel. A persistent grid, one block an SM, each block running tiles (Q tile i, batch*head)
// one after another: its first is blockIdx.x, then whichever the counter `next` hands out as it
// nears the end of one (dynamic, so that long causal tiles and short ones even out), and the next
// tile's Q_i and first K/V tiles load while the last one's O_i is written. C + 1 warpgroups:
// warpgroup 0 is the producer (its first warp fetches tile numbers, one thread issues every TMA
// copy), warpgroups 1..C the consumers, 64 rows of Q_i each (Br = 64 C). K/V tiles of Bc keys in
// S stages, each with two mbarriers: full (the copy engine's bytes are in) and empty (the 4 C
// consumer warps are done reading it); Q_i has a pair too. A consumer thread's accumulator element
// 4n + 2h + e is row 16 warp + g + 8h of its warpgroup's 64, column 8n + 2t + e (lane = 4g + t),
// as in chapter 2.
template <typename T, int D, int Bc, int C>
__global__ void __launch_bounds__(kWarpgroup * (C + 1), 1)
flash_forward_hopper_kernel(const __grid_constant__ CUtensorMap Q,
                            const __grid_constant__ CUtensorMap K,
                            const __grid_constant__ CUtensorMap V, T* __restrict__ O,
                            float* __restrict__ L, int q_len, int kv_len, bool causal, int Tr,
                            int tiles, int HG, float scale_log2, int* next) {
    constexpr int Br = 64 * C, S = hopper_stages(D);
    extern __shared__ __align__(16) unsigned char shared[];
    // Q_i (Br rows), then the stages of K_j and V_j (Bc rows each), each as blocks of 64 columns,
    // all 1024-byte aligned; after them the mbarriers: full[s] and empty[s] of stage s, full[S]
    // and empty[S] for Q_i; then the tile numbers.
    T* Q_i = reinterpret_cast<T*>(shared + (1024 - smem_addr(shared) % 1024) % 1024);
    T* KV = Q_i + Br * D;
    uint64_t *full = reinterpret_cast<uint64_t*>(KV + S * 2 * Bc * D), *empty = full + S + 1;
    int* work = reinterpret_cast<int*>(empty + S + 1);  // tile numbers, for rounds r % 2
    // Line 3: tile b -> (Q tile i, head bh) and its K/V tiles Tc, as chapter 2: heads in groups of
    // HG, each group's Q tiles longest (causal) first, its heads taking turns.
    const auto tile = [&](int b) {                     // -> {i, bh, Tc}
        const int head0 = b / (HG * Tr) * HG, heads = min(HG, tiles / Tr - head0);
        const int i = Tr - 1 - b % (HG * Tr) / heads;
        return int3{i, head0 + b % (HG * Tr) % heads,
                    (flash_kv_end(i * Br, Br, q_len, kv_len, causal) + Bc - 1) / Bc};
    };
    if (threadIdx.x == 0) {
        for (int s = 0; s <= S; s++) mbar_init(&full[s], 1), mbar_init(&empty[s], 4 * C);
        // fence.mbarrier_init: the initialised barriers are seen by the TMA's completions too.
        HOPPER_ONLY(asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"));
    }
    __syncthreads();
    if (threadIdx.x < kWarpgroup) {                    // the producer: lines 4 and 7
        setmaxnreg<false, producer_regs(C)>();         // it needs few registers; the math, many
        if (threadIdx.x >= 32) return;                 // warp 0 runs the loop, lane 0 the copies
        const bool one = threadIdx.x == 0;
        int x = 0;                                     // K/V tiles loaded, over all of the block's
        for (int r = 0, b = blockIdx.x;; r++) {
            if (one) work[r % 2] = b;                  // tile b (past the end: none left) is next
            if (b >= tiles) break;
            const auto [i, bh, Tc] = tile(b);
            if (r > 0) mbar_wait(&empty[S], (r - 1) % 2);  // the last Q_i is read
            if (one) mbar_expect_bytes(&full[S], Br * D * sizeof(T));  // line 4: load Q_i
            if (one) load_tile<Br, D>(Q_i, Q, i * Br, bh, &full[S]);
            for (int j = 0; j < Tc; j++, x++) {        // line 7: K_j, V_j, once tile x - S is read
                if (j == S) named_barrier(1, handout_threads(C));  // the consumers start tile b
                if (x >= S) mbar_wait(&empty[x % S], (x / S - 1) % 2);
                if (!one) continue;
                mbar_expect_bytes(&full[x % S], 2 * Bc * D * sizeof(T));
                load_tile<Bc, D>(KV + x % S * 2 * Bc * D, K, j * Bc, bh, &full[x % S]);
                load_tile<Bc, D>(KV + (x % S * 2 + 1) * Bc * D, V, j * Bc, bh, &full[x % S]);
            }
            if (Tc <= S) named_barrier(1, handout_threads(C));  // (all of its tiles issued)
            b = __shfl_sync(0xffffffffu, one ? atomicAdd(next, 1) + int(gridDim.x) : 0, 0);
        }
        named_barrier(1, handout_threads(C));         // the consumers learn that none is left
        // It leaves once the last tiles it filled are read (a producer that returned at once left
        // blocks that never finished under compute-sanitizer's racecheck).
        for (int y = max(x - S, 0); y < x; y++) mbar_wait(&empty[y % S], y / S % 2);
        return;
    }
    setmaxnreg<true, consumer_regs(C)>();
    const int wg = threadIdx.x / kWarpgroup - 1;       // which consumer, 0 .. C - 1
    const int warp = threadIdx.x % kWarpgroup / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    // The warpgroup's 64 rows of Q_i: in each 64-column block, after wg times 64 rows of 64.
    const char* Q_w = reinterpret_cast<const char*>(Q_i + wg * 64 * 64);
    uint32_t P[Bc / 16][4];                            // P~ of the last tile, in T, as A
    const auto K_of = [&](int x) {                     // K/V tile x's stage: K, then V
        return reinterpret_cast<const char*>(KV + x % S * 2 * Bc * D);
    };
    int x0 = 0;                                        // K/V tiles read before this Q tile's
    for (int r = 0;; r++) {
        named_barrier(1, handout_threads(C));          // the producer has written work[r % 2]
        const int b = work[r % 2];
        if (b >= tiles) break;
        const auto [i, bh, Tc] = tile(b);
        mbar_wait(&full[S], r % 2);                    // Q_i is in
        const int query = i * Br + 64 * wg + 16 * warp + g;  // this thread's rows: query + 8h
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, O_i[D / 2] = {};  // line 5
        const auto add_PV = [&](int x) {               // line 10's product: O_i += P~ V_j
            const char* V_j = K_of(x) + Bc * D * sizeof(T);
            constexpr int N = D < 128 ? D : 128;       // columns a wgmma (d = 256: two halves)
#pragma unroll
            for (int k = 0; k < Bc / 16; k++)
#pragma unroll
                for (int c = 0; c < D / N; c++)
                    wgmma_rs<T, N>(O_i + c * N / 2, P[k],
                                   smem_desc(V_j + (c * N / 64 * Bc + k * 16) * kRowBytes,
                                             Bc * kRowBytes));
            wgmma_commit();
        };
        for (int j = 0, x = x0; j < Tc; j++, x++) {   // line 6: for each K_j, V_j (x: its stage)
            mbar_wait(&full[x % S], x / S % 2);        // tile j is in
            float S_ij[Bc / 2] = {}, alpha[2];         // line 8: S_ij = Q_i K_j^T, 16 of d a step
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < D / 16; k++)
                wgmma_ss<T, Bc>(S_ij, smem_desc(Q_w + k / 4 * Br * kRowBytes + k % 4 * 32, 0),
                                smem_desc(K_of(x) + k / 4 * Bc * kRowBytes + k % 4 * 32, 0));
            wgmma_commit();
            // Line 10 of the tile before, O_i += P~ V_{j-1}, runs while this tile's softmax does.
            if (j > 0) add_PV(x - 1);
            j > 0 ? wgmma_wait<1>(S_ij) : wgmma_wait<0>(S_ij);  // S_ij done (P~ V_{j-1} may not be)
#pragma unroll
            for (int h = 0; h < 2; h++) {              // line 9 for row query + 8h
                const int last = causal ? flash_last_key(query + 8 * h, q_len, kv_len) : kv_len - 1;
                // Element n / 2 * 4 + 2h + n % 2 is key j Bc + 2t + 8 (n / 2) + n % 2: masked
                // past min(last, kv_len - 1), only in a tile that reaches past it (a branch, not
                // a select on every element: NOTES.md section 17). Bc - 7 = 8 (Bc / 8 - 1) + 1 is
                // this thread's last key offset in the tile.
                const int lim = min(last, kv_len - 1) - j * Bc - 2 * t;
                if (lim < Bc - 7)
#pragma unroll
                    for (int n = 0; n < Bc / 4; n++)
                        if (8 * (n / 2) + n % 2 > lim) S_ij[n / 2 * 4 + 2 * h + n % 2] = -INFINITY;
                float m_new = m[h];
#pragma unroll
                for (int n = 0; n < Bc / 4; n++)       // the row's max, over its keys here
                    m_new = fmaxf(m_new, S_ij[n / 2 * 4 + 2 * h + n % 2]);
                m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, 1));  // over the quad
                m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, 2));
                const float m_log2 = m_new == -INFINITY ? 0.f : m_new * scale_log2;  // no key yet
                alpha[h] = exp2_ftz(m[h] * scale_log2 - m_log2);
                m[h] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < Bc / 4; n++) {     // P~_ij = exp(S_ij - m), in S's registers
                    float& s = S_ij[n / 2 * 4 + 2 * h + n % 2];
                    s = exp2_ftz(fmaf(s, scale_log2, -m_log2));
                    sum += s;
                }
                l[h] = l[h] * alpha[h] + sum;
            }
            wgmma_wait<0>(O_i);                        // O_i += P~ V_{j-1} is done
            if (j > 0 && threadIdx.x % 32 == 0) mbar_arrive(&empty[(x - 1) % S]);  // V_{j-1} read
#pragma unroll
            for (int n = 0; n < D / 2; n++) O_i[n] *= alpha[n % 4 / 2];  // n's row: 8 (n % 4 / 2)
#pragma unroll
            for (int k = 0; k < Bc / 16; k++)          // line 10's P~, in T as A, for next time
#pragma unroll
                for (int y = 0; y < 4; y++)
                    P[k][y] = pair_bits<T>(S_ij[8 * k + 2 * y], S_ij[8 * k + 2 * y + 1]);
        }
        if (threadIdx.x % 32 == 0) mbar_arrive(&empty[S]);  // Q_i read: the next one may load
        x0 += Tc;
        if (Tc > 0) {                                  // line 10 of the last tile
            wgmma_fence();
            add_PV(x0 - 1);
            wgmma_wait<0>(O_i);
            if (threadIdx.x % 32 == 0) mbar_arrive(&empty[(x0 - 1) % S]);
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {                  // lines 12-13: O_i / l, L = m + log l
            const int row = query + 8 * h;
            float l_row = l[h] + __shfl_xor_sync(0xffffffffu, l[h], 1);
            l_row += __shfl_xor_sync(0xffffffffu, l_row, 2);
            if (row >= q_len) continue;
            const float inv = l_row > 0.f ? 1.f / l_row : 0.f;  // a row that sees no key: O = 0
#pragma unroll
            for (int n = 0; n < D / 8; n++)
                *reinterpret_cast<uint32_t*>(O + (size_t(bh) * q_len + row) * D + 8 * n + 2 * t) =
                    pair_bits<T>(O_i[4 * n + 2 * h] * inv, O_i[4 * n + 2 * h + 1] * inv);
            const float L_row = l_row > 0.f ? (m[h] * scale_log2 + log2f(l_row)) * kLn2 : -INFINITY;
            if (t == 0) L[size_t(bh) * q_len + row] = L_row;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The launcher: chapter 2's checks, then compute capability 9.0.
// Q_i, the stages of K_j and V_j (2 bytes an element), alignment, 2 (S + 1) mbarriers and two
// tile numbers.
static constexpr size_t flash_hopper_shared_bytes(int d) {
    return size_t(hopper_Br(d) + 2 * hopper_stages(d) * hopper_Bc(d)) * d * 2 + 1024 +
           8 * (2 * hopper_stages(d) + 3);
}
// The budgets, checked where they are set, at every head dim of kFlashHopperHeadDims. Shared
// memory: 227 KiB a block on an H100 or H200. Registers: setmaxnreg takes multiples of 8 from 24
// to 256, and the block's 128 (C + 1) threads share the SM's 65536.
constexpr bool registers_fit(int C) {
    return producer_regs(C) % 8 == 0 && consumer_regs(C) % 8 == 0 && producer_regs(C) >= 24 &&
           consumer_regs(C) <= 256 &&
           kWarpgroup * (producer_regs(C) + C * consumer_regs(C)) <= 65536;
}
constexpr bool every_head_dim(bool (*fits)(int)) {
    for (const int d : kFlashHopperHeadDims)
        if (!fits(d)) return false;
    return true;
}
static_assert(every_head_dim([](int d) { return flash_hopper_shared_bytes(d) <= 227 * 1024; }),
              "a block past 227 KiB");
static_assert(every_head_dim([](int d) { return registers_fit(hopper_C(d)); }),
              "setmaxnreg's registers past the SM's 65536");

// The tensor map of Q, K or V, (heads, len, D) elements of T, for boxes of rows x 64 elements in
// the 128-byte swizzle; rows past len are read as zeros. cuTensorMapEncodeTiled is a driver call,
// found through the runtime, so that nothing links libcuda (CI machines have none).
template <typename T>
static CUtensorMap tensor_map(const T* base, size_t heads, int len, int D, int rows) {
    static const auto encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found;
        FLASH_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                          cudaEnableDefault, &found));
        if (found != cudaDriverEntryPointSuccess || fn == nullptr)
            throw std::runtime_error("the CUDA driver has no cuTensorMapEncodeTiled (CUDA 12+)");
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }();
    CUtensorMap map;
    const cuuint64_t dims[3] = {cuuint64_t(D), cuuint64_t(len), heads};
    const cuuint64_t strides[2] = {D * sizeof(T), size_t(len) * D * sizeof(T)};  // bytes
    const cuuint32_t box[3] = {64, cuuint32_t(rows), 1}, steps[3] = {1, 1, 1};
    const CUresult r = encode(
        &map, std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                             : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        3, const_cast<T*>(base), dims, strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        throw std::runtime_error("cuTensorMapEncodeTiled failed: CUresult " + std::to_string(r));
    return map;
}

// The launch alone (checks.h: flash_forward_hopper_launch), for callers that have run every check.
template <typename T>
static void launch_forward_hopper(const T* Q, const T* K, const T* V, T* O, float* L,
                                  const AttentionShape& s, cudaStream_t stream) {
    dispatch_head_dim<kFlashHopperHeadDims>(s.head_dim, [&](auto dim) {
        constexpr int D = decltype(dim)::value, Br = hopper_Br(D), Bc = hopper_Bc(D);
        constexpr size_t bytes = flash_hopper_shared_bytes(D);
        const int tiles = grid_blocks(s, s.q_len, Br, "q_len");  // Q tiles of all heads
        const auto kernel = flash_forward_hopper_kernel<T, D, Bc, hopper_C(D)>;
        allow_shared(kernel, bytes);
        const size_t heads = size_t(s.batch) * s.heads;
        const CUtensorMap Qm = tensor_map(Q, heads, s.q_len, D, Br),
                          Km = tensor_map(K, heads, s.kv_len, D, Bc),
                          Vm = tensor_map(V, heads, s.kv_len, D, Bc);
        const int blocks = kPersistent ? std::min(tiles, flash_device_props().multiProcessorCount)
                                       : tiles;
        with_scratch(sizeof(int), stream, [&](void* next) {  // the next tile to hand out
            cudaError_t err = cudaMemsetAsync(next, 0, sizeof(int), stream);  // the int 0
            if (err != cudaSuccess) return err;
            kernel<<<blocks, kWarpgroup * (hopper_C(D) + 1), bytes, stream>>>(
                Qm, Km, Vm, O, L, s.q_len, s.kv_len, s.causal, (s.q_len + Br - 1) / Br, tiles,
                kHopperHeadGroup, scale_log2_for(D), static_cast<int*>(next));
            return cudaGetLastError();
        });
    });
}

void flash_forward_hopper_launch(const __half* Q, const __half* K, const __half* V, __half* O,
                                 float* L, const AttentionShape& s, cudaStream_t stream) {
    launch_forward_hopper(Q, K, V, O, L, s, stream);
}
void flash_forward_hopper_launch(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                                 const __nv_bfloat16* V, __nv_bfloat16* O, float* L,
                                 const AttentionShape& s, cudaStream_t stream) {
    launch_forward_hopper(Q, K, V, O, L, s, stream);
}

template <typename T>
static void forward_hopper_checked(const char* fn, const T* Q, const T* K, const T* V, T* O,
                                   float* L, const AttentionShape& s, cudaStream_t stream) {
    validate_shape(s, kFlashHopperHeadDims, sizeof(T));
    validate_forward_pointers(fn, Q, K, V, O, L, s);
    const cudaDeviceProp prop = flash_device_props();
    if (prop.major != 9)
        throw std::runtime_error(std::string(fn) + " needs a GPU of compute capability 9.0 (wgmma, "
                                 "sm_90a: H100, H200); " + prop.name + " is " +
                                 std::to_string(prop.major) + "." + std::to_string(prop.minor));
    launch_forward_hopper(Q, K, V, O, L, s, stream);
}

void flash_forward_fp16_hopper(const __half* Q, const __half* K, const __half* V, __half* O,
                               float* L, const AttentionShape& shape, cudaStream_t stream) {
    forward_hopper_checked("flash_forward_fp16_hopper", Q, K, V, O, L, shape, stream);
}

void flash_forward_bf16_hopper(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                               const __nv_bfloat16* V, __nv_bfloat16* O, float* L,
                               const AttentionShape& shape, cudaStream_t stream) {
    forward_hopper_checked("flash_forward_bf16_hopper", Q, K, V, O, L, shape, stream);
}
