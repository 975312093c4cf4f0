// lab/fp8-accuracy.cu: how far chapter 3's fp8 forward drifts from exact attention as rows grow,
// for variants of flash_hopper_fp8.cu built as lab/fp8-ab.cu's are (lab/chapter3.md, "l on the
// tensor cores and L on long rows"):
//   AB_KIND=fp8 AB_DRIVER=lab/fp8-accuracy.cu lab/hopper-ab.sh NAME=SOURCE [NAME=SOURCE ...]
//   ./fp8_accuracy
// Q, K normal, V normal plus MU (a channel mean, as models' V have), all rounded to e4m3, descales
// 1; 4 heads, 128 queries, kv_len keys, no mask. For 16 rows of each head, O and L against exact
// softmax attention on the same e4m3 numbers in double. e4m3's rounding of P~ is to nearest: it
// scatters O, with no sign. A mean signed error that grows with the row's length is a sum that
// loses bits one way (truncation), e.g. an accumulator on the tensor cores.
#include "checks.h"
#include "flash.h"
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

using fp8 = __nv_fp8_e4m3;
using Fn = void (*)(const fp8*, const fp8*, const fp8*, __nv_bfloat16*, float*,
                    const AttentionShape&, const Fp8Descales&, cudaStream_t);
#define DECL(v)                                                                               \
    void flash_forward_fp8_hopper_##v(const fp8*, const fp8*, const fp8*, __nv_bfloat16*,      \
                                      float*, const AttentionShape&, const Fp8Descales&,      \
                                      cudaStream_t);
#include "hopper-ab-variants.h"  // written by lab/hopper-ab.sh: DECL(name)..., VARIANT_LIST
struct Variant { const char* name; Fn fn; };
static std::vector<Variant> variants = { VARIANT_LIST };
constexpr float MU = 1.f;
constexpr int kHeads = 4, kQueries = 128, kRowsChecked = 16;

int main() {
    printf("%-8s %3s %6s %12s %12s %12s %12s\n", "variant", "d", "keys", "mean dO/mu",
           "max|dO|", "mean dL", "max|dL|");
    for (int d : {128, 256})
        for (int keys : {1024, 4096, 16384, 32768}) {
            const AttentionShape s{1, kHeads, kQueries, keys, d, false};
            std::mt19937 rng(1000 + keys + d);
            std::normal_distribution<float> normal(0.f, 1.f);
            std::vector<fp8> Q(size_t(kHeads) * kQueries * d), K(size_t(kHeads) * keys * d),
                V(K.size());
            for (fp8& x : Q) x = fp8(normal(rng));
            for (fp8& x : K) x = fp8(normal(rng));
            for (fp8& x : V) x = fp8(normal(rng) + MU);
            const auto widen = [](const std::vector<fp8>& x) {  // (e4m3 -> float is exact)
                std::vector<float> f(x.size());
                for (size_t e = 0; e < x.size(); e++) f[e] = float(x[e]);
                return f;
            };
            const std::vector<float> Qf = widen(Q), Kf = widen(K), Vf = widen(V);
            // The exact rows, in double (queries 0, 8, 16, ... of each head).
            std::vector<double> O_ref(size_t(kHeads) * kRowsChecked * d), L_ref(kHeads * kRowsChecked);
            for (int h = 0; h < kHeads; h++)
                for (int r = 0; r < kRowsChecked; r++) {
                    const int i = r * (kQueries / kRowsChecked);
                    std::vector<double> S(keys);
                    double m = -INFINITY, l = 0;
                    for (int j = 0; j < keys; j++) {
                        double dot = 0;
                        for (int x = 0; x < d; x++)
                            dot += double(Qf[(size_t(h) * kQueries + i) * d + x]) *
                                   Kf[(size_t(h) * keys + j) * d + x];
                        S[j] = dot / std::sqrt(double(d)), m = std::max(m, S[j]);
                    }
                    std::vector<double> o(d, 0);
                    for (int j = 0; j < keys; j++) {
                        const double p = std::exp(S[j] - m);
                        l += p;
                        for (int x = 0; x < d; x++)
                            o[x] += p * Vf[(size_t(h) * keys + j) * d + x];
                    }
                    for (int x = 0; x < d; x++) O_ref[(size_t(h) * kRowsChecked + r) * d + x] = o[x] / l;
                    L_ref[h * kRowsChecked + r] = m + std::log(l);
                }
            fp8 *dQ, *dK, *dV;
            __nv_bfloat16* dO;
            float* dL;
            FLASH_CUDA_CHECK(cudaMalloc(&dQ, Q.size()));
            FLASH_CUDA_CHECK(cudaMalloc(&dK, K.size()));
            FLASH_CUDA_CHECK(cudaMalloc(&dV, V.size()));
            FLASH_CUDA_CHECK(cudaMalloc(&dO, Q.size() * 2));
            FLASH_CUDA_CHECK(cudaMalloc(&dL, size_t(kHeads) * kQueries * 4));
            FLASH_CUDA_CHECK(cudaMemcpy(dQ, Q.data(), Q.size(), cudaMemcpyHostToDevice));
            FLASH_CUDA_CHECK(cudaMemcpy(dK, K.data(), K.size(), cudaMemcpyHostToDevice));
            FLASH_CUDA_CHECK(cudaMemcpy(dV, V.data(), V.size(), cudaMemcpyHostToDevice));
            for (const Variant& v : variants) {
                v.fn(dQ, dK, dV, dO, dL, s, {}, 0);
                FLASH_CUDA_CHECK(cudaDeviceSynchronize());
                std::vector<__nv_bfloat16> O(Q.size());
                std::vector<float> L(size_t(kHeads) * kQueries);
                FLASH_CUDA_CHECK(cudaMemcpy(O.data(), dO, O.size() * 2, cudaMemcpyDeviceToHost));
                FLASH_CUDA_CHECK(cudaMemcpy(L.data(), dL, L.size() * 4, cudaMemcpyDeviceToHost));
                double sum_o = 0, max_o = 0, sum_l = 0, max_l = 0;
                for (int h = 0; h < kHeads; h++)
                    for (int r = 0; r < kRowsChecked; r++) {
                        const int i = r * (kQueries / kRowsChecked);
                        for (int x = 0; x < d; x++) {
                            const double e = double(float(O[(size_t(h) * kQueries + i) * d + x])) -
                                             O_ref[(size_t(h) * kRowsChecked + r) * d + x];
                            sum_o += e, max_o = std::max(max_o, std::fabs(e));
                        }
                        const double e = L[h * kQueries + i] - L_ref[h * kRowsChecked + r];
                        sum_l += e, max_l = std::max(max_l, std::fabs(e));
                    }
                const double rows = kHeads * kRowsChecked;
                printf("%-8s %3d %6d %12.2e %12.2e %12.2e %12.2e\n", v.name, d, keys,
                       sum_o / (rows * d) / MU, max_o, sum_l / rows, max_l);
            }
            for (void* p : {(void*)dQ, (void*)dK, (void*)dV, (void*)dO, (void*)dL})
                FLASH_CUDA_CHECK(cudaFree(p));
        }
    return 0;
}
