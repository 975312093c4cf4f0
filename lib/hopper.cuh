// hopper.cuh: chapter 3's helpers, shared by its forward (flash_hopper.cu) and its backward
// (flash_hopper_backward.cu): each wraps one PTX instruction (load_tile: a tile's TMA copies), its
// PTX ISA section named beside it ("wgmma" is "Asynchronous Warpgroup Level Matrix
// Multiply-Accumulate"), plus the pipeline's (stage, phase) state and the host's tensor maps.
// Compiled only into files built for sm_90a (the Makefile's HAVE_SM90A).
#pragma once

#include "checks.h"
#include "fragments.cuh"

#include <cuda.h>          // CUtensorMap and its enums (types only: nothing links libcuda)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled_v12000
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <stdexcept>
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

// This thread's warpgroup, taken from lane 0: the same number, but the compiler then knows it is
// the same in every lane, so addresses and wgmma descriptors built from it live in uniform
// registers instead of being copied there before each wgmma (R2UR; NOTES.md section 17).
__device__ __forceinline__ int warpgroup_index() {
    return __shfl_sync(0xffffffffu, int(threadIdx.x / kWarpgroup), 0);
}

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
// A block's shared memory is laid out by a struct (Storage: each chapter-3 kernel's own), its
// tiles alignas(1024). Dynamic shared memory starts only 16-byte aligned, so the struct starts at
// the first 1024-byte boundary in it, and the launcher asks for 1024 bytes more than the struct
// uses (shared_bytes_through, below).
template <typename Storage>
__device__ __forceinline__ Storage& shared_storage() {
    static_assert(alignof(Storage) == 1024, "the swizzled tiles start on 1024-byte boundaries");
    extern __shared__ __align__(16) unsigned char shared[];
    return *reinterpret_cast<Storage*>(shared + (1024 - smem_addr(shared) % 1024) % 1024);
}
// The bytes a launcher asks for: the struct up to the end of its last member, at `end` (sizeof
// would add the padding up to a multiple of 1024), and the 1024 to align its start.
constexpr size_t shared_bytes_through(size_t end) { return end + 1024; }
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
// at (column, row, head, batch) to shared memory, its bytes counted on bar. The map is a
// __grid_constant__ kernel parameter, named by its generic address.
__device__ __forceinline__ void tma_load(void* to, const CUtensorMap& map, int col, int row,
                                         int head, int batch, uint64_t* bar) {
    HOPPER_ONLY(asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(smem_addr(to)),
        "l"(reinterpret_cast<uint64_t>(&map)), "r"(col), "r"(row), "r"(head), "r"(batch),
        "r"(smem_addr(bar))
        : "memory"));
}
// The other way (the backward's dQ): cp.reduce.async.bulk.tensor adds the box at (column, row,
// head, batch) of shared memory into the tensor in global memory, element by element in L2 (fp32
// adds); with add = false, cp.async.bulk.tensor stores it instead. Rows past the tensor's end are
// left alone. The copies a thread issued form a bulk group at bulk_commit; bulk_wait_read<N> waits
// until at most N of its groups still read shared memory (the buffer is free), bulk_wait<N> until
// at most N are incomplete (their writes done).
__device__ __forceinline__ void tma_store(const CUtensorMap& map, const void* from, int col,
                                          int row, int head, int batch, bool add) {
    const uint64_t m = reinterpret_cast<uint64_t>(&map);
    if (add)
        HOPPER_ONLY(asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile"
                                 ".bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(m),
                                 "r"(col), "r"(row), "r"(head), "r"(batch),
                                 "r"(smem_addr(from)) : "memory"));
    else
        HOPPER_ONLY(asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group"
                                 " [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(m), "r"(col),
                                 "r"(row), "r"(head), "r"(batch), "r"(smem_addr(from))
                                 : "memory"));
}
__device__ __forceinline__ void bulk_commit() {
    HOPPER_ONLY(asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"));
}
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    HOPPER_ONLY(asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"));
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
    HOPPER_ONLY(asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"));
}
// fence.proxy.async.global: orders this thread's global memory accesses through the async proxy
// (TMA) with its ordinary ones (generic proxy), both ways: a turn passed after the TMA's adds
// completed, or adds issued after the turn was seen.
__device__ __forceinline__ void fence_proxy_async_global() {
    HOPPER_ONLY(asm volatile("fence.proxy.async.global;\n" ::: "memory"));
}
// Rows [first, first + R) of (head, batch)'s (len x D) matrix as blocks of 128 bytes of columns
// (64 of fp16 or bf16, 128 of fp8; R x 128 bytes each), one copy a block on bar.
template <int R, int D, typename T>
__device__ __forceinline__ void load_tile(T* to, const CUtensorMap& map, int first, int head,
                                          int batch, uint64_t* bar) {
    constexpr int kCols = kRowBytes / sizeof(T);
#pragma unroll
    for (int c = 0; c < D / kCols; c++)
        tma_load(to + c * R * kCols, map, c * kCols, first, head, batch, bar);
}

// setmaxnreg (PTX ISA, "Miscellaneous Instructions: setmaxnreg"): a warpgroup gives back registers
// (inc = false) or takes them (true) up to R a thread, from and to a pool of the block's own. The
// block starts with 65536 / its threads, rounded down to a multiple of 8 (168 a thread with 2
// consumers, 384 threads: 64512 in all; 128 with 3), and the sums must stay within that start, not
// within 65536: an inc that the decs have not paid for waits for ever (a hang).
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
// barrier.arrive: counts the warpgroup in at named barrier `id` and goes on; the other side waits
// for it there with named_barrier (PTX ISA, "bar, barrier": an arrive synchronizes with the sync).
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Ping-pong (FlashAttention-3): two consumer warpgroups take turns to issue a tile's products, so
// that one's softmax runs while the other's products are on the tensor cores (chapter 3 passes the
// turn after S_ij, the fp8 forward after both products: each where it measured best). A turn is a
// named barrier (2: consumer 0's, 3: consumer 1's) that the waiting consumer syncs on and the
// other arrives at. Some placements make ptxas serialize every wgmma of the kernel: consumer 1's
// first arrive inside the consumers' branch (C7520, "WG.AR in divergent path"; so start() runs
// before the roles part), and a pass after a product issued in one path of a branch but placed
// after the branch (C7514, C7515; a pass in each path compiles clean). On = false: no code.
template <bool On>
struct Turns {
    static constexpr int kFirst = 2;                   // named barriers kFirst, kFirst + 1
    __device__ static void start(int wg) {             // wg: -1 for the producer
        if constexpr (On) if (wg == 1) named_arrive(kFirst, 256);
    }
    __device__ static void take(int wg) {
        if constexpr (On) named_barrier(kFirst + wg, 256);
    }
    __device__ static void pass(int wg) {
        if constexpr (On) named_arrive(kFirst + 1 - wg, 256);
    }
};

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
// The descriptor of the matrix `bytes` further on in shared memory: only the start address (bits
// 0-13, in 16-byte units) moves, and shared memory is under 256 KiB, so it never carries into the
// fields above. A loop of wgmmas builds a tile's descriptor once and steps it: one 32-bit add a
// wgmma operand, where smem_desc each time is about five instructions.
__device__ __forceinline__ uint64_t desc_plus(uint64_t desc, uint32_t bytes) {
    return desc >> 32 << 32 | uint32_t(uint32_t(desc) + (bytes >> 4));
}
// wgmma.fence: registers written before it (accumulators, A) are what the next wgmma reads.
// wgmma.commit_group: closes the batch of wgmmas issued.
__device__ __forceinline__ void wgmma_fence() {
    HOPPER_ONLY(asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"));
}
__device__ __forceinline__ void wgmma_commit() {
    HOPPER_ONLY(asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"));
}
// fence.proxy.async.shared::cta (PTX ISA, "Membar/Fence"): shared memory this thread wrote with
// ordinary stores is seen by the async proxy (wgmma, TMA) that reads it after the next barrier.
__device__ __forceinline__ void fence_proxy_async() {
    HOPPER_ONLY(asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"));
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

// The A operand of an RS wgmma (P~, in registers) is read until its wgmma_wait, which the
// compiler does not know: an empty asm that claims to write A, after the wait, keeps A's old
// registers from being reused before it (a P~ made ahead of the wait goes elsewhere until then).
template <int K>
__device__ __forceinline__ void a_operand_fence(uint32_t (&A)[K][4]) {
#pragma unroll
    for (int k = 0; k < K; k++)
#pragma unroll
        for (int a = 0; a < 4; a++) asm volatile("" : "+r"(A[k][a])::"memory");
}

// wgmma.mma_async m64nNk16 with fp32 accumulators d (N / 2 a thread, laid out as mma.m16n8's, a
// warp's 16 rows each). SS: A and B in shared memory, both K-major (S_ij = Q_i K_j^T), or, with
// Trans, both read transposed (imm-trans-a, -b 1: the backward's dQ_i = dS K_j, dS stored as dS^T,
// keys x queries, and K_j keys x columns). RS: A in registers as mma.m16n8k16's A fragment (P~,
// or Q_i: load_A_fragments), B in shared memory read transposed (TransB, imm-trans-b 1: V_j is
// stored keys x columns) or K-major (S_ij = Q_i K_j^T with Q_i in registers).
#define ACC8(b) "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), \
                "+f"(d[b + 5]), "+f"(d[b + 6]), "+f"(d[b + 7])
#define ACC4 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
#define ACC24 ACC8(0), ACC8(8), ACC8(16)
#define ACC32 ACC8(0), ACC8(8), ACC8(16), ACC8(24)
#define ACC64 ACC32, ACC8(32), ACC8(40), ACC8(48), ACC8(56)
#define ACC96 ACC64, ACC8(64), ACC8(72), ACC8(80), ACC8(88)
#define REGS24 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21," \
               "%22,%23}"
#define REGS32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21," \
               "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define R0_63 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21," \
              "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41," \
              "%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61," \
              "%62,%63"
#define R64_95 "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82," \
               "%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95"
#define REGS64 "{" R0_63 "}"
#define REGS96 "{" R0_63 "," R64_95 "}"
#define AB32 "{%32,%33,%34,%35}, %36"  // RS: A's 4 registers, B's descriptor
#define AB64 "{%64,%65,%66,%67}, %68"
#define WGMMA_SS(N, REGS, ACC, AB, TY)                                                          \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", " AB    \
                 ", 1, 1, 1, " TR ";\n" : ACC : "l"(a), "l"(b))
#define WGMMA_RS(N, REGS, ACC, AB, TY)                                                          \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", " AB    \
                 ", 1, 1, 1, " TRB ";\n" : ACC : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
template <typename T, int N, bool Trans = false>
__device__ __forceinline__ void wgmma_ss(float* d, uint64_t a, uint64_t b) {
    static_assert(N == 48 || N == 64 || N == 128, "wgmma_ss is written for N = 48, 64, 128");
    constexpr bool h = std::is_same<T, __half>::value;
    if constexpr (!Trans) {
#define TR "0, 0"
        if constexpr (N == 48 && h) HOPPER_ONLY(WGMMA_SS(48, REGS24, ACC24, "%24, %25", "f16"));
        if constexpr (N == 48 && !h) HOPPER_ONLY(WGMMA_SS(48, REGS24, ACC24, "%24, %25", "bf16"));
        if constexpr (N == 64 && h) HOPPER_ONLY(WGMMA_SS(64, REGS32, ACC32, "%32, %33", "f16"));
        if constexpr (N == 64 && !h) HOPPER_ONLY(WGMMA_SS(64, REGS32, ACC32, "%32, %33", "bf16"));
        if constexpr (N == 128 && h) HOPPER_ONLY(WGMMA_SS(128, REGS64, ACC64, "%64, %65", "f16"));
        if constexpr (N == 128 && !h) HOPPER_ONLY(WGMMA_SS(128, REGS64, ACC64, "%64, %65", "bf16"));
#undef TR
    } else {
#define TR "1, 1"
        static_assert(N == 64, "wgmma_ss reads transposed operands at N = 64");
        if constexpr (h) HOPPER_ONLY(WGMMA_SS(64, REGS32, ACC32, "%32, %33", "f16"));
        else HOPPER_ONLY(WGMMA_SS(64, REGS32, ACC32, "%32, %33", "bf16"));
#undef TR
    }
}
template <typename T, int N, bool TransB = true>
__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t* a, uint64_t b) {
    static_assert(N == 64 || N == 128, "wgmma_rs is written for N = 64, 128");
    constexpr bool h = std::is_same<T, __half>::value;
    if constexpr (TransB) {
#define TRB "1"
        if constexpr (N == 64 && h) HOPPER_ONLY(WGMMA_RS(64, REGS32, ACC32, AB32, "f16"));
        if constexpr (N == 64 && !h) HOPPER_ONLY(WGMMA_RS(64, REGS32, ACC32, AB32, "bf16"));
        if constexpr (N == 128 && h) HOPPER_ONLY(WGMMA_RS(128, REGS64, ACC64, AB64, "f16"));
        if constexpr (N == 128 && !h) HOPPER_ONLY(WGMMA_RS(128, REGS64, ACC64, AB64, "bf16"));
#undef TRB
    } else {
#define TRB "0"
        static_assert(N == 64 || N == 128, "wgmma_rs reads a K-major B at N = 64 or 128");
        if constexpr (N == 64 && h) HOPPER_ONLY(WGMMA_RS(64, REGS32, ACC32, AB32, "f16"));
        if constexpr (N == 64 && !h) HOPPER_ONLY(WGMMA_RS(64, REGS32, ACC32, AB32, "bf16"));
        if constexpr (N == 128 && h) HOPPER_ONLY(WGMMA_RS(128, REGS64, ACC64, AB64, "f16"));
        if constexpr (N == 128 && !h) HOPPER_ONLY(WGMMA_RS(128, REGS64, ACC64, AB64, "bf16"));
#undef TRB
    }
}
// An A operand in registers from shared memory: a warp's 16 rows of a tile stored as TMA's 128-byte
// swizzled rows in blocks of 64 columns (rows x 64, one after another; the 16-byte chunk c of row
// r sits at chunk c ^ (r % 8)), all D columns, as D / 16 sets of mma.m16n8k16's A fragment, one
// ldmatrix.x4 each: lanes 0-15 name rows 0-15 at the set's columns 0-7, lanes 16-31 at 8-15, so
// the four 8 x 8 matrices land in a0 (rows 0-7, k 0-7), a1 (rows 8-15), a2 and a3 (k 8-15).
// rows: the tile's rows (a block's), row: the warp's first.
template <int D>
__device__ __forceinline__ void load_A_fragments(uint32_t (&A)[D / 16][4], const void* tile,
                                                 int rows, int row) {
    const int r = row + threadIdx.x % 16, half = threadIdx.x % 32 / 16;
    const uint32_t base = smem_addr(tile) + r * kRowBytes;
#pragma unroll
    for (int k = 0; k < D / 16; k++) {
        const uint32_t at = base + k / 4 * rows * kRowBytes + ((k % 4 * 2 + half) ^ r % 8) * 16;
        HOPPER_ONLY(asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                                 : "=r"(A[k][0]), "=r"(A[k][1]), "=r"(A[k][2]), "=r"(A[k][3])
                                 : "r"(at) : "memory"));
    }
}
// The fp8 (e4m3) forms (chapter 3's fp8 forward): m64nNk32, 32 elements of k a step, 32 bytes,
// the same bytes as a k16 step of fp16. fp8 wgmma reads both shared-memory operands K-major only
// (no transpose): B = V_j must sit keys-along-the-row (V^T, flash_hopper_fp8.cu says how). In
// registers, A is 4 .b32 a thread of 4 e4m3 each: a0 row g, k 4t..4t+3; a1 row g + 8, the same
// k; a2 and a3 the same rows at k 16 + 4t..16 + 4t + 3.
#define WGMMA_FP8_SS(N, REGS, ACC, AB)                                                          \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " REGS ", " AB       \
                 ", 1, 1, 1;\n" : ACC : "l"(a), "l"(b))
#define WGMMA_FP8_RS(N, REGS, ACC, AB, SD)                                                      \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " REGS ", " AB       \
                 ", " SD ", 1, 1;\n" : ACC : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
template <int N>
__device__ __forceinline__ void wgmma_fp8_ss(float* d, uint64_t a, uint64_t b) {
    static_assert(N == 64 || N == 128 || N == 192, "wgmma_fp8_ss is written for N = 64, 128, 192");
    if constexpr (N == 64) HOPPER_ONLY(WGMMA_FP8_SS(64, REGS32, ACC32, "%32, %33"));
    if constexpr (N == 128) HOPPER_ONLY(WGMMA_FP8_SS(128, REGS64, ACC64, "%64, %65"));
    if constexpr (N == 192) HOPPER_ONLY(WGMMA_FP8_SS(192, REGS96, ACC96, "%96, %97"));
}
// Accumulate = false: scale-d 0, d = A B (d's old values ignored: the first k-step of a sum).
template <int N, bool Accumulate = true>
__device__ __forceinline__ void wgmma_fp8_rs(float* d, const uint32_t* a, uint64_t b) {
    static_assert(N == 8 || N == 64 || N == 128, "wgmma_fp8_rs is written for N = 8, 64, 128");
#define RS_N(SD)                                                                                \
    if constexpr (N == 8)                                                                       \
        HOPPER_ONLY(WGMMA_FP8_RS(8, "{%0,%1,%2,%3}", ACC4, "{%4,%5,%6,%7}, %8", SD));           \
    if constexpr (N == 64) HOPPER_ONLY(WGMMA_FP8_RS(64, REGS32, ACC32, AB32, SD));              \
    if constexpr (N == 128) HOPPER_ONLY(WGMMA_FP8_RS(128, REGS64, ACC64, AB64, SD));
    if constexpr (Accumulate) { RS_N("1") } else { RS_N("0") }
#undef RS_N
}
#undef WGMMA_FP8_SS
#undef WGMMA_FP8_RS
#undef ACC8
#undef ACC4
#undef ACC24
#undef ACC32
#undef ACC64
#undef ACC96
#undef REGS24
#undef REGS32
#undef REGS64
#undef REGS96
#undef R0_63
#undef R64_95
#undef AB32
#undef AB64
#undef WGMMA_SS
#undef WGMMA_RS
// Chapter 2's acc_at, for a warpgroup's accumulators (one flat array a thread, laid out as
// mma.m16n8's, a warp's 16 rows each): element (r, c) is row 16 warp + g + 8r of the warpgroup's
// 64, r = 0, 1, and column 8 (c / 2) + 2t + c % 2 (lane = 4g + t).
template <int N>
__device__ __forceinline__ float& acc_at(float (&acc)[N], int r, int c) {
    return acc[c / 2 * 4 + 2 * r + c % 2];
}
// pair_bits, quad_reduce and add are chapter 2's, from fragments.cuh.

// Thread t's v[k] becomes thread k's v[t] across its quad (the 4 threads of one row g): a 4 x 4
// transpose in two butterfly steps, each swapping the pairs whose index differs from the thread's
// in one bit. Before, a thread holds 2 columns of each of 4 blocks of 8; after, one block whole.
__device__ __forceinline__ void quad_transpose(uint32_t (&v)[4], int t) {
#pragma unroll
    for (int bit = 1; bit <= 2; bit *= 2)
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (k & bit) continue;                     // the pair (k, k + bit)
            const bool hi = t & bit;                   // it gives the one its partner keeps
            const uint32_t y = __shfl_xor_sync(0xffffffffu, hi ? v[k] : v[k + bit], bit);
            v[k] = hi ? y : v[k], v[k + bit] = hi ? v[k + bit] : y;
        }
}

// Row r of a warpgroup's accumulators (acc_at's columns 0 .. Cols - 1) times f, in T, to `row`
// (16-byte aligned), 16 bytes a store: the quad trades its pairs first (quad_transpose), so that
// each thread writes 8 whole columns, a quarter of the stores of writing its own pairs and whole
// 32-byte sectors. Every lane of the warp calls it (the shuffles); where `write` is false it
// writes nothing.
template <typename T, int Cols, int N>
__device__ __forceinline__ void store_row(T* row, float (&acc)[N], int r, float f, int t,
                                          bool write) {
#pragma unroll
    for (int q = 0; q < Cols / 32; q++) {              // blocks 4q .. 4q + 3 of 8 columns
        uint32_t v[4];                                 // its pairs: columns 8 (4q + b) + 2t, + 1
#pragma unroll
        for (int b = 0; b < 4; b++)
            v[b] = pair_bits<T>(acc_at(acc, r, 8 * q + 2 * b) * f,
                                acc_at(acc, r, 8 * q + 2 * b + 1) * f);
        quad_transpose(v, t);                          // now block 4q + t's 8 columns
        if (write) *reinterpret_cast<uint4*>(row + 8 * (4 * q + t)) = {v[0], v[1], v[2], v[3]};
    }
}

// The pipeline (CUTLASS's PipelineState, ThunderKittens' stage and phase bit): a ring of Stages
// buffers, each with a full and an empty mbarrier, through which tiles pass in order. Tile n
// (counted from the block's start) sits in stage n % Stages and completes phase n / Stages of that
// stage's barriers; waiters name the phase's parity. The rules: the producer loads tile n into its
// stage once the stage's empty barrier has completed the phase before (tile n - Stages is read;
// the first Stages tiles find their stages free), telling full how many bytes will come; a
// consumer reads it once full has completed its phase, then each of its warps arrives on empty.
// PipelineState is the pair (stage, phase), kept as n, from which both follow; advance() moves it
// on. The producer's state is the tile it loads next, a consumer's the tile it reads next.
template <int Stages>
struct PipelineState {
    int n = 0;  // tiles through the ring before this one
    __device__ int stage() const { return n % Stages; }
    __device__ int phase() const { return n / Stages % 2; }
    __device__ int phase_before() const { return (n / Stages - 1) % 2; }  // for n >= Stages
    __device__ PipelineState previous() const { return {n - 1}; }
    __device__ void advance(int tiles = 1) { n += tiles; }
};
// The ring's barriers, set up by one thread before any use: pairs of full (one arrival, the
// producer's, and the bytes of its copies) and empty (one arrival from each consumer warp).
// fence.mbarrier_init: the TMA's completions see them initialised too.
// (full_arrivals: 32 where the producer's whole warp arrives, having written a stage itself.)
__device__ __forceinline__ void init_barriers(uint64_t* full, uint64_t* empty, int pairs,
                                              int consumer_warps, int full_arrivals = 1) {
    for (int s = 0; s < pairs; s++)
        mbar_init(&full[s], full_arrivals), mbar_init(&empty[s], consumer_warps);
    HOPPER_ONLY(asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"));
}

// The tensor map of Q, K or V, (batch, heads, len, D) elements of T where `r` (chapter 5's
// strides: lib/layout.h) puts them, for boxes of rows x 128 bytes (64 elements of fp16 or bf16; 32
// of fp32: the backward's dQacc; 128 of fp8) in the 128-byte swizzle; rows past len are read as
// zeros (and not written), and so are columns past D (fp8 at D = 64: a box wider than a row).
// cuTensorMapEncodeTiled is a driver call, found through the runtime, so that nothing links
// libcuda (CI machines have none).
template <typename T>
static CUtensorMap tensor_map(const T* base, const Rows& at, int batch, int len, int D, int rows) {
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
    const cuuint64_t dims[4] = {cuuint64_t(D), cuuint64_t(len), cuuint64_t(at.heads),
                                cuuint64_t(batch)};
    // Bytes; a dimension of one index takes any stride the map allows (its one index is 0).
    const cuuint64_t row = len > 1 ? at.row : D, head = at.heads > 1 ? at.head : row * len,
                     strides[3] = {row * sizeof(T), head * sizeof(T),
                                   (batch > 1 ? at.batch : head * at.heads) * sizeof(T)};
    const cuuint32_t box[4] = {cuuint32_t(128 / sizeof(T)), cuuint32_t(rows), 1, 1},
                     steps[4] = {1, 1, 1, 1};
    const CUresult r = encode(
        &map, std::is_same<T, float>::value    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
              : std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
              : sizeof(T) == 1                 ? CU_TENSOR_MAP_DATA_TYPE_UINT8  // (fp8's bytes)
                                               : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        4, const_cast<T*>(base), dims, strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        throw std::runtime_error("cuTensorMapEncodeTiled failed: CUresult " + std::to_string(r));
    return map;
}
