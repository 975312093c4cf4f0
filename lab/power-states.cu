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

#include <vector>

#include "power-states.cuh"  // fill_uniform, both_states: the inputs and the protocol

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
