// lab/varlen-bench.cu: chapter 5's packed batches, timed (lab/chapter5.md): 64k tokens packed from
// sequence lengths drawn uniformly in 128-8192, d = 128, 16 heads, causal, fp16, forward and
// backward, against the dense kernels at N = 4096 (the same 64k tokens as 16 sequences) and the
// same batch padded to its longest sequence. A packed batch runs chapter 2's kernels; the dense
// and padded rows are given for chapter 2 (_ampere) and the public call (chapter 3 on an H100 or
// H200). TFLOP/s counts the real (query, key) pairs, 4 d a pair forward, 2.5 times that backward
// (FlashAttention-2's count); a padded batch's pad rows and keys count for nothing.
// Build and run from the repository root (the library built with make):
//   make test_flash
//   nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/varlen-bench.cu build/flash.o \
//        build/flash_fp16.o build/backward_passes.o build/flash_decode.o build/flash_hopper.o \
//        build/flash_hopper_backward.o build/checks.o build/dispatch.o -o varlen_bench
//   ./varlen_bench
// Each figure: the median of 10 CUDA-event-timed calls after 3 warm-ups (a packed call's time
// includes its check of cu_seqlens: a copy to the host and a wait). Prints CSV rows:
// case,call,sequences,tokens,ms_fwd,ms_bwd,tflops_fwd,tflops_fwd_bwd.
#include "checks.h"
#include "flash.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

static float median_ms(const std::function<void()>& call) {
    for (int w = 0; w < 3; ++w) call();
    FLASH_CUDA_CHECK(cudaDeviceSynchronize());
    cudaEvent_t a, b;
    FLASH_CUDA_CHECK(cudaEventCreate(&a));
    FLASH_CUDA_CHECK(cudaEventCreate(&b));
    std::vector<float> ms;
    for (int r = 0; r < 10; ++r) {
        FLASH_CUDA_CHECK(cudaEventRecord(a));
        call();
        FLASH_CUDA_CHECK(cudaEventRecord(b));
        FLASH_CUDA_CHECK(cudaEventSynchronize(b));
        float t = 0;
        FLASH_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
        ms.push_back(t);
    }
    FLASH_CUDA_CHECK(cudaEventDestroy(a));
    FLASH_CUDA_CHECK(cudaEventDestroy(b));
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

// Device buffers for n elements a tensor (random fp16) and n / 64 floats of L.
struct Buffers {
    __half *Q, *K, *V, *O, *dO, *dQ, *dK, *dV;
    float* L;
    explicit Buffers(size_t n) {
        std::vector<__half> h(n);
        std::mt19937 rng(1);
        std::normal_distribution<float> normal;
        for (auto& x : h) x = __float2half(normal(rng));
        for (__half** p : {&Q, &K, &V, &O, &dO, &dQ, &dK, &dV}) {
            FLASH_CUDA_CHECK(cudaMalloc(p, n * sizeof(__half)));
            FLASH_CUDA_CHECK(cudaMemcpy(*p, h.data(), n * sizeof(__half), cudaMemcpyHostToDevice));
        }
        FLASH_CUDA_CHECK(cudaMalloc(&L, n / 64 * sizeof(float)));
    }
    ~Buffers() {
        for (void* p : {(void*)Q, (void*)K, (void*)V, (void*)O, (void*)dO, (void*)dQ, (void*)dK,
                        (void*)dV, (void*)L})
            cudaFree(p);
    }
};

// One row: `pairs` real (query, key) pairs a head; call "public", "ch2" or "packed" (options o).
static void row(const char* what, const char* call, const AttentionShape& s, int sequences,
                long long tokens, double pairs, const AttentionOptions& o, Buffers& b) {
    const std::string c = call;
    const auto fwd = [&] {
        if (c == "public") flash_forward_fp16(b.Q, b.K, b.V, b.O, b.L, s);
        else if (c == "ch2") flash_forward_fp16_ampere(b.Q, b.K, b.V, b.O, b.L, s);
        else flash_forward_fp16(b.Q, b.K, b.V, b.O, b.L, s, o);
    };
    const auto bwd = [&] {
        if (c == "public") flash_backward_fp16(b.Q, b.K, b.V, b.O, b.dO, b.L, b.dQ, b.dK, b.dV, s);
        else if (c == "ch2")
            flash_backward_fp16_ampere(b.Q, b.K, b.V, b.O, b.dO, b.L, b.dQ, b.dK, b.dV, s);
        else flash_backward_fp16(b.Q, b.K, b.V, b.O, b.dO, b.L, b.dQ, b.dK, b.dV, s, o);
    };
    const float f = median_ms(fwd);
    fwd();
    const float g = median_ms(bwd);
    const double flops = 4.0 * s.head_dim * pairs * s.heads;
    printf("%s,%s,%d,%lld,%.3f,%.3f,%.1f,%.1f\n", what, call, sequences, tokens, f, g,
           flops / (f * 1e9), 3.5 * flops / ((f + g) * 1e9));
    fflush(stdout);
}

static double causal_pairs(long long n) { return double(n) * (n + 1) / 2; }

int main() {
    const int H = 16, d = 128, total = 65536;
    printf("case,call,sequences,tokens,ms_fwd,ms_bwd,tflops_fwd,tflops_fwd_bwd\n");
    // Lengths drawn uniformly in [128, 8192] until 64k tokens; the last one cut to fit.
    std::mt19937 rng(2024);
    std::uniform_int_distribution<int> length(128, 8192);
    std::vector<int> lens, cu{0};
    while (cu.back() < total) {
        lens.push_back(std::min(length(rng), total - cu.back()));
        cu.push_back(cu.back() + lens.back());
    }
    const int B = int(lens.size()), longest = *std::max_element(lens.begin(), lens.end());
    double pairs = 0;
    for (int n : lens) pairs += causal_pairs(n);
    Buffers b(size_t(B) * longest * H * d);  // the padded batch's size: the largest here
    {   // Packed.
        int* cu_gpu;
        FLASH_CUDA_CHECK(cudaMalloc(&cu_gpu, cu.size() * sizeof(int)));
        FLASH_CUDA_CHECK(cudaMemcpy(cu_gpu, cu.data(), cu.size() * sizeof(int),
                                    cudaMemcpyHostToDevice));
        AttentionOptions o;
        o.packed = {cu_gpu, cu_gpu, total, total};
        row("packed", "packed", {B, H, longest, longest, d, true}, B, total, pairs, o, b);
        FLASH_CUDA_CHECK(cudaFree(cu_gpu));
    }
    {   // Dense: 16 sequences of 4096, the same tokens.
        const AttentionShape s{total / 4096, H, 4096, 4096, d, true};
        const double dense_pairs = (total / 4096) * causal_pairs(4096);
        row("dense 4096", "ch2", s, s.batch, total, dense_pairs, {}, b);
        row("dense 4096", "public", s, s.batch, total, dense_pairs, {}, b);
    }
    {   // Padded to the longest: every sequence longest rows, its real pairs counted.
        const AttentionShape s{B, H, longest, longest, d, true};
        row("padded", "ch2", s, B, (long long)B * longest, pairs, {}, b);
        row("padded", "public", s, B, (long long)B * longest, pairs, {}, b);
    }
    return 0;
}
