// flash.cu: chapter 1 of a minimal FlashAttention: the forward and backward kernels in fp32 CUDA
// C++, small enough to read beside the papers (FlashAttention, Dao et al. 2022; FlashAttention-2,
// Dao 2023, whose Algorithms 1 and 2 the kernels follow line by line), then their launchers.
//
// Build and test:   make test        (the API is flash.h; the CPU reference is reference.cpp)
// Demo:             make run         (one shape, timed and checked against the CPU reference)
//
// In order: the forward kernel, the helpers it calls, the two backward kernels, the tile rule, the
// launchers. The argument checks: lib/checks.cpp. The names are the papers' (Q_i, K_j, S_ij, m, l,
// Br, Bc, ...), and chapter 2's: NOTES.md's glossary lists them.
// Layouts: Q, O, dQ, dO (B, H, q_len, d); K, V, dK, dV (B, H_kv, kv_len, d); L (B, H, q_len).
// Grouped-query attention (chapter 4): H = group H_kv, and query head h reads K/V head h / group.
// With b H + h = bh, that K/V head is b H_kv + h / group = bh / group: one division, nothing else.
#include "checks.h"
#include "flash.h"
#include "float4.cuh"
#include "log2_units.h"

#include <cuda_pipeline.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

static constexpr int kThreads = 128;  // threads per block (4 warps), in all three kernels
// Blocks resident per SM: each kernel's second __launch_bounds__ argument. It caps a thread's
// registers: an SM has 65536, handed to warps in steps of 256 (8 a thread), so b blocks of 128
// threads leave a thread 65536 / (128 b) rounded down to a multiple of 8: 168 at b = 3 (170.7
// before rounding), and at b = 2 the most a thread may have, 255. The forward's b also gives each
// of its blocks 1/b of the SM's shared memory (the tile rule below), and is an experiment knob:
// make clean all DEFINES=-DFLASH_MIN_BLOCKS_PER_SM=2
#ifndef FLASH_MIN_BLOCKS_PER_SM
#define FLASH_MIN_BLOCKS_PER_SM 3
#endif
static constexpr int kMinBlocksPerSM = FLASH_MIN_BLOCKS_PER_SM;
static constexpr int kDqMinBlocksPerSM = 3;    // the backward's dQ kernel: at most 168 registers
static constexpr int kDkdvMinBlocksPerSM = 2;  // its dK, dV kernel: at most 255 (it uses up to 219)

// ---------------------------------------------------------------------------------------------
// The forward kernel comes first; what it calls is declared here and defined after it.
struct QueryRow {   // query_row: a thread's row of Q_i (Algorithm 1, line 3: the grid)
    size_t bh;      // its query head: batch * heads + head
    int query;      // its row of Q_i: a row of Q, O and L
    int part;       // which of the row's TPR threads it is
    size_t offset;  // where its slice of the row starts in Q and O
};
struct KVTiles {    // kv_tiles: what its block reads of K and V
    float4* K_j;    // K_j in shared memory, (Bc, D/4) float4s,
    float4* V_j;    // then V_j, (Bc, D/4)
    size_t kv_bh;   // their head (GQA: `group` query heads share one)
    int kv_end;     // the keys Q_i needs: 0 .. kv_end - 1 (causal: up to its last row's diagonal)
};
template <int D, int TPR>
__device__ __forceinline__ QueryRow query_row(int q_len, int Tr);
template <int D, int TPR>
__device__ __forceinline__ KVTiles kv_tiles(int q_len, int kv_len, bool causal, int Bc, int Tr,
                                            int group);
template <int TPR, int N>
__device__ __forceinline__ float row_dot(const float4 (&x)[N], const float4* y);
template <int D>
__device__ __forceinline__ void load_tiles(float4* A, const float4* __restrict__ gA, float4* B,
                                           const float4* __restrict__ gB, size_t offset, int rows);

// ---------------------------------------------------------------------------------------------
// Forward: FlashAttention-2, Algorithm 1. One block per (Q tile Q_i, batch*head); each query row
// of Q_i belongs to TPR adjacent threads, each holding a 1/TPR slice of that row of Q_i and of O_i
// in registers (float4s part, part + TPR, part + 2*TPR, ...: the interleave keeps a warp's
// shared-memory reads on distinct banks). K_j and V_j stream through shared memory.
//   D:   the head dim, known at compile time, so that the slices are register arrays (fully
//        unrolled loops index them with constants; a runtime d would put them in local memory).
//   TPR: threads per row, so that a row of Q_i and of O_i (2 * D floats) fits in its registers.
// Names (NOTES.md's glossary): k0 = j Bc is the first key of K_j and kj a key's place in it; a
// thread's part of a tile is named as the tile (Q_i and O_i: its slices of its row). 1/sqrt(d)
// and log2(e) are folded into Q_i once, so scores come out in log2 units and exp(x) is exp2f(x).
// Threads past the last row compute alongside (a row's threads must all take part in its
// shuffles) and write nothing.
template <int D, int TPR>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM)
flash_forward_kernel(const float4* __restrict__ Q, const float4* __restrict__ K,
                     const float4* __restrict__ V, float4* __restrict__ O, float* __restrict__ L,
                     int q_len, int kv_len, bool causal, int Bc, int Tr, int group,
                     float scale_log2) {
    constexpr int slice4 = D / 4 / TPR;                // float4s of a row that one thread holds
    // Line 3: for each Q_i (the grid): the row of Q_i this thread works on.
    const auto [bh, query, part, offset] = query_row<D, TPR>(q_len, Tr);
    float4 Q_i[slice4];
    float4 O_i[slice4] = {};                           // line 5: O_i = 0, in registers
    float m = -INFINITY;                               // line 5: row max m (log2 units)
    float l = 0.f;                                     // line 5: row sum l
    for (int c = 0; c < slice4; c++) Q_i[c] = scale4(Q[offset + c * TPR], scale_log2);  // line 4
    // K_j and V_j in shared memory, their K/V head, and the keys Q_i needs (causal: fewer).
    const auto [K_j, V_j, kv_bh, kv_end] = kv_tiles<D, TPR>(q_len, kv_len, causal, Bc, Tr, group);
    // Line 6: for each K_j, V_j, from its first key k0 = j Bc; line 7: load them.
    for (int k0 = 0; k0 < kv_end; k0 += Bc) {
        load_tiles<D>(K_j, K, V_j, V, (kv_bh * kv_len + k0) * (D / 4), min(Bc, kv_end - k0));
        // Two keys a step at d = 128 only: faster there, slower at d = 64 (lab/chapter1.md).
        #pragma unroll(D == 128 ? 2 : 1)
        for (int kj = 0; kj < min(Bc, kv_end - k0); kj++) {  // lines 8-10, one key at a time
            const float s = row_dot<TPR>(Q_i, &K_j[kj * (D / 4) + part]);  // line 8: S_ij
            const bool seen = !causal || k0 + kj <= flash_last_key(query, q_len, kv_len);
            // Lines 9-10: a new row max m: rescale l and O_i by exp(m_old - m_new).
            if (seen && s > m) {
                const float alpha = exp2f(m - s);
                l *= alpha;
                for (int c = 0; c < slice4; c++) O_i[c] = scale4(O_i[c], alpha);
                m = s;
            }
            const float p = seen ? exp2f(s - m) : 0.f;  // line 9: P_ij = exp(S_ij - m)
            l += p;                                     // line 9: l += rowsum(P_ij)
            // Line 10: O_i += P_ij V_j.
            for (int c = 0; c < slice4; c++) axpy4(O_i[c], p, V_j[kj * (D / 4) + part + c * TPR]);
        }
    }
    // Lines 12-15: O_i = O_i / l and L_i = m + log(l), written once; a row that saw no key (l = 0)
    // gets O = 0 and L = -inf. m is in log2 units, so L = (m + log2(l)) * ln(2).
    if (query >= q_len) return;
    for (int c = 0; c < slice4; c++) O[offset + c * TPR] = scale4(O_i[c], l > 0.f ? 1.f / l : 0.f);
    if (part == 0) L[bh * q_len + query] = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
}

// ---------------------------------------------------------------------------------------------
// Helpers: the forward's setup, then what the forward and backward kernels share.

// This block's Q tile i, of Tr = ceil(q_len / Br) per head, and its query head bh. The block
// order: blockIdx 0 takes the LAST Q tile, which under a causal mask sees the most keys. The GPU
// starts blocks roughly in index order, so the long blocks start first and the short ones fill
// the tail of the last wave.
__device__ __forceinline__ int q_tile(int Tr) { return Tr - 1 - blockIdx.x % Tr; }
__device__ __forceinline__ size_t q_head(int Tr) { return blockIdx.x / Tr; }

// The row of Q_i (q_tile's Br rows of head q_head) that this thread of the forward works on. A
// thread past the last row reads that row (the clamp in `offset`).
template <int D, int TPR>
__device__ __forceinline__ QueryRow query_row(int q_len, int Tr) {
    constexpr int Br = kThreads / TPR;                 // query rows per block
    const size_t bh = q_head(Tr);
    const int query = q_tile(Tr) * Br + threadIdx.x / TPR;
    const int part = threadIdx.x % TPR;
    const size_t offset = (bh * q_len + min(query, q_len - 1)) * (D / 4) + part;
    return {bh, query, part, offset};
}

// What the forward's block reads of K and V: K_j and V_j, Bc rows each, one after the other in
// the block's shared memory; the K/V head of its query head; and how many keys its Q tile needs.
template <int D, int TPR>
__device__ __forceinline__ KVTiles kv_tiles(int q_len, int kv_len, bool causal, int Bc, int Tr,
                                            int group) {
    constexpr int Br = kThreads / TPR;
    extern __shared__ float4 K_j[];
    const size_t kv_bh = q_head(Tr) / group;
    const int kv_end = flash_kv_end(q_tile(Tr) * Br, Br, q_len, kv_len, causal);
    return {K_j, K_j + Bc * (D / 4), kv_bh, kv_end};
}

// Sum over the TPR adjacent threads that share a row; every one of them gets the total.
template <int TPR>
__device__ __forceinline__ float row_sum(float v) {
    for (int w = TPR / 2; w > 0; w /= 2) v += __shfl_xor_sync(0xffffffffu, v, w);
    return v;
}
// The dot product of two rows of d floats, each thread holding its slice of both: x, the N float4s
// this thread keeps in registers, and y[0], y[TPR], y[2*TPR], ... (its float4s of the other row).
// Summed over the row's TPR threads, which must all call it together (a shuffle): never inside a
// branch.
template <int TPR, int N>
__device__ __forceinline__ float row_dot(const float4 (&x)[N], const float4* y) {
    float s = 0.f;
    for (int c = 0; c < N; c++) s += dot4(x[c], y[c * TPR]);
    return row_sum<TPR>(s);
}
// The backward's two dot products per (query, key), S_ij (times `scale`) and dP_ij, of the row of
// Q_i with the row of K_j and of the row of dO_i with the row of V_j. Both are summed over this
// thread's slices before either is reduced across the row, so that the two shuffle chains
// overlap; S is scaled right after its reduction, so that the compiler fuses L_i's multiply, not
// S's, into the subtraction that follows. Both orders decide the machine code.
template <int TPR, int N>
__device__ __forceinline__ float2 row_dot2(const float4 (&x)[N], const float4* y,
                                           const float4 (&u)[N], const float4* w, float scale) {
    float s = 0.f;
    float dp = 0.f;
    for (int c = 0; c < N; c++) s += dot4(x[c], y[c * TPR]);
    for (int c = 0; c < N; c++) dp += dot4(u[c], w[c * TPR]);
    s = row_sum<TPR>(s) * scale;
    dp = row_sum<TPR>(dp);
    return make_float2(s, dp);
}
// Replaces the two tiles in shared memory (K_j and V_j, or Q_i and dO_i): `rows` rows of D floats
// of two tensors, at the same offset, copied global -> shared 16 bytes at a time. The first barrier
// waits until every thread is done with the old tiles, the last until all the copies have landed.
// cp.async (sm_80+; plain copies before that) moves the data without staging it in registers, so
// every load of both tiles is in flight at once.
template <int D>
__device__ __forceinline__ void load_tiles(float4* A, const float4* __restrict__ gA, float4* B,
                                           const float4* __restrict__ gB, size_t offset, int rows) {
    __syncthreads();
    for (int x = threadIdx.x; x < rows * (D / 4); x += blockDim.x) {
#ifdef FLASH_PLAIN_COPY
        A[x] = gA[offset + x];
        B[x] = gB[offset + x];
#else
        __pipeline_memcpy_async(A + x, gA + offset + x, sizeof(float4));
        __pipeline_memcpy_async(B + x, gB + offset + x, sizeof(float4));
#endif
    }
    // This thread's copies have landed; after the barrier, everyone's have.
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads();
}

// ---------------------------------------------------------------------------------------------
// Backward: FlashAttention-2, Algorithm 2, split in two kernels so that no sum needs atomics (and
// the result is bitwise deterministic): each dQ row, and each dK and dV row, is summed by the
// threads that own it, in order. Both recompute P from L (line 11) instead of storing it. Tiles
// are square, Br = Bc, and the layout is the forward's (TPR threads per row; names likewise: one
// entry of S_ij, P_ij, dP_ij, dS_ij is s, p, dp, ds).

// Kernel 1 of 2: dQ, and D. Algorithm 2's loops swapped: one block per Q tile Q_i (the grid,
// longest causal first, as in the forward), with Q_i, dO_i and dQ_i in registers while K_j, V_j
// stream through shared memory (the paper's outer loop, line 5, here the inner one). dQ_i is
// written once at the end, not read and written back per K_j. It also computes line 4's
// D_i = rowsum(dO_i * O_i) and writes it for kernel 2 (Dsum: D in global memory).
template <int D, int TPR>
__global__ void __launch_bounds__(kThreads, kDqMinBlocksPerSM)
flash_backward_dq_kernel(const float4* __restrict__ Q, const float4* __restrict__ K,
                         const float4* __restrict__ V, const float4* __restrict__ O,
                         const float4* __restrict__ dO, const float* __restrict__ L,
                         float* __restrict__ Dsum, float4* __restrict__ dQ, int q_len, int kv_len,
                         bool causal, int Tr, int group, float scale_log2) {
    constexpr int Br = kThreads / TPR;                 // query rows per block; Bc = Br keys per K_j
    constexpr int slice4 = D / 4 / TPR;
    // Shared memory: K_j, (Br, D/4) float4s, then V_j, (Br, D/4).
    extern __shared__ float4 K_j[];
    float4* V_j = K_j + Br * (D / 4);
    const int i = Tr - 1 - blockIdx.x % Tr;            // this block's Q tile
    const size_t bh = blockIdx.x / Tr;
    const size_t kv_bh = bh / group;                   // its K/V head, as in the forward
    const int query = i * Br + threadIdx.x / TPR;
    const int part = threadIdx.x % TPR;
    const int last_key = flash_last_key(query, q_len, kv_len);
    const size_t offset = (bh * q_len + min(query, q_len - 1)) * (D / 4) + part;
    float4 Q_i[slice4];                                // line 9: load Q_i, dO_i, L_i
    float4 dO_i[slice4];
    float4 dQ_i[slice4] = {};                          // dQ_i, accumulated in registers
    for (int c = 0; c < slice4; c++) Q_i[c] = scale4(Q[offset + c * TPR], scale_log2);
    for (int c = 0; c < slice4; c++) dO_i[c] = dO[offset + c * TPR];
    const float D_i = row_dot<TPR>(dO_i, &O[offset]);  // line 4: D_i = rowsum(dO_i * O_i)
    if (query < q_len && part == 0) Dsum[bh * q_len + query] = D_i;
    const float L_i = L[bh * q_len + min(query, q_len - 1)] * kLog2e;  // log2 units, as S_ij
    const int kv_end = flash_kv_end(i * Br, Br, q_len, kv_len, causal);
    // Line 5: for each K_j, V_j, from its first key k0 = j Br; line 6: load them.
    for (int k0 = 0; k0 < kv_end; k0 += Br) {
        load_tiles<D>(K_j, K, V_j, V, (kv_bh * kv_len + k0) * (D / 4), min(Br, kv_end - k0));
        for (int kj = 0; kj < min(Br, kv_end - k0); kj++) {
            // Line 10: S_ij = Q_i K_j^T; line 13: dP_ij = dO_i V_j^T.
            const auto [s, dp] =
                row_dot2<TPR>(Q_i, &K_j[kj * (D / 4) + part], dO_i, &V_j[kj * (D / 4) + part], 1.f);
            const float p = !causal || k0 + kj <= last_key ? exp2f(s - L_i) : 0.f;  // line 11
            const float ds = p * (dp - D_i);           // line 14: dS_ij = P_ij o (dP_ij - D_i)
            // Line 15: dQ_i += dS_ij K_j.
            for (int c = 0; c < slice4; c++) axpy4(dQ_i[c], ds, K_j[kj * (D / 4) + part + c * TPR]);
        }
    }
    if (query >= q_len) return;
    for (int c = 0; c < slice4; c++) dQ[offset + c * TPR] = scale4(dQ_i[c], rsqrtf(D));
}

// Kernel 2 of 2: dK and dV, in Algorithm 2's own order. One block per K/V tile (line 5's loop is
// the grid), one key per TPR threads, with K_j, V_j, dK_j and dV_j in registers while Q_i and dO_i
// stream through shared memory (line 8's loop); `key` is this thread's key, q0 the first query of
// Q_i and `qi` a query's place within it. Grouped-query attention: a K/V head's dK_j, dV_j sum
// over the group's query heads (each query head's P_ij, dS_ij are its own), so line 8's loop runs
// over every (query head of the group, Q_i), one head after the other: the same registers, one
// fixed order, no atomics. The slices of K_j, V_j, dK_j, dV_j and of the Q_i, dO_i
// rows just read take about 220 registers: two blocks per SM, no spills.
template <int D, int TPR>
__global__ void __launch_bounds__(kThreads, kDkdvMinBlocksPerSM)
flash_backward_dkdv_kernel(const float4* __restrict__ Q, const float4* __restrict__ K,
                           const float4* __restrict__ V, const float4* __restrict__ dO,
                           const float* __restrict__ L, const float* __restrict__ Dsum,
                           float4* __restrict__ dK, float4* __restrict__ dV, int q_len,
                           int kv_len, bool causal, int Tc, int group, float scale_log2) {
    constexpr int Bc = kThreads / TPR;                 // keys per block; Br = Bc rows per Q_i
    constexpr int slice4 = D / 4 / TPR;
    // Shared memory: Q_i, (Bc, D/4) float4s, then dO_i, (Bc, D/4).
    extern __shared__ float4 Q_i[];
    float4* dO_i = Q_i + Bc * (D / 4);
    const int j = blockIdx.x % Tc;                     // line 5: for each K_j, V_j (the grid)
    const size_t kv_bh = blockIdx.x / Tc;              // batch * kv_heads + K/V head
    const int key = j * Bc + threadIdx.x / TPR;        // this thread's row of K_j
    const int part = threadIdx.x % TPR;
    const size_t offset = (kv_bh * kv_len + min(key, kv_len - 1)) * (D / 4) + part;  // K, V, dK, dV
    float4 K_j[slice4];                                // line 6: load K_j, V_j
    float4 V_j[slice4];
    float4 dK_j[slice4] = {};                          // line 7: dK_j = 0, dV_j = 0
    float4 dV_j[slice4] = {};
    for (int c = 0; c < slice4; c++) K_j[c] = K[offset + c * TPR];
    for (int c = 0; c < slice4; c++) V_j[c] = V[offset + c * TPR];
    // Causal: Q tiles before the first query that sees the block's first key are skipped.
    const int q_begin = causal ? max(0, flash_first_query(j * Bc, q_len, kv_len)) : 0;
    // Line 8: for each query head bh of the group and each of its Q_i, from its first query q0;
    // line 9: load Q_i and dO_i.
    for (size_t bh = kv_bh * group; bh < (kv_bh + 1) * group; bh++)
    for (int q0 = q_begin; q0 < q_len; q0 += Bc) {
        load_tiles<D>(Q_i, Q, dO_i, dO, (bh * q_len + q0) * (D / 4), min(Bc, q_len - q0));
        for (int qi = 0; qi < min(Bc, q_len - q0); qi++) {
            // Line 10: S_ij = Q_i K_j^T (scaled to log2 units); line 13: dP_ij = dO_i V_j^T.
            const auto [s, dp] = row_dot2<TPR>(K_j, &Q_i[qi * (D / 4) + part], V_j,
                                               &dO_i[qi * (D / 4) + part], scale_log2);
            // Line 9: the query's L_i (in log2 units) and D_i.
            const float L_i = L[bh * q_len + q0 + qi] * kLog2e;
            const float D_i = Dsum[bh * q_len + q0 + qi];
            const bool seen =
                key < kv_len && (!causal || key <= flash_last_key(q0 + qi, q_len, kv_len));
            const float p = seen ? exp2f(s - L_i) : 0.f;  // line 11: P_ij = exp(S_ij - L_i)
            const float ds = p * (dp - D_i);           // line 14: dS_ij = P_ij o (dP_ij - D_i)
            // Line 12: dV_j += P_ij^T dO_i; line 16: dK_j += dS_ij^T Q_i.
            for (int c = 0; c < slice4; c++) axpy4(dV_j[c], p, dO_i[qi * (D / 4) + part + c * TPR]);
            for (int c = 0; c < slice4; c++) axpy4(dK_j[c], ds, Q_i[qi * (D / 4) + part + c * TPR]);
        }
    }
    if (key >= kv_len) return;                         // line 18: write dK_j, dV_j
    for (int c = 0; c < slice4; c++) dK[offset + c * TPR] = scale4(dK_j[c], rsqrtf(D));
    for (int c = 0; c < slice4; c++) dV[offset + c * TPR] = dV_j[c];
}

// ---------------------------------------------------------------------------------------------
// The tile. The paper (FA1, Algorithm 1 line 1) sets Bc = ceil(M / 4d), Br = min(ceil(M / 4d), d)
// so that Q_i, K_j, V_j and O_i (four tiles of d columns) fit in M floats of on-chip SRAM.
// We depart in three ways, each for speed:
//  1. Q_i and O_i live in registers (as in FlashAttention-2), so shared memory holds only K_j and
//     V_j: Bc = M / 2d.
//  2. M is not the whole SM: kMinBlocksPerSM blocks share an SM, so that while one block waits
//     for its next K_j, V_j to arrive the others compute. M = (shared memory per SM) / blocks.
//  3. Br is set by registers, not SRAM: one query row per thread, its q and o (2d floats) in
//     registers; a thread holds at most 64 floats of each, so at d > 64 a row is split across
//     threads_per_row threads, and Br = threads / threads_per_row.
// An experiment knob, e.g. make clean all DEFINES=-DFLASH_FORWARD_SLICE=32
#ifndef FLASH_FORWARD_SLICE
#define FLASH_FORWARD_SLICE 64
#endif
static constexpr int kForwardSlice = FLASH_FORWARD_SLICE;  // floats of q (and of o) per thread
static constexpr int kBackwardSlice = 32;   // floats of each of the backward's 3 or 4 row vectors

// Smallest power of two p with d / p <= slice: the threads that share one row.
static constexpr int threads_per_row(int d, int slice) {
    int p = 1;
    while (d / p > slice) p *= 2;
    return p;
}

// Shared memory one block may use when kMinBlocksPerSM blocks share an SM.
static size_t shared_per_block(const cudaDeviceProp& prop) {
    const size_t share = prop.sharedMemPerMultiprocessor / kMinBlocksPerSM;
    const size_t usable = share > prop.reservedSharedMemPerBlock
                              ? share - prop.reservedSharedMemPerBlock : 0;
    return std::min(usable, prop.sharedMemPerBlockOptin);
}

static FlashTile make_tile(const cudaDeviceProp& prop, int head_dim, int tpr, int Br, int Bc) {
    FlashTile tile{Br, Bc, kThreads, tpr, 2 * size_t(Bc) * head_dim * sizeof(float)};
    if (Bc < 1 || tile.shared_bytes > prop.sharedMemPerBlockOptin)
        throw std::runtime_error("device " + std::string(prop.name) + " has too little shared " +
                                 "memory for one K/V tile at head_dim " + std::to_string(head_dim));
    if (kThreads > prop.maxThreadsPerBlock)
        throw std::runtime_error("device allows fewer than " + std::to_string(kThreads) +
                                 " threads per block");
    return tile;
}

FlashTile flash_choose_tile(const cudaDeviceProp& prop, int head_dim) {
    require_head_dim(head_dim, kFlashHeadDims);
    const int tpr = threads_per_row(head_dim, kForwardSlice);
    const int Bc = int(shared_per_block(prop) / (2 * head_dim * sizeof(float)));
    return make_tile(prop, head_dim, tpr, kThreads / tpr, Bc);
}

// The backward's tiles are square: each of its two kernels keeps one tile in registers (one row
// per threads_per_row threads: for dK, dV the keys; for dQ the queries) and streams the other
// through shared memory in tiles of the same size, Br = Bc = threads / threads_per_row. Its
// threads hold 3 (dQ) or 4 (dK, dV) row vectors, so each holds a smaller slice of a row.
FlashTile flash_choose_tile_backward(const cudaDeviceProp& prop, int head_dim) {
    require_head_dim(head_dim, kFlashHeadDims);
    const int tpr = threads_per_row(head_dim, kBackwardSlice);
    return make_tile(prop, head_dim, tpr, kThreads / tpr, kThreads / tpr);
}

// ---------------------------------------------------------------------------------------------
// Launchers (host). Each checks every argument (lib/checks.cpp) before anything is launched.

static const float4* f4(const float* p) { return reinterpret_cast<const float4*>(p); }
static float4* f4(float* p) { return reinterpret_cast<float4*>(p); }

template <int D>
static void launch_forward(const float* Q, const float* K, const float* V, float* O, float* L,
                           const AttentionShape& s, const FlashTile& tile, cudaStream_t stream) {
    constexpr int TPR = threads_per_row(D, kForwardSlice);
    auto kernel = flash_forward_kernel<D, TPR>;
    const int Tr = (s.q_len + tile.Br - 1) / tile.Br;  // Q tiles per head
    const int blocks = grid_blocks(s, s.q_len, tile.Br, "q_len");
    allow_shared(kernel, tile.shared_bytes);
    kernel<<<blocks, kThreads, tile.shared_bytes, stream>>>(
        f4(Q), f4(K), f4(V), f4(O), L, s.q_len, s.kv_len, s.causal, tile.Bc, Tr,
        flash_kv_group(s), scale_log2_for(D));
    FLASH_CUDA_CHECK(cudaGetLastError());
}

// Bc: keys per K/V tile given by the caller, or none for the device-derived choice.
static void forward_checked(const float* Q, const float* K, const float* V, float* O, float* L,
                            const AttentionShape& s, std::optional<int> Bc, cudaStream_t stream) {
    validate_shape(s);
    if (Bc)
        require(*Bc >= 1, "Bc = " + std::to_string(*Bc) + " is invalid; allowed values: 1 or more");
    validate_forward_pointers("flash_forward", Q, K, V, O, L, s);
    const cudaDeviceProp prop = flash_device_props();
    FlashTile tile = flash_choose_tile(prop, s.head_dim);
    if (Bc) {  // the caller's Bc, within what fits in the shared memory of one block
        const int max_bc = int(prop.sharedMemPerBlockOptin / (2 * s.head_dim * sizeof(float)));
        require(*Bc <= max_bc, "Bc = " + std::to_string(*Bc) + " is invalid; allowed values: " +
                                   "1 to " + std::to_string(max_bc) +
                                   " on this device at this head_dim");
        tile = make_tile(prop, s.head_dim, tile.threads_per_row, tile.Br, *Bc);
    }
    dispatch_head_dim<kFlashHeadDims>(s.head_dim, [&](auto dim) {
        launch_forward<decltype(dim)::value>(Q, K, V, O, L, s, tile, stream);
    });
}

void flash_forward(const float* Q, const float* K, const float* V, float* O, float* L,
                   const AttentionShape& shape, cudaStream_t stream) {
    forward_checked(Q, K, V, O, L, shape, std::nullopt, stream);
}

void flash_forward_bc(const float* Q, const float* K, const float* V, float* O, float* L,
                      const AttentionShape& shape, int Bc, cudaStream_t stream) {
    forward_checked(Q, K, V, O, L, shape, Bc, stream);
}

template <int D>
static void launch_backward(const float* Q, const float* K, const float* V, const float* O,
                            const float* dO, const float* L, float* dQ, float* dK, float* dV,
                            const AttentionShape& s, const FlashTile& tile, cudaStream_t stream) {
    constexpr int TPR = threads_per_row(D, kBackwardSlice);
    const float scale_log2 = scale_log2_for(D);
    const int Tr = (s.q_len + tile.Br - 1) / tile.Br;   // Q tiles per head
    const int Tc = (s.kv_len + tile.Bc - 1) / tile.Bc;  // K/V tiles per head
    const int q_blocks = grid_blocks(s, s.q_len, tile.Br, "q_len");
    AttentionShape kv_shape = s;                        // the dK, dV grid runs over the K/V heads
    kv_shape.heads = flash_kv_heads(s);
    const int kv_blocks = grid_blocks(kv_shape, s.kv_len, tile.Bc, "kv_len");
    const int group = flash_kv_group(s);      // query heads a K/V head
    auto dq_kernel = flash_backward_dq_kernel<D, TPR>;
    auto dkdv_kernel = flash_backward_dkdv_kernel<D, TPR>;
    allow_shared(dq_kernel, tile.shared_bytes);
    allow_shared(dkdv_kernel, tile.shared_bytes);
    // Dsum: D_i = rowsum(dO_i * O_i), (B, H, q_len) floats, the backward's only extra memory.
    with_row_scratch(s, stream, [&](float* Dsum) {
        dq_kernel<<<q_blocks, kThreads, tile.shared_bytes, stream>>>(
            f4(Q), f4(K), f4(V), f4(O), f4(dO), L, Dsum, f4(dQ), s.q_len, s.kv_len, s.causal,
            Tr, group, scale_log2);
        const cudaError_t launched = cudaGetLastError();
        if (launched != cudaSuccess) return launched;
        dkdv_kernel<<<kv_blocks, kThreads, tile.shared_bytes, stream>>>(  // after dq_kernel
            f4(Q), f4(K), f4(V), f4(dO), L, Dsum, f4(dK), f4(dV), s.q_len, s.kv_len, s.causal,
            Tc, group, scale_log2);
        return cudaGetLastError();
    });
}

void flash_backward(const float* Q, const float* K, const float* V, const float* O,
                    const float* dO, const float* L, float* dQ, float* dK, float* dV,
                    const AttentionShape& s, cudaStream_t stream) {
    validate_shape(s);
    validate_backward_pointers("flash_backward", Q, K, V, O, dO, L, dQ, dK, dV, s);
    const FlashTile tile = flash_choose_tile_backward(flash_device_props(), s.head_dim);
    dispatch_head_dim<kFlashHeadDims>(s.head_dim, [&](auto dim) {
        launch_backward<decltype(dim)::value>(Q, K, V, O, dO, L, dQ, dK, dV, s, tile, stream);
    });
}
