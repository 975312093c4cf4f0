// flash_hopper.cu: chapter 3, the forward on Hopper's own instructions (NOTES.md section 17).
// FlashAttention-2's Algorithm 1 as chapter 2 runs it, with its two products on wgmma: a warpgroup
// (4 warps, 128 threads) multiplies a 64-row tile at once, its operands read from shared memory
// through 64-bit descriptors (or, for P~, from registers), asynchronously. The tiles arrive by the
// tensor memory accelerator (TMA), which one producer thread drives while the consumer warpgroups
// compute (warp specialisation; setmaxnreg moves registers to the consumers); mbarriers say when
// a stage is full and when it is free again. Each tile's softmax runs while the previous tile's
// O_i += P~ V_j is on the tensor cores. The grid is persistent: a block an SM, each taking tile
// after tile from a counter. Head dims: kFlashHopperHeadDims (flash.h); fp16 and bf16; compute
// capability 9.0 only. Not here: FlashAttention-3's O written by TMA, its ping-pong at d = 64 and
// 256 (NOTES.md section 17 says why), its fp8 (flash_hopper_fp8.cu). How it was built, step by
// step and measured: lab/chapter3.md.
//
// Build: wgmma exists only in the sm_90a target, so this file alone is compiled with
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -c flash_hopper.cu
// (the Makefile does it). The helpers, each wrapping one PTX instruction, are in lib/hopper.cuh,
// shared with chapter 3's backward (flash_hopper_backward.cu).
#include "checks.h"
#include "chapters.h"
#include "flash.h"
#include "hopper.cuh"  // the helpers chapter 3's forward and backward share
#include "log2_units.h"
#include "mask_policy.cuh"  // the mask and score: PlainPolicy, or chapter 5's policies

#include <cuda.h>          // CUtensorMap and its enums (types only: nothing links libcuda)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled_v12000
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <type_traits>
#include <utility>

// Consumer warpgroups, 64 rows of Q_i each (Br = 64 consumers): two, but three at d = 64, where a
// tile's products are short beside its softmax. Registers a thread, set with setmaxnreg: 65536
// shared by the block's 128 (consumers + 1) threads, the producer keeping few.
__host__ __device__ constexpr int hopper_consumers(int head_dim) { return head_dim == 64 ? 3 : 2; }
__host__ __device__ constexpr int hopper_Br(int d) { return 64 * hopper_consumers(d); }
__host__ __device__ constexpr int producer_regs(int consumers) { return consumers > 2 ? 32 : 24; }
__host__ __device__ constexpr int consumer_regs(int consumers) { return consumers > 2 ? 160 : 240; }
// Keys a K/V tile: 128, but 48 at d = 256, where a consumer thread holds 128 floats of O_i and a
// K/V tile of 128 keys is 128 KiB.
__host__ __device__ constexpr int hopper_Bc(int head_dim) { return head_dim == 256 ? 48 : 128; }
// The pipeline's stages, K/V tiles in shared memory at once (227 KiB an SM): three, the same at
// every head dim (208 KiB with Q_i at d = 256, where tiles of 64 keys would leave room for two
// only, and with two, tile j + 1's copies wait until O_i += P~ V_{j-1} is done). A function of
// the head dim all the same, as Br and Bc are, so that one head dim can be given its own count.
__host__ __device__ constexpr int hopper_stages(int /* head_dim */) { return 3; }
// Q_i in registers at d = 128 (32 a thread, read once a Q tile by load_A_fragments), so that
// S_ij = Q_i K_j^T is an RS product and does not read Q_i from shared memory for every K/V tile
// (lab/chapter3.md, "Q_i in registers"). At d = 256 it would take 64 registers a thread; at
// d = 64 16 more do not fit the three consumers' 160 (ptxas serializes the wgmmas).
__host__ __device__ constexpr bool hopper_q_regs(int head_dim) { return head_dim == 128; }
// The grid: persistent, one block an SM looping over the tiles. -DHOPPER_PERSISTENT=0 gives every
// tile its own block instead, to measure what the persistent grid buys.
#ifndef HOPPER_PERSISTENT
#define HOPPER_PERSISTENT 1
#endif
constexpr bool kPersistent = HOPPER_PERSISTENT;
// Ping-pong (FlashAttention-3): the two consumers take turns to issue S_ij = Q_i K_j^T (Turns,
// lib/hopper.cuh), so that one's softmax runs while the other's product is on the tensor cores. At
// d = 128 only, where it measured 1.00-1.07x; d = 64 runs three consumers, and at d = 256 it
// measured 0.97-1.13x. -DHOPPER_PINGPONG=0 turns it off.
#ifndef HOPPER_PINGPONG
#define HOPPER_PINGPONG 1
#endif
__host__ __device__ constexpr bool hopper_pingpong(int d) { return HOPPER_PINGPONG && d == 128; }
// The lazy rescale (FlashAttention-4's rule), at d = 256: a row's m moves only when a tile's scores
// pass it by more than 2^kLazyLog2 (a warp's rows decide together, rows outside the sequence left
// out: in a packed batch they hold its neighbours' queries), so P~ <= 2^8, within fp16's range, and
// most tiles skip O_i's rescale: 128 multiplies a thread for its 24 scores at d = 256, where it
// measured 0.99-1.15x (median 1.09x). Elsewhere m moves every tile, as Algorithm 1's line 9.
// -DHOPPER_LAZY=0 turns it off.
#ifndef HOPPER_LAZY
#define HOPPER_LAZY 1
#endif
__host__ __device__ constexpr bool hopper_lazy(int d) { return HOPPER_LAZY && d == 256; }
constexpr float kLazyLog2 = 8.f;
// Heads whose Q tiles go together (line 3): 4. The SMs then stream 4 heads' K and V at once (4 /
// group K/V heads under GQA, whose query heads are consecutive), which stay in L2; 16 heads' did
// not (128 MB at N = 16384, d = 128), and K/V tiles read again from DRAM cost power, so clock.
constexpr int kHopperHeadGroup = 4;

// The named barriers (barrier.sync takes an id, 0 being __syncthreads'): the hand-out, where the
// producer's first warp, which has fetched a tile's number, gives it to the consumer warpgroups,
// which take it as they start the tile; and the registers', which the consumers pass only once
// the producer has given its registers back (setmaxnreg.dec), so that their setmaxnreg.inc never
// waits: the GPU would block it until the block's pool has them, but compute-sanitizer's
// racecheck hung in about half its runs at d = 64 when the consumers asked first.
constexpr int kBarrierHandout = 1, kBarrierRegisters = 4;
template <int Consumers>
__device__ __forceinline__ void handout() {
    named_barrier(kBarrierHandout, 32 + kWarpgroup * Consumers);
}

// The block's shared memory, laid out by a struct (as the backward's, and FlashAttention-3's
// SharedStorage): Q_i (Br rows), then the stages of K_j and V_j (Bc rows each), each tile as
// blocks of 64 columns in the 128-byte swizzle, starting on a 1024-byte boundary (the swizzle
// works on address bits 4-9); then the mbarriers: full[s] and empty[s] of stage s, full[Stages]
// and empty[Stages] for Q_i; then the tile numbers, two slots.
template <typename T, int D, int Bc, int Consumers>
struct FwdShared {
    static constexpr int Br = 64 * Consumers, Stages = hopper_stages(D);
    alignas(1024) T Q_i[Br * D];
    struct Stage {
        alignas(1024) T K_j[Bc * D];
        alignas(1024) T V_j[Bc * D];
    } KV[Stages];
    uint64_t full[Stages + 1], empty[Stages + 1];
    int work[2];                                       // tile numbers, at Q_i's phase
};

// ---------------------------------------------------------------------------------------------
// Line 3, the producer's and the consumers' alike: tile -> (Q tile i, head bh) and its K/V tiles
// j0 .. j0 + Tc - 1 (the policy's: all to the last row's last key under causal), as chapter 2:
// heads in groups of head_group, each group's Q tiles longest (causal) first, its heads taking
// turns. Head bh's policy: its sequence's (a packed batch's lengths, the layout's; else the
// shape's) and its head's (ALiBi's slope). Q tile i starts at row0 = i Br - (Br - q_len % Br) %
// Br: the last tile ends on the last row, and where Br does not divide q_len (d = 64: Br = 192)
// the ragged tile is the first, rows from row0 < 0, which under causal sees the fewest keys, not
// the last, which sees the most (d = 64, N = 4096, causal: 1.05-1.07x). Rows outside 0 .. q_len - 1
// are computed (TMA reads rows before a sequence as zeros, or a packed batch's sequence before)
// and never written.
template <int Br, int Bc, typename Policy>
struct FwdTiles {
    const Layout& lay;
    const Policy& policy;
    int Tr, tiles, head_group, group;
    struct Work {
        int row0, bh, j0, Tc;
    };
    __device__ Policy policy_of(int bh) const {
        const int q_len = lay.Q.len(bh, policy.q_len);
        const int kv_len = lay.K.len(bh / group, policy.kv_len);
        return policy.for_sequence(q_len, kv_len).for_head(bh);
    }
    __device__ Work decode(int tile) const {
        const int head0 = tile / (head_group * Tr) * head_group;
        const int heads = min(head_group, tiles / Tr - head0), place = tile % (head_group * Tr);
        const int i = Tr - 1 - place / heads, bh = head0 + place % heads;
        const Policy pol = policy_of(bh);
        const int row0 = i * Br - (Br - pol.q_len % Br) % Br, first = max(row0, 0);
        const KeySpan keys = pol.keys(first, row0 + Br - first);  // the keys of its rows >= 0
        const int j0 = keys.begin / Bc;
        return Work{row0, bh, j0, keys.end > keys.begin ? (keys.end - 1) / Bc - j0 + 1 : 0};
    }
};

// The producer (lines 4 and 7): its first warp fetches tile numbers and hands them out, its lane
// 0, the issuer, copies Q_i and the K/V tiles by TMA into free stages.
template <typename T, int D, int Bc, int Consumers, typename Tiles>
__device__ __forceinline__ void fwd_produce(FwdShared<T, D, Bc, Consumers>& sh,
                                            const CUtensorMap& Q, const CUtensorMap& K,
                                            const CUtensorMap& V, const Tiles& map,
                                            const Layout& lay, int* next) {
    constexpr int Br = 64 * Consumers, Stages = hopper_stages(D);
    T* Q_i = sh.Q_i;
    uint64_t *full = sh.full, *empty = sh.empty;
    int* work = sh.work;
    const auto K_at = [&](int stage) { return sh.KV[stage].K_j; };  // the stage's K_j
    const auto V_at = [&](int stage) { return sh.KV[stage].V_j; };  // and V_j
    if (threadIdx.x >= 32) return;                 // warp 0 runs the loop, lane 0 the copies
    const bool issuer = threadIdx.x == 0;
    PipelineState<Stages> kv;                      // the K/V tile it loads next
    int tile = blockIdx.x;
    for (PipelineState<1> q;; q.advance()) {       // Q_i's ring, of one stage
        if (issuer) work[q.phase()] = tile;        // the next tile (past the end: none left)
        if (tile >= map.tiles) break;
        const auto [row0, bh, j0, Tc] = map.decode(tile);
        if (q.n > 0) mbar_wait(&empty[Stages], q.phase_before());  // the last Q_i is read
        if (issuer) mbar_expect_bytes(&full[Stages], Br * D * sizeof(T));  // line 4: load Q_i
        // Where the maps have head bh's row 0 (row, head, batch), and its K/V head's, bh /
        // group: the group query heads of a K/V head (GQA) share it.
        const int3 q0 = lay.Q.box_at(bh, row0), k0 = lay.K.box_at(bh / map.group, j0 * Bc);
        if (issuer) load_tile<Br, D>(Q_i, Q, q0.x, q0.y, q0.z, &full[Stages]);
        for (int j = 0; j < Tc; j++, kv.advance()) {  // line 7: K_j, V_j, in a free stage
            if (j == Stages) handout<Consumers>();  // the consumers start this tile
            if (kv.n >= Stages) mbar_wait(&empty[kv.stage()], kv.phase_before());
            if (!issuer) continue;
            mbar_expect_bytes(&full[kv.stage()], 2 * Bc * D * sizeof(T));
            const int row = k0.x + j * Bc;         // tile j0 + j
            load_tile<Bc, D>(K_at(kv.stage()), K, row, k0.y, k0.z, &full[kv.stage()]);
            load_tile<Bc, D>(V_at(kv.stage()), V, row, k0.y, k0.z, &full[kv.stage()]);
        }
        if (Tc <= Stages) handout<Consumers>();    // (all of its tiles issued)
        tile = __shfl_sync(0xffffffffu, issuer ? atomicAdd(next, 1) + int(gridDim.x) : 0, 0);
    }
    handout<Consumers>();                          // the consumers learn that none is left
    // It leaves only once the last tiles it filled are read: no copy it issued outlives it
    // (blocks of a cluster need that; whether racecheck needs it here: exercise 3.4).
    for (PipelineState<Stages> s{max(kv.n - Stages, 0)}; s.n < kv.n; s.advance())
        mbar_wait(&empty[s.stage()], s.phase());
}

// Line 9 for row r of a thread's two: m moves to `seen` (this tile's max, or with Lazy the larger
// of it and m), alpha[r] = exp(m_old - m) rescales l here and O_i after line 10's wait, and
// P~_ij = exp(S_ij - m) goes into S's registers and into l.
template <bool Lazy, int N>
__device__ __forceinline__ void exponentials(float (&S_ij)[N], int r, float seen, float (&m)[2],
                                             float (&l)[2], float (&alpha)[2], float scale_log2) {
    const float m_new = Lazy ? fmaxf(m[r], seen) : seen;
    const float new_log2 = m_new == -INFINITY ? 0.f : m_new * scale_log2;
    alpha[r] = exp2_ftz(m[r] * scale_log2 - new_log2);
    m[r] = m_new;
    const float m_log2 = m[r] == -INFINITY ? 0.f : m[r] * scale_log2;  // no key yet
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < N / 2; c++) {                  // the row's Bc / 4 elements a thread
        float& s = acc_at(S_ij, r, c);
        s = exp2_ftz(fmaf(s, scale_log2, -m_log2));
        sum += s;
    }
    l[r] = l[r] * alpha[r] + sum;
}
// Line 9 under the lazy rule, in two halves. lazy_ahead takes P~ against the m the row has while it
// finds the tile's max (the exponentials need not wait for the max and the warp's vote), and keeps
// the scores; lazy_settle, after the vote, keeps P~ where the warp's m stays, and where it moves
// takes P~ again from the scores. Either way the bits are those of exponentials<true>.
template <int N>
__device__ __forceinline__ float lazy_ahead(float (&S_ij)[N], int r, float (&raw)[N / 2], float m,
                                            float& sum, float scale_log2) {
    const float m_log2 = m == -INFINITY ? 0.f : m * scale_log2;
    float m_row = -INFINITY;
    sum = 0.f;
#pragma unroll
    for (int c = 0; c < N / 2; c++) {
        float& s = acc_at(S_ij, r, c);
        raw[c] = s, m_row = fmaxf(m_row, s);
        s = exp2_ftz(fmaf(s, scale_log2, -m_log2));
        sum += s;
    }
    return m_row;                                      // (this thread's part of the row)
}
template <int N>
__device__ __forceinline__ void lazy_settle(float (&S_ij)[N], int r, bool moves,
                                            const float (&raw)[N / 2], float seen, float sum,
                                            float (&m)[2], float (&l)[2], float (&alpha)[2],
                                            float scale_log2) {
    if (!moves) {
        alpha[r] = 1.f, l[r] += sum;
        return;
    }
#pragma unroll
    for (int c = 0; c < N / 2; c++) acc_at(S_ij, r, c) = raw[c];
    exponentials<true>(S_ij, r, seen, m, l, alpha, scale_log2);
}

// A consumer (lines 5-13): 64 rows of each tile's Q_i, the softmax under the product.
template <typename T, int D, int Bc, int Consumers, typename Policy, typename Tiles>
__device__ __forceinline__ void fwd_consume(FwdShared<T, D, Bc, Consumers>& sh, const Tiles& map,
                                            T* __restrict__ O, float* __restrict__ L,
                                            const Layout& lay, float scale_log2) {
    constexpr int Br = 64 * Consumers, Stages = hopper_stages(D);
    using Turn = Turns<hopper_pingpong(D)>;
    T* Q_i = sh.Q_i;
    uint64_t *full = sh.full, *empty = sh.empty;
    int* work = sh.work;
    const auto K_at = [&](int stage) { return sh.KV[stage].K_j; };
    const auto V_at = [&](int stage) { return sh.KV[stage].V_j; };
    const int wg = warpgroup_index() - 1;              // which consumer, 0 .. Consumers - 1
    const int warp = threadIdx.x % kWarpgroup / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    // The warpgroup's 64 rows of Q_i: in each 64-column block, after wg times 64 rows of 64.
    const uint64_t Q_w = smem_desc(Q_i + wg * 64 * 64, 0);  // (a descriptor: desc_plus)
    uint32_t P[Bc / 16][4];                            // P~ of the last tile, in T, as A
    constexpr bool kQregs = hopper_q_regs(D);
    uint32_t Q_r[kQregs ? D / 16 : 1][4];              // (hopper_q_regs) the warp's rows of Q_i
    PipelineState<Stages> kv;                          // where the Q tile's K/V tiles start
    for (PipelineState<1> q;; q.advance()) {           // Q_i's ring, of one stage
        handout<Consumers>();                          // the producer has written work[q.phase()]
        const int tile = work[q.phase()];
        if (tile >= map.tiles) break;
        const auto [row0, bh, j0, Tc] = map.decode(tile);
        const Policy pol = map.policy_of(bh);
        const int q_len = pol.q_len;
        mbar_wait(&full[Stages], q.phase());           // Q_i is in
        if constexpr (kQregs) load_A_fragments<D>(Q_r, Q_i, Br, 64 * wg + 16 * warp);
        const int query = row0 + 64 * wg + 16 * warp + g;  // this thread's rows: query + 8r
        const auto real = [&](int row) { return 0 <= row && row < q_len; };  // (row0 may be < 0)
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, O_i[D / 2] = {};  // line 5
        const auto add_PV = [&](int stage) {           // line 10's product: O_i += P~ V_j
            const uint64_t V_j = smem_desc(V_at(stage), Bc * kRowBytes);
            constexpr int N = D < 128 ? D : 128;       // columns a wgmma (d = 256: two halves)
#pragma unroll
            for (int k = 0; k < Bc / 16; k++)
#pragma unroll
                for (int half = 0; half < D / N; half++)
                    wgmma_rs<T, N>(O_i + half * N / 2, P[k],
                                   desc_plus(V_j, (half * N / 64 * Bc + k * 16) * kRowBytes));
            wgmma_commit();
        };
        PipelineState<Stages> read = kv;               // the K/V tile it reads next
        for (int j = j0; j < j0 + Tc; j++, read.advance()) {  // line 6: for each K_j, V_j
            mbar_wait(&full[read.stage()], read.phase());  // K_j and V_j are in
            const uint64_t K_j = smem_desc(K_at(read.stage()), 0);
            float S_ij[Bc / 2] = {}, alpha[2], m_tile[2];  // line 8: S_ij = Q_i K_j^T, 16 of d
            float raw[2][Bc / 4], sums[2];             // (lazily: the scores, P~'s sums)
            bool grows = false;
            Turn::take(wg);                            // (ping-pong: my turn for line 8)
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < D / 16; k++) {
                const uint64_t K_k = desc_plus(K_j, k / 4 * Bc * kRowBytes + k % 4 * 32);
                if constexpr (kQregs)
                    wgmma_rs<T, Bc, false>(S_ij, Q_r[k], K_k);
                else
                    wgmma_ss<T, Bc>(S_ij, desc_plus(Q_w, k / 4 * Br * kRowBytes + k % 4 * 32), K_k);
            }
            wgmma_commit();
            Turn::pass(wg);                            // (before line 10: after, ptxas serializes)
            // Line 10 of the tile before, O_i += P~ V_{j-1}, runs while this tile's softmax does.
            if (j > j0) add_PV(read.previous().stage());
            j > j0 ? wgmma_wait<1>(S_ij) : wgmma_wait<0>(S_ij);  // S_ij done (P~ V_{j-1}: not yet)
            if constexpr (kQregs) a_operand_fence(Q_r);  // (S_ij's product has read Q_r)
#pragma unroll
            for (int r = 0; r < 2; r++) {              // line 9 for row query + 8r
                float du;                              // (a derivative only the backward needs)
                const auto near = pol.at(query + 8 * r, j * Bc + 2 * t);  // key j Bc + 2t + k:
#pragma unroll
                for (int c = 0; c < Bc / 4; c++) {     // the score changed, if the policy does
                    float& s = acc_at(S_ij, r, c);
                    s = near.score(s, -(8 * (c / 2) + c % 2), du);  // at distance -k
                }
                // acc_at(S_ij, r, c) is key j Bc + 2t + 8 (c / 2) + c % 2: masked outside the
                // row's keys, only in a tile that reaches past them (a branch, not a select on
                // every element: NOTES.md section 17). Bc - 7 = 8 (Bc / 8 - 1) + 1 is this
                // thread's last key offset in the tile. The left side is tested only where a
                // row's keys can start past 0 (Policy::kLeftEdge: a window).
                const Span seen = pol.row_keys(query + 8 * r);
                const int lo = seen.first - j * Bc - 2 * t, hi = seen.last - j * Bc - 2 * t;
                if ((Policy::kLeftEdge && lo > 0) || hi < Bc - 7)
#pragma unroll
                    for (int c = 0; c < Bc / 4; c++) {
                        const int key = 8 * (c / 2) + c % 2;  // (offset from j Bc + 2t)
                        if (key > hi || (Policy::kLeftEdge && key < lo))
                            acc_at(S_ij, r, c) = -INFINITY;
                    }
                float m_row = m[r];                    // the max of all so far (or lazily
                if constexpr (hopper_lazy(D))          // this tile's, P~ taken meanwhile)
                    m_row = lazy_ahead(S_ij, r, raw[r], m[r], sums[r], scale_log2);
                else
#pragma unroll
                    for (int c = 0; c < Bc / 4; c++)   // the row's max, over its keys here
                        m_row = fmaxf(m_row, acc_at(S_ij, r, c));
                m_row = quad_reduce(m_row, fmaxf);     // the max over the row's 4 threads
                if constexpr (!hopper_lazy(D))        // m moves every tile
                    exponentials<false>(S_ij, r, m_row, m, l, alpha, scale_log2);
                else grows |= real(query + 8 * r) &&  // (a row outside the sequence: no say)
                              m_row * scale_log2 >
                                  (m[r] == -INFINITY ? -INFINITY : m[r] * scale_log2 + kLazyLog2);
                m_tile[r] = m_row;
            }
            bool moves = true;                         // (lazily: when some row of the warp grew
            if constexpr (hopper_lazy(D)) {            // past its m by more than 2^kLazyLog2)
                moves = __any_sync(0xffffffffu, grows);
#pragma unroll
                for (int r = 0; r < 2; r++)
                    lazy_settle(S_ij, r, moves, raw[r], m_tile[r], sums[r], m, l, alpha,
                                scale_log2);
            }
            wgmma_wait<0>(O_i);                        // O_i += P~ V_{j-1} is done
            if (j > j0 && threadIdx.x % 32 == 0) mbar_arrive(&empty[read.previous().stage()]);
            if (moves)
#pragma unroll
                for (int n = 0; n < D / 2; n++) O_i[n] *= alpha[n % 4 / 2];  // element n: row n%4/2
#pragma unroll
            for (int k = 0; k < Bc / 16; k++)          // line 10's P~, in T as A, for next time
#pragma unroll
                for (int a = 0; a < 4; a++)            // A's register a: S_ij's 8k + 2a, + 1
                    P[k][a] = pair_bits<T>(S_ij[8 * k + 2 * a], S_ij[8 * k + 2 * a + 1]);
        }
        if (threadIdx.x % 32 == 0) mbar_arrive(&empty[Stages]);  // Q_i read: the next one may load
        kv.advance(Tc);
        if (Tc > 0) {                                  // line 10 of the last tile
            wgmma_fence();
            add_PV(kv.previous().stage());
            wgmma_wait<0>(O_i);
            if (threadIdx.x % 32 == 0) mbar_arrive(&empty[kv.previous().stage()]);
        }
#pragma unroll
        for (int r = 0; r < 2; r++) {                  // lines 12-13: O_i / l, L = m + log l
            const int row = query + 8 * r;
            const float l_row = quad_reduce(l[r], add);  // the sum over the row's 4 threads
            const float inv = l_row > 0.f ? 1.f / l_row : 0.f;  // a row that sees no key: O = 0
            store_row<T, D>(O + lay.O.at(bh) + row * lay.O.row, O_i, r, inv, t, real(row));
            if (!real(row)) continue;
            const float L_row = l_row > 0.f ? (m[r] * scale_log2 + log2f(l_row)) * kLn2 : -INFINITY;
            if (t == 0) L[lay.L.at(bh, q_len) + row] = L_row;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The kernel. A persistent grid, one block an SM, each block running tiles (Q tile i, batch*head)
// one after another: its first is blockIdx.x, then whichever the counter `next` hands out as it
// nears the end of one (dynamic, so that long causal tiles and short ones even out), and the next
// tile's Q_i and first K/V tiles load while the last one's O_i is written. Consumers + 1
// warpgroups: warpgroup 0 is the producer (its first warp fetches tile numbers, one thread, the
// issuer, issues every TMA copy), warpgroups 1..Consumers the consumers, 64 rows of Q_i each
// (Br = 64 Consumers). K/V tiles of Bc keys pass through a ring of Stages stages (PipelineState,
// above), each with two mbarriers: full (the copy engine's bytes are in) and empty (all 4
// Consumers consumer warps have read it); Q_i has a pair too, a ring of one stage whose phase
// also picks the slot of the tile numbers. A consumer thread's accumulators are read through
// acc_at, as in chapter 2. Policy: the mask and the score, chapter 2's (lib/mask_policy.cuh):
// which K/V tiles a Q tile loads, which scores are tested, each score's change. lay: where the
// rows are (chapter 5's strides, a packed batch's sequences); the maps Q, K, V hold them too.
template <typename T, int D, int Bc, int Consumers, typename Policy>
__global__ void __launch_bounds__(kWarpgroup * (Consumers + 1), 1)
flash_forward_hopper_kernel(const __grid_constant__ CUtensorMap Q,
                            const __grid_constant__ CUtensorMap K,
                            const __grid_constant__ CUtensorMap V, T* __restrict__ O,
                            float* __restrict__ L, const __grid_constant__ Layout lay,
                            const Policy policy, int Tr, int tiles, int head_group, int group,
                            float scale_log2, int* next) {
    auto& sh = shared_storage<FwdShared<T, D, Bc, Consumers>>();
    const FwdTiles<64 * Consumers, Bc, Policy> map{lay, policy, Tr, tiles, head_group, group};
    if (threadIdx.x == 0) init_barriers(sh.full, sh.empty, hopper_stages(D) + 1, 4 * Consumers);
    __syncthreads();
    Turns<hopper_pingpong(D)>::start(int(threadIdx.x / kWarpgroup) - 1);  // (consumer 1: 0 first)
    if (threadIdx.x < kWarpgroup) {                    // the producer: lines 4 and 7
        setmaxnreg<false, producer_regs(Consumers)>();  // it needs few registers; the math, many
        named_arrive(kBarrierRegisters, kWarpgroup * (Consumers + 1));  // (given back)
        return fwd_produce(sh, Q, K, V, map, lay, next);
    }
    named_barrier(kBarrierRegisters, kWarpgroup * (Consumers + 1));  // taken only once given back
    setmaxnreg<true, consumer_regs(Consumers)>();
    fwd_consume<T, D, Bc, Consumers, Policy>(sh, map, O, L, lay, scale_log2);
}
#undef HOPPER_ONLY

// ---------------------------------------------------------------------------------------------
// The launcher: chapter 2's checks, then compute capability 9.0.
// Shared memory: FwdShared (shared_bytes_through, lib/hopper.cuh; bf16's is fp16's size).
template <int D>
constexpr size_t flash_hopper_shared_bytes() {
    using Shared = FwdShared<__half, D, hopper_Bc(D), hopper_consumers(D)>;
    return shared_bytes_through(offsetof(Shared, work) + sizeof(Shared::work));
}
// The budgets, checked where they are set, at every head dim of kFlashHopperHeadDims. Shared
// memory: 227 KiB a block on an H100 or H200. Registers: setmaxnreg takes multiples of 8 from 24
// to 256, and the block's 128 (consumers + 1) threads share the SM's 65536.
constexpr bool registers_fit(int consumers) {
    const int producer = producer_regs(consumers), consumer = consumer_regs(consumers);
    return producer % 8 == 0 && consumer % 8 == 0 && producer >= 24 && consumer <= 256 &&
           kWarpgroup * (producer + consumers * consumer) <= 65536;
}
constexpr bool every_head_dim(bool (*fits)(int)) {
    for (const int d : kFlashHopperHeadDims)
        if (!fits(d)) return false;
    return true;
}
template <size_t... I>
constexpr bool shared_fits(std::index_sequence<I...>) {
    return ((flash_hopper_shared_bytes<kFlashHopperHeadDims[I]>() <= 227 * 1024) && ...);
}
static_assert(shared_fits(std::make_index_sequence<std::size(kFlashHopperHeadDims)>()),
              "a block past 227 KiB");
static_assert(every_head_dim([](int d) { return registers_fit(hopper_consumers(d)); }),
              "setmaxnreg's registers past the SM's 65536");


// The launch alone (checks.h: flash_forward_hopper_launch), for callers that have run every check.
// The policy: with_policy's (lib/mask_policy.cuh), the plain one where it serves the options
// (none, strides, a packed batch, a scale), and ALiBi's term only where slopes are (<true>).
template <typename T>
static void launch_forward_hopper(const T* Q, const T* K, const T* V, T* O, float* L,
                                  const AttentionShape& s, const Layout& lay, cudaStream_t stream,
                                  const AttentionOptions* options = nullptr) {
    // The maps' extents: the shape, or a packed batch's one batch of total rows (packed_shape).
    const bool packed = options && options->packed.cu_seqlens_q;
    const AttentionShape x = packed ? packed_shape(s, options->packed) : s;
    dispatch_head_dim<kFlashHopperHeadDims>(s.head_dim, [&](auto dim) {
        constexpr int D = decltype(dim)::value, Br = hopper_Br(D), Bc = hopper_Bc(D);
        constexpr size_t bytes = flash_hopper_shared_bytes<D>();
        const int tiles = grid_blocks(s, s.q_len, Br, "q_len");  // Q tiles of all heads
        const CUtensorMap Qm = tensor_map(Q, lay.Q, x.batch, x.q_len, D, Br),
                          Km = tensor_map(K, lay.K, x.batch, x.kv_len, D, Bc),  // GQA: fewer heads
                          Vm = tensor_map(V, lay.V, x.batch, x.kv_len, D, Bc);
        const int blocks = kPersistent ? std::min(tiles, flash_device_props().multiProcessorCount)
                                       : tiles;
        const auto run = [&](auto policy, float scale_log2) {
            const auto kernel =
                flash_forward_hopper_kernel<T, D, Bc, hopper_consumers(D), decltype(policy)>;
            allow_shared(kernel, bytes);
            with_scratch(sizeof(int), stream, [&](void* next) {  // the next tile to hand out
                cudaError_t err = cudaMemsetAsync(next, 0, sizeof(int), stream);  // the int 0
                if (err != cudaSuccess) return err;
                kernel<<<blocks, kWarpgroup * (hopper_consumers(D) + 1), bytes, stream>>>(
                    Qm, Km, Vm, O, L, lay, policy, (s.q_len + Br - 1) / Br, tiles,
                    kHopperHeadGroup, flash_kv_group(s), scale_log2, static_cast<int*>(next));
                return cudaGetLastError();
            });
        };
        const AttentionOptions o = options ? *options : AttentionOptions{};
        const float scale_log2 = options_scale_log2(s, o);  // the options', or 1/sqrt(d)'s
        with_policy<true>(s, o, [&](auto policy) { run(policy, scale_log2); });
    });
}

void flash_forward_hopper_launch(const __half* Q, const __half* K, const __half* V, __half* O,
                                 float* L, const AttentionShape& s, const Layout& lay,
                                 cudaStream_t stream, const AttentionOptions* options) {
    launch_forward_hopper(Q, K, V, O, L, s, lay, stream, options);
}
void flash_forward_hopper_launch(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                                 const __nv_bfloat16* V, __nv_bfloat16* O, float* L,
                                 const AttentionShape& s, const Layout& lay, cudaStream_t stream,
                                 const AttentionOptions* options) {
    launch_forward_hopper(Q, K, V, O, L, s, lay, stream, options);
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
    launch_forward_hopper(Q, K, V, O, L, s, contiguous_layout(s), stream);
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
