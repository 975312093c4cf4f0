// lab/read-ceiling.cu: what reading batch 1's K and V costs a kernel that does nothing else, under
// flash_decode_bench's protocol (CUDA events around one launch, the L2 flushed by a 512 MiB memset
// before each, median of 21). Issue 46's batch-1 floors are fractions of a 1 GiB copy's bandwidth
// (0.50 at 8k keys, 0.75 at 32k); this says how much of that a pure read of the same bytes reaches
// at each size, so that the decode's fixed cost can be split into what any kernel pays (the launch,
// the first misses, the ramp and the tail of the memory's queue) and what the decode adds.
// Rows: an empty kernel; readers of 16-byte words (grid-stride, U independent loads a thread in
// flight, `blocks` blocks an SM, plain or streaming loads), the best of them a size; readers cut
// as the decode cuts batch 1 (8 K/V heads x S splits, a block each; its tiles in three orders, see
// read_as_split), for the decode's S and for 33 and 66 (2 and 4 blocks an SM);
// cudaMemcpyAsync moving the same traffic (half the bytes read, half written); and the decode
// itself (flash_decode_fp16, the splits it chooses). fp16, d = 128, 8 K/V heads, 32 query heads.
// Build and run from the repository root (the library built with make):
//   nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/read-ceiling.cu build/flash.o \
//        build/flash_fp16.o build/backward_passes.o build/flash_decode.o build/flash_hopper.o \
//        build/flash_hopper_backward.o build/flash_hopper_fp8.o build/checks.o build/dispatch.o \
//        -o read_ceiling
//   ./read_ceiling
#include "checks.h"
#include "flash.h"

#include <algorithm>
#include <cstdio>
#include <vector>

namespace {

constexpr size_t kFlushBytes = size_t(512) << 20;
void* flush_buffer = nullptr;

__global__ void empty_kernel() {}

// Reads n 16-byte words, U loads a thread in flight; writes only if the xor of all it read is a
// value the fill never gives, so that no load can be left out.
template <int U, bool kStreaming>
__global__ void read_words(const uint4* p, size_t n, unsigned* sink) {
    unsigned x = 0;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += stride * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const size_t j = i + u * stride;
            v[u] = j < n ? (kStreaming ? __ldcs(p + j) : __ldg(p + j)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (x == 0x12345678u) *sink = x;
}

// The decode's cut of batch 1: block (head, split) reads its split's tiles of 64 keys (16 KiB of
// K, 16 KiB of V) of its head (each head's rows contiguous, `keys` of them, 16 words a row), 4
// words of K and 4 of V a thread in flight. kOrder 0: a run of contiguous tiles, as the decode
// cuts (split s of S: tiles [s T / S, (s + 1) T / S)); 1: the same run started at a rotated tile
// (the split's s-th, wrapping), so that the blocks' offsets within their runs differ; 2: the
// tiles dealt out (split s: tiles s, s + S, ...), so that the splits of a head read neighbouring
// tiles at once.
template <int kOrder>
__global__ void read_as_split(const uint4* K, const uint4* V, int keys, int splits, unsigned* sink) {
    const int head = blockIdx.x / splits, split = blockIdx.x % splits;
    const int tiles = keys / 64;
    const int t0 = kOrder == 2 ? 0 : int((long long)split * tiles / splits);
    const int t1 = kOrder == 2 ? tiles : int((long long)(split + 1) * tiles / splits);
    const int n = kOrder == 2 ? (tiles - split + splits - 1) / splits : t1 - t0;
    constexpr int kWordsPerTile = 64 * 16;
    unsigned x = 0;
    for (int k = 0; k < n; ++k) {
        const int tile = kOrder == 2 ? split + k * splits
                         : kOrder == 1 ? t0 + (k + split) % n : t0 + k;
        const size_t first = (size_t(head) * keys + size_t(tile) * 64) * 16;
        for (int i = threadIdx.x; i < kWordsPerTile; i += 4 * blockDim.x) {
            uint4 v[8];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const size_t j = first + i + u * blockDim.x;
                v[u] = __ldcs(K + j);
                v[4 + u] = __ldcs(V + j);
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
    }
    if (x == 0x12345678u) *sink = x;
}

template <typename F>
double median_us(F f) {
    cudaEvent_t a, b;
    FLASH_CUDA_CHECK(cudaEventCreate(&a));
    FLASH_CUDA_CHECK(cudaEventCreate(&b));
    for (int r = 0; r < 3; ++r) f();
    std::vector<float> ms;
    for (int r = 0; r < 21; ++r) {
        FLASH_CUDA_CHECK(cudaMemsetAsync(flush_buffer, r & 0xff, kFlushBytes));
        FLASH_CUDA_CHECK(cudaEventRecord(a));
        f();
        FLASH_CUDA_CHECK(cudaGetLastError());
        FLASH_CUDA_CHECK(cudaEventRecord(b));
        FLASH_CUDA_CHECK(cudaEventSynchronize(b));
        float x = 0;
        FLASH_CUDA_CHECK(cudaEventElapsedTime(&x, a, b));
        ms.push_back(x);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    std::sort(ms.begin(), ms.end());
    return 1e3 * ms[ms.size() / 2];
}

}  // namespace

int main() {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        std::printf("read_ceiling: no CUDA GPU found; nothing to time\n");
        return 77;
    }
    const cudaDeviceProp prop = flash_device_props();
    const int sms = prop.multiProcessorCount;
    const int kv_heads = 8, heads = 32, d = 128;
    const std::vector<int> lens = {4096, 8192, 32768, 131072};
    const size_t most = size_t(kv_heads) * lens.back() * d * 2;  // bytes of K (or V), largest

    void *K, *V, *Q, *O, *copy_a, *copy_b;
    float* L;
    unsigned* sink;
    FLASH_CUDA_CHECK(cudaMalloc(&flush_buffer, kFlushBytes));
    FLASH_CUDA_CHECK(cudaMalloc(&K, 2 * most));  // K, then V: the readers' one span
    V = static_cast<char*>(K) + most;
    FLASH_CUDA_CHECK(cudaMalloc(&copy_a, size_t(1) << 30));
    FLASH_CUDA_CHECK(cudaMalloc(&copy_b, size_t(1) << 30));
    FLASH_CUDA_CHECK(cudaMalloc(&Q, size_t(heads) * d * 2));
    FLASH_CUDA_CHECK(cudaMalloc(&O, size_t(heads) * d * 2));
    FLASH_CUDA_CHECK(cudaMalloc(&L, size_t(heads) * sizeof(float)));
    FLASH_CUDA_CHECK(cudaMalloc(&sink, sizeof(unsigned)));
    FLASH_CUDA_CHECK(cudaMemset(flush_buffer, 0x5A, kFlushBytes));
    FLASH_CUDA_CHECK(cudaMemset(K, 0x3A, 2 * most));  // 0.757 in fp16
    FLASH_CUDA_CHECK(cudaMemset(Q, 0x3A, size_t(heads) * d * 2));
    FLASH_CUDA_CHECK(cudaMemset(copy_a, 1, size_t(1) << 30));

    const double copy_us = median_us([&] {
        FLASH_CUDA_CHECK(cudaMemcpyAsync(copy_b, copy_a, size_t(1) << 30, cudaMemcpyDeviceToDevice));
    });
    const double copy_gbs = 2.0 * double(size_t(1) << 30) / copy_us / 1e3;
    std::printf("device: %s (%d SMs); 1 GiB D2D copy %.0f GB/s (read + written)\n", prop.name, sms,
                copy_gbs);
    std::printf("empty kernel: %.1f us (event to event, after the flush)\n",
                median_us([&] { empty_kernel<<<1, 32>>>(); }));
    std::printf("batch 1, fp16, d = %d, %d K/V heads; frac = K+V bytes / time / copy bandwidth\n", d,
                kv_heads);
    std::printf("%7s %9s %-40s %9s %6s\n", "kv_len", "MB", "case", "us", "frac");

    for (const int keys : lens) {
        const size_t bytes = size_t(kv_heads) * keys * d * 2;  // of K, and of V
        const double mb = 2.0 * bytes / 1e6;
        const auto row = [&](const char* name, double us) {
            std::printf("%7d %9.1f %-40s %9.1f %6.2f\n", keys, mb, name, us,
                        2.0 * bytes / us / 1e3 / copy_gbs);
        };
        // The generic readers read the same number of bytes as one span from K's start.
        const size_t words = 2 * bytes / 16;
        const uint4* KV = static_cast<const uint4*>(K);
        {
            double best = 1e30;
            char best_name[64] = "";
            for (int blocks : {1, 2, 4, 8})
                for (int threads : {256, 512, 1024}) {
                    if (blocks * threads > 2048) continue;
                    for (int u : {1, 2, 4, 8})
                        for (int streaming = 0; streaming < 2; ++streaming) {
                            const auto go = [&] {
                                const int grid = blocks * sms;
                                if (streaming) {
                                    if (u == 1) read_words<1, true><<<grid, threads>>>(KV, words, sink);
                                    if (u == 2) read_words<2, true><<<grid, threads>>>(KV, words, sink);
                                    if (u == 4) read_words<4, true><<<grid, threads>>>(KV, words, sink);
                                    if (u == 8) read_words<8, true><<<grid, threads>>>(KV, words, sink);
                                } else {
                                    if (u == 1) read_words<1, false><<<grid, threads>>>(KV, words, sink);
                                    if (u == 2) read_words<2, false><<<grid, threads>>>(KV, words, sink);
                                    if (u == 4) read_words<4, false><<<grid, threads>>>(KV, words, sink);
                                    if (u == 8) read_words<8, false><<<grid, threads>>>(KV, words, sink);
                                }
                            };
                            const double us = median_us(go);
                            if (us < best) {
                                best = us;
                                std::snprintf(best_name, sizeof best_name,
                                              "read, best: %d/SM x %d thr, U=%d%s", blocks, threads, u,
                                              streaming ? ", cs" : "");
                            }
                            if (blocks == 2 && threads == 256 && u == 4 && streaming)
                                row("read: 2/SM x 256 thr, U=4, cs", us);
                        }
                }
            row(best_name, best);
        }
        AttentionShape s{1, heads, 1, keys, d, false};
        s.kv_heads = kv_heads;
        const int splits = flash_decode_choose_splits(prop, s);
        char name[80];
        for (int S : {splits, 33, 66}) {
            for (int order = 0; order < 3; ++order) {
                static const char* const kOrderName[] = {"runs", "runs rotated", "tiles dealt"};
                std::snprintf(name, sizeof name, "read as split: 8 x %d, %s", S, kOrderName[order]);
                const auto go = [&] {
                    const uint4 *k4 = static_cast<const uint4*>(K), *v4 = static_cast<const uint4*>(V);
                    if (order == 0) read_as_split<0><<<kv_heads * S, 256>>>(k4, v4, keys, S, sink);
                    if (order == 1) read_as_split<1><<<kv_heads * S, 256>>>(k4, v4, keys, S, sink);
                    if (order == 2) read_as_split<2><<<kv_heads * S, 256>>>(k4, v4, keys, S, sink);
                };
                row(name, median_us(go));
            }
        }
        row("cudaMemcpyAsync, same traffic", median_us([&] {
                FLASH_CUDA_CHECK(cudaMemcpyAsync(copy_b, copy_a, bytes, cudaMemcpyDeviceToDevice));
            }));
        std::snprintf(name, sizeof name, "flash_decode_fp16 (%d splits)", splits);
        row(name, median_us([&] {
                flash_decode_fp16_splits(static_cast<__half*>(Q), static_cast<__half*>(K),
                                         static_cast<__half*>(V), static_cast<__half*>(O), L, s,
                                         splits);
            }));
    }
    return 0;
}
