// flash_decode.cu: chapter 4, split-KV decoding (flash-decoding) with grouped K/V heads, in fp16
// and bf16. The API is flash.h's chapter 4 section; NOTES.md chapter 4 is the companion text.
//
// A decode step asks a few new query rows (q_len 1..8) to attend over a long K/V cache. Chapter 2's
// forward gives one block a (batch, head) and 128 query rows: here that is one block a head with
// one useful row, a handful of SMs lit, the cache read at a fraction of the memory's speed. Two
// changes make the step run at the speed of memory:
//  1. Grouped K/V heads: the heads / kv_heads query heads that share a K/V head (GQA; MQA when
//     kv_heads = 1), group * q_len rows in all, are one block's rows, so that their K/V head is read
//     once for all of them, not once a query head.
//  2. Split-KV: the keys of a (batch, K/V head) are cut into `splits` runs of whole key tiles, one
//     block each. Block s runs FlashAttention-2's forward loop (online softmax) over its keys only
//     and writes a partial result: O_s (normalised by its own l, fp32) and its logsumexp L_s. The
//     last block of the group to end (arrive_last) merges the partials through L, exactly (NOTES
//     chapter 4 derives it):
//         L = log sum_s exp(L_s),   O = sum_s exp(L_s - L) O_s,
//     in the order s = 0, 1, ..., so the result is the same bits on every run. A split that sees
//     no key (past kv_len, or masked) has L_s = -inf and weight exp(-inf) = 0.
//
// Decode is memory-bound: each key brings 2 d elements (its K and V rows, 4 d bytes) and costs
// 4 d flops a query row (2 d for q.k, 2 d for p v). At R rows a block that is R flops a byte; an
// H100 moves ~3.3 TB/s and does ~60 Tflop/s of fp32 FMA, 18 flops a byte, so up to R = 8 rows the
// CUDA cores keep up with memory. Hence: no mma here, fp32 all the way (S, P and O). The effort
// goes into keeping bytes in flight: each warp streams its own keys through a two-step ring in
// shared memory, the next step's loads on their way while it computes on this one (the split
// kernel's comment). What each choice below was measured against, and the variants tried and
// dropped, with their figures: lab/chapter4.md, part 2.
#include "checks.h"
#include "chapters.h"
#include "flash.h"
#include "fragments.cuh"  // SM80_ASM, the pairs of T
#include "layout.h"     // layout_given
#include "log2_units.h"
#include "mask_policy.cuh"  // the mask and score: PlainPolicy, or chapter 5's ModelPolicy

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <random>
#include <climits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int kThreads = 128;                    // the append kernel's block
constexpr int kMaxSplits = (1 << 24) - 1;         // arrive_last counts arrivals in 24 bits
constexpr int kSplitThreads = 256;               // the split kernel's block: 8 warps
constexpr int kSplitWarps = kSplitThreads / 32;
constexpr int kRows = 8;  // query rows a block: group * q_len rows are cut into blocks of 8

// Keys a tile, the unit the splits are counted in (flash_decode_choose_splits): 64 up to d = 128,
// 32 at d = 256.
__host__ __device__ constexpr int decode_Bc(int D) { return D <= 128 ? 64 : 32; }
// The fewest tiles a split takes (the split rules below), so that its fixed costs stay small.
constexpr int kMinTilesPerSplit = 4;

// The split kernel is compiled for blocks of at most kR rows, kR = 4 or 8 (its registers hold Q
// and O of kR rows): the smallest that holds min(8, group * q_len). Groups of 4 at q_len 1 (Llama,
// Mistral) take the 4-row kernel, which fits 128 registers a thread, so that 2 blocks (16 warps)
// share an SM (if their shared memory fits too: kRingBytes below); the 8-row kernel needs more
// and runs 1 block an SM.
__host__ __device__ constexpr int decode_blocks_per_sm(int kR) { return kR <= 4 ? 2 : 1; }
// Warp-loads of K and of V a lane issues for one step of its loop (the unrolling below): 4, 16
// bytes each, 128 bytes a lane, 4 KiB a warp.
constexpr int kUnroll = 4;
// Each warp streams its keys through a ring of kStages such steps in shared memory (cp.async), a
// slot a lane: kStages - 1 steps on their way while it computes on one. 2 stages: 8 KiB a warp,
// 64 KiB a block, so 2 blocks share an SM on an H100 (228 KiB) or an A100 (164 KiB), 1 on sm_86
// or sm_89 (100 KiB). Another count: make clean all DEFINES=-DFLASH_DECODE_STAGES=3 (96 KiB a
// block; 4 leave 1 block an SM).
#ifndef FLASH_DECODE_STAGES
#define FLASH_DECODE_STAGES 2
#endif
constexpr int kStages = FLASH_DECODE_STAGES;
constexpr size_t kRingBytes = size_t(kSplitWarps) * kStages * 2 * kUnroll * 32 * 16;

// Shared memory of a block: the warps' rings, which the end's merge of the warps' partial (O, m, l)
// of kR rows then reuses.
__host__ __device__ constexpr size_t decode_shared_bytes(int D, int kR) {
    const size_t merge = sizeof(float) * kSplitWarps * (size_t(kR) * D + 2 * kR);
    return merge > kRingBytes ? merge : kRingBytes;
}

// cp.async (compute capability 8.0): 16 bytes from global memory into shared memory, not through
// registers; when `inside` is false it writes 16 zero bytes instead (source size 0): a key past
// the split's end is a finite 0 (0 * NaN would be NaN). A thread commits the copies it has issued
// as a group, and waits until at most N of its groups are in flight; its own copies are then
// visible to it. (SM80_ASM, lib/fragments.cuh: a build for an older GPU compiles them to a trap;
// the API refuses such a GPU.)
// Each copy carries an L2 cache policy (createpolicy, PTX ISA "Data Movement: createpolicy"),
// made once a thread. Evict-first asks the L2 to replace these lines before others, so that a
// call's K and V, read once, replace each other rather than what earlier kernels left there
// (dirty lines, whose write-back the call would pay). Evict-unchanged leaves the L2's choice as it
// would be without a hint (an explicit evict-normal is not the same as none to every L2). The
// launcher's rule: decode_launch.
__device__ __forceinline__ unsigned long long l2_policy(bool evict_first) {
    unsigned long long policy = 0;
    if (evict_first)
        SM80_ASM("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    else
        SM80_ASM("createpolicy.fractional.L2::evict_unchanged.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
__device__ __forceinline__ void cp_async_16(void* to, const void* from, bool inside,
                                            unsigned long long policy) {
    const unsigned dst = unsigned(__cvta_generic_to_shared(to));
    SM80_ASM("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst),
             "l"(from), "r"(inside ? 16 : 0), "l"(policy));
}
__device__ __forceinline__ void cp_async_commit() { SM80_ASM("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { SM80_ASM("cp.async.wait_group %0;\n" ::"n"(N)); }

// 8 elements of T (16 bytes, as loaded) as eight floats.
template <typename T>
__device__ __forceinline__ void eight_floats(uint4 raw, float* f) {
    const Pair<T>* pairs = reinterpret_cast<const Pair<T>*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 v = float2_of(pairs[k]);
        f[2 * k] = v.x, f[2 * k + 1] = v.y;
    }
}
// 16 bytes from global memory through the read-only path (K, V and Q are never written here).
template <typename T>
__device__ __forceinline__ uint4 load16(const T* p) {
    return __ldg(reinterpret_cast<const uint4*>(p));
}

// ---------------------------------------------------------------------------------------------
// The split kernel: block (b, kv head, split, chunk) runs the forward loop of FlashAttention-2
// (Algorithm 1, lines 4-11: S = Q K_j^T, m, P~ = exp(S - m), l, O rescaled and += P~ V_j) for the
// rows [chunk * kRows, +kRows) of its K/V group over the keys of its split, and writes O_s = O / l
// and L_s = m + log l (lines 12-13, per split). Decode reads every byte of K and V once and does
// little with it, so the loop is built to keep bytes on their way from memory while it computes,
// and to spend few instructions on each:
//  - No __syncthreads in the loop: every warp takes keys of its own, 16 bytes a lane, through a
//    ring of its own in shared memory (KeyRing), the next step's copies issued before this step's
//    math.
//  - q . k: each lane multiplies its 8 elements with Q's, then the lanes of the key add their sums
//    by shuffles (scores).
//  - Each group of lanes that shares a key row keeps its own online softmax (m, l and its 8
//    columns of O, for every row): no exchange between key rows in the loop, one rescale per kU
//    keys (online_softmax).
//  - At the end the partials meet through the same logsumexp identity as the splits' merge:
//    first the groups of a warp (merge_groups), then the warps (write_split, in warp order:
//    deterministic).
// The kernel runs the parts in that order. Every array a thread keeps in registers is declared in
// the kernel, where all of them are in view, and where nvcc places them in registers in one pass:
// an array local to a part is placed before the part is inlined, and the kernel's machine code
// changes with it (scores and add_PV take Kf and Vf for that reason).

// The block's shared memory: the warps' rings, then write_split's merge over them. 128-byte
// aligned, so that each warp's copies land at the same offset within 128 bytes as the rows they
// come from, whatever static shared memory comes before it.
extern __shared__ __align__(128) uint4 shared[];

// How a warp's lanes share its keys at head dim D. kLanesPerKey = D / 8 lanes hold a key row, 8
// elements (16 bytes) each, so that one warp-load brings kKeysPerLoad rows (d = 128: 16 lanes a
// row, 2 rows, 512 bytes); a step of a warp's loop is kU warp-loads of K and of V, kWarpKeys keys,
// and the block's warps take kStep keys a step. A lane's place: its warp, its lane, g (which key
// row of a warp-load is its) and c0 (its 8 columns of d).
template <int D>
struct KeyLanes {
    static constexpr int kLanesPerKey = D / 8;              // 8, 16, 32 at d = 64, 128, 256
    static constexpr int kKeysPerLoad = 32 / kLanesPerKey;  // 4, 2, 1
    static constexpr int kU = kUnroll;                      // warp-loads in flight a step
    static constexpr int kWarpKeys = kU * kKeysPerLoad;
    static constexpr int kStep = kSplitWarps * kWarpKeys;
    static_assert(D % 8 == 0 && 32 % kLanesPerKey == 0, "a key row is whole 16-byte lanes");
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int g = lane / kLanesPerKey;
    int c0 = lane % kLanesPerKey * 8;
};

// Where a split block works. blockIdx.x = chunk + chunks * (split + splits * (kv head + kv_heads
// * b)): the chunks of one split (rows beyond 8 of a large group) are neighbours, so the second
// reads the split's K and V from L2. The group's rows are contiguous in Q, O and L: heads
// kvh * group .. + group - 1, q_len rows each; row r of the block is query (row0 + r) % q_len of
// its head.
struct SplitBlock {
    int split, b, kvh;  // the split, the batch and the K/V head
    int row0, R;        // the block's first row of its group's group * q_len, and its rows (<= kR)
    size_t first_row;   // the row of Q, O_s and L_s that is the block's row 0
    size_t rows_total;  // rows of Q, O and L: batch * heads * q_len
    int k0, k1;         // the split's keys [k0, k1): whole Bc-key tiles, the last cut at key_end
};

// Where the keys are (flash.h's KVCache, chapter 4's second part). Without a table, contiguous:
// [batch][kv_heads][kv_len][D]. With one, paged: key j of sequence b is row j % page_size of page
// table[b pages_per_seq + j / page_size], pages [pages][kv_heads][page_size][D]. lens: each
// sequence's keys before this call's `added` are appended (none: kv_len each, nothing added).
// The host checks every length and page in use; where it cannot (a stream being captured into a
// CUDA graph), a bad entry must still never send a read or the append outside the cache, so each
// is clamped into its range: a no-op for the checked ones.
struct KeyPages {
    const int* lens = nullptr;
    const int* table = nullptr;
    int page_size = 0, pages_per_seq = 0, num_pages = 0, added = 0;

    __device__ int keys(int b, int kv_len) const {
        return lens ? min(max(lens[b], 0), kv_len - added) + added : kv_len;
    }
    // Entry i of a sequence's row of the table.
    __device__ int page(const int* row, int i) const { return min(max(row[i], 0), num_pages - 1); }
};
// One K/V head's rows of a K (or V) laid out as pages says: row(j), key j's row (its page's
// through the table); in_pages(j), key j's row's offset from head in pages (a look-up in the
// table and a division: the paged ring makes them once for 32 steps). A page's rows are contiguous.
template <typename T, int D>
struct HeadRows {
    const T* head;       // the head's row 0: contiguous, of its sequence; paged, of page 0
    const int* table;    // the sequence's row of the block table, or none
    int page_elems;      // elements a page (all K/V heads: below 2^31, as the checks bound it)
    int page_size;
    KeyPages pages;      // (its page())
    __device__ HeadRows(const T* K, const KeyPages& p, int b, int kvh, int kv_heads, int kv_len)
        : head(p.table ? K + size_t(kvh) * p.page_size * D
                       : K + (size_t(b) * kv_heads + kvh) * size_t(kv_len) * D),
          table(p.table ? p.table + size_t(b) * p.pages_per_seq : nullptr),
          page_elems(kv_heads * p.page_size * D), page_size(p.page_size), pages(p) {}
    __device__ const T* row(int j) const {
        return head + (table ? in_pages(j) : size_t(j) * D);
    }
    __device__ size_t in_pages(int j) const {
        return size_t(pages.page(table, j / page_size)) * page_elems + size_t(j % page_size) * D;
    }
};

template <int D>
__device__ __forceinline__ SplitBlock split_block(int heads, int kv_heads, int q_len, int kv_len,
                                                  int splits, int chunks) {
    SplitBlock blk;
    int id = blockIdx.x;
    const int chunk = id % chunks;
    id /= chunks;
    blk.split = id % splits;
    id /= splits;
    const int kvh = id % kv_heads, b = id / kv_heads;
    const int group = heads / kv_heads;
    blk.b = b, blk.kvh = kvh;
    blk.row0 = chunk * kRows;
    blk.R = min(kRows, group * q_len - blk.row0);  // <= kR: the launcher's choice of kR
    blk.first_row = (size_t(b) * heads + size_t(kvh) * group) * q_len + blk.row0;
    blk.rows_total = size_t(gridDim.x / (splits * chunks)) * group * q_len;
    return blk;
}
// The split's keys: the policy's for the block's sequence, keys.begin .. keys.end - 1 (all its
// keys without a window), from the tile where they start, cut into runs of tiles_per_split tiles.
// A split past the last key gets none (tile0 = tiles); no overflow: the launcher bounds it.
template <int D>
__device__ __forceinline__ void split_keys(SplitBlock& blk, const KeySpan& keys,
                                           int tiles_per_split) {
    constexpr int Bc = decode_Bc(D);
    const int key0 = keys.begin / Bc * Bc, key_end = max(keys.end, key0);
    const int tiles = (key_end - key0 + Bc - 1) / Bc;
    const int tile0 = min(blk.split * tiles_per_split, tiles);
    blk.k0 = key0 + tile0 * Bc;
    blk.k1 = min(key0 + min(tile0 + tiles_per_split, tiles) * Bc, key_end);
}

// The copy ring (line 7, for a warp's own keys). A warp's ring is kStages steps of slots in shared
// memory, [kStages][2 kU][32] uint4: a stage's kU K slots, then its kU V slots, a slot a lane.
// Step n of the warp takes keys [base, base + kWarpKeys), base = k0 + (n kSplitWarps + warp)
// kWarpKeys (the same for every lane: the loop, and the shuffles in it, are warp-uniform), so that
// the block's warps read neighbouring rows; it goes to stage n % kStages. Each lane copies its 16
// bytes of K and of V of keys base + u kKeysPerLoad + g (u < kU), zeros for a key at or past k1,
// and reads back only what it copied itself: no barrier, not even __syncwarp. One group of copies
// a step, empty past the last, so that cp_async_wait counts steps.
// kPaged: the keys are in pages (KeyPages). A step's keys are then rows of one page (pages are
// multiples of 16 keys; a step's at most 16 keys start at a multiple of their count). The table
// look-up is a load the copies wait for, so it is made 32 steps at a time: lane l holds the page
// of the warp's step 32 m + l, and step n reads its page from lane n % 32 with a shuffle.
template <typename T, int D, bool kPaged>
struct KeyRing {
    using Lanes = KeyLanes<D>;
    static constexpr int kU = Lanes::kU;
    // The lane's slot of stage 0's first K load; the others are 32 apart.
    uint4* slot = shared + threadIdx.x / 32 * kStages * 2 * kU * 32 + threadIdx.x % 32;
    Lanes me;
    HeadRows<T, D> K, V;        // the K/V head's rows
    int k1;                     // the split's end
    int n = 0;                  // kPaged: the warp's next step, and where the lane's step starts
    unsigned long long held = 0;  // (in_pages: K's and V's alike)
    unsigned long long policy;  // the copies' L2 policy (cp_async_16)

    __device__ KeyRing(const T* K_, const T* V_, const KeyPages& pages, const SplitBlock& blk,
                       int kv_heads, int kv_len)
        : K(K_, pages, blk.b, blk.kvh, kv_heads, kv_len),
          V(V_, pages, blk.b, blk.kvh, kv_heads, kv_len), k1(blk.k1) {}
    // The ring's first kStages - 1 steps, from the warp's first key on, which it returns.
    __device__ int start(const Lanes& me_, const SplitBlock& blk, bool evict_first) {
        me = me_;
        policy = l2_policy(evict_first);
        const int first = blk.k0 + me.warp * Lanes::kWarpKeys;
#pragma unroll
        for (int st = 0; st < kStages - 1; ++st) copy(first + st * Lanes::kStep, st);
        return first;
    }
    // The step at `base` into `stage`.
    __device__ void copy(int base, int stage) {
        if (base < k1) {
            const T* Kr = K.head + size_t(base) * D;   // key base's rows
            const T* Vr = V.head + size_t(base) * D;
            if constexpr (kPaged) {                    // (all of the step's keys in one page)
                if (n % 32 == 0) {  // where the warp's next 32 steps start, a lane each
                    const int key = base + me.lane * Lanes::kStep;
                    held = key < k1 ? K.in_pages(key) : 0;
                }
                const unsigned long long at = __shfl_sync(0xffffffffu, held, n % 32);
                Kr = K.head + at, Vr = V.head + at;
                n++;
            }
#pragma unroll
            for (int u = 0; u < kU; ++u) {
                const int j = base + u * Lanes::kKeysPerLoad + me.g;
                const size_t from = size_t(j < k1 ? j - base : 0) * D + me.c0;
                cp_async_16(slot + (stage * 2 * kU + u) * 32, Kr + from, j < k1,
                                         policy);
                cp_async_16(slot + (stage * 2 * kU + kU + u) * 32, Vr + from, j < k1,
                                         policy);
            }
        }
        cp_async_commit();
    }
    // The lane's K and V of `stage`, once its copies of that step have landed.
    __device__ void read(int stage, uint4 (&Kraw)[kU], uint4 (&Vraw)[kU]) const {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            Kraw[u] = slot[(stage * 2 * kU + u) * 32];
            Vraw[u] = slot[(stage * 2 * kU + kU + u) * 32];
        }
    }
};

// Lines 4-5 for the block's rows, a lane's share: q, its slice of Q (8 columns, fp32, times
// scale log2(e), so that the scores are in log2 units and exp is exp2); O = 0 (o, its slice),
// m = -inf, l = 0 (its group's running max and sum, log2 units); row r's keys, [begin[r],
// end[r]): the split's, cut to the row's own (the policy's row_keys: under the causal mask up to
// query i's last key); its query i[r] and its policy rp[r] (its head's: ALiBi's slope), in the
// scores' log2 units. Rows past R are zeros, computed and never written.
template <typename T, int D, int kR, typename Policy>
__device__ __forceinline__ void load_rows(float (&q)[kR][8], float (&o)[kR][8], float (&m)[kR],
                                          float (&l)[kR], int (&begin)[kR], int (&end)[kR],
                                          int (&i)[kR], Policy (&rp)[kR], const KeyLanes<D>& me,
                                          const T* Q, const SplitBlock& blk, int q_len,
                                          const Policy& pol, float scale_log2) {
#pragma unroll
    for (int r = 0; r < kR; ++r) {
        m[r] = -INFINITY, l[r] = 0.f, begin[r] = blk.k0, end[r] = blk.k1, i[r] = 0, rp[r] = pol;
#pragma unroll
        for (int e = 0; e < 8; ++e) q[r][e] = 0.f, o[r][e] = 0.f;
        if (r < blk.R) {
            eight_floats<T>(load16(Q + (blk.first_row + r) * D + me.c0), q[r]);
#pragma unroll
            for (int e = 0; e < 8; ++e) q[r][e] *= scale_log2;
            i[r] = (blk.row0 + r) % q_len;
            rp[r] = pol.for_head((blk.first_row + r) / q_len);
            const Span seen = pol.row_keys(i[r]);
            begin[r] = max(blk.k0, seen.first), end[r] = min(blk.k1, seen.last + 1);
        }
    }
}

// Line 8 for a step's keys j = base + u kKeysPerLoad + g: S[u][r] = q_r . k_j, a lane's 8
// products (K widened into Kf) summed over the key's lanes by a butterfly of shuffles (every lane
// of the key ends with the same sum, bit for bit), changed by the row's policy, then the mask:
// -inf where row r does not count key j (the left side tested only where a row's keys can start
// past the split's first: Policy::kLeftEdge, a window).
template <typename T, int D, int kR, typename Policy>
__device__ __forceinline__ void scores(float (&S)[kUnroll][kR], float (&Kf)[8],
                                       const uint4 (&Kraw)[kUnroll], const float (&q)[kR][8],
                                       const int (&begin)[kR], const int (&end)[kR],
                                       const int (&i)[kR], const Policy (&rp)[kR],
                                       const KeyLanes<D>& me, int base) {
    using Lanes = KeyLanes<D>;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int j = base + u * Lanes::kKeysPerLoad + me.g;
        eight_floats<T>(Kraw[u], Kf);
#pragma unroll
        for (int r = 0; r < kR; ++r) {
            float dot = 0.f;
#pragma unroll
            for (int e = 0; e < 8; ++e) dot += q[r][e] * Kf[e];
#pragma unroll
            for (int off = Lanes::kLanesPerKey / 2; off > 0; off /= 2)
                dot += __shfl_xor_sync(0xffffffffu, dot, off);
            float du;  // (a derivative only the backward needs)
            const bool seen = j < end[r] && (!Policy::kLeftEdge || j >= begin[r]);
            const float s = rp[r].at(i[r], base + me.g).score(dot, -u * Lanes::kKeysPerLoad, du);
            S[u][r] = seen ? s : -INFINITY;            // (at: the same for every u, taken once)
        }
    }
}

// Lines 9-10's online softmax, once for the kU keys of the lane's group: m_new = max(m, S),
// P~ = exp2(S - m_new), l = exp2(m - m_new) l + rowsum P~, O rescaled by the same. S becomes P~.
template <int kR>
__device__ __forceinline__ void online_softmax(float (&S)[kUnroll][kR], float (&o)[kR][8],
                                               float (&m)[kR], float (&l)[kR]) {
#pragma unroll
    for (int r = 0; r < kR; ++r) {
        float m_new = m[r];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) m_new = fmaxf(m_new, S[u][r]);
        // A row that has seen no key yet has m_new = -inf: subtract 0 instead, so that
        // exp2(-inf - -inf) = NaN never happens (P~ = exp2(-inf) = 0, alpha = 0 * 0).
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = exp2_ftz(m[r] - m_use);
        l[r] *= alpha;
#pragma unroll
        for (int e = 0; e < 8; ++e) o[r][e] *= alpha;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            S[u][r] = exp2_ftz(S[u][r] - m_use);  // S becomes P~
            l[r] += S[u][r];
        }
        m[r] = m_new;
    }
}

// Line 10's O += P~ V_j: the lane's 8 columns (V widened into Vf), each row, each key.
template <typename T, int kR>
__device__ __forceinline__ void add_PV(float (&o)[kR][8], float (&Vf)[8],
                                       const float (&P)[kUnroll][kR],
                                       const uint4 (&Vraw)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        eight_floats<T>(Vraw[u], Vf);
#pragma unroll
        for (int r = 0; r < kR; ++r)
#pragma unroll
            for (int e = 0; e < 8; ++e) o[r][e] += P[u][r] * Vf[e];
    }
}

// The warp's kKeysPerLoad groups merge, pairwise by shuffles (NOTES chapter 4's identity with
// two parts): m = max(m_a, m_b), l = exp2(m_a - m) l_a + exp2(m_b - m) l_b, and O alike.
template <int D, int kR>
__device__ __forceinline__ void merge_groups(float (&o)[kR][8], float (&m)[kR], float (&l)[kR]) {
#pragma unroll
    for (int off = KeyLanes<D>::kLanesPerKey; off < 32; off *= 2) {
#pragma unroll
        for (int r = 0; r < kR; ++r) {
            const float m_b = __shfl_xor_sync(0xffffffffu, m[r], off);
            const float l_b = __shfl_xor_sync(0xffffffffu, l[r], off);
            const float m_new = fmaxf(m[r], m_b);
            const float m_use = m_new == -INFINITY ? 0.f : m_new;  // both empty: weights 0
            const float a = exp2_ftz(m[r] - m_use), w = exp2_ftz(m_b - m_use);
            l[r] = a * l[r] + w * l_b;
#pragma unroll
            for (int e = 0; e < 8; ++e)
                o[r][e] = a * o[r][e] + w * __shfl_xor_sync(0xffffffffu, o[r][e], off);
            m[r] = m_new;
        }
    }
}

// Lines 12-13 over this split's keys. Each warp's (m, l, O), from its first group's lanes, goes to
// shared memory over the rings, once every warp is done with its ring (no copy is in flight: the
// last groups are empty): [kSplitWarps][kR][D] O, then [kSplitWarps][kR] m and l. The warps then
// merge, in warp order, and the split's results are written: O_s = O / l (0 where the rows saw no
// key of this split: l = 0), L_s = (m + log2 l) ln 2 in natural log (-inf there). A split alone
// (alone: splits = 1) writes them as O, in T, and L: the merge would weigh it by exp(0) = 1.
template <typename T, int D, int kR>
__device__ __forceinline__ void write_split(const float (&o)[kR][8], const float (&m)[kR],
                                            const float (&l)[kR], const KeyLanes<D>& me,
                                            const SplitBlock& blk, float* Os, float* Ls, T* O,
                                            float* L, bool alone) {
    float* Ow = reinterpret_cast<float*>(shared);
    float* mw = Ow + kSplitWarps * kR * D;
    float* lw = mw + kSplitWarps * kR;
    cp_async_wait<0>();
    __syncthreads();
    if (me.lane < KeyLanes<D>::kLanesPerKey) {
#pragma unroll
        for (int r = 0; r < kR; ++r) {
            float* dst = Ow + (me.warp * kR + r) * D + me.c0;
            *reinterpret_cast<float4*>(dst) = make_float4(o[r][0], o[r][1], o[r][2], o[r][3]);
            *reinterpret_cast<float4*>(dst + 4) = make_float4(o[r][4], o[r][5], o[r][6], o[r][7]);
            if (me.lane == 0) mw[me.warp * kR + r] = m[r], lw[me.warp * kR + r] = l[r];
        }
    }
    __syncthreads();
    for (int x = threadIdx.x; x < blk.R * D / 2; x += kSplitThreads) {  // columns c, c + 1
        const int r = x / (D / 2), c = 2 * (x % (D / 2));
        float m_all = -INFINITY;
#pragma unroll
        for (int w = 0; w < kSplitWarps; ++w) m_all = fmaxf(m_all, mw[w * kR + r]);
        const float m_use = m_all == -INFINITY ? 0.f : m_all;
        float l_all = 0.f, o0 = 0.f, o1 = 0.f;
#pragma unroll
        for (int w = 0; w < kSplitWarps; ++w) {
            const float a = exp2_ftz(mw[w * kR + r] - m_use);
            l_all += a * lw[w * kR + r];
            o0 += a * Ow[(w * kR + r) * D + c], o1 += a * Ow[(w * kR + r) * D + c + 1];
        }
        const float v0 = l_all > 0.f ? o0 / l_all : 0.f, v1 = l_all > 0.f ? o1 / l_all : 0.f;
        const float Lv = l_all > 0.f ? (m_all + log2f(l_all)) * kLn2 : -INFINITY;
        const size_t row = blk.first_row + r;
        if (alone) {
            store_pair(O + row * D + c, v0, v1);
            if (c == 0) L[row] = Lv;
        } else {
            const size_t out = size_t(blk.split) * blk.rows_total + row;
            *reinterpret_cast<float2*>(Os + out * D + c) = make_float2(v0, v1);
            if (c == 0) Ls[out] = Lv;
        }
    }
}

// The merge of the splits (NOTES chapter 4's identity), by the split block that ends last, for
// its rows: a warp a row. L = Lmax + log sum_s exp(L_s - Lmax) and O = sum_s exp(L_s - L) O_s,
// O rounded to T once. Subtracting Lmax keeps every exp <= 1; a row with every L_s = -inf saw no
// key at all: O = 0, L = -inf. The splits are dealt out to the lanes (lane k takes s = k, k + 32,
// ...): each lane reads its own L_s, and the warp agrees on Lmax and the sum by shuffles. Then O,
// kBatch splits at a time: lane k computes split s0 + k's weight, and every lane, for its D / 32
// columns, adds the splits' w O_s in the order s = 0, 1, ..., each weight passed along by a
// shuffle. Same order on every call, whichever block merges: deterministic. The other blocks'
// O_s and L_s are read from L2 (__ldcg: this SM's L1 may never hold a line another SM wrote).
template <typename T, int D, int kBatch>
__device__ __forceinline__ void merge_row(const float* Os, const float* Ls, T* O, float* L,
                                          size_t rows, int splits, size_t row, int lane) {
    constexpr int kCols = D / 32;  // a lane's columns of the row: 2, 4, 8 at d = 64, 128, 256
    const int c0 = lane * kCols;
    // kBatch splits' O_s; past the last split the last one's O_s (finite) is read again and
    // weighs 0, so that no load waits on a branch.
    float2 v[kBatch][kCols / 2];
    auto load = [&](int s0) {
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
            const float* os = Os + (size_t(min(s0 + k, splits - 1)) * rows + row) * D + c0;
#pragma unroll
            for (int e = 0; e < kCols / 2; ++e)
                v[k][e] = __ldcg(reinterpret_cast<const float2*>(os) + e);
        }
    };
    const auto Ls_at = [&](int s) { return __ldcg(Ls + size_t(s) * rows + row); };
    load(0);
    const float L_lane = lane < splits ? Ls_at(lane) : -INFINITY;
    float Lmax = L_lane;
    for (int s = lane + 32; s < splits; s += 32) Lmax = fmaxf(Lmax, Ls_at(s));
    for (int off = 16; off > 0; off /= 2) Lmax = fmaxf(Lmax, __shfl_xor_sync(~0u, Lmax, off));
    float o[kCols] = {};
    float Lrow = -INFINITY;
    if (Lmax != -INFINITY) {
        float sum = expf(L_lane - Lmax);
        for (int s = lane + 32; s < splits; s += 32) sum += expf(Ls_at(s) - Lmax);
        for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(~0u, sum, off);
        Lrow = Lmax + logf(sum);  // the butterfly gives every lane the same bits
        for (int s0 = 0; s0 < splits; s0 += kBatch) {
            if (s0 > 0) load(s0);
            // This lane's split's weight (lane < kBatch: the batch's); exp(-inf) = 0 for a split
            // with no key.
            const int s = s0 + lane;
            const float Ls_s = s0 == 0 ? L_lane : s < splits ? Ls_at(s) : 0.f;
            const float w_lane = s < splits ? expf(Ls_s - Lrow) : 0.f;
#pragma unroll
            for (int k = 0; k < kBatch; ++k) {
                const float w = __shfl_sync(~0u, w_lane, k);
#pragma unroll
                for (int e = 0; e < kCols / 2; ++e)
                    o[2 * e] += w * v[k][e].x, o[2 * e + 1] += w * v[k][e].y;
            }
        }
    }
#pragma unroll
    for (int e = 0; e < kCols; e += 2) store_pair(O + row * D + c0 + e, o[e], o[e + 1]);
    if (lane == 0) L[row] = Lrow;
}

// A split block's arrival at its (batch, K/V head, chunk)'s counter, after its O_s and L_s are
// written: true for the last of the splits, which then merges them. The counter holds (epoch <<
// 24) | arrivals, and the last arrival leaves it 0. A counter of another epoch (another call, or
// memory the scratch pool hands out as some earlier kernel left it) counts as 0 arrivals: so no
// memset, and no second launch. Each call has its own epoch (the launcher's, 40 bits, from a
// random start) and its own scratch (concurrent calls too: each stream's pool allocation). The
// first arrival puts the epoch in with a compare-and-swap; every later one adds 1 (a single
// atomic: splits that end together do not retry one another's swaps).
__device__ __forceinline__ bool arrive_last(unsigned long long* counter, unsigned long long epoch,
                                            int splits) {
    unsigned long long seen = *reinterpret_cast<volatile unsigned long long*>(counter);
    while (seen >> 24 != epoch) {  // no arrival yet: this one would be the first
        const unsigned long long old = seen;
        seen = atomicCAS(counter, old, splits == 1 ? 0 : epoch << 24 | 1);
        if (seen == old) return splits == 1;
    }
    const bool last = (atomicAdd(counter, 1ull) & 0xffffff) + 1 == unsigned(splits);
    if (last) atomicExch(counter, 0ull);  // every split has arrived: the rest, for the next call
    return last;
}

// The kernel: Algorithm 1 over one split's keys, part by part, then the merge of all the splits
// by the last to end. Policy: the mask and the score (lib/mask_policy.cuh: PlainPolicy, or
// chapter 5's ModelPolicy), in the scores' log2 units (in_units(scale_log2)), made the block's
// sequence's (its keys: pages.keys); the keys split are those it lets the rows see. pages: where
// the keys are (KeyPages; kPaged: in pages). counters: one a (batch, K/V head, chunk), with this
// call's epoch (arrive_last).
template <typename T, int D, int kR, typename Policy, bool kPaged>
__global__ void __launch_bounds__(kSplitThreads, decode_blocks_per_sm(kR))
flash_decode_split_kernel(const T* __restrict__ Q, const T* __restrict__ K,
                          const T* __restrict__ V, float* __restrict__ Os,
                          float* __restrict__ Ls, int heads, int kv_heads, int q_len, int kv_len,
                          const Policy policy, const KeyPages pages, int splits, int chunks,
                          int tiles_per_split, float scale_log2, T* __restrict__ O,
                          float* __restrict__ L, unsigned long long* counters,
                          unsigned long long epoch, bool evict_first) {
    constexpr int kU = kUnroll, kStep = KeyLanes<D>::kStep;
    SplitBlock blk = split_block<D>(heads, kv_heads, q_len, kv_len, splits, chunks);
    const Policy pol = policy.for_sequence(q_len, pages.keys(blk.b, kv_len));
    split_keys<D>(blk, pol.keys(0, q_len), tiles_per_split);
    const KeyLanes<D> me;  // the lane's warp, key row g and columns c0
    // Line 7's first steps on their way (the lane's slots of its warp's ring), then lines 4-5:
    // the lane's share of the rows.
    KeyRing<T, D, kPaged> ring(K, V, pages, blk, kv_heads, kv_len);
    const int first = ring.start(me, blk, evict_first);
    float q[kR][8], o[kR][8], m[kR], l[kR];
    int begin[kR], end[kR], i[kR];
    Policy rp[kR];
    load_rows<T, D>(q, o, m, l, begin, end, i, rp, me, Q, blk, q_len, pol, scale_log2);
    int stage = 0;  // step n's stage, n % kStages: advanced in one place, below
    for (int base = first; base < blk.k1; base += kStep) {  // line 6: the warp's steps
        // This lane's copies of the step have landed (at most kStages - 2 younger groups in
        // flight): read them, then refill the stage the previous step used with the step
        // kStages - 1 ahead (line 7), so that memory works while the warp computes.
        cp_async_wait<kStages - 2>();
        uint4 Kraw[kU], Vraw[kU];
        ring.read(stage, Kraw, Vraw);
        ring.copy(base + (kStages - 1) * kStep, stage == 0 ? kStages - 1 : stage - 1);
        stage = stage == kStages - 1 ? 0 : stage + 1;
        float S[kU][kR], Kf[8], Vf[8];
        scores<T, D>(S, Kf, Kraw, q, begin, end, i, rp, me, base);  // line 8
        online_softmax(S, o, m, l);                   // lines 9-10
        add_PV<T>(o, Vf, S, Vraw);                    // line 10
    }
    merge_groups<D>(o, m, l);                  // the warp's groups, then its warps, and
    write_split<T, D>(o, m, l, me, blk, Os, Ls, O, L, splits == 1);  // lines 12-13: O_s, L_s
    if (splits == 1) return;                   // (alone: its O and L are written)
    // The splits' merge, by the last of them to arrive: every thread's O_s and L_s before the
    // arrival (fence, barrier), the arrival by one thread, its answer to all through shared
    // memory (write_split is done with it), then a fence before reading the other splits'.
    __threadfence();
    __syncthreads();
    int* last = reinterpret_cast<int*>(shared);
    if (threadIdx.x == 0) {
        const size_t unit = (size_t(blk.b) * kv_heads + blk.kvh) * chunks + blk.row0 / kRows;
        *last = arrive_last(counters + unit, epoch, splits);
    }
    __syncthreads();
    if (!*last) return;
    __threadfence();
    for (int r = me.warp; r < blk.R; r += kSplitWarps)  // a warp a row, 8 splits a batch
        merge_row<T, D, 8>(Os, Ls, O, L, blk.rows_total, splits, blk.first_row + r, me.lane);
}

// ---------------------------------------------------------------------------------------------
// The append (a K/V cache, flash.h's KVCache): the new keys' K and V rows, k_new and v_new
// ([batch][kv_heads][added][D]), into the cache at each sequence's end, rows lens[b] .. lens[b] +
// added - 1, before the split kernel reads them (the same stream). A thread a 16-byte piece.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
flash_decode_append_kernel(const T* __restrict__ k_new, const T* __restrict__ v_new, T* K, T* V,
                           const KeyPages pages, int kv_heads, int kv_len, size_t pieces) {
    constexpr int kPieces = D / 8;  // 16-byte pieces a row
    const size_t x = size_t(blockIdx.x) * kThreads + threadIdx.x;
    if (x >= pieces) return;
    const size_t n = x / kPieces;   // row n of k_new: (b, kv head, r)
    const int c = int(x % kPieces) * 8, r = int(n % pages.added);
    const int kvh = int(n / pages.added % kv_heads), b = int(n / pages.added / kv_heads);
    const int j = pages.keys(b, kv_len) - pages.added + r;  // (the length, clamped)
    T* Kj = const_cast<T*>(HeadRows<T, D>(K, pages, b, kvh, kv_heads, kv_len).row(j));
    T* Vj = const_cast<T*>(HeadRows<T, D>(V, pages, b, kvh, kv_heads, kv_len).row(j));
    *reinterpret_cast<uint4*>(Kj + c) = load16(k_new + n * D + c);
    *reinterpret_cast<uint4*>(Vj + c) = load16(v_new + n * D + c);
}

// ---------------------------------------------------------------------------------------------
// Host side.

// The split kernel's counters (arrive_last): one a (batch, K/V head, chunk), 8-byte aligned after
// the partials in the scratch. And each call's epoch: 40 bits, counting on from a random start
// (so that a counter's bits left by some other kernel are no epoch's but by a 2^-40 chance).
unsigned long long* counters_after(float* end) {
    const uintptr_t at = (reinterpret_cast<uintptr_t>(end) + 7) / 8 * 8;
    return reinterpret_cast<unsigned long long*>(at);
}
unsigned long long next_epoch() {
    static std::atomic<unsigned long long> epoch{std::random_device{}() |
                                                 (unsigned long long)std::random_device{}() << 32};
    for (;;) {
        const unsigned long long e = epoch.fetch_add(1) & ((1ull << 40) - 1);
        if (e != 0) return e;  // (0 is every counter's rest)
    }
}

// The split kernel's rows a block (kR = 4 or 8, see decode_blocks_per_sm) for this shape.
int rows_kernel_for(const AttentionShape& s) {
    const int rows = std::min(kRows, flash_kv_group(s) * s.q_len);
    return rows <= 4 ? 4 : 8;
}
// Shared memory of a split block at this head dim (the 8-row kernel's, the larger, when kR is 0).
size_t shared_bytes_for(int head_dim, int kR = 8) {
    size_t bytes = 0;
    dispatch_head_dim<kFlashDecodeHeadDims>(head_dim, [&](auto dim) {
        bytes = decode_shared_bytes(decltype(dim)::value, kR);
    });
    return bytes;
}
int bc_for(int head_dim) { return decode_Bc(head_dim); }

int chunks_of(const AttentionShape& s) {
    const int group_rows = flash_kv_group(s) * s.q_len;
    return (group_rows + kRows - 1) / kRows;
}

void require_decode_shape(const AttentionShape& s, const char* fn) {
    validate_shape(s, kFlashDecodeHeadDims, 2);
    require(s.q_len <= kFlashDecodeMaxQLen,
            std::string(fn) + ": shape.q_len = " + std::to_string(s.q_len) + " is not supported " +
                "by the decode kernel; allowed values: 1 to " +
                std::to_string(kFlashDecodeMaxQLen) + " (longer queries: flash_forward_fp16 / _bf16)");
}

void require_decode_device(const cudaDeviceProp& prop, int head_dim, const char* fn) {
    if (prop.major < 8)
        throw std::runtime_error(std::string(fn) + " needs a GPU of compute capability 8.0 or " +
                                 "newer; " + prop.name + " is " +
                                 std::to_string(prop.major) + "." + std::to_string(prop.minor));
    if (shared_bytes_for(head_dim) > prop.sharedMemPerBlockOptin)
        throw std::runtime_error(std::string(fn) + ": device " + prop.name + " has too little " +
                                 "shared memory for the decode block at head_dim " +
                                 std::to_string(head_dim));
}

// Blocks of the split kernel, checked against gridDim.x's limit (before anything is launched).
int split_blocks(const AttentionShape& s, int splits) {
    const long long units = (long long)s.batch * flash_kv_heads(s) * chunks_of(s);
    require(units * splits <= INT_MAX,
            "splits = " + std::to_string(splits) + " is invalid; allowed values: 1 to " +
                std::to_string(INT_MAX / units) + " for " + "this shape (the grid's limit)");
    return int(units * splits);
}

// The blocks of one wave: the split kernel's blocks resident at once on the device (2 or 1 an SM,
// as the registers of the shape's kR and the shared memory of its rings allow).
long long decode_wave(const cudaDeviceProp& prop, const AttentionShape& s) {
    const int kR = rows_kernel_for(s);
    const size_t per_block = shared_bytes_for(s.head_dim, kR) + prop.reservedSharedMemPerBlock;
    const int resident = std::max<int>(
        1, std::min<int>(decode_blocks_per_sm(kR), int(prop.sharedMemPerMultiprocessor / per_block)));
    return (long long)prop.multiProcessorCount * resident;
}

// A K/V cache's sequences' keys after the append, as the host read them (none: kv_len each).
struct SequenceKeys {
    int longest = 0, mean = 0;
    bool read = true;  // false: not read (a graph's capture), the capacity standing in for both
};

// The split rule for sequences of different lengths. Their blocks differ in size (a sequence's
// last split is short; a short sequence's later splits see no key and end at once), and a free
// block slot (decode_wave's) takes the next block, so the call ends up to about one split after
// the slots' mean. Smaller splits shorten that tail but add blocks, each with a fixed cost (its
// Q, its first loads' latency, its merge) of about kBlockCostTiles tiles of streaming, measured.
// With `share` a slot's part of all the tiles, tail + cost = p + kBlockCostTiles share / p is
// least at p = sqrt(kBlockCostTiles share). So a split's tiles: the mean sequence's as
// flash_decode_choose_splits cuts it, at most p, at least kMinTilesPerSplit; then as many splits
// as the longest sequence needs. Equal lengths: flash_decode_choose_splits' own count (its blocks
// are alike: more would only add their cost). differ: whether the lengths may differ (they were
// read and do, or a graph's capture could not read them and the batch has more than one).
constexpr int kBlockCostTiles = 4;  // (lab/chapter4.md, part 6: measured at batch 8 and 32)
// Under a graph's capture, a block's cost counts twice: the lengths are unknown, so the cap
// trades a full batch's time against a ragged one's, and twice halves the first's cost and keeps
// the second's gain (lab/chapter4.md, part 6). -DFLASH_DECODE_CAPTURE_COST=K to try others.
#ifndef FLASH_DECODE_CAPTURE_COST
#define FLASH_DECODE_CAPTURE_COST 2
#endif
int ragged_splits(const cudaDeviceProp& prop, const AttentionShape& longest,
                  const AttentionShape& mean, bool differ, double cost_factor = 1) {
    const int Bc = bc_for(longest.head_dim), at_mean = flash_decode_choose_splits(prop, mean);
    const long long tiles = (longest.kv_len + Bc - 1) / Bc;
    const long long mean_tiles = (mean.kv_len + Bc - 1) / Bc;
    const long long units = (long long)longest.batch * flash_kv_heads(longest) * chunks_of(longest);
    long long per_split = (mean_tiles + at_mean - 1) / at_mean;
    if (differ) {
        const double share = double(units * mean_tiles) / double(decode_wave(prop, longest));
        const long long p = std::llround(std::sqrt(kBlockCostTiles * share * cost_factor));
        per_split = std::min(per_split, std::max<long long>(kMinTilesPerSplit, p));
    }
    return int((tiles + per_split - 1) / per_split);
}

// Host memory for the K/V cache's lengths and table (check_kvcache): pinned, so that both copies
// go in one wait for the stream; one buffer a host thread, kept, and grown when a call needs more.
int* pinned_ints(size_t n) {
    struct Buffer {
        int* p = nullptr;
        size_t n = 0;
        ~Buffer() { cudaFreeHost(p); }  // (at the thread's end: its error, if any, not checked)
    };
    thread_local Buffer buffer;
    if (buffer.n < n) {
        FLASH_CUDA_CHECK(cudaFreeHost(buffer.p));
        buffer.p = nullptr, buffer.n = 0;
        FLASH_CUDA_CHECK(cudaMallocHost(&buffer.p, n * sizeof(int)));
        buffer.n = n;
    }
    return buffer.p;
}

// The keys the longest sequence splits (longest: its keys), as the kernel's split_keys takes
// them: those the policy lets any row see, from a whole tile (a window's first key rounded down),
// as a shape of that many keys for the split rule. Every other sequence has as many or fewer.
template <typename Policy>
AttentionShape key_span(const AttentionShape& s, const Policy& pol, int longest) {
    const KeySpan keys = pol.for_sequence(s.q_len, longest).keys(0, s.q_len);
    const int Bc = bc_for(s.head_dim), key0 = keys.begin / Bc * Bc;
    AttentionShape span = s;
    span.kv_len = std::max(1, keys.end - key0);  // (no key: one empty tile, for the rule)
    return span;
}

// pages: where the keys are (KeyPages; contiguous by default), keys: the sequences' lengths
// (none: kv_len each).
template <typename T, typename Policy>
void decode_launch(const cudaDeviceProp& prop, const T* Q, const T* K, const T* V, T* O, float* L,
                   const AttentionShape& s, const Policy& pol, float scale_log2, int splits,
                   cudaStream_t stream, const KeyPages& pages = {}, const SequenceKeys& keys = {}) {
    const AttentionShape span = key_span(s, pol, keys.longest > 0 ? keys.longest : s.kv_len);
    if (splits == 0)
        splits = keys.mean > 0
                     ? ragged_splits(prop, span, key_span(s, pol, keys.mean),
                                     keys.longest > keys.mean || (!keys.read && s.batch > 1),
                                     keys.read ? 1.0 : FLASH_DECODE_CAPTURE_COST)
                     : flash_decode_choose_splits(prop, span);
    const int blocks = split_blocks(s, splits);
    const int Bc = bc_for(s.head_dim);
    const int tiles = (span.kv_len + Bc - 1) / Bc;
    // Every split a whole number of tiles; with more splits than tiles, the last ones get none.
    const int tiles_per_split = (tiles + splits - 1) / splits;
    const size_t rows = l_elems(s);
    // The L2 policy of K and V's copies (cp_async_16): evict-first where they are at most 4 L2s'
    // worth of bytes, where sparing the call the write-back of the dirty lines that earlier
    // kernels left in the L2 is worth most; evict-unchanged beyond, where evict-first costs more
    // than it spares. The same rule for a paged cache.
    const bool evict_first = 2 * kv_elems(span) * sizeof(T) <= 4 * size_t(prop.l2CacheSize);
    const unsigned long long epoch = next_epoch();
    with_scratch(flash_decode_scratch_bytes(s, splits), stream, [&](void* scratch) {
        float* Os = static_cast<float*>(scratch);
        float* Ls = Os + size_t(splits) * rows * s.head_dim;
        unsigned long long* counters = counters_after(Ls + size_t(splits) * rows);
        cudaError_t err = cudaSuccess;
        dispatch_head_dim<kFlashDecodeHeadDims>(s.head_dim, [&](auto dim) {
            constexpr int D = decltype(dim)::value;
            auto run_split = [&](auto kernel, size_t shared) {
                allow_shared(kernel, shared);
                kernel<<<blocks, kSplitThreads, shared, stream>>>(
                    Q, K, V, Os, Ls, s.heads, flash_kv_heads(s), s.q_len, s.kv_len,
                    pol.in_units(scale_log2), pages, splits, chunks_of(s), tiles_per_split,
                    scale_log2, O, L, counters, epoch, evict_first);
            };
            auto run_rows = [&](auto rows) {
                constexpr int kR = decltype(rows)::value;
                const size_t shared = decode_shared_bytes(D, kR);
                if (pages.table)
                    run_split(flash_decode_split_kernel<T, D, kR, Policy, true>, shared);
                else
                    run_split(flash_decode_split_kernel<T, D, kR, Policy, false>, shared);
            };
            if (rows_kernel_for(s) == 4)
                run_rows(std::integral_constant<int, 4>{});
            else
                run_rows(std::integral_constant<int, 8>{});
            err = cudaGetLastError();
        });
        return err;
    });
}

// Every check (shape, splits, pointers, device) before anything is launched, then the launch.
// splits: the caller's (checked), or none for flash_decode_choose_splits'.
template <typename T>
void decode_call(const char* fn, const T* Q, const T* K, const T* V, T* O, float* L,
                 const AttentionShape& s, std::optional<int> splits, cudaStream_t stream) {
    require_decode_shape(s, fn);
    if (splits)
        require(*splits >= 1 && *splits <= kMaxSplits,
                std::string(fn) + ": splits = " + std::to_string(*splits) +
                    " is invalid; allowed values: 1 to " + std::to_string(kMaxSplits));
    validate_forward_pointers(fn, Q, K, V, O, L, s);
    const cudaDeviceProp prop = flash_device_props();
    require_decode_device(prop, s.head_dim, fn);
    if (splits) split_blocks(s, *splits);  // the grid's limit, refused before the scratch
    flash_decode_launch(prop, Q, K, V, O, L, s, splits.value_or(0), stream);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The split rule (flash.h): one wave of blocks (the blocks resident at once, 2 or 1 an SM as the
// registers of the kernel's kR and the shared memory of its rings allow), and never fewer blocks
// than SMs; each split whole tiles and at least kMinTilesPerSplit of them (so that a split's fixed
// costs, its Q, its partial O_s written and read again by the merge, stay small beside its K
// and V), at least 1. Not more waves: each block pays its fixed costs (its Q, its first loads'
// latency, the merge of its warps) again, and with fewer keys each hides them less.
int flash_decode_choose_splits(const cudaDeviceProp& prop, const AttentionShape& s) {
    const long long wave = decode_wave(prop, s);
    const long long units = (long long)s.batch * flash_kv_heads(s) * chunks_of(s);
    const int Bc = bc_for(s.head_dim);
    const long long tiles = (s.kv_len + Bc - 1) / Bc;
    const long long most = std::max<long long>(1, tiles / kMinTilesPerSplit);
    const long long fill = std::max(wave / units, (prop.multiProcessorCount + units - 1) / units);
    const long long splits = std::max<long long>(1, std::min(fill, most));
    // The same blocks' work with no split left short: tiles per split, then splits again.
    const long long per_split = (tiles + splits - 1) / splits;
    return int((tiles + per_split - 1) / per_split);
}

size_t flash_decode_scratch_bytes(const AttentionShape& s, int splits) {
    validate_shape(s, kFlashDecodeHeadDims, 2);
    require(splits >= 1 && splits <= kMaxSplits,
            "splits = " + std::to_string(splits) + " is invalid; allowed values: 1 to " +
                std::to_string(kMaxSplits) + " (arrive_last's count)");
    size_t bytes = 0;
    const size_t counters = size_t(s.batch) * flash_kv_heads(s) * chunks_of(s);
    const bool overflow =
        __builtin_mul_overflow(l_elems(s), size_t(s.head_dim + 1), &bytes) ||
        __builtin_mul_overflow(bytes, size_t(splits), &bytes) ||
        __builtin_mul_overflow(bytes, sizeof(float), &bytes) ||
        __builtin_add_overflow(bytes, 8 + counters * 8, &bytes);
    require(!overflow, "splits = " + std::to_string(splits) + " is invalid for this shape: the " +
                           "scratch's size overflows size_t");
    return bytes;
}

// The policy: with_policy's (lib/mask_policy.cuh), the plain one where it serves the options
// (none, or a scale).
template <typename T>
void decode_with_options(const cudaDeviceProp& prop, const T* Q, const T* K, const T* V, T* O,
                         float* L, const AttentionShape& s, int splits, cudaStream_t stream,
                         const AttentionOptions* options, const KeyPages& pages = {},
                         const SequenceKeys& keys = {}) {
    const AttentionOptions o = options ? *options : AttentionOptions{};
    const float scale_log2 = options_scale_log2(s, o);  // the options', or 1/sqrt(d)'s
    with_policy(s, o, [&](auto policy) {
        decode_launch(prop, Q, K, V, O, L, s, policy, scale_log2, splits, stream, pages, keys);
    });
}

// Chapter 4, part 2 (flash.h's KVCache): the checks, in order: the shape, the options, the
// cache's fields, the pointers, the device, then the lengths and the block table's entries in use,
// copied to the host. Returns the sequences' keys after the append.
template <typename T>
SequenceKeys check_kvcache(const char* fn, const T* Q, T* K, T* V, const T* k_new,
                           const T* v_new, T* O, float* L, const AttentionShape& s,
                           const KVCache& c, const AttentionOptions& o, cudaStream_t stream) {
    require_decode_shape(s, fn);
    validate_options(fn, o);
    const std::string call = std::string(fn) + ": ";
    require(!layout_given(o.layout) && !o.packed.cu_seqlens_q && !o.packed.cu_seqlens_k,
            call + "options.layout and options.packed are invalid here; allowed: none (the " +
                "cache's layout is KVCache's)");
    require(c.cache_seqlens != nullptr, call + "cache.cache_seqlens is null; allowed: batch " +
                                            "int32 lengths on the device");
    require(c.new_len >= 0 && c.new_len <= s.kv_len,
            call + "cache.new_len = " + std::to_string(c.new_len) + " is invalid; allowed: 0 " +
                "to shape.kv_len = " + std::to_string(s.kv_len));
    require((k_new && v_new) == (c.new_len > 0) && (k_new == nullptr) == (v_new == nullptr),
            call + "k_new and v_new must both be given where cache.new_len > 0 (it is " +
                std::to_string(c.new_len) + "), and both be null where it is 0");
    const std::string paged = c.block_table ? "" : " without a block table";
    if (!c.block_table) {
        require(c.page_size == 0 && c.pages_per_seq == 0 && c.num_pages == 0,
                call + "cache.page_size, pages_per_seq and num_pages are invalid" + paged +
                    "; allowed: 0");
    } else {
        require(c.page_size >= 16 && c.page_size % 16 == 0,
                call + "cache.page_size = " + std::to_string(c.page_size) + " is invalid; " +
                    "allowed: a multiple of 16 (16, 32, ...)");
        require(c.pages_per_seq >= 1 && c.num_pages >= 1,
                call + "cache.pages_per_seq = " + std::to_string(c.pages_per_seq) +
                    " and cache.num_pages = " + std::to_string(c.num_pages) + "; allowed: 1 or " +
                    "more each");
        require((long long)flash_kv_heads(s) * c.page_size * s.head_dim <= INT_MAX,
                call + "cache.page_size = " + std::to_string(c.page_size) + " is invalid; " +
                    "allowed: kv_heads * page_size * head_dim below 2^31 (a page's elements)");
        require((long long)c.pages_per_seq * c.page_size == s.kv_len,
                call + "shape.kv_len = " + std::to_string(s.kv_len) + " is invalid with a " +
                    "block table; allowed: cache.pages_per_seq * cache.page_size = " +
                    std::to_string((long long)c.pages_per_seq * c.page_size));
    }
    const size_t cache_elems = c.block_table ? size_t(c.num_pages) * flash_kv_heads(s) *
                                                   c.page_size * s.head_dim
                                             : kv_elems(s);
    const size_t new_elems = size_t(s.batch) * flash_kv_heads(s) * c.new_len * s.head_dim;
    if (c.new_len > 0)
        validate_pointers(fn, {input_arg("Q", Q, q_elems(s)), output_arg("K_cache", K, cache_elems),
                               output_arg("V_cache", V, cache_elems),
                               input_arg("k_new", k_new, new_elems),
                               input_arg("v_new", v_new, new_elems), output_arg("O", O, q_elems(s)),
                               output_arg("L", L, l_elems(s))});
    else
        validate_pointers(fn, {input_arg("Q", Q, q_elems(s)),
                               input_arg("K_cache", static_cast<const T*>(K), cache_elems),
                               input_arg("V_cache", static_cast<const T*>(V), cache_elems),
                               output_arg("O", O, q_elems(s)), output_arg("L", L, l_elems(s))});
    require_decode_device(flash_device_props(), s.head_dim, fn);
    // A stream being captured into a CUDA graph cannot be waited for: the lengths and the table
    // are then not read back (the kernels clamp them: KeyPages); for the split rule, every
    // sequence is taken as the cache's capacity, but the lengths as possibly different.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    FLASH_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) return {s.kv_len, s.kv_len, false};
    // The lengths and the table, copied to the host together (one wait for the stream).
    const auto on_device = [&](const int* p, const char* name) {
        require(reinterpret_cast<uintptr_t>(p) % alignof(int) == 0,
                call + "cache." + name + " must be 4-byte aligned");
        cudaPointerAttributes attr;
        FLASH_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
        require(attr.type != cudaMemoryTypeUnregistered,
                call + "cache." + name + " is host memory; pass a device pointer");
    };
    const size_t table_ints = c.block_table ? size_t(s.batch) * c.pages_per_seq : 0;
    on_device(c.cache_seqlens, "cache_seqlens");
    if (c.block_table) on_device(c.block_table, "block_table");
    int* const lens = pinned_ints(size_t(s.batch) + table_ints);
    int* const table = lens + s.batch;
    FLASH_CUDA_CHECK(cudaMemcpyAsync(lens, c.cache_seqlens, size_t(s.batch) * sizeof(int),
                                     cudaMemcpyDefault, stream));
    if (c.block_table)
        FLASH_CUDA_CHECK(cudaMemcpyAsync(table, c.block_table, table_ints * sizeof(int),
                                         cudaMemcpyDefault, stream));
    FLASH_CUDA_CHECK(cudaStreamSynchronize(stream));
    SequenceKeys keys;
    long long all = 0;
    for (int b = 0; b < s.batch; b++) {
        // (Each message is built only for a refusal: a table's check runs once a page.)
        if (lens[b] < 0 || lens[b] > s.kv_len - c.new_len)
            require(false, call + "cache.cache_seqlens[" + std::to_string(b) + "] = " +
                               std::to_string(lens[b]) + " is invalid; allowed: 0 to " +
                               "shape.kv_len - cache.new_len = " +
                               std::to_string(s.kv_len - c.new_len) +
                               (c.block_table ? " (the block table's " +
                                                    std::to_string(c.pages_per_seq) +
                                                    " pages of " + std::to_string(c.page_size) +
                                                    " keys)"
                                              : std::string()));
        const int n = lens[b] + c.new_len;
        keys.longest = std::max(keys.longest, n);
        all += n;
        for (int page = 0; c.block_table && page * c.page_size < n; page++) {
            const int p = table[size_t(b) * c.pages_per_seq + page];
            if (p < 0 || p >= c.num_pages)
                require(false, call + "cache.block_table[" + std::to_string(b) + "][" +
                                   std::to_string(page) + "] = " + std::to_string(p) +
                                   " is invalid; allowed: 0 to cache.num_pages - 1 = " +
                                   std::to_string(c.num_pages - 1));
        }
    }
    keys.mean = int((all + s.batch - 1) / s.batch);
    return keys;
}

// Every check, then the append (where new_len > 0) and the decode, on the stream.
template <typename T>
void kvcache_call(const char* fn, const T* Q, T* K, T* V, const T* k_new, const T* v_new, T* O,
                  float* L, const AttentionShape& s, const KVCache& c, const AttentionOptions& o,
                  cudaStream_t stream) {
    const SequenceKeys keys = check_kvcache(fn, Q, K, V, k_new, v_new, O, L, s, c, o, stream);
    KeyPages pages;
    pages.lens = c.cache_seqlens, pages.table = c.block_table, pages.added = c.new_len;
    pages.page_size = c.page_size, pages.pages_per_seq = c.pages_per_seq;
    pages.num_pages = c.num_pages;
    if (c.new_len > 0)
        dispatch_head_dim<kFlashDecodeHeadDims>(s.head_dim, [&](auto dim) {
            constexpr int D = decltype(dim)::value;
            const size_t pieces = size_t(s.batch) * flash_kv_heads(s) * c.new_len * (D / 8);
            flash_decode_append_kernel<T, D><<<unsigned((pieces + kThreads - 1) / kThreads),
                                                kThreads, 0, stream>>>(
                k_new, v_new, K, V, pages, flash_kv_heads(s), s.kv_len, pieces);
            FLASH_CUDA_CHECK(cudaGetLastError());
        });
    decode_with_options(flash_device_props(), Q, static_cast<const T*>(K),
                        static_cast<const T*>(V), O, L, s, 0, stream, &o, pages, keys);
}
void flash_decode_launch(const cudaDeviceProp& prop, const __half* Q, const __half* K,
                         const __half* V, __half* O, float* L, const AttentionShape& s,
                         int splits, cudaStream_t stream, const AttentionOptions* options) {
    decode_with_options(prop, Q, K, V, O, L, s, splits, stream, options);
}
void flash_decode_launch(const cudaDeviceProp& prop, const __nv_bfloat16* Q,
                         const __nv_bfloat16* K, const __nv_bfloat16* V, __nv_bfloat16* O,
                         float* L, const AttentionShape& s, int splits, cudaStream_t stream,
                         const AttentionOptions* options) {
    decode_with_options(prop, Q, K, V, O, L, s, splits, stream, options);
}

void flash_decode_kvcache_fp16(const __half* Q, __half* K_cache, __half* V_cache,
                               const __half* k_new, const __half* v_new, __half* O, float* L,
                               const AttentionShape& shape, const KVCache& cache,
                               const AttentionOptions& options, cudaStream_t stream) {
    kvcache_call("flash_decode_kvcache_fp16", Q, K_cache, V_cache, k_new, v_new, O, L, shape,
                 cache, options, stream);
}
void flash_decode_kvcache_bf16(const __nv_bfloat16* Q, __nv_bfloat16* K_cache,
                               __nv_bfloat16* V_cache, const __nv_bfloat16* k_new,
                               const __nv_bfloat16* v_new, __nv_bfloat16* O, float* L,
                               const AttentionShape& shape, const KVCache& cache,
                               const AttentionOptions& options, cudaStream_t stream) {
    kvcache_call("flash_decode_kvcache_bf16", Q, K_cache, V_cache, k_new, v_new, O, L, shape,
                 cache, options, stream);
}

bool flash_decode_runs(const cudaDeviceProp& prop, const AttentionShape& s) {
    return s.q_len <= kFlashDecodeMaxQLen && head_dim_in(s.head_dim, kFlashDecodeHeadDims) &&
           prop.major >= 8 && shared_bytes_for(s.head_dim) <= prop.sharedMemPerBlockOptin;
}

void flash_decode_fp16(const __half* Q, const __half* K, const __half* V, __half* O, float* L,
                       const AttentionShape& shape, cudaStream_t stream) {
    decode_call("flash_decode_fp16", Q, K, V, O, L, shape, std::nullopt, stream);
}
void flash_decode_bf16(const __nv_bfloat16* Q, const __nv_bfloat16* K, const __nv_bfloat16* V,
                       __nv_bfloat16* O, float* L, const AttentionShape& shape,
                       cudaStream_t stream) {
    decode_call("flash_decode_bf16", Q, K, V, O, L, shape, std::nullopt, stream);
}
void flash_decode_fp16_splits(const __half* Q, const __half* K, const __half* V, __half* O,
                              float* L, const AttentionShape& shape, int splits,
                              cudaStream_t stream) {
    decode_call("flash_decode_fp16_splits", Q, K, V, O, L, shape, splits, stream);
}
void flash_decode_bf16_splits(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                              const __nv_bfloat16* V, __nv_bfloat16* O, float* L,
                              const AttentionShape& shape, int splits, cudaStream_t stream) {
    decode_call("flash_decode_bf16_splits", Q, K, V, O, L, shape, splits, stream);
}
