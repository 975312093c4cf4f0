/*
FlashAttention demo and benchmark, fp32: flash_forward / flash_backward (flash.cu) against
standard attention done the way frameworks do it (cuBLAS SGEMMs around a softmax kernel, with
the whole (q_len, kv_len) score matrix of every head in device memory).

Build and run the demo (one shape, timed, checked against the CPU reference; exits 1 on FAIL):
make flash_bench && ./flash_bench
(by hand: nvcc -O3 -std=c++17 -arch=native bench.cu standard.cu flash.cu checks.cpp reference.cpp
 -lcublas -o flash_bench)

One shape of your own, with keys-per-tile Bc forced to 32:
./flash_bench --batch 2 --heads 16 --seq 4096 --dim 128 --causal 0 --tile 32

The FlashAttention-2 benchmark protocol (what `make bench` runs), then the plot (`make plot`):
./flash_bench --protocol --csv bench.csv
gnuplot -e "csv='bench.csv'; out='bench.png'" plot.gp

./flash_bench --help lists every flag.

What is measured:
- time: the median of >= 10 timed runs after warm-up, each run bracketed by CUDA events.
- TFLOP/s: forward FLOPs = 4 * batch * heads * (visible (query, key) pairs) * head_dim (two
  GEMMs, 2 FLOPs per multiply-add); backward = 2.5x forward (five GEMMs, one recomputes S).
  Causal masking hides pairs, and neither method is credited for them. Both methods get the
  same count, so the ratio of their TFLOP/s is the speed-up, even though standard attention
  does compute the masked scores.
- extra memory: device memory a method takes beyond its inputs and outputs (Q, K, V, O, L and
  for the backward dO, dQ, dK, dV), measured with cudaMemGetInfo and the stream-ordered memory
  pool's high watermark (see measure_begin / measure_end).
- the FP32 peak printed next to TFLOP/s is computed from device properties, not measured.
*/

#include "flash.h"
#include "standard.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

// Every kernel launch is followed by this: a bad launch configuration only shows up here.
#define LAUNCH_CHECK() FLASH_CUDA_CHECK(cudaGetLastError())

static constexpr int kMinTimedRuns = 10;       // never report a median of fewer runs
static constexpr int kRowThreads = 256;        // threads per block of the row-wise kernels
static constexpr double kTolerance = 2e-4;     // max |gpu - ref| <= kTolerance * max(1, max|ref|)
static constexpr double kMaxCheckMacs = 1073741824.0;  // 2^30: the CPU check's size limit
static constexpr double kMiB = 1024.0 * 1024.0;
static constexpr double kGiB = 1024.0 * kMiB;

// Random inputs: x[i] ~ N(0, 1) from a hash of (seed, i), so any tensor is reproducible and the
// fill never depends on the launch shape. Normal inputs give scores of standard deviation ~1.
__device__ inline uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}
__global__ void fill_normal_kernel(float* x, size_t n, uint64_t seed) {
    const uint64_t key = splitmix64(seed);
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x) {
        const uint64_t h = splitmix64(key ^ i);
        const float u1 = (float(h >> 40) + 0.5f) * (1.f / 16777216.f);  // in (0, 1): log finite
        const float u2 = float((h >> 16) & 0xFFFFFF) * (1.f / 16777216.f);
        x[i] = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);  // Box-Muller
    }
}

// The larger of two non-negative floats, NaN winning (fmaxf would drop a NaN and hide a bug).
__device__ inline float max_or_nan(float a, float b) { return (a > b || a != a) ? a : b; }

// *out = max_i |a[i] - b[i]| as float bits. Non-negative floats order like their bit patterns
// (and NaN above +inf), so an unsigned atomicMax is a float max.
__global__ void max_abs_diff_kernel(const float* a, const float* b, size_t n, unsigned int* out) {
    float m = 0.f;
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x)
        m = max_or_nan(m, fabsf(a[i] - b[i]));
    for (int offset = 16; offset > 0; offset >>= 1)
        m = max_or_nan(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (threadIdx.x % 32 == 0) atomicMax(out, __float_as_uint(m));
}

// =============================================================================================
// Launchers
// =============================================================================================

static int grid_stride_blocks(size_t n) {
    return int(std::min<size_t>((n + kRowThreads - 1) / kRowThreads, 65536));
}

static void fill_normal(float* x, size_t n, uint64_t seed) {
    fill_normal_kernel<<<grid_stride_blocks(n), kRowThreads>>>(x, n, seed);
    LAUNCH_CHECK();
}

// max |a - b| over n floats; scratch: one unsigned int of device memory.
static float max_abs_diff(const float* a, const float* b, size_t n, unsigned int* scratch) {
    FLASH_CUDA_CHECK(cudaMemset(scratch, 0, sizeof(unsigned int)));  // 0u is the float 0.0f
    max_abs_diff_kernel<<<grid_stride_blocks(n), kRowThreads>>>(a, b, n, scratch);
    LAUNCH_CHECK();
    unsigned int bits = 0;
    FLASH_CUDA_CHECK(cudaMemcpy(&bits, scratch, sizeof(bits), cudaMemcpyDeviceToHost));
    float v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
}

// The device buffers of one shape: the inputs, and the outputs of each method.
struct Tensors {
    float *Q = nullptr, *K = nullptr, *V = nullptr, *dO = nullptr;         // inputs
    float *O = nullptr, *L = nullptr, *dQ = nullptr, *dK = nullptr, *dV = nullptr;  // flash's
    float *Os = nullptr, *Ls = nullptr, *dQs = nullptr, *dKs = nullptr, *dVs = nullptr;  // std's
    unsigned int* scratch = nullptr;  // for max_abs_diff
};

static void alloc_tensors(Tensors& t, const AttentionShape& s, bool standard, uint64_t seed) {
    const size_t nq = q_elems(s), nkv = kv_elems(s), nl = l_elems(s);
    auto alloc = [](float** p, size_t n) { FLASH_CUDA_CHECK(cudaMalloc(p, n * sizeof(float))); };
    alloc(&t.Q, nq), alloc(&t.K, nkv), alloc(&t.V, nkv), alloc(&t.dO, nq);     // (B, H, N|M, d)
    alloc(&t.O, nq), alloc(&t.L, nl), alloc(&t.dQ, nq), alloc(&t.dK, nkv), alloc(&t.dV, nkv);
    if (standard) {
        alloc(&t.Os, nq), alloc(&t.Ls, nl), alloc(&t.dQs, nq), alloc(&t.dKs, nkv);
        alloc(&t.dVs, nkv);
    }
    FLASH_CUDA_CHECK(cudaMalloc(&t.scratch, sizeof(unsigned int)));
    fill_normal(t.Q, nq, seed + 1);
    fill_normal(t.K, nkv, seed + 2);
    fill_normal(t.V, nkv, seed + 3);
    fill_normal(t.dO, nq, seed + 4);
}

static void free_tensors(Tensors& t) {
    for (float* p : {t.Q, t.K, t.V, t.dO, t.O, t.L, t.dQ, t.dK, t.dV, t.Os, t.Ls, t.dQs, t.dKs,
                     t.dVs})
        FLASH_CUDA_CHECK(cudaFree(p));
    FLASH_CUDA_CHECK(cudaFree(t.scratch));
    t = Tensors{};
}

// cudaMalloc that treats "out of memory" as an answer rather than an error: the baseline's
// memory wall is something the benchmark reports.
static bool try_alloc(float** p, size_t n) {
    const cudaError_t err = cudaMalloc(p, n * sizeof(float));
    if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();  // clear it, so the next check does not see it
        *p = nullptr;
        return false;
    }
    FLASH_CUDA_CHECK(err);
    return true;
}

// =============================================================================================
// Timing, memory and validation helpers
// =============================================================================================

struct TimedRuns {
    double median_ms = NAN;
    int runs = 0;
};

// The one timing helper, for all four methods. One warm-up call (it pays for lazy module
// loading, cold caches and clock ramp-up, and its time sizes the loop), then `repeat` timed calls,
// each between two CUDA events; the median, since a few runs slowed by the rest of the system
// would pull a mean. When budget_s > 0 fewer runs are made for slow calls, so that one measurement
// takes about budget_s, but never fewer than kMinTimedRuns.
template <typename Call>
static TimedRuns time_median_ms(const Call& call, int repeat, double budget_s) {
    cudaEvent_t start, stop;
    FLASH_CUDA_CHECK(cudaEventCreate(&start));
    FLASH_CUDA_CHECK(cudaEventCreate(&stop));
    float ms = 0.f;
    FLASH_CUDA_CHECK(cudaEventRecord(start));
    call();
    FLASH_CUDA_CHECK(cudaEventRecord(stop));
    FLASH_CUDA_CHECK(cudaEventSynchronize(stop));
    FLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    int runs = repeat;
    if (budget_s > 0 && ms > 0)
        runs = int(std::clamp(budget_s * 1e3 / ms, double(kMinTimedRuns), double(repeat)));
    std::vector<float> times(runs);
    for (int r = 0; r < runs; ++r) {
        FLASH_CUDA_CHECK(cudaEventRecord(start));
        call();
        FLASH_CUDA_CHECK(cudaEventRecord(stop));
        FLASH_CUDA_CHECK(cudaEventSynchronize(stop));
        FLASH_CUDA_CHECK(cudaEventElapsedTime(&times[r], start, stop));
    }
    FLASH_CUDA_CHECK(cudaEventDestroy(start));
    FLASH_CUDA_CHECK(cudaEventDestroy(stop));
    std::sort(times.begin(), times.end());
    const double median =
        runs % 2 ? times[runs / 2] : 0.5 * (times[runs / 2 - 1] + times[runs / 2]);
    return {median, runs};
}

// Extra device memory of a method: memory it takes beyond the inputs and outputs it is given.
// Two things are summed, both measured:
//  (a) free memory (cudaMemGetInfo) before allocating the method's workspace minus free memory
//      after one call and a synchronize: the workspace (standard: the score buffers) and anything
//      the call leaves allocated;
//  (b) the growth of the device's stream-ordered memory pool over the call: its reserved-memory
//      high watermark minus what it holds at the end. flash_backward takes its D buffer
//      (B*H*q_len floats) from this pool with cudaMallocAsync and returns it inside the call, so
//      after the synchronize (a) cannot see it; the watermark does, at the pool's granularity.
// Not seen: memory a call takes with plain cudaMalloc and frees before it returns. Free memory
// is per device, so another process allocating meanwhile would show up; granularity is ~2 MiB.
// The cuBLAS handle's own memory (workspace) is measured once, at creation, and added to the
// standard method's figures by the caller.
struct MemProbe {
    cudaMemPool_t pool = nullptr;  // null when the device has no memory pools
    size_t free_before = 0;
};

static size_t free_device_bytes() {
    size_t free_b = 0, total_b = 0;
    FLASH_CUDA_CHECK(cudaDeviceSynchronize());  // let frees and pool trimming land first
    FLASH_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return free_b;
}

static MemProbe measure_begin() {
    MemProbe probe;
    // First synchronize (inside free_device_bytes), so that the pool has trimmed itself before
    // its watermark restarts; nothing runs between the two readings.
    probe.free_before = free_device_bytes();
    int dev = 0, pools = 0;
    FLASH_CUDA_CHECK(cudaGetDevice(&dev));
    FLASH_CUDA_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, dev));
    if (pools) {
        FLASH_CUDA_CHECK(cudaDeviceGetMemPool(&probe.pool, dev));  // the pool cudaMallocAsync uses
        uint64_t zero = 0;  // a high watermark can only be reset, by writing 0
        FLASH_CUDA_CHECK(
            cudaMemPoolSetAttribute(probe.pool, cudaMemPoolAttrReservedMemHigh, &zero));
    }
    return probe;
}

static double measure_end(const MemProbe& probe) {
    const size_t free_after = free_device_bytes();
    double extra = double(probe.free_before) - double(free_after);  // (a)
    if (probe.pool) {
        uint64_t high = 0, now = 0;
        FLASH_CUDA_CHECK(
            cudaMemPoolGetAttribute(probe.pool, cudaMemPoolAttrReservedMemHigh, &high));
        FLASH_CUDA_CHECK(
            cudaMemPoolGetAttribute(probe.pool, cudaMemPoolAttrReservedMemCurrent, &now));
        extra += std::max(0.0, double(high) - double(now));  // (b)
    }
    return std::max(extra, 0.0);
}

// FLOPs. Only the (query, key) pairs that the mask lets through are counted.
static double visible_pairs(const AttentionShape& s) {
    double pairs = 0;
    for (int i = 0; i < s.q_len; ++i) pairs += visible_keys(i, s.q_len, s.kv_len, s.causal);
    return pairs;
}
static double forward_flops(const AttentionShape& s) {  // S = QK^T and O = PV: 2 * 2 * pairs * d
    return 4.0 * s.batch * s.heads * visible_pairs(s) * s.head_dim;
}
static double backward_flops(const AttentionShape& s) {  // S again, dV, dP, dQ, dK: 5 GEMMs of 2
    return 2.5 * forward_flops(s);
}

// The FP32 peak, from device properties: SMs x FP32 lanes per SM x 2 FLOPs (an FMA) x clock.
struct Peak {
    double tflops = 0;
    int lanes = 0;       // FP32 lanes per SM
    bool known = false;  // false: lanes assumed for an architecture not in the table
    double ghz = 0;
};

static int fp32_lanes_per_sm(int major, int minor, bool* known) {
    *known = true;
    switch (major) {
        case 5: return 128;                     // Maxwell
        case 6: return minor == 0 ? 64 : 128;   // P100: 64; GP10x: 128
        case 7: return 64;                      // Volta, Turing
        case 8: return minor == 0 ? 64 : 128;   // A100: 64; GA10x, Orin, Ada: 128
        case 9: return 128;                     // Hopper
        case 10: case 11: case 12: return 128;  // Blackwell
        default: *known = false; return 128;
    }
}

static Peak fp32_peak(const cudaDeviceProp& prop, int dev) {
    Peak p;
    int khz = 0;  // CUDA 13 dropped cudaDeviceProp::clockRate; the attribute remains
    FLASH_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev));
    p.lanes = fp32_lanes_per_sm(prop.major, prop.minor, &p.known);
    p.ghz = khz * 1e-6;
    p.tflops = double(prop.multiProcessorCount) * p.lanes * 2.0 * khz * 1e3 * 1e-12;
    return p;
}

// One result: a method's time, throughput and extra memory, or why it did not run.
struct Measurement {
    bool ran = false;
    bool oom = false;          // the workspace could not be allocated
    double needs_bytes = NAN;  // the workspace it asked for (standard method)
    double ms = NAN, tflops = NAN, extra_bytes = NAN;
};

struct RowResult {
    AttentionShape shape{};
    Measurement flash_fwd, flash_bwd, std_fwd, std_bwd;
    double fwd_diff = NAN, bwd_diff = NAN;  // max |flash - standard| over O; over dQ, dK, dV
};

// The demo's default batch fills the GPU this many times over with forward blocks (see
// default_batch): one partial wave leaves SMs idle and reports a fraction of the kernel's speed.
static constexpr int kDefaultWaves = 8;

struct Options {
    int batch = 0;   // 0: derived from the device (default_batch)
    int heads = 16;
    int seq = 2048;
    int kv_seq = 0;  // 0: = seq
    int dim = 64;
    bool causal = true;
    int tile_bc = 0;  // 0: the device-derived Bc
    int repeat = 20;
    bool protocol = false, standard = true, backward = true;
    std::string csv;
};

// The one benchmark helper: times and measures flash and standard attention, forward and
// backward, on one shape whose tensors t holds. Afterwards t holds each method's outputs.
static RowResult bench_row(const AttentionShape& s, const Options& opt, cublasHandle_t cublas,
                           double cublas_bytes, double budget_s, Tensors& t) {
    RowResult r;
    r.shape = s;
    const double fwd_flops = forward_flops(s), bwd_flops = backward_flops(s);
    auto finish = [&](Measurement& m, const MemProbe& probe, double flops, double add_bytes,
                      const auto& call) {
        m.extra_bytes = measure_end(probe) + add_bytes;
        const TimedRuns timed = time_median_ms(call, opt.repeat, budget_s);
        m.ran = true;
        m.ms = timed.median_ms;
        m.tflops = flops / (m.ms * 1e-3) * 1e-12;
    };

    auto flash_fwd = [&] {
        if (opt.tile_bc > 0) flash_forward_bc(t.Q, t.K, t.V, t.O, t.L, s, opt.tile_bc);
        else flash_forward(t.Q, t.K, t.V, t.O, t.L, s);
        LAUNCH_CHECK();
    };
    auto flash_bwd = [&] {
        flash_backward(t.Q, t.K, t.V, t.O, t.dO, t.L, t.dQ, t.dK, t.dV, s);
        LAUNCH_CHECK();
    };
    MemProbe probe = measure_begin();
    flash_fwd();  // the measured call; it also leaves O and L for the backward
    finish(r.flash_fwd, probe, fwd_flops, 0, flash_fwd);
    if (opt.backward) {
        probe = measure_begin();
        flash_bwd();
        finish(r.flash_bwd, probe, bwd_flops, 0, flash_bwd);
    }
    if (!opt.standard) return r;

    const size_t score_elems = l_elems(s) * size_t(s.kv_len);  // S/P: (B*H, q_len, kv_len)
    const double score_bytes = double(score_elems) * sizeof(float);
    r.std_fwd.needs_bytes = score_bytes;
    if (opt.backward) r.std_bwd.needs_bytes = 2 * score_bytes;  // P kept from the forward, and dP
    float *P = nullptr, *dP = nullptr;
    // The backward's extra counts from here too: it needs the forward's P alive, plus dP.
    probe = measure_begin();
    if (!try_alloc(&P, score_elems)) {
        r.std_fwd.oom = true;
        r.std_bwd.oom = opt.backward;
        return r;
    }
    auto std_fwd = [&] { standard_forward(cublas, t.Q, t.K, t.V, P, t.Os, t.Ls, s); };
    std_fwd();
    finish(r.std_fwd, probe, fwd_flops, cublas_bytes, std_fwd);
    r.fwd_diff = max_abs_diff(t.O, t.Os, q_elems(s), t.scratch);
    if (opt.backward) {
        if (!try_alloc(&dP, score_elems)) {
            r.std_bwd.oom = true;
        } else {
            auto std_bwd = [&] {
                standard_backward(cublas, t.Q, t.K, t.V, t.dO, P, dP, t.dQs, t.dKs, t.dVs, s);
            };
            std_bwd();
            finish(r.std_bwd, probe, bwd_flops, cublas_bytes, std_bwd);
            const float dq = max_abs_diff(t.dQ, t.dQs, q_elems(s), t.scratch);
            const float dk = max_abs_diff(t.dK, t.dKs, kv_elems(s), t.scratch);
            const float dv = max_abs_diff(t.dV, t.dVs, kv_elems(s), t.scratch);
            r.bwd_diff = std::isnan(dq) || std::isnan(dk) || std::isnan(dv) ? NAN
                                                                          : std::max({dq, dk, dv});
        }
    }
    FLASH_CUDA_CHECK(cudaFree(dP));
    FLASH_CUDA_CHECK(cudaFree(P));
    return r;
}

// The one validation helper: copies ref.size() floats at `device` back and compares them with
// the CPU reference: the max |gpu - ref| against a tolerance relative to the largest |ref|
// (fp32 against double accumulation; errors grow with the magnitude of the values summed).
// Equal infinities agree (L = -inf on rows that see no key); anything else non-finite fails.
struct Check {
    double err = 0, tol = 0;
    bool ok() const { return err <= tol; }  // false for NaN
};

static Check validate(const float* device, const std::vector<float>& ref) {
    std::vector<float> got(ref.size());
    FLASH_CUDA_CHECK(cudaMemcpy(got.data(), device, ref.size() * sizeof(float),
                                cudaMemcpyDeviceToHost));
    Check c;
    double largest = 1.0;
    for (size_t i = 0; i < ref.size(); ++i) {
        if (std::isfinite(ref[i])) largest = std::max(largest, double(std::fabs(ref[i])));
        const double e = (got[i] == ref[i]) ? 0.0 : std::fabs(double(got[i]) - double(ref[i]));
        if (!std::isnan(c.err) && !(e <= c.err)) c.err = e;  // a NaN error sticks
    }
    c.tol = kTolerance * largest;
    return c;
}

static std::vector<float> copy_head(const float* device, size_t head, size_t per_head) {
    std::vector<float> h(per_head);
    FLASH_CUDA_CHECK(cudaMemcpy(h.data(), device + head * per_head, per_head * sizeof(float),
                                cudaMemcpyDeviceToHost));
    return h;
}

// Checks the first and the last (batch, head) of each method that ran against the CPU
// reference, run on those heads alone (a batch = 1, heads = 1 shape on the slices). Prints one
// line per head and method; returns whether all passed.
static bool check_against_reference(const RowResult& r, const Tensors& t) {
    const AttentionShape& s = r.shape;
    const bool backward = r.flash_bwd.ran;
    const size_t bh = size_t(s.batch) * s.heads, d = s.head_dim;
    const size_t nq = size_t(s.q_len) * d, nkv = size_t(s.kv_len) * d, nl = s.q_len;
    AttentionShape one = s;
    one.batch = one.heads = 1;
    std::vector<size_t> heads = {0};
    if (bh > 1) heads.push_back(bh - 1);
    printf("check against the CPU reference (double accumulation), "
           "tolerance %.0e x max(1, max|ref|):\n", kTolerance);
    fflush(stdout);  // the CPU reference takes a while on long sequences: say what is running
    bool all_ok = true;
    for (size_t head : heads) {
        const auto q = copy_head(t.Q, head, nq), k = copy_head(t.K, head, nkv);
        const auto v = copy_head(t.V, head, nkv), dout = copy_head(t.dO, head, nq);
        std::vector<float> o(nq), l(nl), dq(nq), dk(nkv), dv(nkv);
        attention_reference(q.data(), k.data(), v.data(), o.data(), l.data(), one);
        if (backward)  // from the reference's own O and L: an independent witness
            attention_reference_backward(q.data(), k.data(), v.data(), o.data(), dout.data(),
                                         l.data(), dq.data(), dk.data(), dv.data(), one);
        struct Method {
            const char* name;
            bool grads;  // whether its backward ran
            const float *O, *L, *dQ, *dK, *dV;
        };
        std::vector<Method> methods = {{"flash", backward, t.O, t.L, t.dQ, t.dK, t.dV}};
        if (r.std_fwd.ran)
            methods.push_back({"standard", r.std_bwd.ran, t.Os, t.Ls, t.dQs, t.dKs, t.dVs});
        for (const Method& m : methods) {
            printf("  %-8s head (b=%zu, h=%zu)", m.name, head / s.heads, head % s.heads);
            bool ok = true;
            auto report = [&](const char* what, const float* device, size_t offset_per_head,
                              const std::vector<float>& ref) {
                const Check c = validate(device + head * offset_per_head, ref);
                printf("  %s %.1e%s", what, c.err, c.ok() ? "" : " (too large)");
                ok = ok && c.ok();
            };
            report("O", m.O, nq, o);
            report("L", m.L, nl, l);
            if (m.grads) {
                report("dQ", m.dQ, nq, dq);
                report("dK", m.dK, nkv, dk);
                report("dV", m.dV, nkv, dv);
            }
            printf("  %s\n", ok ? "ok" : "FAIL");
            all_ok = all_ok && ok;
        }
    }
    return all_ok;
}

// ---- printing ---------------------------------------------------------------------------------

static void print_tile(const char* what, const FlashTile& t, const char* origin) {
    printf("%s tile: Br %d, Bc %d, %d threads, %d threads/row, %.1f KiB shared (%s)\n", what, t.Br,
           t.Bc, t.threads, t.threads_per_row, t.shared_bytes / 1024.0, origin);
}

// The forward tile actually used: with --tile only Bc (and so the shared memory) changes.
static FlashTile forward_tile(const cudaDeviceProp& prop, int dim, int tile_bc) {
    FlashTile fwd = flash_choose_tile(prop, dim);
    if (tile_bc > 0) {
        fwd.Bc = tile_bc;
        fwd.shared_bytes = 2 * size_t(tile_bc) * dim * sizeof(float);  // K_j and V_j
    }
    return fwd;
}
static void print_tiles(const cudaDeviceProp& prop, int dim, int tile_bc) {
    const FlashTile fwd = forward_tile(prop, dim, tile_bc);
    print_tile("forward ", fwd, tile_bc > 0 ? "Bc from --tile" : "chosen for this device");
    print_tile("backward", flash_choose_tile_backward(prop, dim), "chosen for this device");
}

// "12.345" / "OOM (needs 32.0 GiB)" / "-" (not run).
static std::string fmt_ms(const Measurement& m, int width) {
    char buf[64];
    if (m.oom) snprintf(buf, sizeof buf, "OOM (needs %.1f GiB)", m.needs_bytes / kGiB);
    else if (!m.ran) snprintf(buf, sizeof buf, "-");
    else snprintf(buf, sizeof buf, "%.3f", m.ms);
    return std::string(std::max(0, width - int(strlen(buf))), ' ') + buf;
}

static std::string fmt_speedup(const Measurement& flash, const Measurement& standard) {
    char buf[32] = "-";
    if (flash.ran && standard.ran) snprintf(buf, sizeof buf, "%.2fx", standard.ms / flash.ms);
    return buf;
}

// One line of the protocol's listing: one pass (fwd or bwd) of one row.
static void print_pass(const RowResult& r, bool backward, const Peak& peak) {
    const AttentionShape& s = r.shape;
    const Measurement& f = backward ? r.flash_bwd : r.flash_fwd;
    const Measurement& st = backward ? r.std_bwd : r.std_fwd;
    const double diff = backward ? r.bwd_diff : r.fwd_diff;
    if (!backward)
        printf("%4d %4d %5d %6d %4d  fwd |", s.head_dim, s.heads, s.batch, s.q_len, int(s.causal));
    else
        printf("%27s  bwd |", "");
    printf(" %s %8.2f %5.1f%% %9.1f |", fmt_ms(f, 9).c_str(), f.tflops,
           100 * f.tflops / peak.tflops, f.extra_bytes / kMiB);
    if (st.ran)
        printf(" %s %8.2f %5.1f%% %9.1f |", fmt_ms(st, 9).c_str(), st.tflops,
               100 * st.tflops / peak.tflops, st.extra_bytes / kMiB);
    else
        printf(" %-37s |", fmt_ms(st, 0).c_str());
    if (std::isfinite(diff)) printf(" %7s | %.1e\n", fmt_speedup(f, st).c_str(), diff);
    else printf(" %7s | -\n", fmt_speedup(f, st).c_str());
    fflush(stdout);  // a long protocol shows each row as it finishes
}

static void print_protocol_header() {
    printf("%4s %4s %5s %6s %4s %4s | %9s %8s %6s %9s | %9s %8s %6s %9s | %7s | %s\n", "d", "H",
           "B", "N", "caus", "pass", "flash ms", "TFLOP/s", "%peak", "extra MiB", "std ms",
           "TFLOP/s", "%peak", "extra MiB", "speedup", "max|flash-std|");
}

static const char* kCsvHeader =
    "dim,heads,batch,seq,kv_seq,causal,"
    "flash_fwd_ms,flash_fwd_tflops,std_fwd_ms,std_fwd_tflops,fwd_speedup,"
    "flash_fwd_extra_mib,std_fwd_extra_mib,"
    "flash_bwd_ms,flash_bwd_tflops,std_bwd_ms,std_bwd_tflops,bwd_speedup,"
    "flash_bwd_extra_mib,std_bwd_extra_mib,"
    "std_fwd_needs_mib,std_bwd_needs_mib,fwd_max_diff,bwd_max_diff,fp32_peak_tflops";

// One CSV row; what did not run (OOM, --no-standard, --no-backward) is written as nan.
static void write_csv_row(FILE* f, const RowResult& r, const Peak& peak) {
    const AttentionShape& s = r.shape;
    auto num = [&](double v) { std::isfinite(v) ? fprintf(f, ",%.6g", v) : fprintf(f, ",nan"); };
    auto speedup = [&](const Measurement& a, const Measurement& b) {
        num(a.ran && b.ran ? b.ms / a.ms : NAN);
    };
    fprintf(f, "%d,%d,%d,%d,%d,%d", s.head_dim, s.heads, s.batch, s.q_len, s.kv_len, int(s.causal));
    num(r.flash_fwd.ms), num(r.flash_fwd.tflops), num(r.std_fwd.ms), num(r.std_fwd.tflops);
    speedup(r.flash_fwd, r.std_fwd);
    num(r.flash_fwd.extra_bytes / kMiB), num(r.std_fwd.extra_bytes / kMiB);
    num(r.flash_bwd.ms), num(r.flash_bwd.tflops), num(r.std_bwd.ms), num(r.std_bwd.tflops);
    speedup(r.flash_bwd, r.std_bwd);
    num(r.flash_bwd.extra_bytes / kMiB), num(r.std_bwd.extra_bytes / kMiB);
    num(r.std_fwd.needs_bytes / kMiB), num(r.std_bwd.needs_bytes / kMiB);
    num(r.fwd_diff), num(r.bwd_diff), num(peak.tflops);
    fprintf(f, "\n");
    fflush(f);
}

static void print_markdown_summary(const std::vector<RowResult>& rows) {
    auto mib = [](const Measurement& m) {
        char buf[32] = "-";
        if (m.oom) snprintf(buf, sizeof buf, "OOM");
        else if (m.ran) snprintf(buf, sizeof buf, "%.0f", m.extra_bytes / kMiB);
        return std::string(buf);
    };
    printf("\n| head_dim | heads x batch | seq | causal | flash fwd ms | standard fwd ms "
           "| fwd speed-up | flash bwd ms | standard bwd ms | bwd speed-up "
           "| extra MiB flash fwd / bwd | extra MiB standard fwd / bwd |\n");
    printf("|---:|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const RowResult& r : rows) {
        const AttentionShape& s = r.shape;
        printf("| %d | %d x %d | %d | %s | %s | %s | %s | %s | %s | %s | %s / %s | %s / %s |\n",
               s.head_dim, s.heads, s.batch, s.q_len, s.causal ? "yes" : "no",
               fmt_ms(r.flash_fwd, 0).c_str(), fmt_ms(r.std_fwd, 0).c_str(),
               fmt_speedup(r.flash_fwd, r.std_fwd).c_str(), fmt_ms(r.flash_bwd, 0).c_str(),
               fmt_ms(r.std_bwd, 0).c_str(), fmt_speedup(r.flash_bwd, r.std_bwd).c_str(),
               mib(r.flash_fwd).c_str(), mib(r.flash_bwd).c_str(), mib(r.std_fwd).c_str(),
               mib(r.std_bwd).c_str());
    }
}

// =============================================================================================
// main
// =============================================================================================

// One command-line flag. `set` parses its value (nullptr for a switch) into the options and
// returns why it refuses it, or "" when it accepts it. --help is printed from the same table.
struct Flag {
    const char* name;
    const char* value;  // the value's name in --help, or nullptr: a switch, which takes none
    bool shape;         // part of the shape, which --protocol fixes itself
    std::string help;
    std::string (*set)(Options& opt, const char* value);
};

// text as an int >= minimum into *out, or why not
static std::string set_int(const char* text, int* out, int minimum) {
    errno = 0;
    char* end = nullptr;
    const long v = std::strtol(text, &end, 10);
    if (end == text || *end != '\0' || errno != 0 || v < minimum || v > INT_MAX)
        return "needs an integer >= " + std::to_string(minimum) + ", got '" + text + "'";
    *out = int(v);
    return "";
}

static const std::vector<Flag>& flags() {
    static const std::vector<Flag> table = {
        {"--batch", "N", true,
         "batch size (default: enough for " + std::to_string(kDefaultWaves) +
             " full waves of forward blocks on this GPU)",
         [](Options& o, const char* v) { return set_int(v, &o.batch, 1); }},
        {"--heads", "N", true, "heads (default 16)",
         [](Options& o, const char* v) { return set_int(v, &o.heads, 1); }},
        {"--seq", "N", true, "query length q_len (default 2048)",
         [](Options& o, const char* v) { return set_int(v, &o.seq, 1); }},
        {"--kv-seq", "N", true, "key/value length kv_len (default: --seq)",
         [](Options& o, const char* v) { return set_int(v, &o.kv_seq, 1); }},
        {"--dim", "N", true, "head_dim, one of " + flash_head_dims_string() + " (default 64)",
         [](Options& o, const char* v) {
             const std::string why = set_int(v, &o.dim, 1);
             if (!why.empty() || flash_head_dim_supported(o.dim)) return why;
             return std::string(v) + " is not supported (supported: " +
                    flash_head_dims_string() + ")";
         }},
        {"--causal", "0|1", true, "bottom-right causal mask (default 1)",
         [](Options& o, const char* v) {
             if (strcmp(v, "0") != 0 && strcmp(v, "1") != 0)
                 return "needs 0 or 1, got '" + std::string(v) + "'";
             o.causal = v[0] == '1';
             return std::string();
         }},
        {"--tile", "BC", false,
         "keys per K/V tile Bc of the flash forward (default: chosen for the device)",
         [](Options& o, const char* v) { return set_int(v, &o.tile_bc, 1); }},
        {"--repeat", "N", false,
         "timed runs per measurement, at least " + std::to_string(kMinTimedRuns) +
             " (default 20); the median is reported",
         [](Options& o, const char* v) { return set_int(v, &o.repeat, kMinTimedRuns); }},
        {"--protocol", nullptr, false,
         "the FlashAttention-2 benchmark: batch*seq = 16384, hidden 2048\n"
         "                  (head_dim 64 x 32 heads, 128 x 16 heads), seq 512..16384, causal\n"
         "                  0 and 1; the shape flags do not combine with it",
         [](Options& o, const char*) { o.protocol = true; return std::string(); }},
        {"--csv", "FILE", false, "also write the rows as CSV to FILE (for plot.gp)",
         [](Options& o, const char* v) {
             o.csv = v;
             return std::string(*v ? "" : "needs a file name");
         }},
        {"--no-standard", nullptr, false, "skip the standard-attention baseline",
         [](Options& o, const char*) { o.standard = false; return std::string(); }},
        {"--no-backward", nullptr, false, "skip the backward pass",
         [](Options& o, const char*) { o.backward = false; return std::string(); }},
    };
    return table;
}

static void usage(FILE* f) {
    fprintf(f, "usage: flash_bench [options]\n"
               "  Times flash attention against standard attention (cuBLAS + softmax kernels), "
               "fp32.\n"
               "  Default: one shape, timed, checked against the CPU reference; exit 1 on FAIL.\n");
    for (const Flag& flag : flags()) {
        const std::string name = std::string(flag.name) + (flag.value ? " " : "") +
                                 (flag.value ? flag.value : "");
        fprintf(f, "  %-15s %s\n", name.c_str(), flag.help.c_str());
    }
    fprintf(f, "  %-15s %s\n", "--help", "this message");
}

// Returns false (after saying why on stderr) for an unknown flag or a bad value.
static bool parse_args(int argc, char** argv, Options& opt, bool* help) {
    bool shape_flag = false;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--help" || arg == "-h") {
            *help = true;
            return true;
        }
        const Flag* flag = nullptr;
        for (const Flag& f : flags())
            if (arg == f.name) flag = &f;
        if (!flag) {
            fprintf(stderr, "flash_bench: unknown flag '%s'\n", arg.c_str());
            return false;
        }
        const char* value = flag->value ? (i + 1 < argc ? argv[++i] : "") : nullptr;
        const std::string why = flag->set(opt, value);
        if (!why.empty()) {
            fprintf(stderr, "flash_bench: %s %s\n", flag->name, why.c_str());
            return false;
        }
        shape_flag = shape_flag || flag->shape;
    }
    if (opt.protocol && shape_flag) {
        fprintf(stderr, "flash_bench: --protocol fixes its shapes; drop the shape flags\n");
        return false;
    }
    if (opt.kv_seq == 0) opt.kv_seq = opt.seq;
    return true;
}

// Memory the cuBLAS handle takes: its workspace and what its first GEMM loads. Measured once;
// the handle serves every row, and its memory is counted in the standard method's extra.
static cublasHandle_t create_cublas(double* bytes) {
    float* tiny = nullptr;  // allocated outside the measurement: it is ours, not cuBLAS's
    const int n = 64;
    FLASH_CUDA_CHECK(cudaMalloc(&tiny, 3 * n * n * sizeof(float)));
    fill_normal(tiny, 2 * n * n, 7);
    const size_t before = free_device_bytes();
    cublasHandle_t cublas = nullptr;
    CUBLAS_CHECK(cublasCreate(&cublas));
    // Default math: FP32 SGEMM. TF32 tensor-core math (CUBLAS_TF32_TENSOR_OP_MATH) would be
    // faster but rounds inputs to 10 mantissa bits; the baseline must be as exact as flash (which
    // is plain fp32), so TF32 stays off.
    CUBLAS_CHECK(cublasSetMathMode(cublas, CUBLAS_DEFAULT_MATH));
    gemm_rowmajor(cublas, false, true, n, n, n, 1.f, tiny, 0, tiny + n * n, 0, tiny + 2 * n * n,
                  0, 1);
    *bytes = std::max(0.0, double(before) - double(free_device_bytes()));
    FLASH_CUDA_CHECK(cudaFree(tiny));
    return cublas;
}

// A tiny row of everything before the first measured row: the first call of each kernel loads
// its module (lazy loading), which would otherwise be counted as the first row's extra memory.
static void warm_up(const Options& opt, int dim, cublasHandle_t cublas) {
    const AttentionShape tiny{1, 1, 128, 128, dim, true};
    Options quick = opt;
    quick.repeat = kMinTimedRuns;
    Tensors t;
    alloc_tensors(t, tiny, opt.standard, 99);
    bench_row(tiny, quick, cublas, 0, 0, t);
    free_tensors(t);
}

// The demo's default batch: enough (batch, head) pairs that the forward's grid (one block per
// Q tile per head) fills every slot of the GPU (SMs x resident blocks per SM) kDefaultWaves times.
// Resident blocks per SM are estimated from the tile's shared memory and threads. Says why.
static int default_batch(const cudaDeviceProp& prop, const Options& opt) {
    const FlashTile tile = forward_tile(prop, opt.dim, opt.tile_bc);
    const size_t block_shared = tile.shared_bytes + prop.reservedSharedMemPerBlock;
    const int per_sm = std::max(1, std::min(int(prop.sharedMemPerMultiprocessor / block_shared),
                                            prop.maxThreadsPerMultiProcessor / tile.threads));
    const long long slots = (long long)prop.multiProcessorCount * per_sm;
    const long long per_batch = (long long)opt.heads * ((opt.seq + tile.Br - 1) / tile.Br);
    const long long batch = std::max(1LL, (kDefaultWaves * slots + per_batch - 1) / per_batch);
    if (batch > INT_MAX) throw std::invalid_argument("--batch: the default overflows; set it");
    printf("default batch %lld: the forward's %lld blocks (batch x %d heads x %lld Q tiles of %d "
           "rows) fill this GPU's %d SMs x %d blocks %.1f times over (--batch sets it)\n",
           batch, batch * per_batch, opt.heads, per_batch / opt.heads, tile.Br,
           prop.multiProcessorCount, per_sm, double(batch * per_batch) / slots);
    return int(batch);
}

static int run_demo(const Options& opt, const cudaDeviceProp& prop, const Peak& peak,
                    cublasHandle_t cublas, double cublas_bytes, FILE* csv) {
    const int batch = opt.batch > 0 ? opt.batch : default_batch(prop, opt);
    const AttentionShape s{batch, opt.heads, opt.seq, opt.kv_seq, opt.dim, opt.causal};
    validate_shape(s);
    printf("shape: batch %d, heads %d, q_len %d, kv_len %d, head_dim %d, causal %d\n", s.batch,
           s.heads, s.q_len, s.kv_len, s.head_dim, int(s.causal));
    print_tiles(prop, s.head_dim, opt.tile_bc);
    warm_up(opt, s.head_dim, cublas);

    Tensors t;
    alloc_tensors(t, s, opt.standard, 1234);
    const RowResult r = bench_row(s, opt, cublas, cublas_bytes, 0, t);

    printf("timing: median of %d timed runs after warm-up (CUDA events)\n"
           "TFLOP/s counts 4 * head_dim FLOPs per (query, key) pair the mask lets through, per\n"
           "  head (2.5x that backward), for both methods; this GPU's FP32 peak is %.1f TFLOP/s,\n"
           "  and flash runs on its CUDA cores (fp32 FMAs; tensor cores are chapter 2's)\n",
           opt.repeat, peak.tflops);
    auto line = [&](const char* name, const Measurement& m) {
        if (m.oom)
            printf("  %-18s: OOM (its workspace needs %.2f GiB)\n", name, m.needs_bytes / kGiB);
        else if (m.ran)
            printf("  %-18s: %9.3f ms  %7.2f TFLOP/s (%4.1f%% of FP32 peak)  "
                   "extra memory %9.1f MiB\n",
                   name, m.ms, m.tflops, 100 * m.tflops / peak.tflops, m.extra_bytes / kMiB);
    };
    line("flash forward", r.flash_fwd);
    line("standard forward", r.std_fwd);
    if (r.flash_fwd.ran && r.std_fwd.ran)
        printf("  forward speed-up  : %.2fx\n", r.std_fwd.ms / r.flash_fwd.ms);
    line("flash backward", r.flash_bwd);
    line("standard backward", r.std_bwd);
    if (r.flash_bwd.ran && r.std_bwd.ran)
        printf("  backward speed-up : %.2fx\n", r.std_bwd.ms / r.flash_bwd.ms);
    printf("extra memory = device memory beyond inputs and outputs, measured (cudaMemGetInfo\n"
           "  and the memory pool's high watermark, so rounded up to allocation granularity).\n"
           "  Expected:\n"
           "  flash forward 0; flash backward its D buffer, B*H*q_len floats = %.2f MiB\n",
           l_elems(s) * sizeof(float) / kMiB);
    if (opt.standard)
        printf("  standard: S/P (B*H, q_len, kv_len) = %.1f MiB, twice that in the backward\n"
               "  (P and dP), plus the cuBLAS handle's %.1f MiB\n",
               double(l_elems(s)) * s.kv_len * sizeof(float) / kMiB, cublas_bytes / kMiB);
    if (r.std_fwd.ran) printf("max |flash - standard|: O %.1e", r.fwd_diff);
    if (r.std_bwd.ran) printf(", dQ/dK/dV %.1e", r.bwd_diff);
    if (r.std_fwd.ran) printf("\n");
    if (csv) write_csv_row(csv, r, peak);

    // The CPU reference is plain double-precision loops: past ~2^30 multiply-adds per head it
    // would take minutes, so large shapes are checked only against standard attention above.
    const double macs_per_head = double(s.q_len) * s.kv_len * s.head_dim;
    if (macs_per_head > kMaxCheckMacs) {
        printf("CPU reference check skipped: %.1e multiply-adds per head is over %.1e "
               "(use a shorter --seq to check)\nNOT CHECKED\n", macs_per_head, kMaxCheckMacs);
        free_tensors(t);
        return 0;
    }
    const bool ok = check_against_reference(r, t);
    free_tensors(t);
    printf("%s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
}

static int run_protocol(const Options& opt, const cudaDeviceProp& prop, const Peak& peak,
                        cublasHandle_t cublas, double cublas_bytes, FILE* csv) {
    struct Config {
        int dim, heads;
    };
    const Config configs[] = {{64, 32}, {128, 16}};  // hidden = dim * heads = 2048
    const int seqs[] = {512, 1024, 2048, 4096, 8192, 16384};
    const int tokens = 16384;  // batch * seq
    const double budget_s = 1.0;  // per measurement: large rows time 10 runs, not opt.repeat
    printf("FlashAttention-2 protocol: batch * seq = %d, hidden 2048, %s%s\n", tokens,
           opt.standard ? "flash vs standard attention" : "flash only",
           opt.backward ? ", forward and backward" : ", forward only");
    printf("times: median of %d..%d timed runs after warm-up (CUDA events); extra = device memory "
           "beyond inputs and outputs (MiB)\n", kMinTimedRuns, opt.repeat);
    std::vector<RowResult> rows;
    for (const Config& c : configs) {
        printf("\nhead_dim %d, %d heads:\n", c.dim, c.heads);
        print_tiles(prop, c.dim, opt.tile_bc);
        warm_up(opt, c.dim, cublas);
        print_protocol_header();
        auto run_row = [&](const AttentionShape& s) {
            Tensors t;
            alloc_tensors(t, s, opt.standard, 1000 + s.q_len);
            const RowResult r = bench_row(s, opt, cublas, cublas_bytes, budget_s, t);
            free_tensors(t);
            print_pass(r, false, peak);
            if (opt.backward) print_pass(r, true, peak);
            if (csv) write_csv_row(csv, r, peak);
            rows.push_back(r);
        };
        for (int causal = 0; causal <= 1; ++causal)
            for (int seq : seqs) run_row({tokens / seq, c.heads, seq, seq, c.dim, causal == 1});
        // Past the protocol, the memory wall: batch 1 at twice the longest length. Standard
        // attention's (B*H, N, N) scores alone are then 4 * heads * N^2 bytes (128 GiB at 32
        // heads); flash attention still needs no more than O(B*H*N).
        run_row({1, c.heads, 2 * tokens, 2 * tokens, c.dim, false});
    }
    print_markdown_summary(rows);
    return 0;
}

int main(int argc, char** argv) {
    Options opt;
    bool help = false;
    if (!parse_args(argc, argv, opt, &help)) {
        usage(stderr);
        return 2;
    }
    if (help) {
        usage(stdout);
        return 0;
    }

    int devices = 0;
    const cudaError_t err = cudaGetDeviceCount(&devices);
    if (err != cudaSuccess || devices == 0) {
        fprintf(stderr, "flash_bench: no CUDA GPU available (%s); nothing to run\n",
               err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
        return 1;
    }

    try {
        int dev = 0;
        FLASH_CUDA_CHECK(cudaGetDevice(&dev));
        cudaDeviceProp prop;
        FLASH_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
        const Peak peak = fp32_peak(prop, dev);
        printf("device: %s, %d SMs, compute capability %d.%d, %.1f GiB\n", prop.name,
               prop.multiProcessorCount, prop.major, prop.minor, prop.totalGlobalMem / kGiB);
        printf("FP32 peak: %.1f TFLOP/s, computed from device properties: %d SMs x %d FP32 "
               "lanes/SM%s x 2 FLOP/FMA x %.3f GHz max clock\n",
               peak.tflops, prop.multiProcessorCount, peak.lanes,
               peak.known ? "" : " (assumed: architecture not in the table)", peak.ghz);
        if (opt.tile_bc > 0) {  // reject an impossible Bc now, not after minutes of protocol
            for (int dim : {opt.protocol ? 64 : opt.dim, opt.protocol ? 128 : opt.dim})
                if (2 * size_t(opt.tile_bc) * dim * sizeof(float) > prop.sharedMemPerBlockOptin) {
                    fprintf(stderr, "flash_bench: --tile %d needs %zu bytes of shared memory at "
                            "head_dim %d; this device allows %zu per block\n", opt.tile_bc,
                            2 * size_t(opt.tile_bc) * dim * sizeof(float), dim,
                            size_t(prop.sharedMemPerBlockOptin));
                    usage(stderr);
                    return 2;
                }
        }

        FILE* csv = nullptr;
        if (!opt.csv.empty()) {
            csv = fopen(opt.csv.c_str(), "w");
            if (!csv) throw std::runtime_error("cannot write " + opt.csv + ": " + strerror(errno));
            fprintf(csv, "%s\n", kCsvHeader);
        }
        double cublas_bytes = 0;
        cublasHandle_t cublas = create_cublas(&cublas_bytes);
        const int rc = opt.protocol ? run_protocol(opt, prop, peak, cublas, cublas_bytes, csv)
                                    : run_demo(opt, prop, peak, cublas, cublas_bytes, csv);
        CUBLAS_CHECK(cublasDestroy(cublas));
        if (csv && fclose(csv) != 0) throw std::runtime_error("cannot write " + opt.csv);
        if (csv) printf("wrote %s\n", opt.csv.c_str());
        return rc;
    } catch (const std::invalid_argument& e) {  // a shape or tile the library refuses
        fprintf(stderr, "flash_bench: %s\n", e.what());
        return 2;
    } catch (const std::exception& e) {
        fprintf(stderr, "flash_bench: error: %s\n", e.what());
        return 1;
    }
}
