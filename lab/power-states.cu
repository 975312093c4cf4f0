// lab/power-states.cu: chapter 3's forward and backward (the public fp16 calls) timed in two power
// states, the protocol lab/power-states.py runs SDPA's cuDNN backend through, so that the two
// figures of a row are taken alike (lab/chapter3.md, "Against cuDNN in like power states").
//   cold: after 1 s idle, 3 warm-up calls, then 10 calls each timed alone (CUDA events);
//   hot:  after 400 ms of calls back to back (the H200's power limiter lowers the SM clock
//         about 50 ms into such a stretch: lab/chapter5.md, run 13), 10 calls timed alike.
// Each row prints the medians and the wall-clock window (epoch seconds) of each set of 10, which
// lab/power-states-table.py joins with nvidia-smi's clock samples. Shapes: FlashAttention-2's
// (batch x N = 16384, heads = 2048 / d), d = 64, 128, 256, N = 4096, 16384, causal and not.
// With --options ROUNDS instead: issue 45's floors in the same two states, fp16, d = 128, causal,
// ROUNDS rounds with the cases in turns (lab/options-bench.cu's shapes and options; with "two"
// after ROUNDS, plain and softcap alone, and a head dim D after "two", at that dim): plain,
// softcap 30, ALiBi (BLOOM's slopes) and scale 0.1 at batch 4 x 16 heads x N = 4096; dense causal
// and a window of 4096 keys at 1 x 16 x 32768, TFLOP/s counting visible pairs. Each line is tagged
// with the case and the round (plain1, softcap1, ..., dense1, window1). OPTIONS_SOFTCAP=C sets
// the softcap to C instead of 30: the inputs' scores reach about 2, so a cap of 0.25 puts scores
// past the cap in every tile (the tiles whose tanh then runs on the XU: lib/mask_policy.cuh).
// With "two", OPTIONS_N=N (default 4096; batch 16384 / N) and OPTIONS_CAUSAL=0 (default 1) set the
// shape of the two cases: the softcap's ratio at other lengths and without the mask.
// Build and run (lab/gpu-power-states.sh does both, with cuDNN and the clock samples):
//   make -j16 build/flash.o build/flash_fp16.o build/backward_passes.o build/flash_decode.o \
//     build/checks.o build/dispatch.o build/flash_hopper.o build/flash_hopper_backward.o \
//     build/flash_hopper_fp8.o
//   nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/power-states.cu build/*.o -o power_states
//   ./power_states ours [fwd [D]];  ./power_states --options 2 [two [D]]  (fwd: the forward
//   alone; D: that head dim alone; "both D": both passes at D alone). BWD_DETERMINISTIC=0: the
//   plain rows' backward with options.deterministic false.
#include "checks.h"
#include "flash.h"

#include <cuda_fp16.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "power-states.cuh"  // fill_uniform, both_states: the inputs and the protocol

// The options of the plain rows' backward: the defaults, or deterministic false with
// BWD_DETERMINISTIC=0 (FlashAttention-2's deterministic=False: dQ's adds in no fixed order).
static AttentionOptions unordered;

// Visible (query, key) pairs of one causal head of n rows, a window of `left` keys (-1: none).
static double causal_pairs(int n, int left) {
    double p = 0;
    for (long long i = 0; i < n; ++i) p += left < 0 ? i + 1 : std::min<long long>(i, left) + 1;
    return p;
}

// Issue 45's options against the plain call, forward and backward, rounds in turns.
static void options_rows(int rounds, bool two, int d) {
    struct Case { const char* who; int N; AttentionOptions o; int left; };
    const char* n_env = std::getenv("OPTIONS_N");
    const char* causal_env = std::getenv("OPTIONS_CAUSAL");
    const int first = two && n_env ? std::atoi(n_env) : 4096;
    const bool causal = !(two && causal_env && !std::strcmp(causal_env, "0"));
    for (int N : {first, 32768}) {
        if (two && N != first) break;
        const AttentionShape s{N == 32768 ? 1 : std::max(1, 16384 / N), 16, N, N, d, causal};
        const size_t n = size_t(s.batch) * s.heads * N * s.head_dim;
        std::vector<__half*> t(8);  // Q K V O dO dQ dK dV
        for (__half*& p : t) FLASH_CUDA_CHECK(cudaMalloc(&p, n * sizeof(__half)));
        float *L = nullptr, *slopes = nullptr;
        FLASH_CUDA_CHECK(cudaMalloc(&L, size_t(s.batch) * s.heads * N * sizeof(float)));
        std::vector<float> h(s.heads);
        for (int x = 0; x < s.heads; ++x) h[x] = std::exp2(-8.0f * (x + 1) / s.heads);  // BLOOM's
        FLASH_CUDA_CHECK(cudaMalloc(&slopes, h.size() * sizeof(float)));
        FLASH_CUDA_CHECK(
            cudaMemcpy(slopes, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
        for (int k : {0, 1, 2, 4}) fill_uniform<<<1024, 256>>>(t[k], n, 1 + k);
        FLASH_CUDA_CHECK(cudaGetLastError());
        AttentionOptions none, cap, alibi, scale, window;
        const char* cap_env = std::getenv("OPTIONS_SOFTCAP");
        cap.softcap = cap_env ? float(std::atof(cap_env)) : 30.f;
        alibi.alibi_slopes = slopes;
        scale.softmax_scale = 0.1f;
        window.window_left = 4096, window.window_right = 0;
        std::vector<Case> cases;
        if (N != 32768)
            cases = {{"plain", N, none, -1}, {"softcap", N, cap, -1}, {"alibi", N, alibi, -1},
                     {"scale", N, scale, -1}};
        else
            cases = {{"dense", N, none, -1}, {"window", N, window, 4096}};
        if (two) cases.resize(2);  // plain and softcap (N = 4096 only)
        for (int r = 1; r <= rounds; r++)
            for (const Case& c : cases) {
                const std::string tag = c.who + std::to_string(r);
                const double pairs = causal ? causal_pairs(N, c.left) : double(N) * N;
                const double flop = 4.0 * s.batch * s.heads * pairs * s.head_dim;
                auto fwd = [&] { flash_forward_fp16(t[0], t[1], t[2], t[3], L, s, c.o); };
                auto bwd = [&] {
                    flash_backward_fp16(t[0], t[1], t[2], t[3], t[4], L, t[5], t[6], t[7], s,
                                        c.o);
                };
                both_states(tag.c_str(), "fwd", s, flop, fwd);
                fwd();
                both_states(tag.c_str(), "bwd", s, 2.5 * flop, bwd);
            }
        for (__half* p : t) FLASH_CUDA_CHECK(cudaFree(p));
        FLASH_CUDA_CHECK(cudaFree(L));
        FLASH_CUDA_CHECK(cudaFree(slopes));
    }
}

int main(int argc, char** argv) {
    const char* tag = argc > 1 ? argv[1] : "ours";
    const char* det = std::getenv("BWD_DETERMINISTIC");  // 0: the backward without dQ's order
    unordered.deterministic = !(det && !std::strcmp(det, "0"));
    const bool fwd_only = argc > 2 && std::strcmp(argv[2], "fwd") == 0;
    if (std::strcmp(tag, "--options") == 0) {
        printf("# who pass d D N N causal C cold ms TFLOP/s t0 t1 hot ms TFLOP/s t0 t1\n");
        const bool two = argc > 3 && !std::strcmp(argv[3], "two");
        const int d = two && argc > 4 ? std::atoi(argv[4]) : 128;
        options_rows(argc > 2 ? std::atoi(argv[2]) : 2, two, d);
        return 0;
    }
    printf("# who pass d D N N causal C cold ms TFLOP/s t0 t1 hot ms TFLOP/s t0 t1\n");
    const int only = argc > 3 ? std::atoi(argv[3]) : 0;  // one head dim
    for (int d : {64, 128, 256})
        for (int N : {4096, 16384})
            for (int c : {0, 1}) {
                if (only && d != only) continue;
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
                    flash_backward_fp16(t[0], t[1], t[2], t[3], t[4], L, t[5], t[6], t[7], s,
                                        unordered);
                };
                both_states(tag, "fwd", s, flop, fwd);
                fwd();
                if (!fwd_only) both_states(tag, "bwd", s, 2.5 * flop, bwd);
                for (__half* p : t) FLASH_CUDA_CHECK(cudaFree(p));
                FLASH_CUDA_CHECK(cudaFree(L));
            }
}
