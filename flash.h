// flash.h: the API of a minimal FlashAttention (forward and backward) in fp32 CUDA C++.
//
// Kernels and launchers: flash.cu. Argument checks shared with later chapters: checks.h,
// checks.cpp. CPU reference: reference.cpp. Tests: test_*.cpp.
// Everything here throws std::invalid_argument for bad input (before anything is launched) and
// std::runtime_error for a CUDA failure (with cudaGetErrorString and file:line).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>
#include <string>

struct AttentionShape {
    int batch, heads, q_len, kv_len, head_dim;
    bool causal;
};

// The causal rule, bottom-right aligned (as FlashAttention-2 >= 2.1): query i sees key j iff
// j <= flash_last_key(i, q_len, kv_len). With q_len == kv_len that is j <= i. The one statement of
// the rule in the GPU code: every kernel and its tile-skipping bounds use it (the CPU reference
// states it again on its own, on purpose: the ground truth shares no code with what it checks).
// (i - q_len) < 0 comes first, so the sum never overflows.
__host__ __device__ inline int flash_last_key(int i, int q_len, int kv_len) {
    return i - q_len + kv_len;
}
// The same rule read from the key's side: key j is seen by queries i >= flash_first_query(j, ...)
// (j <= i + flash_last_key(0, ...) rearranged).
__host__ __device__ inline int flash_first_query(int j, int q_len, int kv_len) {
    return j - flash_last_key(0, q_len, kv_len);
}
// The keys a tile of query rows [first_row, first_row + rows) needs: 0 .. flash_kv_end - 1. Under
// a causal mask, past the last key its last row sees, every K/V tile can be skipped.
__host__ __device__ inline int flash_kv_end(int first_row, int rows, int q_len, int kv_len,
                                            bool causal) {
    if (!causal) return kv_len;
    const int last_row = (first_row + rows < q_len ? first_row + rows : q_len) - 1;
    const int end = flash_last_key(last_row, q_len, kv_len) + 1;
    return end < kv_len ? end : kv_len;
}

// Device pointers, float32, contiguous row-major. Q, O: [batch][heads][q_len][head_dim];
// K, V: [batch][heads][kv_len][head_dim]; L: [batch][heads][q_len].
// O = softmax(Q K^T / sqrt(head_dim)) V, row by row; L = natural-log logsumexp of each row of the
// scaled scores. Causal is bottom-right aligned: query i sees key j iff j <= i + kv_len - q_len.
// A row that sees no key gets O = 0 and L = -inf.
void flash_forward(const float* Q, const float* K, const float* V, float* O, float* L,
                   const AttentionShape& shape, cudaStream_t stream = 0);

// Given dO = dloss/dO, fills dQ, dK, dV (shaped as Q, K, V). O and L are the forward's outputs.
void flash_backward(const float* Q, const float* K, const float* V, const float* O,
                    const float* dO, const float* L, float* dQ, float* dK, float* dV,
                    const AttentionShape& shape, cudaStream_t stream = 0);

// Chapter 2 (flash_fp16.cu): the same forward on tensor cores. Q, K, V, O are fp16 (__half),
// laid out as above; L stays fp32. The softmax statistics and every sum are fp32; only Q, K, V, O
// and P are rounded to fp16. Same contract as flash_forward. Needs a GPU of compute capability
// 8.0 or newer (A100, RTX 30/40, H100): on an older one it throws std::runtime_error.
void flash_forward_fp16(const __half* Q, const __half* K, const __half* V, __half* O, float* L,
                        const AttentionShape& shape, cudaStream_t stream = 0);
// The fp16 backward: given dO, fills dQ, dK, dV (fp16, shaped as Q, K, V) from the forward's O
// and fp32 L. Deterministic (bitwise-identical gradients on every call: the one sum over blocks,
// dQ's, is added in a fixed order); P and dS are rounded to fp16 for the tensor-core products,
// every sum is fp32. Extra memory: flash_backward_fp16_scratch_bytes, taken from the stream's
// memory pool (cudaMallocAsync) during the call and given back. Head dims: see below.
void flash_backward_fp16(const __half* Q, const __half* K, const __half* V, const __half* O,
                         const __half* dO, const float* L, __half* dQ, __half* dK, __half* dV,
                         const AttentionShape& shape, cudaStream_t stream = 0);

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
// The tile: how one thread block is laid out. See NOTES.md, "The tile".
struct FlashTile {
    int Br;               // query rows per block (one block per Q tile per batch*head)
    int Bc;               // keys per K/V tile staged in shared memory
    int threads;          // threads per block
    int threads_per_row;  // threads that share one query row (its q and o split across them)
    size_t shared_bytes;  // dynamic shared memory per block: K_j and V_j, 2 * Bc * head_dim floats
};

// The head dims with a compiled kernel; anything else is refused.
constexpr int kFlashHeadDims[] = {16, 32, 64, 96, 128, 256};
// True iff head_dim is one of kFlashHeadDims.
bool flash_head_dim_supported(int head_dim);
// "16, 32, 64, 96, 128, 256": for error messages.
std::string flash_head_dims_string();

// The forward tile for this device and head_dim (a pure host function; unit-tested on the CPU).
FlashTile flash_choose_tile(const cudaDeviceProp& prop, int head_dim);
// The backward's tile (the same rule; its blocks keep four row vectors in registers, not two).
FlashTile flash_choose_tile_backward(const cudaDeviceProp& prop, int head_dim);

// flash_forward with keys-per-tile Bc given by the caller instead of the device-derived choice
// (for measuring what the choice is worth). Bc must be in [1, the most that fits in shared memory].
void flash_forward_bc(const float* Q, const float* K, const float* V, float* O, float* L,
                      const AttentionShape& shape, int Bc, cudaStream_t stream = 0);

// Chapter 2's head dims (every one of chapter 1's: one kernel template covers them all), its
// tile (Br = 128: 32 query rows per warp, 64 at head_dim 256; Bc = 128 to head_dim 64, 64 to 128,
// 32 at 256, halved where shared memory is short; see flash_fp16.cu), and flash_forward_fp16 with
// Bc (32, 64, or 128 to head_dim 64) given by the caller. The bf16 calls take the same tiles.
constexpr int kFlashFp16HeadDims[] = {16, 32, 64, 96, 128, 256};
FlashTile flash_choose_tile_fp16(const cudaDeviceProp& prop, int head_dim);
void flash_forward_fp16_bc(const __half* Q, const __half* K, const __half* V, __half* O,
                           float* L, const AttentionShape& shape, int Bc, cudaStream_t stream = 0);
// The fp16 backward takes the forward's head dims, kFlashFp16HeadDims. Its tile: Br = 64 query
// rows a Q tile (32 at d = 256), Bc = 128 keys a K/V tile, one per block of 8 warps, where that
// fits the device's shared memory (d >= 32), else Bc = 64 (4 warps); shared_bytes is the block's.
// At d = 128 that is 173 KiB with Bc = 128 and 121 KiB with 64, so a GPU with 99 KiB (sm_86, sm_89)
// gets the runtime_error there. Throws as the forward's does.
FlashTile flash_choose_tile_fp16_backward(const cudaDeviceProp& prop, int head_dim);
// flash_backward_fp16 with Bc (64, or 128 from head_dim 32) given by the caller.
void flash_backward_fp16_bc(const __half* Q, const __half* K, const __half* V, const __half* O,
                            const __half* dO, const float* L, __half* dQ, __half* dK, __half* dV,
                            const AttentionShape& shape, int Bc, cudaStream_t stream = 0);
// The fp16 backward's extra device memory for this shape, in bytes: dQ summed in fp32
// (B*H*q_len*head_dim floats), D (B*H*q_len floats), one turn counter per Q tile of Br rows
// (B*H*ceil(q_len / Br) ints) and two tickets (ints). Throws as the backward does for a bad shape.
size_t flash_backward_fp16_scratch_bytes(const AttentionShape& shape);

// Throws std::invalid_argument naming the field when a shape field is out of range or a tensor's
// element count overflows.
void validate_shape(const AttentionShape& shape);
// Elements of Q and O (batch*heads*q_len*head_dim), of K and V (... kv_len ...), of L (... q_len).
size_t q_elems(const AttentionShape& s);
size_t kv_elems(const AttentionShape& s);
size_t l_elems(const AttentionShape& s);

// ---------------------------------------------------------------------------------------------
// CPU reference (reference.cpp): the same contract on host pointers, accumulated in double.
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

// ---------------------------------------------------------------------------------------------
// Check a CUDA call: on failure throw std::runtime_error("<call> failed at file:line: <error>").
#define FLASH_CUDA_CHECK(call)                                                                  \
    do {                                                                                        \
        cudaError_t flash_err_ = (call);                                                        \
        if (flash_err_ != cudaSuccess)                                                          \
            throw std::runtime_error(std::string(#call) + " failed at " + __FILE__ + ":" +      \
                                     std::to_string(__LINE__) + ": " +                          \
                                     cudaGetErrorString(flash_err_));                           \
    } while (0)
