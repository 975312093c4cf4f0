// fragments.cuh: the register-level helpers of the mma.sync chapters: chapter 2 (flash_fp16.cu)
// and chapter 4's decode (flash_decode.cu). The element type T and its pairs, one mma, one 16x16
// shared-memory load, and how a thread finds its elements of an accumulator and reduces a row over
// its quad. Each is one documented PTX instruction or a few lines of index arithmetic; none is
// needed to follow the algorithm, only to run it. NOTES.md section 9 draws the fragments.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

// mma.sync.m16n8k16 and cp.async need compute capability 8.0. When nvcc compiles for an older GPU
// (a build with no GPU present defaults to sm_75), the kernels still compile, to a trap; the API
// refuses such GPUs with a std::runtime_error before anything is launched.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define SM80_ASM(...) __trap()
#pragma nv_diag_suppress 177  // the operands SM80_ASM drops leave some variables unused
#else
#define SM80_ASM(...) asm volatile(__VA_ARGS__)
#endif

// ---------------------------------------------------------------------------------------------
// The element type T of Q, K, V, O and the gradients: __half (fp16) or __nv_bfloat16 (bf16). Both
// are 16 bits, so every load, layout and tile is the same for the two; only the mma's type and the
// rounding of fp32 results differ. ("fp16" in a kernel's name is the chapter's, for either.)
template <typename T>
constexpr bool is_bf16 = std::is_same_v<T, __nv_bfloat16>;
// Two elements of T side by side, 32 bits: __half2 or __nv_bfloat162.
template <typename T>
using Pair = std::conditional_t<is_bf16<T>, __nv_bfloat162, __half2>;

// fp32 to a pair of T, the one rounding (to nearest) every kernel's 16-bit output goes through, x
// in the low half. pair_of gives the pair; pair_bits the same 32 bits as one register (an mma
// operand: P~ as the A of P~ V_j, in chapters 2 and 3); store_pair writes the pair to memory at p
// (4-byte aligned).
template <typename T>
__device__ __forceinline__ Pair<T> pair_of(float x, float y) {
    if constexpr (is_bf16<T>) return __floats2bfloat162_rn(x, y);
    else return __floats2half2_rn(x, y);
}
template <typename T>
__device__ __forceinline__ uint32_t pair_bits(float x, float y) {
    const Pair<T> h = pair_of<T>(x, y);
    return *reinterpret_cast<const uint32_t*>(&h);
}
template <typename T>
__device__ __forceinline__ void store_pair(T* p, float x, float y) {
    *reinterpret_cast<Pair<T>*>(p) = pair_of<T>(x, y);
}
// A pair of T widened to two floats (exact).
__device__ __forceinline__ float2 float2_of(__half2 h) { return __half22float2(h); }
__device__ __forceinline__ float2 float2_of(__nv_bfloat162 h) { return __bfloat1622float2(h); }
// x rounded to T (to nearest) and widened back: T's value nearest x, as a float.
template <typename T>
__device__ __forceinline__ float rounded_to(float x) { return float2_of(pair_of<T>(x, x)).x; }

// ---------------------------------------------------------------------------------------------
// C (16x8, fp32) += A (16x16, T, row-major) * B (16x8, T, "col": B's columns contiguous).
// Per thread (lane = 4g + t): a: 4 registers of 2 Ts; b: 2; c: rows g and g+8, cols 2t, 2t+1.
template <typename T>
__device__ __forceinline__ void mma_16x8x16(float c[4], const uint32_t a[4], uint32_t b0,
                                            uint32_t b1) {
    if constexpr (is_bf16<T>)
        SM80_ASM("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]),
                 "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        SM80_ASM("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]),
                 "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A warp's product of 16M rows by N columns in mma tiles, acc[m][n] (rows 16m .. 16m + 15,
// columns 8n .. 8n + 7: the C above), as one thread holds it: 2M rows by N / 4 columns. Its r-th
// row is row 16 (r / 2) + g + 8 (r % 2) = 8r + g of the warp's 16M, its c-th column is column
// acc_col(c, t) (lane = 4g + t), and acc_at(acc, r, c) is the element there.
template <int N8>
__device__ __forceinline__ float& acc_at(float (*acc)[N8][4], int r, int c) {
    return acc[r / 2][c / 2][2 * (r % 2) + c % 2];
}
__device__ __forceinline__ int acc_col(int c, int t) { return 8 * (c / 2) + 2 * t + c % 2; }
// v combined by op (fmaxf, or add) over the quad, the 4 lanes 4g .. 4g + 3 that together hold a
// row of an accumulator: lanes 1 apart first, then 2, and every lane gets the result. Chapter 1's
// row_sum is the same butterfly taken the other way round; the order decides a sum's last bits.
template <typename Op>
__device__ __forceinline__ float quad_reduce(float v, Op op) {
    v = op(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return op(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float add(float a, float b) { return a + b; }

// The 16x16 block of a shared-memory array (row stride `ld` halves) whose top-left is `tile`, as
// four 8x8 quarters: r[0] rows 0-7 cols 0-7, r[1] rows 8-15 cols 0-7, r[2] rows 0-7 cols 8-15,
// r[3] rows 8-15 cols 8-15 (lane L points at row L % 16, column 8 * (L / 16)); with Across, the
// quarters across first: r[1] rows 0-7 cols 8-15, r[2] rows 8-15 cols 0-7 (row L % 8 + 8 (L / 16),
// column 8 (L / 8 % 2)), so that an mma operand's two halves sit in adjacent registers (the mma
// takes its B as a register pair: without it, every B costs two moves). Each thread gets 2 halves
// of each quarter: (row g, cols 2t, 2t+1), or with Trans (rows 2t, 2t+1, col g).
template <bool Trans, bool Across = false, typename T>
__device__ __forceinline__ void load_16x16(uint32_t r[4], const T* tile, int ld) {
    const int lane = threadIdx.x % 32;
    const int row = Across ? lane % 8 + lane / 16 * 8 : lane % 16;
    const int col = Across ? lane / 8 % 2 * 8 : lane / 16 * 8;
    const unsigned p = unsigned(__cvta_generic_to_shared(tile + row * ld + col));
    if constexpr (Trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(p));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(p));
}
