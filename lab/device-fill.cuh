// lab/device-fill.cuh: the helpers the lab's timing drivers share (fp16-forward-variants.cu,
// hopper-steps.cu, hopper-ab.cu, backward-pool.cu): random inputs made on the GPU, the largest
// difference of two outputs, and the median time of a call. Include checks.h first
// (FLASH_CUDA_CHECK).
#pragma once

#include <algorithm>
#include <functional>
#include <vector>

// p[i] uniform in [-1.5, 1.5), from a hash of i and seed (no host copy for big tensors). T: __half
// or __nv_bfloat16.
template <typename T>
__global__ void fill(T* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x) {
        unsigned h = unsigned(i * 2654435761u) ^ seed;
        h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
        p[i] = T(((h & 0xffff) / 65536.f - 0.5f) * 3.f);
    }
}
// *out = max(*out, max |a[i] - b[i]|); *out must start at 0 (or below every difference).
template <typename T>
__global__ void max_diff(const T* a, const T* b, size_t n, float* out) {
    float m = 0.f;
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x)
        m = fmaxf(m, fabsf(float(a[i]) - float(b[i])));
    atomicMax(reinterpret_cast<int*>(out), __float_as_int(m));  // m >= 0: int order is float order
}

// The median of `reps` CUDA-event-timed runs of call(), after `warmups` untimed ones, in ms; each
// timed run ends in a synchronisation, as the FA2 protocol times a call.
inline float median_ms(const std::function<void()>& call, int reps = 20, int warmups = 3) {
    cudaEvent_t start, stop;
    FLASH_CUDA_CHECK(cudaEventCreate(&start));
    FLASH_CUDA_CHECK(cudaEventCreate(&stop));
    std::vector<float> ms(reps);
    for (int r = 0; r < warmups; r++) call();
    for (float& t : ms) {
        FLASH_CUDA_CHECK(cudaEventRecord(start));
        call();
        FLASH_CUDA_CHECK(cudaEventRecord(stop));
        FLASH_CUDA_CHECK(cudaEventSynchronize(stop));
        FLASH_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    }
    std::nth_element(ms.begin(), ms.begin() + reps / 2, ms.end());
    FLASH_CUDA_CHECK(cudaEventDestroy(start));
    FLASH_CUDA_CHECK(cudaEventDestroy(stop));
    return ms[reps / 2];
}
