// flash.h: the API of a minimal FlashAttention, forward and backward, in four chapters: 1 in fp32
// on the CUDA cores (flash.cu); 2 in fp16 and bf16 on the tensor cores (flash_fp16.cu); 3 the fp16
// and bf16 forward and backward on Hopper's own instructions (flash_hopper.cu,
// flash_hopper_backward.cu); 4 grouped K/V heads in every chapter, and split-KV decoding
// (flash_decode.cu); 5 attention as models call it: strides, packed batches of sequences of their
// own lengths, sliding windows, softcap, ALiBi and the softmax scale (AttentionOptions, below).
//
// Only what a user calls is here. Which chapter a call runs is decided in one place, the API layer
// lib/dispatch.cpp (flash_forward_fp16 / _bf16 are the only calls with a choice); every other call
// is one chapter's own. The library's inside (argument checks, element counts, launch helpers,
// FLASH_CUDA_CHECK): lib/checks.h, lib/checks.cpp. The CPU reference the tests and the demo check
// against: reference.h, reference.cpp. Tests: test_flash.cpp, tests/.
// Every call throws std::invalid_argument for bad input (before anything is launched) and
// std::runtime_error for a CUDA failure (with cudaGetErrorString and file:line).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <stdexcept>  // the exception types every call throws
#include <string>

struct AttentionShape {
    int batch, heads, q_len, kv_len, head_dim;
    bool causal;
    // K/V heads (chapter 4, grouped-query attention): query head h reads K/V head
    // h / (heads / kv_heads), so heads / kv_heads query heads share each K/V head. kv_heads must
    // divide heads; 1 is multi-query attention. 0 (the default) means kv_heads = heads, one K/V
    // head a query head, as in every chapter before 4.
    int kv_heads = 0;
};

// The shape's K/V heads: kv_heads, or heads where kv_heads is 0.
__host__ __device__ inline int flash_kv_heads(const AttentionShape& s) {
    return s.kv_heads == 0 ? s.heads : s.kv_heads;
}
// The query heads that share one K/V head (1 without GQA): query head h reads K/V head
// h / flash_kv_group(s).
__host__ __device__ inline int flash_kv_group(const AttentionShape& s) {
    return s.heads / flash_kv_heads(s);
}

// The causal rule, bottom-right aligned (as FlashAttention-2 >= 2.1): query i sees key j iff
// j <= flash_last_key(i, q_len, kv_len). With q_len == kv_len that is j <= i. In the API because
// it is the contract's rule as code, for a caller to mask with (bench/standard.h does). The one
// statement of the rule in the GPU code: every kernel and its tile-skipping bounds (lib/checks.h)
// use it (the CPU reference states it again on its own, on purpose: the ground truth shares no
// code with what it checks). (i - q_len) < 0 comes first, so the sum never overflows.
__host__ __device__ inline int flash_last_key(int i, int q_len, int kv_len) {
    return i - q_len + kv_len;
}

// ---------------------------------------------------------------------------------------------
// Chapter 1: fp32.

// Device pointers, float32, contiguous row-major. Q, O: [batch][heads][q_len][head_dim];
// K, V: [batch][kv_heads][kv_len][head_dim] (kv_heads: flash_kv_heads(shape)); L:
// [batch][heads][q_len].
// O = softmax(Q K^T / sqrt(head_dim)) V, row by row; L = natural-log logsumexp of each row of the
// scaled scores. Causal is bottom-right aligned: query i sees key j iff j <= i + kv_len - q_len.
// A row that sees no key gets O = 0 and L = -inf.
void flash_forward(const float* Q, const float* K, const float* V, float* O, float* L,
                   const AttentionShape& shape, cudaStream_t stream = 0);

// Given dO = dloss/dO, fills dQ, dK, dV (shaped as Q, K, V). O and L are the forward's outputs.
// Extra memory: D, B*H*q_len floats, scratch for the call (flash_release_scratch, below).
void flash_backward(const float* Q, const float* K, const float* V, const float* O,
                    const float* dO, const float* L, float* dQ, float* dK, float* dV,
                    const AttentionShape& shape, cudaStream_t stream = 0);

// ---------------------------------------------------------------------------------------------
// Chapter 2: fp16 and bf16.

// The same forward on tensor cores. Q, K, V, O are fp16 (__half), laid out as above; L stays fp32.
// The softmax statistics and every sum are fp32; only Q, K, V, O and P are rounded to fp16. Same
// contract as flash_forward. Needs a GPU of compute capability 8.0 or newer (A100, RTX 30/40,
// H100): on an older one it throws std::runtime_error. On compute capability 9.0 (H100, H200),
// at the head dims chapter 3 has (kFlashHopperHeadDims), it runs chapter 3's kernel
// (flash_forward_fp16_hopper, below); everywhere else, and on every GPU in a library built without
// chapter 3 (below), chapter 2's (flash_forward_fp16_ampere).
void flash_forward_fp16(const __half* Q, const __half* K, const __half* V, __half* O, float* L,
                        const AttentionShape& shape, cudaStream_t stream = 0);
// The fp16 backward: given dO, fills dQ, dK, dV (fp16, shaped as Q, K, V) from the forward's O
// and fp32 L. Deterministic (bitwise-identical gradients on every call: the one sum over blocks,
// dQ's, is added in a fixed order; with options, AttentionOptions::deterministic may drop it); P
// and dS are rounded to fp16 for the tensor-core products, every sum is fp32. Extra memory:
// flash_backward_fp16_scratch_bytes, scratch for the call
// (flash_release_scratch, below). Head dims and tile: see below. Like the forward, it runs chapter
// 3's backward on compute capability 9.0 at kFlashHopperHeadDims (flash_backward_fp16_hopper),
// chapter 2's everywhere else (flash_backward_fp16_ampere).
void flash_backward_fp16(const __half* Q, const __half* K, const __half* V, const __half* O,
                         const __half* dO, const float* L, __half* dQ, __half* dK, __half* dV,
                         const AttentionShape& shape, cudaStream_t stream = 0);
// The fp16 backward's extra device memory for this shape, in bytes: dQ summed in fp32
// (B*H*q_len*head_dim floats), D (B*H*q_len floats), turn counters for Q tiles of 32 rows, the
// smallest any device takes (B*H*ceil(q_len / 32) ints), and a ticket (an int): the same figure on
// every GPU. Throws as the backward does for a bad shape.
size_t flash_backward_fp16_scratch_bytes(const AttentionShape& shape);

// The same forward and backward in bf16 (__nv_bfloat16: fp32's 8-bit exponent, 8 bits of
// mantissa, where fp16 has 5 and 11): the very kernels of flash_fp16.cu, compiled for the other
// element type (mma.sync ... .bf16.bf16.f32). Same contract, same tiles, same extra memory
// (flash_backward_fp16_scratch_bytes) and the same compute capability 8.0 as the fp16 pair.
void flash_forward_bf16(const __nv_bfloat16* Q, const __nv_bfloat16* K, const __nv_bfloat16* V,
                        __nv_bfloat16* O, float* L, const AttentionShape& shape,
                        cudaStream_t stream = 0);
void flash_backward_bf16(const __nv_bfloat16* Q, const __nv_bfloat16* K, const __nv_bfloat16* V,
                         const __nv_bfloat16* O, const __nv_bfloat16* dO, const float* L,
                         __nv_bfloat16* dQ, __nv_bfloat16* dK, __nv_bfloat16* dV,
                         const AttentionShape& shape, cudaStream_t stream = 0);

// ---------------------------------------------------------------------------------------------
// Chapter 5: attention as models call it, FlashAttention-2's keyword arguments of flash_attn_func.
// With q_len rows, kv_len keys and i' = i + kv_len - q_len (the bottom-right alignment), the score
// of query i and key j is
//   s = softmax_scale (Q_i . K_j)             softmax_scale 0: 1/sqrt(head_dim)
//   s = softcap tanh(s / softcap)             where softcap > 0 (Gemma 2)
//   s = s - slope_h |i' - j|                  where alibi_slopes is given (BLOOM, MPT)
// and query i sees key j iff i' - window_left <= j <= i' + window_right (a bound of -1 leaves
// that side open; causal bounds the right at 0: causal with a window is (left, 0), Mistral's).
// O, L and the gradients are then as chapter 1's contract says, with these scores: L the
// natural-log logsumexp of each row's visible s, a row that sees no key O = 0, L = -inf.
//
// Where the rows are (strides, in elements): element x of row i of head h of batch b of a tensor
// lies at base[b * batch + h * head + i * row + x], the last dimension contiguous. A tensor whose
// three strides are all 0 (the default) is contiguous, [batch][heads][len][head_dim]. Given strides
// are each a multiple of 8 (so that every row is 16-byte aligned, as the base pointer is), 8 or
// more (the row stride head_dim or more) and below 2^39 (a dimension of one index: any, it is
// never used); an output's (O; dQ, dK,
// dV) place each element of it apart from every other. A view of one fused QKV projection, (batch,
// len, 3, heads, head_dim), is Q at base, K at base + heads * head_dim, V at base + 2 * heads *
// head_dim, each with strides {len * 3 * heads * head_dim, head_dim, 3 * heads * head_dim}. L stays
// contiguous. Where an argument check names a tensor's size, it is the span from its first element
// to its last.
struct TensorStrides {
    long long batch = 0, head = 0, row = 0;
};
struct AttentionLayout {
    TensorStrides Q, K, V, O, dO, dQ, dK, dV;  // the forward reads the first four only
};
// A packed batch (FlashAttention-2's flash_attn_varlen_func): shape.batch sequences of their own
// lengths, one after another. Sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1]
// - 1 of Q, O, dO and dQ, (total_q, heads, head_dim) tensors; its keys rows cu_seqlens_k[b] .. of
// K, V, dK and dV, (total_k, kv_heads, head_dim). Every rule above holds within each sequence
// (causal bottom-right at its own lengths). shape.q_len and kv_len are the longest sequence's
// (max_seqlen_q, max_seqlen_k: they size the grid). L is [heads][total_q]. A packed tensor's
// strides are its head and row strides (the batch stride is unused); all 0 is contiguous, rows
// heads * head_dim apart. cu_seqlens_q, _k: int32 device pointers, batch + 1 offsets, 0 first,
// non-decreasing (a sequence may be empty), the last total_q, total_k, no length above q_len,
// kv_len. The calls copy both to the host to check them: a packed call waits for the stream's
// earlier work, and cannot be captured in a CUDA graph.
struct PackedBatch {
    const int* cu_seqlens_q = nullptr;  // nullptr (both): not packed
    const int* cu_seqlens_k = nullptr;
    int total_q = 0, total_k = 0;       // rows of the packed Q and K
};
struct AttentionOptions {
    float softmax_scale = 0.f;  // 0 (1/sqrt(head_dim)) or 2^-32 to 2^16
    int window_left = -1, window_right = -1;  // >= -1 each
    float softcap = 0.f;        // 0 (none) or 2^-32 to 2^16
    // ALiBi: fp32 device pointer, a slope per query head ([heads]), or per batch and head
    // ([batch][heads]) where alibi_per_batch; 16-byte aligned, as every tensor. nullptr: none.
    // (A pointer does not carry its allocation's size: fewer slopes than that are read past
    // their end. The PyTorch op checks the tensor's shape.)
    const float* alibi_slopes = nullptr;
    bool alibi_per_batch = false;
    AttentionLayout layout;     // contiguous by default
    PackedBatch packed;         // none by default
    // The backward's dQ: true (the default) adds each dQ_i's parts in a fixed order, so that a
    // call's bits are the same every time; false lets chapter 3's blocks add them as they get
    // there (FlashAttention-2's deterministic=False; faster where blocks would wait for their
    // turn: head_dim 256), and dQ's last bits may then differ from call to call. False only
    // permits: chapter 3 with a window, softcap or ALiBi, chapters 1 and 2, the forward and the
    // decode keep their order and their bits.
    bool deterministic = true;
};
// The same calls with options. Options that change no score (every field but the layout its
// default, a window bound no row reaches, the default scale written out) run what the calls above
// run, bit for bit and in speed, with the layout's strides: chapter 3 or 2 (the decode only with
// every tensor contiguous; a strided short query runs chapter 3 or 2). Any other runs the chapter
// the calls above would run (the decode for a contiguous short query, chapter 3, or chapter 2),
// with the options as its tile policy (lib/mask_policy.cuh), head_dim in kFlashFp16HeadDims. A (Q
// tile, K/V tile) pair with no visible score is skipped, forward and backward: a window of w keys
// costs O(N w); the decode splits only the keys a window lets its rows see. A packed batch runs
// chapter 3 or 2, each sequence with the bits it would get alone there. Bad options throw
// std::invalid_argument naming the field, before anything is launched.
void flash_forward_fp16(const __half* Q, const __half* K, const __half* V, __half* O, float* L,
                        const AttentionShape& shape, const AttentionOptions& options,
                        cudaStream_t stream = 0);
void flash_forward_bf16(const __nv_bfloat16* Q, const __nv_bfloat16* K, const __nv_bfloat16* V,
                        __nv_bfloat16* O, float* L, const AttentionShape& shape,
                        const AttentionOptions& options, cudaStream_t stream = 0);
void flash_backward_fp16(const __half* Q, const __half* K, const __half* V, const __half* O,
                         const __half* dO, const float* L, __half* dQ, __half* dK, __half* dV,
                         const AttentionShape& shape, const AttentionOptions& options,
                         cudaStream_t stream = 0);
void flash_backward_bf16(const __nv_bfloat16* Q, const __nv_bfloat16* K, const __nv_bfloat16* V,
                         const __nv_bfloat16* O, const __nv_bfloat16* dO, const float* L,
                         __nv_bfloat16* dQ, __nv_bfloat16* dK, __nv_bfloat16* dV,
                         const AttentionShape& shape, const AttentionOptions& options,
                         cudaStream_t stream = 0);
// True iff every field is its default (deterministic aside: false only permits an unordered add,
// so a call that keeps the order honours it), the layout contiguous, nothing packed. (The calls
// also take a window bound no row reaches and the default scale written out for none: the rule
// above, lib/dispatch.cpp.)
bool flash_options_plain(const AttentionOptions& options);

// ---------------------------------------------------------------------------------------------
// Chapter 2's forward kernel (mma.sync) whatever the GPU: what flash_forward_fp16 / _bf16 run
// before compute capability 9.0, here so that one H100 can compare the two chapters.
void flash_forward_fp16_ampere(const __half* Q, const __half* K, const __half* V, __half* O,
                               float* L, const AttentionShape& shape, cudaStream_t stream = 0);
void flash_forward_bf16_ampere(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                               const __nv_bfloat16* V, __nv_bfloat16* O, float* L,
                               const AttentionShape& shape, cudaStream_t stream = 0);

// Chapter 3 (flash_hopper.cu): the same forward on Hopper's wgmma, TMA and warp specialisation
// (NOTES.md section 17). Same contract, element types and L as flash_forward_fp16 / _bf16;
// head_dim in kFlashHopperHeadDims (std::invalid_argument otherwise); a GPU of compute capability
// 9.0 (H100, H200), else std::runtime_error. flash_forward_fp16 / _bf16 run it there. Extra
// memory: a 4-byte tile counter, scratch for the call (flash_release_scratch, below). It needs
// nvcc's sm_90a target (CUDA 12.0 or newer); a library built without it (FLASH_NO_HOPPER: the
// Makefile sets it for an older nvcc, saying so) leaves chapter 3 out, and these two then check
// their arguments as above and throw std::runtime_error saying chapter 3 was not built.
void flash_forward_fp16_hopper(const __half* Q, const __half* K, const __half* V, __half* O,
                               float* L, const AttentionShape& shape, cudaStream_t stream = 0);
void flash_forward_bf16_hopper(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                               const __nv_bfloat16* V, __nv_bfloat16* O, float* L,
                               const AttentionShape& shape, cudaStream_t stream = 0);

// Chapter 3, part 3 (flash_hopper_fp8.cu): the forward in fp8, e4m3 (FlashAttention-3's fp8;
// NOTES.md section 24). Q, K, V are __nv_fp8_e4m3, contiguous [batch][heads (K, V: kv_heads)]
// [len][head_dim], each (batch, head) standing for its elements times a descale factor: descales
// are device float arrays, q [batch][heads], k and v [batch][kv_heads] (null: 1, as
// FlashAttention-3's descale_q, _k, _v). S = descale_q descale_k Q K^T / sqrt(d); P~ is rounded to
// e4m3 for P~ V; O = descale_v P~ V / l in bf16 or fp16 (the overload), L = m + log l in fp32.
// head_dim 64, 128 or 256, causal or not (no options), compute capability 9.0 (else
// std::runtime_error); bad arguments std::invalid_argument naming them, nothing launched. Extra
// memory, from the library's pool: V^T, batch * kv_heads * head_dim * round_up(kv_len, 32) bytes
// (at head_dim 128 and 256, 20 bytes more a column of each (batch, kv head): flash_fp8_centred_v).
struct Fp8Descales {
    const float* q = nullptr;  // [batch][heads], or none: 1
    const float* k = nullptr;  // [batch][kv_heads], or none
    const float* v = nullptr;  // [batch][kv_heads], or none
};
void flash_forward_fp8_hopper(const __nv_fp8_e4m3* Q, const __nv_fp8_e4m3* K,
                              const __nv_fp8_e4m3* V, __nv_bfloat16* O, float* L,
                              const AttentionShape& shape, const Fp8Descales& descales = {},
                              cudaStream_t stream = 0);
void flash_forward_fp8_hopper(const __nv_fp8_e4m3* Q, const __nv_fp8_e4m3* K,
                              const __nv_fp8_e4m3* V, __half* O, float* L,
                              const AttentionShape& shape, const Fp8Descales& descales = {},
                              cudaStream_t stream = 0);
// The keys of one K/V tile of the fp8 forward, by head dim. P~ is rounded against the running
// max as it stands after each tile, so the bits depend on it (tests/test_fp8.cpp's reference tiles
// the keys alike).
__host__ __device__ constexpr int flash_fp8_bc(int head_dim) {
    return head_dim == 128 ? 192 : head_dim > 0 ? 128 : 0;
}
// Whether the fp8 forward centres V's columns first (head dim 128 and 256, where O's sum over keys
// keeps one level, flash_hopper_fp8.cu's Fp8Sums, and centred columns keep it from growing with the
// row): V' = e4m3(V - mu), each (batch, kv head, column) its own mu, and O = mu + P~ V' / l
// (NOTES.md section 24).
__host__ __device__ constexpr bool flash_fp8_centred_v(int head_dim) { return head_dim >= 128; }
// A column's mu: the mean of its n values, clamped so that every |v - mu| <= 448 (e4m3's largest:
// V' never saturates). sum512 is the column's sum in units of 2^-9, which every e4m3 value is a
// whole number of (an exact sum, in any order); lo and hi its least and greatest value. The same
// arithmetic on the CPU and the GPU (IEEE division and rounding): the tests' reference repeats it.
__host__ __device__ inline float flash_fp8_centre(long long sum512, int n, float lo, float hi) {
    const float mean = float(double(sum512) / (512.0 * n));
    return fminf(fmaxf(mean, hi - 448.f), lo + 448.f);
}
// Where key j of a group of 32 sits in V^T's row (flash_hopper_fp8.cu's transpose): the fp8 P~
// that a thread's accumulators hold, read as wgmma's A fragment, takes its keys in this order.
__host__ __device__ constexpr int flash_fp8_v_slot(int j) {
    // A thread (t = lane % 4) holds keys 2t, 2t + 1, 2t + 8, 2t + 9 of each 16; A's fragment
    // wants k = 4t .. 4t + 3 of each 16: key 2t + e + 8h goes to slot 4t + 2h + e.
    return j / 16 * 16 + (j % 8) / 2 * 4 + (j % 16) / 8 * 2 + j % 2;
}
// Which of a thread's S accumulators (chapter 3's layout: index n is row g + 8 (n % 4 / 2), key
// 8 (n / 4) + 2t + n % 2 of the tile) goes to byte i of A register a for keys 32 kk .. 32 kk + 31
// (the fp8 A fragment: row g + 8 (a % 2), k 4t + i + 16 (a / 2)), given flash_fp8_v_slot's order.
__host__ __device__ constexpr int flash_fp8_p_index(int kk, int a, int i) {
    return 16 * kk + a / 2 * 8 + a % 2 * 2 + i / 2 * 4 + i % 2;
}

// The backwards of each chapter, whatever the GPU (flash_backward_fp16 / _bf16 pick one as the
// forward does: chapter 3's on compute capability 9.0 at kFlashHopperHeadDims, chapter 2's
// elsewhere). Same contract and extra memory (flash_backward_fp16_scratch_bytes) as
// flash_backward_fp16 / _bf16, bitwise deterministic each. _ampere: chapter 2's (mma.sync),
// compute capability 8.0 or newer. _hopper: chapter 3's (flash_hopper_backward.cu: wgmma, TMA,
// warp specialisation), head_dim in kFlashHopperHeadDims and compute capability 9.0, refused and
// not-built as the forward's _hopper calls.
void flash_backward_fp16_ampere(const __half* Q, const __half* K, const __half* V, const __half* O,
                                const __half* dO, const float* L, __half* dQ, __half* dK,
                                __half* dV, const AttentionShape& shape, cudaStream_t stream = 0);
void flash_backward_bf16_ampere(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                                const __nv_bfloat16* V, const __nv_bfloat16* O,
                                const __nv_bfloat16* dO, const float* L, __nv_bfloat16* dQ,
                                __nv_bfloat16* dK, __nv_bfloat16* dV, const AttentionShape& shape,
                                cudaStream_t stream = 0);
void flash_backward_fp16_hopper(const __half* Q, const __half* K, const __half* V, const __half* O,
                                const __half* dO, const float* L, __half* dQ, __half* dK,
                                __half* dV, const AttentionShape& shape, cudaStream_t stream = 0);
void flash_backward_bf16_hopper(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                                const __nv_bfloat16* V, const __nv_bfloat16* O,
                                const __nv_bfloat16* dO, const float* L, __nv_bfloat16* dQ,
                                __nv_bfloat16* dK, __nv_bfloat16* dV, const AttentionShape& shape,
                                cudaStream_t stream = 0);

// ---------------------------------------------------------------------------------------------
// Chapter 4 (flash_decode.cu): split-KV decoding (flash-decoding) for short queries against long
// keys, with grouped K/V heads (shape.kv_heads: GQA, MQA). The same contract as flash_forward_fp16
// (layouts, fp32 natural-log L, causal bottom-right, a row that sees no key: O = 0, L = -inf),
// for q_len from 1 to kFlashDecodeMaxQLen and head_dim in kFlashDecodeHeadDims
// (std::invalid_argument otherwise), any kv_len >= 1, kv_heads dividing heads. The query rows of
// a K/V group (heads / kv_heads heads, q_len rows each) read their K/V head together, and the keys
// are cut into `splits` runs of whole key tiles, a block each; each block writes a partial O_s
// (fp32) and L_s, and the last block of a K/V group to end merges them (one launch), L = log
// sum_s exp(L_s), O = sum_s exp(L_s - L) O_s, in a fixed order (deterministic), rounding O to
// fp16 / bf16 once. Compute capability 8.0
// or newer (cp.async), else std::runtime_error. Extra memory: flash_decode_scratch_bytes, scratch
// for the call (flash_release_scratch, below). flash_forward_fp16 / _bf16 run it for q_len <=
// kFlashDecodeMaxQLen (lib/dispatch.cpp).
constexpr int kFlashDecodeHeadDims[] = {64, 128, 256};
constexpr int kFlashDecodeMaxQLen = 8;
void flash_decode_fp16(const __half* Q, const __half* K, const __half* V, __half* O, float* L,
                       const AttentionShape& shape, cudaStream_t stream = 0);
void flash_decode_bf16(const __nv_bfloat16* Q, const __nv_bfloat16* K, const __nv_bfloat16* V,
                       __nv_bfloat16* O, float* L, const AttentionShape& shape,
                       cudaStream_t stream = 0);
// The same with the number of splits given by the caller instead of flash_decode_choose_splits'
// (like the _bc calls): splits from 1 to 2^24 - 1 (std::invalid_argument otherwise, outputs
// untouched). More
// splits than key tiles is allowed: those past the last key see none and add nothing.
void flash_decode_fp16_splits(const __half* Q, const __half* K, const __half* V, __half* O,
                              float* L, const AttentionShape& shape, int splits,
                              cudaStream_t stream = 0);
void flash_decode_bf16_splits(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                              const __nv_bfloat16* V, __nv_bfloat16* O, float* L,
                              const AttentionShape& shape, int splits, cudaStream_t stream = 0);
// The splits the calls without _splits take on this device (a pure host function, unit-tested on
// the CPU): one wave of blocks (the device's SMs times the blocks an SM holds at once), and no
// fewer blocks than SMs, over the blocks one split makes (batch * kv_heads * ceil(heads / kv_heads
// * q_len / 8)),
// each split a whole number of 64-key tiles (32 at head_dim 256) and at least 4 of them, so that
// the partials' traffic stays small beside K and V; at least 1.
int flash_decode_choose_splits(const cudaDeviceProp& prop, const AttentionShape& shape);
// The decode's extra device memory for this shape and splits, in bytes: O_s and L_s of every
// split, splits * batch * heads * q_len * (head_dim + 1) floats, then 8 bytes of alignment and an
// 8-byte counter for each (batch, K/V head, run of 8 of its group's rows): batch * kv_heads *
// ceil(heads / kv_heads * q_len / 8) of them. Throws std::invalid_argument for a bad shape or
// splits out of range.
size_t flash_decode_scratch_bytes(const AttentionShape& shape, int splits);

// Chapter 4, part 2: decoding from a K/V cache (FlashAttention-2's flash_attn_with_kvcache): each
// sequence has its own number of keys, the cache may be paged, and this call's new keys are
// appended first. shape: q_len 1 to kFlashDecodeMaxQLen, head_dim in kFlashDecodeHeadDims, kv_len
// the cache's rows a sequence (its capacity). K_cache and V_cache are:
//  - contiguous (block_table none): [batch][kv_heads][kv_len][head_dim];
//  - paged (vLLM's block table): [num_pages][kv_heads][page_size][head_dim]; key j of sequence b
//    is row j % page_size of page block_table[b * pages_per_seq + j / page_size], and kv_len must
//    be pages_per_seq * page_size.
// k_new and v_new ([batch][kv_heads][new_len][head_dim], or none where new_len is 0) are written
// into the cache at rows cache_seqlens[b] .. cache_seqlens[b] + new_len - 1 of sequence b, which
// then has cache_seqlens[b] + new_len keys; Q's q_len rows are its last ones (causal and windows
// bottom-right at that length). The options' scores and window apply (options: their layout and
// packed batch must be left empty). O and L as flash_decode_fp16's. The checks copy cache_seqlens
// and the block table to the host (they wait for the stream): each length from 0 to kv_len -
// new_len, each page the keys use below num_pages; std::invalid_argument names the entry, before
// anything is written. The keys are split for the lengths read (longer sequences in more
// blocks). On a stream being captured into a CUDA graph the checks cannot wait: the lengths and
// pages are then not checked, the kernels clamp each into its range (a bad entry reads the wrong
// keys, never memory outside the cache), and the keys are split for the cache's capacity (so a
// replay's bits can differ from a direct call's, within the rounding; each is deterministic).
struct KVCache {
    const int* cache_seqlens = nullptr;  // [batch], int32 on the device: keys before this call
    const int* block_table = nullptr;    // [batch][pages_per_seq], int32 on the device, or none
    int page_size = 0;                   // keys a page, a multiple of 16 (with block_table)
    int pages_per_seq = 0;               // the block table's columns
    int num_pages = 0;                   // pages in K_cache and V_cache
    int new_len = 0;                     // keys appended from k_new, v_new (0: none)
};
void flash_decode_kvcache_fp16(const __half* Q, __half* K_cache, __half* V_cache,
                               const __half* k_new, const __half* v_new, __half* O, float* L,
                               const AttentionShape& shape, const KVCache& cache,
                               const AttentionOptions& options = AttentionOptions{},
                               cudaStream_t stream = 0);
void flash_decode_kvcache_bf16(const __nv_bfloat16* Q, __nv_bfloat16* K_cache,
                               __nv_bfloat16* V_cache, const __nv_bfloat16* k_new,
                               const __nv_bfloat16* v_new, __nv_bfloat16* O, float* L,
                               const AttentionShape& shape, const KVCache& cache,
                               const AttentionOptions& options = AttentionOptions{},
                               cudaStream_t stream = 0);

// ---------------------------------------------------------------------------------------------
// Scratch. The backwards, and chapter 3's forward, take device memory for the duration of a call
// (each says how much) from a stream-ordered memory pool the library keeps on each device, and
// give it back to that pool, in stream order, when the call's kernels are done. The pool keeps
// what it has reserved for the next call (re-reserving it after every synchronisation, as the
// device's default pool does, cost the fp16 backward 8-20% at N = 1024 on an H100), so it holds
// as much as the largest call so far needed, at least 32 MiB, until this gives back all of it that
// no call is using (on the current device): synchronise the streams of earlier calls first, or
// what their scratch held may stay reserved.
void flash_release_scratch();

// ---------------------------------------------------------------------------------------------
// Head dims: each chapter's list of the head dims with a compiled kernel; anything else is
// refused. Chapter 2 has every one of chapter 1's (one kernel template covers them all).
constexpr int kFlashHeadDims[] = {16, 32, 64, 96, 128, 256};
constexpr int kFlashFp16HeadDims[] = {16, 32, 64, 96, 128, 256};
constexpr int kFlashHopperHeadDims[] = {64, 128, 256};
// True iff head_dim is one of kFlashHeadDims.
bool flash_head_dim_supported(int head_dim);
// "16, 32, 64, 96, 128, 256": for error messages.
std::string flash_head_dims_string();

// ---------------------------------------------------------------------------------------------
// The tile: how one thread block is laid out. See NOTES.md, "The tile". The queries and the _bc
// calls below are API, not inside: they are how a caller measures what the tile choice is worth.
struct FlashTile {
    int Br;               // query rows per Q tile
    int Bc;               // keys per K/V tile
    int threads;          // threads per block
    int threads_per_row;  // threads that share one row of a tile (chapter 2: the 4 of an mma quad)
    size_t shared_bytes;  // dynamic shared memory per block, in bytes (what it holds: below)
};
// shared_bytes, chapter 1: 2 * Bc * head_dim floats, K_j and V_j (the backward's dK, dV pass:
// Q_i and dO_i, Br = Bc rows each). Chapter 2, in the element type (2 bytes) with every row
// padded by 8 elements (flash_fp16.cu's kPad): the forward's Q_i and two stages of K_j and V_j,
// Br + 4 * Bc rows of head_dim; the backward's K_j, V_j and two stages of Q_i and dO_i,
// 2 * Bc + 4 * Br rows of head_dim, then P^T and dS^T (Bc rows of Br each) and two stages of L_i
// and D_i (4 * Br floats).

// Chapter 1. The forward tile for this device and head_dim (a pure host function; unit-tested on
// the CPU), and the backward's (the same rule; its blocks keep four row vectors in registers, not
// two).
FlashTile flash_choose_tile(const cudaDeviceProp& prop, int head_dim);
FlashTile flash_choose_tile_backward(const cudaDeviceProp& prop, int head_dim);
// flash_forward with keys-per-tile Bc given by the caller instead of the device-derived choice.
// Bc must be in [1, the most that fits in shared memory].
void flash_forward_bc(const float* Q, const float* K, const float* V, float* O, float* L,
                      const AttentionShape& shape, int Bc, cudaStream_t stream = 0);

// Chapter 2's forward tile (Br = 128: 32 query rows per warp, 64 at head_dim 256; Bc = 128 to
// head_dim 64, 64 to 128, 32 at 256, halved where shared memory is short; see flash_fp16.cu), and
// flash_forward_fp16 with Bc (32, 64, or 128 to head_dim 64) given by the caller. The bf16 calls
// take the same tiles.
FlashTile flash_choose_tile_fp16(const cudaDeviceProp& prop, int head_dim);
void flash_forward_fp16_bc(const __half* Q, const __half* K, const __half* V, __half* O,
                           float* L, const AttentionShape& shape, int Bc, cudaStream_t stream = 0);
// The fp16 backward's tile, (Bc keys a K/V tile, Br query rows a Q tile), the first of a list
// whose block fits the device's shared memory: (128, 64) else (64, 64) at head_dim 32, 96, 128;
// (128, 128) else (128, 64) else (64, 64) at 64; (64, 64) else (64, 32) at 256; (64, 64) at 16.
// A warp per 16 keys (8 warps at 256). At d = 128 shared_bytes is 173 KiB with Bc = 128 and
// 121 KiB with 64, so a GPU with 99 KiB (sm_86, sm_89) gets the runtime_error there, as at 256.
// Throws as the forward's does.
FlashTile flash_choose_tile_fp16_backward(const cudaDeviceProp& prop, int head_dim);
// flash_backward_fp16 with Bc (64, or 128 from head_dim 32 to 128) given by the caller; Br is
// the list's first for that Bc that fits.
void flash_backward_fp16_bc(const __half* Q, const __half* K, const __half* V, const __half* O,
                            const __half* dO, const float* L, __half* dQ, __half* dK, __half* dV,
                            const AttentionShape& shape, int Bc, cudaStream_t stream = 0);
