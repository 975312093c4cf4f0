// flash.cu: FlashAttention forward and backward in fp32 CUDA C++, small enough to read beside
// the papers (FlashAttention, Dao et al. 2022; FlashAttention-2, Dao 2023).
//
// Build and test:   make test        (the API is in flash.h; the CPU reference in reference.cpp)
// Demo:             make run         (one shape, timed and checked against the CPU reference)
//
// Sections, in order: shapes and checks, the tile, the kernels, the launchers.
// Layouts: Q, O, dQ, dO (B, H, q_len, d); K, V, dK, dV (B, H, kv_len, d); L (B, H, q_len).
#include "flash.h"

#include <cuda_pipeline.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

// ---------------------------------------------------------------------------------------------
// Shapes and checks (host). Everything here runs before any launch, so bad input never reaches
// the GPU and never touches an output.

bool flash_head_dim_supported(int head_dim) {
    for (int d : kFlashHeadDims)
        if (d == head_dim) return true;
    return false;
}

std::string flash_head_dims_string() {
    std::string s;
    for (int d : kFlashHeadDims) s += (s.empty() ? "" : ", ") + std::to_string(d);
    return s;
}

static void require(bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument(what);
}

// a * b, or an invalid_argument naming `what` when it does not fit in size_t
static size_t mul_checked(size_t a, size_t b, const char* what) {
    size_t r;
    require(!__builtin_mul_overflow(a, b, &r), std::string("shape: ") + what + " overflows size_t");
    return r;
}

void validate_shape(const AttentionShape& s) {
    const std::pair<const char*, int> fields[] = {
        {"batch", s.batch}, {"heads", s.heads}, {"q_len", s.q_len}, {"kv_len", s.kv_len}};
    for (const auto& f : fields)
        require(f.second >= 1, std::string("shape.") + f.first + " = " + std::to_string(f.second) +
                                   " is invalid; allowed values: 1 or more");
    require(flash_head_dim_supported(s.head_dim),
            "shape.head_dim = " + std::to_string(s.head_dim) +
                " is not supported; allowed values: " + flash_head_dims_string());
    // Every tensor's byte count must fit in size_t (and so every 64-bit offset the kernels form).
    const size_t bh = mul_checked(s.batch, s.heads, "batch * heads");
    mul_checked(mul_checked(mul_checked(bh, s.q_len, "batch * heads * q_len"), s.head_dim,
                            "batch * heads * q_len * head_dim"),
                sizeof(float), "batch * heads * q_len * head_dim * sizeof(float)");
    mul_checked(mul_checked(mul_checked(bh, s.kv_len, "batch * heads * kv_len"), s.head_dim,
                            "batch * heads * kv_len * head_dim"),
                sizeof(float), "batch * heads * kv_len * head_dim * sizeof(float)");
}

size_t q_elems(const AttentionShape& s) {
    return size_t(s.batch) * s.heads * s.q_len * s.head_dim;
}
size_t kv_elems(const AttentionShape& s) {
    return size_t(s.batch) * s.heads * s.kv_len * s.head_dim;
}
size_t l_elems(const AttentionShape& s) { return size_t(s.batch) * s.heads * s.q_len; }

// One tensor argument: its name, pointer and element count, for the pointer checks below.
struct Arg {
    const char* name;
    const void* ptr;
    size_t elems;
    bool output;
};

// Null, misaligned (the kernels load 16-byte float4s), outputs overlapping any other argument,
// and host memory the GPU cannot read: all refused before launch.
template <size_t N>
static void validate_pointers(const char* fn, const Arg (&args)[N]) {
    for (const Arg& a : args) {
        require(a.ptr != nullptr, std::string(fn) + ": " + a.name + " is null");
        require(reinterpret_cast<uintptr_t>(a.ptr) % 16 == 0,
                std::string(fn) + ": " + a.name + " must be 16-byte aligned (cudaMalloc is)");
    }
    for (const Arg& a : args)
        for (const Arg& b : args) {
            if (&a == &b || !a.output) continue;
            const char *pa = static_cast<const char*>(a.ptr), *pb = static_cast<const char*>(b.ptr);
            const size_t na = a.elems * sizeof(float), nb = b.elems * sizeof(float);
            const bool overlap = pa < pb + nb && pb < pa + na;
            require(!overlap, std::string(fn) + ": output " + a.name + " overlaps " + b.name);
        }
    for (const Arg& a : args) {
        cudaPointerAttributes attr;
        FLASH_CUDA_CHECK(cudaPointerGetAttributes(&attr, a.ptr));
        require(attr.type != cudaMemoryTypeUnregistered,
                std::string(fn) + ": " + a.name + " is host memory; pass a device pointer");
    }
}

// ---------------------------------------------------------------------------------------------
// The tile. The paper (FA1, Algorithm 1 line 1) sets Bc = ceil(M / 4d), Br = min(ceil(M / 4d), d)
// so that Q_i, K_j, V_j and O_i (four tiles of d columns) fit in M floats of on-chip SRAM.
// We depart in three ways, each for speed:
//  1. Q_i and O_i live in registers (as in FlashAttention-2), so shared memory holds only K_j and
//     V_j: Bc = M / 2d.
//  2. M is not the whole SM: kMinBlocksPerSM blocks share an SM, so that while one block waits
//     for its next K_j, V_j to arrive the others compute. M = (shared memory per SM) / blocks.
//  3. Br is set by registers, not SRAM: one query row per thread, its q and o (2d floats) in
//     registers; a thread holds at most 64 floats of each, so at d > 64 a row is split across
//     threads_per_row threads, and Br = threads / threads_per_row.
static constexpr int kThreads = 128;        // threads per block (4 warps)
// Two knobs to experiment with, e.g. make clean all DEFINES=-DFLASH_FORWARD_SLICE=32
#ifndef FLASH_MIN_BLOCKS_PER_SM
#define FLASH_MIN_BLOCKS_PER_SM 3
#endif
#ifndef FLASH_FORWARD_SLICE
#define FLASH_FORWARD_SLICE 64
#endif
static constexpr int kMinBlocksPerSM = FLASH_MIN_BLOCKS_PER_SM;  // forward; 3: <= 170 registers
static constexpr int kForwardSlice = FLASH_FORWARD_SLICE;  // floats of q (and of o) per thread
static constexpr int kBackwardSlice = 32;   // floats of each of the backward's 3 or 4 row vectors
static constexpr float kLog2e = 1.4426950408889634f;
static constexpr float kLn2 = 0.6931471805599453f;

// Smallest power of two p with d / p <= slice: the threads that share one row.
static constexpr int threads_per_row(int d, int slice) {
    int p = 1;
    while (d / p > slice) p *= 2;
    return p;
}

// Shared memory one block may use when kMinBlocksPerSM blocks share an SM.
static size_t shared_per_block(const cudaDeviceProp& prop) {
    const size_t share = prop.sharedMemPerMultiprocessor / kMinBlocksPerSM;
    const size_t usable = share > prop.reservedSharedMemPerBlock
                              ? share - prop.reservedSharedMemPerBlock : 0;
    return std::min(usable, prop.sharedMemPerBlockOptin);
}

static FlashTile make_tile(const cudaDeviceProp& prop, int head_dim, int tpr, int Br, int Bc) {
    FlashTile tile{Br, Bc, kThreads, tpr, 2 * size_t(Bc) * head_dim * sizeof(float)};
    if (Bc < 1 || tile.shared_bytes > prop.sharedMemPerBlockOptin)
        throw std::runtime_error("device " + std::string(prop.name) + " has too little shared " +
                                 "memory for one K/V tile at head_dim " + std::to_string(head_dim));
    if (kThreads > prop.maxThreadsPerBlock)
        throw std::runtime_error("device allows fewer than " + std::to_string(kThreads) +
                                 " threads per block");
    return tile;
}

static void require_head_dim(int head_dim) {
    require(flash_head_dim_supported(head_dim),
            "head_dim = " + std::to_string(head_dim) + " is not supported; allowed values: " +
                flash_head_dims_string());
}

FlashTile flash_choose_tile(const cudaDeviceProp& prop, int head_dim) {
    require_head_dim(head_dim);
    const int tpr = threads_per_row(head_dim, kForwardSlice);
    const int Bc = int(shared_per_block(prop) / (2 * head_dim * sizeof(float)));
    return make_tile(prop, head_dim, tpr, kThreads / tpr, Bc);
}

// The backward's tiles are square: each of its two kernels keeps one tile in registers (one row
// per threads_per_row threads: for dK, dV the keys; for dQ the queries) and streams the other
// through shared memory in tiles of the same size, Br = Bc = threads / threads_per_row. Its
// threads hold 3 (dQ) or 4 (dK, dV) row vectors, so each holds a smaller slice of a row.
FlashTile flash_choose_tile_backward(const cudaDeviceProp& prop, int head_dim) {
    require_head_dim(head_dim);
    const int tpr = threads_per_row(head_dim, kBackwardSlice);
    return make_tile(prop, head_dim, tpr, kThreads / tpr, kThreads / tpr);
}

// ---------------------------------------------------------------------------------------------
// The kernels. Small helpers first: CUDA has no float4 arithmetic.
__device__ __forceinline__ float dot4(float4 a, float4 b) {
    return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}
__device__ __forceinline__ float4 scale4(float4 a, float s) {
    return make_float4(a.x * s, a.y * s, a.z * s, a.w * s);
}
__device__ __forceinline__ void axpy4(float4& y, float a, float4 x) {  // y += a * x
    y.x += a * x.x;
    y.y += a * x.y;
    y.z += a * x.z;
    y.w += a * x.w;
}
// Sum over the TPR adjacent threads that share a row; every one of them gets the total.
template <int TPR>
__device__ __forceinline__ float row_sum(float v) {
    for (int w = TPR / 2; w > 0; w /= 2) v += __shfl_xor_sync(0xffffffffu, v, w);
    return v;
}
// All threads of the block copy `rows` rows of d floats of two tensors (at the same offset),
// global -> shared, 16 bytes at a time. cp.async (sm_80+; plain copies before that) moves the data
// without staging it in registers, so every load of both tiles is in flight at once.
template <int D>
__device__ __forceinline__ void load_tiles(float4* A, const float4* __restrict__ gA, float4* B,
                                           const float4* __restrict__ gB, size_t offset, int rows) {
    for (int x = threadIdx.x; x < rows * (D / 4); x += blockDim.x) {
#ifdef FLASH_PLAIN_COPY
        A[x] = gA[offset + x];
        B[x] = gB[offset + x];
#else
        __pipeline_memcpy_async(A + x, gA + offset + x, sizeof(float4));
        __pipeline_memcpy_async(B + x, gB + offset + x, sizeof(float4));
#endif
    }
    __pipeline_commit();
    __pipeline_wait_prior(0);  // this thread's copies have landed; __syncthreads() does the rest
}

// Forward: FlashAttention-2 Algorithm 1. One block per (Q tile i, batch*head); one query row per
// TPR threads, each holding a 1/TPR slice of the row (float4s t, t+TPR, t+2*TPR, ...: the
// interleave keeps a warp's shared-memory reads on distinct banks). The scale 1/sqrt(d) and
// log2(e) are folded into q once, so scores come out in log2 units and exp(x) is exp2f(x).
// Threads past the last row load that row (the clamp), compute alongside, and write nothing.
template <int D, int TPR>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM)
flash_forward_kernel(const float4* __restrict__ Q, const float4* __restrict__ K,
                     const float4* __restrict__ V, float4* __restrict__ O, float* __restrict__ L,
                     int q_len, int kv_len, bool causal, int Bc, int n_q_tiles, float scale_log2) {
    constexpr int C = D / 4 / TPR, Br = kThreads / TPR;  // C: float4s of a row one thread holds
    extern __shared__ float4 smem[];
    float4 *Kj = smem, *Vj = smem + Bc * (D / 4);      // K_j, V_j: (Bc, D/4) each
    // Line 3's loop over the Q tiles is the grid: one block per Q_i, the longest (causal) first.
    const int q0 = (n_q_tiles - 1 - blockIdx.x % n_q_tiles) * Br;
    const int i = q0 + threadIdx.x / TPR, t = threadIdx.x % TPR, diag = kv_len - q_len;
    const size_t bh = blockIdx.x / n_q_tiles, row = (bh * q_len + min(i, q_len - 1)) * (D / 4) + t;
    float4 q[C], o[C] = {};                            // line 5: O_i = 0, in registers
    float m = -INFINITY, l = 0.f;                      // line 5: row max m (log2 units), sum l
    for (int c = 0; c < C; c++) q[c] = scale4(Q[row + c * TPR], scale_log2);  // line 4: Q_i
    // Causal: query i sees keys j <= i + diag. Tiles past the block's last row's last key: skipped.
    const int kv_end = causal ? min(kv_len, min(q0 + Br, q_len) + diag) : kv_len;
    for (int j0 = 0; j0 < kv_end; j0 += Bc) {          // line 6: for each K_j, V_j
        __syncthreads();                               // everyone is done with the last tile
        load_tiles<D>(Kj, K, Vj, V, (bh * kv_len + j0) * (D / 4), min(Bc, kv_end - j0));  // line 7
        __syncthreads();
        for (int j = 0; j < min(Bc, kv_end - j0); j++) {  // lines 8-10, one key (column) at a time
            float s = 0.f;                             // line 8: S_ij = Q_i K_j^T
            for (int c = 0; c < C; c++) s += dot4(q[c], Kj[j * (D / 4) + t + c * TPR]);
            s = row_sum<TPR>(s);
            const bool seen = !causal || j0 + j <= i + diag;
            if (seen && s > m) {                       // lines 9-10: a new row max m: rescale
                const float alpha = exp2f(m - s);      // l and O_i by exp(m_old - m_new)
                l *= alpha;
                for (int c = 0; c < C; c++) o[c] = scale4(o[c], alpha);
                m = s;
            }
            const float p = seen ? exp2f(s - m) : 0.f;  // line 9: P_ij = exp(S_ij - m)
            l += p;                                     // line 9: l += rowsum(P_ij)
            for (int c = 0; c < C; c++) axpy4(o[c], p, Vj[j * (D / 4) + t + c * TPR]);  // line 10
        }
    }
    // Lines 12-15: O_i = O_i / l and L_i = m + log(l), written once; a row that saw no key (l = 0)
    // gets O = 0 and L = -inf. m is in log2 units, so L = (m + log2(l)) * ln(2).
    if (i >= q_len) return;
    for (int c = 0; c < C; c++) O[row + c * TPR] = scale4(o[c], l > 0.f ? 1.f / l : 0.f);
    if (t == 0) L[bh * q_len + i] = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
}

// Backward, kernel 1 of 2: dQ (FlashAttention-2 Algorithm 2, the dQ half). One block per
// (Q tile, batch*head), one query row per TPR threads, holding q, dO_i and dQ_i in registers
// while K_j, V_j stream through shared memory. It also writes D_i = rowsum(dO_i * O_i), which
// kernel 2 reads. No atomics: each dQ row is summed by the threads that own it, in key order.
template <int D, int TPR>
__global__ void __launch_bounds__(kThreads, 3)
flash_backward_dq_kernel(const float4* __restrict__ Q, const float4* __restrict__ K,
                         const float4* __restrict__ V, const float4* __restrict__ O,
                         const float4* __restrict__ dO, const float* __restrict__ L,
                         float* __restrict__ Dsum, float4* __restrict__ dQ, int q_len, int kv_len,
                         bool causal, int n_q_tiles, float scale_log2) {
    constexpr int C = D / 4 / TPR, B = kThreads / TPR;  // the block's Q tile and K/V tiles: B rows
    extern __shared__ float4 smem[];
    float4 *Kj = smem, *Vj = smem + B * (D / 4);       // (B, D/4) each
    const int q0 = (n_q_tiles - 1 - blockIdx.x % n_q_tiles) * B;  // longest causal tiles first
    const int i = q0 + threadIdx.x / TPR, t = threadIdx.x % TPR, diag = kv_len - q_len;
    const size_t bh = blockIdx.x / n_q_tiles, row = (bh * q_len + min(i, q_len - 1)) * (D / 4) + t;
    float4 q[C], dOi[C], dq[C] = {};
    float Di = 0.f;
    for (int c = 0; c < C; c++) q[c] = scale4(Q[row + c * TPR], scale_log2);
    for (int c = 0; c < C; c++) dOi[c] = dO[row + c * TPR];
    for (int c = 0; c < C; c++) Di += dot4(dOi[c], O[row + c * TPR]);
    Di = row_sum<TPR>(Di);                             // D_i = rowsum(dO_i * O_i)
    if (i < q_len && t == 0) Dsum[bh * q_len + i] = Di;
    const float Li = L[bh * q_len + min(i, q_len - 1)] * kLog2e;  // log2 units, like q K^T
    const int kv_end = causal ? min(kv_len, min(q0 + B, q_len) + diag) : kv_len;
    for (int j0 = 0; j0 < kv_end; j0 += B) {
        __syncthreads();
        load_tiles<D>(Kj, K, Vj, V, (bh * kv_len + j0) * (D / 4), min(B, kv_end - j0));
        __syncthreads();
        for (int j = 0; j < min(B, kv_end - j0); j++) {
            float s = 0.f, dp = 0.f;                   // S_ij = q K_j^T, dP_ij = dO_i V_j^T
            for (int c = 0; c < C; c++) s += dot4(q[c], Kj[j * (D / 4) + t + c * TPR]);
            for (int c = 0; c < C; c++) dp += dot4(dOi[c], Vj[j * (D / 4) + t + c * TPR]);
            s = row_sum<TPR>(s);                       // every thread of the row must take part
            dp = row_sum<TPR>(dp);                     // in a shuffle: never inside a branch
            const float P = !causal || j0 + j <= i + diag ? exp2f(s - Li) : 0.f;  // from L_i
            const float dS = P * (dp - Di);            // dS_ij = P_ij (dP_ij - D_i)
            for (int c = 0; c < C; c++) axpy4(dq[c], dS, Kj[j * (D / 4) + t + c * TPR]);  // dQ_i +=
        }
    }
    for (int c = 0; c < C && i < q_len; c++) dQ[row + c * TPR] = scale4(dq[c], rsqrtf(D));
}

// Backward, kernel 2 of 2: dK and dV. One block per (K/V tile, batch*head), one key per TPR
// threads, holding k, v, dK_j and dV_j in registers while Q_i and dO_i stream through shared
// memory. No atomics: each key's sums are owned by its threads, in query order. k, v, dK, dV and
// the Q_i, dO_i slices just read take ~220 registers: two blocks per SM, no spills.
template <int D, int TPR>
__global__ void __launch_bounds__(kThreads, 2)
flash_backward_dkdv_kernel(const float4* __restrict__ Q, const float4* __restrict__ K,
                           const float4* __restrict__ V, const float4* __restrict__ dO,
                           const float* __restrict__ L, const float* __restrict__ Dsum,
                           float4* __restrict__ dK, float4* __restrict__ dV, int q_len,
                           int kv_len, bool causal, int n_kv_tiles, float scale_log2) {
    constexpr int C = D / 4 / TPR, B = kThreads / TPR;  // the block's K/V tile and Q tiles: B rows
    extern __shared__ float4 smem[];
    float4 *Qi = smem, *dOi = smem + B * (D / 4);      // (B, D/4) each
    const int k0 = blockIdx.x % n_kv_tiles * B;
    const int j = k0 + threadIdx.x / TPR, t = threadIdx.x % TPR, diag = kv_len - q_len;
    const size_t bh = blockIdx.x / n_kv_tiles;
    const size_t row = (bh * kv_len + min(j, kv_len - 1)) * (D / 4) + t;  // past the end: as dQ
    float4 k[C], v[C], dk[C] = {}, dv[C] = {};
    for (int c = 0; c < C; c++) k[c] = K[row + c * TPR];
    for (int c = 0; c < C; c++) v[c] = V[row + c * TPR];
    // Causal: key j is seen by queries i >= j - diag: Q tiles before the block's first, skipped.
    for (int i0 = causal ? max(0, k0 - diag) : 0; i0 < q_len; i0 += B) {
        __syncthreads();
        load_tiles<D>(Qi, Q, dOi, dO, (bh * q_len + i0) * (D / 4), min(B, q_len - i0));
        __syncthreads();
        for (int i = 0; i < min(B, q_len - i0); i++) {
            float s = 0.f, dp = 0.f;                   // S_ij = Q_i k^T, dP_ij = dO_i v^T
            for (int c = 0; c < C; c++) s += dot4(Qi[i * (D / 4) + t + c * TPR], k[c]);
            for (int c = 0; c < C; c++) dp += dot4(dOi[i * (D / 4) + t + c * TPR], v[c]);
            s = row_sum<TPR>(s) * scale_log2;          // shuffles: every thread of the row,
            dp = row_sum<TPR>(dp);                     // never inside a branch
            const float Lrow = L[bh * q_len + i0 + i] * kLog2e, Drow = Dsum[bh * q_len + i0 + i];
            const bool seen = j < kv_len && (!causal || j <= i0 + i + diag);
            const float P = seen ? exp2f(s - Lrow) : 0.f;  // P_ij recomputed from L_i
            const float dS = P * (dp - Drow);          // dS_ij = P_ij (dP_ij - D_i)
            for (int c = 0; c < C; c++) axpy4(dv[c], P, dOi[i * (D / 4) + t + c * TPR]);  // dV_j +=
            for (int c = 0; c < C; c++) axpy4(dk[c], dS, Qi[i * (D / 4) + t + c * TPR]);  // dK_j +=
        }
    }
    for (int c = 0; c < C && j < kv_len; c++) dK[row + c * TPR] = scale4(dk[c], rsqrtf(D));
    for (int c = 0; c < C && j < kv_len; c++) dV[row + c * TPR] = dv[c];
}

// ---------------------------------------------------------------------------------------------
// Launchers (host).

// The few device properties the tile rule reads, fetched one attribute at a time (fast, unlike
// cudaGetDeviceProperties, which can take milliseconds).
static cudaDeviceProp current_device_props() {
    int dev = 0, v = 0;
    FLASH_CUDA_CHECK(cudaGetDevice(&dev));
    cudaDeviceProp prop{};
    FLASH_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
    prop.sharedMemPerMultiprocessor = size_t(v);
    FLASH_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    prop.sharedMemPerBlockOptin = size_t(v);
    FLASH_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrReservedSharedMemoryPerBlock, dev));
    prop.reservedSharedMemPerBlock = size_t(v);
    FLASH_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxThreadsPerBlock, dev));
    prop.maxThreadsPerBlock = v;
    return prop;
}

// Blocks of the grid: tiles * batch * heads, in gridDim.x (whose limit, 2^31 - 1, is far above
// gridDim.y's 65535, so any batch * heads fits).
static int grid_blocks(const AttentionShape& s, int rows, int tile, const char* what) {
    const int tiles = (rows - 1) / tile + 1;
    require(tiles <= INT_MAX / s.batch / s.heads,  // checked before multiplying: no overflow
            std::string("shape: batch * heads * ceil(") + what + " / tile) exceeds the grid " +
                "limit " +
                std::to_string(INT_MAX));
    return tiles * s.batch * s.heads;
}

template <typename Kernel>
static void allow_shared(Kernel kernel, size_t bytes) {
    FLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(bytes)));
}

template <int D>
static void launch_forward(const float* Q, const float* K, const float* V, float* O, float* L,
                           const AttentionShape& s, const FlashTile& tile, cudaStream_t stream) {
    constexpr int TPR = threads_per_row(D, kForwardSlice);
    auto kernel = flash_forward_kernel<D, TPR>;
    const int n_q_tiles = (s.q_len + tile.Br - 1) / tile.Br;
    const int blocks = grid_blocks(s, s.q_len, tile.Br, "q_len");
    allow_shared(kernel, tile.shared_bytes);
    const float scale_log2 = kLog2e / std::sqrt(float(D));
    kernel<<<blocks, kThreads, tile.shared_bytes, stream>>>(
        reinterpret_cast<const float4*>(Q), reinterpret_cast<const float4*>(K),
        reinterpret_cast<const float4*>(V), reinterpret_cast<float4*>(O), L, s.q_len, s.kv_len,
        s.causal, tile.Bc, n_q_tiles, scale_log2);
    FLASH_CUDA_CHECK(cudaGetLastError());
}

static void forward_checked(const float* Q, const float* K, const float* V, float* O, float* L,
                            const AttentionShape& s, int Bc, cudaStream_t stream) {
    validate_shape(s);
    const Arg args[] = {{"Q", Q, q_elems(s), false}, {"K", K, kv_elems(s), false},
                        {"V", V, kv_elems(s), false}, {"O", O, q_elems(s), true},
                        {"L", L, l_elems(s), true}};
    validate_pointers("flash_forward", args);
    const cudaDeviceProp prop = current_device_props();
    FlashTile tile = flash_choose_tile(prop, s.head_dim);
    if (Bc > 0) {  // the caller's Bc, within what fits in the shared memory of one block
        const int max_bc = int(prop.sharedMemPerBlockOptin / (2 * s.head_dim * sizeof(float)));
        require(Bc <= max_bc, "Bc = " + std::to_string(Bc) + " is invalid; allowed values: 1 to " +
                                  std::to_string(max_bc) + " on this device at this head_dim");
        tile = make_tile(prop, s.head_dim, tile.threads_per_row, tile.Br, Bc);
    }
    switch (s.head_dim) {
        case 16: return launch_forward<16>(Q, K, V, O, L, s, tile, stream);
        case 32: return launch_forward<32>(Q, K, V, O, L, s, tile, stream);
        case 64: return launch_forward<64>(Q, K, V, O, L, s, tile, stream);
        case 96: return launch_forward<96>(Q, K, V, O, L, s, tile, stream);
        case 128: return launch_forward<128>(Q, K, V, O, L, s, tile, stream);
        case 256: return launch_forward<256>(Q, K, V, O, L, s, tile, stream);
    }
}

void flash_forward(const float* Q, const float* K, const float* V, float* O, float* L,
                   const AttentionShape& shape, cudaStream_t stream) {
    forward_checked(Q, K, V, O, L, shape, 0, stream);
}

void flash_forward_bc(const float* Q, const float* K, const float* V, float* O, float* L,
                      const AttentionShape& shape, int Bc, cudaStream_t stream) {
    validate_shape(shape);
    require(Bc >= 1, "Bc = " + std::to_string(Bc) + " is invalid; allowed values: 1 or more");
    forward_checked(Q, K, V, O, L, shape, Bc, stream);
}

template <int D>
static void launch_backward(const float* Q, const float* K, const float* V, const float* O,
                            const float* dO, const float* L, float* dQ, float* dK, float* dV,
                            const AttentionShape& s, const FlashTile& tile, cudaStream_t stream) {
    constexpr int TPR = threads_per_row(D, kBackwardSlice);
    const float scale_log2 = kLog2e / std::sqrt(float(D));
    const int n_q_tiles = (s.q_len + tile.Br - 1) / tile.Br;
    const int n_kv_tiles = (s.kv_len + tile.Bc - 1) / tile.Bc;
    const int q_blocks = grid_blocks(s, s.q_len, tile.Br, "q_len");
    const int kv_blocks = grid_blocks(s, s.kv_len, tile.Bc, "kv_len");
    auto dq_kernel = flash_backward_dq_kernel<D, TPR>;
    auto dkdv_kernel = flash_backward_dkdv_kernel<D, TPR>;
    allow_shared(dq_kernel, tile.shared_bytes);
    allow_shared(dkdv_kernel, tile.shared_bytes);
    float* Dsum = nullptr;  // D_i = rowsum(dO_i * O_i): (B, H, q_len), the only extra memory
    FLASH_CUDA_CHECK(cudaMallocAsync(&Dsum, l_elems(s) * sizeof(float), stream));
    auto f4 = [](const float* p) { return reinterpret_cast<const float4*>(p); };
    dq_kernel<<<q_blocks, kThreads, tile.shared_bytes, stream>>>(
        f4(Q), f4(K), f4(V), f4(O), f4(dO), L, Dsum, reinterpret_cast<float4*>(dQ), s.q_len,
        s.kv_len, s.causal, n_q_tiles, scale_log2);
    cudaError_t launch = cudaGetLastError();
    if (launch == cudaSuccess) {
        dkdv_kernel<<<kv_blocks, kThreads, tile.shared_bytes, stream>>>(
            f4(Q), f4(K), f4(V), f4(dO), L, Dsum, reinterpret_cast<float4*>(dK),
            reinterpret_cast<float4*>(dV), s.q_len, s.kv_len, s.causal, n_kv_tiles, scale_log2);
        launch = cudaGetLastError();
    }
    FLASH_CUDA_CHECK(cudaFreeAsync(Dsum, stream));  // stream-ordered: after both kernels
    FLASH_CUDA_CHECK(launch);
}

void flash_backward(const float* Q, const float* K, const float* V, const float* O,
                    const float* dO, const float* L, float* dQ, float* dK, float* dV,
                    const AttentionShape& s, cudaStream_t stream) {
    validate_shape(s);
    const Arg args[] = {{"Q", Q, q_elems(s), false},   {"K", K, kv_elems(s), false},
                        {"V", V, kv_elems(s), false},  {"O", O, q_elems(s), false},
                        {"dO", dO, q_elems(s), false}, {"L", L, l_elems(s), false},
                        {"dQ", dQ, q_elems(s), true},  {"dK", dK, kv_elems(s), true},
                        {"dV", dV, kv_elems(s), true}};
    validate_pointers("flash_backward", args);
    const FlashTile tile = flash_choose_tile_backward(current_device_props(), s.head_dim);
    switch (s.head_dim) {
        case 16: return launch_backward<16>(Q, K, V, O, dO, L, dQ, dK, dV, s, tile, stream);
        case 32: return launch_backward<32>(Q, K, V, O, dO, L, dQ, dK, dV, s, tile, stream);
        case 64: return launch_backward<64>(Q, K, V, O, dO, L, dQ, dK, dV, s, tile, stream);
        case 96: return launch_backward<96>(Q, K, V, O, dO, L, dQ, dK, dV, s, tile, stream);
        case 128: return launch_backward<128>(Q, K, V, O, dO, L, dQ, dK, dV, s, tile, stream);
        case 256: return launch_backward<256>(Q, K, V, O, dO, L, dQ, dK, dV, s, tile, stream);
    }
}
