// flash_hopper.cu: chapter 3, the forward on Hopper's own matrix instruction (NOTES.md section 17).
// FlashAttention-2's Algorithm 1 as chapter 2 runs it, with its two products on wgmma: a warpgroup
// (4 warps, 128 threads) multiplies a 64-row tile at once, its operands read from shared memory
// through 64-bit descriptors (or, for P~, from registers), asynchronously. What is written of the
// chapter (NOTES.md section 17's steps 1, 1b, 4a-4c): wgmma with shared-memory operands, K_j and
// V_j loaded by cp.async in three stages, Q tiles longest first, each tile's softmax run while
// the previous tile's O_i += P~ V_j is on the tensor cores, a tile that fits two blocks an SM at
// d = 64, one-instruction exponentials. Not yet: the copy engine (TMA), warp specialisation,
// ping-pong between warpgroups, d = 256. Head dims 64 and 128, fp16 and bf16, compute capability
// 9.0 only.
//
// Build: wgmma exists only in the sm_90a target, so this file alone is compiled with
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -c flash_hopper.cu
// (the Makefile does it). Every helper below is one PTX instruction; the PTX ISA sections are
// named beside them ("wgmma" is "Asynchronous Warpgroup Level Matrix Multiply-Accumulate").
#include "checks.h"
#include "flash.h"
#include "log2_units.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>
#include <type_traits>

// Built for anything but sm_90a the kernel must not run silently empty: it traps (and the
// launcher refuses every GPU but compute capability 9.0 before that).
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HOPPER_ONLY(...) __trap()
#else
#define HOPPER_ONLY(...) __VA_ARGS__
#endif

constexpr int kHopperHeadDims[] = {64, 128};
constexpr int kHopperBr = 128;                         // two warpgroups of 64 rows
// Keys a K/V tile. At d = 64, 64: a thread then holds S_ij, P~ and O_i in 123 registers, and two
// blocks share an SM, one's loads and softmax under the other's products (NOTES.md section 17).
constexpr int hopper_Bc(int head_dim) { return head_dim == 64 ? 64 : 128; }
constexpr int kStages = 3;                             // K/V tiles in shared memory at once
constexpr int kHopperHeadGroup = 16;                   // heads whose Q tiles go together (line 3)

// ---------------------------------------------------------------------------------------------
// Shared memory: the 128-byte swizzle. wgmma reads a tile as blocks of 64 columns of 16-bit
// elements (128 bytes a row), rows one after another, and in each row the 16-byte chunk c sits at
// chunk c ^ (row % 8): 8 rows that a read touches at one chunk then fall in 8 different banks.
// (Picture: NOTES.md section 17.) The swizzle works on address bits, so tiles start 1024-aligned.

// Rows [first, first + R) of a (len x D) matrix into that layout, 16 bytes a cp.async (PTX ISA,
// "Data Movement: cp.async"); rows at or past len become zeros. Not waited for.
template <int R, int D, typename T>
__device__ __forceinline__ void load_swizzled(T* to, const T* src, int first, int len) {
    for (int x = threadIdx.x; x < R * D / 8; x += blockDim.x) {
        const int r = x / (D / 8), chunk = x % (D / 8), c = chunk % 8;
        const bool inside = first + r < len;
        char* dst = reinterpret_cast<char*>(to) + chunk / 8 * R * 128 + r * 128 + (c ^ r % 8) * 16;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                         uint32_t(__cvta_generic_to_shared(dst))),
                     "l"(src + size_t(inside ? first + r : 0) * D + chunk * 8),
                     "r"(inside ? 16 : 0));
    }
}

// A shared-memory matrix descriptor (wgmma, "Matrix Descriptor Format"): the start address, the
// leading and stride byte offsets (each >> 4) and the swizzle mode (1: 128 bytes). sbo: from one
// group of 8 rows to the next, 1024 bytes. lbo: for an operand read transposed (V_j), from one
// block of 64 columns to the next; K-major operands (Q_i, K_j) ignore it, and step through k by
// moving the start 32 bytes (16 elements) along the row.
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo) {
    const uint32_t a = uint32_t(__cvta_generic_to_shared(p));
    return uint64_t((a & 0x3FFFF) >> 4) | uint64_t(lbo >> 4) << 16 | uint64_t(1024 >> 4) << 32 |
           uint64_t(1) << 62;
}
// wgmma.fence: registers written before it (accumulators, A) are what the next wgmma reads.
// wgmma.commit_group and wgmma.wait_group 0: close the batch of wgmmas issued, wait for it all.
__device__ __forceinline__ void wgmma_fence() {
    HOPPER_ONLY(asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"));
}
__device__ __forceinline__ void wgmma_commit() {
    HOPPER_ONLY(asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"));
}
template <int Pending>  // wgmma.wait_group: until at most Pending of the latest batches run
__device__ __forceinline__ void wgmma_wait() {
    HOPPER_ONLY(asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory"));
}
// After a wait: the compiler must not read (or write) these registers before it, as it would
// for registers no instruction it knows of is still writing.
template <int N>
__device__ __forceinline__ void fence_registers(float* r) {
#pragma unroll
    for (int x = 0; x < N; x++) asm volatile("" : "+f"(r[x])::"memory");
}

// wgmma.mma_async m64nNk16 with fp32 accumulators d (N / 2 a thread, laid out as mma.m16n8's, a
// warp's 16 rows each). SS: A and B in shared memory, both K-major (S = Q_i K_j^T). RS: A in
// registers as mma.m16n8k16's A fragment (P~), B in shared memory read transposed (imm-trans-b 1:
// V_j is stored keys x columns).
#define ACC8(b) "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), \
                "+f"(d[b + 5]), "+f"(d[b + 6]), "+f"(d[b + 7])
#define ACC32 ACC8(0), ACC8(8), ACC8(16), ACC8(24)
#define ACC64 ACC32, ACC8(32), ACC8(40), ACC8(48), ACC8(56)
#define REGS32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21," \
               "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define REGS64 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21," \
               "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41," \
               "%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61," \
               "%62,%63}"
#define WGMMA_SS(N, REGS, ACC, AB, TY)                                                          \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", " AB    \
                 ", 1, 1, 1, 0, 0;\n" : ACC : "l"(a), "l"(b))
#define WGMMA_RS(N, REGS, ACC, AB, TY)                                                          \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", " AB    \
                 ", 1, 1, 1, 1;\n" : ACC : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float* d, uint64_t a, uint64_t b) {
    constexpr bool h = std::is_same<T, __half>::value;
    if constexpr (N == 64 && h) HOPPER_ONLY(WGMMA_SS(64, REGS32, ACC32, "%32, %33", "f16"));
    if constexpr (N == 64 && !h) HOPPER_ONLY(WGMMA_SS(64, REGS32, ACC32, "%32, %33", "bf16"));
    if constexpr (N == 128 && h) HOPPER_ONLY(WGMMA_SS(128, REGS64, ACC64, "%64, %65", "f16"));
    if constexpr (N == 128 && !h) HOPPER_ONLY(WGMMA_SS(128, REGS64, ACC64, "%64, %65", "bf16"));
}
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t* a, uint64_t b) {
    constexpr bool h = std::is_same<T, __half>::value;
#define AB32 "{%32,%33,%34,%35}, %36"
#define AB64 "{%64,%65,%66,%67}, %68"
    if constexpr (N == 64 && h) HOPPER_ONLY(WGMMA_RS(64, REGS32, ACC32, AB32, "f16"));
    if constexpr (N == 64 && !h) HOPPER_ONLY(WGMMA_RS(64, REGS32, ACC32, AB32, "bf16"));
    if constexpr (N == 128 && h) HOPPER_ONLY(WGMMA_RS(128, REGS64, ACC64, AB64, "f16"));
    if constexpr (N == 128 && !h) HOPPER_ONLY(WGMMA_RS(128, REGS64, ACC64, AB64, "bf16"));
}
// Two floats as one 32-bit register of T pair, the A fragment's element pairs.
template <typename T>
__device__ __forceinline__ uint32_t pair_bits(float a, float b) {
    uint32_t bits;
    if constexpr (std::is_same<T, __half>::value) {
        const __half2 p = __floats2half2_rn(a, b);
        bits = *reinterpret_cast<const uint32_t*>(&p);
    } else {
        const __nv_bfloat162 p = __floats2bfloat162_rn(a, b);
        bits = *reinterpret_cast<const uint32_t*>(&p);
    }
    return bits;
}

// ---------------------------------------------------------------------------------------------
// The kernel. One block per (Q tile i, batch*head): Br = 128 rows, two warpgroups of 64; K/V
// tiles of Bc keys (hopper_Bc) in three stages: tile j + 1 loads while tile j's S_ij and tile
// j - 1's P~ V_{j-1} run. A thread's accumulator element 4n + 2h + e is row 16 warp + g + 8h of
// its warpgroup's 64, column 8n + 2t + e (lane = 4g + t), as in chapter 2.
template <typename T, int D, int Bc>
__global__ void __launch_bounds__(256, Bc == 64 ? 2 : 1)
flash_forward_hopper_kernel(const T* __restrict__ Q, const T* __restrict__ K,
                            const T* __restrict__ V, T* __restrict__ O, float* __restrict__ L,
                            int q_len, int kv_len, bool causal, int Tr, int HG,
                            float scale_log2) {
    constexpr int Br = kHopperBr;
    extern __shared__ __align__(16) unsigned char shared[];
    // Q_i (2 x 64 rows), then three stages of K_j and V_j (Bc rows each), 1024-byte aligned.
    T* Q_i = reinterpret_cast<T*>(shared + (1024 - __cvta_generic_to_shared(shared) % 1024) % 1024);
    T* KV = Q_i + Br * D;
    // Line 3: block -> (Q tile i, head), as chapter 2: heads in groups of HG, each group's Q
    // tiles longest (causal) first, its heads taking turns.
    const int BH = gridDim.x / Tr, head0 = blockIdx.x / (HG * Tr) * HG, heads = min(HG, BH - head0);
    const int i = Tr - 1 - int(blockIdx.x % (HG * Tr)) / heads;
    const size_t bh = head0 + blockIdx.x % (HG * Tr) % heads;
    const int wg = threadIdx.x / 128, warp = threadIdx.x % 128 / 32;
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    const int q0 = i * Br, query = q0 + 64 * wg + 16 * warp + g;  // its rows: query + 8h
    load_swizzled<64, D>(Q_i, Q + bh * q_len * D, q0, q_len);  // line 4: load Q_i
    load_swizzled<64, D>(Q_i + 64 * D, Q + bh * q_len * D, q0 + 64, q_len);
    const int Tc = (flash_kv_end(q0, Br, q_len, kv_len, causal) + Bc - 1) / Bc;
    const auto load_KV = [&](int j) {                  // line 7: load K_j, V_j into a stage
        load_swizzled<Bc, D>(KV + j % kStages * 2 * Bc * D, K + bh * kv_len * D, j * Bc, kv_len);
        load_swizzled<Bc, D>(KV + (j % kStages * 2 + 1) * Bc * D, V + bh * kv_len * D, j * Bc,
                             kv_len);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    if (Tc > 0) load_KV(0);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, O_i[D / 2] = {};  // line 5
    const char* Q_w = reinterpret_cast<const char*>(Q_i + wg * 64 * D);  // the warpgroup's rows
    uint32_t P[Bc / 16][4];                            // P~ of the last tile, in T, as A
    const auto K_of = [&](int j) {                     // K_j's stage; V_j follows it
        return reinterpret_cast<const char*>(KV + j % kStages * 2 * Bc * D);
    };
    const auto add_PV = [&](int j) {                   // line 10's product: O_i += P~ V_j
        const char* V_j = K_of(j) + Bc * D * sizeof(T);
#pragma unroll
        for (int k = 0; k < Bc / 16; k++)
            wgmma_rs<T, D>(O_i, P[k], smem_desc(V_j + k * 16 * 128, Bc * 128));
        wgmma_commit();
    };
    for (int j = 0; j < Tc; j++) {                     // line 6: for each K_j, V_j
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        // Written through cp.async, read by wgmma, which is another proxy: fence.proxy.async
        // (PTX ISA, "Memory Consistency Model: proxies") before the barrier.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();                               // tile j is in; tile j - 2 was read
        if (j + 1 < Tc) load_KV(j + 1);                // a tile ahead, into its stage
        const char* K_j = K_of(j);
        float S[Bc / 2] = {};                          // line 8: S_ij = Q_i K_j^T, 16 of d a step
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < D / 16; k++)
            wgmma_ss<T, Bc>(S, smem_desc(Q_w + k / 4 * 64 * 128 + k % 4 * 32, 0),
                            smem_desc(K_j + k / 4 * Bc * 128 + k % 4 * 32, 0));
        wgmma_commit();
        // Line 10 of the tile before, O_i += P~ V_{j-1}, runs while this tile's softmax does.
        if (j > 0) add_PV(j - 1);
        if (j > 0) wgmma_wait<1>();                    // S_ij is done (P~ V_{j-1} may not be)
        else wgmma_wait<0>();
        fence_registers<Bc / 2>(S);
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {                  // line 9 for row query + 8h
            const int last = causal ? flash_last_key(query + 8 * h, q_len, kv_len) : kv_len - 1;
            const bool edge = (j + 1) * Bc - 1 > min(last, kv_len - 1);
            float m_new = m[h];
#pragma unroll
            for (int n = 0; n < Bc / 4; n++) {         // element n / 2, 2h + n % 2: a key
                float& s = S[4 * (n / 2) + 2 * h + n % 2];
                const int key = j * Bc + 8 * (n / 2) + 2 * t + n % 2;
                if (edge && (key >= kv_len || key > last)) s = -INFINITY;
                m_new = fmaxf(m_new, s);
            }
            m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, 1));  // over the quad
            m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, 2));
            const float m_log2 = m_new == -INFINITY ? 0.f : m_new * scale_log2;  // no key yet
            alpha[h] = exp2_ftz(m[h] * scale_log2 - m_log2);
            m[h] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < Bc / 4; n++) {         // P~_ij = exp(S_ij - m), in S's registers
                float& s = S[4 * (n / 2) + 2 * h + n % 2];
                s = exp2_ftz(fmaf(s, scale_log2, -m_log2));
                sum += s;
            }
            l[h] = l[h] * alpha[h] + sum;
        }
        wgmma_wait<0>();                               // O_i += P~ V_{j-1} is done
        fence_registers<D / 2>(O_i);
#pragma unroll
        for (int n = 0; n < D / 4; n++) O_i[4 * (n / 2) + n % 2] *= alpha[0];
#pragma unroll
        for (int n = 0; n < D / 4; n++) O_i[4 * (n / 2) + 2 + n % 2] *= alpha[1];
#pragma unroll
        for (int k = 0; k < Bc / 16; k++)              // line 10's P~, in T as A, for next time
#pragma unroll
            for (int x = 0; x < 4; x++)
                P[k][x] = pair_bits<T>(S[8 * k + 2 * x], S[8 * k + 2 * x + 1]);
    }
    if (Tc > 0) {                                      // line 10 of the last tile
        wgmma_fence();
        add_PV(Tc - 1);
        wgmma_wait<0>();
        fence_registers<D / 2>(O_i);
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {                      // lines 12-13: O_i / l, L = m + log l
        const int row = query + 8 * h;
        float l_row = l[h] + __shfl_xor_sync(0xffffffffu, l[h], 1);
        l_row += __shfl_xor_sync(0xffffffffu, l_row, 2);
        if (row >= q_len) continue;
        const float inv = l_row > 0.f ? 1.f / l_row : 0.f;  // a row that sees no key: O = 0
#pragma unroll
        for (int n = 0; n < D / 8; n++)
            *reinterpret_cast<uint32_t*>(O + (bh * q_len + row) * D + 8 * n + 2 * t) =
                pair_bits<T>(O_i[4 * n + 2 * h] * inv, O_i[4 * n + 2 * h + 1] * inv);
        if (t == 0)
            L[bh * q_len + row] =
                l_row > 0.f ? (m[h] * scale_log2 + log2f(l_row)) * kLn2 : -INFINITY;
    }
}

// ---------------------------------------------------------------------------------------------
// The launcher: chapter 2's checks, then compute capability 9.0.
static size_t flash_hopper_shared_bytes(int head_dim) {  // Q_i, 3 stages of K_j, V_j, alignment
    return size_t(kHopperBr + 2 * kStages * hopper_Bc(head_dim)) * head_dim * 2 + 1024;
}

template <typename T>
static void forward_hopper_checked(const char* fn, const T* Q, const T* K, const T* V, T* O,
                                   float* L, const AttentionShape& s, cudaStream_t stream) {
    validate_shape(s, kHopperHeadDims, sizeof(T));
    validate_forward_pointers(fn, Q, K, V, O, L, s);
    const cudaDeviceProp prop = flash_device_props();
    if (prop.major != 9)
        throw std::runtime_error(std::string(fn) + " needs a GPU of compute capability 9.0 (wgmma, "
                                 "sm_90a: H100, H200); " + prop.name + " is " +
                                 std::to_string(prop.major) + "." + std::to_string(prop.minor));
    const int blocks = grid_blocks(s, s.q_len, kHopperBr, "q_len");
    const size_t bytes = flash_hopper_shared_bytes(s.head_dim);
    dispatch_head_dim<kHopperHeadDims>(s.head_dim, [&](auto dim) {
        constexpr int D = decltype(dim)::value;
        const auto kernel = flash_forward_hopper_kernel<T, D, hopper_Bc(D)>;
        allow_shared(kernel, bytes);
        kernel<<<blocks, 256, bytes, stream>>>(Q, K, V, O, L, s.q_len, s.kv_len, s.causal,
                                              (s.q_len + kHopperBr - 1) / kHopperBr,
                                              kHopperHeadGroup, scale_log2_for(D));
        FLASH_CUDA_CHECK(cudaGetLastError());
    });
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
