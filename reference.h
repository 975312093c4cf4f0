// reference.h: the CPU reference (reference.cpp), the ground truth the tests and flash_bench check
// the GPU against. Not part of the library (the Makefile's FLASH_OBJS has no reference.o): the
// same contract as flash.h's calls, on host pointers, every sum accumulated in double. A bad shape
// is refused as the GPU calls refuse it (checks.h's validate_shape).
#pragma once

#include "flash.h"

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
