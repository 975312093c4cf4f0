// lab/kvcache-bench.cu: chapter 4's K/V cache call (flash_decode_kvcache_fp16) timed against the
// plain decode (flash_decode_fp16) at issue 46's shape: fp16, d = 128, 32 query heads over 8 K/V
// heads, q_len 1, the L2 flushed (a 512 MiB memset) before every call. Cases: the contiguous
// cache, the same keys in pages of 64 scattered by a shuffled block table, both with one key
// appended, and ragged batches of 8 and 32 with lengths drawn uniformly in 1k-32k (and in
// 24k-32k: nearly equal). GB/s counts the K
// and V bytes each sequence's keys hold; the copy bandwidth is a 1 GiB cudaMemcpyAsync's (read
// plus written). The cache call copies its lengths and table to the host to check them (it waits
// for the stream), so its time includes that copy and the host's gap before the launch; the
// "graph" cases are the same calls captured in a CUDA graph and replayed (as a server replays its
// decode step), which checks nothing on the host and splits for the cache's capacity; two of them
// read the same keys through other tables (pages of 64 in order; pages of 256, shuffled).
// Build and run from the repository root (the library built with make):
//   nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/kvcache-bench.cu build/flash.o \
//        build/flash_fp16.o build/backward_passes.o build/flash_decode.o build/flash_hopper.o \
//        build/flash_hopper_backward.o build/checks.o build/dispatch.o -o kvcache_bench
//   ./kvcache_bench
// Prints CSV: case,batch,kv_len,us,GB/s,fraction of copy.
#include "checks.h"
#include "flash.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

static void* flush_buffer = nullptr;
static constexpr size_t kFlushBytes = size_t(512) << 20;

// The median of 15 calls (after 2 warm-ups), each after a flush of the L2, CUDA events around the
// call alone.
static float median_us(const std::function<void()>& call) {
    cudaEvent_t a, b;
    FLASH_CUDA_CHECK(cudaEventCreate(&a));
    FLASH_CUDA_CHECK(cudaEventCreate(&b));
    std::vector<float> us;
    for (int r = 0; r < 17; ++r) {
        FLASH_CUDA_CHECK(cudaMemsetAsync(flush_buffer, r, kFlushBytes));
        FLASH_CUDA_CHECK(cudaEventRecord(a));
        call();
        FLASH_CUDA_CHECK(cudaEventRecord(b));
        FLASH_CUDA_CHECK(cudaEventSynchronize(b));
        float ms = 0;
        FLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
        if (r >= 2) us.push_back(ms * 1e3f);
    }
    FLASH_CUDA_CHECK(cudaEventDestroy(a));
    FLASH_CUDA_CHECK(cudaEventDestroy(b));
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
}

int main() {
    FLASH_CUDA_CHECK(cudaMalloc(&flush_buffer, kFlushBytes));
    // The copy bandwidth: 1 GiB device to device, bytes read plus written over the time.
    const size_t copy_bytes = size_t(1) << 30;
    void *src, *dst;
    FLASH_CUDA_CHECK(cudaMalloc(&src, copy_bytes));
    FLASH_CUDA_CHECK(cudaMalloc(&dst, copy_bytes));
    const float copy_us = median_us([&] {
        FLASH_CUDA_CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice));
    });
    const double copy_gbs = 2.0 * copy_bytes / (copy_us * 1e3);
    FLASH_CUDA_CHECK(cudaFree(src));
    FLASH_CUDA_CHECK(cudaFree(dst));
    printf("case,batch,kv_len,us,GB/s,fraction\n");
    printf("copy,0,0,%.1f,%.0f,1.00\n", copy_us, copy_gbs);
    const int heads = 32, kvh = 8, d = 128, page = 64;
    std::mt19937 rng(46);
    for (const auto& bk : {std::make_pair(1, 32768), std::make_pair(8, 32768),
                           std::make_pair(32, 32768)}) {
        const int batch = bk.first, kv_len = bk.second, pages_per_seq = kv_len / page;
        AttentionShape s{batch, heads, 1, kv_len, d, true};
        s.kv_heads = kvh;
        const size_t kv = size_t(batch) * kvh * kv_len * d;
        __half *Q, *K, *V, *O, *kn, *vn;
        float* L;
        int *lens_g, *table_g;
        for (__half** p : {&Q, &O}) FLASH_CUDA_CHECK(cudaMalloc(p, size_t(batch) * heads * d * 2));
        for (__half** p : {&K, &V}) {
            FLASH_CUDA_CHECK(cudaMalloc(p, kv * 2));
            FLASH_CUDA_CHECK(cudaMemset(*p, 0x11, kv * 2));
        }
        for (__half** p : {&kn, &vn}) FLASH_CUDA_CHECK(cudaMalloc(p, size_t(batch) * kvh * d * 2));
        FLASH_CUDA_CHECK(cudaMemset(Q, 0x22, size_t(batch) * heads * d * 2));
        FLASH_CUDA_CHECK(cudaMalloc(&L, size_t(batch) * heads * 4));
        FLASH_CUDA_CHECK(cudaMalloc(&lens_g, batch * 4));
        FLASH_CUDA_CHECK(cudaMalloc(&table_g, size_t(batch) * pages_per_seq * 4));
        std::vector<int> table(size_t(batch) * pages_per_seq);
        std::iota(table.begin(), table.end(), 0);
        std::shuffle(table.begin(), table.end(), rng);
        FLASH_CUDA_CHECK(cudaMemcpy(table_g, table.data(), table.size() * 4,
                                    cudaMemcpyHostToDevice));
        // The same keys in other tables: pages of 64 in order, and pages of 256, shuffled (the
        // pages' order and size, against the scattered pages of 64: the memory's locality).
        int *inorder_g, *table256_g;
        std::vector<int> table256(size_t(batch) * kv_len / 256);
        std::iota(table256.begin(), table256.end(), 0);
        std::shuffle(table256.begin(), table256.end(), rng);
        FLASH_CUDA_CHECK(cudaMalloc(&inorder_g, table.size() * 4));
        FLASH_CUDA_CHECK(cudaMalloc(&table256_g, table256.size() * 4));
        std::vector<int> inorder(table.size());
        std::iota(inorder.begin(), inorder.end(), 0);
        FLASH_CUDA_CHECK(cudaMemcpy(inorder_g, inorder.data(), inorder.size() * 4,
                                    cudaMemcpyHostToDevice));
        FLASH_CUDA_CHECK(cudaMemcpy(table256_g, table256.data(), table256.size() * 4,
                                    cudaMemcpyHostToDevice));
        const auto row = [&](const char* what, const std::vector<int>& lens, bool paged,
                             int added, bool plain, bool graph = false, int* table_of = nullptr,
                             int page_of = 64) {
            FLASH_CUDA_CHECK(cudaMemcpy(lens_g, lens.data(), batch * 4, cudaMemcpyHostToDevice));
            KVCache c;
            c.cache_seqlens = lens_g, c.new_len = added;
            if (paged)
                c.block_table = table_of ? table_of : table_g, c.page_size = page_of,
                c.pages_per_seq = kv_len / page_of, c.num_pages = batch * (kv_len / page_of);
            const auto call = [&](cudaStream_t stream) {
                if (plain) flash_decode_fp16(Q, K, V, O, L, s, stream);
                else flash_decode_kvcache_fp16(Q, K, V, added ? kn : nullptr,
                                               added ? vn : nullptr, O, L, s, c, {}, stream);
            };
            float us = 0;
            if (graph) {  // captured on a stream of its own, replayed on the default stream
                cudaStream_t side;
                cudaGraph_t g;
                cudaGraphExec_t exec;
                FLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
                FLASH_CUDA_CHECK(cudaStreamBeginCapture(side, cudaStreamCaptureModeRelaxed));
                call(side);
                FLASH_CUDA_CHECK(cudaStreamEndCapture(side, &g));
                FLASH_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
                us = median_us([&] { FLASH_CUDA_CHECK(cudaGraphLaunch(exec, 0)); });
                FLASH_CUDA_CHECK(cudaGraphExecDestroy(exec));
                FLASH_CUDA_CHECK(cudaGraphDestroy(g));
                FLASH_CUDA_CHECK(cudaStreamDestroy(side));
            } else {
                us = median_us([&] { call(0); });
            }
            double keys = 0;
            for (int l : lens) keys += l + added;
            const double bytes = 2.0 * keys * kvh * d * 2;
            const double gbs = bytes / (us * 1e3);
            printf("%s,%d,%d,%.1f,%.0f,%.2f\n", what, batch, kv_len, us, gbs, gbs / copy_gbs);
            fflush(stdout);
        };
        const std::vector<int> full(batch, kv_len), full_less(batch, kv_len - 1);
        row("plain decode", full, false, 0, true);
        row("cache, contiguous", full, false, 0, false);
        row("cache, paged 64", full, true, 0, false);
        row("cache, contiguous, append 1", full_less, false, 1, false);
        row("cache, paged 64, append 1", full_less, true, 1, false);
        row("graph, plain decode", full, false, 0, true, true);
        row("graph, contiguous", full, false, 0, false, true);
        row("graph, paged 64", full, true, 0, false, true);
        row("graph, paged 64, append 1", full_less, true, 1, false, true);
        row("graph, paged 64 in order", full, true, 0, false, true, inorder_g);
        row("graph, paged 256", full, true, 0, false, true, table256_g, 256);
        if (batch >= 8) {
            std::uniform_int_distribution<int> len(1024, 32768), near(24576, 32768);
            std::vector<int> ragged(batch), close(batch);
            for (int& l : ragged) l = len(rng);
            for (int& l : close) l = near(rng);
            row("cache, ragged 1k-32k, contiguous", ragged, false, 0, false);
            row("cache, ragged 1k-32k, paged 64", ragged, true, 0, false);
            row("graph, ragged 1k-32k, paged 64", ragged, true, 0, false, true);
            row("cache, ragged 24k-32k, contiguous", close, false, 0, false);
        }
        for (void* p : {(void*)Q, (void*)O, (void*)K, (void*)V, (void*)kn, (void*)vn, (void*)L,
                        (void*)lens_g, (void*)table_g, (void*)inorder_g, (void*)table256_g})
            FLASH_CUDA_CHECK(cudaFree(p));
    }
    return 0;
}
