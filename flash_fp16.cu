// flash_fp16.cu: chapter 2, FlashAttention-2 on tensor cores, forward and backward: fp16 Q, K,
// V, O and gradients; the softmax statistics (m, l, L), D and every accumulation in fp32. The same
// contract as chapter 1 (flash.h); read it beside flash.cu and FA2's Algorithms 1 and 2.
//
// Build and test:   make test        Demo:   ./flash_bench --dtype fp16
// Sections, in order: constants, fragment helpers, the forward kernel, the backward's helpers and
// two kernels, the tiles, the launchers.
//
// What changes from chapter 1: the two matrix products of Algorithm 1, S = Q_i K_j^T (line 8) and
// O_i += P~ V_j (line 10), run as mma.sync.m16n8k16 instructions, each a 16x8x16 product by one
// warp. Their operands and results live in registers in the layouts the PTX ISA documents
// ("Matrix Fragments for mma.m16n8k16"); NOTES.md chapter 2 draws them. The one fact that lets
// FA2 keep everything in registers: the fp32 accumulator of S, rounded to fp16, is already laid
// out as the A operand of the next mma, so P~ goes from S to P~ V without touching shared memory.
#include "checks.h"
#include "flash.h"

#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

// The block: kWarps warps, each owning 16 query rows (the M of one mma), so Br = 16 * kWarps.
static constexpr int kWarps = 4;
static constexpr int kBr = 16 * kWarps;
// Shared-memory rows are D + kPad halves long. Unpadded, the 8 rows one ldmatrix reads start a
// multiple of 128 bytes apart and hit the same banks (an 8-way conflict); 8 halves (16 bytes) of
// padding shift each row by 4 banks, so the 8 rows cover all 32. To see what it buys:
// make clean all DEFINES=-DFLASH_FP16_PAD=0 (NOTES.md chapter 2 has the measurement).
#ifndef FLASH_FP16_PAD
#define FLASH_FP16_PAD 8
#endif
static constexpr int kPad = FLASH_FP16_PAD;
static constexpr float kLog2e = 1.4426950408889634f;
static constexpr float kLn2 = 0.6931471805599453f;

// mma.sync.m16n8k16 and cp.async need compute capability 8.0. When nvcc compiles for an older GPU
// (a build with no GPU present defaults to sm_75), the kernel still compiles, to a trap; the API
// refuses such GPUs with a std::runtime_error before anything is launched.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define SM80_ASM(...) __trap()
#pragma nv_diag_suppress 177  // the operands SM80_ASM drops leave some variables unused
#else
#define SM80_ASM(...) asm volatile(__VA_ARGS__)
#endif

// ---------------------------------------------------------------------------------------------
// Fragment helpers: one mma, one 16x16 shared-memory load, one async copy. Everything in them is
// a documented PTX instruction; none is needed to follow the algorithm, only to run it.

// C (16x8, fp32) += A (16x16, fp16, row-major) * B (16x8, fp16, "col": B's columns contiguous).
// Per thread (lane = 4g + t): a: 4 registers of 2 halves; b: 2; c: rows g and g+8, cols 2t, 2t+1.
__device__ __forceinline__ void mma_16x8x16(float c[4], const uint32_t a[4], uint32_t b0,
                                            uint32_t b1) {
    SM80_ASM("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
             "{%8,%9}, {%0,%1,%2,%3};\n" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
             : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The 16x16 block of a shared-memory array (row stride `ld` halves) whose top-left is `tile`, as
// four 8x8 quarters: r[0] rows 0-7 cols 0-7, r[1] rows 8-15 cols 0-7, r[2] rows 0-7 cols 8-15,
// r[3] rows 8-15 cols 8-15. Lane L points at row L % 16, column 8 * (L / 16). Each thread gets
// 2 halves of each quarter: (row g, cols 2t, 2t+1), or with Trans (rows 2t, 2t+1, col g).
template <bool Trans>
__device__ __forceinline__ void load_16x16(uint32_t r[4], const __half* tile, int ld) {
    const int lane = threadIdx.x % 32;
    const unsigned p = unsigned(__cvta_generic_to_shared(tile + lane % 16 * ld + lane / 16 * 8));
    if constexpr (Trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(p));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(p));
}

// Two fp32 accumulators c[0], c[1] rounded to one register of two fp16 (c[0] in the low half).
__device__ __forceinline__ uint32_t pack_half2(const float* c) {
    const __half2 h = __floats2half2_rn(c[0], c[1]);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// Rows [first, first + ROWS) of a (len, D) fp16 tensor into shared memory (row stride D + kPad),
// 16 bytes per cp.async; rows at or past `len` are filled with zeros (cp.async's source size 0),
// so padding rows never carry garbage (0 * NaN would be NaN). Not waited for: see below.
template <int ROWS, int D>
__device__ __forceinline__ void load_rows_async(__half* tile, const __half* src, int first,
                                                int len) {
    for (int x = threadIdx.x; x < ROWS * D / 8; x += blockDim.x) {  // x: one 16-byte chunk
        const int row = x / (D / 8);
        const int col = x % (D / 8) * 8;
        const bool inside = first + row < len;
        const unsigned to = unsigned(__cvta_generic_to_shared(tile + row * (D + kPad) + col));
        SM80_ASM("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to),
                 "l"(src + size_t(inside ? first + row : 0) * D + col), "r"(inside ? 16 : 0));
    }
}
// The copies this thread has issued so far become one group; wait until at most N groups are
// still in flight (N = 0: all of them have landed, for this thread; __syncthreads for the rest).
template <int N>
__device__ __forceinline__ void commit_and_wait() {
    SM80_ASM("cp.async.commit_group;\n" ::);
    SM80_ASM("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---------------------------------------------------------------------------------------------
// The forward: FlashAttention-2 Algorithm 1 on tensor cores. One block per (Q tile i, batch*head);
// warp w owns rows 16w .. 16w+15 of Q_i, and each thread two of them, row and row + 8 (h = 0, 1),
// holding columns 2t, 2t+1 (t = lane % 4) of every 8-column slice of S_ij and of O_i: its c-th
// column of a row is column 8 (c / 2) + 2t + c % 2, in accumulator S[c / 2][2h + c % 2].
// D: head dim, fixed at compile time so that O_i's accumulators (D/2 floats a thread) are
// registers. Bc: keys per K/V tile; S_ij's accumulators are Bc/2 floats a thread, so Bc is
// bounded by registers, and the tile rule (flash_choose_tile_fp16) picks it from shared memory.
template <int D, int Bc>
__global__ void __launch_bounds__(32 * kWarps)
flash_forward_fp16_kernel(const __half* __restrict__ Q, const __half* __restrict__ K,
                          const __half* __restrict__ V, __half* __restrict__ O,
                          float* __restrict__ L, int q_len, int kv_len, bool causal, int Tr,
                          float scale_log2) {
    constexpr int ld = D + kPad;                       // shared-memory row stride, in halves
    extern __shared__ __align__(16) __half Q_i[];      // (Br, ld), then K_j and V_j:
    __half* K_j = Q_i + kBr * ld;                      // (2, Bc, ld) each: two stages, line 7
    __half* V_j = K_j + 2 * Bc * ld;
    const int warp = threadIdx.x / 32;
    const int t = threadIdx.x % 4;                     // lane = 4 g + t
    const int i = Tr - 1 - int(blockIdx.x % Tr);       // line 3: Q tile i, longest (causal) first
    const size_t bh = blockIdx.x / Tr;                 // which (batch, head)
    const int row = i * kBr + 16 * warp + threadIdx.x % 32 / 4;  // this thread's rows: row + 8h
    const size_t kv_head = bh * kv_len * D;            // this head's K and V start here
    const int kv_end = flash_kv_end(i * kBr, kBr, q_len, kv_len, causal);  // causal: keys needed
    load_rows_async<kBr, D>(Q_i, Q + bh * q_len * D, i * kBr, q_len);  // line 4: load Q_i
    load_rows_async<Bc, D>(K_j, K + kv_head, 0, kv_end);  // line 7 for j = 0
    load_rows_async<Bc, D>(V_j, V + kv_head, 0, kv_end);
    float O_i[D / 8][4] = {};                          // line 5: O_i = 0, m = -inf, l = 0
    float m[2] = {-1e30f, -1e30f};                     // log2 units (scores carry log2 e); -1e30
    float l[2] = {0.f, 0.f};                           // stands in for -inf: e^(m_old - m) stays
                                                       // 1, not NaN, while no key has been seen
    for (int j = 0; j * Bc < kv_end; j++) {            // line 6: for each K_j, V_j
        const int stage = j % 2 * Bc * ld;             // where tile j is in K_j, V_j
        commit_and_wait<0>();                          // tile j has landed (this thread's part),
        __syncthreads();                               // everyone's; the other stage is free
        if ((j + 1) * Bc < kv_end) {                   // line 7, a tile ahead: K_{j+1}, V_{j+1}
            load_rows_async<Bc, D>(K_j + (Bc * ld - stage), K + kv_head, (j + 1) * Bc, kv_end);
            load_rows_async<Bc, D>(V_j + (Bc * ld - stage), V + kv_head, (j + 1) * Bc, kv_end);
        }
        uint32_t a[4], b[4];                           // mma operands: A (16x16), two B (16x8)
        float S[Bc / 8][4] = {};                       // line 8: S_ij = Q_i K_j^T, 16 dims a
        for (int k = 0; k < D / 16; k++) {             // step, 16 keys (two mmas) at a time
            load_16x16<false>(a, Q_i + 16 * warp * ld + 16 * k, ld);
            for (int n = 0; n < Bc / 16; n++) {
                load_16x16<false>(b, K_j + stage + 16 * n * ld + 16 * k, ld);
                mma_16x8x16(S[2 * n], a, b[0], b[2]);
                mma_16x8x16(S[2 * n + 1], a, b[1], b[3]);
            }
        }
        for (int h = 0; h < 2; h++) {                  // line 9 for row + 8h: mask, scale, max
            const int last = causal ? flash_last_key(row + 8 * h, q_len, kv_len) : kv_len - 1;
            const float m_old = m[h];
            for (int c = 0; c < Bc / 4; c++) {         // column c is key j Bc + 8(c/2) + 2t + c%2
                float& s = S[c / 2][2 * h + c % 2];
                s = j * Bc + 8 * (c / 2) + 2 * t + c % 2 <= last ? s * scale_log2 : -INFINITY;
                m[h] = fmaxf(m[h], s);
            }
            m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffffu, m[h], 1));  // over the 4 threads
            m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffffu, m[h], 2));  // that hold the row
            const float alpha = exp2f(m_old - m[h]);   // line 10's e^(m_old - m_new)
            l[h] *= alpha;
            for (int c = 0; c < D / 4; c++) O_i[c / 2][2 * h + c % 2] *= alpha;
            for (int c = 0; c < Bc / 4; c++) {         // P~_ij = exp(S_ij - m), l += rowsum(P~)
                S[c / 2][2 * h + c % 2] = exp2f(S[c / 2][2 * h + c % 2] - m[h]);
                l[h] += S[c / 2][2 * h + c % 2];
            }
        }
        for (int k = 0; k < Bc / 16; k++) {            // line 10: O_i += P~_ij V_j, 16 keys a
            const uint32_t p[4] = {pack_half2(S[2 * k]), pack_half2(S[2 * k] + 2),  // step: S's
                                   pack_half2(S[2 * k + 1]), pack_half2(S[2 * k + 1] + 2)};  // A
            for (int n = 0; n < D / 16; n++) {
                load_16x16<true>(b, V_j + stage + 16 * k * ld + 16 * n, ld);
                mma_16x8x16(O_i[2 * n], p, b[0], b[1]);
                mma_16x8x16(O_i[2 * n + 1], p, b[2], b[3]);
            }
        }
    }
    commit_and_wait<0>();                              // no copy may land after the block exits
    for (int h = 0; h < 2; h++) {                      // lines 12-15 for row + 8h, written once
        float l_row = l[h] + __shfl_xor_sync(0xffffffffu, l[h], 1);
        l_row += __shfl_xor_sync(0xffffffffu, l_row, 2);
        const size_t q = bh * q_len + row + 8 * h;     // this row's place in L (and O, x D)
        // A row that saw a key has l >= 1 (its max's own term is e^0); one that saw none has
        // l = 0 and O_i = 0: it gets O = 0 / 1 = 0 and L = -inf.
        for (int c = 0; c < D / 8 && row + 8 * h < q_len; c++)
            *reinterpret_cast<__half2*>(O + q * D + 8 * c + 2 * t) = __floats2half2_rn(
                O_i[c][2 * h] / fmaxf(l_row, 1.f), O_i[c][2 * h + 1] / fmaxf(l_row, 1.f));
        if (t == 0 && row + 8 * h < q_len)
            L[q] = l_row > 0.f ? (m[h] + log2f(l_row)) * kLn2 : -INFINITY;
    }
}

// ---------------------------------------------------------------------------------------------
// The backward: FlashAttention-2 Algorithm 2 on tensor cores, split in two kernels as in chapter 1
// so that no sum needs atomics (deterministic: every gradient element is summed by one thread, in
// a fixed order). Kernel 1 swaps the paper's loops (one block per Q tile: dQ_i and D_i); kernel 2
// keeps them (one block per K/V tile: dK_j, dV_j). Both recompute S and P from L (line 11), so
// the backward does 7 products where FA2 with atomics does 5.
// Tiles (measured on the H100, NOTES.md section 14): kernel 1 streams K/V tiles of Bc = 32 keys
// past a 128-row Q tile, 32 rows a warp (64 and 16 at d = 256); kernel 2 streams Q tiles of Br = 64
// queries past a 64-key K/V tile (32 at d = 256, so that its shared memory fits an A100's 163 KB).
static constexpr int kBwdBc = 32;  // kernel 1: keys per K/V tile
// Kernel 1: 16-row mma tiles per warp. With two, every K_j or V_j fragment a warp loads from shared
// memory feeds two mmas, not one (+1-7% on the H100, NOTES.md section 14); at d = 256 two tiles'
// dQ_i would need 256 accumulators a thread, more than it may have.
constexpr int dq_M(int head_dim) { return head_dim <= 128 ? 2 : 1; }
constexpr int dq_Br(int head_dim) { return 16 * dq_M(head_dim) * kWarps; }  // kernel 1: Q tile rows
constexpr int dkdv_Br(int head_dim) { return head_dim <= 128 ? 64 : 32; }  // kernel 2: Q tile rows
static constexpr int kBc = 16 * kWarps;  // kernel 2: keys per block (16 per warp)
// Registers: at d <= 64 three blocks of 128 threads fit an SM (<= 168 registers a thread); at
// d = 96, 128 kernel 2's dK_j and dV_j accumulators (D floats a thread) and kernel 1's two tiles of
// dQ_i need up to 252, so two; at d = 256 one (shared memory allows no more), and dK_j, dV_j take a
// launch each (below).
template <int D>
constexpr int kBwdMinBlocks = D <= 64 ? 3 : D <= 128 ? 2 : 1;
// Which of dK_j and dV_j a launch of kernel 2 computes: both, or, at d = 256, where the two
// accumulators (256 floats a thread) cannot fit in a thread's 255 registers, one per launch.
enum Grads { kDKdV, kOnlyDV, kOnlyDK };
template <int D>
constexpr Grads kGradsPerLaunch = D <= 128 ? kDKdV : kOnlyDV;  // kOnlyDV: then a kOnlyDK launch

// The same for N floats of a vector (4 bytes per cp.async): entries at or past `len` become 0.
template <int N>
__device__ __forceinline__ void load_floats_async(float* to, const float* src, int first,
                                                  int len) {
    for (int x = threadIdx.x; x < N; x += blockDim.x) {
        const bool inside = first + x < len;
        SM80_ASM("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(unsigned(
                     __cvta_generic_to_shared(to + x))),
                 "l"(src + (inside ? first + x : 0)), "r"(inside ? 4 : 0));
    }
}
// The two shapes of product in Algorithm 2, each the loop the forward writes out inline, for one
// warp that owns M tiles of 16 rows (acc[m]: rows 16m .. 16m + 15; kernel 2 passes one, &S).
// acc (16M x N, fp32 accumulators) += A B^T: A the warp's 16M rows of a shared-memory tile, B N
// rows of another, both K columns wide (the forward's S = Q_i K_j^T: B's rows are the mma's
// columns, so no transpose). Each B fragment is loaded once and feeds M mmas.
template <int M, int N, int K>
__device__ __forceinline__ void mma_ABt(float (*acc)[N / 8][4], const __half* A, const __half* B,
                                        int ld) {
    uint32_t a[M][4], b[4];
    for (int k = 0; k < K / 16; k++) {
        for (int m = 0; m < M; m++) load_16x16<false>(a[m], A + 16 * m * ld + 16 * k, ld);
        for (int n = 0; n < N / 16; n++) {
            load_16x16<false>(b, B + 16 * n * ld + 16 * k, ld);
            for (int m = 0; m < M; m++) {
                mma_16x8x16(acc[m][2 * n], a[m], b[0], b[2]);
                mma_16x8x16(acc[m][2 * n + 1], a[m], b[1], b[3]);
            }
        }
    }
}
// acc (16M x N) += P B: P (16M x K) the accumulators of an earlier product, rounded to fp16 where
// they are (two 16x8 C tiles are one 16x16 A tile), B K rows of a tile, N columns (the forward's
// O_i += P~ V_j: B's rows are the mma's k, so .trans).
template <int M, int K, int N>
__device__ __forceinline__ void mma_PB(float (*acc)[N / 8][4], float (*P)[K / 8][4],
                                       const __half* B, int ld) {
    uint32_t b[4];
    for (int k = 0; k < K / 16; k++) {
        uint32_t p[M][4];
        for (int m = 0; m < M; m++) {
            p[m][0] = pack_half2(P[m][2 * k]);
            p[m][1] = pack_half2(P[m][2 * k] + 2);
            p[m][2] = pack_half2(P[m][2 * k + 1]);
            p[m][3] = pack_half2(P[m][2 * k + 1] + 2);
        }
        for (int n = 0; n < N / 16; n++) {
            load_16x16<true>(b, B + 16 * k * ld + 16 * n, ld);
            for (int m = 0; m < M; m++) {
                mma_16x8x16(acc[m][2 * n], p[m], b[0], b[1]);
                mma_16x8x16(acc[m][2 * n + 1], p[m], b[2], b[3]);
            }
        }
    }
}

// Kernel 1 of 2: dQ (and D). One block per (Q tile i, batch*head); warp w owns M tiles of 16 rows
// of Q_i (rows 16Mw .. 16Mw + 16M - 1), a thread rows row + 8r, r < 2M (in tile r / 2, its top or
// bottom 8 rows by r % 2) and, of every 8-column slice of S, dP, dS and dQ_i, columns 2t, 2t+1 (as
// in the forward, which has M = 1). Q_i and dO_i stay in shared memory; K_j, V_j stream through it, two
// stages (cp.async). Bc: keys per K/V tile. M: 2 where the registers allow (dq_M, above).
template <int D, int Bc, int M>
__global__ void __launch_bounds__(32 * kWarps, kBwdMinBlocks<D>)
flash_backward_dq_fp16_kernel(const __half* __restrict__ Q, const __half* __restrict__ K,
                              const __half* __restrict__ V, const __half* __restrict__ O,
                              const __half* __restrict__ dO, const float* __restrict__ L,
                              float* __restrict__ Dsum, __half* __restrict__ dQ, int q_len,
                              int kv_len, bool causal, int Tr, float scale_log2) {
    constexpr int ld = D + kPad;
    constexpr int Br = 16 * M * kWarps;                // query rows per block
    extern __shared__ __align__(16) __half Q_i[];      // (Br, ld); then dO_i (Br, ld);
    __half* dO_i = Q_i + Br * ld;                      // then K_j, V_j: (2, Bc, ld) each
    __half* K_j = dO_i + Br * ld;
    __half* V_j = K_j + 2 * Bc * ld;
    const int warp = threadIdx.x / 32;
    const int t = threadIdx.x % 4;                     // lane = 4 g + t
    const int i = Tr - 1 - int(blockIdx.x % Tr);       // Q tile i, longest (causal) first
    const size_t bh = blockIdx.x / Tr;
    const int row = i * Br + 16 * M * warp + threadIdx.x % 32 / 4;  // this thread's rows: row + 8r
    const size_t q_head = bh * q_len * D, kv_head = bh * kv_len * D;
    const int kv_end = flash_kv_end(i * Br, Br, q_len, kv_len, causal);  // causal: keys needed
    load_rows_async<Br, D>(Q_i, Q + q_head, i * Br, q_len);      // line 9: load Q_i, dO_i
    load_rows_async<Br, D>(dO_i, dO + q_head, i * Br, q_len);
    load_rows_async<Bc, D>(K_j, K + kv_head, 0, kv_end);         // line 6 for j = 0
    load_rows_async<Bc, D>(V_j, V + kv_head, 0, kv_end);
    float L_i[2 * M], D_i[2 * M];                      // line 9: L_i (log2 units) and ...
    for (int r = 0; r < 2 * M; r++) {                  // line 4: D_i = rowsum(dO_i o O_i), fp32
        const bool inside = row + 8 * r < q_len;       // (read from global while Q_i, dO_i land)
        const size_t q = bh * q_len + (inside ? row + 8 * r : 0);
        const __half2* O_q = reinterpret_cast<const __half2*>(O + q * D) + t;  // columns 8c + 2t,
        const __half2* dO_q = reinterpret_cast<const __half2*>(dO + q * D) + t;  // 8c + 2t + 1
        float sum = 0.f;
        for (int c = 0; c < D / 8; c++) {
            const float2 o = __half22float2(O_q[4 * c]), g = __half22float2(dO_q[4 * c]);
            sum += o.x * g.x + o.y * g.y;
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);   // over the quad that holds the row
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        D_i[r] = inside ? sum : 0.f;
        L_i[r] = inside ? L[q] * kLog2e : 0.f;         // -inf for a row that sees no key
        if (inside && t == 0) Dsum[q] = sum;           // for kernel 2
    }
    float dQ_i[M][D / 8][4] = {};                      // dQ_i, accumulated in registers
    for (int j = 0; j * Bc < kv_end; j++) {            // line 5: for each K_j, V_j
        const int stage = j % 2 * Bc * ld;             // where tile j is in K_j, V_j
        commit_and_wait<0>();                          // tile j (and Q_i, dO_i) landed; the
        __syncthreads();                               // other stage is free
        if ((j + 1) * Bc < kv_end) {                   // line 6, a tile ahead: K_{j+1}, V_{j+1}
            load_rows_async<Bc, D>(K_j + (Bc * ld - stage), K + kv_head, (j + 1) * Bc, kv_end);
            load_rows_async<Bc, D>(V_j + (Bc * ld - stage), V + kv_head, (j + 1) * Bc, kv_end);
        }
        float S[M][Bc / 8][4] = {}, dP[M][Bc / 8][4] = {};
        mma_ABt<M, Bc, D>(S, Q_i + 16 * M * warp * ld, K_j + stage, ld);    // 10: S = Q_i K_j^T
        mma_ABt<M, Bc, D>(dP, dO_i + 16 * M * warp * ld, V_j + stage, ld);  // 13: dP = dO_i V_j^T
        for (int r = 0; r < 2 * M; r++) {              // row + 8r sees keys 0 .. last
            const int last = causal ? min(flash_last_key(row + 8 * r, q_len, kv_len), kv_len - 1)
                                    : kv_len - 1;
            for (int c = 0; c < Bc / 4; c++) {         // column c is key j Bc + 8(c/2) + 2t + c%2
                float& s = S[r / 2][c / 2][2 * (r % 2) + c % 2];
                const bool seen = j * Bc + 8 * (c / 2) + 2 * t + c % 2 <= last;
                const float P = seen ? exp2f(s * scale_log2 - L_i[r]) : 0.f;  // line 11
                s = P * (dP[r / 2][c / 2][2 * (r % 2) + c % 2] - D_i[r]);  // line 14: dS =
            }                                          // P o (dP - D_i), in S's registers
        }
        mma_PB<M, Bc, D>(dQ_i, S, K_j + stage, ld);     // line 15: dQ_i += dS K_j
    }
    commit_and_wait<0>();                              // no copy may land after the block exits
    for (int r = 0; r < 2 * M; r++)                    // dQ = dQ_i / sqrt(d) (S was unscaled)
        for (int c = 0; c < D / 8 && row + 8 * r < q_len; c++)
            *reinterpret_cast<__half2*>(dQ + q_head + size_t(row + 8 * r) * D + 8 * c + 2 * t) =
                __floats2half2_rn(dQ_i[r / 2][c][2 * (r % 2)] * rsqrtf(D),
                                  dQ_i[r / 2][c][2 * (r % 2) + 1] * rsqrtf(D));
}

// Kernel 2 of 2: dK and dV, in Algorithm 2's order. One block per (K/V tile j, batch*head), warp
// w owns keys 16w..16w+15 of K_j, a thread keys `key` and key + 8 (h = 0, 1). Everything is
// transposed: S^T = K_j Q_i^T has a key per row and a query per column, so each thread needs L
// and D of its columns' queries: they are staged in shared memory beside Q_i and dO_i, which
// stream through it in tiles of Br queries, two stages. K_j, V_j stay in shared memory. G: which
// of dK_j, dV_j this launch computes (an only-dV launch skips lines 13-16; the other, line 12).
template <int D, int Br, Grads G>
__global__ void __launch_bounds__(32 * kWarps, kBwdMinBlocks<D>)
flash_backward_dkdv_fp16_kernel(const __half* __restrict__ Q, const __half* __restrict__ K,
                                const __half* __restrict__ V, const __half* __restrict__ dO,
                                const float* __restrict__ L, const float* __restrict__ Dsum,
                                __half* __restrict__ dK, __half* __restrict__ dV, int q_len,
                                int kv_len, bool causal, int Tc, float scale_log2) {
    constexpr int ld = D + kPad;
    extern __shared__ __align__(16) __half K_j[];      // (Bc, ld); then V_j (Bc, ld); then
    __half* V_j = K_j + kBc * ld;                      // Q_i, dO_i (2, Br, ld) each; then
    __half* Q_i = V_j + kBc * ld;                      // L_i, D_i (2, Br) floats each
    __half* dO_i = Q_i + 2 * Br * ld;
    float* L_i = reinterpret_cast<float*>(dO_i + 2 * Br * ld);
    float* D_i = L_i + 2 * Br;
    const int warp = threadIdx.x / 32;
    const int t = threadIdx.x % 4;
    const int j = int(blockIdx.x % Tc);                // line 5: for each K_j, V_j (the grid;
    const size_t bh = blockIdx.x / Tc;                 // causal: the longest, j = 0, first)
    const int key = j * kBc + 16 * warp + threadIdx.x % 32 / 4;  // this thread's keys: key + 8h
    const size_t q_head = bh * q_len * D, kv_head = bh * kv_len * D;
    const int q_begin = causal ? max(0, flash_first_query(j * kBc, q_len, kv_len)) : 0;
    load_rows_async<kBc, D>(K_j, K + kv_head, j * kBc, kv_len);  // line 6: load K_j, V_j
    load_rows_async<kBc, D>(V_j, V + kv_head, j * kBc, kv_len);
    load_rows_async<Br, D>(Q_i, Q + q_head, q_begin, q_len);     // line 9 for the first Q_i
    load_rows_async<Br, D>(dO_i, dO + q_head, q_begin, q_len);
    load_floats_async<Br>(L_i, L + bh * q_len, q_begin, q_len);
    load_floats_async<Br>(D_i, Dsum + bh * q_len, q_begin, q_len);
    float dK_j[D / 8][4] = {}, dV_j[D / 8][4] = {};    // line 7: dK_j = 0, dV_j = 0
    for (int it = 0; q_begin + it * Br < q_len; it++) {  // line 8: for each Q_i (from q_begin)
        const int q0 = q_begin + it * Br, stage = it % 2 * Br * ld, fstage = it % 2 * Br;
        commit_and_wait<0>();
        __syncthreads();
        if (q0 + Br < q_len) {                         // line 9, a tile ahead: Q_i, dO_i, L_i, D_i
            load_rows_async<Br, D>(Q_i + (Br * ld - stage), Q + q_head, q0 + Br, q_len);
            load_rows_async<Br, D>(dO_i + (Br * ld - stage), dO + q_head, q0 + Br, q_len);
            load_floats_async<Br>(L_i + (Br - fstage), L + bh * q_len, q0 + Br, q_len);
            load_floats_async<Br>(D_i + (Br - fstage), Dsum + bh * q_len, q0 + Br, q_len);
        }
        float S[Br / 8][4] = {}, dP[Br / 8][4] = {};
        mma_ABt<1, Br, D>(&S, K_j + 16 * warp * ld, Q_i + stage, ld);  // 10: S^T = K_j Q_i^T
        for (int h = 0; h < 2; h++) {                  // line 11: P^T = exp(S^T - L_i), masked:
            const int first = key + 8 * h >= kv_len ? q_len  // key + 8h is seen by queries
                              : causal ? flash_first_query(key + 8 * h, q_len, kv_len) : 0;
            const int lo = first - q0 - 2 * t, hi = q_len - q0 - 2 * t;  // first .. q_len - 1
            for (int c = 0; c < Br / 4; c++) {         // column c is query q0 + 2t + x, x below
                const int x = 8 * (c / 2) + c % 2;
                float& s = S[c / 2][2 * h + c % 2];
                s = x >= lo && x < hi ? exp2f(s * scale_log2 - L_i[fstage + 2 * t + x] * kLog2e)
                                      : 0.f;
            }
        }
        if constexpr (G != kOnlyDK)
            mma_PB<1, Br, D>(&dV_j, &S, dO_i + stage, ld);        // line 12: dV_j += P^T dO_i
        if constexpr (G == kOnlyDV) continue;
        mma_ABt<1, Br, D>(&dP, V_j + 16 * warp * ld, dO_i + stage, ld);  // 13: dP^T = V_j dO_i^T
        for (int h = 0; h < 2; h++)                    // line 14: dS^T = P^T o (dP^T - D_i),
            for (int c = 0; c < Br / 4; c++)           // in dP's registers
                dP[c / 2][2 * h + c % 2] = S[c / 2][2 * h + c % 2] *
                    (dP[c / 2][2 * h + c % 2] - D_i[fstage + 8 * (c / 2) + 2 * t + c % 2]);
        mma_PB<1, Br, D>(&dK_j, &dP, Q_i + stage, ld);           // line 16: dK_j += dS^T Q_i
    }
    commit_and_wait<0>();
    for (int h = 0; h < 2; h++)                        // line 18: write dK_j / sqrt(d), dV_j
        for (int c = 0; c < D / 8 && key + 8 * h < kv_len; c++) {
            const size_t at = kv_head + size_t(key + 8 * h) * D + 8 * c + 2 * t;
            if (G != kOnlyDV)
                *reinterpret_cast<__half2*>(dK + at) = __floats2half2_rn(
                    dK_j[c][2 * h] * rsqrtf(D), dK_j[c][2 * h + 1] * rsqrtf(D));
            if (G != kOnlyDK)
                *reinterpret_cast<__half2*>(dV + at) =
                    __floats2half2_rn(dV_j[c][2 * h], dV_j[c][2 * h + 1]);
        }
}

// ---------------------------------------------------------------------------------------------
// The tile. Br = 16 * kWarps = 64 is set by the mma (16 rows a warp). Bc is set by registers
// (S_ij's accumulators, Bc/2 floats a thread, beside O_i's D/2): 64 at most, and a multiple of 16
// (the k of the P~ V mma). Between 64 and 32 the SM's shared memory decides, in the spirit of the
// paper's Bc = M/4d: a block holds Q_i and two stages of K_j and V_j, and kFp16BlocksPerSM blocks
// should share an SM, so that while some warps do the softmax on the CUDA cores others keep the
// tensor cores busy. Bc = 64 when that many blocks fit, otherwise 32. (Measured on the H100 in
// NOTES.md chapter 2: at d = 128, Bc = 32 with 4 blocks an SM beat Bc = 64 with 2.)
static constexpr int kFp16BlocksPerSM = 4;

static size_t fp16_shared_bytes(int head_dim, int Bc) {  // Q_i, 2 x K_j, 2 x V_j
    return size_t(kBr + 4 * Bc) * (head_dim + kPad) * sizeof(__half);
}

static FlashTile fp16_tile(const cudaDeviceProp& prop, int head_dim, int Bc) {
    const FlashTile tile{kBr, Bc, 32 * kWarps, 4, fp16_shared_bytes(head_dim, Bc)};
    if (tile.shared_bytes > prop.sharedMemPerBlockOptin)
        throw std::runtime_error("device " + std::string(prop.name) + " has too little shared " +
                                 "memory for the fp16 tile at head_dim " +
                                 std::to_string(head_dim));
    return tile;
}

// Chapter 2's instructions (mma.sync.m16n8k16, cp.async) need compute capability 8.0.
static void require_sm80(const cudaDeviceProp& prop, const char* fn) {
    if (prop.major < 8)
        throw std::runtime_error(std::string(fn) + " needs a GPU of compute capability 8.0 or " +
                                 "newer (mma.sync.m16n8k16, cp.async); " + prop.name + " is " +
                                 std::to_string(prop.major) + "." + std::to_string(prop.minor));
}

FlashTile flash_choose_tile_fp16(const cudaDeviceProp& prop, int head_dim) {
    require_head_dim(head_dim, kFlashFp16HeadDims);
    require_sm80(prop, "flash_forward_fp16");
    const size_t per_block = prop.sharedMemPerMultiprocessor / kFp16BlocksPerSM;
    const bool fits_64 =
        fp16_shared_bytes(head_dim, 64) + prop.reservedSharedMemPerBlock <= per_block;
    return fp16_tile(prop, head_dim, fits_64 ? 64 : 32);
}

// ---------------------------------------------------------------------------------------------
// Launchers (host): every check (checks.cpp) before anything is launched.

template <int D, int Bc>
static void launch_forward_fp16(const __half* Q, const __half* K, const __half* V, __half* O,
                                float* L, const AttentionShape& s, const FlashTile& tile,
                                cudaStream_t stream) {
    auto kernel = flash_forward_fp16_kernel<D, Bc>;
    const int Tr = (s.q_len + kBr - 1) / kBr;  // Q tiles per head
    const int blocks = grid_blocks(s, s.q_len, kBr, "q_len");
    allow_shared(kernel, tile.shared_bytes);
    kernel<<<blocks, tile.threads, tile.shared_bytes, stream>>>(
        Q, K, V, O, L, s.q_len, s.kv_len, s.causal, Tr, kLog2e / sqrtf(float(D)));
    FLASH_CUDA_CHECK(cudaGetLastError());
}

// Bc: keys per K/V tile given by the caller (32 or 64), or none for the device-derived choice.
static void forward_fp16_checked(const __half* Q, const __half* K, const __half* V, __half* O,
                                 float* L, const AttentionShape& s, std::optional<int> Bc,
                                 cudaStream_t stream) {
    validate_shape(s, kFlashFp16HeadDims, sizeof(__half));
    if (Bc)
        require(*Bc == 32 || *Bc == 64,
                "Bc = " + std::to_string(*Bc) + " is invalid; allowed values: 32, 64");
    validate_forward_pointers("flash_forward_fp16", Q, K, V, O, L, s);
    const cudaDeviceProp prop = flash_device_props();
    FlashTile tile = flash_choose_tile_fp16(prop, s.head_dim);
    if (Bc) tile = fp16_tile(prop, s.head_dim, *Bc);
    dispatch_head_dim<kFlashFp16HeadDims>(s.head_dim, [&](auto dim) {
        constexpr int D = decltype(dim)::value;
        if (tile.Bc == 64) launch_forward_fp16<D, 64>(Q, K, V, O, L, s, tile, stream);
        else launch_forward_fp16<D, 32>(Q, K, V, O, L, s, tile, stream);
    });
}

void flash_forward_fp16(const __half* Q, const __half* K, const __half* V, __half* O, float* L,
                        const AttentionShape& shape, cudaStream_t stream) {
    forward_fp16_checked(Q, K, V, O, L, shape, std::nullopt, stream);
}

void flash_forward_fp16_bc(const __half* Q, const __half* K, const __half* V, __half* O,
                           float* L, const AttentionShape& shape, int Bc, cudaStream_t stream) {
    forward_fp16_checked(Q, K, V, O, L, shape, Bc, stream);
}

// The backward's tile: Br = dq_Br query rows a block in kernel 1 (128; 64 at d = 256), Bc =
// kBwdBc keys a K/V tile (kernel 2's blocks own kBc = 64 keys and stream Q tiles of dkdv_Br rows).
// Shared memory: kernel 1 holds Q_i, dO_i and two stages of K_j, V_j; kernel 2 holds K_j, V_j and
// two stages of Q_i, dO_i and of L_i, D_i. At d = 256 that is 132 KB: an A100 or an H100, not a
// GPU with 99 KB (sm_86, sm_89).
static size_t dq_shared_bytes(int head_dim) {
    return size_t(2 * dq_Br(head_dim) + 4 * kBwdBc) * (head_dim + kPad) * sizeof(__half);
}
static size_t dkdv_shared_bytes(int head_dim) {
    return size_t(2 * kBc + 4 * dkdv_Br(head_dim)) * (head_dim + kPad) * sizeof(__half) +
           4 * dkdv_Br(head_dim) * sizeof(float);
}

FlashTile flash_choose_tile_fp16_backward(const cudaDeviceProp& prop, int head_dim) {
    require_head_dim(head_dim, kFlashFp16HeadDims);
    require_sm80(prop, "flash_backward_fp16");
    const size_t bytes = std::max(dq_shared_bytes(head_dim), dkdv_shared_bytes(head_dim));
    if (bytes > prop.sharedMemPerBlockOptin)
        throw std::runtime_error("device " + std::string(prop.name) + " has too little shared " +
                                 "memory for the fp16 backward at head_dim " +
                                 std::to_string(head_dim));
    return {dq_Br(head_dim), kBwdBc, 32 * kWarps, 4, bytes};
}

template <int D>
static void launch_backward_fp16(const __half* Q, const __half* K, const __half* V,
                                 const __half* O, const __half* dO, const float* L, __half* dQ,
                                 __half* dK, __half* dV, const AttentionShape& s,
                                 cudaStream_t stream) {
    auto dq_kernel = flash_backward_dq_fp16_kernel<D, kBwdBc, dq_M(D)>;
    constexpr Grads G = kGradsPerLaunch<D>;  // kDKdV, or at d = 256 kOnlyDV, then kOnlyDK
    auto dkdv_kernel = flash_backward_dkdv_fp16_kernel<D, dkdv_Br(D), G>;
    const int Tr = (s.q_len + dq_Br(D) - 1) / dq_Br(D);  // Q tiles per head (kernel 1's blocks)
    const int Tc = (s.kv_len + kBc - 1) / kBc;  // K/V tiles per head (kernel 2's blocks)
    const int q_blocks = grid_blocks(s, s.q_len, dq_Br(D), "q_len");
    const int kv_blocks = grid_blocks(s, s.kv_len, kBc, "kv_len");
    allow_shared(dq_kernel, dq_shared_bytes(D));
    allow_shared(dkdv_kernel, dkdv_shared_bytes(D));
    if constexpr (G == kOnlyDV)  // d = 256: kernel 2 again, for dK
        allow_shared(flash_backward_dkdv_fp16_kernel<D, dkdv_Br(D), kOnlyDK>, dkdv_shared_bytes(D));
    const float scale_log2 = kLog2e / sqrtf(float(D));
    // Dsum: D_i = rowsum(dO_i * O_i), (B, H, q_len) floats, the backward's only extra memory.
    with_row_scratch(s, stream, [&](float* Dsum) {
        dq_kernel<<<q_blocks, 32 * kWarps, dq_shared_bytes(D), stream>>>(
            Q, K, V, O, dO, L, Dsum, dQ, s.q_len, s.kv_len, s.causal, Tr, scale_log2);
        const cudaError_t launched = cudaGetLastError();
        if (launched != cudaSuccess) return launched;
        dkdv_kernel<<<kv_blocks, 32 * kWarps, dkdv_shared_bytes(D), stream>>>(  // after dq_kernel
            Q, K, V, dO, L, Dsum, dK, dV, s.q_len, s.kv_len, s.causal, Tc, scale_log2);
        if constexpr (G == kOnlyDV) {  // d = 256: that launch wrote dV; this one writes dK
            const cudaError_t launched_dv = cudaGetLastError();
            if (launched_dv != cudaSuccess) return launched_dv;
            auto dk_kernel = flash_backward_dkdv_fp16_kernel<D, dkdv_Br(D), kOnlyDK>;
            dk_kernel<<<kv_blocks, 32 * kWarps, dkdv_shared_bytes(D), stream>>>(
                Q, K, V, dO, L, Dsum, dK, dV, s.q_len, s.kv_len, s.causal, Tc, scale_log2);
        }
        return cudaGetLastError();
    });
}

void flash_backward_fp16(const __half* Q, const __half* K, const __half* V, const __half* O,
                         const __half* dO, const float* L, __half* dQ, __half* dK, __half* dV,
                         const AttentionShape& s, cudaStream_t stream) {
    validate_shape(s, kFlashFp16HeadDims, sizeof(__half));
    validate_backward_pointers("flash_backward_fp16", Q, K, V, O, dO, L, dQ, dK, dV, s);
    flash_choose_tile_fp16_backward(flash_device_props(), s.head_dim);  // refuses what cannot run
    dispatch_head_dim<kFlashFp16HeadDims>(s.head_dim, [&](auto dim) {
        launch_backward_fp16<decltype(dim)::value>(Q, K, V, O, dO, L, dQ, dK, dV, s, stream);
    });
}
