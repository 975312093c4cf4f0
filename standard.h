// standard.h: standard attention, the baseline: what FlashAttention replaces. The way frameworks
// compute attention without it: cuBLAS GEMMs around softmax kernels, with the whole score matrix
// of every head, S and then P = softmax(S), (B*H, q_len, kv_len) floats, written to and read back
// from device memory (HBM). Read standard.cu beside flash.cu: the same math, in three passes over
// HBM instead of one. fp32 (chapter 1); a chapter 2 fp16 version would change the GEMM call and
// the element type, not the structure.
// Layouts as in flash.h: Q, O, dQ, dO (B, H, q_len, d); K, V, dK, dV (B, H, kv_len, d);
// L (B, H, q_len).
#pragma once

#include "flash.h"

#include <cublas_v2.h>

#include <stdexcept>
#include <string>

// Check a cuBLAS call: on failure throw std::runtime_error("<call> failed at file:line: <status>").
#define CUBLAS_CHECK(call)                                                                      \
    do {                                                                                        \
        cublasStatus_t cublas_status_ = (call);                                                 \
        if (cublas_status_ != CUBLAS_STATUS_SUCCESS)                                            \
            throw std::runtime_error(std::string(#call) + " failed at " + __FILE__ + ":" +      \
                                     std::to_string(__LINE__) + ": " +                          \
                                     cublasGetStatusString(cublas_status_));                    \
    } while (0)

// Keys that query row i sees: keys 0 .. visible_keys - 1 (the causal rule of flash.h; a row may
// see none).
__host__ __device__ inline int visible_keys(int i, int q_len, int kv_len, bool causal) {
    if (!causal) return kv_len;
    const int last = flash_last_key(i, q_len, kv_len);  // < kv_len, so last + 1 cannot overflow
    return last < 0 ? 0 : last + 1;
}

// Forward. P: a (B*H, q_len, kv_len) workspace; it holds P afterwards, which the backward needs
// (frameworks keep it for that). Fills O and L (natural-log logsumexp, as flash_forward's).
void standard_forward(cublasHandle_t cublas, const float* Q, const float* K, const float* V,
                      float* P, float* O, float* L, const AttentionShape& shape);

// Backward from the forward's P. dP: a second (B*H, q_len, kv_len) workspace, which becomes dS.
void standard_backward(cublasHandle_t cublas, const float* Q, const float* K, const float* V,
                       const float* dO, const float* P, float* dP, float* dQ, float* dK,
                       float* dV, const AttentionShape& shape);

// Row-major C (m, n) = alpha * op(A) (m, k) * op(B) (k, n), for `batch` matrices at the given
// strides (elements), with cuBLAS's fp32 SGEMM.
void gemm_rowmajor(cublasHandle_t cublas, bool trans_a, bool trans_b, int m, int n, int k,
                   float alpha, const float* A, long long stride_a, const float* B,
                   long long stride_b, float* C, long long stride_c, int batch);
