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
//     and writes a partial result: O_s (normalised by its own l, fp32) and its logsumexp L_s. A
//     second kernel merges the partials through L, exactly (NOTES chapter 4 derives it):
//         L = log sum_s exp(L_s),   O = sum_s exp(L_s - L) O_s,
//     in the order s = 0, 1, ..., so the result is the same bits on every run. A split that sees
//     no key (past kv_len, or masked) has L_s = -inf and weight exp(-inf) = 0.
//
// Decode is memory-bound: each key brings 2 d elements (its K and V rows, 4 d bytes) and costs
// 4 d flops a query row (2 d for q.k, 2 d for p v). At R rows a block that is R flops a byte; an
// H100 moves ~3.3 TB/s and does ~60 Tflop/s of fp32 FMA, 18 flops a byte, so up to R = 8 rows the
// CUDA cores keep up with memory and tensor cores would buy nothing. Hence: no mma here, fp32 all
// the way (S, P and O), and the effort goes into keeping bytes in flight: 16-byte cp.async copies,
// kStages tiles of K and V under way per block, a few blocks an SM.
#include "checks.h"
#include "flash.h"
#include "log2_units.h"

#include <algorithm>
#include <climits>
#include <optional>
#include <string>
#include <type_traits>

// cp.async needs compute capability 8.0; an older target compiles the kernels to a trap, and the
// launcher refuses such GPUs before anything runs (as chapter 2 does).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define DECODE_SM80_ASM(...) __trap()
#pragma nv_diag_suppress 177
#else
#define DECODE_SM80_ASM(...) asm volatile(__VA_ARGS__)
#endif

namespace {

constexpr int kThreads = 128;  // 4 warps a block
constexpr int kWarps = kThreads / 32;
constexpr int kRows = 8;       // query rows a block: group * q_len rows are cut into blocks of 8
// K/V tiles in shared memory: kStages - 1 in flight while one is used. An experiment knob, as
// chapter 2's FLASH_FP16_PAD (make clean all DEFINES=-DFLASH_DECODE_STAGES=2): 2 stages take 70
// KiB a block at d = 128 instead of 110, the split rule (from the shared memory) follows.
#ifndef FLASH_DECODE_STAGES
#define FLASH_DECODE_STAGES 3
#endif
constexpr int kStages = FLASH_DECODE_STAGES;
static_assert(kStages >= 2, "a tile in flight while one is used");
constexpr int kPad = 8;        // elements of padding a shared-memory row (bank conflicts: below)
static_assert(kRows % kWarps == 0, "each warp owns kRows / kWarps rows' softmax statistics");

// Keys a tile: 64 up to d = 128, 32 at d = 256, so a stage (K and V) is 16 to 33 KiB.
__host__ __device__ constexpr int decode_Bc(int D) { return D <= 128 ? 64 : 32; }
// The threads that share one key's dot products (each a slice of d): kThreads / Bc.
__host__ __device__ constexpr int decode_parts(int D) { return kThreads / decode_Bc(D); }

// Shared memory of a block: kStages tiles of K and of V (rows padded), the block's Q rows (fp32,
// pre-scaled), the partial scores S (one slice a part), and a float per row twice (alpha, 1/l).
__host__ __device__ constexpr size_t decode_shared_bytes(int D) {
    return size_t(2) * kStages * decode_Bc(D) * (D + kPad) * 2 +  // K, V tiles (2-byte elements)
           sizeof(float) * (size_t(kRows) * D +                    // Q
                            size_t(decode_parts(D)) * kRows * decode_Bc(D) +  // S parts, then P
                            2 * kRows);                            // alpha, 1/l
}

// Two elements of T as two floats; 8 elements (16 bytes) as eight.
__device__ __forceinline__ float2 float2_of(__half2 h) { return __half22float2(h); }
__device__ __forceinline__ float2 float2_of(__nv_bfloat162 h) { return __bfloat1622float2(h); }
template <typename T>
__device__ __forceinline__ void eight_floats(const T* p, float* f) {
    using T2 = typename std::conditional<std::is_same<T, __half>::value, __half2,
                                         __nv_bfloat162>::type;
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T2* pairs = reinterpret_cast<const T2*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 v = float2_of(pairs[k]);
        f[2 * k] = v.x, f[2 * k + 1] = v.y;
    }
}
template <typename T>
__device__ __forceinline__ void store_pair(T* p, float x, float y) {
    if constexpr (std::is_same<T, __half>::value)
        *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x, y);
    else
        *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}

// Keys [first, first + Bc) of one K/V head (len keys, rows of D) into a shared tile, 16 bytes per
// cp.async; keys at or past len are zero-filled (source size 0): a padding row of V must be 0, not
// garbage, since P = 0 times a NaN is NaN.
template <int D, typename T>
__device__ __forceinline__ void load_tile_async(T* tile, const T* src, int first, int len) {
    constexpr int Bc = decode_Bc(D);
    for (int x = threadIdx.x; x < Bc * D / 8; x += kThreads) {
        const int row = x / (D / 8), col = x % (D / 8) * 8;
        const bool inside = first + row < len;
        const unsigned to = unsigned(__cvta_generic_to_shared(tile + row * (D + kPad) + col));
        DECODE_SM80_ASM("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to),
                        "l"(src + size_t(inside ? first + row : 0) * D + col),
                        "r"(inside ? 16 : 0));
    }
}
__device__ __forceinline__ void commit() { DECODE_SM80_ASM("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void wait_until_in_flight() {
    DECODE_SM80_ASM("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---------------------------------------------------------------------------------------------
// The split kernel: block (b, kv head, split, chunk) runs the forward loop of FlashAttention-2
// (Algorithm 1, lines 5-12: S = Q K_j^T, m, P~ = exp(S - m), l, O rescaled and += P~ V_j) for the
// rows [chunk * kRows, +kRows) of its K/V group over the key tiles of its split, and writes
// O_s = O / l and L_s = m + log l (line 12-13, per split). blockIdx.x = chunk + chunks * (split +
// splits * (kv head + kv_heads * b)): the chunks of one split (rows beyond 8 of a large group)
// are neighbours, so the second reads the split's K and V from L2.
//
// Thread layouts, each chosen for conflict-free shared memory:
//  S = Q K^T: thread t takes key t % Bc and slice t / Bc of d (a warp: 32 keys, one slice, so Q's
//    element is one broadcast and the 32 K rows, 272 bytes apart at d = 128, fall in distinct
//    banks); the slices' sums meet in shared memory.
//  softmax: warp w owns rows w, w + kWarps, ...: their m and l live in its registers.
//  O += P V: thread t owns columns 2 (t % (D/2)) and +1 of rows t / (D/2) + k (256 / D) (a warp
//    reads 32 consecutive pairs of one V row).
// (__launch_bounds__'s 2: two blocks an SM, which is what shared memory allows at d = 128; without
// it nvcc 13 held the kernel to 64 registers and spilled.)
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2)
flash_decode_split_kernel(const T* __restrict__ Q, const T* __restrict__ K,
                          const T* __restrict__ V, float* __restrict__ Os,
                          float* __restrict__ Ls, int heads, int kv_heads, int q_len, int kv_len,
                          bool causal, int splits, int chunks, int tiles_per_split,
                          float scale_log2) {
    constexpr int Bc = decode_Bc(D), kParts = decode_parts(D), kSlice = D / kParts;
    constexpr int kRowGroups = kThreads / (D / 2), kRowsPerThread = kRows / kRowGroups;
    static_assert(kSlice % 8 == 0 && kRows % kRowGroups == 0, "layouts");
    extern __shared__ __align__(16) unsigned char shared[];
    T* Ks = reinterpret_cast<T*>(shared);                           // [kStages][Bc][D + kPad]
    T* Vs = Ks + kStages * Bc * (D + kPad);                         // [kStages][Bc][D + kPad]
    float* Qs = reinterpret_cast<float*>(Vs + kStages * Bc * (D + kPad));  // [kRows][D]
    float* Ss = Qs + kRows * D;           // [kParts][kRows][Bc]: partial scores; part 0 then P
    float* alpha_s = Ss + kParts * kRows * Bc;  // [kRows]: the tile's rescale exp(m_old - m_new)
    float* inv_l = alpha_s + kRows;             // [kRows]: 1 / l at the end (0 where l = 0)

    int id = blockIdx.x;
    const int chunk = id % chunks;
    id /= chunks;
    const int split = id % splits;
    id /= splits;
    const int kvh = id % kv_heads, b = id / kv_heads;
    const int group = heads / kv_heads;
    const int row0 = chunk * kRows;  // the block's first row of the group's group * q_len
    const int R = min(kRows, group * q_len - row0);
    // The group's rows are contiguous in Q, O and L: heads kvh * group .. +group - 1, q_len rows
    // each. Row r of the block is query i = (row0 + r) % q_len of its head.
    const size_t first_row = (size_t(b) * heads + size_t(kvh) * group) * q_len + row0;
    const size_t rows_total = size_t(gridDim.x / (splits * chunks)) * group * q_len;  // B*H*q_len
    const T* Kh = K + (size_t(b) * kv_heads + kvh) * size_t(kv_len) * D;
    const T* Vh = V + (size_t(b) * kv_heads + kvh) * size_t(kv_len) * D;

    // This split's key tiles: [tile0, tile_end), a whole number of Bc-key tiles (none for a split
    // past the last key).
    const int tiles = (kv_len + Bc - 1) / Bc;
    const int tile0 = min(split * tiles_per_split, tiles);  // no overflow: launcher bounds it
    const int n = min(tile0 + tiles_per_split, tiles) - tile0;

    // Start the first kStages - 1 tiles on their way, then stage Q (as fp32, times
    // log2(e) / sqrt(d): scores come out in log2 units, the exponentials as exp2).
    for (int st = 0; st < kStages - 1; ++st) {
        if (st < n) {
            load_tile_async<D>(Ks + st * Bc * (D + kPad), Kh, (tile0 + st) * Bc, kv_len);
            load_tile_async<D>(Vs + st * Bc * (D + kPad), Vh, (tile0 + st) * Bc, kv_len);
        }
        commit();
    }
    for (int e = threadIdx.x; e < R * D; e += kThreads)
        Qs[e] = float(Q[first_row * D + e]) * scale_log2;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float m[kRows / kWarps], l[kRows / kWarps];  // rows warp + k * kWarps: max and sum (log2)
#pragma unroll
    for (int k = 0; k < kRows / kWarps; ++k) m[k] = -INFINITY, l[k] = 0.f;
    const int col = 2 * (threadIdx.x % (D / 2)), rg = threadIdx.x / (D / 2);
    float acc[kRowsPerThread][2] = {};  // O (unnormalised) of rows rg + k * kRowGroups

    for (int it = 0; it < n; ++it) {
        // Tile it has landed (for every thread: the barrier), and every thread is done with the
        // buffer the next copy overwrites (tile it - 1's).
        wait_until_in_flight<kStages - 2>();
        __syncthreads();
        const int next = it + kStages - 1;
        if (next < n) {
            load_tile_async<D>(Ks + next % kStages * Bc * (D + kPad), Kh, (tile0 + next) * Bc,
                               kv_len);
            load_tile_async<D>(Vs + next % kStages * Bc * (D + kPad), Vh, (tile0 + next) * Bc,
                               kv_len);
        }
        commit();  // (an empty group near the end keeps the wait's count right)
        const T* Kt = Ks + it % kStages * Bc * (D + kPad);
        const T* Vt = Vs + it % kStages * Bc * (D + kPad);
        const int key0 = (tile0 + it) * Bc;

        {  // S = Q K_j^T (line 8), slice `part` of d for key jj, every row at once
            const int jj = threadIdx.x % Bc, part = threadIdx.x / Bc;
            float s[kRows] = {};
#pragma unroll
            for (int c = 0; c < kSlice; c += 8) {
                float kf[8];
                eight_floats(Kt + jj * (D + kPad) + part * kSlice + c, kf);
#pragma unroll
                for (int r = 0; r < kRows; ++r)
                    if (r < R) {
                        const float4 q0 = *reinterpret_cast<const float4*>(
                            Qs + r * D + part * kSlice + c);
                        const float4 q1 = *reinterpret_cast<const float4*>(
                            Qs + r * D + part * kSlice + c + 4);
                        s[r] += q0.x * kf[0] + q0.y * kf[1] + q0.z * kf[2] + q0.w * kf[3] +
                                q1.x * kf[4] + q1.y * kf[5] + q1.z * kf[6] + q1.w * kf[7];
                    }
            }
#pragma unroll
            for (int r = 0; r < kRows; ++r)
                if (r < R) Ss[(part * kRows + r) * Bc + jj] = s[r];
        }
        __syncthreads();

        // Online softmax (lines 9-10): the slices summed in a fixed order, the causal mask
        // (bottom-right: query i sees key j iff j <= flash_last_key(i, ...)) and kv_len applied,
        // m_new = max(m, rowmax S), P~ = exp2(S - m_new), l = exp2(m - m_new) l + rowsum P~.
#pragma unroll
        for (int k = 0; k < kRows / kWarps; ++k) {
            const int r = warp + k * kWarps;
            if (r >= R) continue;  // warp-uniform
            const int i = (row0 + r) % q_len;
            const int last = causal ? flash_last_key(i, q_len, kv_len) : kv_len - 1;
            float s[Bc / 32], tile_max = -INFINITY;
#pragma unroll
            for (int u = 0; u < Bc / 32; ++u) {
                const int jj = lane + 32 * u, j = key0 + jj;
                float sum = 0.f;
#pragma unroll
                for (int part = 0; part < kParts; ++part) sum += Ss[(part * kRows + r) * Bc + jj];
                s[u] = j < kv_len && j <= last ? sum : -INFINITY;
                tile_max = fmaxf(tile_max, s[u]);
            }
#pragma unroll
            for (int off = 16; off > 0; off /= 2)
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
            const float m_new = fmaxf(m[k], tile_max);
            // A row that has seen no key yet has m_new = -inf: subtract 0 instead, so that
            // exp2(-inf - -inf) = NaN never happens (P~ = exp2(-inf) = 0, alpha = 0 * 0).
            const float m_use = m_new == -INFINITY ? 0.f : m_new;
            float tile_sum = 0.f;
#pragma unroll
            for (int u = 0; u < Bc / 32; ++u) {
                const float p = exp2_ftz(s[u] - m_use);
                Ss[r * Bc + lane + 32 * u] = p;  // part 0's slot: P~, for O += P~ V below
                tile_sum += p;
            }
#pragma unroll
            for (int off = 16; off > 0; off /= 2)
                tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, off);
            const float alpha = exp2_ftz(m[k] - m_use);
            l[k] = alpha * l[k] + tile_sum;
            m[k] = m_new;
            if (lane == 0) alpha_s[r] = alpha;
        }
        __syncthreads();

        // O = diag(alpha) O + P~ V_j (line 10), 4 keys at a time (P~ as one float4).
#pragma unroll
        for (int k = 0; k < kRowsPerThread; ++k) {
            const int r = rg + k * kRowGroups;
            if (r < R) acc[k][0] *= alpha_s[r], acc[k][1] *= alpha_s[r];
        }
        for (int jj = 0; jj < Bc; jj += 4) {
            float2 v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u)
                v[u] = float2_of(*reinterpret_cast<const typename std::conditional<
                                     std::is_same<T, __half>::value, __half2,
                                     __nv_bfloat162>::type*>(Vt + (jj + u) * (D + kPad) + col));
#pragma unroll
            for (int k = 0; k < kRowsPerThread; ++k) {
                const int r = rg + k * kRowGroups;
                if (r >= R) continue;
                const float4 p = *reinterpret_cast<const float4*>(Ss + r * Bc + jj);
                acc[k][0] += p.x * v[0].x + p.y * v[1].x + p.z * v[2].x + p.w * v[3].x;
                acc[k][1] += p.x * v[0].y + p.y * v[1].y + p.z * v[2].y + p.w * v[3].y;
            }
        }
    }

    // The split's results (lines 12-13 over this split's keys): L_s = (m + log2 l) ln 2 in
    // natural log (-inf where the row saw no key of this split: l = 0), O_s = O / l (0 there).
#pragma unroll
    for (int k = 0; k < kRows / kWarps; ++k) {
        const int r = warp + k * kWarps;
        if (r < R && lane == 0) {
            Ls[size_t(split) * rows_total + first_row + r] =
                l[k] > 0.f ? (m[k] + log2f(l[k])) * kLn2 : -INFINITY;
            inv_l[r] = l[k] > 0.f ? 1.f / l[k] : 0.f;
        }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
        const int r = rg + k * kRowGroups;
        if (r >= R) continue;
        float2 o{acc[k][0] * inv_l[r], acc[k][1] * inv_l[r]};
        *reinterpret_cast<float2*>(Os + ((size_t(split) * rows_total + first_row + r) * D + col)) =
            o;
    }
}

// ---------------------------------------------------------------------------------------------
// The combine kernel: row by row, L = Lmax + log sum_s exp(L_s - Lmax) and O = sum_s exp(L_s - L)
// O_s, summed in the order s = 0, 1, ... (deterministic), O rounded to T once. Subtracting Lmax
// keeps every exp <= 1; a row with every L_s = -inf saw no key at all: O = 0, L = -inf.
// D / 4 threads a row, 4 columns each (16-byte loads of O_s).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
flash_decode_combine_kernel(const float* __restrict__ Os, const float* __restrict__ Ls,
                            T* __restrict__ O, float* __restrict__ L, size_t rows, int splits) {
    constexpr int kPerRow = D / 4;
    const size_t row = size_t(blockIdx.x) * (kThreads / kPerRow) + threadIdx.x / kPerRow;
    const int x = threadIdx.x % kPerRow * 4;
    if (row >= rows) return;
    float Lmax = -INFINITY;
    for (int s = 0; s < splits; ++s) Lmax = fmaxf(Lmax, Ls[size_t(s) * rows + row]);
    float4 o{0.f, 0.f, 0.f, 0.f};
    float Lrow = -INFINITY;
    if (Lmax != -INFINITY) {
        float sum = 0.f;
        for (int s = 0; s < splits; ++s) sum += expf(Ls[size_t(s) * rows + row] - Lmax);
        Lrow = Lmax + logf(sum);
        for (int s = 0; s < splits; ++s) {
            const float w = expf(Ls[size_t(s) * rows + row] - Lrow);  // exp(-inf) = 0: no key
            const float4 os = *reinterpret_cast<const float4*>(Os + (size_t(s) * rows + row) * D + x);
            o.x += w * os.x, o.y += w * os.y, o.z += w * os.z, o.w += w * os.w;
        }
    }
    store_pair(O + row * D + x, o.x, o.y);
    store_pair(O + row * D + x + 2, o.z, o.w);
    if (x == 0) L[row] = Lrow;
}

// ---------------------------------------------------------------------------------------------
// Host side.

size_t shared_bytes_for(int head_dim) {
    size_t bytes = 0;
    dispatch_head_dim<kFlashDecodeHeadDims>(head_dim, [&](auto dim) {
        bytes = decode_shared_bytes(decltype(dim)::value);
    });
    return bytes;
}
int bc_for(int head_dim) { return decode_Bc(head_dim); }

int chunks_of(const AttentionShape& s) {
    const int group_rows = s.heads / flash_kv_heads(s) * s.q_len;
    return (group_rows + kRows - 1) / kRows;
}

void require_decode_shape(const AttentionShape& s, const char* fn) {
    validate_shape_grouped(s, kFlashDecodeHeadDims, 2);
    require(s.q_len <= kFlashDecodeMaxQLen,
            std::string(fn) + ": shape.q_len = " + std::to_string(s.q_len) + " is not supported " +
                "by the decode kernel; allowed values: 1 to " +
                std::to_string(kFlashDecodeMaxQLen) + " (longer queries: flash_forward_fp16 / _bf16)");
}

void require_decode_device(const cudaDeviceProp& prop, int head_dim, const char* fn) {
    if (prop.major < 8)
        throw std::runtime_error(std::string(fn) + " needs a GPU of compute capability 8.0 or " +
                                 "newer (cp.async); " + prop.name + " is " +
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

template <typename T>
void decode_launch(const T* Q, const T* K, const T* V, T* O, float* L, const AttentionShape& s,
                   int splits, cudaStream_t stream) {
    const int blocks = split_blocks(s, splits);
    const int Bc = bc_for(s.head_dim);
    const int tiles = (s.kv_len + Bc - 1) / Bc;
    // Every split a whole number of tiles; with more splits than tiles, the last ones get none.
    const int tiles_per_split = (tiles + splits - 1) / splits;
    const size_t rows = l_elems(s);
    with_scratch(flash_decode_scratch_bytes(s, splits), stream, [&](void* scratch) {
        float* Os = static_cast<float*>(scratch);
        float* Ls = Os + size_t(splits) * rows * s.head_dim;
        cudaError_t err = cudaSuccess;
        dispatch_head_dim<kFlashDecodeHeadDims>(s.head_dim, [&](auto dim) {
            constexpr int D = decltype(dim)::value;
            auto split_kernel = flash_decode_split_kernel<T, D>;
            allow_shared(split_kernel, decode_shared_bytes(D));
            split_kernel<<<blocks, kThreads, decode_shared_bytes(D), stream>>>(
                Q, K, V, Os, Ls, s.heads, flash_kv_heads(s), s.q_len, s.kv_len, s.causal, splits,
                chunks_of(s), tiles_per_split, scale_log2_for(D));
            err = cudaGetLastError();
            if (err != cudaSuccess) return;
            constexpr size_t kRowsPerBlock = kThreads / (D / 4);
            const size_t combine_blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
            flash_decode_combine_kernel<T, D><<<unsigned(combine_blocks), kThreads, 0, stream>>>(
                Os, Ls, O, L, rows, splits);
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
        require(*splits >= 1, std::string(fn) + ": splits = " + std::to_string(*splits) +
                                  " is invalid; allowed values: 1 or more");
    validate_forward_pointers(fn, Q, K, V, O, L, s);
    const cudaDeviceProp prop = flash_device_props();
    require_decode_device(prop, s.head_dim, fn);
    if (splits) split_blocks(s, *splits);  // the grid's limit, refused before the scratch
    flash_decode_launch(prop, Q, K, V, O, L, s, splits.value_or(0), stream);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The split rule (flash.h): enough blocks for about two waves of the GPU, each split whole tiles
// and at least kMinTilesPerSplit of them (so that a split's fixed costs, its Q, its partial O_s
// written and read again by the combine, stay small beside its K and V), never more splits than
// that allows, at least 1.
int flash_decode_choose_splits(const cudaDeviceProp& prop, const AttentionShape& s) {
    constexpr int kWaves = 2, kMinTilesPerSplit = 4;
    const size_t per_block = shared_bytes_for(s.head_dim) + prop.reservedSharedMemPerBlock;
    const int resident = std::max<int>(1, int(prop.sharedMemPerMultiprocessor / per_block));
    const long long want = (long long)kWaves * prop.multiProcessorCount * resident;
    const long long units = (long long)s.batch * flash_kv_heads(s) * chunks_of(s);
    const int Bc = bc_for(s.head_dim);
    const long long tiles = (s.kv_len + Bc - 1) / Bc;
    const long long most = std::max<long long>(1, tiles / kMinTilesPerSplit);
    long long splits = std::min((want + units - 1) / units, most);
    splits = std::max<long long>(1, splits);
    // The same blocks' work with no split left short: tiles per split, then splits again.
    const long long per_split = (tiles + splits - 1) / splits;
    return int((tiles + per_split - 1) / per_split);
}

size_t flash_decode_scratch_bytes(const AttentionShape& s, int splits) {
    validate_shape_grouped(s, kFlashDecodeHeadDims, 2);
    require(splits >= 1, "splits = " + std::to_string(splits) + " is invalid; allowed values: 1 "
                         "or more");
    size_t bytes = 0;
    const bool overflow =
        __builtin_mul_overflow(l_elems(s), size_t(s.head_dim + 1), &bytes) ||
        __builtin_mul_overflow(bytes, size_t(splits), &bytes) ||
        __builtin_mul_overflow(bytes, sizeof(float), &bytes);
    require(!overflow, "splits = " + std::to_string(splits) + " is invalid for this shape: the " +
                           "scratch's size overflows size_t");
    return bytes;
}

void flash_decode_launch(const cudaDeviceProp& prop, const __half* Q, const __half* K,
                         const __half* V, __half* O, float* L, const AttentionShape& s,
                         int splits, cudaStream_t stream) {
    decode_launch(Q, K, V, O, L, s, splits > 0 ? splits : flash_decode_choose_splits(prop, s),
                  stream);
}
void flash_decode_launch(const cudaDeviceProp& prop, const __nv_bfloat16* Q,
                         const __nv_bfloat16* K, const __nv_bfloat16* V, __nv_bfloat16* O,
                         float* L, const AttentionShape& s, int splits, cudaStream_t stream) {
    decode_launch(Q, K, V, O, L, s, splits > 0 ? splits : flash_decode_choose_splits(prop, s),
                  stream);
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
