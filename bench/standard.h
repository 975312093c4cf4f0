// standard.h: standard attention, the baseline: what FlashAttention replaces. The way frameworks
// compute attention without it: cuBLAS GEMMs around softmax kernels, with the whole score matrix
// of every head, S and then P = softmax(S), (B*H, q_len, kv_len) elements, written to and read
// back from device memory (HBM). Read standard.cu beside flash.cu: the same math, in three passes
// over HBM instead of one.
// Three element types, one code: fp32 (chapter 1: plain fp32 GEMMs on the CUDA cores), fp16 and
// bf16 (chapter 2: 16-bit GEMMs on the tensor cores, accumulated in fp32, S and P stored in the
// element type as frameworks store them). Only the element type changes, not the structure.
// Layouts as in flash.h: Q, O, dQ, dO (B, H, q_len, d); K, V, dK, dV (B, H, kv_len, d);
// L (B, H, q_len), always fp32.
#pragma once

#include "checks.h"
#include "flash.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// Check a cuBLAS call: on failure throw std::runtime_error("<call> failed at file:line: <status>"),
// as FLASH_CUDA_CHECK (checks.h) does for a CUDA call.
#define CUBLAS_CHECK(call) cublas_check((call), #call, __FILE__, __LINE__)
inline void cublas_check(cublasStatus_t status, const char* call, const char* file, int line) {
    if (status != CUBLAS_STATUS_SUCCESS)
        throw_failed_call(call, file, line, cublasGetStatusString(status));
}

// Keys that query row i sees: keys 0 .. visible_keys - 1 (the causal rule of flash.h; a row may
// see none).
__host__ __device__ inline int visible_keys(int i, int q_len, int kv_len, bool causal) {
    if (!causal) return kv_len;
    const int last = flash_last_key(i, q_len, kv_len);  // < kv_len, so last + 1 cannot overflow
    return last < 0 ? 0 : last + 1;
}

// The element types to and from fp32, where all arithmetic happens: widening is exact, narrowing
// rounds to nearest (even).
__host__ __device__ inline float to_float(float x) { return x; }
__host__ __device__ inline float to_float(__half x) { return __half2float(x); }
__host__ __device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __host__ __device__ inline T from_float(float x);
template <> __host__ __device__ inline float from_float<float>(float x) { return x; }
template <> __host__ __device__ inline __half from_float<__half>(float x) {
    return __float2half_rn(x);
}
template <> __host__ __device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Forward. P: a (B*H, q_len, kv_len) workspace; it holds P afterwards, which the backward needs
// (frameworks keep it for that). Fills O and L (natural-log logsumexp, as flash_forward's).
// T is float, __half or __nv_bfloat16 (instantiated for those three in standard.cu).
template <typename T>
void standard_forward(cublasHandle_t cublas, const T* Q, const T* K, const T* V, T* P, T* O,
                      float* L, const AttentionShape& shape);

// Backward from the forward's P. dP: a second (B*H, q_len, kv_len) workspace, which becomes dS.
template <typename T>
void standard_backward(cublasHandle_t cublas, const T* Q, const T* K, const T* V, const T* dO,
                       const T* P, T* dP, T* dQ, T* dK, T* dV, const AttentionShape& shape);

// Row-major C (m, n) = alpha * op(A) (m, k) * op(B) (k, n), for `batch` matrices at the given
// strides (elements), with cuBLAS's GemmStridedBatchedEx: inputs and output of type T, products
// summed in fp32 (for float: plain fp32 SGEMM math; for __half and __nv_bfloat16: the tensor
// cores).
template <typename T>
void gemm_rowmajor(cublasHandle_t cublas, bool trans_a, bool trans_b, int m, int n, int k,
                   float alpha, const T* A, long long stride_a, const T* B, long long stride_b,
                   T* C, long long stride_c, int batch);
