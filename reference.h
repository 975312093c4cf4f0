// reference.h: the CPU reference (reference.cpp), the ground truth the tests and flash_bench check
// the GPU against. Not part of the library (the Makefile's FLASH_OBJS has no reference.o): the
// same contract as flash.h's calls, on host pointers, every sum accumulated in double. A bad shape
// is refused as the GPU calls refuse it (checks.h's validate_shape).
#pragma once

#include "flash.h"

#include <functional>

void attention_reference(const float* Q, const float* K, const float* V, float* O, float* L,
                         const AttentionShape& shape);
void attention_reference(const double* Q, const double* K, const double* V, double* O, double* L,
                         const AttentionShape& shape);
void attention_reference_backward(const float* Q, const float* K, const float* V, const float* O,
                                  const float* dO, const float* L, float* dQ, float* dK, float* dV,
                                  const AttentionShape& shape);
void attention_reference_backward(const double* Q, const double* K, const double* V,
                                  const double* O, const double* dO, const double* L, double* dQ,
                                  double* dK, double* dV, const AttentionShape& shape);
// How many threads the reference shares its rows out over: 0 (the default) for
// std::thread::hardware_concurrency(). The results are the same, bit for bit, for any number.
void attention_reference_threads(unsigned threads);
// Runs body(k) for k = 0 .. n-1 over those threads, as the reference shares out its rows (a plain
// loop below a million multiply-adds of `work`): for a test's own reference, each k writing only
// its own outputs, so that the results are a plain loop's, bit for bit.
void attention_reference_for_each(size_t n, double work, const std::function<void(size_t)>& body);

// ---------------------------------------------------------------------------------------------
// The reference for attention as models call it (chapter 5), in double: FlashAttention-2's score
// changes and masks (flash_attn_func's softmax_scale, window_size, softcap and alibi_slopes),
// grouped K/V heads, any strides, packed sequences of their own lengths (flash_attn_varlen_func's
// cu_seqlens), and a K/V cache of ragged lengths, paged or not (flash_attn_with_kvcache's
// cache_seqlens and block_table; forward only). For query row i of a sequence with
// q_len rows and kv_len keys, i' = i + kv_len - q_len (the bottom-right alignment), key j:
//   s_ij = scale Q_i . K_j                          scale = softmax_scale, or 1/sqrt(d) when 0
//   s_ij = softcap tanh(s_ij / softcap)             where softcap > 0
//   s_ij = s_ij - slope_h |i' - j|                  where alibi_slopes is given (one per head,
//                                                    or per batch and head)
//   visible iff i' - window_left <= j <= i' + window_right   (-1: no bound on that side;
//                                                    causal bounds the right at 0)
//   L_i = log sum_{visible j} exp(s_ij)   O_i = sum_{visible j} exp(s_ij - L_i) V_j
// A row that sees no key gets O_i = 0 and L_i = -inf, and gives nothing backward.
struct ReferenceStrides {   // in elements; the last dimension (head_dim) is contiguous
    long long batch = 0, head = 0, row = 0;
};
struct ReferenceProblem {
    int batch = 0, heads = 0, kv_heads = 0, head_dim = 0;  // kv_heads 0: heads
    int q_len = 0, kv_len = 0;  // every sequence's lengths (dense); unused with cu_seqlens
    // Packed sequences: sequence b's rows are cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of Q, O,
    // dO, dQ (its keys likewise of K, V, dK, dV), batch + 1 non-decreasing offsets from 0; the
    // batch strides are then unused, and L is [heads][total_q] (FlashAttention-2's softmax_lse).
    const int* cu_seqlens_q = nullptr;
    const int* cu_seqlens_k = nullptr;
    // A K/V cache (FlashAttention-2's flash_attn_with_kvcache; forward only, not with cu_seqlens):
    // cache_seqlens[b] (batch of them): sequence b's keys are rows 0 .. cache_seqlens[b] - 1 of its
    // cache (kv_len, the cache's rows, is then their bound). Paged (vLLM's block table), where
    // block_table is given: key j of sequence b is row j % page_size of page
    // block_table[b * pages_per_seq + j / page_size], page p's rows starting p * k.batch elements
    // on (V's: p * v.batch); the batch strides are then the pages'.
    const int* cache_seqlens = nullptr;
    const int* block_table = nullptr;
    int page_size = 0, pages_per_seq = 0;
    bool causal = false;
    double softmax_scale = 0.0;
    int window_left = -1, window_right = -1;
    double softcap = 0.0;
    const double* alibi_slopes = nullptr;  // [heads] ([batch][heads] where alibi_per_batch), or none
    bool alibi_per_batch = false;
    const double *Q = nullptr, *K = nullptr, *V = nullptr, *dO = nullptr;
    double *O = nullptr, *L = nullptr, *dQ = nullptr, *dK = nullptr, *dV = nullptr;
    ReferenceStrides q, k, v, o, dq, dk, dv, d_o;  // Q's, K's, ... strides (do: dO's)
};
// The contiguous strides of [batch][heads][len][head_dim].
ReferenceStrides reference_contiguous(int heads, int len, int head_dim);
// Forward: O and L. Backward: dQ, dK and dV from Q, K, V and dO (it recomputes the forward's
// statistics itself). Bad fields throw std::invalid_argument naming them, before anything is
// written.
void attention_reference_general(const ReferenceProblem& p);
void attention_reference_general_backward(const ReferenceProblem& p);
