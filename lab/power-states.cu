// lab/power-states.cu: chapter 3's forward and backward (the public fp16 calls) timed in two power
// states, the protocol lab/power-states.py runs SDPA's cuDNN backend through, so that the two
// figures of a row are taken alike (lab/chapter3.md, "Against cuDNN in like power states").
//   cold: after 1 s idle, 3 warm-up calls, then 10 calls each timed alone (CUDA events);
//   hot:  after 400 ms of calls back to back (the H200's power limiter lowers the SM clock
//         about 50 ms into such a stretch: lab/chapter5.md, run 13), 10 calls timed alike.
// Each row prints the medians and the wall-clock window (epoch seconds) of each set of 10, which
// lab/power-states-table.py joins with nvidia-smi's clock samples. Shapes: FlashAttention-2's
// (batch x N = 16384, heads = 2048 / d), d = 64, 128, 256, N = 4096, 16384, causal and not.
// Build and run (lab/gpu-power-states.sh does both, with cuDNN and the clock samples):
//   make -j16 build/flash.o build/flash_fp16.o build/backward_passes.o build/flash_decode.o \
//     build/checks.o build/dispatch.o build/flash_hopper.o build/flash_hopper_backward.o \
//     build/flash_hopper_fp8.o
//   nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/power-states.cu build/*.o -o power_states
//   ./power_states ours
#include "checks.h"
#include "flash.h"

#include <cuda_fp16.h>

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

static double epoch_s() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

struct Timed { double ms, t0, t1; };  // the median of 10 calls, and their window

static Timed time10(const std::function<void()>& call) {
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
static void both_states(const char* tag, const char* pass, const AttentionShape& s, double flop,
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

int main(int argc, char** argv) {
    const char* tag = argc > 1 ? argv[1] : "ours";
    printf("# who pass d D N N causal C cold ms TFLOP/s t0 t1 hot ms TFLOP/s t0 t1\n");
    for (int d : {64, 128, 256})
        for (int N : {4096, 16384})
            for (int c : {0, 1}) {
                const AttentionShape s{16384 / N, 2048 / d, N, N, d, bool(c)};
                const size_t n = size_t(s.batch) * s.heads * N * d;
                std::vector<__half*> t(8);  // Q K V O dO dQ dK dV
                for (__half*& p : t) FLASH_CUDA_CHECK(cudaMalloc(&p, n * sizeof(__half)));
                float* L = nullptr;
                FLASH_CUDA_CHECK(cudaMalloc(&L, size_t(s.batch) * s.heads * N * sizeof(float)));
                for (int k : {0, 1, 2, 4}) fill_uniform<<<1024, 256>>>(t[k], n, 1 + k);
                FLASH_CUDA_CHECK(cudaGetLastError());
                const double pairs = c ? double(N) * (N + 1) / 2 : double(N) * N;
                const double flop = 4.0 * s.batch * s.heads * pairs * d;  // the forward's
                auto fwd = [&] { flash_forward_fp16(t[0], t[1], t[2], t[3], L, s); };
                auto bwd = [&] {
                    flash_backward_fp16(t[0], t[1], t[2], t[3], t[4], L, t[5], t[6], t[7], s);
                };
                both_states(tag, "fwd", s, flop, fwd);
                fwd();
                both_states(tag, "bwd", s, 2.5 * flop, bwd);
                for (__half* p : t) FLASH_CUDA_CHECK(cudaFree(p));
                FLASH_CUDA_CHECK(cudaFree(L));
            }
}
