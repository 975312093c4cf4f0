// lab/fp8-bench.cu: chapter 3's fp8 forward (flash_forward_fp8_hopper) against chapter 3's fp16
// forward on the same shapes (issue 47's floors: d 128 and 256, N 4k-16k, causal and not), in
// TFLOP/s counting 4 N^2 d a head (halved under the causal mask). Random inputs uniform in
// [-1.5, 1.5), median of 20 calls after 3 warm-ups, CUDA events around the call (its V^T pass
// included). Build and run from the repository root (the library built with make):
//   nvcc -O3 -std=c++17 -arch=native -I. -Ilib -Ilab lab/fp8-bench.cu build/flash.o \
//        build/flash_fp16.o build/flash_decode.o build/checks.o build/dispatch.o \
//        build/backward_passes.o build/flash_hopper.o build/flash_hopper_backward.o \
//        build/flash_hopper_fp8.o -o fp8_bench
//   ./fp8_bench
// Prints CSV: d,N,causal,fp8_tflops,fp16_tflops,ratio (fp8 over fp16).
#include "checks.h"
#include "flash.h"

#include <algorithm>
#include <cstdio>
#include "device-fill.cuh"  // fill, median_ms

int main() {
    printf("d,N,causal,fp8_tflops,fp16_tflops,ratio\n");
    for (int d : {128, 256})
        for (int n : {4096, 8192, 16384})
            for (bool causal : {false, true}) {
                const int heads = 16, batch = std::max(1, 32768 / n);  // 32k tokens a call
                const AttentionShape s{batch, heads, n, n, d, causal};
                const size_t elems = size_t(batch) * heads * n * d;
                __nv_fp8_e4m3 *Q8, *K8, *V8;
                __half *Q, *K, *V, *O;
                float* L;
                unsigned seed = 1;
                for (__nv_fp8_e4m3** p : {&Q8, &K8, &V8}) {
                    FLASH_CUDA_CHECK(cudaMalloc(p, elems));
                    fill<<<1024, 256>>>(*p, elems, seed++);
                }
                for (__half** p : {&Q, &K, &V, &O}) {
                    FLASH_CUDA_CHECK(cudaMalloc(p, elems * 2));
                    fill<<<1024, 256>>>(*p, elems, seed++);
                }
                FLASH_CUDA_CHECK(cudaGetLastError());
                FLASH_CUDA_CHECK(cudaMalloc(&L, size_t(batch) * heads * n * 4));
                const double flops = 4.0 * n * n * d * batch * heads / (causal ? 2 : 1);
                const float ms8 = median_ms([&] {
                    flash_forward_fp8_hopper(Q8, K8, V8, reinterpret_cast<__nv_bfloat16*>(O), L, s);
                });
                const float ms16 = median_ms([&] { flash_forward_fp16_hopper(Q, K, V, O, L, s); });
                const double t8 = flops / (ms8 * 1e9), t16 = flops / (ms16 * 1e9);
                printf("%d,%d,%d,%.0f,%.0f,%.2f\n", d, n, causal, t8, t16, t8 / t16);
                fflush(stdout);
                for (void* p : {(void*)Q8, (void*)K8, (void*)V8, (void*)Q, (void*)K, (void*)V,
                                (void*)O, (void*)L})
                    FLASH_CUDA_CHECK(cudaFree(p));
            }
    return 0;
}
