// decode.cu (flash_decode_bench): chapter 4's timing. For each decode shape (fp16, q_len = 1 by
// default, 32 query heads over 8 K/V heads, d = 128), the median time of flash_decode_fp16 (CUDA
// events around each call, after warm-up, with L2 flushed before every call so that K and V come
// from memory: by a memset, or with --flush read by reading a buffer, see Flush below), the bytes of K and V read once over that time (GB/s), and the device's own copy
// bandwidth measured in the same run (cudaMemcpyAsync device to device of 1 GiB: bytes read plus
// bytes written over its median time), and the fraction of it the decode reaches. Issue 30's floor:
// >= 0.70 from kv_len 32k, >= 0.50 at 8k.
//   ./flash_decode_bench [--kv-len 4096,8192,...] [--batch 1,8,32] [--q-len 1] [--heads 32]
//                        [--kv-heads 8] [--splits N] [--bf16] [--flush write|read] [--csv FILE]
#include "checks.h"
#include "flash.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

std::vector<int> int_list(const char* text) {
    std::vector<int> v;
    for (const char* p = text; *p;) {
        char* end = nullptr;
        v.push_back(int(std::strtol(p, &end, 10)));
        p = *end == ',' ? end + 1 : end;
        if (end == p && *p) break;
    }
    return v;
}

struct Timer {
    cudaEvent_t start, stop;
    Timer() {
        FLASH_CUDA_CHECK(cudaEventCreate(&start));
        FLASH_CUDA_CHECK(cudaEventCreate(&stop));
    }
    ~Timer() {
        cudaEventDestroy(start);
        cudaEventDestroy(stop);
    }
};

// Reads n 16-byte words and writes nothing unless their xor is a value the byte fill below never
// gives (so that the reads cannot be left out): the L2 flush that leaves no dirty line behind.
__global__ void read_through(const uint4* p, size_t n, unsigned* sink) {
    unsigned x = 0;
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x) {
        const uint4 v = p[i];
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (x == 0x12345678u) *sink = x;
}

// The L2 flush before each timed call, over a buffer larger than any L2. write (the default): a
// memset of it, which leaves the L2 full of dirty lines that the timed call's first misses must
// write back to memory; read: read_through over it (filled once), which leaves the L2 clean and
// holding none of the call's data. The first is what the figures in NOTES use; the second shows
// what those write-backs cost a call that reads little (lab/chapter4.md).
struct Flush {
    void* buffer;
    size_t bytes;
    bool read;
    unsigned* sink;
    void operator()(int r) const {
        if (!read) {
            FLASH_CUDA_CHECK(cudaMemsetAsync(buffer, r & 0xff, bytes));
            return;
        }
        read_through<<<1024, 256>>>(static_cast<const uint4*>(buffer), bytes / 16, sink);
        FLASH_CUDA_CHECK(cudaGetLastError());
    }
};

// The median over `reps` timed calls of f (after `warm` untimed ones), L2 flushed before each.
template <typename F>
double median_ms(F f, int warm, int reps, const Flush& flush) {
    Timer t;
    for (int r = 0; r < warm; ++r) f();
    std::vector<float> ms;
    for (int r = 0; r < reps; ++r) {
        flush(r);
        FLASH_CUDA_CHECK(cudaEventRecord(t.start));
        f();
        FLASH_CUDA_CHECK(cudaEventRecord(t.stop));
        FLASH_CUDA_CHECK(cudaEventSynchronize(t.stop));
        float x = 0;
        FLASH_CUDA_CHECK(cudaEventElapsedTime(&x, t.start, t.stop));
        ms.push_back(x);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
    std::vector<int> kv_lens = {4096, 8192, 32768, 131072}, batches = {1, 8, 32};
    int q_len = 1, heads = 32, kv_heads = 8, d = 128, splits = 0;
    bool bf16 = false, read_flush = false;
    const char* csv = nullptr;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        const char* v = i + 1 < argc ? argv[i + 1] : "";
        if (a == "--kv-len") kv_lens = int_list(v), ++i;
        else if (a == "--batch") batches = int_list(v), ++i;
        else if (a == "--q-len") q_len = std::atoi(v), ++i;
        else if (a == "--heads") heads = std::atoi(v), ++i;
        else if (a == "--kv-heads") kv_heads = std::atoi(v), ++i;
        else if (a == "--head-dim") d = std::atoi(v), ++i;
        else if (a == "--splits") splits = std::atoi(v), ++i;
        else if (a == "--bf16") bf16 = true;
        else if (a == "--csv") csv = v, ++i;
        else if (a == "--flush" && (std::strcmp(v, "read") == 0 || std::strcmp(v, "write") == 0))
            read_flush = std::strcmp(v, "read") == 0, ++i;
        else {
            std::fprintf(stderr, "usage: %s [--kv-len L,..] [--batch B,..] [--q-len N] [--heads H] "
                                 "[--kv-heads G] [--head-dim D] [--splits S] [--bf16] [--flush write|read] "
                                 "[--csv F]\n",
                         argv[0]);
            return 2;
        }
    }
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        std::printf("flash_decode_bench: no CUDA GPU found; nothing to time\n");
        return 77;
    }
    try {
        const cudaDeviceProp prop = flash_device_props();
        // The copy bandwidth: 1 GiB device to device, read and written: 2 GiB of traffic.
        const size_t copy_bytes = size_t(1) << 30, flush_bytes = size_t(512) << 20;
        void *a = nullptr, *b = nullptr, *flush = nullptr;
        unsigned* sink = nullptr;
        FLASH_CUDA_CHECK(cudaMalloc(&a, copy_bytes));
        FLASH_CUDA_CHECK(cudaMalloc(&b, copy_bytes));
        FLASH_CUDA_CHECK(cudaMalloc(&flush, flush_bytes));
        FLASH_CUDA_CHECK(cudaMalloc(&sink, sizeof(unsigned)));
        FLASH_CUDA_CHECK(cudaMemset(a, 1, copy_bytes));
        FLASH_CUDA_CHECK(cudaMemset(flush, 0x5A, flush_bytes));
        // The copy is timed after the write flush whatever --flush says: the same yardstick.
        const double copy_ms = median_ms(
            [&] { FLASH_CUDA_CHECK(cudaMemcpyAsync(b, a, copy_bytes, cudaMemcpyDeviceToDevice)); },
            3, 15, Flush{flush, flush_bytes, false, sink});
        const double copy_gbs = 2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9;
        FLASH_CUDA_CHECK(cudaFree(a));
        FLASH_CUDA_CHECK(cudaFree(b));
        std::printf("device: %s (%d SMs); D2D copy bandwidth %.0f GB/s (1 GiB, read + written)\n",
                    prop.name, prop.multiProcessorCount, copy_gbs);
        std::printf("decode %s, d = %d, %d query heads over %d K/V heads, q_len = %d; L2 flushed by "
                    "%s\n", bf16 ? "bf16" : "fp16", d, heads, kv_heads, q_len,
                    read_flush ? "reading (clean)" : "writing (dirty)");
        std::printf("%6s %8s %7s %10s %9s %9s %9s\n", "batch", "kv_len", "splits", "time_us",
                    "KV_GB/s", "copy_GB/s", "fraction");
        FILE* out = csv ? std::fopen(csv, "w") : nullptr;
        if (out)
            std::fprintf(out, "device,dtype,batch,heads,kv_heads,q_len,kv_len,head_dim,splits,"
                              "time_us,kv_gbs,copy_gbs,fraction\n");
        // The tensors of the largest shape, allocated once; each shape uses their beginning, so
        // that no shape's time depends on the shapes timed before it (freed and allocated again, a
        // shape timed after a larger one reads its new tensors slower).
        size_t q_most = 0, kv_most = 0, l_most = 0;
        for (int batch : batches)
            for (int kv_len : kv_lens) {
                AttentionShape s{batch, heads, q_len, kv_len, d, false};
                s.kv_heads = kv_heads;
                q_most = std::max(q_most, q_elems(s)), kv_most = std::max(kv_most, kv_elems(s));
                l_most = std::max(l_most, l_elems(s));
            }
        void *Q, *K, *V, *O;
        float* L;
        FLASH_CUDA_CHECK(cudaMalloc(&Q, q_most * 2));
        FLASH_CUDA_CHECK(cudaMalloc(&K, kv_most * 2));
        FLASH_CUDA_CHECK(cudaMalloc(&V, kv_most * 2));
        FLASH_CUDA_CHECK(cudaMalloc(&O, q_most * 2));
        FLASH_CUDA_CHECK(cudaMalloc(&L, l_most * sizeof(float)));
        for (int batch : batches)
            for (int kv_len : kv_lens) {
                AttentionShape s{batch, heads, q_len, kv_len, d, false};
                s.kv_heads = kv_heads;
                const int used = splits > 0 ? splits : flash_decode_choose_splits(prop, s);
                const size_t kv_bytes = kv_elems(s) * 2;
                // 0x3A3A: 0.757 in fp16, a small finite number in bf16 too (the time does not
                // depend on the values)
                FLASH_CUDA_CHECK(cudaMemset(Q, 0x3A, q_elems(s) * 2));
                FLASH_CUDA_CHECK(cudaMemset(K, 0x3A, kv_bytes));
                FLASH_CUDA_CHECK(cudaMemset(V, 0x3A, kv_bytes));
                const auto call = [&] {
                    if (bf16)
                        flash_decode_bf16_splits(
                            static_cast<__nv_bfloat16*>(Q), static_cast<__nv_bfloat16*>(K),
                            static_cast<__nv_bfloat16*>(V), static_cast<__nv_bfloat16*>(O), L, s,
                            used);
                    else
                        flash_decode_fp16_splits(static_cast<__half*>(Q), static_cast<__half*>(K),
                                                 static_cast<__half*>(V), static_cast<__half*>(O),
                                                 L, s, used);
                };
                const double ms = median_ms(call, 3, 21, Flush{flush, flush_bytes, read_flush, sink});
                const double gbs = 2.0 * kv_bytes / (ms * 1e-3) / 1e9;
                std::printf("%6d %8d %7d %10.1f %9.0f %9.0f %9.2f\n", batch, kv_len, used,
                            ms * 1e3, gbs, copy_gbs, gbs / copy_gbs);
                if (out)
                    std::fprintf(out, "%s,%s,%d,%d,%d,%d,%d,%d,%d,%.2f,%.1f,%.1f,%.4f\n", prop.name,
                                 bf16 ? "bf16" : "fp16", batch, heads, kv_heads, q_len, kv_len, d,
                                 used, ms * 1e3, gbs, copy_gbs, gbs / copy_gbs);
            }
        for (void* p : {Q, K, V, O, static_cast<void*>(L)}) FLASH_CUDA_CHECK(cudaFree(p));
        if (out) std::fclose(out);
        FLASH_CUDA_CHECK(cudaFree(flush));
        FLASH_CUDA_CHECK(cudaFree(sink));
    } catch (const std::exception& e) {
        std::fprintf(stderr, "flash_decode_bench: %s\n", e.what());
        return 1;
    }
    return 0;
}
