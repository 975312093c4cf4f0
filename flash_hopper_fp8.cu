// flash_hopper_fp8.cu: chapter 3, part 3, the forward in fp8 (e4m3) on Hopper (NOTES.md section
// 24). Chapter 3's forward (flash_hopper.cu: the producer, the consumers, the ring of K/V tiles,
// the persistent grid) with both products on fp8 wgmma, m64nNk32: twice the elements a cycle of
// fp16's. Four things change, each in one place:
//  1. V^T. fp8 wgmma reads its shared-memory operands K-major only, so O_i += P~ V_j needs V_j
//     with the keys along the row: a small kernel (transpose_v) writes V^T into scratch first.
//  2. P~ in e4m3, in registers. A thread's S_ij accumulators hold keys 2t, 2t + 1, 2t + 8, 2t + 9
//     of each 16; the A fragment of k32 wants k = 4t .. 4t + 3. Rather than move P~ between
//     threads, transpose_v puts V's keys in that order (flash.h's flash_fp8_v_slot): the sum over
//     keys does not care about their order, only that P~ and V agree on it.
//  3. Scales. Each (batch, head)'s Q, K, V stand for their elements times a descale; those of Q
//     and K scale the scores (folded into scale_log2), that of V the output. P~ <= 1 is rounded
//     as 256 P~ (<= 256, under e4m3's 448), so that probabilities down to 2^-14 stay normal
//     numbers; l sums the same 256 P~, so O = P~ V / l needs no correction, and L subtracts 8.
//  4. Sums over keys. fp8 wgmma's accumulators keep about 14 bits, so P~ V and l go through
//     Fp8Sums: a tile in the accumulators, the tiles in fp32 (at d = 128 and 256 only l; V's
//     columns are centred there, centre_v, so that the sum P~ (v - mu) does not grow with the row).
// The ping-pong of FlashAttention-3 is here at d = 256 only (fp8_pingpong); not here: its
// in-kernel transpose of V, chapter 5's options.
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -c flash_hopper_fp8.cu (the
// Makefile does it, as for flash_hopper.cu).
#include "checks.h"
#include "chapters.h"
#include "flash.h"
#include "hopper.cuh"
#include "log2_units.h"
#include "mask_policy.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_fp8.h>

#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

using fp8 = __nv_fp8_e4m3;

// Tiles: 128 rows of Q_i (two consumer warpgroups); Bc = flash_fp8_bc(d) keys (flash.h: 192 at
// d = 128, 128 elsewhere); a row of Q_i or K_j padded to 128 bytes at d = 64 (the TMA fills
// columns past d with zeros; the scores read only the first d). V^T_j in blocks of 128 keys, one
// 128-byte swizzled row each (the last block's keys past Bc are loaded, never read). Stages:
// three (at d = 256, 64 KiB a stage: 224 KiB with Q_i).
constexpr int kFp8Consumers = 2, kFp8Br = 64 * kFp8Consumers, kVtKeys = 128;
__host__ __device__ constexpr int fp8_vt_blocks(int d) {
    return (flash_fp8_bc(d) + kVtKeys - 1) / kVtKeys;
}
__host__ __device__ constexpr int fp8_cols(int d) { return d < 128 ? 128 : d; }
__host__ __device__ constexpr int fp8_stages(int) { return 3; }
constexpr int kPOffsetLog2 = 8;  // P~ is rounded as 2^8 P~ (above)
// Ping-pong of the two consumers (lib/hopper.cuh, Turns), the turn passed after both products:
// on at d = 256 (1.01-1.06x as measured), off at d = 128 (0.97-1.00x: there the softmax, not the
// products, bounds a step). -DFP8_PINGPONG=0 turns it off everywhere.
#ifndef FP8_PINGPONG
#define FP8_PINGPONG 1
#endif
__host__ __device__ constexpr bool fp8_pingpong(int d) { return FP8_PINGPONG && d == 256; }
// l, a row's sum of 256 P~, on the tensor cores: each P~ V_j product also multiplies P~ by a
// block of ones (an m64n8k32 wgmma a k-step; column 0 of its accumulators is the sum), so the
// softmax loses its add a score; l is then the sum of the rounded P~ that O's numerator sums.
#ifndef FP8_TENSOR_SUM
#define FP8_TENSOR_SUM 1
#endif

// The sums over keys, O_i's numerator P~ V and l (NOTES.md section 24). An fp8 wgmma adds into its
// accumulators keeping about 14 bits below the larger term's leading bit, so a sum carried in them
// from the first tile to the last loses more as rows grow (O off by 13%, L by 0.49 at 32k keys).
// Two levels (DeepSeek-V3's promotion): each tile's sums go to accumulators that the tile's first
// k-step overwrites (`acc`), and after the wait into fp32 registers (`O`, `l`). For O that costs
// D / 2 registers a thread: d = 64 has them. d = 128 has them only with 128 keys a tile, and 192
// keys with one level are faster; d = 256 has none. There l has two levels, O's numerator one,
// and V's columns are centred first (flash_fp8_centred_v): a sum of P~ (v - mu) does not grow
// with the row as one of P~ v does when a column has a mean.
__host__ __device__ constexpr bool fp8_two_level(int d) { return d < 128; }
template <int D>
struct Fp8Sums {
    static constexpr bool TwoLevel = fp8_two_level(D);  // O's numerator; l's: FP8_TENSOR_SUM
    float acc[D / 2 + 4 * FP8_TENSOR_SUM] = {};  // the wgmmas': P~ V, then l's 4 (FP8_TENSOR_SUM)
    float O[TwoLevel ? D / 2 : 1] = {};          // fp32 P~ V (TwoLevel)
    float l[2] = {0.f, 0.f};                     // fp32 l
    float alpha_prev[2] = {0.f, 0.f};            // the fp32 sums lag one tile in scale
    __device__ __forceinline__ float* l_acc() { return acc + D / 2; }
    // After the wait on tile j - 1's products (scale m_{j-1}), before tile j's. The fp32 sums
    // (O if TwoLevel, l if FP8_TENSOR_SUM) hold tiles < j - 1 at scale m_{j-2}; one FMA takes them
    // to m_{j-1} and adds tile j - 1's (not on a row block's first tile: acc then holds nothing of
    // its own). O in one level: to scale m_j. l without FP8_TENSOR_SUM is the kernel's, rescaled
    // before the wait.
    __device__ __forceinline__ void rescale(const float (&alpha)[2], bool first) {
        if constexpr (!TwoLevel)
#pragma unroll
            for (int n = 0; n < D / 2; n++) acc[n] *= alpha[n % 4 / 2];
        if (!first) promote();
        alpha_prev[0] = alpha[0], alpha_prev[1] = alpha[1];
    }
    // After the last tile's wait: its sums added in, all at the last tile's scale.
    __device__ __forceinline__ void finish() { promote(); }
    __device__ __forceinline__ void promote() {
        if constexpr (TwoLevel)
#pragma unroll
            for (int n = 0; n < D / 2; n++) O[n] = fmaf(O[n], alpha_prev[n % 4 / 2], acc[n]);
        if (FP8_TENSOR_SUM)
            for (int r = 0; r < 2; r++) l[r] = fmaf(l[r], alpha_prev[r], l_acc()[2 * r]);
    }
    __device__ __forceinline__ auto& numerator() {
        if constexpr (TwoLevel) return O;
        else return acc;
    }
    // O in place, both rows, for store_row: descale_v P~ V / l, or with V centred (mu: the head's
    // column means, flash_fp8_centred_v) descale_v (mu + P~ V' / l); 0 where l = 0 (no key seen).
    __device__ __forceinline__ void output(const float (&l_row)[2], float dv, const float* mu,
                                           int t) {
        float inv[2], shift[2];
        for (int r = 0; r < 2; r++) {
            inv[r] = l_row[r] > 0.f ? dv / l_row[r] : 0.f;
            shift[r] = flash_fp8_centred_v(D) && l_row[r] > 0.f ? dv : 0.f;
        }
#pragma unroll
        for (int q = 0; q < D / 8; q++) {  // columns 8q + 2t and 8q + 2t + 1 (acc_col)
            const float2 m = flash_fp8_centred_v(D)
                                 ? __ldg(reinterpret_cast<const float2*>(mu + 8 * q + 2 * t))
                                 : float2{0.f, 0.f};
#pragma unroll
            for (int r = 0; r < 2; r++) {
                float& o0 = acc_at(numerator(), r, 2 * q);
                float& o1 = acc_at(numerator(), r, 2 * q + 1);
                o0 = fmaf(o0, inv[r], shift[r] * m.x), o1 = fmaf(o1, inv[r], shift[r] * m.y);
            }
        }
    }
    // Row r's l, over the quad (with FP8_TENSOR_SUM, thread t = 0's column 0 of the ones' product;
    // t > 0 added columns 2t, exact zeros).
    __device__ __forceinline__ float row_sum(int r) { return quad_reduce(l[r], add); }
};
// One k-step of a sum over keys, d += A B; with Overwrite, a tile's first sets d = A B.
template <int N, bool Overwrite>
__device__ __forceinline__ void fp8_sum_step(float* d, const uint32_t* a, uint64_t b, int k) {
    if (Overwrite && k == 0) wgmma_fp8_rs<N, false>(d, a, b);
    else wgmma_fp8_rs<N>(d, a, b);
}

template <int D>
struct Fp8Shared {
    static constexpr int Cols = fp8_cols(D), Stages = fp8_stages(D);
    alignas(1024) fp8 Q_i[kFp8Br * Cols];
    struct Stage {
        alignas(1024) fp8 K_j[flash_fp8_bc(D) * Cols];
        alignas(1024) fp8 Vt_j[fp8_vt_blocks(D)][D * kVtKeys];  // blocks of D rows of 128 keys
    } KV[Stages];
    alignas(1024) uint8_t ones[8 * kRowBytes];  // B of the sum: row 0 e4m3 1.0s, rows 1-7 zeros
    uint64_t full[Stages + 1], empty[Stages + 1];
    int work[2];
};

// What centre_v gathers of each column of V for transpose_v (flash_fp8_centred_v), zeroed first:
// the sum in units of 2^-9, exact, and the least and greatest value as order-keeping unsigneds
// (fp8_order: atomicMax on them is max on the floats; 0, below every float, is "none yet").
struct Fp8ColumnStats {
    unsigned long long sum512;
    unsigned neg_lo, hi;  // fp8_order(-least), fp8_order(greatest)
};
__device__ __forceinline__ unsigned fp8_order(float f) {
    const unsigned b = __float_as_uint(f);
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}
__device__ __forceinline__ float fp8_unorder(unsigned u) {
    return __uint_as_float(u & 0x80000000u ? u & 0x7fffffffu : ~u);
}
constexpr int kCentreKeys = 1024;  // keys a block of centre_v (a whole grid: V read at full speed)
// A block a (batch * kv_heads head, kCentreKeys keys), 8 warps: each thread 16 columns (one 16-byte
// load) of every Lanes-th key, four loads in flight. A thread's sums are exact in fp32 (every e4m3
// value a whole number of 2^-9, at most 64 of them of at most 448: under 2^24 units), then ints in
// units of 2^-9 (a block's at most 1024 * 448 * 512 < 2^31); the lanes of a warp combined with
// shuffles, the warps in shared memory by one thread a column, which adds the block's into stats
// with atomics: on integers, the same in any order.
template <int D>
__global__ void __launch_bounds__(256) centre_v(const fp8* __restrict__ V,
                                                Fp8ColumnStats* __restrict__ stats, int kv_len) {
    constexpr int Per = D / 16, Lanes = 256 / Per;  // threads a key; keys a step
    static_assert(Per <= 32 && D <= 256, "a warp's first Per threads hold every column");
    static_assert((kCentreKeys + Lanes - 1) / Lanes * 448.0 * 512 < (1 << 24), "a thread's fp32 "
                  "sum of its keys' values is exact");
    __shared__ int sums[8][D];
    __shared__ float los[8][D], his[8][D];
    const int chunks = (kv_len + kCentreKeys - 1) / kCentreKeys, head = blockIdx.x / chunks;
    const int key0 = blockIdx.x % chunks * kCentreKeys, keys = min(kv_len - key0, kCentreKeys);
    const int c0 = threadIdx.x % Per * 16, lane = threadIdx.x / Per;
    const fp8* from = V + (size_t(head) * kv_len + key0) * D + c0;
    float sum[16] = {};
    float lo[16], hi[16];
    for (int e = 0; e < 16; e++) lo[e] = INFINITY, hi[e] = -INFINITY;
#pragma unroll 4
    for (int j = lane; j < keys; j += Lanes) {
        const uint4 sixteen = *reinterpret_cast<const uint4*>(from + size_t(j) * D);
        const uint32_t words[4] = {sixteen.x, sixteen.y, sixteen.z, sixteen.w};
#pragma unroll
        for (int w = 0; w < 4; w++) {
            __nv_fp8x4_e4m3 four;
            four.__x = words[w];
            const float4 f = float4(four);
            const float v[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int c = 4 * w + e;
                sum[c] += v[e], lo[c] = fminf(lo[c], v[e]), hi[c] = fmaxf(hi[c], v[e]);
            }
        }
    }
#pragma unroll
    for (int c = 0; c < 16; c++) {
        int units = int(sum[c] * 512.f);  // (exact: above)
        for (int off = Per; off < 32; off *= 2) {  // the warp's other keys, same columns
            units += __shfl_xor_sync(~0u, units, off);
            lo[c] = fminf(lo[c], __shfl_xor_sync(~0u, lo[c], off));
            hi[c] = fmaxf(hi[c], __shfl_xor_sync(~0u, hi[c], off));
        }
        if (threadIdx.x % 32 < Per) {
            const int warp = threadIdx.x / 32;
            sums[warp][c0 + c] = units, los[warp][c0 + c] = lo[c], his[warp][c0 + c] = hi[c];
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        long long total = 0;
        float least = INFINITY, greatest = -INFINITY;
        for (int w = 0; w < 8; w++) {
            total += sums[w][c];
            least = fminf(least, los[w][c]), greatest = fmaxf(greatest, his[w][c]);
        }
        Fp8ColumnStats& to = stats[size_t(head) * D + c];
        atomicAdd(&to.sum512, static_cast<unsigned long long>(total));  // (two's complement)
        atomicMax(&to.neg_lo, fp8_order(-least)), atomicMax(&to.hi, fp8_order(greatest));
    }
}

// V^T: V [batch * kv_heads][kv_len][D] to [batch * kv_heads][D][len32] (len32: kv_len rounded up
// to 32), key j of each group of 32 at slot flash_fp8_v_slot(j), zeros past kv_len; with stats
// (not null: V centred), each column's keys as e4m3(v - mu), rounded to nearest even, mu from
// centre_v's stats (flash_fp8_centre), and written to mu by the blocks of key 0 for the output. A
// block a (head, kTransposeKeys keys), 256 threads, blocks in x (a grid's y stops at 65535): the
// rows come in whole, 16 bytes a load, to shared memory, and each column's mu is made once, by
// thread c, while they come; then thread (c, g) writes column c's keys
// 16 g .. 16 g + 15 as 16 bytes, eight threads a whole 128-byte line of V^T's row. Rows are stored
// with their 16-byte chunks swizzled (chunk ^ row / 16): the 8 g of a warp read 8 banks at once.
constexpr int kTransposeKeys = 128;
template <int D>
__device__ __forceinline__ int transpose_at(int row, int col) {
    return row * D + (col ^ row / 16 % (D / 16 < 8 ? D / 16 : 8) * 16);
}
template <int D>
__global__ void __launch_bounds__(256) transpose_v(const fp8* __restrict__ V, fp8* __restrict__ Vt,
                                                   const Fp8ColumnStats* __restrict__ stats,
                                                   float* __restrict__ mu, int kv_len, int len32) {
    static_assert(D <= 256, "a thread a column's mu");
    __shared__ alignas(16) uint8_t rows[kTransposeKeys * D];
    __shared__ float mu_c[D];
    const int blocks = (len32 + kTransposeKeys - 1) / kTransposeKeys;
    const int head = blockIdx.x / blocks, key0 = blockIdx.x % blocks * kTransposeKeys;
    const uint8_t* from = reinterpret_cast<const uint8_t*>(V) + (size_t(head) * kv_len + key0) * D;
    const bool column = stats && threadIdx.x < D;  // thread c makes column c's mu
    Fp8ColumnStats st{};
    if (column) st = stats[size_t(head) * D + threadIdx.x];
    for (int x = threadIdx.x; x < kTransposeKeys * D / 16; x += 256) {  // (coalesced)
        const int r = x * 16 / D, c = x * 16 % D;
        const uint4 zero = {0, 0, 0, 0};
        *reinterpret_cast<uint4*>(rows + transpose_at<D>(r, c)) =
            key0 + r < kv_len ? *reinterpret_cast<const uint4*>(from + size_t(r) * D + c) : zero;
    }
    if (column) {
        mu_c[threadIdx.x] = flash_fp8_centre(static_cast<long long>(st.sum512), kv_len,
                                             -fp8_unorder(st.neg_lo), fp8_unorder(st.hi));
        if (key0 == 0) mu[size_t(head) * D + threadIdx.x] = mu_c[threadIdx.x];
    }
    __syncthreads();
    const int g = threadIdx.x % 8;
    if (key0 + 16 * g >= len32) return;
#pragma unroll 2
    for (int c = threadIdx.x / 8; c < D; c += 32) {
        const float m = stats ? mu_c[c] : 0.f;
        alignas(16) __nv_fp8x2_e4m3 out[8];
#pragma unroll
        for (int j = 0; j < 16; j += 2) {  // flash_fp8_v_slot keeps each 16 keys within their 16,
            __nv_fp8x2_e4m3 two;           // and keys 2i, 2i + 1 side by side: two at a time
            two.__x = rows[transpose_at<D>(16 * g + j, c)] |
                      rows[transpose_at<D>(16 * g + j + 1, c)] << 8;
            if (stats) {
                const int key = key0 + 16 * g + j;
                const float2 v = float2(two);
                two = __nv_fp8x2_e4m3(make_float2(key < kv_len ? v.x - m : 0.f,  // (zeros past
                                                  key + 1 < kv_len ? v.y - m : 0.f));  // kv_len)
            }
            out[flash_fp8_v_slot(j) / 2] = two;
        }
        *reinterpret_cast<uint4*>(Vt + (size_t(head) * D + c) * len32 + key0 + 16 * g) =
            *reinterpret_cast<const uint4*>(out);
    }
}

// Four floats as four e4m3 bytes of a register, the first in the low byte (cvt.rn.satfinite:
// round to nearest, finite values past 448 to 448).
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
    uint32_t r = 0;
    HOPPER_ONLY(asm("{\n.reg .b16 lo, hi;\n"
                    "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
                    "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
                    "mov.b32 %0, {lo, hi};\n}\n" : "=r"(r) : "f"(a), "f"(b), "f"(c), "f"(d)));
    return r;
}

// The kernel: flash_hopper.cu's fwd_produce and fwd_consume, step for step (their comments hold
// here), in one function, with the changes above.
template <int D, typename TO, typename Policy>
__global__ void __launch_bounds__(kWarpgroup * (kFp8Consumers + 1), 1)
flash_forward_fp8_kernel(const __grid_constant__ CUtensorMap Q,
                         const __grid_constant__ CUtensorMap K,
                         const __grid_constant__ CUtensorMap Vt, TO* __restrict__ O,
                         float* __restrict__ L, const __grid_constant__ Layout lay,
                         const Rows vt, const Policy policy, const Fp8Descales descale,
                         const float* __restrict__ mu, int Tr, int tiles, int head_group,
                         int group, float scale_log2, int* next) {
    constexpr int Br = kFp8Br, Bc = flash_fp8_bc(D), Cols = fp8_cols(D), Stages = fp8_stages(D);
    constexpr int VtBlocks = fp8_vt_blocks(D);
    using Turn = Turns<fp8_pingpong(D)>;
    auto& sh = shared_storage<Fp8Shared<D>>();
    uint64_t *full = sh.full, *empty = sh.empty;
    int* work = sh.work;
    struct Work {
        int i, bh, j0, Tc;
    };
    const auto decode = [&](int tile) {
        const int head0 = tile / (head_group * Tr) * head_group;
        const int hs = min(head_group, tiles / Tr - head0), place = tile % (head_group * Tr);
        const int i = Tr - 1 - place / hs, bh = head0 + place % hs;
        const KeySpan keys = policy.keys(i * Br, Br);
        const int j0 = keys.begin / Bc;
        return Work{i, bh, j0, keys.end > keys.begin ? (keys.end - 1) / Bc - j0 + 1 : 0};
    };
    if (threadIdx.x == 0) init_barriers(full, empty, Stages + 1, 4 * kFp8Consumers);
    if (FP8_TENSOR_SUM && threadIdx.x < 8 * kRowBytes / 4) {  // (row 0, its bytes alike, is
                                                               // where any swizzle leaves it)
        const uint32_t four = threadIdx.x < kRowBytes / 4 ? 0x38383838u : 0u;  // e4m3 1.0 = 0x38
        reinterpret_cast<uint32_t*>(sh.ones)[threadIdx.x] = four;
    }
    fence_proxy_async();  // the wgmmas (the async proxy) read them
    __syncthreads();
    Turn::start(int(threadIdx.x / kWarpgroup) - 1);
    if (threadIdx.x < kWarpgroup) {  // the producer
        setmaxnreg<false, 24>();
        if (threadIdx.x >= 32) return;
        const bool issuer = threadIdx.x == 0;
        PipelineState<Stages> kv;
        int tile = blockIdx.x;
        for (PipelineState<1> q;; q.advance()) {
            if (issuer) work[q.phase()] = tile;
            if (tile >= tiles) break;
            const auto [i, bh, j0, Tc] = decode(tile);
            if (q.n > 0) mbar_wait(&empty[Stages], q.phase_before());
            // Where the maps have Q's head bh (row, head, batch), and K's and V^T's, bh / group.
            const int3 q0 = lay.Q.box_at(bh, i * Br), k0 = lay.K.box_at(bh / group, j0 * Bc),
                       v0 = vt.box_at(bh / group, 0);
            if (issuer) {
                mbar_expect_bytes(&full[Stages], Br * Cols);
                load_tile<Br, Cols>(sh.Q_i, Q, q0.x, q0.y, q0.z, &full[Stages]);
            }
            for (int j = 0; j < Tc; j++, kv.advance()) {
                if (j == Stages) named_barrier(1, 32 + kWarpgroup * kFp8Consumers);
                if (kv.n >= Stages) mbar_wait(&empty[kv.stage()], kv.phase_before());
                if (!issuer) continue;
                auto& st = sh.KV[kv.stage()];
                mbar_expect_bytes(&full[kv.stage()], Bc * Cols + VtBlocks * D * kVtKeys);
                load_tile<Bc, Cols>(st.K_j, K, k0.x + j * Bc, k0.y, k0.z, &full[kv.stage()]);
                for (int b = 0; b < VtBlocks; b++)
                    tma_load(st.Vt_j[b], Vt, k0.x + j * Bc + b * kVtKeys, 0, v0.y, v0.z,
                             &full[kv.stage()]);
            }
            if (Tc <= Stages) named_barrier(1, 32 + kWarpgroup * kFp8Consumers);
            tile = __shfl_sync(0xffffffffu, issuer ? atomicAdd(next, 1) + int(gridDim.x) : 0, 0);
        }
        named_barrier(1, 32 + kWarpgroup * kFp8Consumers);
        for (PipelineState<Stages> s{max(kv.n - Stages, 0)}; s.n < kv.n; s.advance())
            mbar_wait(&empty[s.stage()], s.phase());
        return;
    }
    setmaxnreg<true, 240>();
    const int wg = warpgroup_index() - 1;
    const int warp = threadIdx.x % kWarpgroup / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    const uint64_t Q_w = smem_desc(reinterpret_cast<const char*>(sh.Q_i) + wg * 64 * kRowBytes, 0);
    const uint64_t ones = smem_desc(sh.ones, 0);       // (descriptors: desc_plus steps them)
    uint32_t P[Bc / 32][4];  // 256 P~ of the last tile, e4m3, as A (keys in V^T's order)
    PipelineState<Stages> kv;
    for (PipelineState<1> q;; q.advance()) {
        named_barrier(1, 32 + kWarpgroup * kFp8Consumers);
        const int tile = work[q.phase()];
        if (tile >= tiles) break;
        const auto [i, bh, j0, Tc] = decode(tile);
        // The head's scales: scores in log2 units times descale_q descale_k; O times descale_v.
        const float dq = descale.q ? descale.q[bh] : 1.f;
        const float dk = descale.k ? descale.k[bh / group] : 1.f;
        const float dv = descale.v ? descale.v[bh / group] : 1.f;
        const float scale = scale_log2 * dq * dk;
        mbar_wait(&full[Stages], q.phase());
        const int query = i * Br + 64 * wg + 16 * warp + g;
        float m[2] = {-INFINITY, -INFINITY};
        // O_i's numerator and l (Fp8Sums): the accumulators, P~ V then l's 4, in one array so that
        // one wait and one rescale cover both (apart, ptxas serializes the wgmmas: C7515)
        Fp8Sums<D> O_i;
        float (&l)[2] = O_i.l;
        const auto add_PV = [&](int stage) {  // O_i += P~ V_j: B = V^T's rows (N = columns of O)
            constexpr int N = D < 128 ? D : 128;
#pragma unroll
            for (int k = 0; k < Bc / 32; k++) {  // keys 32k .. 32k + 31: V^T's block k / 4
                const uint64_t Vt_j = smem_desc(sh.KV[stage].Vt_j[k / 4], 0);
#pragma unroll
                for (int half = 0; half < D / N; half++)
                    fp8_sum_step<N, fp8_two_level(D)>(
                        O_i.acc + half * N / 2, P[k],
                        desc_plus(Vt_j, half * N * kRowBytes + k % 4 * 32), k);
                if (FP8_TENSOR_SUM)
                    fp8_sum_step<8, true>(O_i.l_acc(), P[k], desc_plus(ones, k % 4 * 32), k);
            }
            wgmma_commit();
        };
        PipelineState<Stages> read = kv;
        for (int j = j0; j < j0 + Tc; j++, read.advance()) {
            mbar_wait(&full[read.stage()], read.phase());
            const uint64_t K_j = smem_desc(sh.KV[read.stage()].K_j, 0);
            float S_ij[Bc / 2] = {}, alpha[2], offset[2];
            Turn::take(wg);
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < D / 32; k++)  // 32 of d a step (d = 64: the padding unread)
                wgmma_fp8_ss<Bc>(S_ij, desc_plus(Q_w, k / 4 * Br * kRowBytes + k % 4 * 32),
                                 desc_plus(K_j, k / 4 * Bc * kRowBytes + k % 4 * 32));
            wgmma_commit();
            if (j > j0) {  // (the turn passed after both products, in each path: Turns)
                add_PV(read.previous().stage());
                Turn::pass(wg);
                wgmma_wait<1>(S_ij);
            } else {
                Turn::pass(wg);
                wgmma_wait<0>(S_ij);
            }
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const Span seen = policy.row_keys(query + 8 * r);
                const int hi = seen.last - j * Bc - 2 * t;
                if (hi < Bc - 7)
#pragma unroll
                    for (int c = 0; c < Bc / 4; c++)
                        if (8 * (c / 2) + c % 2 > hi) acc_at(S_ij, r, c) = -INFINITY;
                float m_new = m[r];
#pragma unroll
                for (int c = 0; c < Bc / 4; c++) m_new = fmaxf(m_new, acc_at(S_ij, r, c));
                m_new = quad_reduce(m_new, fmaxf);
                const float m_log2 = m_new == -INFINITY ? 0.f : m_new * scale;
                alpha[r] = exp2_ftz(m[r] * scale - m_log2);
                m[r] = m_new;
                offset[r] = kPOffsetLog2 - m_log2;  // 256 P~ (the offset 8 in log2 units)
            }
            // P~ in e4m3 as A, keys 32k .. 32k + 31 (flash_fp8_p_index; row a % 2), both rows at
            // once; without the row's sum on the tensor cores, each row's in its keys' order.
            // Made while P~ V_{j-1} still reads P, so into Pn; P after the wait.
            float sum[2] = {0.f, 0.f};
            uint32_t Pn[Bc / 32][4];
#pragma unroll
            for (int k = 0; k < Bc / 32; k++)
#pragma unroll
                for (int a = 0; a < 4; a++) {
                    float p[4];
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const float s = S_ij[flash_fp8_p_index(k, a, e)];
                        p[e] = exp2_ftz(fmaf(s, scale, offset[a % 2]));
                        if (!FP8_TENSOR_SUM) sum[a % 2] += p[e];
                    }
                    Pn[k][a] = e4m3x4(p[0], p[1], p[2], p[3]);
                }
            if (!FP8_TENSOR_SUM)
                for (int r = 0; r < 2; r++) l[r] = l[r] * alpha[r] + sum[r];
            wgmma_wait<0>(O_i.acc);
            if (j > j0 && threadIdx.x % 32 == 0) mbar_arrive(&empty[read.previous().stage()]);
            O_i.rescale(alpha, j == j0);
            a_operand_fence(P);  // (P~ V_{j-1} has read P)
#pragma unroll
            for (int k = 0; k < Bc / 32; k++)
#pragma unroll
                for (int a = 0; a < 4; a++) P[k][a] = Pn[k][a];
        }
        if (threadIdx.x % 32 == 0) mbar_arrive(&empty[Stages]);
        kv.advance(Tc);
        if (Tc > 0) {
            wgmma_fence();
            add_PV(kv.previous().stage());
            wgmma_wait<0>(O_i.acc);
            if (threadIdx.x % 32 == 0) mbar_arrive(&empty[kv.previous().stage()]);
            O_i.finish();
        }
        const float l_row[2] = {O_i.row_sum(0), O_i.row_sum(1)};
        O_i.output(l_row, dv, mu ? mu + size_t(bh / group) * D : nullptr, t);  // (mu: V centred)
#pragma unroll
        for (int r = 0; r < 2; r++) {  // O = descale_v P~ V / l; L = m + log(l / 256)
            const int row = query + 8 * r;
            const bool in = row < policy.q_len;
            store_row<TO, D>(O + (size_t(bh) * policy.q_len + row) * D, O_i.numerator(), r, 1.f, t,
                             in);
            if (!in) continue;
            const float L_row =
                l_row[r] > 0.f ? (m[r] * scale + log2f(l_row[r]) - kPOffsetLog2) * kLn2
                               : -INFINITY;
            if (t == 0) L[size_t(bh) * policy.q_len + row] = L_row;
        }
    }
}
#undef HOPPER_ONLY

// ---------------------------------------------------------------------------------------------
// The launcher.
template <int D>
constexpr size_t fp8_shared_bytes() {
    return shared_bytes_through(offsetof(Fp8Shared<D>, work) + sizeof(Fp8Shared<D>::work));
}
static_assert(fp8_shared_bytes<64>() <= 227 * 1024 && fp8_shared_bytes<128>() <= 227 * 1024 &&
                  fp8_shared_bytes<256>() <= 227 * 1024,
              "a block past 227 KiB");

template <typename TO>
static void forward_fp8(const char* fn, const fp8* Q, const fp8* K, const fp8* V, TO* O, float* L,
                        const AttentionShape& s, const Fp8Descales& descale, cudaStream_t stream) {
    validate_shape(s, kFlashHopperHeadDims, 1);
    validate_pointers(fn, {input_arg("Q", Q, q_elems(s)), input_arg("K", K, kv_elems(s)),
                           input_arg("V", V, kv_elems(s)), output_arg("O", O, q_elems(s)),
                           output_arg("L", L, l_elems(s))});
    const size_t per_q = size_t(s.batch) * s.heads, per_kv = size_t(s.batch) * flash_kv_heads(s);
    for (const Arg& d : {input_arg("descales.q", descale.q, per_q),
                         input_arg("descales.k", descale.k, per_kv),
                         input_arg("descales.v", descale.v, per_kv)})
        if (d.ptr)  // (given: a device array no output overlaps)
            validate_pointers(fn, {d, output_arg("O", O, q_elems(s)),
                                   output_arg("L", L, l_elems(s))});
    const cudaDeviceProp prop = flash_device_props();
    if (prop.major != 9)
        throw std::runtime_error(std::string(fn) + " needs a GPU of compute capability 9.0 (fp8 "
                                 "wgmma, sm_90a: H100, H200); " + prop.name + " is " +
                                 std::to_string(prop.major) + "." + std::to_string(prop.minor));
    const int kvh = flash_kv_heads(s), len32 = (s.kv_len + 31) / 32 * 32;
    const size_t vt_bytes = size_t(s.batch) * kvh * s.head_dim * len32;  // (a multiple of 32)
    const size_t columns =  // V centred: a mu and an Fp8ColumnStats a column of each head
        flash_fp8_centred_v(s.head_dim) ? size_t(s.batch) * kvh * s.head_dim : 0;
    const long long groups =  // the transpose's blocks
        (long long)s.batch * kvh * ((len32 + kTransposeKeys - 1) / kTransposeKeys);
    if (groups > INT_MAX)
        throw std::invalid_argument(std::string(fn) + ": batch * kv_heads * kv_len / " +
                                    std::to_string(kTransposeKeys) + " is invalid past 2^31 - 1 "
                                    "(the transpose's grid)");
    const Layout lay = contiguous_layout(s);
    dispatch_head_dim<kFlashHopperHeadDims>(s.head_dim, [&](auto dim) {
        constexpr int D = decltype(dim)::value;
        constexpr size_t bytes = fp8_shared_bytes<D>();
        const int tiles = grid_blocks(s, s.q_len, kFp8Br, "q_len");
        const int blocks = std::min(tiles, prop.multiProcessorCount);
        // Scratch: V^T, then (V centred) mu and the column stats, then the tile counter; the
        // stats and the counter zeroed.
        const size_t stats_at = vt_bytes + columns * sizeof(float);  // (a multiple of 32)
        const size_t next_at = stats_at + columns * sizeof(Fp8ColumnStats);
        with_scratch(next_at + 16, stream, [&](void* scratch) {
            char* base = static_cast<char*>(scratch);
            fp8* Vt = reinterpret_cast<fp8*>(base);
            float* mu = columns ? reinterpret_cast<float*>(base + vt_bytes) : nullptr;
            auto* stats = columns ? reinterpret_cast<Fp8ColumnStats*>(base + stats_at) : nullptr;
            int* next = reinterpret_cast<int*>(base + next_at);
            cudaError_t err = cudaMemsetAsync(base + stats_at, 0, next_at + 4 - stats_at, stream);
            if (err != cudaSuccess) return err;
            if constexpr (flash_fp8_centred_v(D)) {
                const int chunks = (s.kv_len + kCentreKeys - 1) / kCentreKeys;  // (<= groups)
                centre_v<D><<<unsigned(s.batch * kvh * chunks), 256, 0, stream>>>(V, stats,
                                                                                 s.kv_len);
                if ((err = cudaGetLastError()) != cudaSuccess) return err;
            }
            transpose_v<D><<<unsigned(groups), 256, 0, stream>>>(V, Vt, stats, mu, s.kv_len, len32);
            if ((err = cudaGetLastError()) != cudaSuccess) return err;
            // V^T as a tensor of batch x kv_heads heads, D rows of len32 "columns" (keys).
            Rows vt;
            vt.heads = kvh, vt.row = len32, vt.head = (long long)D * len32;
            vt.batch = vt.head * kvh;
            const CUtensorMap Qm = tensor_map(Q, lay.Q, s.batch, s.q_len, D, kFp8Br),
                              Km = tensor_map(K, lay.K, s.batch, s.kv_len, D, flash_fp8_bc(D)),
                              Vm = tensor_map<fp8>(Vt, vt, s.batch, D, len32, D);
            const auto run = [&](auto policy) {
                const auto kernel = flash_forward_fp8_kernel<D, TO, decltype(policy)>;
                allow_shared(kernel, bytes);
                kernel<<<blocks, kWarpgroup * (kFp8Consumers + 1), bytes, stream>>>(
                    Qm, Km, Vm, O, L, lay, vt, policy, descale, mu,
                    (s.q_len + kFp8Br - 1) / kFp8Br, tiles,
                    16, flash_kv_group(s), options_scale_log2(s, AttentionOptions{}), next);
                return cudaGetLastError();
            };
            return run(PlainPolicy{s.q_len, s.kv_len, s.causal});
        });
    });
}

void flash_forward_fp8_hopper(const fp8* Q, const fp8* K, const fp8* V, __nv_bfloat16* O,
                              float* L, const AttentionShape& shape, const Fp8Descales& descales,
                              cudaStream_t stream) {
    forward_fp8("flash_forward_fp8_hopper", Q, K, V, O, L, shape, descales, stream);
}
void flash_forward_fp8_hopper(const fp8* Q, const fp8* K, const fp8* V, __half* O, float* L,
                              const AttentionShape& shape, const Fp8Descales& descales,
                              cudaStream_t stream) {
    forward_fp8("flash_forward_fp8_hopper", Q, K, V, O, L, shape, descales, stream);
}
