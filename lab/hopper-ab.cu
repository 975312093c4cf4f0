// lab/hopper-ab.cu: variants of chapter 3's kernel timed side by side in one process, each round
// running every variant in turn (so that clock and temperature drift fall on all of them alike):
// lab/chapter3.md's step 5 (lab/data/hopper-step5-ab-h100.txt).
// Each variant is flash_hopper.cu as some commit or edit has it, compiled with its exported names
// suffixed by lab/hopper-ab.sh, which also links this file against them:
//   lab/hopper-ab.sh NAME=SOURCE [NAME=SOURCE ...]       (the first variant is the baseline)
//   ./hopper_ab [ROUNDS [D [N]]]                         (default 3 rounds, d = 64 128 256, all N)
// Shapes follow the FA2 protocol (batch * N = 16384, heads * d = 2048), fp16; a figure is the
// median over the rounds of each round's median of 10 CUDA-event-timed calls (after 2 warm-ups),
// forward TFLOP/s = 4 B H (visible pairs) d / t; max|dO| is the largest |O - O(baseline)|, which
// must stay at fp16's rounding.
#include "checks.h"
#include "flash.h"
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>
#include "device-fill.cuh"  // fill, max_diff, median_ms

using Fn = void (*)(const __half*, const __half*, const __half*, __half*, float*,
                   const AttentionShape&, cudaStream_t);
#define DECL(v)                                                                            \
    void flash_forward_fp16_hopper_##v(const __half*, const __half*, const __half*, __half*, \
                                       float*, const AttentionShape&, cudaStream_t);
#include "hopper-ab-variants.h"  // written by lab/hopper-ab.sh: DECL(name)..., VARIANT_LIST
struct V { const char* name; Fn fn; };
static std::vector<V> variants = { VARIANT_LIST };


int main(int argc, char** argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 3;
    std::vector<int> dims = {64, 128, 256}, Ns = {1024, 2048, 4096, 8192, 16384};
    if (argc > 2) dims = {atoi(argv[2])};
    if (argc > 3) Ns = {atoi(argv[3])};
    printf("  d c     N");
    for (auto& v : variants) printf(" %8s", v.name);
    printf("   (TFLOP/s, median over %d alternating rounds of medians of 10)\n", rounds);
    for (int d : dims) for (int causal : {0, 1}) for (int N : Ns) {
        const AttentionShape s{16384 / N, 2048 / d, N, N, d, causal == 1};
        const size_t n = q_elems(s);
        __half *Q, *K, *V_, *O, *O0; float *L, *diff;
        for (__half** p : {&Q, &K, &V_, &O, &O0}) FLASH_CUDA_CHECK(cudaMalloc(p, n * 2));
        FLASH_CUDA_CHECK(cudaMalloc(&L, l_elems(s) * 4)); FLASH_CUDA_CHECK(cudaMalloc(&diff, 4));
        unsigned seed = 1;
        for (__half* p : {Q, K, V_}) fill<<<1024, 256>>>(p, n, seed++);
        const double pairs = causal ? double(N) * (N + 1) / 2 : double(N) * N;
        const double flops = 4.0 * s.batch * s.heads * pairs * d;
        std::vector<std::vector<float>> t(variants.size());
        variants[0].fn(Q, K, V_, O0, L, s, 0);
        float worst = 0.f;
        for (size_t k = 1; k < variants.size(); k++) {
            variants[k].fn(Q, K, V_, O, L, s, 0);
            FLASH_CUDA_CHECK(cudaMemset(diff, 0, 4));
            max_diff<<<1024, 256>>>(O0, O, n, diff);
            float w; FLASH_CUDA_CHECK(cudaMemcpy(&w, diff, 4, cudaMemcpyDeviceToHost));
            worst = std::max(worst, w);
        }
        for (int r = 0; r < rounds; r++)
            for (size_t k = 0; k < variants.size(); k++)
                t[k].push_back(median_ms([&] { variants[k].fn(Q, K, V_, O, L, s, 0); }, 10, 2));
        printf("%3d %d %5d", d, causal, N);
        for (auto& x : t) {
            std::sort(x.begin(), x.end());
            printf(" %8.1f", flops / x[x.size() / 2] / 1e9);
        }
        printf("   max|dO| %.1e\n", worst);
        for (void* p : {(void*)Q, (void*)K, (void*)V_, (void*)O, (void*)O0, (void*)L, (void*)diff})
            FLASH_CUDA_CHECK(cudaFree(p));
    }
    return 0;
}
