// lab/power-states-ab.cu: versions of chapter 3's forward (flash_hopper.cu) in lab/power-states.cu's
// two power states, so that an A/B of a change that may cost or save energy a tile (not only time)
// is read cold and hot alike, the SM clock beside each (lab/chapter3.md, "Against cuDNN in like
// power states"). The versions link in as lab/hopper-ab.sh links them for lab/hopper-ab.cu:
//   AB_DRIVER=lab/power-states-ab.cu lab/hopper-ab.sh NAME=SOURCE [NAME=SOURCE ...]
//   nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader -lms 20 > smi.csv &
//   ./power_states_ab [ROUNDS [D]] > ab.txt; kill %1     (default 2 rounds, d = 128)
// AB_SEQS=2048,8192 (the lengths N, default 4096,16384) and AB_CAUSAL=1 (or 0; default both) pick
// other shapes of the protocol: batch 16384 / N, 2048 / d heads; AB_HEADS=32 other query heads,
// AB_GROUP=4 query heads a K/V head (GQA; the buffers are sized as Q, dK and dV compared as such).
//   python3 lab/power-states-table.py --ratio NEW/BASE smi.csv ab.txt
// Built with -DAB_BACKWARD (AB_KIND=bwd lab/hopper-ab.sh, or AB_KIND=bwd lab/gpu-power-states.sh):
// versions of chapter 3's backward (flash_hopper_backward.cu) instead, the same way.
// Each round runs every version in turn at each shape (FlashAttention-2's, N = 4096 and 16384,
// causal and not); a line per version, tagged NAME and the round, as lab/power-states.cu prints.
#include "checks.h"
#include "flash.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "power-states.cuh"  // fill_uniform, both_states: the inputs and the protocol

#ifndef AB_BACKWARD
using Fn = void (*)(const __half*, const __half*, const __half*, __half*, float*,
                    const AttentionShape&, cudaStream_t);
#define DECL(v)                                                                            \
    void flash_forward_fp16_hopper_##v(const __half*, const __half*, const __half*, __half*, \
                                       float*, const AttentionShape&, cudaStream_t);
#else  // AB_KIND=bwd: versions of chapter 3's backward (flash_hopper_backward.cu)
using Fn = void (*)(const __half*, const __half*, const __half*, const __half*, const __half*,
                    const float*, __half*, __half*, __half*, const AttentionShape&, cudaStream_t);
#define DECL(v)                                                                              \
    void flash_backward_fp16_hopper_##v(const __half*, const __half*, const __half*,          \
                                        const __half*, const __half*, const float*, __half*,  \
                                        __half*, __half*, const AttentionShape&, cudaStream_t);
#endif
#include "hopper-ab-variants.h"  // written by lab/hopper-ab.sh: DECL(name)..., VARIANT_LIST
struct Version { const char* name; Fn fn; };
__global__ void fill_value(float* p, size_t n, float v) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x)
        p[i] = v;
}
static std::vector<Version> versions = { VARIANT_LIST };

int main(int argc, char** argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 2, d = argc > 2 ? atoi(argv[2]) : 128;
    printf("# who pass d D N N causal C cold ms TFLOP/s t0 t1 hot ms TFLOP/s t0 t1\n");
    std::vector<int> seqs, masks;
    for (const char* x = getenv("AB_SEQS") ? getenv("AB_SEQS") : "4096,16384"; *x;
         x += strcspn(x, ","), x += *x == ',')
        seqs.push_back(atoi(x));
    const char* only = getenv("AB_CAUSAL");
    for (int c : {0, 1})
        if (!only || atoi(only) == c) masks.push_back(c);
    for (int N : seqs)
        for (int c : masks) {
            AttentionShape s{16384 / N, 2048 / d, N, N, d, bool(c)};
            if (getenv("AB_HEADS")) s.heads = atoi(getenv("AB_HEADS"));
            if (getenv("AB_GROUP")) s.kv_heads = s.heads / atoi(getenv("AB_GROUP"));
            const size_t n = q_elems(s);
            std::vector<__half*> t(8);  // Q K V O dO dQ dK dV
            for (__half*& p : t) FLASH_CUDA_CHECK(cudaMalloc(&p, n * sizeof(__half)));
            float* L = nullptr;
            FLASH_CUDA_CHECK(cudaMalloc(&L, l_elems(s) * sizeof(float)));
            for (int k : {0, 1, 2, 4}) fill_uniform<<<1024, 256>>>(t[k], n, 1 + k);
            FLASH_CUDA_CHECK(cudaGetLastError());
            const double pairs = c ? double(N) * (N + 1) / 2 : double(N) * N;
            const double flop = 4.0 * s.batch * s.heads * pairs * d;
#ifdef AB_BACKWARD  // O uniform as the inputs, each row's L log N (its scores are near 0): the
            // probabilities about 1/N, as a forward of these inputs would leave them
            fill_uniform<<<1024, 256>>>(t[3], n, 4);
            fill_value<<<1024, 256>>>(L, l_elems(s), std::log(float(N)));
            FLASH_CUDA_CHECK(cudaGetLastError());
#endif
#ifdef AB_BACKWARD  // each version's dQ, dK, dV against the first's, element by element
            std::vector<__half> first(3 * n), mine(3 * n);
            for (size_t x = 0; x < versions.size(); x++) {
                versions[x].fn(t[0], t[1], t[2], t[3], t[4], L, t[5], t[6], t[7], s, 0);
                for (int k = 0; k < 3; k++)
                    FLASH_CUDA_CHECK(cudaMemcpy((x ? mine : first).data() + k * n, t[5 + k],
                                                n * sizeof(__half), cudaMemcpyDeviceToHost));
                if (x == 0) continue;
                size_t differ = 0;
                for (size_t e = 0; e < 3 * n; e++)
                    differ += __half_as_ushort(mine[e]) != __half_as_ushort(first[e]);
                printf("# bits: %s against %s, d %d N %d causal %d: %zu of %zu elements differ\n",
                       versions[x].name, versions[0].name, d, N, c, differ, 3 * n);
            }
#endif
            for (int r = 1; r <= rounds; r++)
                for (const Version& v : versions) {
                    const std::string tag = v.name + std::to_string(r);
#ifndef AB_BACKWARD
                    both_states(tag.c_str(), "fwd", s, flop,
                                [&] { v.fn(t[0], t[1], t[2], t[3], L, s, 0); });
#else
                    both_states(tag.c_str(), "bwd", s, 2.5 * flop, [&] {
                        v.fn(t[0], t[1], t[2], t[3], t[4], L, t[5], t[6], t[7], s, 0);
                    });
#endif
                }
            for (__half* p : t) FLASH_CUDA_CHECK(cudaFree(p));
            FLASH_CUDA_CHECK(cudaFree(L));
        }
}
