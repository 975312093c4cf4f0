// lab/hopper-steps.cu: chapter 3's forward (flash_forward_fp16_hopper, flash_hopper.cu) timed
// beside chapter 2's (flash_forward_fp16_ampere) on the FA2 protocol's shapes, for NOTES.md
// section 17's table.
// Build and run from the repository root on an H100 (the library built with make, ARCH=sm_90):
//   make build/flash.o build/flash_fp16.o build/backward_passes.o build/flash_decode.o \
//        build/flash_hopper.o build/flash_hopper_backward.o build/checks.o build/dispatch.o ARCH=sm_90
//   nvcc -O3 -std=c++17 -arch=sm_90 -I. -Ilib lab/hopper-steps.cu build/flash.o build/flash_fp16.o
//        build/backward_passes.o build/flash_decode.o build/flash_hopper.o \
//        build/flash_hopper_backward.o build/checks.o build/dispatch.o -o hopper_steps && ./hopper_steps [fp16|bf16] [N]
// Shapes: batch * N = 16384, heads * d = 2048, d = 64, 128 and 256, N = 1024 .. 16384 (or the one
// N given), causal and not.
// Each figure is the median of 20 CUDA-event-timed calls after 3 warm-ups; forward TFLOP/s =
// 4 B H (visible pairs) d / t. Also prints the largest |O(chapter 3) - O(chapter 2)|, which must
// stay at the element type's rounding (the test suite checks both against the CPU reference).
#include "checks.h"  // FLASH_CUDA_CHECK, q_elems
#include "flash.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <vector>

#include "device-fill.cuh"  // fill, max_diff, median_ms


template <typename T>
static void run(const char* type, void (*chapter2)(const T*, const T*, const T*, T*, float*,
                                                    const AttentionShape&, cudaStream_t),
                void (*chapter3)(const T*, const T*, const T*, T*, float*, const AttentionShape&,
                                 cudaStream_t),
                int only_N) {
    printf("%s  d causal     N   chapter 2   chapter 3  ch3/ch2  max|O3 - O2|\n", type);
    for (int d : {64, 128, 256})
        for (int causal : {0, 1})
            for (int N = 1024; N <= 16384; N *= 2) {
                if (only_N != 0 && N != only_N) continue;
                const AttentionShape s{16384 / N, 2048 / d, N, N, d, causal == 1};
                const size_t n = q_elems(s);
                T *Q, *K, *V, *O2, *O3;
                float *L, *diff;
                for (T** p : {&Q, &K, &V, &O2, &O3}) FLASH_CUDA_CHECK(cudaMalloc(p, n * sizeof(T)));
                FLASH_CUDA_CHECK(cudaMalloc(&L, l_elems(s) * sizeof(float)));
                FLASH_CUDA_CHECK(cudaMalloc(&diff, sizeof(float)));
                unsigned seed = 1;
                for (T* p : {Q, K, V}) fill<<<1024, 256>>>(p, n, seed++);
                FLASH_CUDA_CHECK(cudaGetLastError());
                const double pairs = causal ? double(N) * (N + 1) / 2 : double(N) * N;
                const double flops = 4.0 * s.batch * s.heads * pairs * d;
                const float t2 = median_ms([&] { chapter2(Q, K, V, O2, L, s, 0); });
                float t3 = 0.f;
                try {
                    t3 = median_ms([&] { chapter3(Q, K, V, O3, L, s, 0); });
                } catch (const std::invalid_argument& e) {  // a head dim a step did not run
                    printf("%s %3d %6d %5d  chapter 3: %s\n", type, d, causal, N, e.what());
                }
                if (t3 > 0.f) {
                    FLASH_CUDA_CHECK(cudaMemset(diff, 0, sizeof(float)));
                    max_diff<<<1024, 256>>>(O2, O3, n, diff);
                    FLASH_CUDA_CHECK(cudaGetLastError());
                    float worst = 0.f;
                    FLASH_CUDA_CHECK(
                        cudaMemcpy(&worst, diff, sizeof(float), cudaMemcpyDeviceToHost));
                    printf("%s %3d %6d %5d %11.1f %11.1f %8.2f  %.2e\n", type, d, causal, N,
                           flops / t2 / 1e9, flops / t3 / 1e9, t2 / t3, worst);
                }
                for (void* p : {static_cast<void*>(Q), static_cast<void*>(K), static_cast<void*>(V),
                                static_cast<void*>(O2), static_cast<void*>(O3),
                                static_cast<void*>(L), static_cast<void*>(diff)})
                    FLASH_CUDA_CHECK(cudaFree(p));
            }
}

int main(int argc, char** argv) {
    const int only_N = argc > 2 ? std::atoi(argv[2]) : 0;  // one N only (0: all)
    if (argc > 1 && std::strcmp(argv[1], "bf16") == 0)
        run<__nv_bfloat16>("bf16", flash_forward_bf16_ampere, flash_forward_bf16_hopper, only_N);
    else
        run<__half>("fp16", flash_forward_fp16_ampere, flash_forward_fp16_hopper, only_N);
    return 0;
}
