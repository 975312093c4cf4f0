// checks.h: the library's inside that every chapter shares: argument checks, element counts, the
// causal rule's tile bounds, launch helpers and FLASH_CUDA_CHECK. Not the API (that is flash.h);
// the tests, the benchmark and the CPU reference include it too. The checks run before any
// launch, so bad input never reaches the GPU and never touches an output; they throw
// std::invalid_argument naming the field and the allowed values. What the API layer calls in each
// chapter is in chapters.h.
#pragma once

#include "flash.h"
#include "layout.h"

#include <cstddef>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

// Throws std::invalid_argument(what) unless ok.
void require(bool ok, const std::string& what);

// Throws std::runtime_error("<call> failed at <file>:<line>: <why>"): the one message of
// FLASH_CUDA_CHECK and of standard.h's CUBLAS_CHECK.
[[noreturn]] void throw_failed_call(const char* call, const char* file, int line, const char* why);
// Check a CUDA call: on failure throw std::runtime_error("<call> failed at file:line: <error>").
// For the launchers, the tests and the benchmark; not an API call.
// On a machine with no GPU or no driver, <error> ends with a sentence saying so (flash_no_gpu).
#define FLASH_CUDA_CHECK(call) flash_cuda_check((call), #call, __FILE__, __LINE__)
[[noreturn]] void throw_cuda_failed(cudaError_t err, const char* call, const char* file, int line);
inline void flash_cuda_check(cudaError_t err, const char* call, const char* file, int line) {
    if (err != cudaSuccess) throw_cuda_failed(err, call, file, line);
}
// Whether err means that this machine has no CUDA GPU, or no driver at all: cudaErrorNoDevice, or
// cudaErrorInsufficientDriver with no driver installed (what the runtime answers then, which reads
// as if a driver were there but too old).
bool flash_no_gpu(cudaError_t err);

// ---------------------------------------------------------------------------------------------
// The causal rule (flash.h's flash_last_key) as the kernels' tile loops need it.

// Read from the key's side: key j is seen by queries i >= flash_first_query(j, ...)
// (j <= i + flash_last_key(0, ...) rearranged).
__host__ __device__ inline int flash_first_query(int j, int q_len, int kv_len) {
    return j - flash_last_key(0, q_len, kv_len);
}
// The keys a tile of query rows [first_row, first_row + rows) needs: 0 .. flash_kv_end - 1. Under
// a causal mask, past the last key its last row sees, every K/V tile can be skipped; 0 where no
// row sees a key (q_len > kv_len), never less, so that a count of K/V tiles never goes negative.
__host__ __device__ inline int flash_kv_end(int first_row, int rows, int q_len, int kv_len,
                                            bool causal) {
    if (!causal) return kv_len;
    const int last_row = (first_row + rows < q_len ? first_row + rows : q_len) - 1;
    const int end = flash_last_key(last_row, q_len, kv_len) + 1;
    return end < 0 ? 0 : end < kv_len ? end : kv_len;
}

// ---------------------------------------------------------------------------------------------
// Head dims. Each chapter lists the head dims it has kernels for in a constexpr int array
// (flash.h: kFlashHeadDims, kFlashFp16HeadDims, kFlashHopperHeadDims) and hands that list to what
// follows.
struct HeadDims {
    const int* dims;
    size_t count;
    template <size_t N>
    constexpr HeadDims(const int (&list)[N]) : dims(list), count(N) {}
};
bool head_dim_in(int head_dim, HeadDims supported);
std::string head_dims_string(HeadDims supported);  // "16, 32, 64"
// Throws the one head-dim refusal, "shape.head_dim = 48 is not supported; allowed values: ...",
// unless head_dim is in `supported`.
void require_head_dim(int head_dim, HeadDims supported);

// The one switch from a runtime head_dim to a compile-time one: calls
// f(std::integral_constant<int, D>{}) for the D in Dims that equals head_dim (so f can instantiate
// its kernel template at D), or throws require_head_dim's refusal. Dims: a constexpr int array.
//   dispatch_head_dim<kFlashHeadDims>(head_dim, [&](auto dim) { run<decltype(dim)::value>(); });
template <const auto& Dims, typename F, size_t... I>
void dispatch_head_dim_over(int head_dim, F& f, std::index_sequence<I...>) {
    const bool found =
        ((head_dim == Dims[I] ? (f(std::integral_constant<int, Dims[I]>{}), true) : false) || ...);
    if (!found) require_head_dim(head_dim, Dims);
}
template <const auto& Dims, typename F>
void dispatch_head_dim(int head_dim, F&& f) {
    dispatch_head_dim_over<Dims>(head_dim, f, std::make_index_sequence<std::size(Dims)>{});
}

// ---------------------------------------------------------------------------------------------
// Shapes. Every field in range, head_dim in `supported`, and every tensor's byte count, at
// elem_bytes per element, within size_t (and so every 64-bit offset the kernels form). Throws
// std::invalid_argument naming the field when a field is out of range or a count overflows.
void validate_shape(const AttentionShape& shape, HeadDims supported, size_t elem_bytes);
// The same with chapter 1's head dims and sizeof(float) (the largest element any chapter uses).
void validate_shape(const AttentionShape& shape);
// Elements of Q and O (batch*heads*q_len*head_dim), of K and V (... kv_len ...), of L (... q_len).
size_t q_elems(const AttentionShape& s);
size_t kv_elems(const AttentionShape& s);
size_t l_elems(const AttentionShape& s);

// ---------------------------------------------------------------------------------------------
// Pointers. One tensor argument: its name, pointer, element count and element size in bytes
// (4 for float, 2 for __half), and whether the kernel writes it.
struct Arg {
    const char* name;
    const void* ptr;
    size_t elems;
    size_t elem_bytes;
    bool output;
};
template <typename T>
Arg input_arg(const char* name, const T* ptr, size_t elems) {
    return {name, ptr, elems, sizeof(T), false};
}
template <typename T>
Arg output_arg(const char* name, T* ptr, size_t elems) {
    return {name, ptr, elems, sizeof(T), true};
}
// Refuses, naming the argument: a null pointer, one not 16-byte aligned (the kernels load 16
// bytes at a time), an output overlapping any other argument, host memory the GPU cannot read.
// fn names the API call in the message. Call validate_shape first: it bounds the byte counts.
void validate_pointers(const char* fn, std::initializer_list<Arg> args);
// The elements a tensor of this layout spans, from its first to its last, plus one (validate_layout
// first: it bounds the strides): q_elems or kv_elems where it is contiguous.
size_t span_elems(const Rows& r, const AttentionShape& s, int len);
// The forward's tensors, in every chapter: inputs Q, K, V and outputs O (element type T) and L,
// each over the span its layout gives (chapter 5's strides; contiguous without).
template <typename T>
void validate_forward_pointers(const char* fn, const T* Q, const T* K, const T* V, T* O,
                               float* L, const AttentionShape& s,
                               const Layout& a = Layout{}) {
    const Layout& l = a.Q.heads ? a : contiguous_layout(s);
    const int q = s.q_len, k = s.kv_len;
    validate_pointers(fn, {input_arg("Q", Q, span_elems(l.Q, s, q)),
                           input_arg("K", K, span_elems(l.K, s, k)),
                           input_arg("V", V, span_elems(l.V, s, k)),
                           output_arg("O", O, span_elems(l.O, s, q)),
                           output_arg("L", L, l_elems(s))});
}
// The backward's: inputs Q, K, V, O, dO (element type T) and L, outputs dQ, dK, dV.
template <typename T>
void validate_backward_pointers(const char* fn, const T* Q, const T* K, const T* V, const T* O,
                                const T* dO, const float* L, T* dQ, T* dK, T* dV,
                                const AttentionShape& s, const Layout& a = Layout{}) {
    const Layout& l = a.Q.heads ? a : contiguous_layout(s);
    const int q = s.q_len, k = s.kv_len;
    validate_pointers(fn, {input_arg("Q", Q, span_elems(l.Q, s, q)),
                           input_arg("K", K, span_elems(l.K, s, k)),
                           input_arg("V", V, span_elems(l.V, s, k)),
                           input_arg("O", O, span_elems(l.O, s, q)),
                           input_arg("dO", dO, span_elems(l.dO, s, q)),
                           input_arg("L", L, l_elems(s)),
                           output_arg("dQ", dQ, span_elems(l.dQ, s, q)),
                           output_arg("dK", dK, span_elems(l.dK, s, k)),
                           output_arg("dV", dV, span_elems(l.dV, s, k))});
}
// Chapter 5's strides (flash.h's AttentionLayout rule), of the tensors the call reads and writes
// (backward: all eight; the forward: Q, K, V, O): each given one's strides multiples of 8, 8 or
// more (no broadcasting; rows head_dim or more apart) and below 2^39, but for a dimension of one
// index, whose stride is never used; an output's (O, dQ, dK, dV) such that no two of its elements
// share a place: taken from the smallest stride up, each stride past the reach of those below it.
// Throws
// std::invalid_argument naming the tensor and the stride. Call validate_shape first.
void validate_layout(const char* fn, const AttentionLayout& layout, const AttentionShape& s,
                     bool backward);

// Chapter 5's options (flash.h's AttentionOptions): softmax_scale and softcap 0 or within
// [2^-32, 2^16], each window bound >= -1, alibi_per_batch only with slopes. The slopes' pointer,
// where given, is checked with the call's tensors (validate_pointers: null, alignment, overlap
// with an output, host memory): alibi_arg is its Arg, heads floats (batch * heads where
// alibi_per_batch).
void validate_options(const char* fn, const AttentionOptions& options);
Arg alibi_arg(const AttentionOptions& options, const AttentionShape& s);
// A packed batch (flash.h's PackedBatch), in two steps. validate_packed, with the options: both
// cu_seqlens or neither (totals 0 without them), totals >= 1 with them. validate_packed_lengths,
// the call's last check (nothing where not packed): each cu_seqlens in device memory, 4-byte
// aligned, copied to the host on `stream` (a wait for the stream's earlier work) and checked:
// 0 first, non-decreasing, its last the total, no length above shape.q_len (kv_len).
void validate_packed(const char* fn, const PackedBatch& packed, const AttentionShape& s);
void validate_packed_lengths(const char* fn, const PackedBatch& packed, const AttentionShape& s,
                             cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Launch helpers.

// The properties of the current device, fetched with cudaGetDeviceProperties once per device
// (it can take milliseconds) and cached; every later call is a lookup.
cudaDeviceProp flash_device_props();

// Blocks of a grid with one block per tile of `rows` (tiles of `tile` rows) per batch*head, in
// gridDim.x (limit 2^31 - 1, far above gridDim.y's 65535). Refuses a grid past the limit, naming
// `what` (the field the tiles run along).
int grid_blocks(const AttentionShape& shape, int rows, int tile, const char* what);

// The stream-ordered memory pool of the library's own on the current device (one per device, made
// on first use) that every call's scratch comes from: it keeps the memory it has reserved (release
// threshold: no limit) until flash_release_scratch. The device's default pool gives its free
// memory back at every synchronisation, so a call after one would wait for the driver to map its
// scratch again, a wait that weighs most on short calls (lab/chapter2.md, the backward's step 10).
cudaMemPool_t flash_kept_pool();

// Whether every scratch starts zeroed: FLASH_ZERO_SCRATCH=1 in the environment (read once), which
// `make sanitize` sets for initcheck alone. The kernels never need it: a scratch's first writes
// are TMA stores (chapter 3's dQ sums), which initcheck does not see, or a counter whose old bits
// count as no arrival (the decode's), which initcheck reports as a read of uninitialized memory.
bool flash_zero_scratch();

// Scratch for a launch: calls launch(scratch), which launches kernels on `stream` and returns
// the first launch error (cudaSuccess if none), with scratch `bytes` of device memory taken from
// flash_kept_pool() and given back after those kernels, in stream order, whatever happened
// (launch returning an error or throwing); then throws that launch error, if any.
template <typename Launch>
void with_scratch(size_t bytes, cudaStream_t stream, Launch launch) {
    void* scratch = nullptr;
    FLASH_CUDA_CHECK(cudaMallocFromPoolAsync(&scratch, bytes, flash_kept_pool(), stream));
    if (flash_zero_scratch()) FLASH_CUDA_CHECK(cudaMemsetAsync(scratch, 0, bytes, stream));
    cudaError_t launched = cudaSuccess;
    try {
        launched = launch(scratch);
    } catch (...) {  // a launch that throws gives the scratch back too (the first error is
                     // the one to report, so this free's own is not checked)
        cudaFreeAsync(scratch, stream);
        throw;
    }
    FLASH_CUDA_CHECK(cudaFreeAsync(scratch, stream));
    FLASH_CUDA_CHECK(launched);
}
// The same with a (B*H*q_len)-float buffer, Dsum: chapter 1's backward's D.
template <typename Launch>
void with_row_scratch(const AttentionShape& s, cudaStream_t stream, Launch launch) {
    with_scratch(l_elems(s) * sizeof(float), stream,
                 [&](void* scratch) { return launch(static_cast<float*>(scratch)); });
}

// Lets `kernel` use `bytes` of dynamic shared memory (above 48 KiB needs the opt-in).
template <typename Kernel>
void allow_shared(Kernel kernel, size_t bytes) {
    FLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(bytes)));
}

