// flash_fp16.cu: chapter 2, the FlashAttention-2 forward on tensor cores: fp16 Q, K, V, O; the
// softmax statistics (m, l, L) and every accumulation in fp32. Same contract as chapter 1's
// flash_forward (flash.h); read it beside flash.cu and FA2's Algorithm 1.
//
// Build and test:   make test        Demo:   ./flash_bench --dtype fp16
//
// What changes from chapter 1: the two matrix products of Algorithm 1, S = Q_i K_j^T (line 8) and
// O_i += P V_j (line 10), run as mma.sync.m16n8k16 instructions, each a 16x8x16 product by one
// warp. Their operands and results live in registers in the layouts the PTX ISA documents
// ("Matrix Fragments for mma.m16n8k16"); NOTES.md chapter 2 draws them. The one fact that makes
// FA2 fit in registers: the fp32 accumulator of S, rounded to fp16, is already laid out as the A
// operand of the next mma, so P goes from S to P V without touching shared memory.
#include "flash.h"

#include <cuda_fp16.h>

#include <cstdint>

// The block: kWarps warps, each owning 16 query rows (the M of one mma), so Br = 16 * kWarps.
static constexpr int kWarps = 4;
// Shared-memory rows are D + kPad halves long. Unpadded, the 8 rows one ldmatrix reads start a
// multiple of 128 bytes apart and hit the same banks (an 8-way conflict); 8 halves (16 bytes) of
// padding shift each row by 4 banks, so the 8 rows cover all 32.
static constexpr int kPad = 8;

// ---------------------------------------------------------------------------------------------
// Fragment helpers: one mma, one 16x16 shared-memory load, one async copy. Everything in them is
// a documented PTX instruction; none is needed to follow the algorithm, only to run it.

// C (16x8, fp32) += A (16x16, fp16, row-major) * B (16x8, fp16, "col": B's columns contiguous).
// Per thread (lane = 4g + t): a: 4 registers of 2 halves; b: 2; c: rows g and g+8, cols 2t, 2t+1.
__device__ __forceinline__ void mma_16x8x16(float c[4], const uint32_t a[4], uint32_t b0,
                                            uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The 16x16 block of a shared-memory array (row stride `ld` halves) whose top-left is `tile`, as
// four 8x8 quarters: r[0] rows 0-7 cols 0-7, r[1] rows 8-15 cols 0-7, r[2] rows 0-7 cols 8-15,
// r[3] rows 8-15 cols 8-15. Lane L points at row L % 16, column 8 * (L / 16). Each thread gets
// 2 halves of each quarter: (row g, cols 2t, 2t+1), or with Trans (rows 2t, 2t+1, col g).
template <bool Trans>
__device__ __forceinline__ void load_16x16(uint32_t r[4], const __half* tile, int ld) {
    const int lane = threadIdx.x % 32;
    const unsigned p = unsigned(__cvta_generic_to_shared(tile + (lane % 16) * ld + lane / 16 * 8));
    if constexpr (Trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(p));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(p));
}

// Two fp32 values rounded to one register of two fp16 (lo in the low half: the lower column).
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// Rows [first, first + ROWS) of a (len, D) fp16 tensor into shared memory (row stride D + kPad),
// 16 bytes per cp.async, all in flight at once; rows at or past `len` are filled with zeros
// (cp.async's source size 0), so padding rows never carry garbage (0 * NaN would be NaN).
template <int ROWS, int D>
__device__ __forceinline__ void load_rows_async(__half* tile, const __half* src, int first,
                                                int len) {
    constexpr int chunks = D / 8;  // 16-byte chunks per row
    for (int x = threadIdx.x; x < ROWS * chunks; x += blockDim.x) {
        const int row = x / chunks;
        const int col = x % chunks * 8;
        const bool inside = first + row < len;
        const __half* from = src + size_t(inside ? first + row : 0) * D + col;
        const unsigned to = unsigned(__cvta_generic_to_shared(tile + row * (D + kPad) + col));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(from),
                     "r"(inside ? 16 : 0));
    }
    asm volatile("cp.async.commit_group;\n" ::);
}
// Wait until at most N of this thread's committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void wait_copies() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---------------------------------------------------------------------------------------------
// The forward: FlashAttention-2 Algorithm 1 on tensor cores. One block per (Q tile i, batch*head);
// warp w owns rows 16w .. 16w+15 of Q_i, and each thread two of them: r = lane / 4 and r + 8,
// holding columns 2t, 2t+1 (t = lane % 4) of every 8-column slice of S_ij and of O_i.
// D: head dim, fixed at compile time so that O_i's accumulators (D/2 floats a thread) are
// registers. Bc: keys per K/V tile; S_ij's accumulators are Bc/2 floats a thread, so Bc is
// bounded by registers and chosen by the tile rule (flash_choose_tile_fp16).
template <int D, int Bc>
__global__ void __launch_bounds__(32 * kWarps)
flash_forward_fp16_kernel(const __half* __restrict__ Q, const __half* __restrict__ K,
                          const __half* __restrict__ V, __half* __restrict__ O,
                          float* __restrict__ L, int q_len, int kv_len, bool causal, int Tr,
                          float scale_log2) {
    constexpr int Br = 16 * kWarps;
    constexpr int ld = D + kPad;                       // shared-memory row stride, in halves
    extern __shared__ __align__(16) __half smem[];
    __half* Q_i = smem;                                // (Br, ld)
    __half* K_j = Q_i + Br * ld;                       // (2, Bc, ld): two stages, see line 7
    __half* V_j = K_j + 2 * Bc * ld;                   // (2, Bc, ld)
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int i = Tr - 1 - int(blockIdx.x % Tr);       // line 3: Q tile i, longest (causal) first
    const size_t bh = blockIdx.x / Tr;                 // which (batch, head)
    const int first_row = i * Br;
    const int row = first_row + 16 * warp + lane / 4;  // this thread's rows: row and row + 8
    const int diag = kv_len - q_len;                   // causal: query q sees keys <= q + diag
    Q += bh * q_len * D;
    K += bh * kv_len * D;
    V += bh * kv_len * D;
    // Causal: keys past the block's last row's last key are never seen: those tiles are skipped.
    const int kv_end = causal ? min(kv_len, min(first_row + Br, q_len) + diag) : kv_len;
    const int Tc = kv_end > 0 ? (kv_end + Bc - 1) / Bc : 0;
    load_rows_async<Br, D>(Q_i, Q, first_row, q_len);  // line 4: load Q_i
    load_rows_async<Bc, D>(K_j, K, 0, kv_end);         // line 7 for j = 0
    load_rows_async<Bc, D>(V_j, V, 0, kv_end);
    float O_i[D / 8][4] = {};                          // line 5: O_i = 0, m = -inf, l = 0
    float m[2] = {-INFINITY, -INFINITY};               // (log2 units: scores carry log2(e))
    float l[2] = {0.f, 0.f};                           // this thread's part of each row's sum
    for (int j = 0; j < Tc; j++) {                     // line 6: for each K_j, V_j
        const __half* K_s = K_j + (j % 2) * Bc * ld;
        const __half* V_s = V_j + (j % 2) * Bc * ld;
        if (j + 1 < Tc) {                              // line 7, one tile ahead: K_{j+1}, V_{j+1}
            load_rows_async<Bc, D>(K_j + (j + 1) % 2 * Bc * ld, K, (j + 1) * Bc, kv_end);
            load_rows_async<Bc, D>(V_j + (j + 1) % 2 * Bc * ld, V, (j + 1) * Bc, kv_end);
            wait_copies<2>();                          // all but the two just issued have landed
        } else {
            wait_copies<0>();
        }
        __syncthreads();
        float S[Bc / 8][4] = {};                       // line 8: S_ij = Q_i K_j^T, 16 columns at
        for (int k = 0; k < D / 16; k++) {             // a time (two mmas of 8), 16 dims a step
            uint32_t a[4], b[4];
            load_16x16<false>(a, Q_i + 16 * warp * ld + 16 * k, ld);
            for (int n = 0; n < Bc / 16; n++) {
                load_16x16<false>(b, K_s + 16 * n * ld + 16 * k, ld);
                mma_16x8x16(S[2 * n], a, b[0], b[2]);
                mma_16x8x16(S[2 * n + 1], a, b[1], b[3]);
            }
        }
        for (int h = 0; h < 2; h++) {                  // line 9, for rows row (h=0), row+8 (h=1)
            const int last_key = causal ? min(row + 8 * h + diag, kv_end - 1) : kv_end - 1;
            float m_new = m[h];                        // m = max(m, rowmax(S_ij)), masked -inf
            for (int n = 0; n < Bc / 8; n++)
                for (int e = 0; e < 2; e++) {
                    const int key = j * Bc + 8 * n + 2 * (lane % 4) + e;
                    float& s = S[n][2 * h + e];
                    s = key <= last_key ? s * scale_log2 : -INFINITY;
                    m_new = fmaxf(m_new, s);
                }
            m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, 1));  // the row's 4 threads
            m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, 2));
            const float m_ref = m_new == -INFINITY ? 0.f : m_new;  // no key seen yet: no NaN
            const float alpha = exp2f(m[h] - m_ref);   // line 10: O_i, l rescaled by e^(m_old - m)
            m[h] = m_new;
            l[h] *= alpha;
            for (int n = 0; n < D / 8; n++) {
                O_i[n][2 * h] *= alpha;
                O_i[n][2 * h + 1] *= alpha;
            }
            for (int n = 0; n < Bc / 8; n++)           // P~_ij = exp(S_ij - m), l += rowsum
                for (int e = 0; e < 2; e++) {
                    S[n][2 * h + e] = exp2f(S[n][2 * h + e] - m_ref);
                    l[h] += S[n][2 * h + e];
                }
        }
        for (int k = 0; k < Bc / 16; k++) {            // line 10: O_i += P~_ij V_j: S's
            const uint32_t p[4] = {pack_half2(S[2 * k][0], S[2 * k][1]),  // accumulators of 16
                                   pack_half2(S[2 * k][2], S[2 * k][3]),  // keys are the A
                                   pack_half2(S[2 * k + 1][0], S[2 * k + 1][1]),  // operand
                                   pack_half2(S[2 * k + 1][2], S[2 * k + 1][3])};
            for (int n = 0; n < D / 16; n++) {
                uint32_t b[4];
                load_16x16<true>(b, V_s + 16 * k * ld + 16 * n, ld);
                mma_16x8x16(O_i[2 * n], p, b[0], b[1]);
                mma_16x8x16(O_i[2 * n + 1], p, b[2], b[3]);
            }
        }
        __syncthreads();                               // everyone is done with this stage
    }
    // Lines 12-15: O_i / l and L_i = m + log(l), written once; no key seen: O = 0, L = -inf.
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        const int r = row + 8 * h;
        if (r >= q_len) continue;
        const float inv_l = l[h] > 0.f ? 1.f / l[h] : 0.f;
        for (int n = 0; n < D / 8; n++)
            *reinterpret_cast<__half2*>(O + (bh * q_len + r) * D + 8 * n + 2 * (lane % 4)) =
                __floats2half2_rn(O_i[n][2 * h] * inv_l, O_i[n][2 * h + 1] * inv_l);
        if (lane % 4 == 0)
            L[bh * q_len + r] = l[h] > 0.f ? (m[h] + log2f(l[h])) * 0.6931471805599453f : -INFINITY;
    }
}

// Raw launch, no checks (the API below validates first). Shared memory: Q_i and two stages of
// K_j and V_j, (Br + 4 Bc) rows of D + kPad halves.
template <int D, int Bc>
void launch_forward_fp16(const __half* Q, const __half* K, const __half* V, __half* O, float* L,
                         const AttentionShape& s, cudaStream_t stream) {
    constexpr int Br = 16 * kWarps;
    const size_t bytes = size_t(Br + 4 * Bc) * (D + kPad) * sizeof(__half);
    auto kernel = flash_forward_fp16_kernel<D, Bc>;
    FLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(bytes)));
    const int Tr = (s.q_len + Br - 1) / Br;
    const int blocks = Tr * s.batch * s.heads;
    kernel<<<blocks, 32 * kWarps, bytes, stream>>>(Q, K, V, O, L, s.q_len, s.kv_len, s.causal, Tr,
                                                   1.4426950408889634f / sqrtf(float(D)));
    FLASH_CUDA_CHECK(cudaGetLastError());
}
