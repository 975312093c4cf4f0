// lab/backward-pool.cu: the fp16 backward timed with the device's default memory pool giving its
// memory back at every synchronisation (release threshold 0, CUDA's default) and keeping it
// (threshold: no limit), in one process: lab/chapter2.md, the backward's step 10
// (lab/data/fp16-backward-pool.txt).
// It measures a backward that takes its scratch with cudaMallocAsync, as commits before 99ed5ad
// did; from 99ed5ad the scratch comes from the library's own kept pool, and the columns agree.
// Build and run from the repository root on an H100 (the library built with make, ARCH=sm_90):
//   make build/flash.o build/flash_fp16.o build/backward_passes.o build/flash_decode.o \
//        build/flash_hopper.o build/flash_hopper_backward.o build/checks.o build/dispatch.o ARCH=sm_90
//   nvcc -O3 -std=c++17 -arch=sm_90 -I. -Ilib lab/backward-pool.cu build/flash.o build/flash_fp16.o
//        build/backward_passes.o build/flash_decode.o build/flash_hopper.o \
//        build/flash_hopper_backward.o build/checks.o build/dispatch.o -o backward_pool && ./backward_pool
// Each figure: the median of 10 CUDA-event-timed calls (each followed by a synchronisation, as
// the protocol times them) after 3 warm-ups, FA2 protocol shapes, fp16.
#include "checks.h"
#include "flash.h"
#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>
#include "device-fill.cuh"  // fill, median_ms
int main() {
    cudaMemPool_t pool; FLASH_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
    printf("  d c     N  trim(ms)  keep(ms)  trim2(ms)  keep/trim\n");
    for (int d : {64, 128}) for (int causal : {0, 1}) for (int N : {1024, 2048, 4096}) {
        const AttentionShape s{16384 / N, 2048 / d, N, N, d, causal == 1};
        const size_t n = q_elems(s);
        __half *Q, *K, *V, *O, *dO, *dQ, *dK, *dV; float* L;
        for (__half** p : {&Q, &K, &V, &O, &dO, &dQ, &dK, &dV})
            FLASH_CUDA_CHECK(cudaMalloc(p, n * 2));
        FLASH_CUDA_CHECK(cudaMalloc(&L, l_elems(s) * 4));
        unsigned seed = 1; for (__half* p : {Q, K, V, dO}) fill<<<1024, 256>>>(p, n, seed++);
        flash_forward_fp16(Q, K, V, O, L, s);
        auto bwd = [&] { flash_backward_fp16(Q, K, V, O, dO, L, dQ, dK, dV, s); };
        uint64_t zero = 0, keep = UINT64_MAX;
        FLASH_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &zero));
        const float t0 = median_ms(bwd, 10);
        FLASH_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
        const float t1 = median_ms(bwd, 10);
        FLASH_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &zero));
        FLASH_CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
        const float t2 = median_ms(bwd, 10);
        printf("%3d %d %5d %9.3f %9.3f %10.3f %8.3f\n", d, causal, N, t0, t1, t2,
               t1 / std::min(t0, t2));
        for (void* p : {(void*)Q, (void*)K, (void*)V, (void*)O, (void*)dO, (void*)dQ, (void*)dK,
                        (void*)dV, (void*)L})
            FLASH_CUDA_CHECK(cudaFree(p));
    }
}
