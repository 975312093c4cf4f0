// lab/fp8-ab.cu: variants of chapter 3's fp8 forward (flash_hopper_fp8.cu) timed side by side in
// one process, each round running every variant in turn, as lab/hopper-ab.cu times chapter 3's
// fp16 forward. Each variant is flash_hopper_fp8.cu as some commit or edit has it:
//   AB_KIND=fp8 lab/hopper-ab.sh NAME=SOURCE [NAME=SOURCE ...]   (the first is the baseline)
//   ./fp8_ab [ROUNDS [D [N]]]           (default 3 rounds, d = 128 and 256, N = 4096-16384)
// Shapes as lab/fp8-bench.cu's (16 heads, 32k tokens a call, O in bf16), random inputs uniform
// in [-1.5, 1.5); a figure is the median over the rounds of each round's median of 10
// CUDA-event-timed calls (after 2 warm-ups), TFLOP/s = 4 B H (visible pairs) d / t; max|dO| is
// the largest |O - O(baseline)|: 0 for a change that keeps the arithmetic, e4m3's rounding of P~
// (about 2^-4 of |O|'s scale) at most for one that changes it.
#include "checks.h"
#include "flash.h"
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "device-fill.cuh"  // fill, max_diff, median_ms

using fp8 = __nv_fp8_e4m3;
using Fn = void (*)(const fp8*, const fp8*, const fp8*, __nv_bfloat16*, float*,
                    const AttentionShape&, const Fp8Descales&, cudaStream_t);
#define DECL(v)                                                                               \
    void flash_forward_fp8_hopper_##v(const fp8*, const fp8*, const fp8*, __nv_bfloat16*,      \
                                      float*, const AttentionShape&, const Fp8Descales&,      \
                                      cudaStream_t);
#include "hopper-ab-variants.h"  // written by lab/hopper-ab.sh: DECL(name)..., VARIANT_LIST
struct V { const char* name; Fn fn; };
static std::vector<V> variants = { VARIANT_LIST };

int main(int argc, char** argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 3;
    std::vector<int> dims = {128, 256}, Ns = {4096, 8192, 16384};
    if (argc > 2) dims = {atoi(argv[2])};
    if (argc > 3) Ns = {atoi(argv[3])};
    printf("  d c     N");
    for (auto& v : variants) printf(" %8s", v.name);
    printf("   (TFLOP/s, median over %d alternating rounds of medians of 10)\n", rounds);
    for (int d : dims) for (int causal : {0, 1}) for (int N : Ns) {
        const AttentionShape s{std::max(1, 32768 / N), 16, N, N, d, causal == 1};
        const size_t n = size_t(s.batch) * s.heads * N * d;
        fp8 *Q, *K, *V_;
        __nv_bfloat16 *O, *O0;
        float *L, *diff;
        for (fp8** p : {&Q, &K, &V_}) FLASH_CUDA_CHECK(cudaMalloc(p, n));
        for (__nv_bfloat16** p : {&O, &O0}) FLASH_CUDA_CHECK(cudaMalloc(p, n * 2));
        FLASH_CUDA_CHECK(cudaMalloc(&L, size_t(s.batch) * s.heads * N * 4));
        FLASH_CUDA_CHECK(cudaMalloc(&diff, 4));
        unsigned seed = 1;
        for (fp8* p : {Q, K, V_}) fill<<<1024, 256>>>(p, n, seed++);
        FLASH_CUDA_CHECK(cudaGetLastError());
        const double pairs = causal ? double(N) * (N + 1) / 2 : double(N) * N;
        const double flops = 4.0 * s.batch * s.heads * pairs * d;
        std::vector<std::vector<float>> t(variants.size());
        variants[0].fn(Q, K, V_, O0, L, s, {}, 0);
        float worst = 0.f;
        for (size_t k = 1; k < variants.size(); k++) {
            variants[k].fn(Q, K, V_, O, L, s, {}, 0);
            FLASH_CUDA_CHECK(cudaMemset(diff, 0, 4));
            max_diff<<<1024, 256>>>(O0, O, n, diff);
            float w;
            FLASH_CUDA_CHECK(cudaMemcpy(&w, diff, 4, cudaMemcpyDeviceToHost));
            worst = std::max(worst, w);
        }
        for (int r = 0; r < rounds; r++)
            for (size_t k = 0; k < variants.size(); k++)
                t[k].push_back(median_ms([&] { variants[k].fn(Q, K, V_, O, L, s, {}, 0); }, 10, 2));
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
