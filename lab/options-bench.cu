// lab/options-bench.cu: chapter 5's options against the plain calls, timed: a sliding window
// against the dense causal mask at N = 32k, and softcap, ALiBi and a softmax scale against plain
// attention at N = 4096 (lab/chapter5.md, lab/data/options-h200.csv). fp16, chapter 2's kernels
// (which the options run) beside the public call (chapter 3 on an H100 or H200), and the decode
// (chapter 4) with each option against none.
// TFLOP/s counts the visible (query, key) pairs: 4 d per pair forward, 2.5 times that backward
// (FlashAttention-2's count), so a window's figure is comparable with the dense one.
// Build and run from the repository root (the library built with make):
//   make test_flash
//   nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/options-bench.cu build/flash.o \
//        build/flash_fp16.o build/backward_passes.o build/flash_decode.o build/flash_hopper.o \
//        build/flash_hopper_backward.o build/flash_hopper_fp8.o build/checks.o build/dispatch.o \
//        -o options_bench
//   ./options_bench
// Each figure: the median of 10 CUDA-event-timed calls after 3 warm-ups. Prints CSV rows:
// case,call,seq,window,ms_fwd,ms_bwd,tflops_fwd,tflops_fwd_bwd. With OPTIONS_BENCH_ONLY=NAME
// only the rows of the public and options calls whose case starts with NAME, and no decode (for
// a profiler: lab/options-ab.sh). With OPTIONS_BENCH_REPEAT=N, only dense causal's row, N times
// over the same buffers and N times over fresh ones. With OPTIONS_BENCH_PAIRED=N, dense causal
// and the window in turns, each after 2 s idle, N times. With OPTIONS_BENCH_CLOCKS=N, N dense
// causal forwards back to back, each one's time and the SM clock right after it.
#include "checks.h"
#include "flash.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
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

// The SM clock in MHz, as the cycles one SM counts over 20 us of the global timer.
__global__ void sm_clock_probe(float* mhz) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    const long long c0 = clock64();
    do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (t - t0 < 20000);
    *mhz = float(clock64() - c0) * 1000.f / float(t - t0);
}

// Visible (query, key) pairs of one head: causal with a window of `left` keys (-1: none).
static double pairs(int n, int left) {
    double p = 0;
    for (long long i = 0; i < n; ++i) p += left < 0 ? i + 1 : std::min<long long>(i, left) + 1;
    return p;
}

struct Buffers {
    __half *Q, *K, *V, *O, *dO, *dQ, *dK, *dV;
    float *L, *slopes;
    explicit Buffers(size_t n, int heads) {
        std::vector<__half> h(n);
        std::mt19937 rng(1);
        std::normal_distribution<float> normal;
        for (auto& x : h) x = __float2half(normal(rng));
        for (__half** p : {&Q, &K, &V, &O, &dO, &dQ, &dK, &dV}) {
            FLASH_CUDA_CHECK(cudaMalloc(p, n * sizeof(__half)));
            FLASH_CUDA_CHECK(cudaMemcpy(*p, h.data(), n * sizeof(__half), cudaMemcpyHostToDevice));
        }
        FLASH_CUDA_CHECK(cudaMalloc(&L, n / 64 * sizeof(float)));  // rows: n / d, d >= 64
        std::vector<float> s(heads);
        for (int x = 0; x < heads; ++x) s[x] = std::exp2(-8.0f * (x + 1) / heads);  // BLOOM's
        FLASH_CUDA_CHECK(cudaMalloc(&slopes, heads * sizeof(float)));
        FLASH_CUDA_CHECK(cudaMemcpy(slopes, s.data(), heads * sizeof(float), cudaMemcpyHostToDevice));
    }
    void release() {
        for (void* p : {(void*)Q, (void*)K, (void*)V, (void*)O, (void*)dO, (void*)dQ, (void*)dK,
                        (void*)dV, (void*)L, (void*)slopes})
            FLASH_CUDA_CHECK(cudaFree(p));
    }
};

// One row: the forward, then the forward and backward, of `call` ("plain": the public call;
// "ch2": chapter 2's plain kernels; "options": the calls with options o).
static void row(const char* what, const char* call, const AttentionShape& s, int left,
                const AttentionOptions& o, Buffers& b) {
    const std::string c = call;
    const char* only = std::getenv("OPTIONS_BENCH_ONLY");
    if (only && (c == "ch2" || std::strncmp(what, only, std::strlen(only)) != 0)) return;
    const auto fwd = [&] {
        if (c == "plain") flash_forward_fp16(b.Q, b.K, b.V, b.O, b.L, s);
        else if (c == "ch2") flash_forward_fp16_ampere(b.Q, b.K, b.V, b.O, b.L, s);
        else flash_forward_fp16(b.Q, b.K, b.V, b.O, b.L, s, o);
    };
    const auto bwd = [&] {
        if (c == "plain") flash_backward_fp16(b.Q, b.K, b.V, b.O, b.dO, b.L, b.dQ, b.dK, b.dV, s);
        else if (c == "ch2")
            flash_backward_fp16_ampere(b.Q, b.K, b.V, b.O, b.dO, b.L, b.dQ, b.dK, b.dV, s);
        else flash_backward_fp16(b.Q, b.K, b.V, b.O, b.dO, b.L, b.dQ, b.dK, b.dV, s, o);
    };
    const float f = median_ms(fwd);
    fwd();
    const float g = median_ms(bwd);
    const double flops = 4.0 * s.head_dim * pairs(s.q_len, left) * s.batch * s.heads;
    printf("%s,%s,%d,%d,%.3f,%.3f,%.1f,%.1f\n", what, call, s.q_len, left, f, g,
           flops / (f * 1e9), 3.5 * flops / ((f + g) * 1e9));
    fflush(stdout);
}

int main() {
    printf("case,call,seq,window,ms_fwd,ms_bwd,tflops_fwd,tflops_fwd_bwd\n");
    if (const char* repeat = std::getenv("OPTIONS_BENCH_REPEAT")) {
        // Dense causal's spread between processes (lab/chapter5.md, run 11): its row N times in
        // this process over the same buffers, then N times over fresh ones (freed, allocated
        // again): does the time follow the buffers, or the process?
        const AttentionShape s{1, 16, 32768, 32768, 128, true};
        const size_t n = size_t(s.batch) * s.heads * s.q_len * s.head_dim;
        AttentionOptions none;
        Buffers b(n, s.heads);
        for (int r = 0; r < std::atoi(repeat); ++r)
            row("dense, same buffers", "plain", s, -1, none, b);
        b.release();
        for (int r = 0; r < std::atoi(repeat); ++r) {
            Buffers fresh(n, s.heads);
            row("dense, fresh buffers", "plain", s, -1, none, fresh);
            fresh.release();
        }
        return 0;
    }
    if (const char* clocks = std::getenv("OPTIONS_BENCH_CLOCKS")) {
        // Each call's own time and the SM clock right after it (lab/chapter5.md, run 12: do the
        // two speeds of dense causal follow the clock?): after 2 s idle, N forwards back to back.
        const AttentionShape s{1, 16, 32768, 32768, 128, true};
        Buffers b(size_t(s.batch) * s.heads * s.q_len * s.head_dim, s.heads);
        float* mhz;
        FLASH_CUDA_CHECK(cudaMalloc(&mhz, sizeof(float)));
        cudaEvent_t a, e;
        FLASH_CUDA_CHECK(cudaEventCreate(&a));
        FLASH_CUDA_CHECK(cudaEventCreate(&e));
        std::this_thread::sleep_for(std::chrono::seconds(2));
        printf("call,ms_fwd,sm_mhz_after\n");
        for (int r = 0; r < std::atoi(clocks); ++r) {
            FLASH_CUDA_CHECK(cudaEventRecord(a));
            flash_forward_fp16(b.Q, b.K, b.V, b.O, b.L, s);
            FLASH_CUDA_CHECK(cudaEventRecord(e));
            sm_clock_probe<<<1, 1>>>(mhz);
            FLASH_CUDA_CHECK(cudaGetLastError());
            float ms = 0, f = 0;
            FLASH_CUDA_CHECK(cudaEventSynchronize(e));
            FLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, a, e));
            FLASH_CUDA_CHECK(cudaMemcpy(&f, mhz, sizeof(float), cudaMemcpyDeviceToHost));
            printf("%d,%.3f,%.0f\n", r, ms, f);
        }
        return 0;
    }
    if (const char* paired = std::getenv("OPTIONS_BENCH_PAIRED")) {
        // The window floor at like clocks (lab/chapter5.md, run 12: dense causal runs into the
        // board's power cap): dense causal and the window in turns, N times, each after 2 s idle.
        const AttentionShape s{1, 16, 32768, 32768, 128, true};
        Buffers b(size_t(s.batch) * s.heads * s.q_len * s.head_dim, s.heads);
        AttentionOptions none, window;
        window.window_left = 4096, window.window_right = 0;
        for (int r = 0; r < std::atoi(paired); ++r) {
            std::this_thread::sleep_for(std::chrono::seconds(2));
            row("dense causal, after 2 s idle", "plain", s, -1, none, b);
            std::this_thread::sleep_for(std::chrono::seconds(2));
            row("window 4096, after 2 s idle", "options", s, 4096, window, b);
        }
        return 0;
    }
    {   // A window of 4096 keys at N = 32k against the dense causal mask, d = 128.
        const AttentionShape s{1, 16, 32768, 32768, 128, true};
        Buffers b(size_t(s.batch) * s.heads * s.q_len * s.head_dim, s.heads);
        AttentionOptions none, window;
        window.window_left = 4096, window.window_right = 0;
        row("dense causal", "plain", s, -1, none, b);
        row("dense causal", "ch2", s, -1, none, b);
        row("window 4096", "options", s, 4096, window, b);
    }
    {   // Softcap, ALiBi and a scale against plain attention, N = 4096, d = 128, causal.
        const AttentionShape s{4, 16, 4096, 4096, 128, true};
        Buffers b(size_t(s.batch) * s.heads * s.q_len * s.head_dim, s.heads);
        AttentionOptions none, cap, alibi, scale;
        cap.softcap = 30.f;
        alibi.alibi_slopes = b.slopes;
        scale.softmax_scale = 0.1f;
        row("plain", "plain", s, -1, none, b);
        row("plain", "ch2", s, -1, none, b);
        row("softcap 30", "options", s, -1, cap, b);
        row("alibi", "options", s, -1, alibi, b);
        row("scale 0.1", "options", s, -1, scale, b);
    }
    if (!std::getenv("OPTIONS_BENCH_ONLY")) {
        // The decode (chapter 4): one query row against 32k keys, 32 query heads over 8 K/V heads,
        // d = 128, batch 8, forward alone. GB/s counts the K and V bytes of the keys the rows see
        // (a window's 4097, else all), so that a window's figure is comparable with the plain one.
        const AttentionShape s{8, 32, 1, 32768, 128, true, 8};
        Buffers b(size_t(s.batch) * 8 * s.kv_len * s.head_dim, s.heads);
        AttentionOptions none, window, cap, alibi, scale;
        window.window_left = 4096, window.window_right = 0;
        cap.softcap = 30.f;
        alibi.alibi_slopes = b.slopes;
        scale.softmax_scale = 0.1f;
        printf("decode case,call,kv_len,window,us,GB/s\n");
        const auto decode_row = [&](const char* what, const AttentionOptions& o, int left) {
            const bool plain = &o == &none;
            const float ms = median_ms([&] {
                if (plain) flash_forward_fp16(b.Q, b.K, b.V, b.O, b.L, s);
                else flash_forward_fp16(b.Q, b.K, b.V, b.O, b.L, s, o);
            });
            const double keys = left < 0 ? s.kv_len : left + 1;
            const double bytes = 2.0 * s.batch * 8 * keys * s.head_dim * sizeof(__half);
            printf("%s,%s,%d,%d,%.1f,%.0f\n", what, plain ? "plain" : "options", s.kv_len, left,
                   ms * 1e3, bytes / (ms * 1e6));
            fflush(stdout);
        };
        decode_row("decode plain", none, -1);
        decode_row("decode window 4096", window, 4096);
        decode_row("decode softcap 30", cap, -1);
        decode_row("decode alibi", alibi, -1);
        decode_row("decode scale 0.1", scale, -1);
    }
    return 0;
}
