// log2_units.h: the log2 units in which the kernels of every chapter take the softmax's
// exponentials (internal; the API is flash.h). e^x = 2^(x log2(e)), and 2^x is the GPU's native
// exponential (exp2f, ex2.approx): chapter 1 folds log2(e), with 1/sqrt(d), into Q_i once, chapter
// 2 into one fma per score. L is turned back into natural log, times ln(2), when it is written
// (NOTES.md section 2).
#pragma once

#include <cmath>

inline constexpr float kLog2e = 1.4426950408889634f;  // log2(e): e^x = 2^(x * log2(e))
inline constexpr float kLn2 = 0.6931471805599453f;    // ln(2) = 1 / log2(e)

// The factor that takes a raw score q . k to the softmax's exponent in log2 units: the scale
// 1/sqrt(d) of attention, times log2(e). Each launcher passes it to its kernels as scale_log2.
inline float scale_log2_for(int head_dim) { return kLog2e / std::sqrt(float(head_dim)); }

#ifdef __CUDACC__
// 2^x, flushing results below 2^-126 to 0 (ex2.approx.ftz: one instruction, where exp2f adds a
// range check and two multiplies to keep them). What is flushed is a weight P = 2^x below 2^-126,
// lost anyway beside the row's largest weight, 1: summed into l >= 1, or rounded to T (fp16's
// smallest value is 2^-24) and multiplied by inputs of the order of 1. Chapters 2 and 3.
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// 2^x on the FMA pipe, where the XU (ex2's unit, 16 results a clock an SM) is the bound
// (FlashAttention-4's trick): x = r + f with r an integer (rounded by adding 1.5 * 2^23, which
// leaves r in the low mantissa bits) and f in [-1/2, 1/2]; 2^f a degree-4 polynomial with p(0) = 1
// (lab/exp2-poly.py's fit, relative error below 2^-17.3); r added to its exponent bits. x below
// -127 gives 0 (f = 0, p = 1, exponent bits 0), as exp2_ftz flushes. About ten instructions.
__device__ __forceinline__ float exp2_fma(float x) {
    constexpr float kRound = 12582912.f;               // 1.5 * 2^23
    x = fmaxf(x, -127.f);
    const float t = x + kRound, f = x - (t - kRound);  // f = x - r
    float p = fmaf(fmaf(fmaf(0.00966637369f, f, 0.0559220357f), f, 0.240224094f), f, 0.693126272f);
    p = fmaf(p, f, 1.f);
    return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));  // 2^r p
}
// The c-th exponential of an unrolled loop (c a constant there, so the choice costs nothing):
// every Every-th on the FMA pipe, the others on the XU (Every = 0: all on the XU).
template <int Every>
__device__ __forceinline__ float exp2_at(float x, int c) {
    if constexpr (Every > 0)
        if (c % Every == Every - 1) return exp2_fma(x);
    return exp2_ftz(x);
}
#endif
