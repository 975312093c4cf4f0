// flash_fp16.cu: chapter 2, FlashAttention-2 on tensor cores, forward and backward: fp16 (or bf16)
// Q, K, V, O and gradients; the softmax statistics (m, l, L), D and every accumulation in fp32.
// The same contract as chapter 1 (flash.h); read it beside flash.cu and FA2's Algorithms 1 and 2.
//
// Build and test:   make test        Demo:   ./flash_bench --dtype fp16   (or --dtype bf16)
// Sections, in order: constants, helpers (the fragments' are lib/fragments.cuh's), the forward
// kernel, the backward (its order of adds, warp tiles, helpers and kernel; the two small passes
// around it are lib/backward_passes.cu's), the tiles, the launchers. What each choice was
// measured against, and the variants dropped: lab/chapter2.md.
// flash_forward_fp16 / _bf16 themselves are the API layer's (lib/dispatch.cpp): it runs this
// chapter's forward, or chapter 3's where that has a kernel; this file needs no other chapter.
// Both kernels take the mask and the score as a policy (lib/mask_policy.cuh, NOTES.md section
// 23): PlainPolicy (causal or none, the chapter's own) or ModelPolicy (chapter 5's options:
// windows, softcap, ALiBi, a softmax scale).
//
// What changes from chapter 1: the two matrix products of Algorithm 1, S = Q_i K_j^T (line 8) and
// O_i += P~ V_j (line 10), run as mma.sync.m16n8k16 instructions, each a 16x8x16 product by one
// warp. Their operands and results live in registers in the layouts the PTX ISA documents
// ("Matrix Fragments for mma.m16n8k16"); NOTES.md section 9 draws them. The one fact that lets
// FA2 keep everything in registers: the fp32 accumulator of S, rounded to fp16, is already laid
// out as the A operand of the next mma, so P~ goes from S to P~ V without touching shared memory.
// The names are chapter 1's and the papers': NOTES.md's glossary lists them.
#include "checks.h"
#include "chapters.h"
#include "flash.h"
#include "fragments.cuh"  // T, its pairs, the mma and its fragments
#include "log2_units.h"
#include "mask_policy.cuh"  // the mask and score: PlainPolicy, or chapter 5's ModelPolicy
#include "ordered_add.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

// The forward's block: kWarps warps, each owning 16 M query rows (M mma tiles of 16), so
// Br = 16 M kWarps (the tile, below).
static constexpr int kWarps = 4;
static constexpr int kFwdThreads = 32 * kWarps;  // threads of a forward block
// Shared-memory rows are D + kPad halves long. Unpadded, the 8 rows one ldmatrix reads start a
// multiple of 128 bytes apart and hit the same banks (an 8-way conflict); 8 halves (16 bytes) of
// padding shift each row by 4 banks, so the 8 rows cover all 32. To see what it buys:
// make clean all DEFINES=-DFLASH_FP16_PAD=0.
#ifndef FLASH_FP16_PAD
#define FLASH_FP16_PAD 8
#endif
static constexpr int kPad = FLASH_FP16_PAD;

// ---------------------------------------------------------------------------------------------
// Helpers: the element type, the pairs of T, one mma, one 16x16 shared-memory load, a thread's
// place in an accumulator and the quad's reduction are lib/fragments.cuh's (chapter 4 shares
// them); here, the async copies of rows and the product of two shared-memory operands.

// Rows [first, first + ROWS) of a (len, D) tensor of T, rows `stride` elements apart (chapter 5's
// layout; D where contiguous), into shared memory (row stride D + kPad), 16 bytes per cp.async;
// rows at or past `len` are filled with zeros (cp.async's source size 0), so padding rows never
// carry garbage (0 * NaN would be NaN). Not waited for: see below. THREADS, the block's threads, is
// a constant so that nvcc steps a thread's row on from chunk to chunk instead of dividing its chunk
// number out again (NOTES.md section 14).
template <int ROWS, int D, int THREADS = kFwdThreads, typename T>
__device__ __forceinline__ void load_rows_async(T* tile, const T* src, size_t stride, int first,
                                                int len) {
    for (int x = threadIdx.x; x < ROWS * D / 8; x += THREADS) {  // x: one 16-byte chunk
        const int row = x / (D / 8);
        const int col = x % (D / 8) * 8;
        const bool inside = first + row < len;
        const unsigned to = unsigned(__cvta_generic_to_shared(tile + row * (D + kPad) + col));
        SM80_ASM("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to),
                 "l"(src + size_t(inside ? first + row : 0) * stride + col), "r"(inside ? 16 : 0));
    }
}
// The copies this thread has issued so far become one group; wait until at most N groups are
// still in flight (N = 0: all of them have landed, for this thread; __syncthreads for the rest).
template <int N>
__device__ __forceinline__ void commit_and_wait() {
    SM80_ASM("cp.async.commit_group;\n" ::);
    SM80_ASM("cp.async.wait_group %0;\n" ::"n"(N));
}

// A product with both operands in shared memory, for one warp that owns M tiles of 16 rows of acc
// (acc[m]: rows 16m .. 16m + 15): acc (16M x N, fp32) += A B, K deep, the operands read as they
// are stored there: the forward's S = Q_i K_j^T and every product of the backward. A: the warp's
// 16M rows, K columns (lda apart), or with At stored transposed, K rows of 16M columns; B: K rows
// of N columns, or with Bt stored transposed, N rows of K columns. S = Q_i K_j^T and the
// backward's S^T = K_j Q_i^T are <false, true>, dV_j += P^T dO_i <false, false>, dQ_i += dS K_j
// <true, false> (dS read from dS^T). A transposed operand is read with ldmatrix.trans; every B
// fragment is loaded once and feeds M mmas.
template <int M, int K, int N, bool At, bool Bt, typename T>
__device__ __forceinline__ void mma_AB(float (*acc)[N / 8][4], const T* A, int lda, const T* B,
                                       int ldb) {
    uint32_t a[M][4], b[4];
    for (int k = 0; k < K / 16; k++) {
        for (int m = 0; m < M; m++) {
            if constexpr (At) load_16x16<true, true>(a[m], A + 16 * k * lda + 16 * m, lda);
            else load_16x16<false>(a[m], A + 16 * m * lda + 16 * k, lda);
        }
        for (int n = 0; n < N / 16; n++) {             // (b[0], b[1]): columns 16n .. 16n + 7
            if constexpr (Bt) load_16x16<false, true>(b, B + 16 * n * ldb + 16 * k, ldb);
            else load_16x16<true>(b, B + 16 * k * ldb + 16 * n, ldb);
            for (int m = 0; m < M; m++) {
                mma_16x8x16<T>(acc[m][2 * n], a[m], b[0], b[1]);
                mma_16x8x16<T>(acc[m][2 * n + 1], a[m], b[2], b[3]);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The forward: FlashAttention-2 Algorithm 1 on tensor cores. One block per (Q tile i, batch*head),
// kWarps warps; warp w owns M mma tiles of Q_i's rows, rows 16Mw .. 16Mw + 16M - 1 (Br = 16 M
// kWarps), and each thread 2M of them: the queries query + 8r (r < 2M), rows g and g + 8 of each
// of its warp's tiles (lane = 4g + t), and of each of those rows columns 2t, 2t+1 of every
// 8-column slice of S_ij and of O_i: its element (r, c) is acc_at(S, r, c), column acc_col(c, t).
// D: head dim, fixed at compile time so that O_i's accumulators (M D / 2 floats a thread) are
// registers. Bc: keys per K/V tile; S_ij's accumulators are M Bc / 2 floats a thread, so Bc and
// M are bounded by registers (fwd_M, flash_choose_tile_fp16). M = 2 feeds every K_j and V_j
// fragment a warp loads from shared memory to two mmas, where M = 1 loads it for one.
// Policy: the mask and the score (lib/mask_policy.cuh): which K/V tiles a Q tile loads, which
// scores are tested, each score's change; scale_log2 turns its units into the exponent's.
template <typename T, int D, int Bc, int M, typename Policy, typename Lay>
__global__ void __launch_bounds__(kFwdThreads)
flash_forward_fp16_kernel(const T* __restrict__ Q, const T* __restrict__ K,
                          const T* __restrict__ V, T* __restrict__ O, float* __restrict__ L,
                          const Policy policy, const Lay lay, int Tr, int HG, int group,
                          float scale_log2) {
    constexpr int Br = 16 * M * kWarps, ld = D + kPad;  // ld: shared row stride, in Ts
    // Shared memory: Q_i, (Br, ld); then K_j and V_j, (2, Bc, ld) each: two stages (line 7).
    extern __shared__ __align__(16) unsigned char shared[];
    T* Q_i = reinterpret_cast<T*>(shared);
    T* K_j = Q_i + Br * ld;
    T* V_j = K_j + 2 * Bc * ld;
    const int warp = threadIdx.x / 32, t = threadIdx.x % 4;
    // Line 3: block -> (Q tile i, head): heads in groups of HG, each group's Q tiles longest
    // (causal) first, its heads taking turns; HG = 1: one head's tiles after another's.
    const int BH = gridDim.x / Tr, head0 = blockIdx.x / (HG * Tr) * HG, heads = min(HG, BH - head0);
    const int i = Tr - 1 - int(blockIdx.x % (HG * Tr)) / heads;
    const size_t bh = head0 + blockIdx.x % (HG * Tr) % heads;  // which (batch, head)
    // Its sequence's policy (a packed batch's lengths, the layout's; else the shape's) and head's.
    const Policy pol = policy.for_sequence(lay.Q.len(bh, policy.q_len),
                                           lay.K.len(bh / group, policy.kv_len)).for_head(bh);
    const int q_len = pol.q_len, kv_len = pol.kv_len;
    const int query = i * Br + 16 * M * warp + threadIdx.x % 32 / 4;  // its rows: query + 8r
    // This head's rows start at these offsets (lay: chapter 5's strides, or the contiguous ones
    // as constants); its K and V are its K/V head's, bh / group (GQA: group query heads share one
    // K/V head, flash.cu's layouts). Consecutive heads share it, and HG of them run together: the
    // K/V tiles they read stay in L2.
    const size_t k_at = lay.K.at(bh / group, kv_len), v_at = lay.V.at(bh / group, kv_len);
    // The keys Q_i needs, keys.begin .. keys.end - 1 (without a mask all, under causal to the
    // last row's last key), in K/V tiles j0 .. ; a tile inside keys.all_begin .. keys.all_end - 1,
    // the keys every row sees, needs no mask.
    const KeySpan keys = pol.keys(i * Br, Br);
    const int j0 = keys.begin / Bc;
    const auto load_KV = [&](int j, int stage) {       // line 7: K_j, V_j into a stage
        load_rows_async<Bc, D>(K_j + stage, K + k_at, lay.K.row, j * Bc, keys.end);
        load_rows_async<Bc, D>(V_j + stage, V + v_at, lay.V.row, j * Bc, keys.end);
    };
    load_rows_async<Br, D>(Q_i, Q + lay.Q.at(bh, q_len), lay.Q.row, i * Br, q_len);  // line 4
    load_KV(j0, 0);
    // Line 5: O_i = 0, m = -inf, l = 0, for this thread's rows; m in the scores' units (unscaled).
    // -1e30 stands in for -inf: e^(m_old - m) stays 1, not NaN, while no key has been seen.
    float O_i[M][D / 8][4] = {}, m[2 * M], l[2 * M];
    for (int r = 0; r < 2 * M; r++) m[r] = -1e30f, l[r] = 0.f;
    for (int j = j0; j * Bc < keys.end; j++) {         // line 6: for each K_j, V_j
        const int stage = (j - j0) % 2 * Bc * ld;      // where tile j is in K_j, V_j
        // Tile j has landed: this thread's copies, then, after the barrier, everyone's; the other
        // stage is free.
        commit_and_wait<0>();
        __syncthreads();
        if ((j + 1) * Bc < keys.end) load_KV(j + 1, Bc * ld - stage);  // line 7, a tile ahead
        // Line 8: S_ij = Q_i K_j^T, this warp's rows.
        float S[M][Bc / 8][4] = {};
        mma_AB<M, D, Bc, false, true>(S, Q_i + 16 * M * warp * ld, ld, K_j + stage, ld);
#pragma unroll  // (so that S's indices are constants: S stays in registers at Bc = 128)
        for (int r = 0; r < 2 * M; r++) {              // line 9 for query + 8r: mask, max
            const float m_old = m[r];
            float du;                                  // (a derivative only the backward needs)
            const auto near = pol.at(query + 8 * r, j * Bc + acc_col(0, t));
            for (int c = 0; c < Bc / 4; c++) {         // column c is key j Bc + acc_col(c, t):
                float& s = acc_at(S, r, c);            // its score changed, if the policy does
                s = near.score(s, acc_col(0, t) - acc_col(c, t), du);  // (a constant distance)
            }
            // The mask, in a tile where a row misses one of the keys.
            if (j * Bc < keys.all_begin || (j + 1) * Bc > keys.all_end) {
                const Span seen = pol.row_keys(query + 8 * r);  // this row's keys
                for (int c = 0; c < Bc / 4; c++) {
                    const int key = j * Bc + acc_col(c, t);
                    if (key < seen.first || key > seen.last) acc_at(S, r, c) = -INFINITY;
                }
            }
            for (int c = 0; c < Bc / 4; c++) m[r] = fmaxf(m[r], acc_at(S, r, c));
            m[r] = quad_reduce(m[r], fmaxf);           // the max over the row's 4 threads
            // Scores carry the scale (1/sqrt(d), or the options') and log2 e only here, in one
            // fma each: e^((s - m) scale) = 2^(s c - m c), c = scale_log2.
            const float alpha = exp2_ftz((m_old - m[r]) * scale_log2);  // line 10's e^(m_old - m)
            l[r] *= alpha;
            for (int c = 0; c < D / 4; c++) acc_at(O_i, r, c) *= alpha;
            for (int c = 0; c < Bc / 4; c++) {         // P~_ij = exp(S_ij - m), l += rowsum(P~)
                float& s = acc_at(S, r, c);
                s = exp2_ftz(fmaf(s, scale_log2, -m[r] * scale_log2));
                l[r] += s;
            }
        }
        // Line 10: O_i += P~_ij V_j, 16 keys a step; P~, rounded to T, is the A operand as it
        // stands in S's registers (NOTES.md section 9).
        for (int k = 0; k < Bc / 16; k++) {
            uint32_t p[M][4], b[4];
            for (int mt = 0; mt < M; mt++) {
                const float *lo = S[mt][2 * k], *hi = S[mt][2 * k + 1];  // A's two column halves
                p[mt][0] = pair_bits<T>(lo[0], lo[1]), p[mt][1] = pair_bits<T>(lo[2], lo[3]);
                p[mt][2] = pair_bits<T>(hi[0], hi[1]), p[mt][3] = pair_bits<T>(hi[2], hi[3]);
            }
            for (int n = 0; n < D / 16; n++) {
                load_16x16<true>(b, V_j + stage + 16 * k * ld + 16 * n, ld);
                for (int mt = 0; mt < M; mt++) {
                    mma_16x8x16<T>(O_i[mt][2 * n], p[mt], b[0], b[1]);
                    mma_16x8x16<T>(O_i[mt][2 * n + 1], p[mt], b[2], b[3]);
                }
            }
        }
    }
    commit_and_wait<0>();                              // no copy may land after the block exits
    for (int r = 0; r < 2 * M; r++) {                  // lines 12-15 for query + 8r, written once
        const float l_row = quad_reduce(l[r], add);    // the sum over the row's 4 threads
        const size_t at = lay.L.at(bh, q_len) + query + 8 * r;  // this row's place in L
        T* O_row = O + lay.O.at(bh, q_len) + (query + 8 * r) * lay.O.row;  // and in O
        // A row that saw a key has l >= 1 (its max's own term is e^0); one that saw none has
        // l = 0 and O_i = 0: it gets O = 0 / 1 = 0 and L = -inf.
        for (int n = 0; n < D / 8 && query + 8 * r < q_len; n++)  // columns 2n, 2n + 1
            store_pair(O_row + 8 * n + 2 * t, acc_at(O_i, r, 2 * n) / fmaxf(l_row, 1.f),
                       acc_at(O_i, r, 2 * n + 1) / fmaxf(l_row, 1.f));
        if (t == 0 && query + 8 * r < q_len)
            L[at] = l_row > 0.f ? (m[r] * scale_log2 + log2f(l_row)) * kLn2 : -INFINITY;
    }
}

// ---------------------------------------------------------------------------------------------
// The backward: FlashAttention-2 Algorithm 2 on tensor cores, as the paper writes it. One block
// per K/V tile j (line 5) keeps K_j, V_j in shared memory and dK_j, dV_j in registers while the Q
// tiles i stream past it (line 8); S, P, dP and dS are computed once per (i, j): five products.
// Line 15's dQ_i += dS_ij K_j is the one sum over K/V tiles, so the blocks that share Q_i add their
// parts into dQacc, an fp32 copy of dQ in global memory, in a fixed order (below): deterministic,
// bitwise. Three launches: D (line 4), the kernel, then dQ = dQacc scale rounded to fp16.
//
// The block: W warps, Bc keys, Q tiles of Br rows (bwd_tiles, below). Everything is transposed:
// S^T = K_j Q_i^T has a key per row, as do P^T and dS^T, the left operands of lines 12 and 16, so
// each thread needs L and D of its columns' queries (staged beside Q_i). Every product is split
// over the W warps in two-dimensional tiles (WarpTile): S^T and dP^T in tiles of keys x queries,
// dV_j and dK_j in tiles of keys x columns of d (so a thread holds only its share of both), dQ_i's
// part in tiles of queries x columns. The tiles of one product are not those of the next, so P^T
// and dS^T go through shared memory (fp16), between a barrier.
//
// The order of line 15's adds. Every block takes a ticket as it starts (atomicAdd on a zeroed
// counter): the order blocks start in. Without a mask, tickets run over each head's K/V tiles from
// the right (j = Tc - 1 first, four heads' tiles interleaved) and every dQ_i takes its adds in
// decreasing j; under the causal mask they run from the left (j = 0, the longest, first; 32 heads'
// tiles interleaved, so that the last blocks to start are short ones), each block walks its Q
// tiles from the last, and every dQ_i takes its adds in increasing j. A turn counter per (head, Q
// tile) says how many blocks have added there. Each warp of block j waits until it equals the
// number of tiles before j in that order (all of which see Q_i, as j does), adds its tile of
// dQ_i, and one thread of the block passes the turn on once all have. A block only ever waits for
// blocks with lower tickets, which have started and so are running or done, and the lowest-ticket
// block still running waits for nobody: no deadlock (NOTES.md section 14).
// Grouped-query attention (GQA): a block is a (K/V head, j) and walks the Q tiles of each query
// head of its group in turn; the turn counters, dQacc and D stay per query head. A dQ_i of query
// head h is added to by the blocks of h's K/V head alone, exactly the blocks that added to it
// without GQA, in the same order, and a block passes each turn before it waits for the next: the
// argument above holds unchanged, whatever the number of query heads a block covers.

// An (R x C) product split over W warps: a grid of R / rows by `across` tiles of `rows` x `cols`.
// rows = 32 (two mma tiles, so every B fragment a warp loads feeds two mmas) where the columns then
// come out a multiple of 16, else 16. Warp w's tile starts at row(w), col(w).
__host__ __device__ constexpr int tile_rows(int R, int C, int W) {
    return R % 32 == 0 && W % (R / 32) == 0 && C * (R / 32) % (16 * W) == 0 ? 32 : 16;
}
template <int R, int C, int W>
struct WarpTile {
    static constexpr int rows = tile_rows(R, C, W), M = rows / 16, across = W / (R / rows);
    static constexpr int cols = C / across;
    static_assert(W % (R / rows) == 0 && cols % 16 == 0, "a warp's tile must be whole mma tiles");
    static __device__ int row(int warp) { return rows * (warp / across); }
    static __device__ int col(int warp) { return cols * (warp % across); }
};

// Entries [first, first + N) of a float vector into shared memory, 4 bytes per cp.async, as
// load_rows_async does rows: entries at or past `len` become 0. Not waited for.
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
// One warp's tile of 2M rows of 8 a thread by N columns (`rows` rows left in the tensor) out of
// acc, times scale, in T, row stride LD: P^T and dS^T to shared memory, dK_j and dV_j (line 18).
template <int M, int N, typename T>
__device__ __forceinline__ void store_tile(T* out, long long LD, float (*acc)[N / 8][4],
                                           float scale, int rows) {
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    for (int r = 0; r < 2 * M; r++)                    // row 8r + g, columns 8n + 2t, + 1
        for (int n = 0; n < N / 8 && 8 * r + g < rows; n++)
            store_pair(out + (8 * r + g) * LD + 8 * n + 2 * t,
                       acc_at(acc, r, 2 * n) * scale, acc_at(acc, r, 2 * n + 1) * scale);
}

// The ordered add (above): block_ticket, wait_turn and pass_turn, in lib/ordered_add.cuh (chapter
// 3's backward adds its dQ in the same order, with the same three).
// One warp's tile of dQ_i (2M rows of 8 a thread, N columns) into dQacc, here at the thread's
// first element (row g, column 2t; row stride D; `rows` rows from there to the tensor's end): the
// first block in the order stores, the others add (a red: the add happens in L2, nothing comes
// back; on sm_90 two floats at once). Every address is one register plus a constant, so that no
// red waits for the one before it to let go of its address register (NOTES.md section 14).
template <int M, int N, int D>
__device__ __forceinline__ void add_tile(float* dQacc, float (*acc)[N / 8][4], int rows,
                                         bool first) {
    for (int r = 0; r < 2 * M; r++)                    // row 8r + g, columns 8n + 2t, + 1
        for (int n = 0; n < N / 8 && 8 * r < rows; n++) {
            float* to = dQacc + 8 * r * D + 8 * n;
            const float2 v = make_float2(acc_at(acc, r, 2 * n), acc_at(acc, r, 2 * n + 1));
            if (first) *reinterpret_cast<float2*>(to) = v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            else atomicAdd(reinterpret_cast<float2*>(to), v);
#else
            else atomicAdd(to, v.x), atomicAdd(to + 1, v.y);
#endif
        }
}

// The kernel. One block per (K/V tile j, K/V head), in ticket order. W warps, K/V tiles of Bc
// keys, Q tiles of Br rows in two stages (cp.async). A thread's r-th row of a warp tile is
// 16(r / 2) + g + 8(r % 2), its c-th column 8(c / 2) + 2t + c % 2 (lane = 4g + t). Two blocks an
// SM where Q tiles have 64 rows at d <= 64: their warps hide each other's barriers and loads
// (NOTES.md section 14), for registers capped at 128 (a few spill at d = 64).
// Policy: the forward's (lib/mask_policy.cuh); scale: the softmax scale, dK's last factor.
template <typename T, int D, int W, int Bc, int Br, typename Policy, typename Lay>
__global__ void __launch_bounds__(32 * W, D <= 64 && Br == 64 ? 2 : 1)
flash_backward_fp16_kernel(const T* __restrict__ Q, const T* __restrict__ K,
                           const T* __restrict__ V, const T* __restrict__ dO,
                           const float* __restrict__ L, const float* __restrict__ Dsum,
                           float* __restrict__ dQacc, int* __restrict__ turns, int* next_ticket,
                           T* __restrict__ dK, T* __restrict__ dV, const Policy policy,
                           const Lay lay, int Tc, int BH, int HG, int group, float scale_log2,
                           float scale) {
    constexpr int ld = D + kPad, ldS = Br + kPad;
    using TS = WarpTile<Bc, Br, W>;                    // S^T, dP^T: keys x queries
    using TKV = WarpTile<Bc, D, W>;                    // dK_j, dV_j: keys x columns
    using TQ = WarpTile<Br, D, W>;                     // dQ_i's part: queries x columns
    // Shared memory: K_j and V_j (Bc, ld) each; Q_i and dO_i (2, Br, ld) each, two stages; P^T
    // and dS^T (Bc, ldS) each; L_i and D_i (2, Br) floats each.
    extern __shared__ __align__(16) unsigned char shared[];
    T* K_j = reinterpret_cast<T*>(shared);
    T* V_j = K_j + Bc * ld;
    T* Q_i = V_j + Bc * ld;
    T* dO_i = Q_i + 2 * Br * ld;
    T* P_T = dO_i + 2 * Br * ld;
    T* dS_T = P_T + Bc * ldS;
    float* L_i = reinterpret_cast<float*>(dS_T + Bc * ldS);
    float* D_i = L_i + 2 * Br;
    // Ticket -> (K/V head, K/V tile j): K/V heads (BH = batch * kv_heads of them) in groups of
    // HG, each group's tiles from the right (causal: from the left, longest first), its heads
    // taking turns. Line 5: for each K_j, V_j.
    const int ticket = block_ticket(next_ticket), head0 = ticket / (HG * Tc) * HG;
    const int heads = min(HG, BH - head0), slot = ticket % (HG * Tc);
    const bool from_left = policy.from_left();
    const int j = from_left ? slot / heads : Tc - 1 - slot / heads;
    const size_t kv_bh = head0 + slot % heads;         // batch * kv_heads + K/V head
    const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    // The block's sequence (packed: its own lengths); Tr, the turns' Q tiles a head: the longest.
    const Policy seq = policy.for_sequence(lay.Q.len(kv_bh * group, policy.q_len),
                                           lay.K.len(kv_bh, policy.kv_len));
    const int q_len = seq.q_len, kv_len = seq.kv_len, Tr = (policy.q_len + Br - 1) / Br;
    if (j * Bc >= kv_len) return;                      // a shorter sequence's: past its keys
    // The Q tiles that see a key of tile j, i_first .. i_last (the mask's: all without one);
    // causal (from the left), the last first.
    const Span rows = seq.queries(j * Bc, min((j + 1) * Bc, kv_len));
    const int i_first = rows.first / Br, i_last = rows.last < rows.first ? -1 : rows.last / Br;
    const int i0 = from_left ? i_last : i_first, di = from_left ? -1 : 1;
    // Line 8's loop, step n: the group's query heads one after another (GQA: group query heads
    // read this K/V head, and dK_j, dV_j sum over all of them, in this fixed order, in
    // registers), and each one's Q tiles. Without GQA (group = 1) the loop is over Q tiles only.
    const int tiles = max(i_last - i_first + 1, 0), steps = group * tiles;  // Q tiles a head; steps
    const auto head_of = [&](int n) { return kv_bh * group + n / tiles; };  // its query head bh
    const auto tile_of = [&](int n) { return i0 + di * (n % tiles); };       // its Q tile i
    auto load_Q_tile = [&](int stage, int n) {         // line 9: load Q_i, dO_i, L_i, D_i of step n
        const size_t bh = head_of(n);
        const int q0 = tile_of(n) * Br;
        load_rows_async<Br, D, 32 * W>(Q_i + stage * ld, Q + lay.Q.at(bh, q_len), lay.Q.row, q0,
                                       q_len);
        load_rows_async<Br, D, 32 * W>(dO_i + stage * ld, dO + lay.dO.at(bh, q_len), lay.dO.row, q0,
                                       q_len);
        load_floats_async<Br>(L_i + stage, L + lay.L.at(bh, q_len), q0, q_len);  // D as L
        load_floats_async<Br>(D_i + stage, Dsum + lay.L.at(bh, q_len), q0, q_len);
    };
    load_rows_async<Bc, D, 32 * W>(K_j, K + lay.K.at(kv_bh, kv_len), lay.K.row, j * Bc,
                                   kv_len);  // line 6
    load_rows_async<Bc, D, 32 * W>(V_j, V + lay.V.at(kv_bh, kv_len), lay.V.row, j * Bc,
                                   kv_len);
    if (steps > 0) load_Q_tile(0, 0);
    float dK_j[TKV::M][TKV::cols / 8][4] = {}, dV_j[TKV::M][TKV::cols / 8][4] = {};  // line 7
    int* added = nullptr;                              // the turn of the dQ_i added to last
    for (int n = 0; n < steps; n++) {                  // line 8: for each (query head, Q_i)
        const size_t bh = head_of(n);                  // batch * heads + query head
        const Policy pol = seq.for_head(bh);
        const int i = tile_of(n);
        const int q0 = i * Br, fstage = n % 2 * Br, stage = fstage * ld;
        // Q_i has landed; the other stage, P^T and dS^T are free.
        commit_and_wait<0>();
        __syncthreads();
        const int k_w = TS::row(warp), q_w = TS::col(warp);  // this warp's tile of S^T
        float S[TS::M][TS::cols / 8][4] = {}, dP[TS::M][TS::cols / 8][4] = {};
        // Line 10: S^T = K_j Q_i^T; line 13: dP^T = V_j dO_i^T (this warp's tile of each).
        mma_AB<TS::M, D, TS::cols, false, true>(S, K_j + k_w * ld, ld, Q_i + stage + q_w * ld, ld);
        mma_AB<TS::M, D, TS::cols, false, true>(dP, V_j + k_w * ld, ld, dO_i + stage + q_w * ld,
                                                ld);
        // The turn of the dQ_i added to a step ago, passed on by one thread (a warp in turn), after
        // the barrier above: the adds have had time to land, so the release waits little.
        if (added && threadIdx.x == 32 * (i % W)) pass_turn(added);
        if (n + 1 < steps) load_Q_tile(Br - fstage, n + 1);  // line 9, a tile ahead
        // Row r of the warp's tile is key j Bc + k_w + 8r + g, which the queries seen[r] see
        // (none when it is past kv_len). 8r is written as the mma numbers rows, 16(r / 2) +
        // 8(r % 2), here and in acc_at below: nvcc compiles these two loops into other, larger
        // machine code from the shorter forms (NOTES.md section 14).
        Span seen[2 * TS::M];
        for (int r = 0; r < 2 * TS::M; r++)
            seen[r] = pol.key_queries(j * Bc + k_w + 16 * (r / 2) + g + 8 * (r % 2));
        // The mask only where the tile reaches past kv_len, q_len or a key's queries.
        const bool edge = (j + 1) * Bc > kv_len || q0 + Br > q_len ||
                          !pol.full(q0, q0 + Br, j * Bc, (j + 1) * Bc);
        // The scores' distances from query q0 + q_w + 2t, key j Bc + k_w + g: constants below.
        const auto near = pol.at(q0 + q_w + acc_col(0, t), j * Bc + k_w + g);
#pragma unroll  // (S and dP stay in registers: with a score change nvcc would not unroll)
        for (int c = 0; c < TS::cols / 4; c++) {       // column c: query q0 + qi
            const int qi = q_w + acc_col(c, t);
            const float L_q = L_i[fstage + qi] * kLog2e, D_q = D_i[fstage + qi];
#pragma unroll
            for (int r = 0; r < 2 * TS::M; r++) {
                float& p = S[r / 2][c / 2][2 * (r % 2) + c % 2];  // acc_at(S, r, c)
                float du;                              // d(changed score) / d(Q_i . K_j)
                // Line 11: P^T = exp(S^T - L_i), of the changed scores, masked. (Key
                // j Bc + k_w + g + 16(r / 2) + 8(r % 2).)
                const int k = (acc_col(c, t) - acc_col(0, t)) - (16 * (r / 2) + 8 * (r % 2));
                p = exp2_ftz(near.score(p, k, du) * scale_log2 - L_q);
                if (edge && (q0 + qi < seen[r].first || q0 + qi > seen[r].last)) p = 0.f;
                float& ds = dP[r / 2][c / 2][2 * (r % 2) + c % 2];  // acc_at(dP, r, c)
                ds = p * (ds - D_q) * du;              // line 14: dS^T = P^T o (dP^T - D_i), du
            }
        }
        // P^T and dS^T to shared memory, in T, for the products of lines 12, 15 and 16.
        store_tile<TS::M, TS::cols>(P_T + k_w * ldS + q_w, ldS, S, 1.f, Bc);
        store_tile<TS::M, TS::cols>(dS_T + k_w * ldS + q_w, ldS, dP, 1.f, Bc);
        __syncthreads();
        const int kv_w = TKV::row(warp), d_w = TKV::col(warp);  // this warp's tile of dK_j, dV_j
        mma_AB<TKV::M, Br, TKV::cols, false, false>(   // line 12: dV_j += P^T dO_i
            dV_j, P_T + kv_w * ldS, ldS, dO_i + stage + d_w, ld);
        mma_AB<TKV::M, Br, TKV::cols, false, false>(   // line 16: dK_j += dS^T Q_i
            dK_j, dS_T + kv_w * ldS, ldS, Q_i + stage + d_w, ld);
        // Line 15: dQ_i += dS K_j, this warp's tile of it, added in turn (the tiles that see Q_i
        // before j in the order first: right of j, causal left of it; the turn is passed on a
        // step later).
        const int dq_q = TQ::row(warp), dq_d = TQ::col(warp);
        float dQ_i[TQ::M][TQ::cols / 8][4] = {};
        mma_AB<TQ::M, Bc, TQ::cols, true, false>(dQ_i, dS_T + dq_q, ldS, K_j + dq_d, ld);
        added = turns + bh * Tr + i;
        const KeySpan keys = pol.keys(q0, Br);         // Q_i's K/V tiles: keys.begin / Bc ..
        const int mine = from_left ? j - keys.begin / Bc : (keys.end - 1) / Bc - j;
        wait_turn(added, mine);
        const size_t row = lay.L.at(bh, q_len) + q0 + dq_q + g;  // dQacc's rows are L's
        add_tile<TQ::M, TQ::cols, D>(dQacc + row * D + dq_d + 2 * t, dQ_i, q_len - q0 - dq_q - g,
                                     mine == 0);
    }
    commit_and_wait<0>();                              // no copy may land after the block exits
    __syncthreads();                                   // every warp's last adds were issued
    if (added && threadIdx.x == 0) pass_turn(added);
    const int key = j * Bc + TKV::row(warp);           // line 18: write dK_j scale, dV_j
    T* dK_at = dK + lay.dK.at(kv_bh, kv_len) + key * lay.dK.row + TKV::col(warp);
    T* dV_at = dV + lay.dV.at(kv_bh, kv_len) + key * lay.dV.row + TKV::col(warp);
    store_tile<TKV::M, TKV::cols>(dK_at, lay.dK.row, dK_j, scale, kv_len - key);
    store_tile<TKV::M, TKV::cols>(dV_at, lay.dV.row, dV_j, 1.f, kv_len - key);
}
// ---------------------------------------------------------------------------------------------
// The tile. Br = 16 M kWarps: M = 2 mma tiles of 16 rows a warp (Br = 128) where registers hold
// them, M = 1 (Br = 64) at d = 256, where a thread's O_i alone would be 256 floats. Bc (a multiple
// of 16, the k of the P~ V mma) is set by registers too: a thread holds M (D + Bc) / 2
// accumulators (O_i and S_ij), so Bc = 128 at d <= 64, 64 at d = 96 and 128 (at most 192 floats:
// two blocks of 4 warps an SM; FA2 takes the same tiles on the H100), and 32 at d = 256, where
// shared memory would hold one block of Bc = 64 an SM.
// Shared memory holds Q_i and two stages of K_j and V_j; a device with too little for that Bc
// takes half of it.
constexpr int fwd_M(int head_dim) { return head_dim <= 128 ? 2 : 1; }
constexpr int fwd_Br(int head_dim) { return 16 * kWarps * fwd_M(head_dim); }
constexpr int fwd_max_Bc(int head_dim) { return head_dim <= 64 ? 128 : head_dim <= 128 ? 64 : 32; }

// Chapter 2's instructions (mma.sync.m16n8k16, cp.async) need compute capability 8.0.
static void require_sm80(const cudaDeviceProp& prop, const char* fn) {
    if (prop.major < 8)
        throw std::runtime_error(std::string(fn) + " needs a GPU of compute capability 8.0 or " +
                                 "newer (mma.sync.m16n8k16, cp.async); " + prop.name + " is " +
                                 std::to_string(prop.major) + "." + std::to_string(prop.minor));
}

// The host code below comes in two halves, the forward's and the backward's. The Makefile
// compiles this file twice, with -DFLASH_FP16_FORWARD and -DFLASH_FP16_BACKWARD, into two objects
// built at once (the kernels' instances are most of the build's time); without either macro one
// object holds both (PyTorch's extension build).
#if !defined(FLASH_FP16_BACKWARD)
constexpr size_t fp16_shared_bytes(int head_dim, int Bc) {  // Q_i, 2 x K_j, 2 x V_j
    return size_t(fwd_Br(head_dim) + 4 * Bc) * (head_dim + kPad) * sizeof(__half);
}
// The chooser's rule: registers' Bc, halved while the block's shared memory would not hold it.
constexpr int fwd_Bc_fitting(int head_dim, size_t shared_per_block) {
    int Bc = fwd_max_Bc(head_dim);
    while (Bc > 32 && fp16_shared_bytes(head_dim, Bc) > shared_per_block) Bc /= 2;
    return Bc;
}
// The tiles built for every call: those the chooser gives on GPUs of compute capability 8.0 and
// newer, whose blocks may take 99 KiB (8.6, 8.9, 12.0) to 227 KiB (9.0, 10.0) of shared memory.
// The other tiles run the plain, dense fp16 call alone (flash_forward_fp16_bc), a third of the
// kernels fewer to compile. Every tile a block of 99 KiB up can get is among them (the assert).
constexpr size_t kLeastSharedPerBlock = 99 * 1024;
constexpr bool fwd_tile_built(int head_dim, int Bc) {
    return Bc == fwd_max_Bc(head_dim) || Bc == fwd_Bc_fitting(head_dim, kLeastSharedPerBlock);
}
static_assert([] {
    for (int d : kFlashFp16HeadDims)
        if (fwd_Bc_fitting(d, kLeastSharedPerBlock) < fwd_max_Bc(d) / 2) return false;
    return true;
}(), "a block of 99 KiB to 227 KiB would get a tile that is not built for every call");

static FlashTile fp16_tile(const cudaDeviceProp& prop, int head_dim, int Bc) {
    const FlashTile tile{fwd_Br(head_dim), Bc, kFwdThreads, 4, fp16_shared_bytes(head_dim, Bc)};
    if (tile.shared_bytes > prop.sharedMemPerBlockOptin)
        throw std::runtime_error("device " + std::string(prop.name) + " has too little shared " +
                                 "memory for the fp16 tile at head_dim " +
                                 std::to_string(head_dim));
    return tile;
}

FlashTile flash_choose_tile_fp16(const cudaDeviceProp& prop, int head_dim) {
    require_head_dim(head_dim, kFlashFp16HeadDims);
    require_sm80(prop, "flash_forward_fp16");
    return fp16_tile(prop, head_dim, fwd_Bc_fitting(head_dim, prop.sharedMemPerBlockOptin));
}

// ---------------------------------------------------------------------------------------------
// Launchers (host): every check (lib/checks.cpp) before anything is launched. T: __half or
// __nv_bfloat16; fn: the public function's name, for messages.

// The order of the blocks: 16 heads' Q tiles at a time, longest first (the kernel's line 3). Under
// the causal mask the longest tiles then start first across 16 heads (largest first balances
// the SMs' loads), and the few heads' K and V that the running blocks read stay in L2.
static constexpr int kFwdHeadGroup = 16;

// The policy: with_policy's (lib/mask_policy.cuh), the plain one where it serves the options
// (none, a packed batch, strides, a scale). A tile not built for every call (fwd_tile_built) has
// the plain, dense fp16 kernel alone; forward_fp16_launch refuses anything else there first.
template <typename T, int D, int Bc>
static void launch_forward_fp16(const T* Q, const T* K, const T* V, T* O, float* L,
                                const AttentionShape& s, const Layout& lay,
                                const AttentionOptions* options, const FlashTile& tile,
                                cudaStream_t stream) {
    const int Tr = (s.q_len + tile.Br - 1) / tile.Br;  // Q tiles per head
    const int blocks = grid_blocks(s, s.q_len, tile.Br, "q_len");
    const auto launch = [&](auto policy, auto layout, float scale_log2) {
        auto kernel = flash_forward_fp16_kernel<T, D, Bc, fwd_M(D), decltype(policy),
                                                decltype(layout)>;
        allow_shared(kernel, tile.shared_bytes);
        kernel<<<blocks, tile.threads, tile.shared_bytes, stream>>>(
            Q, K, V, O, L, policy, layout, Tr, kFwdHeadGroup, flash_kv_group(s), scale_log2);
        FLASH_CUDA_CHECK(cudaGetLastError());
    };
    const AttentionOptions o = options ? *options : AttentionOptions{};
    const float scale_log2 = options_scale_log2(s, o);  // the options', or 1/sqrt(D)'s
    constexpr bool every_call = fwd_tile_built(D, Bc), half = std::is_same<T, __half>::value;
    if (plain_policy_serves(o, s) && dense(lay, s, false)) {
        if constexpr (every_call || half)
            launch(PlainPolicy{s.q_len, s.kv_len, s.causal}, DenseLayout<D>{}, scale_log2);
    } else if constexpr (every_call)
        with_policy(s, o, [&](auto policy) { launch(policy, lay, scale_log2); });
}

// The launch once the arguments are checked (shape, pointers): the device's checks, the tile, the
// kernel. Bc: keys per K/V tile given by the caller (checked), or none for the device's choice;
// lay: the tensors' strides; options: chapter 5's (checked), or none.
template <typename T>
static void forward_fp16_launch(const char* fn, const cudaDeviceProp& prop, const T* Q, const T* K,
                                const T* V, T* O, float* L, const AttentionShape& s,
                                std::optional<int> Bc, const Layout& lay, cudaStream_t stream,
                                const AttentionOptions* options = nullptr) {
    require_sm80(prop, fn);
    FlashTile tile = flash_choose_tile_fp16(prop, s.head_dim);
    if (Bc) tile = fp16_tile(prop, s.head_dim, *Bc);
    const bool plain_fp16 = std::is_same<T, __half>::value && dense(lay, s, false) &&
                            plain_policy_serves(options ? *options : AttentionOptions{}, s);
    if (!fwd_tile_built(s.head_dim, tile.Bc) && !plain_fp16)
        throw std::runtime_error(std::string(fn) + ": Bc = " + std::to_string(tile.Bc) + " at " +
                                 "head_dim " + std::to_string(s.head_dim) + " runs only the " +
                                 "plain, dense fp16 call (the tiles of blocks of 99 KiB to " +
                                 "227 KiB of shared memory run every call); " + prop.name +
                                 " allows " + std::to_string(prop.sharedMemPerBlockOptin) +
                                 " bytes a block");
    dispatch_head_dim<kFlashFp16HeadDims>(s.head_dim, [&](auto dim) {
        constexpr int D = decltype(dim)::value;
        if constexpr (fwd_max_Bc(D) >= 128)
            if (tile.Bc == 128)
                return launch_forward_fp16<T, D, 128>(Q, K, V, O, L, s, lay, options, tile,
                                                      stream);
        if (tile.Bc == 64)
            launch_forward_fp16<T, D, 64>(Q, K, V, O, L, s, lay, options, tile, stream);
        else launch_forward_fp16<T, D, 32>(Q, K, V, O, L, s, lay, options, tile, stream);
    });
}

// Every check, then the launch. Bc: as above (32, 64, or 128 up to head_dim 64).
template <typename T>
static void forward_fp16_checked(const char* fn, const T* Q, const T* K, const T* V, T* O,
                                 float* L, const AttentionShape& s, std::optional<int> Bc,
                                 cudaStream_t stream) {
    validate_shape(s, kFlashFp16HeadDims, sizeof(T));
    if (Bc)
        require(*Bc == 32 || *Bc == 64 || (*Bc == 128 && s.head_dim <= 64),
                "Bc = " + std::to_string(*Bc) + " is invalid; allowed values: 32, 64, 128 (128 up "
                "to head_dim 64)");
    validate_forward_pointers(fn, Q, K, V, O, L, s);
    forward_fp16_launch(fn, flash_device_props(), Q, K, V, O, L, s, Bc, contiguous_layout(s),
                        stream);
}

// For the API layer (lib/dispatch.cpp), which has checked the arguments (lib/checks.h).
void flash_forward_ampere_launch(const char* fn, const cudaDeviceProp& prop, const __half* Q,
                                 const __half* K, const __half* V, __half* O, float* L,
                                 const AttentionShape& s, const Layout& lay, cudaStream_t stream,
                                 const AttentionOptions* options) {
    forward_fp16_launch(fn, prop, Q, K, V, O, L, s, std::nullopt, lay, stream, options);
}
void flash_forward_ampere_launch(const char* fn, const cudaDeviceProp& prop,
                                 const __nv_bfloat16* Q, const __nv_bfloat16* K,
                                 const __nv_bfloat16* V, __nv_bfloat16* O, float* L,
                                 const AttentionShape& s, const Layout& lay, cudaStream_t stream,
                                 const AttentionOptions* options) {
    forward_fp16_launch(fn, prop, Q, K, V, O, L, s, std::nullopt, lay, stream, options);
}

void flash_forward_fp16_ampere(const __half* Q, const __half* K, const __half* V, __half* O,
                               float* L, const AttentionShape& shape, cudaStream_t stream) {
    forward_fp16_checked("flash_forward_fp16_ampere", Q, K, V, O, L, shape, std::nullopt, stream);
}

void flash_forward_bf16_ampere(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                               const __nv_bfloat16* V, __nv_bfloat16* O, float* L,
                               const AttentionShape& shape, cudaStream_t stream) {
    forward_fp16_checked("flash_forward_bf16_ampere", Q, K, V, O, L, shape, std::nullopt, stream);
}

void flash_forward_fp16_bc(const __half* Q, const __half* K, const __half* V, __half* O,
                           float* L, const AttentionShape& shape, int Bc, cudaStream_t stream) {
    forward_fp16_checked("flash_forward_fp16", Q, K, V, O, L, shape, Bc, stream);
}

#endif  // the forward's host code
#if !defined(FLASH_FP16_FORWARD)

// The backward's tile: Bc keys a K/V tile, Br query rows a Q tile, W warps. Registers decide
// first: a thread holds its share of dK_j and dV_j, 2 Bc d / (32 W) floats, beside S^T and dP^T.
// So Bc = 128 keys on 8 warps up to d = 128, and at d = 256 64 keys on 8 warps (128 keys would be
// 256 floats a thread). Br = 128 at d = 64, where registers allow it: each barrier and each
// ordered add then serves twice the work. Where a block does not fit the device's shared memory
// the next tile in bwd_tiles' list is taken (Br halved, then Bc = 64 on 4 warps). d = 16 takes
// Bc = 64 on 4 warps: 8 warps would split dQ_i's 16 columns too finely. Shared memory: K_j, V_j,
// two stages of Q_i and dO_i, P^T and dS^T (Bc x Br each, padded), two stages of L_i and D_i.
struct BwdTile {
    int Bc, Br;
};
// The (Bc, Br) the backward takes at head_dim, best first; Bc = 0 ends a list.
constexpr std::array<BwdTile, 3> bwd_tiles(int head_dim) {
    if (head_dim == 16) return {{{64, 64}}};
    if (head_dim == 64) return {{{128, 128}, {128, 64}, {64, 64}}};
    if (head_dim == 256) return {{{64, 64}, {64, 32}}};
    return {{{128, 64}, {64, 64}}};
}
constexpr int bwd_warps(int head_dim, int Bc) { return head_dim == 256 ? 8 : Bc / 16; }

static size_t bwd_shared_bytes(int head_dim, BwdTile t) {
    return (2 * t.Bc + 4 * t.Br) * (head_dim + kPad) * sizeof(__half) +
           2 * t.Bc * (t.Br + kPad) * sizeof(__half) + 4 * t.Br * sizeof(float);
}

// The first tile of bwd_tiles(head_dim) with Bc keys (any Bc where Bc = 0) whose block fits the
// device's shared memory; std::runtime_error naming the device where none does.
static FlashTile bwd_tile(const cudaDeviceProp& prop, int head_dim, int Bc) {
    for (const BwdTile t : bwd_tiles(head_dim)) {
        if (t.Bc == 0 || (Bc != 0 && t.Bc != Bc)) continue;
        const FlashTile tile{t.Br, t.Bc, 32 * bwd_warps(head_dim, t.Bc), 4,
                             bwd_shared_bytes(head_dim, t)};
        if (tile.shared_bytes <= prop.sharedMemPerBlockOptin) return tile;
    }
    throw std::runtime_error("device " + std::string(prop.name) + " has too little shared memory " +
                             "for the fp16 backward at head_dim " + std::to_string(head_dim) +
                             (Bc ? " (Bc " + std::to_string(Bc) + ")" : std::string()));
}

FlashTile flash_choose_tile_fp16_backward(const cudaDeviceProp& prop, int head_dim) {
    require_head_dim(head_dim, kFlashFp16HeadDims);
    require_sm80(prop, "flash_backward_fp16");
    return bwd_tile(prop, head_dim, 0);
}

template <typename T, int D, int Bc, int Br, typename Policy, typename Lay>
static void launch_backward_fp16(const T* Q, const T* K, const T* V, const T* O, const T* dO,
                                 const float* L, T* dQ, T* dK, T* dV, const AttentionShape& s,
                                 const Layout& lay, const Lay& kernel_lay,
                                 const AttentionOptions& o, const Policy& policy,
                                 const FlashTile& tile, cudaStream_t stream) {
    auto kernel = flash_backward_fp16_kernel<T, D, bwd_warps(D, Bc), Bc, Br, Policy, Lay>;
    const int Tc = (s.kv_len + Bc - 1) / Bc;           // K/V tiles per head
    AttentionShape kv_shape = s;                       // one block per K/V tile of each K/V head
    kv_shape.heads = flash_kv_heads(s);
    const int blocks = grid_blocks(kv_shape, s.kv_len, Bc, "kv_len");
    const int kv_group = flash_kv_group(s);  // query heads a K/V head (GQA)
    allow_shared(kernel, tile.shared_bytes);
    // Every K/V tile of a head adds to a dQ_i after the one before it in the order: interleaving
    // heads' tiles keeps those of one head further apart in time, 4 without a mask; under the mask
    // 32, so that a wave holds few tiles of a head, all starting at its last Q tile (NOTES.md
    // section 14).
    const int group = policy.from_left() ? 32 : 4;
    flash_backward_passes(O, dO, L, dQ, s, lay, stream, [&](const BackwardScratch& m) {
        kernel<<<blocks, tile.threads, tile.shared_bytes, stream>>>(
            Q, K, V, dO, L, m.D, m.dQacc, m.turns, m.next_ticket, dK, dV, policy, kernel_lay,
            Tc, s.batch * flash_kv_heads(s), group, kv_group, options_scale_log2(s, o),
            options_scale(s, o));
        return cudaGetLastError();
    }, o);
}


// The policy: with_policy's (lib/mask_policy.cuh), the plain one where it serves the options
// (none, a packed batch, strides, a scale). The layout: the
// contiguous one's constants (DenseLayout) for plain calls on contiguous tensors, else the
// strides (Layout).
template <typename T, int D, int Bc, int Br>
static void launch_backward_fp16(const T* Q, const T* K, const T* V, const T* O, const T* dO,
                                 const float* L, T* dQ, T* dK, T* dV, const AttentionShape& s,
                                 const Layout& lay, const AttentionOptions* options,
                                 const FlashTile& tile, cudaStream_t stream) {
    const AttentionOptions o = options ? *options : AttentionOptions{};
    if (plain_policy_serves(o, s) && dense(lay, s, true))
        return launch_backward_fp16<T, D, Bc, Br>(Q, K, V, O, dO, L, dQ, dK, dV, s, lay,
                                                  DenseLayout<D>{}, o,
                                                  PlainPolicy{s.q_len, s.kv_len, s.causal}, tile,
                                                  stream);
    with_policy(s, o, [&](auto policy) {
        launch_backward_fp16<T, D, Bc, Br>(Q, K, V, O, dO, L, dQ, dK, dV, s, lay, lay, o, policy,
                                           tile, stream);
    });
}

template <typename T>
static void backward_fp16_launch(const char* fn, const cudaDeviceProp& prop, const T* Q,
                                 const T* K, const T* V, const T* O, const T* dO, const float* L,
                                 T* dQ, T* dK, T* dV, const AttentionShape& s,
                                 std::optional<int> Bc, const Layout& lay, cudaStream_t stream,
                                 const AttentionOptions* options = nullptr);
// Bc: keys per K/V tile given by the caller (one of bwd_tiles' at this head_dim), or none for
// the device-derived choice.
template <typename T>
static void backward_fp16_checked(const char* fn, const T* Q, const T* K, const T* V, const T* O,
                                  const T* dO, const float* L, T* dQ, T* dK, T* dV,
                                  const AttentionShape& s, std::optional<int> Bc,
                                  cudaStream_t stream) {
    validate_shape(s, kFlashFp16HeadDims, sizeof(T));
    if (Bc) {                                          // a Bc of this head_dim's tile list
        const auto tiles = bwd_tiles(s.head_dim);
        require(std::any_of(tiles.begin(), tiles.end(),
                            [&](BwdTile t) { return t.Bc > 0 && t.Bc == *Bc; }),
                "Bc = " + std::to_string(*Bc) + " is invalid; allowed values: 64, 128 (128 from "
                "head_dim 32 to 128)");
    }
    validate_backward_pointers(fn, Q, K, V, O, dO, L, dQ, dK, dV, s);
    backward_fp16_launch(fn, flash_device_props(), Q, K, V, O, dO, L, dQ, dK, dV, s, Bc,
                         contiguous_layout(s), stream);
}

// The launch once the arguments are checked: the device's checks, the tile, the kernels.
template <typename T>
static void backward_fp16_launch(const char* fn, const cudaDeviceProp& prop, const T* Q,
                                 const T* K, const T* V, const T* O, const T* dO, const float* L,
                                 T* dQ, T* dK, T* dV, const AttentionShape& s,
                                 std::optional<int> Bc, const Layout& lay, cudaStream_t stream,
                                 const AttentionOptions* options) {
    require_sm80(prop, fn);
    const FlashTile tile = bwd_tile(prop, s.head_dim, Bc.value_or(0));  // refuses what cannot run
    dispatch_head_dim<kFlashFp16HeadDims>(s.head_dim, [&](auto dim) {
        constexpr int D = decltype(dim)::value;
        constexpr std::array<BwdTile, 3> tiles = bwd_tiles(D);
        const auto launch_if_chosen = [&](auto n) {    // the n-th tile of the list, if chosen
            constexpr BwdTile t = tiles[decltype(n)::value];
            if constexpr (t.Bc > 0)
                if (tile.Bc == t.Bc && tile.Br == t.Br)
                    launch_backward_fp16<T, D, t.Bc, t.Br>(Q, K, V, O, dO, L, dQ, dK, dV, s,
                                                           lay, options, tile, stream);
        };
        launch_if_chosen(std::integral_constant<int, 0>{});
        launch_if_chosen(std::integral_constant<int, 1>{});
        launch_if_chosen(std::integral_constant<int, 2>{});
    });
}

// For the API layer (lib/dispatch.cpp: flash_backward_fp16 / _bf16), which has checked the
// arguments.
void flash_backward_ampere_launch(const char* fn, const cudaDeviceProp& prop, const __half* Q,
                                  const __half* K, const __half* V, const __half* O,
                                  const __half* dO, const float* L, __half* dQ, __half* dK,
                                  __half* dV, const AttentionShape& s, const Layout& lay,
                                  cudaStream_t stream, const AttentionOptions* options) {
    backward_fp16_launch(fn, prop, Q, K, V, O, dO, L, dQ, dK, dV, s, std::nullopt, lay, stream,
                         options);
}
void flash_backward_ampere_launch(const char* fn, const cudaDeviceProp& prop,
                                  const __nv_bfloat16* Q, const __nv_bfloat16* K,
                                  const __nv_bfloat16* V, const __nv_bfloat16* O,
                                  const __nv_bfloat16* dO, const float* L, __nv_bfloat16* dQ,
                                  __nv_bfloat16* dK, __nv_bfloat16* dV, const AttentionShape& s,
                                  const Layout& lay, cudaStream_t stream,
                                  const AttentionOptions* options) {
    backward_fp16_launch(fn, prop, Q, K, V, O, dO, L, dQ, dK, dV, s, std::nullopt, lay, stream,
                         options);
}

void flash_backward_fp16_ampere(const __half* Q, const __half* K, const __half* V,
                                const __half* O, const __half* dO, const float* L, __half* dQ,
                                __half* dK, __half* dV, const AttentionShape& s,
                                cudaStream_t stream) {
    backward_fp16_checked("flash_backward_fp16_ampere", Q, K, V, O, dO, L, dQ, dK, dV, s,
                          std::nullopt, stream);
}

void flash_backward_bf16_ampere(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                                const __nv_bfloat16* V, const __nv_bfloat16* O,
                                const __nv_bfloat16* dO, const float* L, __nv_bfloat16* dQ,
                                __nv_bfloat16* dK, __nv_bfloat16* dV, const AttentionShape& s,
                                cudaStream_t stream) {
    backward_fp16_checked("flash_backward_bf16_ampere", Q, K, V, O, dO, L, dQ, dK, dV, s,
                          std::nullopt, stream);
}

void flash_backward_fp16_bc(const __half* Q, const __half* K, const __half* V, const __half* O,
                            const __half* dO, const float* L, __half* dQ, __half* dK, __half* dV,
                            const AttentionShape& s, int Bc, cudaStream_t stream) {
    backward_fp16_checked("flash_backward_fp16", Q, K, V, O, dO, L, dQ, dK, dV, s, Bc, stream);
}
#endif  // the backward's host code
