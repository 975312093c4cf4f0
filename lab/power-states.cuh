// lab/power-states.cuh: the two power states of lab/power-states.cu (and lab/power-states-ab.cu),
// one protocol for every call timed: cold, after 1 s idle, 3 warm-ups, then 10 calls each timed
// alone; hot, after 400 ms of calls back to back, 10 more. One line a call, the medians and each
// set's wall-clock window (epoch seconds), which lab/power-states-table.py joins with nvidia-smi's
// clock samples. Include checks.h first (FLASH_CUDA_CHECK).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>
#include <vector>

// Uniform in [-1, 1), a hash of the index: the range lab/power-states.py draws from
// (device-fill.cuh's fill draws from [-1.5, 1.5)).
__global__ void fill_uniform(__half* p, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x) {
        uint32_t h = uint32_t(i) * 2654435761u ^ seed * 40503u;
        h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
        p[i] = __float2half((h & 0xFFFFFF) / float(1 << 24) * 2.f - 1.f);
    }
}

inline double epoch_s() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

struct Timed { double ms, t0, t1; };  // the median of 10 calls, and their window

inline Timed time10(const std::function<void()>& call) {
    cudaEvent_t a, b;
    FLASH_CUDA_CHECK(cudaEventCreate(&a));
    FLASH_CUDA_CHECK(cudaEventCreate(&b));
    std::vector<float> ms(10);
    const double t0 = epoch_s();
    for (float& m : ms) {
        FLASH_CUDA_CHECK(cudaEventRecord(a));
        call();
        FLASH_CUDA_CHECK(cudaEventRecord(b));
        FLASH_CUDA_CHECK(cudaEventSynchronize(b));
        FLASH_CUDA_CHECK(cudaEventElapsedTime(&m, a, b));
    }
    const double t1 = epoch_s();
    FLASH_CUDA_CHECK(cudaEventDestroy(a));
    FLASH_CUDA_CHECK(cudaEventDestroy(b));
    std::sort(ms.begin(), ms.end());
    return {0.5 * (ms[4] + ms[5]), t0, t1};
}

// Both states of one call: cold, then hot.
inline void both_states(const char* tag, const char* pass, const AttentionShape& s, double flop,
                        const std::function<void()>& call) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    for (int i = 0; i < 3; i++) call();
    FLASH_CUDA_CHECK(cudaDeviceSynchronize());
    const Timed cold = time10(call);
    for (const double h0 = epoch_s(); epoch_s() - h0 < 0.4;) {
        for (int i = 0; i < 5; i++) call();
        FLASH_CUDA_CHECK(cudaDeviceSynchronize());
    }
    const Timed hot = time10(call);
    printf("%s %s d %d N %d causal %d cold %.4f %.1f %.3f %.3f hot %.4f %.1f %.3f %.3f\n", tag,
           pass, s.head_dim, s.q_len, int(s.causal), cold.ms, flop / cold.ms * 1e-9, cold.t0,
           cold.t1, hot.ms, flop / hot.ms * 1e-9, hot.t0, hot.t1);
    fflush(stdout);
}

