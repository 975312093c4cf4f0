// chapters.h: the library's inside between the API layer (lib/dispatch.cpp, which picks a
// chapter) and the chapters: each chapter's launch without its argument checks (the API layer has
// run them all: checking twice would cost a cudaPointerGetAttributes per tensor again), the
// dispatch rules, and the two passes both tensor-core backwards run around their kernel. The
// argument checks themselves are in checks.h.
#pragma once

#include "checks.h"

// Whether flash_forward_fp16 / _bf16 run chapter 3 on this device at this head dim rather than
// chapter 2: chapter 3 built (flash_hopper_built), compute capability 9.0 and a head dim in
// kFlashHopperHeadDims. The one statement of the dispatch rule (dispatch.cpp; the tests state it
// again on their own, to check it).
bool flash_forward_runs_hopper(const cudaDeviceProp& prop, int head_dim);
// False when the library was built with FLASH_NO_HOPPER (the Makefile sets it when nvcc has no
// sm_90a target, before CUDA 12.0): flash_hopper.cu is then left out, flash_forward_fp16 / _bf16
// run chapter 2 on every GPU and flash_forward_fp16_hopper / _bf16_hopper throw
// std::runtime_error saying chapter 3 was not built.
bool flash_hopper_built();

// Chapter 2 (flash_fp16.cu): checks the device (compute capability 8.0, shared memory for the
// tile; fn names the public call in the refusal), takes the device's tile and launches.
void flash_forward_ampere_launch(const char* fn, const cudaDeviceProp& prop, const __half* Q,
                                 const __half* K, const __half* V, __half* O, float* L,
                                 const AttentionShape& s, const Layout& lay, cudaStream_t stream,
                                 const AttentionOptions* options = nullptr);
void flash_forward_ampere_launch(const char* fn, const cudaDeviceProp& prop,
                                 const __nv_bfloat16* Q, const __nv_bfloat16* K,
                                 const __nv_bfloat16* V, __nv_bfloat16* O, float* L,
                                 const AttentionShape& s, const Layout& lay, cudaStream_t stream,
                                 const AttentionOptions* options = nullptr);
// Chapter 4 (flash_decode.cu): whether flash_forward_fp16 / _bf16 run the decode kernel for this
// shape on this device (q_len <= kFlashDecodeMaxQLen, head_dim in kFlashDecodeHeadDims, compute
// capability 8.0 and the block's shared memory), and its launch for the API layer, arguments
// checked: splits 0 for flash_decode_choose_splits' choice (of the keys the options let the rows
// see); options: chapter 5's (checked; contiguous tensors, no packed batch), or none.
bool flash_decode_runs(const cudaDeviceProp& prop, const AttentionShape& s);
void flash_decode_launch(const cudaDeviceProp& prop, const __half* Q, const __half* K,
                         const __half* V, __half* O, float* L, const AttentionShape& s,
                         int splits, cudaStream_t stream, const AttentionOptions* options = nullptr);
void flash_decode_launch(const cudaDeviceProp& prop, const __nv_bfloat16* Q,
                         const __nv_bfloat16* K, const __nv_bfloat16* V, __nv_bfloat16* O,
                         float* L, const AttentionShape& s, int splits, cudaStream_t stream,
                         const AttentionOptions* options = nullptr);
// Chapter 3 (flash_hopper.cu), for a device where flash_forward_runs_hopper is true; options:
// chapter 5's (checked), or none.
void flash_forward_hopper_launch(const __half* Q, const __half* K, const __half* V, __half* O,
                                 float* L, const AttentionShape& s, const Layout& lay,
                                 cudaStream_t stream, const AttentionOptions* options = nullptr);
void flash_forward_hopper_launch(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                                 const __nv_bfloat16* V, __nv_bfloat16* O, float* L,
                                 const AttentionShape& s, const Layout& lay, cudaStream_t stream,
                                 const AttentionOptions* options = nullptr);

// The backwards, the same way: chapter 2's (flash_fp16.cu; fn names the public call in its
// refusals) and chapter 3's (flash_hopper_backward.cu, where flash_backward_runs_hopper is true:
// the forward's rule).
bool flash_backward_runs_hopper(const cudaDeviceProp& prop, int head_dim);
void flash_backward_ampere_launch(const char* fn, const cudaDeviceProp& prop, const __half* Q,
                                  const __half* K, const __half* V, const __half* O,
                                  const __half* dO, const float* L, __half* dQ, __half* dK,
                                  __half* dV, const AttentionShape& s, const Layout& lay,
                                  cudaStream_t stream, const AttentionOptions* options = nullptr);
void flash_backward_ampere_launch(const char* fn, const cudaDeviceProp& prop,
                                  const __nv_bfloat16* Q, const __nv_bfloat16* K,
                                  const __nv_bfloat16* V, const __nv_bfloat16* O,
                                  const __nv_bfloat16* dO, const float* L, __nv_bfloat16* dQ,
                                  __nv_bfloat16* dK, __nv_bfloat16* dV, const AttentionShape& s,
                                  const Layout& lay, cudaStream_t stream,
                                  const AttentionOptions* options = nullptr);
void flash_backward_hopper_launch(const __half* Q, const __half* K, const __half* V,
                                  const __half* O, const __half* dO, const float* L, __half* dQ,
                                  __half* dK, __half* dV, const AttentionShape& s,
                                  const Layout& lay, cudaStream_t stream,
                                  const AttentionOptions* options = nullptr);
void flash_backward_hopper_launch(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                                  const __nv_bfloat16* V, const __nv_bfloat16* O,
                                  const __nv_bfloat16* dO, const float* L, __nv_bfloat16* dQ,
                                  __nv_bfloat16* dK, __nv_bfloat16* dV, const AttentionShape& s,
                                  const Layout& lay, cudaStream_t stream,
                                  const AttentionOptions* options = nullptr);

// The two passes around both backwards on tensor cores (lib/backward_passes.cu: chapter 2's
// launcher and chapter 3's run them around their kernels), in one scratch of
// flash_backward_fp16_scratch_bytes(s) (a packed batch's: its rows') laid out as below: the turns
// and the ticket zeroed, line 4 of Algorithm 2 (D = rowsum(dO o O)) before the kernel, and after
// it dQ = dQacc scale in T (S is unscaled in both kernels; scale: 1/sqrt(d), or the options'; a
// row whose L is -inf saw no key and gets 0). kernel(scratch) launches the backward kernel, which
// adds dQ's parts into dQacc in the ordered add's order (lib/ordered_add.cuh), and returns
// cudaGetLastError(); with options.deterministic false, dQacc zeroed too, for a kernel that adds
// every part in no order (chapter 3's). Throws the first CUDA error, as with_scratch does.
constexpr int kBackwardMinBr = 32;  // the fewest rows a Q tile of either backward takes
struct BackwardScratch {
    float* dQacc;      // dQ before its scale, fp32, B*H*q_len*d floats (packed: at least
                       // H*total_q*d), rows as the kernel puts them: the first add stores
                       // (zeroed, every block adding, where options.deterministic is false)
    int* turns;        // B*H*ceil(q_len / kBackwardMinBr) turn counters (one a query head and
                       // Q tile of kBackwardMinBr rows or more; packed: q_len the longest), zeroed
    int* next_ticket;  // the ticket counter, zeroed
    float* D;          // D_i of line 4, rows as L's (B*H*q_len floats; packed H*total_q)
};
using BackwardKernel = std::function<cudaError_t(const BackwardScratch&)>;
// options: chapter 5's (the dQ pass takes its scale; a packed batch's extents). lay: where O, dO
// and dQ's rows are (chapter 5's strides), and L's, which D's follow. acc: where the kernel puts
// dQacc's rows (in rows of head_dim floats): L's (nullptr: chapter 2), or another layout within
// the scratch's dQacc (chapter 3: [batch][heads][q_len], for a packed batch too).
void flash_backward_passes(const __half* O, const __half* dO, const float* L, __half* dQ,
                           const AttentionShape& s, const Layout& lay, cudaStream_t stream,
                           const BackwardKernel& kernel, const AttentionOptions& options = {},
                           const Rows* acc = nullptr);
void flash_backward_passes(const __nv_bfloat16* O, const __nv_bfloat16* dO, const float* L,
                           __nv_bfloat16* dQ, const AttentionShape& s, const Layout& lay,
                           cudaStream_t stream, const BackwardKernel& kernel,
                           const AttentionOptions& options = {}, const Rows* acc = nullptr);
