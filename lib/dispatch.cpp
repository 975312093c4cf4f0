// dispatch.cpp: the API layer's one decision, which chapter a public call runs. flash_forward_fp16
// and flash_forward_bf16 (flash.h) check their arguments, then run chapter 4's decode kernel
// (flash_decode.cu) for short queries where flash_decode_runs says so, chapter 3's forward
// (flash_hopper.cu) where flash_forward_runs_hopper says so and chapter 2's (flash_fp16.cu)
// everywhere else; flash_backward_fp16 / _bf16 the same, by the same rule (chapter 3's backward:
// flash_hopper_backward.cu). Every other public call is one chapter's own and lives in it:
// chapter 1's in flash.cu, chapter 2's (_ampere, _bc) in flash_fp16.cu, chapter 3's (_hopper) in
// flash_hopper.cu and flash_hopper_backward.cu; no chapter calls another's public calls (chapter
// 3's backward runs chapter 2's passes around its kernel, flash_backward_passes: lib/checks.h).
//
// Built with FLASH_NO_HOPPER (the Makefile sets it when nvcc has no sm_90a target, CUDA before
// 12.0, and then leaves flash_hopper.cu out), chapter 2 runs on every GPU and chapter 3's own
// calls, defined here instead, check their arguments and throw std::runtime_error saying chapter 3
// was not built.
#include "checks.h"
#include "chapters.h"
#include "flash.h"
#include "mask_policy.cuh"  // WindowMask::of (which window bounds reach no row), options_scale

#include <string>

// Whatever chapter 3 runs, chapter 2 has a kernel for too: the API checks a shape against
// kFlashFp16HeadDims before it picks a chapter.
static constexpr bool hopper_dims_in_fp16_dims() {
    for (int d : kFlashHopperHeadDims) {
        bool found = false;
        for (int e : kFlashFp16HeadDims) found = found || d == e;
        if (!found) return false;
    }
    return true;
}
static_assert(hopper_dims_in_fp16_dims(), "a head dim of chapter 3 that chapter 2 lacks");

bool flash_hopper_built() {
#ifdef FLASH_NO_HOPPER
    return false;
#else
    return true;
#endif
}

bool flash_forward_runs_hopper(const cudaDeviceProp& prop, int head_dim) {
    return flash_hopper_built() && prop.major == 9 && head_dim_in(head_dim, kFlashHopperHeadDims);
}
// The backward's rule is the forward's: one rule for both.
bool flash_backward_runs_hopper(const cudaDeviceProp& prop, int head_dim) {
    return flash_forward_runs_hopper(prop, head_dim);
}

// One chapter's launch, the arguments checked; lay: where the tensors' rows are (chapter 5).
template <typename T>
static void forward_run(const char* fn, const T* Q, const T* K, const T* V, T* O, float* L,
                        const AttentionShape& s, const Layout& lay, cudaStream_t stream) {
    const cudaDeviceProp prop = flash_device_props();
    // The decode rule (chapter 4): a short query (q_len <= kFlashDecodeMaxQLen, 8) runs the
    // split-KV decode kernel wherever it has the head dim and the device (flash_decode_runs):
    // chapters 2 and 3 give one block a (batch, head) and fill 1 to 8 of its 128 rows, and read
    // the keys with a block a head; the decode kernel splits the keys over the SMs. Same contract.
    // It reads contiguous tensors only, so far.
    if (flash_decode_runs(prop, s) && dense(lay, s, false))
        return flash_decode_launch(prop, Q, K, V, O, L, s, 0, stream);
#ifndef FLASH_NO_HOPPER
    if (flash_forward_runs_hopper(prop, s.head_dim))
        return flash_forward_hopper_launch(Q, K, V, O, L, s, lay, stream);
#endif
    flash_forward_ampere_launch(fn, prop, Q, K, V, O, L, s, lay, stream);
}
// Every check of the arguments (std::invalid_argument before anything touches the GPU but the
// pointer queries), then one chapter's launch. fn: the public call's name, for messages.
template <typename T>
static void forward_fp16_dispatch(const char* fn, const T* Q, const T* K, const T* V, T* O,
                                  float* L, const AttentionShape& s, cudaStream_t stream) {
    validate_shape(s, kFlashFp16HeadDims, sizeof(T));
    validate_forward_pointers(fn, Q, K, V, O, L, s);
    forward_run(fn, Q, K, V, O, L, s, contiguous_layout(s), stream);
}

void flash_forward_fp16(const __half* Q, const __half* K, const __half* V, __half* O, float* L,
                        const AttentionShape& shape, cudaStream_t stream) {
    forward_fp16_dispatch("flash_forward_fp16", Q, K, V, O, L, shape, stream);
}

void flash_forward_bf16(const __nv_bfloat16* Q, const __nv_bfloat16* K, const __nv_bfloat16* V,
                        __nv_bfloat16* O, float* L, const AttentionShape& shape,
                        cudaStream_t stream) {
    forward_fp16_dispatch("flash_forward_bf16", Q, K, V, O, L, shape, stream);
}

// The backward the same way: chapter 3's backward (flash_hopper_backward.cu) or chapter 2's
// (flash_fp16.cu).
template <typename T>
static void backward_run(const char* fn, const T* Q, const T* K, const T* V, const T* O,
                         const T* dO, const float* L, T* dQ, T* dK, T* dV,
                         const AttentionShape& s, const Layout& lay, cudaStream_t stream) {
    const cudaDeviceProp prop = flash_device_props();
#ifndef FLASH_NO_HOPPER
    if (flash_backward_runs_hopper(prop, s.head_dim))
        return flash_backward_hopper_launch(Q, K, V, O, dO, L, dQ, dK, dV, s, lay, stream);
#endif
    flash_backward_ampere_launch(fn, prop, Q, K, V, O, dO, L, dQ, dK, dV, s, lay, stream);
}
template <typename T>
static void backward_fp16_dispatch(const char* fn, const T* Q, const T* K, const T* V, const T* O,
                                   const T* dO, const float* L, T* dQ, T* dK, T* dV,
                                   const AttentionShape& s, cudaStream_t stream) {
    validate_shape(s, kFlashFp16HeadDims, sizeof(T));
    validate_backward_pointers(fn, Q, K, V, O, dO, L, dQ, dK, dV, s);
    backward_run(fn, Q, K, V, O, dO, L, dQ, dK, dV, s, contiguous_layout(s), stream);
}

void flash_backward_fp16(const __half* Q, const __half* K, const __half* V, const __half* O,
                         const __half* dO, const float* L, __half* dQ, __half* dK, __half* dV,
                         const AttentionShape& shape, cudaStream_t stream) {
    backward_fp16_dispatch("flash_backward_fp16", Q, K, V, O, dO, L, dQ, dK, dV, shape, stream);
}

void flash_backward_bf16(const __nv_bfloat16* Q, const __nv_bfloat16* K, const __nv_bfloat16* V,
                         const __nv_bfloat16* O, const __nv_bfloat16* dO, const float* L,
                         __nv_bfloat16* dQ, __nv_bfloat16* dK, __nv_bfloat16* dV,
                         const AttentionShape& shape, cudaStream_t stream) {
    backward_fp16_dispatch("flash_backward_bf16", Q, K, V, O, dO, L, dQ, dK, dV, shape, stream);
}

// Chapter 5: the calls with options. Options that change no score are the calls without, with
// the layout's strides (a bound of the window no row reaches, WindowMask::of's rule, and the
// default scale written out, are none: scores_plain); any other, and a packed batch, runs the
// chapter the plain calls run (the decode kernel for a short query, chapter 3, or chapter 2),
// with the options as its policy.
static bool changes_nothing(const AttentionOptions& o, const AttentionShape& s) {
    return !o.packed.cu_seqlens_q && scores_plain(o, s);
}
// The checks every call with options starts with: the shape, the options, the layout (a packed
// batch's as packed_strides fills it in, of its extents). Returns the tensors' extents: the
// shape, or a packed batch's one batch of total_q and total_k rows (packed_shape).
static AttentionShape validate_with_options(const char* fn, const AttentionShape& s,
                                            const AttentionOptions& o, int elem_bytes,
                                            bool backward) {
    validate_shape(s, kFlashFp16HeadDims, elem_bytes);
    validate_options(fn, o);
    validate_packed(fn, o.packed, s);
    if (!o.packed.cu_seqlens_q) {
        validate_layout(fn, o.layout, s, backward);
        return s;
    }
    const AttentionShape extent = packed_shape(s, o.packed);
    validate_shape(extent, kFlashFp16HeadDims, elem_bytes);
    validate_layout(fn, packed_strides(o.layout, s), extent, backward);
    return extent;
}
static Layout layout_with_options(const AttentionOptions& o, const AttentionShape& s) {
    return o.packed.cu_seqlens_q ? packed_layout(o.layout, s, o.packed) : layout_of(o.layout, s);
}
template <typename T>
static void forward_options_dispatch(const char* fn, const T* Q, const T* K, const T* V, T* O,
                                     float* L, const AttentionShape& s, const AttentionOptions& o,
                                     cudaStream_t stream) {
    const AttentionShape x = validate_with_options(fn, s, o, sizeof(T), false);  // the extents
    const Layout lay = layout_with_options(o, s);
    validate_forward_pointers(fn, Q, K, V, O, L, x, lay);
    if (changes_nothing(o, s)) return forward_run(fn, Q, K, V, O, L, s, lay, stream);
    if (o.alibi_slopes)  // the slopes against the outputs, which they must not overlap
        validate_pointers(fn, {alibi_arg(o, s), output_arg("O", O, span_elems(lay.O, x, x.q_len)),
                               output_arg("L", L, l_elems(x))});
    validate_packed_lengths(fn, o.packed, s, stream);  // (the last check: it waits for the stream)
    const cudaDeviceProp prop = flash_device_props();
    // The decode rule, as without options: contiguous tensors of one short query each.
    if (!o.packed.cu_seqlens_q && flash_decode_runs(prop, s) && dense(lay, s, false))
        return flash_decode_launch(prop, Q, K, V, O, L, s, 0, stream, &o);
#ifndef FLASH_NO_HOPPER
    if (flash_forward_runs_hopper(prop, s.head_dim))  // chapter 3 takes the policy too
        return flash_forward_hopper_launch(Q, K, V, O, L, s, lay, stream, &o);
#endif
    flash_forward_ampere_launch(fn, prop, Q, K, V, O, L, s, lay, stream, &o);
}
template <typename T>
static void backward_options_dispatch(const char* fn, const T* Q, const T* K, const T* V,
                                      const T* O, const T* dO, const float* L, T* dQ, T* dK,
                                      T* dV, const AttentionShape& s, const AttentionOptions& o,
                                      cudaStream_t stream) {
    const AttentionShape x = validate_with_options(fn, s, o, sizeof(T), true);
    const Layout lay = layout_with_options(o, s);
    validate_backward_pointers(fn, Q, K, V, O, dO, L, dQ, dK, dV, x, lay);
    if (changes_nothing(o, s) && o.deterministic)  // (the launchers' options carry the flag)
        return backward_run(fn, Q, K, V, O, dO, L, dQ, dK, dV, s, lay, stream);
    if (o.alibi_slopes)
        validate_pointers(fn, {alibi_arg(o, s),
                               output_arg("dQ", dQ, span_elems(lay.dQ, x, x.q_len)),
                               output_arg("dK", dK, span_elems(lay.dK, x, x.kv_len)),
                               output_arg("dV", dV, span_elems(lay.dV, x, x.kv_len))});
    validate_packed_lengths(fn, o.packed, s, stream);
    const cudaDeviceProp prop = flash_device_props();
#ifndef FLASH_NO_HOPPER
    if (flash_backward_runs_hopper(prop, s.head_dim))  // chapter 3 takes the policy too
        return flash_backward_hopper_launch(Q, K, V, O, dO, L, dQ, dK, dV, s, lay, stream, &o);
#endif
    flash_backward_ampere_launch(fn, prop, Q, K, V, O, dO, L, dQ, dK, dV, s, lay, stream, &o);
}

void flash_forward_fp16(const __half* Q, const __half* K, const __half* V, __half* O, float* L,
                        const AttentionShape& shape, const AttentionOptions& options,
                        cudaStream_t stream) {
    forward_options_dispatch("flash_forward_fp16", Q, K, V, O, L, shape, options, stream);
}
void flash_forward_bf16(const __nv_bfloat16* Q, const __nv_bfloat16* K, const __nv_bfloat16* V,
                        __nv_bfloat16* O, float* L, const AttentionShape& shape,
                        const AttentionOptions& options, cudaStream_t stream) {
    forward_options_dispatch("flash_forward_bf16", Q, K, V, O, L, shape, options, stream);
}
void flash_backward_fp16(const __half* Q, const __half* K, const __half* V, const __half* O,
                         const __half* dO, const float* L, __half* dQ, __half* dK, __half* dV,
                         const AttentionShape& shape, const AttentionOptions& options,
                         cudaStream_t stream) {
    backward_options_dispatch("flash_backward_fp16", Q, K, V, O, dO, L, dQ, dK, dV, shape,
                              options, stream);
}
void flash_backward_bf16(const __nv_bfloat16* Q, const __nv_bfloat16* K, const __nv_bfloat16* V,
                         const __nv_bfloat16* O, const __nv_bfloat16* dO, const float* L,
                         __nv_bfloat16* dQ, __nv_bfloat16* dK, __nv_bfloat16* dV,
                         const AttentionShape& shape, const AttentionOptions& options,
                         cudaStream_t stream) {
    backward_options_dispatch("flash_backward_bf16", Q, K, V, O, dO, L, dQ, dK, dV, shape,
                              options, stream);
}

#ifdef FLASH_NO_HOPPER
// Chapter 3's own calls in a library without it: the same refusals of bad arguments as
// flash_hopper.cu's (std::invalid_argument first), then std::runtime_error.
template <typename T>
[[noreturn]] static void hopper_not_built(const char* fn, const T* Q, const T* K, const T* V, T* O,
                                          float* L, const AttentionShape& s) {
    validate_shape(s, kFlashHopperHeadDims, sizeof(T));
    validate_forward_pointers(fn, Q, K, V, O, L, s);
    throw std::runtime_error(std::string(fn) + ": chapter 3 (flash_hopper.cu) was not built: the " +
                             "library was built with FLASH_NO_HOPPER, which the Makefile sets " +
                             "when nvcc has no sm_90a target (CUDA 12.0 or newer has it); " +
                             "flash_forward_fp16 / _bf16 run chapter 2 instead");
}

void flash_forward_fp16_hopper(const __half* Q, const __half* K, const __half* V, __half* O,
                               float* L, const AttentionShape& shape, cudaStream_t) {
    hopper_not_built("flash_forward_fp16_hopper", Q, K, V, O, L, shape);
}

void flash_forward_bf16_hopper(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                               const __nv_bfloat16* V, __nv_bfloat16* O, float* L,
                               const AttentionShape& shape, cudaStream_t) {
    hopper_not_built("flash_forward_bf16_hopper", Q, K, V, O, L, shape);
}

// Chapter 3's fp8 forward (flash_hopper_fp8.cu): the shape's refusal, then not built.
[[noreturn]] static void fp8_not_built(const AttentionShape& s) {
    validate_shape(s, kFlashHopperHeadDims, 1);
    throw std::runtime_error("flash_forward_fp8_hopper: chapter 3 (flash_hopper_fp8.cu) was not "
                             "built: the library was built with FLASH_NO_HOPPER, which the "
                             "Makefile sets when nvcc has no sm_90a target (CUDA 12.0 or newer "
                             "has it)");
}
void flash_forward_fp8_hopper(const __nv_fp8_e4m3*, const __nv_fp8_e4m3*, const __nv_fp8_e4m3*,
                              __nv_bfloat16*, float*, const AttentionShape& shape,
                              const Fp8Descales&, cudaStream_t) {
    fp8_not_built(shape);
}
void flash_forward_fp8_hopper(const __nv_fp8_e4m3*, const __nv_fp8_e4m3*, const __nv_fp8_e4m3*,
                              __half*, float*, const AttentionShape& shape, const Fp8Descales&,
                              cudaStream_t) {
    fp8_not_built(shape);
}

template <typename T>
[[noreturn]] static void hopper_backward_not_built(const char* fn, const T* Q, const T* K,
                                                   const T* V, const T* O, const T* dO,
                                                   const float* L, T* dQ, T* dK, T* dV,
                                                   const AttentionShape& s) {
    validate_shape(s, kFlashHopperHeadDims, sizeof(T));
    validate_backward_pointers(fn, Q, K, V, O, dO, L, dQ, dK, dV, s);
    throw std::runtime_error(std::string(fn) + ": chapter 3 (flash_hopper_backward.cu) was not " +
                             "built: the library was built with FLASH_NO_HOPPER, which the " +
                             "Makefile sets when nvcc has no sm_90a target (CUDA 12.0 or newer " +
                             "has it); flash_backward_fp16 / _bf16 run chapter 2 instead");
}

void flash_backward_fp16_hopper(const __half* Q, const __half* K, const __half* V,
                                const __half* O, const __half* dO, const float* L, __half* dQ,
                                __half* dK, __half* dV, const AttentionShape& shape,
                                cudaStream_t) {
    hopper_backward_not_built("flash_backward_fp16_hopper", Q, K, V, O, dO, L, dQ, dK, dV, shape);
}

void flash_backward_bf16_hopper(const __nv_bfloat16* Q, const __nv_bfloat16* K,
                                const __nv_bfloat16* V, const __nv_bfloat16* O,
                                const __nv_bfloat16* dO, const float* L, __nv_bfloat16* dQ,
                                __nv_bfloat16* dK, __nv_bfloat16* dV, const AttentionShape& shape,
                                cudaStream_t) {
    hopper_backward_not_built("flash_backward_bf16_hopper", Q, K, V, O, dO, L, dQ, dK, dV, shape);
}
#endif
