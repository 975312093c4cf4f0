// lab/softcap-bound.cu: chapter 3's softcap forward, fp16 and bf16, its accuracy on sampled rows
// against a double-precision softmax written here, and its time against plain attention's in the
// two power states (lab/power-states.cuh). It asks one question of a kernel that takes the cap as
// every row's max (lab/chapter5.md, part 24): is it right, and in which type, and is it faster.
// Shape: batch 4 x 16 heads x N = 4096, d = 128, causal (issue 45's options shape); inputs uniform
// in [-1, 1). Build beside the tree's objects (lab/power-states.cu's header lists them), e.g.
//   nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/softcap-bound.cu build/*.o -o softcap_bound
//   ./softcap_bound [ROUNDS]
// Each line: "err TYPE cap C worst W at row R col X" (rows 0, 61, 122, ... of head 0 and the last
// row), then power-states lines tagged TYPE-plainR and TYPE-softcapR.
#include "checks.h"
#include "flash.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "power-states.cuh"  // both_states: the protocol

template <typename T>
__global__ void fill(T* p, size_t n, uint32_t seed) {  // uniform in [-1, 1), as fill_uniform
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x) {
        uint32_t h = uint32_t(i) * 2654435761u ^ seed * 40503u;
        h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
        p[i] = T((h & 0xFFFFFF) / float(1 << 24) * 2.f - 1.f);
    }
}

template <typename T> void forward(T* const* t, float* L, const AttentionShape& s,
                                   const AttentionOptions& o);
template <> void forward<__half>(__half* const* t, float* L, const AttentionShape& s,
                                 const AttentionOptions& o) {
    flash_forward_fp16(t[0], t[1], t[2], t[3], L, s, o);
}
template <> void forward<__nv_bfloat16>(__nv_bfloat16* const* t, float* L, const AttentionShape& s,
                                        const AttentionOptions& o) {
    flash_forward_bf16(t[0], t[1], t[2], t[3], L, s, o);
}

// The worst |O - reference| over head 0's sampled rows, in double from the rounded inputs.
template <typename T>
void accuracy(const char* type, T* const* t, float* L, const AttentionShape& s, float cap) {
    AttentionOptions o;
    o.softcap = cap;
    forward<T>(t, L, s, o);
    FLASH_CUDA_CHECK(cudaDeviceSynchronize());
    const int N = s.q_len, d = s.head_dim;
    std::vector<std::vector<T>> h(4, std::vector<T>(size_t(N) * d));
    for (int k = 0; k < 4; k++)
        FLASH_CUDA_CHECK(cudaMemcpy(h[k].data(), t[k], h[k].size() * sizeof(T),
                                    cudaMemcpyDeviceToHost));
    const auto at = [&](int k, int row, int col) { return double(float(h[k][size_t(row) * d + col])); };
    const double scale = 1.0 / std::sqrt(double(d));
    double worst = 0;
    int worst_row = 0, worst_col = 0;
    std::vector<double> p(N);
    std::vector<int> rows;
    for (int i = 0; i < N; i += 61) rows.push_back(i);
    rows.push_back(N - 1);
    for (const int i : rows) {
        double m = -INFINITY, l = 0;
        for (int j = 0; j <= i; j++) {
            double dot = 0;
            for (int c = 0; c < d; c++) dot += at(0, i, c) * at(1, j, c);
            p[j] = cap * std::tanh(dot * scale / cap);
            m = std::max(m, p[j]);
        }
        for (int j = 0; j <= i; j++) l += (p[j] = std::exp(p[j] - m));
        for (int c = 0; c < d; c++) {
            double o_c = 0;
            for (int j = 0; j <= i; j++) o_c += p[j] * at(2, j, c);
            const double err = std::fabs(o_c / l - at(3, i, c));
            if (!(err <= worst)) worst = err, worst_row = i, worst_col = c;
        }
    }
    printf("err %s cap %g worst %.3g at row %d col %d\n", type, cap, worst, worst_row, worst_col);
    fflush(stdout);
}

template <typename T>
void run(const char* type, int rounds) {
    const AttentionShape s{4, 16, 4096, 4096, 128, true};
    const size_t n = size_t(s.batch) * s.heads * s.q_len * s.head_dim;
    T* t[4];
    for (T*& p : t) FLASH_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    float* L = nullptr;
    FLASH_CUDA_CHECK(cudaMalloc(&L, size_t(s.batch) * s.heads * s.q_len * sizeof(float)));
    for (int k : {0, 1, 2}) fill<T><<<1024, 256>>>(t[k], n, 1 + k);
    FLASH_CUDA_CHECK(cudaGetLastError());
    for (float cap : {30.f, 50.f}) accuracy<T>(type, t, L, s, cap);
    double pairs = 0;
    for (long long i = 0; i < s.q_len; ++i) pairs += i + 1;
    const double flop = 4.0 * s.batch * s.heads * pairs * s.head_dim;
    AttentionOptions none, cap;
    cap.softcap = 30.f;
    for (int r = 1; r <= rounds; r++)
        for (const auto& c : {std::make_pair("plain", none), std::make_pair("softcap", cap)}) {
            const std::string tag = std::string(type) + "-" + c.first + std::to_string(r);
            both_states(tag.c_str(), "fwd", s, flop, [&] { forward<T>(t, L, s, c.second); });
        }
    for (T* p : t) FLASH_CUDA_CHECK(cudaFree(p));
    FLASH_CUDA_CHECK(cudaFree(L));
}

int main(int argc, char** argv) {
    const int rounds = argc > 1 ? std::atoi(argv[1]) : 2;
    run<__half>("fp16", rounds);
    run<__nv_bfloat16>("bf16", rounds);
    return 0;
}
