// flash_hopper_backward.cu: chapter 3, the backward on Hopper's own instructions. Chapter 2's
// backward (flash_fp16.cu: FlashAttention-2's Algorithm 2, one block per K/V tile j, the Q tiles
// streaming past, dQ added in a fixed order) with chapter 3's tools (lib/hopper.cuh): all five
// products on wgmma, the tiles brought by TMA through a ring of stages that a producer warp fills
// while two consumer warpgroups compute, the transposes done by descriptors, not copies.
//
// Everything is transposed, as in chapter 2: S^T = K_j Q_i^T has a key per row, so a consumer
// warpgroup's accumulators hold P^T and dS^T exactly as the A fragment of the next products wants
// them (dV_j += P^T dO_i, dK_j += dS^T Q_i: wgmma with A in registers, FlashAttention-3's trick);
// only dS goes through shared memory, once, for dQ_i = dS K_j, which reads it, and K_j, transposed
// (imm-trans 1). dQ_i's part goes back through shared memory too, and two warps of their own add
// it into dQacc (fp32) by TMA reduce-adds, in chapter 2's fixed order: bitwise deterministic.
//
// The kernel, as FlashAttention-3's backward, is a short dispatcher over roles: the producer
// (produce: lines 6 and 9), the dQ writers (write_dq) and the consumers (consume: lines 7-18, a
// function a step). What was measured, tried and dropped on the way: lab/chapter3-backward.md.
//
// Grouped K/V heads (AttentionShape::kv_heads): a block is (batch, K/V head, K/V tile j) and walks
// the Q tiles of the group's heads / kv_heads query heads, so that dK_j and dV_j sum over the group
// in registers, in a fixed order: Q tile by Q tile, the group's heads in turn at each. Head dims:
// kFlashHopperHeadDims; fp16 and bf16; compute capability 9.0. Built for sm_90a only, as
// flash_hopper.cu.
#include "checks.h"
#include "chapters.h"
#include "flash.h"
#include "hopper.cuh"
#include "log2_units.h"
#include "mask_policy.cuh"  // the mask and score: PlainPolicy, or chapter 5's policies
#include "ordered_add.cuh"  // block_ticket, wait_turn, pass_turn: chapter 2's

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

// The tile. Q tiles of Br = 64 rows (one wgmma's M); two consumer warpgroups. Up to d = 128 each
// owns 64 keys of a K/V tile of Bc = 128 and holds all d columns of their dK_j and dV_j (d floats a
// thread at d = 128); at d = 256 that would be 256 floats, so the two share 64 keys (Bc = 64) and
// each holds half of the columns (Split = 2; both then compute the same S^T and dP^T, 40% more
// products at d = 256).
constexpr int kBwdConsumers = 2, kBwdBr = 64;
static_assert(kBwdBr >= kBackwardMinBr, "the scratch has turns for Q tiles of kBackwardMinBr rows up");
// Stages of Q_i, dO_i, L_i, D_i: two, four at d = 64, whose tiles are short (with two, the
// consumers would wait for the next tile).
__host__ __device__ constexpr int bwd_stages(int d) { return d == 64 ? 4 : 2; }
__host__ __device__ constexpr int bwd_split(int d) { return d == 256 ? 2 : 1; }
__host__ __device__ constexpr int bwd_Bc(int d) { return 64 * kBwdConsumers / bwd_split(d); }
// dQ_i (Br x d, fp32) leaves the consumers a chunk of columns at a time, through shared-memory
// buffers, to dQ writer warps, one a buffer (write_dq, below). A consumer computes 64 columns a
// wgmma (the transposed reads need 64); who computes which:
//  - d = 128: each consumer one, into a buffer of its own (chunks of 64 columns, 16 KiB);
//  - d = 64: the consumers take turns, tile by tile (tile n: consumer n % 2, buffer n % 2); 32
//    columns each would be narrower than the transposed wgmma reads;
//  - d = 256: the consumers take turns too (tile n: consumer n % 2), each all four of its tile's
//    64-column products, passed on as eight chunks of 32 columns, three buffers in turn (8 KiB
//    each; the third in the room of a second dS^T buffer: dS^T waits for the last tile's dQ_i
//    products instead). While one stages dQ_i, the other computes the next tile instead of
//    waiting for it.
// A buffer's uses must come in order: the parity of its barriers' phases tells a user which use it
// waits for, and a user ahead of the other could take an older phase of the same parity for the one
// it waits for. Where both consumers use a buffer, a barrier orders them: at d = 64 the one each
// tile has anyway (dS^T is in: kBarrierDsIn), at d = 256 the mbarrier ds_read, on which tile n's
// consumer arrives once its chunks are in and its dQ_i products have read dS^T, and for which tile
// n + 1's waits before it stores its dS^T.
__host__ __device__ constexpr int bwd_dq_buffers(int d) { return d == 256 ? 3 : 2; }
__host__ __device__ constexpr int bwd_ds_buffers(int d) { return d == 256 ? 1 : 2; }
static_assert(bwd_dq_buffers(256) <= 3, "a writer warp a buffer: warpgroup 0's warps 1 .. 3");
__host__ __device__ constexpr int bwd_dq_cols(int d) { return d == 256 ? 32 : 64; }
__host__ __device__ constexpr int bwd_dq_chunks(int d) { return d / bwd_dq_cols(d); }
// The named barriers (barrier.sync and barrier.arrive take an id, 0 being __syncthreads'), and who
// meets at each:
constexpr int kBarrierDsIn = 2;     // Split = 1: both consumers, each having stored its dS^T
constexpr int kBarrierWriters = 5;  // the dQ writers: all have completed a tile's adds
// Registers a thread, set with setmaxnreg (the forward's pair at two consumers, as FlashAttention-3
// has it). setmaxnreg only moves registers within the block's own: its 384 threads start with 168
// each (65536 / 384, rounded down to a multiple of 8: ptxas -v), 64512 in all, and
// 128 (24 + 2 x 240) = 64512. A producer keeping 32 gives back 1024 fewer than the consumers ask:
// their setmaxnreg.inc then waits for them for ever, and every launch hangs.
constexpr int kBwdProducerRegs = 24, kBwdConsumerRegs = 240;
constexpr int kBwdThreads = kWarpgroup * (kBwdConsumers + 1);
static_assert(kWarpgroup * (kBwdProducerRegs + kBwdConsumers * kBwdConsumerRegs) <=
                      kBwdThreads * (65536 / kBwdThreads / 8 * 8) &&
                  kBwdProducerRegs >= 24 && kBwdConsumerRegs <= 256 &&
                  kBwdProducerRegs % 8 == 0 && kBwdConsumerRegs % 8 == 0,
              "setmaxnreg asks for more registers than the block starts with");

// The block's shared memory (FlashAttention-3 lays its own out as a struct too, SharedStorage).
// The tiles of T are blocks of 64 columns in the 128-byte swizzle, as TMA writes them and wgmma
// reads them; the swizzle works on address bits 4-9, so each tile starts on a 1024-byte boundary.
template <typename T, int D>
struct BwdShared {
    static constexpr int Bc = bwd_Bc(D), Br = kBwdBr, Stages = bwd_stages(D);
    alignas(1024) T K_j[Bc * D];                       // line 6, once
    alignas(1024) T V_j[Bc * D];
    alignas(1024) T Q_s[Stages][Br * D];               // stage s: Q_s[s] and dO_s[s] hold
    alignas(1024) T dO_s[Stages][Br * D];              // Q_i and dO_i (line 9)
    static constexpr int DsBufs = bwd_ds_buffers(D), DqBufs = bwd_dq_buffers(D);
    alignas(1024) T dS_s[DsBufs][Bc * Br];             // dS^T (Bc x Br, swizzled as TMA would):
                                                       // tile n's in dS_s[n % DsBufs]
    alignas(1024) float dQ_s[DqBufs][Br * bwd_dq_cols(D)];  // dQ buffer b: its chunk as
                                                       // boxes of Br rows x 32 floats, swizzled
    struct { float L_i[Br], D_i[Br]; } LD[Stages];     // stage s: L_i, D_i (line 9)
    // The mbarriers: the stages' full (the producer's 32 lanes, with the bytes of its copies) and
    // empty (each consumer thread's arrival); K_j and V_j are in; dQ buffer b is filled (a
    // warpgroup's 128 arrivals) and read (its writer's one); the one dS^T buffer is read (DsBufs =
    // 1: the warpgroup's 128 arrivals after its dQ_i products).
    uint64_t full[Stages], empty[Stages];
    uint64_t kv_full;
    uint64_t dq_full[DqBufs], dq_empty[DqBufs];
    uint64_t ds_read;
    // B of ALiBi's key term (KeyBias, below): 8 rows of 64 elements, all 256, read as every group
    // of 8 rows of a 64-row operand. Last, so that the kernels without it keep their layout.
    alignas(1024) T ones[8 * 64];
};
// The launcher's bytes (shared_bytes_through, lib/hopper.cuh), within the 227 KiB of a block.
template <int D>
constexpr size_t bwd_hopper_shared_bytes(bool ones = false) {  // ones: with KeyBias's B
    using Shared = BwdShared<__half, D>;               // (bf16's is the same: 2-byte elements)
    if (ones) return shared_bytes_through(offsetof(Shared, ones) + sizeof(Shared::ones));
    return shared_bytes_through(offsetof(Shared, ds_read) + sizeof(Shared::ds_read));
}
static_assert(bwd_hopper_shared_bytes<64>(true) <= 227 * 1024 &&
                  bwd_hopper_shared_bytes<128>(true) <= 227 * 1024 &&
                  bwd_hopper_shared_bytes<256>() <= 227 * 1024,
              "a block past 227 KiB");

// A block's work (lines 5 and 8): K/V tile j of K/V head kvh (of batch * kv_heads), and the Q tiles
// that see it, `tiles` of them in a fixed order, the n-th being tile_at(walk_at(n)). pol: the mask
// and the score (lib/mask_policy.cuh: PlainPolicy, or chapter 5's ScoredPolicy or ModelPolicy),
// as in chapter 2.
template <typename Policy, int Bc, int Br>
struct BwdBlock {
    Policy pol;
    bool from_left;                // the order: keys bounded on the right (causal) from the left
    int q_len, kv_len;
    int group, Tr;                 // query heads a K/V head, Q tiles a query head
    int kvh, j;                    // line 5
    int kv_heads;                  // K/V heads a batch (kv_heads * group query heads)
    int i_first, i_last, tiles;    // the Q tiles that see tile j; how many, all query heads
    // The n-th Q tile {query head, i}: at each i the group's heads in turn, so that every block
    // reaches (head, i) at the same step n and none waits long for its dQ turn there (head after
    // head, as chapter 2 walks, a block under the mask would reach each next head before the
    // longer blocks ahead of it in the turns, and wait for them). From the left, from the last Q
    // tile (chapter 2's order, so dQ_i's adds follow j up).
    // Tile n as (g, r), n = r group + g. The producer and the consumers step it by additions, not
    // a division a tile (walk_at: 5% of d = 128's samples; lab/chapter3-backward.md, "The tiles
    // walked"); the dQ writers divide, since a Walk of their own spilled their 24 registers.
    struct Walk {
        int g = 0, r = 0;
        __device__ void advance(int group) { g = g + 1 == group ? 0 : g + 1, r += g == 0; }
    };
    __device__ Walk walk_at(int n) const { return Walk{n % group, n / group}; }
    __device__ int2 tile_at(Walk w) const {
        return int2{kvh * group + w.g, from_left ? i_last - w.r : i_first + w.r};
    }
    // The block's place in dQ_i's order of adds: the K/V tiles that see Q tile i before j (from
    // the left: those left of it; else those right of it).
    __device__ int mine(int i) const {
        const KeySpan keys = pol.keys(i * Br, Br);
        return from_left ? j - keys.begin / Bc : (keys.end - 1) / Bc - j;
    }
};
// Ticket -> the block's work, chapter 2's order: heads in groups of HG, each group's tiles from the
// right (causal: from the left, longest first), its heads taking turns. Line 8: the Q tiles i
// that see key tile j (the policy's, for the block's sequence: a packed batch's lengths, the
// layout's; a tile past its keys sees none). Tr, the turns' Q tiles a head: the longest's.
template <int Bc, int Br, typename Policy>
__device__ __forceinline__ BwdBlock<Policy, Bc, Br> bwd_block(int ticket, const Policy& policy,
                                                             const Layout& lay, int Tc, int BH,
                                                             int group, int HG) {
    BwdBlock<Policy, Bc, Br> b;
    b.kv_heads = lay.K.heads, b.group = group, b.from_left = policy.from_left();
    const int head0 = ticket / (HG * Tc) * HG, heads = min(HG, BH - head0);
    const int slot = ticket % (HG * Tc);
    b.kvh = head0 + slot % heads;
    b.j = b.from_left ? slot / heads : Tc - 1 - slot / heads;
    b.Tr = (policy.q_len + Br - 1) / Br;
    b.pol = policy.for_sequence(lay.Q.len(size_t(b.kvh) * group, policy.q_len),
                                lay.K.len(b.kvh, policy.kv_len));
    b.q_len = b.pol.q_len, b.kv_len = b.pol.kv_len;
    const Span rows = b.pol.queries(b.j * Bc, min((b.j + 1) * Bc, b.kv_len));
    b.i_first = rows.first / Br, b.i_last = rows.last < rows.first ? -1 : rows.last / Br;
    b.tiles = b.j * Bc < b.kv_len ? group * max(b.i_last - b.i_first + 1, 0) : 0;
    return b;
}

// Accumulators set by ordinary instructions (zeros) are written before this point, so that the
// wgmma_fence after it covers them (else ptxas injects a fence of its own at every wgmma).
template <int N>
__device__ __forceinline__ void written(float (&r)[N]) {
#pragma unroll
    for (int x = 0; x < N; x++) asm volatile("" : "+f"(r[x])::"memory");
}
// Keeps registers that an asynchronous wgmma still reads (the A fragments) alive to this point, so
// that the compiler gives them to nothing else before the wgmma_wait that precedes it.
template <int K>
__device__ __forceinline__ void keep(const uint32_t (&a)[K][4]) {
#pragma unroll
    for (int k = 0; k < K; k++)
        asm volatile("" ::"r"(a[k][0]), "r"(a[k][1]), "r"(a[k][2]), "r"(a[k][3]));
}

// ---------------------------------------------------------------------------------------------
// The producer (warpgroup 0's first warp): lines 6 and 9.

// L_i and D_i of the n-th Q tile (line 9), rows lane + 32h of its Br; 0 past q_len (masked) and
// past the last tile (`exists` false). The producer's lanes load them a tile ahead of their stage
// (produce's loop).
template <int Br, typename Blk>
__device__ __forceinline__ void load_LD(float (&v)[Br / 32][2], const float* L, const float* Dsum,
                                        typename Blk::Walk w, bool exists, const Blk& blk,
                                        const Rows& l_rows) {
    const auto [bh, i] = blk.tile_at(w);
    for (int h = 0; h < Br / 32; h++) {
        const int x = threadIdx.x % 32 + 32 * h;
        const bool in = exists && i * Br + x < blk.q_len;
        // (D's rows are L's; the dense case written out: Rows::at's division costs the
        // producer's 24 registers a spill)
        const size_t at = (l_rows.starts ? l_rows.at(bh, blk.q_len) : size_t(bh) * blk.q_len) +
                          i * Br + x;
        v[h][0] = in ? L[at] : 0.f, v[h][1] = in ? Dsum[at] : 0.f;
    }
}

// Lane 0 loads K_j and V_j once (line 6), then each Q_i and dO_i into the next free stage by TMA
// (line 9); all 32 lanes store the stage's L_i and D_i and arrive on its full barrier (lane 0's
// arrival with the bytes to come). L_i, D_i are loaded a tile ahead, so that no stage's copies
// wait for a round trip to memory.
template <typename T, int D, typename Blk>
__device__ __forceinline__ void produce(BwdShared<T, D>& sh, const CUtensorMap& Q,
                                        const CUtensorMap& K, const CUtensorMap& V,
                                        const CUtensorMap& dO, const float* L, const float* Dsum,
                                        const Blk& blk, const Layout& lay) {
    constexpr int Br = kBwdBr, Bc = bwd_Bc(D), Stages = bwd_stages(D);
    if (threadIdx.x == 0) {                            // line 6: K_j, V_j, once
        mbar_expect_bytes(&sh.kv_full, 2 * Bc * D * sizeof(T));
        const int3 k0 = lay.K.box_at(blk.kvh, blk.j * Bc);  // (row, head, batch) in K's map
        load_tile<Bc, D>(sh.K_j, K, k0.x, k0.y, k0.z, &sh.kv_full);
        load_tile<Bc, D>(sh.V_j, V, k0.x, k0.y, k0.z, &sh.kv_full);
    }
    PipelineState<Stages> st;
    float next[Br / 32][2];                            // L_i, D_i of tile n, then of n + 1
    typename Blk::Walk w;                              // tile n, then n + 1 once L_i, D_i are in
    load_LD<Br>(next, L, Dsum, w, 0 < blk.tiles, blk, lay.L);
    for (; st.n < blk.tiles; st.advance()) {           // line 9: Q_i, dO_i, L_i, D_i
        const auto [bh, i] = blk.tile_at(w);
        const int s = st.stage();
        if (st.n >= Stages) mbar_wait(&sh.empty[s], st.phase_before());
        for (int h = 0; h < Br / 32; h++)
            sh.LD[s].L_i[threadIdx.x + 32 * h] = next[h][0],
            sh.LD[s].D_i[threadIdx.x + 32 * h] = next[h][1];
        w.advance(blk.group);
        load_LD<Br>(next, L, Dsum, w, st.n + 1 < blk.tiles, blk, lay.L);
        if (threadIdx.x > 0) mbar_arrive(&sh.full[s]);  // its L_i, D_i written: an arrival each
        else {                                         // lane 0's arrival, with the bytes to come
            mbar_expect_bytes(&sh.full[s], 2 * Br * D * sizeof(T));
            const int3 q0 = lay.Q.box_at(bh, i * Br);  // (row, head, batch) in Q's, dO's map
            load_tile<Br, D>(sh.Q_s[s], Q, q0.x, q0.y, q0.z, &sh.full[s]);
            load_tile<Br, D>(sh.dO_s[s], dO, q0.x, q0.y, q0.z, &sh.full[s]);
        }
    }
    // It leaves once the last stages it filled are read (as the forward's producer).
    for (PipelineState<Stages> e{max(st.n - Stages, 0)}; e.n < st.n; e.advance())
        mbar_wait(&sh.empty[e.stage()], e.phase());
}

// ---------------------------------------------------------------------------------------------
// The dQ writers (the producer warpgroup's second and third warps, and its fourth at d = 256;
// FlashAttention-3's way to add dQ): writer w takes the chunks of buffer w, in the order the
// consumers fill them (tile n's chunks c = 0 .. Chunks - 1, chunk q = n Chunks + c in buffer
// q % Bufs); its lane 0 adds each into dQacc with one TMA reduce-add per 32 columns (the first
// block in the order stores instead) and gives the buffer back once the TMA has read it. A writer
// a buffer, so that one buffer's read by the TMA overlaps the others'. The order across blocks is
// chapter 2's: before its first chunk of a tile a writer waits for the block's turn at that (query
// head, Q tile), and once the tile's adds are complete (every writer's, where the tile has chunks
// in every buffer; at d = 64 a tile is one chunk, in buffer n % 2) the turn passes on, before any
// wait for the next tile (NOTES section 14). The consumers never wait for a turn, and never issue
// an atomic. Ordered false (options.deterministic false): no turns, every block adds (dQacc zeroed).
template <bool Ordered, typename T, int D, typename Blk>
__device__ __forceinline__ void write_dq(BwdShared<T, D>& sh, const CUtensorMap& dQacc,
                                         int* turns, const Blk& blk) {
    constexpr int Chunks = bwd_dq_chunks(D), Bufs = bwd_dq_buffers(D), Cols = bwd_dq_cols(D);
    constexpr int Br = kBwdBr;
    const int w = threadIdx.x / 32 - 1;                // writer w, buffer w
    const bool lane0 = threadIdx.x % 32 == 0;
    const int batch = blk.kvh / blk.kv_heads;         // tile n's query head: batch's head0 + g
    const int head0 = (blk.kvh - batch * blk.kv_heads) * blk.group;
    int q = 0;
    for (int n = 0; n < blk.tiles; n++) {
        const auto wk = blk.walk_at(n);
        const auto [bh, i] = blk.tile_at(wk);
        int* turn = turns + size_t(bh) * blk.Tr + i;
        const int mine = blk.mine(i);                  // its place in dQ_i's order
        bool adding = false;                           // it has chunks of tile n
        for (int c = 0; c < Chunks; c++, q++) {
            if (q % Bufs != w) continue;               // another writer's chunk
            mbar_wait(&sh.dq_full[w], q / Bufs % 2);   // the chunk is in its buffer
            if (!adding) {
                if constexpr (Ordered) wait_turn(turn, mine);
                fence_proxy_async_global(), adding = true;
            }
            if (lane0) {
                for (int h = 0; h < Cols / 32; h++)    // its boxes of 32 columns
                    tma_store(dQacc, sh.dQ_s[w] + 32 * h * Br, Cols * c + 32 * h, i * Br,
                              head0 + wk.g, batch, !Ordered || mine > 0);
                bulk_commit(), bulk_wait_read<0>();
                mbar_arrive(&sh.dq_empty[w]);
            }
            __syncwarp();
        }
        if (lane0 && adding) bulk_wait<0>(), fence_proxy_async_global();  // its adds are complete
        if (Chunks >= Bufs) named_barrier(kBarrierWriters, 32 * Bufs);  // and the others'.
        if (Ordered && lane0 && (Chunks >= Bufs ? w == 0 : adding)) pass_turn(turn);
        __syncwarp();
    }
}

// ---------------------------------------------------------------------------------------------
// The consumers (warpgroups 1 and 2): lines 7-18, one function a step, consume calling them.

// A consumer thread: its warpgroup wg (0 .. C - 1), warp and lane (lane = 4g + t: acc_at's
// layout), and the keys kw.. and columns cw.. of dK_j, dV_j it holds (at Split = 2 both
// warpgroups hold keys 0 .. 63, each half of the columns). wg from lane 0 keeps the descriptors
// uniform; at d = 128 that gained nothing and made ptxas spill (lab/chapter3-backward.md).
__host__ __device__ constexpr bool bwd_uniform_wg(int d) { return d != 128; }
template <int D>
struct ConsumerThread {
    static constexpr int Split = bwd_split(D), Dw = D / Split;  // Dw: columns it holds
    int wg, warp, g, t, kw, cw;
    __device__ ConsumerThread()
        : wg((bwd_uniform_wg(D) ? warpgroup_index() : int(threadIdx.x / kWarpgroup)) - 1),
          warp(threadIdx.x % kWarpgroup / 32),
          g(threadIdx.x % 32 / 4), t(threadIdx.x % 4), kw(wg / Split * 64), cw(wg % Split * Dw) {}
    __device__ int key(int j, int r) const { return j * bwd_Bc(D) + kw + 16 * warp + g + 8 * r; }
};

// ALiBi's term on the tensor cores (ALiBi alone under the causal mask: ScoredPolicy<false, true>).
// Where every visible score has i' >= j (i' = i + kv_len - q_len), -slope (i' - j) is a key's
// term plus a query's: slope (j - q0 - kv_len + q_len) for key j, q0 the Q tile's first row, and
// -slope (i - q0) for query i. The key's term rides one more k-step of S^T = K_j Q_i^T: A holds it
// / 256 in three parts of T (hi, mid, lo: 24 bits and more), B is 256s (sh.ones), so S^T comes out
// with the term added. The query's goes into line 11's offsets (RowOffsets' m). Line 11 is then
// plain attention's one fma a score, where the distance, its product and the fma took three.
// Elsewhere (no mask, or a term past fp16's range) A is 0 and line 11 takes the term as
// ModelPolicy::Near does. Scores past the diagonal (masked) may come out as inf before the mask.
template <typename Policy, int D>
constexpr bool bwd_key_bias = false;
template <int D>  // (at d = 256 its B does not fit, and a score's share of the tile is half)
constexpr bool bwd_key_bias<ScoredPolicy<false, true>, D> = D <= 128;
struct KeyBias {
    uint32_t a[1][4] = {};                             // the extra k-step's A (rows: the keys)
    float m = 0.f;                                     // -c slope: the offsets' factor of i - q0
    bool on = false;
};
template <typename T, typename Policy>
__device__ __forceinline__ KeyBias key_bias(const Policy& pol, float su, const float (&key)[2],
                                            float q0, int t, float c) {
    KeyBias b;                                         // su: the head's slope / scale
    b.on = pol.causal && fabsf(su) * float(pol.q_len + pol.kv_len + 512) <= 1.6e7f;
    if (!b.on) return b;
    b.m = -c * su;
    float hi[2], mid[2], lo[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {                      // key[r]: its key r - kv_len + q_len
        const float v = su * (key[r] - q0) * (1.f / 256);
        hi[r] = rounded_to<T>(v);
        const float rest = v - hi[r];                  // (exact)
        mid[r] = rounded_to<T>(rest);
        lo[r] = rounded_to<T>(rest - mid[r]);
    }
    if (t == 0) b.a[0][0] = pair_bits<T>(hi[0], mid[0]), b.a[0][1] = pair_bits<T>(hi[1], mid[1]);
    if (t == 1) b.a[0][0] = pair_bits<T>(lo[0], 0.f), b.a[0][1] = pair_bits<T>(lo[1], 0.f);
    return b;
}

// Line 10: S^T = K_j Q_i^T; line 13: dP^T = V_j dO_i^T (the warpgroup's 64 keys), 16 of d a step,
// both operands K-major in shared memory. S^T is waited for, dP^T left running.
// K_j's rows in registers at d = 64 (the warpgroup's 64 keys as A, 16 a thread, read once a
// block by load_A_fragments), so that S^T = K_j Q_i^T is RS; at d = 128 and 256 they do not fit
// beside dK_j and dV_j (ptxas serializes the wgmmas).
__host__ __device__ constexpr bool bwd_k_regs(int d) { return d == 64; }
template <int D>
using KFragments = uint32_t[bwd_k_regs(D) ? D / 16 : 1][4];
template <typename T, int D, bool kBias = false>
__device__ __forceinline__ void products_S_dP(float (&S)[kBwdBr / 2], float (&dP)[kBwdBr / 2],
                                              const BwdShared<T, D>& sh, int s, int kw,
                                              const KFragments<D>& K_r, KeyBias& bias) {
    constexpr int Br = kBwdBr, Bc = bwd_Bc(D);
    const char* K_w = reinterpret_cast<const char*>(sh.K_j) + kw * kRowBytes;
    const char* V_w = reinterpret_cast<const char*>(sh.V_j) + kw * kRowBytes;
    const char* Q_i = reinterpret_cast<const char*>(sh.Q_s[s]);
    const char* dO_i = reinterpret_cast<const char*>(sh.dO_s[s]);
    written(S), written(dP);
    const uint64_t Q_d = smem_desc(Q_i, 0), K_d = smem_desc(K_w, 0);  // (desc_plus steps them)
    const uint64_t V_d = smem_desc(V_w, 0), dO_d = smem_desc(dO_i, 0);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < D / 16; k++) {
        const uint64_t Q_k = desc_plus(Q_d, k / 4 * Br * kRowBytes + k % 4 * 32);
        if constexpr (bwd_k_regs(D))
            wgmma_rs<T, Br, false>(S, K_r[k], Q_k);
        else
            wgmma_ss<T, Br>(S, desc_plus(K_d, k / 4 * Bc * kRowBytes + k % 4 * 32), Q_k);
    }
    if constexpr (kBias)  // ALiBi's key term (KeyBias): B's stride from 8 rows to the next 0
        wgmma_rs<T, Br, false>(S, bias.a[0], smem_desc(sh.ones, 0) & ~(uint64_t(0x3FFF) << 32));
    wgmma_commit();
#pragma unroll
    for (int k = 0; k < D / 16; k++)
        wgmma_ss<T, Br>(dP, desc_plus(V_d, k / 4 * Bc * kRowBytes + k % 4 * 32),
                        desc_plus(dO_d, k / 4 * Br * kRowBytes + k % 4 * 32));
    wgmma_commit();
    wgmma_wait<1>(S);                                  // S^T is done (dP^T may not be)
    if constexpr (kBias) a_operand_fence(bias.a);      // (its product has read bias.a)
}

// Line 11's offsets, -L_i log2(e), of a thread's 16 queries (acc_at's column c: query
// 8(c/2) + 2t + c%2). Read into registers right after the stage's full wait (Ahead), so that line
// 11's exponentials do not wait on shared memory behind S^T's product. A policy that changes the
// scores (a softcap, ALiBi) holds registers of its own: there the 16 made ptxas spill and ran
// slower, so line 11 reads each as it goes (lab/chapter3-backward.md, "L_i in registers"); ALiBi
// alone under the plain mask (ScoredPolicy) holds few enough to keep them; a softcap there does
// not (16 bytes spilled at d = 128, 1-3% slower: lab/chapter5.md, part 27).
template <typename Policy>
constexpr bool bwd_l_ahead = true;
template <bool kSoftcap, bool kAlibi>
constexpr bool bwd_l_ahead<ModelPolicy<kSoftcap, kAlibi>> = !kSoftcap && !kAlibi;
template <bool kSoftcap, bool kAlibi>
constexpr bool bwd_l_ahead<ScoredPolicy<kSoftcap, kAlibi>> = !kSoftcap;
template <bool Ahead>
struct RowOffsets {
    float v[kBwdBr / 4];
    __device__ RowOffsets(const float* L_i, int t) {
#pragma unroll
        for (int c = 0; c < kBwdBr / 4; c++) v[c] = -L_i[8 * (c / 2) + 2 * t + c % 2] * kLog2e;
    }
    __device__ RowOffsets(const float* L_i, int t, float m) {  // + m (i - q0): KeyBias's query term
        const float mt = m * float(2 * t);
#pragma unroll
        for (int c = 0; c < kBwdBr / 4; c++)
            v[c] = fmaf(-L_i[8 * (c / 2) + 2 * t + c % 2], kLog2e,
                        fmaf(m, float(8 * (c / 2) + c % 2), mt));
    }
    __device__ float operator[](int c) const { return v[c]; }
};
template <>
struct RowOffsets<false> {
    const float* L_i;
    int t;
    __device__ RowOffsets(const float* L, int t_) : L_i(L), t(t_) {}
    __device__ float operator[](int c) const { return -L_i[8 * (c / 2) + 2 * t + c % 2] * kLog2e; }
};
template <typename Policy, int D, bool Ahead = bwd_l_ahead<Policy>>
__device__ __forceinline__ RowOffsets<Ahead> row_offsets(const float* L_i, int t, float m) {
    if constexpr (bwd_key_bias<Policy, D>) return RowOffsets<Ahead>(L_i, t, m);
    else return RowOffsets<Ahead>(L_i, t);
}

// Under a softcap each score takes two XU instructions, its tanh and its exponential, and the
// consumers' softmax waits on the XU: there one exponential in kCappedFmaEvery of a thread's goes
// to the FMA pipe instead (exp2_at, lib/log2_units.h; lab/chapter5.md part 14).
constexpr int kCappedFmaEvery = 4;

// Line 11: P^T = exp(S^T - L_i) of the changed scores (pol: the tile's head's policy) in S's
// registers, masked where the tile is an edge one (edge: it reaches past a key's queries, kv_len
// or q_len; seen[r]: key r's queries, none past kv_len); du: each score's derivative (1 without a
// softcap: the compiler then keeps none). The mask: behind one branch a tile, which most tiles
// skip (a select a score would cost every tile an ISETP, a PLOP3 and an FSEL a score); at d = 256
// a select a score, which measured faster there (lab/chapter3-backward.md, "The mask behind a
// branch"). acc_at(S, r, c): key kw + 16 warp + g + 8r (me.key(j, r)), query 8(c/2)+2t+c%2 of
// the Q tile at row q0.
template <int D, typename Policy, bool Ahead>
__device__ __forceinline__ void probabilities(float (&S)[kBwdBr / 2], float (&du)[kBwdBr / 2],
                                              const RowOffsets<Ahead>& nL, int q0, bool edge,
                                              const Span (&seen)[2], int j, const Policy& pol,
                                              const ConsumerThread<D> me, float scale_log2,
                                              bool biased = false) {
    constexpr int Br = kBwdBr;
    constexpr bool kSelects = D == 256;  // the mask's form, below
    if (bwd_key_bias<Policy, D> && biased)             // S^T carries the key's term (KeyBias;
#pragma unroll                                         // d <= 128: the mask below, not selects)
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int c = 0; c < Br / 4; c++) {
                float& p = acc_at(S, r, c);
                p = exp2_ftz(fmaf(p, scale_log2, nL[c]));
                acc_at(du, r, c) = 1.f;
            }
    else
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const auto near = pol.at(q0 + 2 * me.t, me.key(j, r));  // query q0 + 2t + (qi - 2t)
#pragma unroll
        for (int c = 0; c < Br / 4; c++) {
            const int qi = 8 * (c / 2) + 2 * me.t + c % 2;
            float& p = acc_at(S, r, c);
            const float x = near.exponent(p, 8 * (c / 2) + c % 2, acc_at(du, r, c), scale_log2,
                                          nL[c]);
            p = exp2_at<Policy::kCapped ? kCappedFmaEvery : 0>(x, c);
            if (kSelects && edge && (q0 + qi < seen[r].first || q0 + qi > seen[r].last)) p = 0.f;
        }
    }
    if constexpr (!kSelects)
        if (edge)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int first = seen[r].first - q0 - 2 * me.t;
                const int last = seen[r].last - q0 - 2 * me.t;
#pragma unroll
                for (int c = 0; c < Br / 4; c++) {
                    const int qc = 8 * (c / 2) + c % 2;  // qi - 2t: a constant
                    if (qc < first || qc > last) acc_at(S, r, c) = 0.f;
                }
            }
}

// Line 14: dS^T = P^T o (dP^T - D_i), in dP's registers; then P^T and dS^T in T, as the A
// fragments of lines 12 and 16 (A's register a: elements 8k + 2a, + 1).
template <typename T>
__device__ __forceinline__ void ds_fragments(uint32_t (&P)[kBwdBr / 16][4],
                                             uint32_t (&dS)[kBwdBr / 16][4],
                                             float (&S)[kBwdBr / 2], float (&dP)[kBwdBr / 2],
                                             float (&du)[kBwdBr / 2], const float* D_i,
                                             int t) {
    constexpr int Br = kBwdBr;
#pragma unroll
    for (int c = 0; c < Br / 4; c++)
#pragma unroll
        for (int r = 0; r < 2; r++)
            acc_at(dP, r, c) = acc_at(S, r, c) *
                               (acc_at(dP, r, c) - D_i[8 * (c / 2) + 2 * t + c % 2]) *
                               acc_at(du, r, c);
#pragma unroll
    for (int k = 0; k < Br / 16; k++)
#pragma unroll
        for (int a = 0; a < 4; a++) {
            P[k][a] = pair_bits<T>(S[8 * k + 2 * a], S[8 * k + 2 * a + 1]);
            dS[k][a] = pair_bits<T>(dP[8 * k + 2 * a], dP[8 * k + 2 * a + 1]);
        }
}

// dS^T to shared memory for line 15, keys x queries in the 128-byte swizzle, into tile n's
// buffer: row `key`, the 16-byte chunk of queries 8b.. at chunk b ^ (key % 8). Its element pairs
// (g + 8r, 8b + 2t) are dS[b / 2][2 (b % 2) + r].
template <typename T, int D>
__device__ __forceinline__ void store_dS_T(BwdShared<T, D>& sh, int n,
                                           const uint32_t (&dS)[kBwdBr / 16][4],
                                           const ConsumerThread<D> me) {
    char* dS_T = reinterpret_cast<char*>(sh.dS_s[n % bwd_ds_buffers(D)]);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int key = me.kw + 16 * me.warp + me.g + 8 * r;
#pragma unroll
        for (int b = 0; b < kBwdBr / 8; b++)
            *reinterpret_cast<uint32_t*>(dS_T + key * kRowBytes + (b ^ key % 8) * 16 + 4 * me.t) =
                dS[b / 2][2 * (b % 2) + r];
    }
    fence_proxy_async();                               // wgmma (the async proxy) reads it next
}

// Line 12: dV_j += P^T dO_i; line 16: dK_j += dS^T Q_i: A from registers, B (queries x columns)
// read transposed, its 64-column blocks Br rows apart. At most 128 columns a wgmma. Left running.
template <typename T, int D>
__device__ __forceinline__ void products_dV_dK(float (&dV_j)[D / bwd_split(D) / 2],
                                               float (&dK_j)[D / bwd_split(D) / 2],
                                               const uint32_t (&P)[kBwdBr / 16][4],
                                               const uint32_t (&dS)[kBwdBr / 16][4],
                                               const BwdShared<T, D>& sh, int s, int cw) {
    constexpr int Br = kBwdBr, Dw = D / bwd_split(D), N = Dw < 128 ? Dw : 128;
    const uint64_t Q_d = smem_desc(sh.Q_s[s], Br * kRowBytes);
    const uint64_t dO_d = smem_desc(sh.dO_s[s], Br * kRowBytes);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < Br / 16; k++)
#pragma unroll
        for (int h = 0; h < Dw / N; h++) {
            const int at = ((cw + h * N) / 64 * Br + 16 * k) * kRowBytes;
            wgmma_rs<T, N>(dV_j + h * N / 2, P[k], desc_plus(dO_d, at));
            wgmma_rs<T, N>(dK_j + h * N / 2, dS[k], desc_plus(Q_d, at));
        }
    wgmma_commit();
}

// Box h (columns 32h..) of a consumer's 64 x 64 accumulators of dQ_i into a dQ buffer, as the TMA
// reads it: 128 bytes a row, in each row the 16-byte chunk of columns 4b.. at b ^ (row % 8) (the
// 128-byte swizzle). A store of the warp's 8-byte pairs takes two passes of 16 lanes; in each,
// lanes t and t ^ 2 of rows g and g ^ 1 would meet in one bank if they stored the same column
// group b, so lanes t = 2, 3 take the group two ahead (k + 2): no bank conflict.
__device__ __forceinline__ void stage_dq(char* to, float (&dQ)[32], int h) {
    const int warp = threadIdx.x % kWarpgroup / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = 16 * warp + g + 8 * r;
#pragma unroll
        for (int k = 0; k < 4; k++) {                  // columns 8b + 2t, + 1 of the 64
            const int b0 = 4 * h + k, b1 = 4 * h + (k + 2) % 4, b = t / 2 ? b1 : b0;
            const float2 v = t / 2 ? float2{acc_at(dQ, r, 2 * b1), acc_at(dQ, r, 2 * b1 + 1)}
                                   : float2{acc_at(dQ, r, 2 * b0), acc_at(dQ, r, 2 * b0 + 1)};
            auto* at = reinterpret_cast<float2*>(
                to + row * kRowBytes + ((2 * (b % 4) + t / 2) ^ row % 8) * 16 + t % 2 * 8);
            *at = v;                                   // (the registers' indices fixed: b0, b1)
        }
    }
}

// Line 15: dQ_i = dS K_j, its columns 64c.. (one wgmma of N = 64): A = dS (tile n's dS^T read
// transposed), B = K_j read transposed.
template <typename T, int D>
__device__ __forceinline__ void product_dQ(float (&dQ_i)[32], const BwdShared<T, D>& sh, int n,
                                           int c) {
    constexpr int Bc = bwd_Bc(D);
    const uint64_t dS_d = smem_desc(sh.dS_s[n % bwd_ds_buffers(D)], Bc * kRowBytes);
    const uint64_t K_d = smem_desc(sh.K_j, Bc * kRowBytes);  // lbo: where a next 64-column block
    written(dQ_i);                                     // would be
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < Bc / 16; k++)
        wgmma_ss<T, 64, true>(dQ_i, desc_plus(dS_d, 16 * k * kRowBytes),
                              desc_plus(K_d, (c * Bc + 16 * k) * kRowBytes));
    wgmma_commit();
    wgmma_wait<0>(dQ_i);
}

// Tile n's dQ_i, columns 64c.., to the dQ writers: its boxes of 32 columns into chunk q's buffer
// (stage_dq), once the writer has read the buffer's last chunk; the chunk's arrival on the
// buffer's full barrier once all of its boxes are in.
template <typename T, int D>
__device__ __forceinline__ void send_dq(BwdShared<T, D>& sh, float (&dQ_i)[32], int n, int c) {
    constexpr int Br = kBwdBr, Bufs = bwd_dq_buffers(D), Chunks = bwd_dq_chunks(D);
    constexpr int Cols = bwd_dq_cols(D);
#pragma unroll
    for (int h = 0; h < 2; h++) {                      // its boxes of 32 columns: chunk q, buffer b
        const int q = n * Chunks + (64 * c + 32 * h) / Cols, b = q % Bufs;
        if (32 * h % Cols == 0 && q >= Bufs) mbar_wait(&sh.dq_empty[b], (q / Bufs - 1) % 2);
        stage_dq(reinterpret_cast<char*>(sh.dQ_s[b] + 32 * h % Cols * Br), dQ_i, h);
        if ((32 * h + 32) % Cols == 0)                 // the chunk is in: the TMA reads it next
            fence_proxy_async(), mbar_arrive(&sh.dq_full[b]);
    }
}

// Line 18: dK_j scale (S was unscaled: 1/sqrt(d), or the options'), dV_j, rows past kv_len left
// out; dk, dv: where their rows are (chapter 5's strides). 16 bytes a store (store_row).
template <typename T, int D, typename Blk>
__device__ __forceinline__ void store_dK_dV(T* dK, T* dV, const Rows dk, const Rows dv,
                                            float (&dK_j)[D / bwd_split(D) / 2],
                                            float (&dV_j)[D / bwd_split(D) / 2],
                                            const Blk& blk, const ConsumerThread<D> me,
                                            float scale) {
    constexpr int Dw = D / bwd_split(D);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int key = me.key(blk.j, r);
        const bool in = key < blk.kv_len;
        store_row<T, Dw>(dK + dk.at(blk.kvh) + key * dk.row + me.cw, dK_j, r, scale, me.t, in);
        store_row<T, Dw>(dV + dv.at(blk.kvh) + key * dv.row + me.cw, dV_j, r, 1.f, me.t, in);
    }
}

// A consumer warpgroup: its keys' dK_j, dV_j in registers (line 7), then for each Q tile in the
// block's order (line 8) the five products and the steps between them, in a stage of the ring.
template <typename T, int D, typename Blk>
__device__ __forceinline__ void consume(BwdShared<T, D>& sh, const Blk& blk, T* dK, T* dV,
                                        const Rows dk, const Rows dv, float scale_log2,
                                        float scale) {
    constexpr int C = kBwdConsumers, Br = kBwdBr, Stages = bwd_stages(D), Bc = bwd_Bc(D);
    constexpr int Split = bwd_split(D);
    const ConsumerThread<D> me;
    float dK_j[D / Split / 2] = {}, dV_j[D / Split / 2] = {};  // line 7
    mbar_wait(&sh.kv_full, 0);                         // K_j and V_j are in
    KFragments<D> K_r;                                 // (bwd_k_regs) the warp's keys of K_j
    if constexpr (bwd_k_regs(D)) load_A_fragments<D>(K_r, sh.K_j, Bc, me.kw + 16 * me.warp);
    const int j = blk.j;                               // (line 11's mask: once a block)
    const Span all = blk.pol.all_queries(j * Bc, (j + 1) * Bc);  // the rows that see every key
    const Span seen[2] = {blk.pol.key_queries(me.key(j, 0)), blk.pol.key_queries(me.key(j, 1))};
    using Policy = decltype(blk.pol);
    const int lag = blk.pol.kv_len - blk.pol.q_len;  // (KeyBias: its keys, a head's slope)
    const float key_f[2] = {float(me.key(j, 0) - lag), float(me.key(j, 1) - lag)};
    size_t slope_bh = ~size_t(0);
    float slope = 0.f;
    PipelineState<Stages> st;
    typename Blk::Walk w;
    for (int n = 0; n < blk.tiles; n++, w.advance(blk.group), st.advance()) {  // line 8: each Q_i
        const auto [bh, i] = blk.tile_at(w);
        const int s = st.stage(), q0 = i * Br;
        KeyBias kb;                                    // (ALiBi's key term: KeyBias, made
        if constexpr (bwd_key_bias<Policy, D>) {       // before the wait; the slope a head)
            if (bh != slope_bh) slope_bh = bh, slope = blk.pol.for_head(bh).mod.slope_u;
            kb = key_bias<T>(blk.pol, slope, key_f, float(q0), me.t, scale_log2);
        }
        mbar_wait(&sh.full[s], st.phase());            // Q_i, dO_i, L_i, D_i are in
        float S[Br / 2] = {}, dP[Br / 2] = {}, du[Br / 2];
        const RowOffsets<bwd_l_ahead<Policy>> nL = row_offsets<Policy, D>(sh.LD[s].L_i, me.t, kb.m);
        products_S_dP<T, D, bwd_key_bias<Policy, D>>(S, dP, sh, s, me.kw, K_r, kb);  // lines 10, 13
        // Line 11 masks only where the tile reaches past a key's queries, kv_len or q_len.
        const bool edge = (j + 1) * Bc > blk.kv_len || q0 + Br > blk.q_len || q0 < all.first ||
                          q0 + Br - 1 > all.last;
        Policy head = blk.pol;                         // (KeyBias: the slope as loaded above)
        if constexpr (bwd_key_bias<Policy, D>) head.mod.slope_u = slope;
        else head = blk.pol.for_head(bh);
        probabilities(S, du, nL, q0, edge, seen, j, head, me, scale_log2, kb.on);  // line 11
        wgmma_wait<0>(dP);                             // dP^T is done
        uint32_t P[Br / 16][4], dS[Br / 16][4];        // P^T and dS^T in T, as A fragments
        ds_fragments<T>(P, dS, S, dP, du, sh.LD[s].D_i, me.t);  // line 14
        // dS^T for line 15. At Split = 2 both warpgroups hold it; the one that computes dQ_i
        // (the dQ buffers' comment) stores it, into the one buffer, once tile n - 1's consumer
        // has staged its chunks and its dQ_i products have read dS^T (ds_read).
        const bool adds = D == 128 || me.wg == n % C;  // it computes dQ_i, or its part
        if (Split == 1) store_dS_T(sh, n, dS, me);
        products_dV_dK(dV_j, dK_j, P, dS, sh, s, me.cw);  // lines 12, 16 run on meanwhile
        if (Split == 1) named_barrier(kBarrierDsIn, kWarpgroup * C);  // every dS^T is in
        else if (adds) {
            if (n > 0) mbar_wait(&sh.ds_read, (n - 1) % 2);  // tile n - 1's arrivals
            store_dS_T(sh, n, dS, me);
        }
#pragma unroll 1
        for (int cb = 0; cb < (adds ? D / 64 / (D == 128 ? C : 1) : 0); cb++) {
            const int c = D == 128 ? me.wg : cb;       // line 15: dQ_i, columns 64c..
            float dQ_i[32] = {};
            product_dQ(dQ_i, sh, n, c);
            send_dq(sh, dQ_i, n, c);
        }
        if (Split == 2 && adds) mbar_arrive(&sh.ds_read);  // staged, dS^T read: tile n + 1's
        wgmma_wait<0>(dV_j), written(dK_j);            // lines 12, 16 done: stage, A fragments free
        // Every consumer thread gives the stage back itself, so that its own reads of L_i, D_i
        // (the producer's plain stores) are ordered before the refill by its own arrival: one
        // lane's after a __syncwarp orders them too, but racecheck follows only a thread's own.
        keep(P), keep(dS);
        mbar_arrive(&sh.empty[s]);
    }
    store_dK_dV(dK, dV, dk, dv, dK_j, dV_j, blk, me, scale);  // line 18
}

// ---------------------------------------------------------------------------------------------
// The kernel: one block per (batch*kv head, K/V tile j), in ticket order (chapter 2's). Warpgroup
// 0's first warp is the producer (lane 0 issues the TMA copies, all 32 lanes copy L_i and D_i), its
// second and third the dQ writers (and its fourth at d = 256, else idle); warpgroups 1 and 2 the
// consumers. Shared memory: BwdShared. Ordered: dQ's adds in chapter 2's order, or none.
template <typename T, int D, int Split, typename Policy, bool Ordered = true>
__global__ void __launch_bounds__(kBwdThreads, 1)
flash_backward_hopper_kernel(const __grid_constant__ CUtensorMap Q,
                             const __grid_constant__ CUtensorMap K,
                             const __grid_constant__ CUtensorMap V,
                             const __grid_constant__ CUtensorMap dO, const float* __restrict__ L,
                             const float* __restrict__ Dsum,
                             const __grid_constant__ CUtensorMap dQacc,
                             int* __restrict__ turns, int* next_ticket, T* __restrict__ dK,
                             T* __restrict__ dV, const __grid_constant__ Layout lay,
                             const Policy policy, int Tc, int BH, int group, int HG,
                             float scale_log2, float scale) {
    static_assert(Split == bwd_split(D), "the launcher's Split is bwd_split(D)");
    BwdShared<T, D>& sh = shared_storage<BwdShared<T, D>>();
    if (threadIdx.x == 0) {                            // the mbarriers, before any use
        mbar_init(&sh.kv_full, 1);
        if (bwd_ds_buffers(D) == 1) mbar_init(&sh.ds_read, 128);
        for (int b = 0; b < bwd_dq_buffers(D); b++)
            mbar_init(&sh.dq_full[b], 128), mbar_init(&sh.dq_empty[b], 1);
        init_barriers(sh.full, sh.empty, bwd_stages(D), 128 * kBwdConsumers, 32);
    }
    if constexpr (bwd_key_bias<Policy, D>) {              // KeyBias's B: 256s
        for (int x = threadIdx.x; x < 4 * 64; x += blockDim.x)
            store_pair<T>(&sh.ones[2 * x], 256.f, 256.f);
        fence_proxy_async();                           // (for wgmma, which reads them)
    }
    const int ticket = block_ticket(next_ticket);      // its barrier publishes the mbarriers too
    const auto blk = bwd_block<bwd_Bc(D), kBwdBr>(ticket, policy, lay, Tc, BH, group, HG);
    if (threadIdx.x < kWarpgroup) {                    // warpgroup 0: few registers
        setmaxnreg<false, kBwdProducerRegs>();
        if (threadIdx.x >= 32 * (1 + bwd_dq_buffers(D))) return;
        if (threadIdx.x >= 32) return write_dq<Ordered>(sh, dQacc, turns, blk);  // dQ's writers
        return produce(sh, Q, K, V, dO, L, Dsum, blk, lay);  // the producer
    }
    setmaxnreg<true, kBwdConsumerRegs>();              // the consumers: many
    consume(sh, blk, dK, dV, lay.dK, lay.dV, scale_log2, scale);
}

#undef HOPPER_ONLY

// ---------------------------------------------------------------------------------------------
// The kernel: in order, or without it where the call allows (ordered false: options.deterministic
// false) and the policy is the plain one (the others keep the order: half the kernels to build).
template <typename T, int D, typename Policy>
static auto backward_kernel(bool ordered) {
    if constexpr (std::is_same<Policy, PlainPolicy>::value)
        if (!ordered) return flash_backward_hopper_kernel<T, D, bwd_split(D), Policy, false>;
    return flash_backward_hopper_kernel<T, D, bwd_split(D), Policy, true>;
}

// ---------------------------------------------------------------------------------------------
// The launcher: chapter 2's passes around the kernel (flash_backward_passes, lib/chapters.h: its
// scratch, its D pass before, its dQ = dQacc scale after), the kernel between them; policy:
// PlainPolicy, ScoredPolicy or ModelPolicy, o its options (the scale).
template <typename T, typename Policy>
static void run_backward_hopper(const T* Q, const T* K, const T* V, const T* O, const T* dO,
                                const float* L, T* dQ, T* dK, T* dV, const AttentionShape& s,
                                const Layout& lay, cudaStream_t stream, const AttentionOptions& o,
                                const Policy& policy) {
    dispatch_head_dim<kFlashHopperHeadDims>(s.head_dim, [&](auto dim) {
        constexpr int D = decltype(dim)::value, Bc = bwd_Bc(D), Br = kBwdBr;
        constexpr size_t bytes = bwd_hopper_shared_bytes<D>(bwd_key_bias<Policy, D>);
        AttentionOptions po = o;                       // the passes zero dQacc without the order
        po.deterministic = o.deterministic || !std::is_same<Policy, PlainPolicy>::value;
        const auto kernel = backward_kernel<T, D, Policy>(po.deterministic);
        allow_shared(kernel, bytes);
        AttentionShape kv_shape = s;                   // a block per (batch, kv head, K/V tile)
        kv_shape.heads = flash_kv_heads(s);
        const int blocks = grid_blocks(kv_shape, s.kv_len, Bc, "kv_len");
        const int Tc = (s.kv_len + Bc - 1) / Bc, BH = s.batch * flash_kv_heads(s);
        // The maps' extents: the shape, or a packed batch's one batch of total rows.
        const AttentionShape x = o.packed.cu_seqlens_q ? packed_shape(s, o.packed) : s;
        const CUtensorMap Qm = tensor_map(Q, lay.Q, x.batch, x.q_len, D, Br),
                          dOm = tensor_map(dO, lay.dO, x.batch, x.q_len, D, Br),
                          Km = tensor_map(K, lay.K, x.batch, x.kv_len, D, Bc),
                          Vm = tensor_map(V, lay.V, x.batch, x.kv_len, D, Bc);
        // Interleaving heads' tiles keeps one head's tiles apart in time (chapter 2's groups): HG
        // heads' tickets at a time, K/V tile by K/V tile. Under the mask about two waves of blocks
        // a group (HG Tc = 2 SMs, at most 32 heads), but 16 heads at d = 256; without it 4.
        const int sms = flash_device_props().multiProcessorCount;
        const int HG = !policy.from_left() ? 4 : D == 256 ? 16 : std::clamp(2 * sms / Tc, 1, 32);
        // The kernel's turns: one a (query head, Q tile of 64), within the passes' B*H*ceil(q_len
        // / 32). dQacc (fp32) is written by the TMA: boxes of Br rows x 32 columns, in
        // [batch][heads][q_len][d] whatever the layout: a packed batch's sequences each q_len
        // (the longest) rows apart there, so that no box reaches another sequence's rows.
        const Rows acc_rows = rows_of({}, s.batch, s.heads, s.q_len, 1);  // (rows of d floats)
        flash_backward_passes(O, dO, L, dQ, s, lay, stream, [&](const BackwardScratch& m) {
            const Rows dq_acc = rows_of({}, s.batch, s.heads, s.q_len, D);  // contiguous, fp32
            const CUtensorMap dQm = tensor_map(m.dQacc, dq_acc, s.batch, s.q_len, D, Br);
            kernel<<<blocks, kBwdThreads, bytes, stream>>>(
                Qm, Km, Vm, dOm, L, m.D, dQm, m.turns, m.next_ticket, dK, dV, lay, policy, Tc,
                BH, flash_kv_group(s), HG, options_scale_log2(s, o), options_scale(s, o));
            return cudaGetLastError();
        }, po, &acc_rows);
    });
}
// The policy: with_policy's (lib/mask_policy.cuh), the plain one where it serves the options
// (none, strides, a packed batch, a scale), and ALiBi's term only where slopes are (<true>).
template <typename T>
static void launch_backward_hopper(const T* Q, const T* K, const T* V, const T* O, const T* dO,
                                   const float* L, T* dQ, T* dK, T* dV, const AttentionShape& s,
                                   const Layout& lay, cudaStream_t stream,
                                   const AttentionOptions* options = nullptr) {
    const AttentionOptions o = options ? *options : AttentionOptions{};
    with_policy<true>(s, o, [&](auto policy) {
        run_backward_hopper(Q, K, V, O, dO, L, dQ, dK, dV, s, lay, stream, o, policy);
    });
}

void flash_backward_hopper_launch(const __half* Q, const __half* K, const __half* V,
                                  const __half* O, const __half* dO, const float* L, __half* dQ,
                                  __half* dK, __half* dV, const AttentionShape& s,
                                  const Layout& lay, cudaStream_t stream,
                                  const AttentionOptions* options) {
    launch_backward_hopper(Q, K, V, O, dO, L, dQ, dK, dV, s, lay, stream, options);
}
void flash_backward_hopper_launch(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                                  const __nv_bfloat16* V, const __nv_bfloat16* O,
                                  const __nv_bfloat16* dO, const float* L, __nv_bfloat16* dQ,
                                  __nv_bfloat16* dK, __nv_bfloat16* dV, const AttentionShape& s,
                                  const Layout& lay, cudaStream_t stream,
                                  const AttentionOptions* options) {
    launch_backward_hopper(Q, K, V, O, dO, L, dQ, dK, dV, s, lay, stream, options);
}

template <typename T>
static void backward_hopper_checked(const char* fn, const T* Q, const T* K, const T* V, const T* O,
                                    const T* dO, const float* L, T* dQ, T* dK, T* dV,
                                    const AttentionShape& s, cudaStream_t stream) {
    validate_shape(s, kFlashHopperHeadDims, sizeof(T));
    validate_backward_pointers(fn, Q, K, V, O, dO, L, dQ, dK, dV, s);
    const cudaDeviceProp prop = flash_device_props();
    if (prop.major != 9)
        throw std::runtime_error(std::string(fn) + " needs a GPU of compute capability 9.0 (wgmma, "
                                 "sm_90a: H100, H200); " + prop.name + " is " +
                                 std::to_string(prop.major) + "." + std::to_string(prop.minor));
    launch_backward_hopper(Q, K, V, O, dO, L, dQ, dK, dV, s, contiguous_layout(s), stream);
}

void flash_backward_fp16_hopper(const __half* Q, const __half* K, const __half* V,
                                const __half* O, const __half* dO, const float* L, __half* dQ,
                                __half* dK, __half* dV, const AttentionShape& shape,
                                cudaStream_t stream) {
    backward_hopper_checked("flash_backward_fp16_hopper", Q, K, V, O, dO, L, dQ, dK, dV, shape,
                            stream);
}
void flash_backward_bf16_hopper(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                                const __nv_bfloat16* V, const __nv_bfloat16* O,
                                const __nv_bfloat16* dO, const float* L, __nv_bfloat16* dQ,
                                __nv_bfloat16* dK, __nv_bfloat16* dV, const AttentionShape& shape,
                                cudaStream_t stream) {
    backward_hopper_checked("flash_backward_bf16_hopper", Q, K, V, O, dO, L, dQ, dK, dV, shape,
                            stream);
}
