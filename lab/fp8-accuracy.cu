// lab/fp8-accuracy.cu: how far chapter 3's fp8 forward drifts from exact attention as rows grow,
// for variants of flash_hopper_fp8.cu built as lab/fp8-ab.cu's are (lab/chapter3.md, "l on the
// tensor cores and L on long rows"), or of chapter 3's fp16 forward, flash_hopper.cu:
//   AB_KIND=fp8 AB_DRIVER=lab/fp8-accuracy.cu lab/hopper-ab.sh NAME=SOURCE [NAME=SOURCE ...]
//   AB_DRIVER=lab/fp8-accuracy.cu lab/hopper-ab.sh NAME=SOURCE ...        (fp16: flash_hopper.cu)
//   ./fp8_accuracy
// Q, K normal, V normal plus MU (a channel mean, as models' V have), all rounded to e4m3 (or
// fp16), descales 1; 4 heads, 128 queries, kv_len keys, no mask. For 16 rows of each head, O and L against exact
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
using Fp8Fn = void (*)(const fp8*, const fp8*, const fp8*, __nv_bfloat16*, float*,
                       const AttentionShape&, const Fp8Descales&, cudaStream_t);
using Fp16Fn = void (*)(const __half*, const __half*, const __half*, __half*, float*,
                        const AttentionShape&, cudaStream_t);
#define DECL(v)                                                                               \
    void flash_forward_fp8_hopper_##v(const fp8*, const fp8*, const fp8*, __nv_bfloat16*,      \
                                      float*, const AttentionShape&, const Fp8Descales&,      \
                                      cudaStream_t);                                          \
    void flash_forward_fp16_hopper_##v(const __half*, const __half*, const __half*, __half*,   \
                                       float*, const AttentionShape&, cudaStream_t);
#include "hopper-ab-variants.h"  // written by lab/hopper-ab.sh: DECL(name)..., VARIANT_LIST
struct Variant {  // one of the two kinds, as VARIANT_LIST names it
    const char* name;
    Fp8Fn f8 = nullptr;
    Fp16Fn f16 = nullptr;
    Variant(const char* n, Fp8Fn f) : name(n), f8(f) {}
    Variant(const char* n, Fp16Fn f) : name(n), f16(f) {}
};
static std::vector<Variant> variants = { VARIANT_LIST };
constexpr float MU = 1.f;
constexpr int kHeads = 4, kQueries = 128, kRowsChecked = 16;

// x rounded to the variant's input type (e4m3 or fp16), as float (exact in both cases).
float rounded(float x, bool f8) { return f8 ? float(fp8(x)) : __half2float(__float2half(x)); }

// Exact attention in double on the rounded inputs, for rows 0, 8, 16, ... of each head.
void exact(const std::vector<float>& Q, const std::vector<float>& K, const std::vector<float>& V,
           int keys, int d, std::vector<double>& O_ref, std::vector<double>& L_ref) {
    O_ref.assign(size_t(kHeads) * kRowsChecked * d, 0), L_ref.assign(kHeads * kRowsChecked, 0);
    for (int h = 0; h < kHeads; h++)
        for (int r = 0; r < kRowsChecked; r++) {
            const int i = r * (kQueries / kRowsChecked);
            std::vector<double> S(keys), o(d, 0);
            double m = -INFINITY, l = 0;
            for (int j = 0; j < keys; j++) {
                double dot = 0;
                for (int x = 0; x < d; x++)
                    dot += double(Q[(size_t(h) * kQueries + i) * d + x]) * K[(size_t(h) * keys + j) * d + x];
                S[j] = dot / std::sqrt(double(d)), m = std::max(m, S[j]);
            }
            for (int j = 0; j < keys; j++) {
                const double p = std::exp(S[j] - m);
                l += p;
                for (int x = 0; x < d; x++) o[x] += p * V[(size_t(h) * keys + j) * d + x];
            }
            for (int x = 0; x < d; x++) O_ref[(size_t(h) * kRowsChecked + r) * d + x] = o[x] / l;
            L_ref[h * kRowsChecked + r] = m + std::log(l);
        }
}

template <typename T>
T* upload(const std::vector<float>& x) {
    std::vector<T> y(x.begin(), x.end());
    T* p;
    FLASH_CUDA_CHECK(cudaMalloc(&p, y.size() * sizeof(T)));
    FLASH_CUDA_CHECK(cudaMemcpy(p, y.data(), y.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
}

int main() {
    printf("%-8s %3s %6s %12s %12s %12s %12s\n", "variant", "d", "keys", "mean dO/mu",
           "max|dO|", "mean dL", "max|dL|");
    for (int d : {128, 256})
        for (int keys : {1024, 4096, 16384, 32768}) {
            const AttentionShape s{1, kHeads, kQueries, keys, d, false};
            std::mt19937 rng(1000 + keys + d);
            std::normal_distribution<float> normal(0.f, 1.f);
            std::vector<float> Qn(size_t(kHeads) * kQueries * d), Kn(size_t(kHeads) * keys * d),
                Vn(Kn.size());
            for (float& x : Qn) x = normal(rng);
            for (float& x : Kn) x = normal(rng);
            for (float& x : Vn) x = normal(rng) + MU;
            for (const Variant& v : variants) {
                const bool f8 = v.f8 != nullptr;
                std::vector<float> Q(Qn), K(Kn), V(Vn);
                for (auto* t : {&Q, &K, &V})
                    for (float& x : *t) x = rounded(x, f8);
                std::vector<double> O_ref, L_ref;
                exact(Q, K, V, keys, d, O_ref, L_ref);
                std::vector<float> O(Q.size()), L(size_t(kHeads) * kQueries);
                float* dL;
                FLASH_CUDA_CHECK(cudaMalloc(&dL, L.size() * 4));
                if (f8) {
                    fp8 *dQ = upload<fp8>(Q), *dK = upload<fp8>(K), *dV = upload<fp8>(V);
                    __nv_bfloat16* dO;
                    FLASH_CUDA_CHECK(cudaMalloc(&dO, Q.size() * 2));
                    v.f8(dQ, dK, dV, dO, dL, s, {}, 0);
                    FLASH_CUDA_CHECK(cudaDeviceSynchronize());
                    std::vector<__nv_bfloat16> Ob(Q.size());
                    FLASH_CUDA_CHECK(cudaMemcpy(Ob.data(), dO, Ob.size() * 2, cudaMemcpyDeviceToHost));
                    for (size_t e = 0; e < O.size(); e++) O[e] = float(Ob[e]);
                    for (void* p : {(void*)dQ, (void*)dK, (void*)dV, (void*)dO}) FLASH_CUDA_CHECK(cudaFree(p));
                } else {
                    __half *dQ = upload<__half>(Q), *dK = upload<__half>(K), *dV = upload<__half>(V);
                    __half* dO;
                    FLASH_CUDA_CHECK(cudaMalloc(&dO, Q.size() * 2));
                    v.f16(dQ, dK, dV, dO, dL, s, 0);
                    FLASH_CUDA_CHECK(cudaDeviceSynchronize());
                    std::vector<__half> Oh(Q.size());
                    FLASH_CUDA_CHECK(cudaMemcpy(Oh.data(), dO, Oh.size() * 2, cudaMemcpyDeviceToHost));
                    for (size_t e = 0; e < O.size(); e++) O[e] = __half2float(Oh[e]);
                    for (void* p : {(void*)dQ, (void*)dK, (void*)dV, (void*)dO}) FLASH_CUDA_CHECK(cudaFree(p));
                }
                FLASH_CUDA_CHECK(cudaMemcpy(L.data(), dL, L.size() * 4, cudaMemcpyDeviceToHost));
                FLASH_CUDA_CHECK(cudaFree(dL));
                double sum_o = 0, max_o = 0, sum_l = 0, max_l = 0;
                for (int h = 0; h < kHeads; h++)
                    for (int r = 0; r < kRowsChecked; r++) {
                        const int i = r * (kQueries / kRowsChecked);
                        for (int x = 0; x < d; x++) {
                            const double e = O[(size_t(h) * kQueries + i) * d + x] -
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
        }
    return 0;
}
