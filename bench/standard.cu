// standard.cu: standard attention, the baseline FlashAttention replaces (see standard.h). Forward:
//   S = Q K^T / sqrt(d)     a GEMM, S (B*H, q_len, kv_len) written to HBM
//   P = softmax(S), L       a row kernel: reads S, writes P over it (in HBM)
//   O = P V                 a GEMM, reads P back
// Backward: dV = P^T dO, dP = dO V^T (HBM again), dS = P o (dP - D), dQ = dS K, dK = dS^T Q.
// FlashAttention computes the same, tile by tile, without S, P or dP ever leaving the chip.
// Everything is templated on the element type T (float, __half or __nv_bfloat16): the GEMMs read
// and write T and sum in fp32; the row kernels read T, compute in fp32 and write T (L is always
// fp32).
#include "checks.h"
#include "standard.h"

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <stdexcept>

static constexpr int kRowThreads = 256;  // threads per block of the row kernels (one row each)

// ---------------------------------------------------------------------------------------------
// The row kernels, one block per row of S (one query row of one head).

__device__ inline float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Sum over the block; every thread gets it. blockDim.x must be a multiple of 32.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int warps = blockDim.x / 32;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = warp_sum(lane < warps ? partial[lane] : 0.f);
    __syncthreads();  // partial may be reused by the caller's next block_sum
    return v;
}

// Merge the softmax statistics (max m, sum l of exp(x - m)) of two sets of scores.
__device__ inline void softmax_merge(float& m, float& l, float m2, float l2) {
    const float M = fmaxf(m, m2);
    if (M == -INFINITY) return;  // both sets empty: keep (m, l) = (-inf, 0), avoid exp(nan)
    l = l * expf(m - M) + l2 * expf(m2 - M);
    m = M;
}

// P = softmax(S) in place, masked entries 0; L = logsumexp(row). S: (B*H, q_len, kv_len), already
// scaled by 1/sqrt(d) in the GEMM. L: (B*H, q_len). In fp16 and bf16, S arrives rounded to T by
// the GEMM (as in frameworks); max, sum and exp are fp32, and only P is rounded back to T.
template <typename T>
__global__ void softmax_forward_kernel(T* S, float* L, int q_len, int kv_len, bool causal) {
    const size_t row = blockIdx.x;
    const int visible = visible_keys(int(row % q_len), q_len, kv_len, causal);
    T* s = S + row * kv_len;

    // One pass for max and sum together (online softmax): each new maximum rescales the sum.
    float m = -INFINITY;
    float l = 0.f;
    for (int j = threadIdx.x; j < visible; j += blockDim.x) {
        const float x = to_float(s[j]);
        if (x > m) {
            l = l * expf(m - x) + 1.f;
            m = x;
        } else {
            l += expf(x - m);
        }
    }
    for (int offset = 16; offset > 0; offset >>= 1)
        softmax_merge(m, l, __shfl_xor_sync(0xffffffffu, m, offset),
                      __shfl_xor_sync(0xffffffffu, l, offset));
    __shared__ float part_m[32];
    __shared__ float part_l[32];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int warps = blockDim.x / 32;
    if (lane == 0) {
        part_m[warp] = m;
        part_l[warp] = l;
    }
    __syncthreads();
    m = -INFINITY;
    l = 0.f;
    for (int w = 0; w < warps; ++w) softmax_merge(m, l, part_m[w], part_l[w]);

    // A row that sees nothing has l = 0: it gets P = 0 (so O = 0) and L = -inf, as flash does.
    const float inv_l = visible > 0 ? 1.f / l : 0.f;
    for (int j = threadIdx.x; j < kv_len; j += blockDim.x)
        s[j] = from_float<T>(j < visible ? expf(to_float(s[j]) - m) * inv_l : 0.f);
    if (threadIdx.x == 0) L[row] = visible > 0 ? m + logf(l) : -INFINITY;
}

// dS = P o (dP - D), in place over dP, where D = rowsum(dP o P) (which equals rowsum(dO o O), the
// D of FlashAttention's backward). P, dP: (B*H, q_len, kv_len). D and dS are computed in fp32.
template <typename T>
__global__ void softmax_backward_kernel(const T* P, T* dP, int kv_len) {
    const size_t row = blockIdx.x;
    const T* p = P + row * kv_len;
    T* ds = dP + row * kv_len;
    float acc = 0.f;
    for (int j = threadIdx.x; j < kv_len; j += blockDim.x) acc += to_float(p[j]) * to_float(ds[j]);
    const float D = block_sum(acc);
    for (int j = threadIdx.x; j < kv_len; j += blockDim.x)
        ds[j] = from_float<T>(to_float(p[j]) * (to_float(ds[j]) - D));
}

// ---------------------------------------------------------------------------------------------
// Host

// cuBLAS's name for each element type.
template <typename T> struct CublasType;
template <> struct CublasType<float> { static constexpr cudaDataType_t value = CUDA_R_32F; };
template <> struct CublasType<__half> { static constexpr cudaDataType_t value = CUDA_R_16F; };
template <> struct CublasType<__nv_bfloat16> {
    static constexpr cudaDataType_t value = CUDA_R_16BF;
};

// cuBLAS is column-major, and a row-major matrix is its column-major transpose, so we ask for
// C^T = op(B)^T op(A)^T: the operands and m, n swap, the transpose flags stay. The leading
// dimension of a row-major matrix is its number of columns as stored.
// One call for every type: GemmStridedBatchedEx with A, B, C of type T and CUBLAS_COMPUTE_32F
// (fp32 sums; alpha and beta are then floats). For float this is the same plain fp32 math as
// cublasSgemmStridedBatched under the handle's default math mode (TF32 would need
// CUBLAS_COMPUTE_32F_FAST_TF32 or CUBLAS_TF32_TENSOR_OP_MATH; bench.cu leaves both off); for
// __half and __nv_bfloat16 cuBLAS runs 16-bit products with fp32 accumulation on the tensor
// cores.
template <typename T>
void gemm_rowmajor(cublasHandle_t cublas, bool trans_a, bool trans_b, int m, int n, int k,
                   float alpha, const T* A, long long stride_a, const T* B, long long stride_b,
                   T* C, long long stride_c, int batch) {
    const float beta = 0.f;
    const cudaDataType_t type = CublasType<T>::value;
    const int lda = trans_a ? m : k;
    const int ldb = trans_b ? k : n;
    const int ldc = n;
    CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        cublas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k,
        &alpha, B, type, ldb, stride_b, A, type, lda, stride_a, &beta, C, type, ldc, stride_c,
        batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

static int row_blocks(const AttentionShape& s) {  // one block per query row of every head
    if (l_elems(s) > size_t(INT_MAX))
        throw std::invalid_argument("batch * heads * q_len exceeds the grid limit");
    return int(l_elems(s));
}

// Per head: Q, O (q_len, d); K, V (kv_len, d); S, P (q_len, kv_len). The GEMMs run over all
// B*H heads at once (strided batched), each head's matrices `stride` elements apart.
struct Strides {
    long long q, kv, s;
    explicit Strides(const AttentionShape& sh)
        : q((long long)sh.q_len * sh.head_dim),
          kv((long long)sh.kv_len * sh.head_dim),
          s((long long)sh.q_len * sh.kv_len) {}
};

template <typename T>
void standard_forward(cublasHandle_t cublas, const T* Q, const T* K, const T* V, T* P, T* O,
                      float* L, const AttentionShape& s) {
    const int q = s.q_len, kv = s.kv_len, d = s.head_dim, heads = s.batch * s.heads;
    const Strides st(s);
    const float scale = 1.f / std::sqrt(float(d));
    // S = Q K^T / sqrt(d): (B*H, q_len, kv_len), written to P's memory
    gemm_rowmajor(cublas, false, true, q, kv, d, scale, Q, st.q, K, st.kv, P, st.s, heads);
    // P = softmax(S) in place, and L: (B*H, q_len)
    softmax_forward_kernel<T><<<row_blocks(s), kRowThreads>>>(P, L, q, kv, s.causal);
    FLASH_CUDA_CHECK(cudaGetLastError());
    // O = P V: (B*H, q_len, d)
    gemm_rowmajor(cublas, false, false, q, d, kv, 1.f, P, st.s, V, st.kv, O, st.q, heads);
}

template <typename T>
void standard_backward(cublasHandle_t cublas, const T* Q, const T* K, const T* V, const T* dO,
                       const T* P, T* dP, T* dQ, T* dK, T* dV, const AttentionShape& s) {
    const int q = s.q_len, kv = s.kv_len, d = s.head_dim, heads = s.batch * s.heads;
    const Strides st(s);
    const float scale = 1.f / std::sqrt(float(d));
    // dV = P^T dO: (B*H, kv_len, d)
    gemm_rowmajor(cublas, true, false, kv, d, q, 1.f, P, st.s, dO, st.q, dV, st.kv, heads);
    // dP = dO V^T: (B*H, q_len, kv_len)
    gemm_rowmajor(cublas, false, true, q, kv, d, 1.f, dO, st.q, V, st.kv, dP, st.s, heads);
    // dS = P o (dP - D), in place over dP
    softmax_backward_kernel<T><<<row_blocks(s), kRowThreads>>>(P, dP, kv);
    FLASH_CUDA_CHECK(cudaGetLastError());
    // dQ = dS K / sqrt(d): (B*H, q_len, d); dK = dS^T Q / sqrt(d): (B*H, kv_len, d)
    gemm_rowmajor(cublas, false, false, q, d, kv, scale, dP, st.s, K, st.kv, dQ, st.q, heads);
    gemm_rowmajor(cublas, true, false, kv, d, q, scale, dP, st.s, Q, st.q, dK, st.kv, heads);
}

// The three element types there are: fp32 (chapter 1), fp16 and bf16 (chapter 2).
#define STANDARD_INSTANTIATE(T)                                                                 \
    template void gemm_rowmajor<T>(cublasHandle_t, bool, bool, int, int, int, float, const T*,  \
                                   long long, const T*, long long, T*, long long, int);         \
    template void standard_forward<T>(cublasHandle_t, const T*, const T*, const T*, T*, T*,     \
                                      float*, const AttentionShape&);                           \
    template void standard_backward<T>(cublasHandle_t, const T*, const T*, const T*, const T*,  \
                                       const T*, T*, T*, T*, T*, const AttentionShape&);
STANDARD_INSTANTIATE(float)
STANDARD_INSTANTIATE(__half)
STANDARD_INSTANTIATE(__nv_bfloat16)
