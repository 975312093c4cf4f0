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
// it into dQacc (fp32) by TMA reduce-adds, in chapter 2's fixed order: bitwise deterministic. (The
// first version had the consumers add it with atomics, each waiting for its block's turn: 15-24%
// slower at d = 128, lab/chapter3-backward.md.)
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
#include "ordered_add.cuh"  // block_ticket, wait_turn, pass_turn: chapter 2's

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

// The tile. Q tiles of Br = 64 rows (one wgmma's M); two consumer warpgroups. Up to d = 128 each
// owns 64 keys of a K/V tile of Bc = 128 and holds all d columns of their dK_j and dV_j (d floats a
// thread at d = 128); at d = 256 that would be 256 floats, so the two share 64 keys (Bc = 64) and
// each holds half of the columns (Split = 2; both compute the same S^T and dP^T, 40% more products
// there: the price of this first version). Stages of Q_i, dO_i, L_i, D_i: bwd_stages.
constexpr int kBwdConsumers = 2, kBwdBr = 64;
// Stages of Q_i, dO_i, L_i, D_i: two, four at d = 64, whose tiles are short (3-8% faster than
// two on an H100; six no faster, nor three at d = 128: lab/chapter3-backward.md, step 4).
__host__ __device__ constexpr int bwd_stages(int d) { return d == 64 ? 4 : 2; }
__host__ __device__ constexpr int bwd_split(int d) { return d == 256 ? 2 : 1; }
__host__ __device__ constexpr int bwd_Bc(int d) { return 64 * kBwdConsumers / bwd_split(d); }
// dQ_i (Br x d, fp32) leaves the consumers a chunk of columns at a time, through two shared-memory
// buffers, to two dQ writer warps, one a buffer (write_dq, below). A consumer computes 64 columns
// a wgmma (the transposed reads need 64); who computes which:
//  - d = 128: each consumer one, into a buffer of its own (chunks of 64 columns, 16 KiB);
//  - d = 64: the consumers take turns, tile by tile (tile n: consumer n % 2, buffer n % 2); 32
//    columns each would be narrower than the transposed wgmma reads;
//  - d = 256: the consumers take turns too (tile n: consumer n % 2), each all four of its tile's
//    64-column products, passed on as eight chunks of 32 columns, the two buffers in turn (8 KiB
//    each: two of 16 KiB do not fit beside two stages). While one stages dQ_i, the other computes
//    the next tile: 1-9% faster than the first consumer staging every tile's dQ_i while the
//    second waited for it at each tile's barrier (lab/chapter3-backward.md, step 6).
// A buffer's uses must come in order: the parity of its barriers' phases tells a user which use it
// waits for, and a user ahead of the other could take an older phase of the same parity for the one
// it waits for. Where both consumers use a buffer, a barrier orders them: at d = 64 the one each
// tile has anyway (dS^T is in), at d = 256 one that tile n's consumer passes to tile n + 1's once
// its chunks are in (named barriers 3 and 4). Measured and dropped (lab/chapter3-backward.md, steps
// 3 and 4): at d = 64 both consumers each over its own 64 keys, summed in the buffer, 10-20% slower
// than taking turns; at d = 256 each tile's chunks split between the consumers, 0.91-1.05x.
constexpr int kBwdDqBuffers = 2;
static_assert(kBwdDqBuffers == 2, "a writer warp a buffer, two consumers taking turns at them");
__host__ __device__ constexpr int bwd_dq_cols(int d) { return d == 256 ? 32 : 64; }
__host__ __device__ constexpr int bwd_dq_chunks(int d) { return d / bwd_dq_cols(d); }
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

// Accumulators set by ordinary instructions (zeros) are written before this point, so that the
// wgmma_fence after it covers them (else ptxas injects a fence of its own at every wgmma).
template <int N>
__device__ __forceinline__ void written(float (&r)[N]) {
#pragma unroll
    for (int x = 0; x < N; x++) asm volatile("" : "+f"(r[x])::"memory");
}
// barrier.arrive: counts the warpgroup in at named barrier `id` and goes on; the other side waits
// for it there with named_barrier (PTX ISA, "bar, barrier": an arrive synchronizes with the sync).
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Keeps registers that an asynchronous wgmma still reads (the A fragments) alive to this point, so
// that the compiler gives them to nothing else before the wgmma_wait that precedes it.
template <int K>
__device__ __forceinline__ void keep(const uint32_t (&a)[K][4]) {
#pragma unroll
    for (int k = 0; k < K; k++)
        asm volatile("" ::"r"(a[k][0]), "r"(a[k][1]), "r"(a[k][2]), "r"(a[k][3]));
}

// Box h (columns 32h..) of a consumer's 64 x 64 accumulators of dQ_i into a dQ buffer, as the TMA
// reads it: 128 bytes a row, in each row the 16-byte chunk of columns 4b.. at b ^ (row % 8) (the
// 128-byte swizzle). A store of the warp's 8-byte pairs takes two passes of 16 lanes; in each,
// lanes t and t ^ 2 of rows g and g ^ 1 would meet in one bank if they stored the same column
// group b, so lanes t = 2, 3 take the group two ahead (k + 2): no bank conflict. (Storing in b's
// order, ncu counted 1.8 times the shared-memory wavefronts needed; lab/chapter3-backward.md,
// step 6.)
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

// L_i and D_i of the n-th Q tile (line 9), rows lane + 32h of its Br, 0 past q_len (masked) and past
// the last tile: the producer's lanes load them a tile ahead of their stage (the kernel's loop).
template <int Br, typename TileAt>
__device__ __forceinline__ void load_LD(float (&v)[Br / 32][2], const float* L, const float* Dsum,
                                        int n, int tiles, int q_len, TileAt tile_at) {
    const auto [bh, i] = tile_at(n);
    for (int h = 0; h < Br / 32; h++) {
        const int x = threadIdx.x % 32 + 32 * h;
        const bool in = n < tiles && i * Br + x < q_len;
        const size_t at = size_t(bh) * q_len + i * Br + x;
        v[h][0] = in ? L[at] : 0.f, v[h][1] = in ? Dsum[at] : 0.f;
    }
}

// The dQ writers (the producer warpgroup's second and third warps; FlashAttention-3's way to add
// dQ): writer w takes the chunks of buffer w, in the order the consumers fill them (tile n's chunks
// c = 0 .. Chunks - 1, chunk q = n Chunks + c in buffer q % Bufs); its lane 0 adds each into dQacc
// with one TMA reduce-add per 32 columns (the first block in the order stores instead) and gives
// the buffer back once the TMA has read it. Two writers, so that one buffer's read by the TMA
// overlaps the other's (with one, handing the buffers back in turn, d = 256's consumers waited for
// them; two are 0-4% faster: lab/chapter3-backward.md, step 6). The order across blocks is chapter
// 2's: before its first chunk of a tile a writer waits for the block's turn at that (query head, Q
// tile), and once the tile's adds are complete (both writers', where the tile has chunks in both
// buffers; at d = 64 a tile is one chunk, in buffer n % 2) the turn passes on, before any wait for
// the next tile (NOTES section 14). The consumers never wait for a turn, and never issue an atomic.
template <int D, typename TileAt>
__device__ void write_dq(const CUtensorMap& dQacc, const float* dQ_s, uint64_t* full,
                         uint64_t* empty, int* turns, int Tr, int tiles, int mine, TileAt tile_at) {
    constexpr int Chunks = bwd_dq_chunks(D), Bufs = kBwdDqBuffers, Cols = bwd_dq_cols(D);
    constexpr int Br = kBwdBr;
    const int w = threadIdx.x / 32 - 1;                // writer w, buffer w
    const bool lane0 = threadIdx.x % 32 == 0;
    for (int n = 0, q = 0; n < tiles; n++) {
        const auto [bh, i] = tile_at(n);
        int* turn = turns + size_t(bh) * Tr + i;
        bool adding = false;                           // it has chunks of tile n
        for (int c = 0; c < Chunks; c++, q++) {
            if (q % Bufs != w) continue;               // the other writer's chunk
            mbar_wait(&full[w], q / Bufs % 2);         // the chunk is in its buffer
            if (!adding) wait_turn(turn, mine), fence_proxy_async_global(), adding = true;
            if (lane0) {
                for (int h = 0; h < Cols / 32; h++)    // its boxes of 32 columns
                    tma_store(dQacc, dQ_s + (w * Cols + 32 * h) * Br, Cols * c + 32 * h, i * Br,
                              bh, mine > 0);
                bulk_commit(), bulk_wait_read<0>();
                mbar_arrive(&empty[w]);
            }
            __syncwarp();
        }
        if (lane0 && adding) bulk_wait<0>(), fence_proxy_async_global();  // its adds are complete
        if (Chunks >= Bufs) named_barrier(5, 32 * Bufs);  // and the other writer's
        if (lane0 && (Chunks >= Bufs ? w == 0 : adding)) pass_turn(turn);
        __syncwarp();
    }
}

// The kernel: one block per (batch*kv head, K/V tile j), in ticket order (chapter 2's). Warpgroup
// 0's first warp is the producer (lane 0 issues the TMA copies, all 32 lanes copy L_i and D_i), its
// second and third the dQ writers; warpgroups 1 and 2 the consumers. Shared memory, 1024-aligned:
// K_j and V_j (Bc rows), the stages of Q_i and dO_i (Br rows), each as blocks of 64 columns in the
// 128-byte swizzle; dS^T (Bc x Br, swizzled as TMA would) twice; the dQ buffers (two boxes of Br
// rows x 32 floats each, the same swizzle); the stages' L_i and D_i; the mbarriers.
template <typename T, int D, int Split>
__global__ void __launch_bounds__(kBwdThreads, 1)
flash_backward_hopper_kernel(const __grid_constant__ CUtensorMap Q,
                             const __grid_constant__ CUtensorMap K,
                             const __grid_constant__ CUtensorMap V,
                             const __grid_constant__ CUtensorMap dO, const float* __restrict__ L,
                             const float* __restrict__ Dsum,
                             const __grid_constant__ CUtensorMap dQacc,
                             int* __restrict__ turns, int* next_ticket, T* __restrict__ dK,
                             T* __restrict__ dV, int q_len, int kv_len, bool causal, int Tc,
                             int BH, int group, int HG, float scale_log2) {
    constexpr int C = kBwdConsumers, Br = kBwdBr, Stages = bwd_stages(D), Bc = 64 * C / Split;
    constexpr int Bufs = kBwdDqBuffers, Chunks = bwd_dq_chunks(D), Cols = bwd_dq_cols(D);
    constexpr int Dw = D / Split;                      // columns of dK_j, dV_j a warpgroup holds
    extern __shared__ __align__(16) unsigned char shared[];
    T* K_j = reinterpret_cast<T*>(shared + (1024 - smem_addr(shared) % 1024) % 1024);
    T *V_j = K_j + Bc * D, *Q_s = V_j + Bc * D;       // stage s: Q_s + s Br D, dO_s + s Br D
    T *dO_s = Q_s + Stages * Br * D, *dS_s = dO_s + Stages * Br * D;  // dS^T: 2, n % 2 for tile n
    float* dQ_s = reinterpret_cast<float*>(dS_s + 2 * Bc * Br);  // dQ chunks: 2 boxes a buffer
    float* LD = dQ_s + Bufs * Br * Cols;               // stage s: L_i, then D_i
    auto *full = reinterpret_cast<uint64_t*>(LD + Stages * 2 * Br), *empty = full + Stages,
         *kv_full = empty + Stages, *dq_full = kv_full + 1, *dq_empty = dq_full + Bufs;
    // The mbarriers (before init_barriers' fence, which covers them all): K_j and V_j are in; dQ
    // buffer b is filled (a warpgroup's 128 arrivals) and read (the writer's one); the stages'
    // empty (each consumer thread's arrival) and full (the producer's 32 lanes').
    if (threadIdx.x == 0) {
        mbar_init(kv_full, 1);
        for (int b = 0; b < Bufs; b++) mbar_init(&dq_full[b], 128), mbar_init(&dq_empty[b], 1);
        init_barriers(full, empty, Stages, 128 * C, 32);
    }
    const int ticket = block_ticket(next_ticket);      // its barrier publishes the mbarriers too
    // Ticket -> (kv head, K/V tile j), chapter 2's order: heads in groups of HG, each group's tiles
    // from the right (causal: from the left, longest first), its heads taking turns. Line 5.
    const int head0 = ticket / (HG * Tc) * HG, heads = min(HG, BH - head0);
    const int slot = ticket % (HG * Tc), kvh = head0 + slot % heads;
    const int j = causal ? slot / heads : Tc - 1 - slot / heads;
    // Line 8: the Q tiles i that see key tile j, of each query head kvh group + g of the group;
    // under the mask from the last (chapter 2's order, so dQ_i's adds follow j up).
    const int Tr = (q_len + Br - 1) / Br;
    const int i_first = causal ? max(0, flash_first_query(j * Bc, q_len, kv_len)) / Br : 0;
    const int per_head = max(Tr - i_first, 0), tiles = group * per_head;
    const int mine = causal ? j : Tc - 1 - j;          // the block's place in each dQ_i's order
    // The n-th Q tile {query head, i}: at each i the group's heads in turn, so that every block
    // reaches (head, i) at the same step n and none waits long for its dQ turn there. (Head after
    // head, as chapter 2 walks, a block under the mask reaches each next head before the longer
    // blocks ahead of it in the turns: 0.94x MHA's TFLOP/s at d = 128, now 1.03x; chapter4.md.)
    const auto tile_at = [&](int n) {
        const int r = n / group;
        return int2{kvh * group + n % group, causal ? Tr - 1 - r : i_first + r};
    };
    if (threadIdx.x < kWarpgroup) {                    // the producer: lines 6 and 9
        setmaxnreg<false, kBwdProducerRegs>();
        if (threadIdx.x >= 32 * (1 + kBwdDqBuffers)) return;
        if (threadIdx.x >= 32)                         // the next warps: the dQ writers
            return write_dq<D>(dQacc, dQ_s, dq_full, dq_empty, turns, Tr, tiles, mine, tile_at);
        if (threadIdx.x == 0) {                               // line 6: K_j, V_j, once
            mbar_expect_bytes(kv_full, 2 * Bc * D * sizeof(T));
            load_tile<Bc, D>(K_j, K, j * Bc, kvh, kv_full);
            load_tile<Bc, D>(V_j, V, j * Bc, kvh, kv_full);
        }
        // L_i, D_i are loaded a tile ahead, so that no stage waits for its own: loaded and stored
        // in turn, they held each stage's TMA copies back by a round trip to memory, which set the
        // pace at d = 64 (1.06-1.3x faster with this on an H100; lab/chapter4.md).
        PipelineState<Stages> st;
        float next[Br / 32][2];                        // L_i, D_i of tile n, then of n + 1
        load_LD<Br>(next, L, Dsum, 0, tiles, q_len, tile_at);
        for (int n = 0; n < tiles; n++, st.advance()) {  // line 9: Q_i, dO_i, L_i, D_i
            const auto [bh, i] = tile_at(n);
            const int s = st.stage();
            if (st.n >= Stages) mbar_wait(&empty[s], st.phase_before());
            for (int h = 0; h < Br / 32; h++)
                LD[s * 2 * Br + threadIdx.x + 32 * h] = next[h][0],
                LD[s * 2 * Br + Br + threadIdx.x + 32 * h] = next[h][1];
            load_LD<Br>(next, L, Dsum, n + 1, tiles, q_len, tile_at);
            if (threadIdx.x > 0) mbar_arrive(&full[s]);  // its L_i, D_i written: an arrival each
            else {                                     // lane 0's arrival, with the bytes to come
                mbar_expect_bytes(&full[s], 2 * Br * D * sizeof(T));
                load_tile<Br, D>(Q_s + s * Br * D, Q, i * Br, bh, &full[s]);
                load_tile<Br, D>(dO_s + s * Br * D, dO, i * Br, bh, &full[s]);
            }
        }
        // It leaves once the last stages it filled are read (as the forward's producer).
        for (PipelineState<Stages> e{max(st.n - Stages, 0)}; e.n < st.n; e.advance())
            mbar_wait(&empty[e.stage()], e.phase());
        return;
    }
    setmaxnreg<true, kBwdConsumerRegs>();
    const int wg = threadIdx.x / kWarpgroup - 1;       // which consumer, 0 .. C - 1
    const int warp = threadIdx.x % kWarpgroup / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    const int kw = wg / Split * 64, cw = wg % Split * Dw;  // its keys kw.., its columns cw..
    const char *K_c = reinterpret_cast<const char*>(K_j), *K_w = K_c + kw * kRowBytes;
    const char* V_w = reinterpret_cast<const char*>(V_j) + kw * kRowBytes;
    float dK_j[Dw / 2] = {}, dV_j[Dw / 2] = {};        // line 7
    mbar_wait(kv_full, 0);                             // K_j and V_j are in
    PipelineState<Stages> st;
    for (int n = 0; n < tiles; n++, st.advance()) {   // line 8: for each Q_i
        const auto [bh, i] = tile_at(n);
        const int s = st.stage(), q0 = i * Br;
        const char* Q_i = reinterpret_cast<const char*>(Q_s + s * Br * D);
        const char* dO_i = reinterpret_cast<const char*>(dO_s + s * Br * D);
        const float *L_i = LD + s * 2 * Br, *D_i = L_i + Br;
        mbar_wait(&full[s], st.phase());               // Q_i, dO_i, L_i, D_i are in
        // Line 10: S^T = K_j Q_i^T; line 13: dP^T = V_j dO_i^T (its 64 keys), 16 of d a step.
        float S[Br / 2] = {}, dP[Br / 2] = {};
        written(S), written(dP);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < D / 16; k++)
            wgmma_ss<T, Br>(S, smem_desc(K_w + k / 4 * Bc * kRowBytes + k % 4 * 32, 0),
                            smem_desc(Q_i + k / 4 * Br * kRowBytes + k % 4 * 32, 0));
        wgmma_commit();
#pragma unroll
        for (int k = 0; k < D / 16; k++)
            wgmma_ss<T, Br>(dP, smem_desc(V_w + k / 4 * Bc * kRowBytes + k % 4 * 32, 0),
                            smem_desc(dO_i + k / 4 * Br * kRowBytes + k % 4 * 32, 0));
        wgmma_commit();
        wgmma_wait<1>(S);                              // S^T is done (dP^T may not be)
        // Line 11: P^T = exp(S^T - L_i), masked only where the tile reaches past a key's first
        // query, kv_len or q_len. acc_at(S, r, c): key kw + 16 warp + g + 8r, query 8(c/2)+2t+c%2.
        const bool edge = (j + 1) * Bc > kv_len || q0 + Br > q_len ||
                          (causal && q0 < flash_first_query((j + 1) * Bc - 1, q_len, kv_len));
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int key = j * Bc + kw + 16 * warp + g + 8 * r;
            const int first =                          // the key's first query
                key >= kv_len ? q_len : causal ? flash_first_query(key, q_len, kv_len) : 0;
#pragma unroll
            for (int c = 0; c < Br / 4; c++) {
                const int qi = 8 * (c / 2) + 2 * t + c % 2;
                float& p = acc_at(S, r, c);
                p = exp2_ftz(p * scale_log2 - L_i[qi] * kLog2e);
                if (edge && (q0 + qi < first || q0 + qi >= q_len)) p = 0.f;
            }
        }
        wgmma_wait<0>(dP);                             // dP^T is done
        uint32_t P[Br / 16][4], dS[Br / 16][4];        // P^T and dS^T in T, as A fragments
#pragma unroll
        for (int c = 0; c < Br / 4; c++)               // line 14: dS^T = P^T o (dP^T - D_i)
#pragma unroll
            for (int r = 0; r < 2; r++)
                acc_at(dP, r, c) =
                    acc_at(S, r, c) * (acc_at(dP, r, c) - D_i[8 * (c / 2) + 2 * t + c % 2]);
#pragma unroll
        for (int k = 0; k < Br / 16; k++)
#pragma unroll
            for (int a = 0; a < 4; a++) {              // A's register a: elements 8k + 2a, + 1
                P[k][a] = pair_bits<T>(S[8 * k + 2 * a], S[8 * k + 2 * a + 1]);
                dS[k][a] = pair_bits<T>(dP[8 * k + 2 * a], dP[8 * k + 2 * a + 1]);
            }
        // dS^T to shared memory for line 15, keys x queries in the 128-byte swizzle: row `key`,
        // the 16-byte chunk of queries 8b.. at chunk b ^ (key % 8). Its element pairs (g + 8r,
        // 8b + 2t) are dS[b / 2][2 (b % 2) + r]. At Split = 2 both hold it; the one that computes
        // dQ_i (kBwdDqBuffers' comment) writes it, into its own buffer: n % 2 = wg.
        char* dS_T = reinterpret_cast<char*>(dS_s + n % 2 * Bc * Br);
        const bool adds = D == 128 || wg == n % C;     // it computes dQ_i, or its part
        if (Split == 1 || adds) {
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int key = kw + 16 * warp + g + 8 * r;
#pragma unroll
                for (int b = 0; b < Br / 8; b++)
                    *reinterpret_cast<uint32_t*>(dS_T + key * kRowBytes + (b ^ key % 8) * 16 +
                                                 4 * t) = dS[b / 2][2 * (b % 2) + r];
            }
            fence_proxy_async();                       // wgmma (the async proxy) reads it next
        }
        // Line 12: dV_j += P^T dO_i; line 16: dK_j += dS^T Q_i: A from registers, B (queries x
        // columns) read transposed, its 64-column blocks Br rows apart. At most 128 columns a
        // wgmma.
        constexpr int N = Dw < 128 ? Dw : 128;
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < Br / 16; k++)
#pragma unroll
            for (int h = 0; h < Dw / N; h++) {
                const int at = ((cw + h * N) / 64 * Br + 16 * k) * kRowBytes;
                wgmma_rs<T, N>(dV_j + h * N / 2, P[k], smem_desc(dO_i + at, Br * kRowBytes));
                wgmma_rs<T, N>(dK_j + h * N / 2, dS[k], smem_desc(Q_i + at, Br * kRowBytes));
            }
        wgmma_commit();                                // (lines 12, 16 run on meanwhile)
        if (Split == 1) named_barrier(2, kWarpgroup * C);  // every warpgroup's dS^T is in
        else if (adds && n > 0) named_barrier(3 + n % 2, kWarpgroup * C);  // tile n - 1's dQ_i in
        // Line 15: dQ_i = dS K_j, chunk c (columns 64c..) a wgmma: A = dS (dS^T read
        // transposed), B = K_j read transposed; then into a dQ buffer for the writers. Which
        // warpgroup computes which chunk: kBwdDqBuffers' comment.
#pragma unroll 1
        for (int cb = 0; cb < (adds ? D / 64 / (D == 128 ? C : 1) : 0); cb++) {
            const int c = D == 128 ? wg : cb;         // columns 64c.. of the n-th tile's dQ_i
            float dQ_i[32] = {};
            written(dQ_i);
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < Bc / 16; k++)
                wgmma_ss<T, 64, true>(dQ_i,  // lbo: where a next 64-column block would be
                                      smem_desc(dS_T + 16 * k * kRowBytes, Bc * kRowBytes),
                                      smem_desc(K_c + (c * Bc + 16 * k) * kRowBytes,
                                                Bc * kRowBytes));
            wgmma_commit();
            wgmma_wait<0>(dQ_i);
#pragma unroll
            for (int h = 0; h < 2; h++) {              // its boxes of 32 columns: chunk q, buffer b
                const int q = n * Chunks + (64 * c + 32 * h) / Cols, b = q % Bufs;
                if (32 * h % Cols == 0 && q >= Bufs) mbar_wait(&dq_empty[b], (q / Bufs - 1) % 2);
                stage_dq(reinterpret_cast<char*>(dQ_s + (b * Cols + 32 * h % Cols) * Br), dQ_i, h);
                if ((32 * h + 32) % Cols == 0)         // the chunk is in: the TMA reads it next
                    fence_proxy_async(), mbar_arrive(&dq_full[b]);
            }
        }
        if (Split == 2 && adds && n + 1 < tiles) named_arrive(3 + (n + 1) % 2, kWarpgroup * C);
        wgmma_wait<0>(dV_j), written(dK_j);            // lines 12, 16 done: stage, A fragments free
        // Every consumer thread gives the stage back itself, so that its own reads of L_i, D_i
        // (the producer's plain stores) are ordered before the refill by its own arrival: one
        // lane's after a __syncwarp orders them too, but racecheck follows only a thread's own.
        keep(P), keep(dS);
        mbar_arrive(&empty[s]);
    }
    // Line 18: dK_j / sqrt(d) (S was unscaled), dV_j, rows past kv_len left out.
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int key = j * Bc + kw + 16 * warp + g + 8 * r;
        const size_t at = (size_t(kvh) * kv_len + key) * D + cw + 2 * t;
#pragma unroll
        for (int b = 0; b < Dw / 8 && key < kv_len; b++) {
            *reinterpret_cast<uint32_t*>(dK + at + 8 * b) = pair_bits<T>(
                acc_at(dK_j, r, 2 * b) * rsqrtf(D), acc_at(dK_j, r, 2 * b + 1) * rsqrtf(D));
            *reinterpret_cast<uint32_t*>(dV + at + 8 * b) =
                pair_bits<T>(acc_at(dV_j, r, 2 * b), acc_at(dV_j, r, 2 * b + 1));
        }
    }
}

#undef HOPPER_ONLY

// ---------------------------------------------------------------------------------------------
// The launcher. Shared memory: K_j, V_j, the stages of Q_i and dO_i, dS^T twice (2 bytes an
// element), the dQ buffers (Br x bwd_dq_cols floats each), the stages' L_i and D_i, alignment, the
// mbarriers (2 a stage, K_j and V_j's, 2 a dQ buffer).
static constexpr size_t bwd_hopper_shared_bytes(int d) {
    return size_t(2 * bwd_Bc(d) * d + 2 * bwd_stages(d) * kBwdBr * d + 2 * bwd_Bc(d) * kBwdBr) * 2 +
           size_t(kBwdDqBuffers) * kBwdBr * bwd_dq_cols(d) * sizeof(float) +
           bwd_stages(d) * 2 * kBwdBr * sizeof(float) + 1024 +
           8 * (2 * bwd_stages(d) + 1 + 2 * kBwdDqBuffers);
}
static_assert(bwd_hopper_shared_bytes(64) <= 227 * 1024 &&
                  bwd_hopper_shared_bytes(128) <= 227 * 1024 &&
                  bwd_hopper_shared_bytes(256) <= 227 * 1024,
              "a block past 227 KiB");

// The launch: chapter 2's passes around the kernel (flash_backward_passes, lib/checks.h: its
// scratch, its D pass before, its dQ = dQacc / sqrt(d) after), the kernel between them.
template <typename T>
static void launch_backward_hopper(const T* Q, const T* K, const T* V, const T* O, const T* dO,
                                   const float* L, T* dQ, T* dK, T* dV, const AttentionShape& s,
                                   cudaStream_t stream) {
    dispatch_head_dim<kFlashHopperHeadDims>(s.head_dim, [&](auto dim) {
        constexpr int D = decltype(dim)::value, Bc = bwd_Bc(D), Br = kBwdBr;
        constexpr size_t bytes = bwd_hopper_shared_bytes(D);
        const auto kernel = flash_backward_hopper_kernel<T, D, bwd_split(D)>;
        allow_shared(kernel, bytes);
        AttentionShape kv_shape = s;                   // a block per (batch, kv head, K/V tile)
        kv_shape.heads = flash_kv_heads(s);
        const int blocks = grid_blocks(kv_shape, s.kv_len, Bc, "kv_len");
        const int Tc = (s.kv_len + Bc - 1) / Bc, BH = s.batch * flash_kv_heads(s);
        const size_t q_heads = l_elems(s) / s.q_len;
        const CUtensorMap Qm = tensor_map(Q, q_heads, s.q_len, D, Br),
                          dOm = tensor_map(dO, q_heads, s.q_len, D, Br),
                          Km = tensor_map(K, size_t(BH), s.kv_len, D, Bc),
                          Vm = tensor_map(V, size_t(BH), s.kv_len, D, Bc);
        // Interleaving heads' tiles keeps one head's tiles apart in time (chapter 2's groups): HG
        // heads' tickets at a time, K/V tile by K/V tile. Under the mask about two waves of blocks a
        // group (HG Tc = 2 SMs, at most 32 heads): from N = 2048 at d = 128 that is 5-7% faster than
        // 32 heads for MHA, 5-14% for GQA of 4; at d = 256 it was 5-12% slower, so 32 stays there.
        // Without the mask 4 heads (lab/chapter4.md, "The heads a ticket group").
        const int sms = flash_device_props().multiProcessorCount;
        const int HG = !s.causal ? 4 : D == 256 ? 32 : std::clamp(2 * sms / Tc, 1, 32);
        // The kernel's turns: one a (query head, Q tile of 64), within the passes' B*H*ceil(q_len
        // / 32). dQacc (fp32) is written by the TMA: boxes of Br rows x 32 columns.
        flash_backward_passes(O, dO, dQ, s, stream, [&](const BackwardScratch& m) {
            const CUtensorMap dQm = tensor_map(m.dQacc, q_heads, s.q_len, D, Br);
            kernel<<<blocks, kBwdThreads, bytes, stream>>>(
                Qm, Km, Vm, dOm, L, m.D, dQm, m.turns, m.next_ticket, dK, dV, s.q_len,
                s.kv_len, s.causal, Tc, BH, flash_kv_group(s), HG, scale_log2_for(D));
            return cudaGetLastError();
        });
    });
}

void flash_backward_hopper_launch(const __half* Q, const __half* K, const __half* V,
                                  const __half* O, const __half* dO, const float* L, __half* dQ,
                                  __half* dK, __half* dV, const AttentionShape& s,
                                  cudaStream_t stream) {
    launch_backward_hopper(Q, K, V, O, dO, L, dQ, dK, dV, s, stream);
}
void flash_backward_hopper_launch(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                                  const __nv_bfloat16* V, const __nv_bfloat16* O,
                                  const __nv_bfloat16* dO, const float* L, __nv_bfloat16* dQ,
                                  __nv_bfloat16* dK, __nv_bfloat16* dV, const AttentionShape& s,
                                  cudaStream_t stream) {
    launch_backward_hopper(Q, K, V, O, dO, L, dQ, dK, dV, s, stream);
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
    launch_backward_hopper(Q, K, V, O, dO, L, dQ, dK, dV, s, stream);
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
