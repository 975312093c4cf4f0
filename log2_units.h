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
