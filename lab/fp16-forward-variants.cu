// lab/fp16-forward-variants.cu: lab/chapter2.md's forward steps 5-8, the second-edition forward's
// tile and order, timed side by side. It includes flash_fp16.cu whole and launches
// flash_forward_fp16_kernel<__half, D, Bc, M> directly, so one binary holds every variant
// (M = rows of 16 a warp owns, Bc = keys a tile, HG = heads' Q tiles taken together).
// Build and run from the repository root on a GPU of compute capability 8.0 or newer:
//   nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/fp16-forward-variants.cu lib/checks.cpp -o fwd_variants
//   ./fwd_variants tiles      (M 1/2 x Bc at d = 64 and 128, N = 1024 and 4096: steps 5-7)
//   ./fwd_variants order      (HG = 1, 4, 8, 16, all at N = 1024 .. 16384: step 8)
// Shapes follow the FA2 protocol (batch * N = 16384, heads * d = 2048); each row is the median of
// 20 CUDA-event-timed launches after 3 warm-ups, forward TFLOP/s = 4 B H (visible pairs) d / t,
// and the largest |O - O(M = 1, Bc = 32)|, which must stay at fp16's rounding (about 1e-3).
#include "../flash_fp16.cu"
#include "../lib/checks.h"  // FLASH_CUDA_CHECK, q_elems (flash_fp16.cu includes it as well)

#include <cstdio>
#include <string>
#include <vector>

#include "device-fill.cuh"  // fill, max_diff


struct Problem {
    AttentionShape s;
    __half *Q, *K, *V, *O, *O_ref;
    float *L, *diff;
};

template <int D, int Bc, int M>
float time_ms(const Problem& p, int HG, __half* O) {
    auto kernel = flash_forward_fp16_kernel<__half, D, Bc, M>;
    const int Br = 16 * M * kWarps, Tr = (p.s.q_len + Br - 1) / Br;
    const size_t smem = size_t(Br + 4 * Bc) * (D + kPad) * sizeof(__half);
    FLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(smem)));
    cudaEvent_t a, b;
    FLASH_CUDA_CHECK(cudaEventCreate(&a));
    FLASH_CUDA_CHECK(cudaEventCreate(&b));
    std::vector<float> t;
    for (int r = 0; r < 23; r++) {
        FLASH_CUDA_CHECK(cudaEventRecord(a));
        kernel<<<Tr * p.s.batch * p.s.heads, kFwdThreads, smem>>>(
            p.Q, p.K, p.V, O, p.L, p.s.q_len, p.s.kv_len, p.s.causal, Tr, HG, scale_log2_for(D));
        FLASH_CUDA_CHECK(cudaGetLastError());
        FLASH_CUDA_CHECK(cudaEventRecord(b));
        FLASH_CUDA_CHECK(cudaEventSynchronize(b));
        float ms;
        FLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
        if (r >= 3) t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

template <int D, int Bc, int M>
void row(const Problem& p, int HG) {
    const float ms = time_ms<D, Bc, M>(p, HG, p.O);
    FLASH_CUDA_CHECK(cudaMemset(p.diff, 0, sizeof(float)));  // 0 bytes are the float 0
    max_diff<<<256, 256>>>(p.O, p.O_ref, q_elems(p.s), p.diff);
    FLASH_CUDA_CHECK(cudaGetLastError());
    float diff;
    FLASH_CUDA_CHECK(cudaMemcpy(&diff, p.diff, sizeof(float), cudaMemcpyDeviceToHost));
    const double N = p.s.q_len, pairs = p.s.causal ? N * (N + 1) / 2 : N * N;
    const double tflops = 4.0 * p.s.batch * p.s.heads * pairs * D / (ms * 1e-3) / 1e12;
    std::printf("d=%-3d N=%-5d causal=%d M=%d Bc=%-3d HG=%-4d %7.1f TFLOP/s  max|dO| %.1e\n", D,
                p.s.q_len, int(p.s.causal), M, Bc, HG, tflops, diff);
}

template <int D>
void shape(int N, bool causal, bool order) {
    Problem p{{16384 / N, 2048 / D, N, N, D, causal}, {}, {}, {}, {}, {}, {}, {}};
    const size_t n = q_elems(p.s);
    for (__half** t : {&p.Q, &p.K, &p.V, &p.O, &p.O_ref})
        FLASH_CUDA_CHECK(cudaMalloc(t, n * sizeof(__half)));
    FLASH_CUDA_CHECK(cudaMalloc(&p.L, l_elems(p.s) * sizeof(float)));
    FLASH_CUDA_CHECK(cudaMalloc(&p.diff, sizeof(float)));
    unsigned seed = 1;
    for (__half* t : {p.Q, p.K, p.V}) fill<<<1024, 256>>>(t, n, seed++);
    time_ms<D, 32, 1>(p, 1, p.O_ref);                  // the reference output: M = 1, Bc = 32
    constexpr int Bc = D <= 64 ? 128 : 64;             // the shipped tile
    if (order) {
        for (int HG : {1, 4, 8, 16, 1 << 20}) row<D, Bc, 2>(p, HG);  // 1 << 20: all heads
    } else {
        row<D, 32, 1>(p, 1), row<D, 64, 1>(p, 1);      // the first edition's Br = 64
        row<D, 32, 2>(p, 1), row<D, 64, 2>(p, 1);      // 32 rows a warp
        if constexpr (D <= 64) row<D, 128, 2>(p, 1);
    }
    for (void* t : {(void*)p.Q, (void*)p.K, (void*)p.V, (void*)p.O, (void*)p.O_ref,
                    (void*)p.L, (void*)p.diff})
        FLASH_CUDA_CHECK(cudaFree(t));
}

int main(int argc, char** argv) {
    const std::string what = argc > 1 ? argv[1] : "";
    if (what != "tiles" && what != "order") {
        std::fprintf(stderr, "usage: %s tiles|order\n", argv[0]);
        return 2;
    }
    const bool order = what == "order";
    const std::vector<int> lengths =
        order ? std::vector<int>{1024, 2048, 8192, 16384} : std::vector<int>{1024, 4096};
    for (int causal = 0; causal < 2; causal++)
        for (int N : lengths) shape<64>(N, causal, order), shape<128>(N, causal, order);
    return 0;
}
