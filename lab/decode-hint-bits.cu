// lab/decode-hint-bits.cu: the decode's two L2 policies give the same bits. flash_decode.cu's split kernel copies
// K and V with an evict-first L2 policy where they are at most 4 L2s' worth of bytes and with evict-unchanged beyond
// (one runtime policy a thread; before the paged cache took the rule too, two instantiations, no hint beyond); no
// shape of the test suite is that large. This calls flash_decode_launch with the device's properties, then with
// l2CacheSize set to 0 (every shape "beyond") and to INT_MAX (every shape "within": evict-first), O and L filled with
// 0xFF bytes (NaN) before each call, and compares the three results byte for byte, at small shapes and at two of
// 537 MB. A policy moves lines in L2, never a value: any difference is a bug. PASS / FAIL, exit code.
//   make build/flash.o build/flash_fp16.o build/flash_decode.o build/checks.o build/dispatch.o HAVE_SM90A= \
//        CPPFLAGS=-I.deps/include
//   nvcc -I. -Ilib -O3 -std=c++17 -arch=native -DFLASH_NO_HOPPER lab/decode-hint-bits.cu build/flash.o \
//        build/flash_fp16.o build/flash_decode.o build/checks.o build/dispatch.o -o hint-bits && ./hint-bits
#include "checks.h"
#include "chapters.h"
#include "flash.h"
#include <climits>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
template <typename T>
bool one(const AttentionShape& s, const char* name) {
    const cudaDeviceProp prop = flash_device_props();
    const size_t nq = size_t(s.batch) * s.heads * s.q_len * s.head_dim;
    const size_t nkv = size_t(s.batch) * s.kv_heads * s.kv_len * s.head_dim;
    const size_t nl = size_t(s.batch) * s.heads * s.q_len;
    std::mt19937 rng(1234);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<T> q(nq), kv(nkv);
    for (auto& x : q) x = T(nd(rng));
    T *Q, *K, *V, *O; float* L;
    FLASH_CUDA_CHECK(cudaMalloc(&Q, nq * sizeof(T))); FLASH_CUDA_CHECK(cudaMalloc(&K, nkv * sizeof(T)));
    FLASH_CUDA_CHECK(cudaMalloc(&V, nkv * sizeof(T))); FLASH_CUDA_CHECK(cudaMalloc(&O, nq * sizeof(T)));
    FLASH_CUDA_CHECK(cudaMalloc(&L, nl * sizeof(float)));
    FLASH_CUDA_CHECK(cudaMemcpy(Q, q.data(), nq * sizeof(T), cudaMemcpyHostToDevice));
    for (auto& x : kv) x = T(nd(rng));
    FLASH_CUDA_CHECK(cudaMemcpy(K, kv.data(), nkv * sizeof(T), cudaMemcpyHostToDevice));
    for (auto& x : kv) x = T(nd(rng));
    FLASH_CUDA_CHECK(cudaMemcpy(V, kv.data(), nkv * sizeof(T), cudaMemcpyHostToDevice));
    std::vector<std::vector<unsigned char>> o(3), l(3);
    const bool hinted = 2 * nkv * sizeof(T) <= 4 * size_t(prop.l2CacheSize);
    for (int v = 0; v < 3; ++v) {
        cudaDeviceProp p = prop;
        if (v == 1) p.l2CacheSize = 0;        // no hint
        if (v == 2) p.l2CacheSize = INT_MAX;  // evict-first
        FLASH_CUDA_CHECK(cudaMemset(O, 0xFF, nq * sizeof(T)));
        FLASH_CUDA_CHECK(cudaMemset(L, 0xFF, nl * sizeof(float)));
        flash_decode_launch(p, Q, K, V, O, L, s, 0, 0);
        FLASH_CUDA_CHECK(cudaGetLastError());
        FLASH_CUDA_CHECK(cudaDeviceSynchronize());
        o[v].resize(nq * sizeof(T)); l[v].resize(nl * sizeof(float));
        FLASH_CUDA_CHECK(cudaMemcpy(o[v].data(), O, o[v].size(), cudaMemcpyDeviceToHost));
        FLASH_CUDA_CHECK(cudaMemcpy(l[v].data(), L, l[v].size(), cudaMemcpyDeviceToHost));
    }
    size_t nan = 0;
    for (size_t i = 0; i < nl; ++i) { float x; std::memcpy(&x, l[0].data() + 4 * i, 4); nan += x != x; }
    const bool same = o[0] == o[1] && o[1] == o[2] && l[0] == l[1] && l[1] == l[2] && nan == 0;
    std::printf("%s %s b=%d h=%d kv=%d q=%d n=%d d=%d causal=%d: K+V %.0f MB (device rule: %s); no hint == "
                "evict-first == device rule, bit for bit: %s (NaN L: %zu)\n", same ? "PASS" : "FAIL", name, s.batch,
                s.heads, s.kv_heads, s.q_len, s.kv_len, s.head_dim, int(s.causal), 2.0 * nkv * sizeof(T) / 1e6,
                hinted ? "evict-first" : "no hint", same ? "yes" : "NO", nan);
    cudaFree(Q); cudaFree(K); cudaFree(V); cudaFree(O); cudaFree(L);
    return same;
}
AttentionShape sh(int b, int h, int kv, int q, int n, int d, bool c) { AttentionShape s{b, h, q, n, d, c}; s.kv_heads = kv; return s; }
int main() {
    const cudaDeviceProp prop = flash_device_props();
    std::printf("device: %s, L2 %d bytes\n", prop.name, prop.l2CacheSize);
    bool ok = true;
    ok &= one<__half>(sh(2, 8, 2, 1, 3001, 128, true), "fp16");
    ok &= one<__nv_bfloat16>(sh(2, 8, 1, 5, 1000, 64, true), "bf16");
    ok &= one<__half>(sh(1, 4, 2, 8, 777, 256, false), "fp16");
    ok &= one<__half>(sh(1, 32, 8, 1, 131072, 128, false), "fp16");
    ok &= one<__nv_bfloat16>(sh(4, 32, 8, 3, 32768, 128, true), "bf16");
    std::printf("%s\n", ok ? "ALL PASS" : "SOME FAIL");
    return ok ? 0 : 1;
}
