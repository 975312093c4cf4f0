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
#endif
