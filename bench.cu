/*
FlashAttention demo and benchmark: flash attention against standard attention done the way
frameworks do it (cuBLAS GEMMs around a softmax kernel, with the whole (q_len, kv_len) score
matrix of every head in device memory), in fp32 (chapter 1: flash_forward / flash_backward,
flash.cu, on the CUDA cores) or fp16 (chapter 2: flash_forward_fp16 / flash_backward_fp16,
flash_fp16.cu, on the tensor cores; at head_dim 128 and 256 the fp16 backward needs 121 and
142.5 KiB of shared memory a block at least: A100, H100).

Build and run the demo (one shape, timed, checked against the CPU reference; exits 1 on FAIL):
make flash_bench && ./flash_bench
(by hand: nvcc -O3 -std=c++17 -arch=native bench.cu standard.cu flash.cu flash_fp16.cu checks.cpp
 reference.cpp -lcublas -o flash_bench)

One shape of your own, with keys-per-tile Bc forced to 32; the same in fp16:
./flash_bench --batch 2 --heads 16 --seq 4096 --dim 128 --causal 0 --tile 32
./flash_bench --batch 2 --heads 16 --seq 4096 --dim 128 --causal 0 --tile 32 --dtype fp16

The FlashAttention-2 benchmark protocol (what `make bench` runs: fp32, then fp16), then the plot
(`make plot`); `--protocol --dtype fp16` runs the fp16 block alone (seconds, not minutes):
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
- the peaks printed next to TFLOP/s (FP32 on the CUDA cores; dense FP16 on the tensor cores with
  fp32 accumulate) are computed from device properties, not measured (see fp32_peak, fp16_peak).
*/

#include "flash.h"
#include "standard.h"

#include <cublas_v2.h>
#include <cuda_fp16.h>
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
#include <type_traits>
#include <vector>

// Every kernel launch is followed by this: a bad launch configuration only shows up here.
#define LAUNCH_CHECK() FLASH_CUDA_CHECK(cudaGetLastError())

static constexpr int kMinTimedRuns = 10;       // never report a median of fewer runs
static constexpr int kRowThreads = 256;        // threads per block of the row-wise kernels
static constexpr double kTolerance = 2e-4;     // max |gpu - ref| <= kTolerance * max(1, max|ref|)
// fp16's O: max |gpu - ref| <= kFp16Roundoffs * 2^-11 * max(1, max|V| of the head). P~ and O are
// rounded to fp16, whose unit roundoff is 2^-11 (11 significant bits); each O row is a convex
// combination of V rows, so its error is bounded by a few roundoffs times max|V|.
static constexpr double kFp16Roundoffs = 4;
static constexpr double kFp16UnitRoundoff = 1.0 / 2048;  // 2^-11
// fp16's dQ, dK, dV: max |gpu - ref| <= kFp16GradRoundoffs * 2^-11 * max(1, max|ref|), per tensor.
// P and dS are rounded to fp16 before the tensor-core products, and each gradient once more at
// the end; a sum of such terms is off by a few unit roundoffs of its largest terms. 16 leaves
// room for the cancellation in dS = P (dP - D).
static constexpr double kFp16GradRoundoffs = 16;
static constexpr double kMaxCheckMacs = 1073741824.0;  // 2^30: the CPU check's size limit
static constexpr double kMiB = 1024.0 * 1024.0;
static constexpr double kGiB = 1024.0 * kMiB;

// The element types: fp32 (chapter 1) and fp16 (chapter 2). Templates below take T = float or
// __half; kDtype names T at run time.
enum class Dtype { fp32, fp16 };
static const char* dtype_name(Dtype d) { return d == Dtype::fp16 ? "fp16" : "fp32"; }
template <typename T>
constexpr Dtype kDtype = std::is_same_v<T, __half> ? Dtype::fp16 : Dtype::fp32;

// Random inputs: x[i] ~ N(0, 1) from a hash of (seed, i), so any tensor is reproducible and the
// fill never depends on the launch shape. Normal inputs give scores of standard deviation ~1.
// fp16 tensors get the same values, rounded to fp16.
__device__ inline uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}
template <typename T>
__global__ void fill_normal_kernel(T* x, size_t n, uint64_t seed) {
    const uint64_t key = splitmix64(seed);
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x) {
        const uint64_t h = splitmix64(key ^ i);
        const float u1 = (float(h >> 40) + 0.5f) * (1.f / 16777216.f);  // in (0, 1): log finite
        const float u2 = float((h >> 16) & 0xFFFFFF) * (1.f / 16777216.f);
        x[i] = from_float<T>(sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));  // Box-Muller
    }
}

// The larger of two non-negative floats, NaN winning (fmaxf would drop a NaN and hide a bug).
__device__ inline float max_or_nan(float a, float b) { return (a > b || a != a) ? a : b; }

// *out = max_i |a[i] - b[i]| as float bits (the difference taken in fp32). Non-negative floats
// order like their bit patterns (and NaN above +inf), so an unsigned atomicMax is a float max.
template <typename T>
__global__ void max_abs_diff_kernel(const T* a, const T* b, size_t n, unsigned int* out) {
    float m = 0.f;
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x)
        m = max_or_nan(m, fabsf(to_float(a[i]) - to_float(b[i])));
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

template <typename T>
static void fill_normal(T* x, size_t n, uint64_t seed) {
    fill_normal_kernel<T><<<grid_stride_blocks(n), kRowThreads>>>(x, n, seed);
    LAUNCH_CHECK();
}

// max |a - b| over n elements; scratch: one unsigned int of device memory.
template <typename T>
static float max_abs_diff(const T* a, const T* b, size_t n, unsigned int* scratch) {
    FLASH_CUDA_CHECK(cudaMemset(scratch, 0, sizeof(unsigned int)));  // 0u is the float 0.0f
    max_abs_diff_kernel<T><<<grid_stride_blocks(n), kRowThreads>>>(a, b, n, scratch);
    LAUNCH_CHECK();
    unsigned int bits = 0;
    FLASH_CUDA_CHECK(cudaMemcpy(&bits, scratch, sizeof(bits), cudaMemcpyDeviceToHost));
    float v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
}

// The device buffers of one shape: the inputs, and the outputs of each method. Elements of type
// T, except L, which is fp32 in both chapters. The backward's buffers exist only when it runs.
template <typename T>
struct Tensors {
    T *Q = nullptr, *K = nullptr, *V = nullptr, *dO = nullptr;                     // inputs
    T *O = nullptr, *dQ = nullptr, *dK = nullptr, *dV = nullptr;                   // flash's
    T *Os = nullptr, *dQs = nullptr, *dKs = nullptr, *dVs = nullptr;               // standard's
    float *L = nullptr, *Ls = nullptr;                                             // flash's, std's
    unsigned int* scratch = nullptr;  // for max_abs_diff
};

template <typename T>
static void alloc_tensors(Tensors<T>& t, const AttentionShape& s, bool standard, bool backward,
                          uint64_t seed) {
    const size_t nq = q_elems(s), nkv = kv_elems(s), nl = l_elems(s);
    auto alloc = [](auto** p, size_t n) { FLASH_CUDA_CHECK(cudaMalloc(p, n * sizeof(**p))); };
    alloc(&t.Q, nq), alloc(&t.K, nkv), alloc(&t.V, nkv), alloc(&t.O, nq), alloc(&t.L, nl);
    if (backward) alloc(&t.dO, nq), alloc(&t.dQ, nq), alloc(&t.dK, nkv), alloc(&t.dV, nkv);
    if (standard) alloc(&t.Os, nq), alloc(&t.Ls, nl);
    if (standard && backward) alloc(&t.dQs, nq), alloc(&t.dKs, nkv), alloc(&t.dVs, nkv);
    FLASH_CUDA_CHECK(cudaMalloc(&t.scratch, sizeof(unsigned int)));
    fill_normal(t.Q, nq, seed + 1);  // (B, H, N|M, d)
    fill_normal(t.K, nkv, seed + 2);
    fill_normal(t.V, nkv, seed + 3);
    if (backward) fill_normal(t.dO, nq, seed + 4);
}

template <typename T>
static void free_tensors(Tensors<T>& t) {
    T* const all[] = {t.Q, t.K, t.V, t.dO, t.O, t.dQ, t.dK, t.dV, t.Os, t.dQs, t.dKs, t.dVs};
    for (T* p : all) FLASH_CUDA_CHECK(cudaFree(p));  // cudaFree(nullptr): a no-op, for unallocated
    FLASH_CUDA_CHECK(cudaFree(t.L));
    FLASH_CUDA_CHECK(cudaFree(t.Ls));
    FLASH_CUDA_CHECK(cudaFree(t.scratch));
    t = Tensors<T>{};
}

// cudaMalloc that treats "out of memory" as an answer rather than an error: the baseline's
// memory wall is something the benchmark reports.
template <typename T>
static bool try_alloc(T** p, size_t n) {
    const cudaError_t err = cudaMalloc(p, n * sizeof(T));
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
//      (B*H*q_len floats), flash_backward_fp16 its scratch (flash_backward_fp16_scratch_bytes: dQ
//      in fp32, D, turn counters) from this pool with cudaMallocAsync and returns it
//      inside the call, so after the synchronize (a) cannot see it; the watermark does, at the
//      pool's granularity.
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

// A peak, from device properties: SMs x FLOPs per clock per SM x clock.
struct Peak {
    double tflops = 0;
    int flops_per_clock = 0;  // per SM
    bool known = false;       // false: assumed for an architecture not in the table
    double ghz = 0;
};
struct Peaks {
    Peak fp32;  // FP32 FMAs on the CUDA cores: what chapter 1 runs on
    Peak fp16;  // dense FP16 on the tensor cores, fp32 accumulate: what chapter 2 runs on
    const Peak& of(Dtype d) const { return d == Dtype::fp16 ? fp16 : fp32; }
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

// Dense FP16 tensor-core FLOPs per clock per SM with FP32 accumulate (the mode of flash_fp16.cu's
// mma and of standard attention's CUBLAS_COMPUTE_32F GEMMs): each whitepaper's dense "peak FP16
// Tensor TFLOPS with FP32 accumulate" divided by SMs x the boost clock it is quoted at.
//   7.0 V100: 1024 (8 tensor cores x 64 FMA; Volta whitepaper: 125 TFLOPS, 80 SMs, 1.53 GHz)
//   8.0 A100: 2048 (4 tensor cores x 256 FMA; A100 whitepaper: 312 TFLOPS, 108 SMs, 1.41 GHz)
//   8.6 GA10x, 8.9 Ada: 512, the GeForce rate: these run FP32 accumulate at half the FP16-
//       accumulate rate (GA102 whitepaper: RTX 3090 71 TFLOPS, 82 SMs, 1.695 GHz; Ada whitepaper:
//       RTX 4090 165.2 TFLOPS, 128 SMs, 2.52 GHz). Their professional and data-center parts
//       (RTX A6000, A40, A10, L40, L40S, RTX 6000 Ada) run it at the full 1024: there the
//       percentages of this peak read twice too high.
//   9.0 H100: 4096 (H100 whitepaper: 989.4 TFLOPS for the SXM5 part, 132 SMs, 1.83 GHz). That
//       peak is reached with wgmma (sm_90a's warpgroup MMA, which cuBLAS uses); mma.sync, which
//       flash_fp16.cu uses, reaches only part of it on Hopper.
// Anything else is assumed: Hopper's rate for newer architectures, Volta's for older ones.
static int fp16_tensor_flops_per_clock(int major, int minor, bool* known) {
    *known = true;
    if (major == 7 && minor == 0) return 1024;
    if (major == 8 && minor == 0) return 2048;
    if (major == 8 && (minor == 6 || minor == 9)) return 512;
    if (major == 9 && minor == 0) return 4096;
    *known = false;
    return major >= 9 ? 4096 : 1024;
}

static Peaks device_peaks(const cudaDeviceProp& prop, int dev) {
    int khz = 0;  // CUDA 13 dropped cudaDeviceProp::clockRate; the attribute remains
    FLASH_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev));
    // The maximum clock the device reports. Whitepapers may quote tensor peaks at a lower boost
    // clock (H100 SXM5: 1.83 GHz against the 1.98 GHz reported), so the fp16 figure here can be
    // a few percent above theirs.
    auto peak = [&](int flops_per_clock, bool known) {
        Peak p;
        p.flops_per_clock = flops_per_clock;
        p.known = known;
        p.ghz = khz * 1e-6;
        p.tflops = double(prop.multiProcessorCount) * flops_per_clock * khz * 1e3 * 1e-12;
        return p;
    };
    bool known32 = false, known16 = false;
    const int lanes = fp32_lanes_per_sm(prop.major, prop.minor, &known32);
    const int fp16 = fp16_tensor_flops_per_clock(prop.major, prop.minor, &known16);
    return {peak(2 * lanes, known32), peak(fp16, known16)};  // an FMA is 2 FLOPs
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
    Dtype dtype = Dtype::fp32;
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
    Dtype dtype = Dtype::fp32;
    bool dtype_given = false;  // without --dtype, the protocol runs both element types
    std::string csv;
    bool runs(Dtype d) const {  // whether this run measures element type d
        return dtype_given ? dtype == d : (protocol || d == Dtype::fp32);
    }
};

// The flash calls for each element type; Bc > 0 forces the keys per tile.
static void flash_fwd_call(const float* Q, const float* K, const float* V, float* O, float* L,
                           const AttentionShape& s, int Bc) {
    if (Bc > 0) flash_forward_bc(Q, K, V, O, L, s, Bc);
    else flash_forward(Q, K, V, O, L, s);
}
static void flash_fwd_call(const __half* Q, const __half* K, const __half* V, __half* O,
                           float* L, const AttentionShape& s, int Bc) {
    if (Bc > 0) flash_forward_fp16_bc(Q, K, V, O, L, s, Bc);
    else flash_forward_fp16(Q, K, V, O, L, s);
}
static void flash_bwd_call(const float* Q, const float* K, const float* V, const float* O,
                           const float* dO, const float* L, float* dQ, float* dK, float* dV,
                           const AttentionShape& s) {
    flash_backward(Q, K, V, O, dO, L, dQ, dK, dV, s);
}
static void flash_bwd_call(const __half* Q, const __half* K, const __half* V, const __half* O,
                           const __half* dO, const float* L, __half* dQ, __half* dK, __half* dV,
                           const AttentionShape& s) {
    flash_backward_fp16(Q, K, V, O, dO, L, dQ, dK, dV, s);
}

// The one benchmark helper: times and measures flash and standard attention, forward and
// backward (unless --no-backward), on one shape whose tensors t holds. Afterwards t holds each
// method's outputs. cublas_bytes: the handle's memory, counted in the standard method's extra.
template <typename T>
static RowResult bench_row(const AttentionShape& s, const Options& opt, cublasHandle_t cublas,
                           double cublas_bytes, double budget_s, Tensors<T>& t) {
    RowResult r;
    r.shape = s;
    r.dtype = kDtype<T>;
    const bool backward = opt.backward;
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
        flash_fwd_call(t.Q, t.K, t.V, t.O, t.L, s, opt.tile_bc);
        LAUNCH_CHECK();
    };
    MemProbe probe = measure_begin();
    flash_fwd();  // the measured call; it also leaves O and L for the backward
    finish(r.flash_fwd, probe, fwd_flops, 0, flash_fwd);
    if (backward) {
        auto flash_bwd = [&] {
            flash_bwd_call(t.Q, t.K, t.V, t.O, t.dO, t.L, t.dQ, t.dK, t.dV, s);
            LAUNCH_CHECK();
        };
        probe = measure_begin();
        flash_bwd();
        finish(r.flash_bwd, probe, bwd_flops, 0, flash_bwd);
    }
    if (!opt.standard) return r;

    const size_t score_elems = l_elems(s) * size_t(s.kv_len);  // S/P: (B*H, q_len, kv_len)
    const double score_bytes = double(score_elems) * sizeof(T);
    r.std_fwd.needs_bytes = score_bytes;
    if (backward) r.std_bwd.needs_bytes = 2 * score_bytes;  // P kept from the forward, and dP
    T *P = nullptr, *dP = nullptr;
    // The backward's extra counts from here too: it needs the forward's P alive, plus dP.
    probe = measure_begin();
    if (!try_alloc(&P, score_elems)) {
        r.std_fwd.oom = true;
        r.std_bwd.oom = backward;
        return r;
    }
    auto std_fwd = [&] { standard_forward(cublas, t.Q, t.K, t.V, P, t.Os, t.Ls, s); };
    std_fwd();
    finish(r.std_fwd, probe, fwd_flops, cublas_bytes, std_fwd);
    r.fwd_diff = max_abs_diff(t.O, t.Os, q_elems(s), t.scratch);
    if (backward) {
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

// The one validation helper: copies ref.size() elements at `device` back and compares them with
// the CPU reference: max |gpu - ref| against the tolerance tol the caller derives (see
// check_against_reference). Equal infinities agree (L = -inf on rows that see no key); anything
// else non-finite fails.
struct Check {
    double err = 0, tol = 0;
    bool ok() const { return err <= tol; }  // false for NaN
};

// One head's slice of a device tensor, widened to float (exactly, for fp16).
template <typename T>
static std::vector<float> copy_head(const T* device, size_t head, size_t per_head) {
    std::vector<T> h(per_head);
    FLASH_CUDA_CHECK(cudaMemcpy(h.data(), device + head * per_head, per_head * sizeof(T),
                                cudaMemcpyDeviceToHost));
    std::vector<float> f(per_head);
    for (size_t i = 0; i < per_head; ++i) f[i] = to_float(h[i]);
    return f;
}

template <typename T>
static Check validate(const T* device, const std::vector<float>& ref, double tol) {
    const std::vector<float> got = copy_head(device, 0, ref.size());
    Check c;
    for (size_t i = 0; i < ref.size(); ++i) {
        const double e = (got[i] == ref[i]) ? 0.0 : std::fabs(double(got[i]) - double(ref[i]));
        if (!std::isnan(c.err) && !(e <= c.err)) c.err = e;  // a NaN error sticks
    }
    c.tol = tol;
    return c;
}

// max(1, max |x|) over the finite x: what the tolerances scale with (errors grow with the
// magnitude of the values summed).
static double scale_of(const std::vector<float>& x) {
    double largest = 1.0;
    for (float v : x)
        if (std::isfinite(v)) largest = std::max(largest, double(std::fabs(v)));
    return largest;
}

// Checks the first and the last (batch, head) of each method that ran against the CPU
// reference, run on those heads alone (a batch = 1, heads = 1 shape on the slices; in fp16 on
// the fp16 inputs widened exactly to float, so only the GPU's own rounding is measured). Prints
// one line per head and method; returns whether all passed.
// Tolerances: fp32, kTolerance x max(1, max|ref|) (fp32 against double accumulation); fp16, for
// O kFp16Roundoffs x 2^-11 x max(1, max|V| of the head) (see kFp16Roundoffs), for dQ, dK, dV
// kFp16GradRoundoffs x 2^-11 x max(1, max|ref|) of each (see kFp16GradRoundoffs), and for L,
// which is fp32 in both chapters, the fp32 rule. The reference's backward runs from its own O
// and L, on the same dO (in fp16, the fp16 dO widened exactly).
template <typename T>
static bool check_against_reference(const RowResult& r, const Tensors<T>& t) {
    const AttentionShape& s = r.shape;
    const bool fp16 = kDtype<T> == Dtype::fp16;
    const bool backward = r.flash_bwd.ran;
    const size_t bh = size_t(s.batch) * s.heads, d = s.head_dim;
    const size_t nq = size_t(s.q_len) * d, nkv = size_t(s.kv_len) * d, nl = s.q_len;
    AttentionShape one = s;
    one.batch = one.heads = 1;
    std::vector<size_t> heads = {0};
    if (bh > 1) heads.push_back(bh - 1);
    if (fp16) {
        printf("check against the CPU reference (double accumulation, on the fp16 inputs), "
               "tolerance O %.0f x 2^-11 x max(1, max|V|),\n  L %.0e x max(1, max|ref|)",
               kFp16Roundoffs, kTolerance);
        if (backward)
            printf(", dQ/dK/dV %.0f x 2^-11 x max(1, max|ref|) each", kFp16GradRoundoffs);
        printf(":\n");
    } else
        printf("check against the CPU reference (double accumulation), "
               "tolerance %.0e x max(1, max|ref|):\n", kTolerance);
    fflush(stdout);  // the CPU reference takes a while on long sequences: say what is running
    bool all_ok = true;
    for (size_t head : heads) {
        const auto q = copy_head(t.Q, head, nq), k = copy_head(t.K, head, nkv);
        const auto v = copy_head(t.V, head, nkv);
        std::vector<float> o(nq), l(nl), dout, dq(nq), dk(nkv), dv(nkv);
        attention_reference(q.data(), k.data(), v.data(), o.data(), l.data(), one);
        if (backward) {  // from the reference's own O and L: an independent witness
            dout = copy_head(t.dO, head, nq);
            attention_reference_backward(q.data(), k.data(), v.data(), o.data(), dout.data(),
                                         l.data(), dq.data(), dk.data(), dv.data(), one);
        }
        const double o_tol = fp16 ? kFp16Roundoffs * kFp16UnitRoundoff * scale_of(v)
                                  : kTolerance * scale_of(o);
        struct Method {
            const char* name;
            bool grads;  // whether its backward ran
            const T *O;
            const float* L;
            const T *dQ, *dK, *dV;
        };
        std::vector<Method> methods = {{"flash", backward, t.O, t.L, t.dQ, t.dK, t.dV}};
        if (r.std_fwd.ran)
            methods.push_back({"standard", r.std_bwd.ran, t.Os, t.Ls, t.dQs, t.dKs, t.dVs});
        for (const Method& m : methods) {
            printf("  %-8s head (b=%zu, h=%zu)", m.name, head / s.heads, head % s.heads);
            bool ok = true;
            auto report = [&](const char* what, const auto* device, size_t offset_per_head,
                              const std::vector<float>& ref, double tol) {
                const Check c = validate(device + head * offset_per_head, ref, tol);
                printf("  %s %.1e%s", what, c.err, c.ok() ? "" : " (too large)");
                ok = ok && c.ok();
            };
            report("O", m.O, nq, o, o_tol);
            report("L", m.L, nl, l, kTolerance * scale_of(l));
            if (m.grads) {
                const double grad_rel = fp16 ? kFp16GradRoundoffs * kFp16UnitRoundoff : kTolerance;
                report("dQ", m.dQ, nq, dq, grad_rel * scale_of(dq));
                report("dK", m.dK, nkv, dk, grad_rel * scale_of(dk));
                report("dV", m.dV, nkv, dv, grad_rel * scale_of(dv));
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
static FlashTile forward_tile(const cudaDeviceProp& prop, int dim, int tile_bc, Dtype dtype) {
    if (dtype == Dtype::fp16) {
        FlashTile fwd = flash_choose_tile_fp16(prop, dim);
        if (tile_bc > 0 && tile_bc != fwd.Bc) {
            // A block of flash_fp16.cu holds Q_i (Br rows) and two stages of K_j and V_j (4 Bc
            // rows), all rows of one padded length, so that length is read off the chosen tile.
            const size_t row_bytes = fwd.shared_bytes / size_t(fwd.Br + 4 * fwd.Bc);
            fwd.Bc = tile_bc;
            fwd.shared_bytes = row_bytes * size_t(fwd.Br + 4 * tile_bc);
        }
        return fwd;
    }
    FlashTile fwd = flash_choose_tile(prop, dim);
    if (tile_bc > 0) {
        fwd.Bc = tile_bc;
        fwd.shared_bytes = 2 * size_t(tile_bc) * dim * sizeof(float);  // K_j and V_j
    }
    return fwd;
}
// The backward's tile only where the backward runs: with --no-backward, a GPU whose shared
// memory is too small for the fp16 backward's tile (99 KB at head_dim 128 and 256) still runs.
static void print_tiles(const cudaDeviceProp& prop, int dim, int tile_bc, Dtype dtype,
                        bool backward) {
    const FlashTile fwd = forward_tile(prop, dim, tile_bc, dtype);
    const char* origin = tile_bc > 0 ? "Bc from --tile" : "chosen for this device";
    if (dtype == Dtype::fp16) {
        print_tile("fp16 forward ", fwd, origin);
        if (backward)
            print_tile("fp16 backward", flash_choose_tile_fp16_backward(prop, dim),
                       "chosen for this device");
        return;
    }
    print_tile("forward ", fwd, origin);
    if (backward)
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

// One line of the protocol's listing: one pass (fwd or bwd) of one row. peak: of the row's dtype.
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

// dtype: fp32 or fp16. fp32_peak_tflops: the FP32 peak on every row; peak_tflops: the peak of
// the row's dtype (FP32, or dense FP16 tensor with fp32 accumulate), which %peak divides by.
static const char* kCsvHeader =
    "dtype,dim,heads,batch,seq,kv_seq,causal,"
    "flash_fwd_ms,flash_fwd_tflops,std_fwd_ms,std_fwd_tflops,fwd_speedup,"
    "flash_fwd_extra_mib,std_fwd_extra_mib,"
    "flash_bwd_ms,flash_bwd_tflops,std_bwd_ms,std_bwd_tflops,bwd_speedup,"
    "flash_bwd_extra_mib,std_bwd_extra_mib,"
    "std_fwd_needs_mib,std_bwd_needs_mib,fwd_max_diff,bwd_max_diff,fp32_peak_tflops,peak_tflops";

// One CSV row; what did not run (OOM, --no-standard, --no-backward) is nan.
static void write_csv_row(FILE* f, const RowResult& r, const Peaks& peaks) {
    const AttentionShape& s = r.shape;
    auto num = [&](double v) { std::isfinite(v) ? fprintf(f, ",%.6g", v) : fprintf(f, ",nan"); };
    auto speedup = [&](const Measurement& a, const Measurement& b) {
        num(a.ran && b.ran ? b.ms / a.ms : NAN);
    };
    fprintf(f, "%s,%d,%d,%d,%d,%d,%d", dtype_name(r.dtype), s.head_dim, s.heads, s.batch,
            s.q_len, s.kv_len, int(s.causal));
    num(r.flash_fwd.ms), num(r.flash_fwd.tflops), num(r.std_fwd.ms), num(r.std_fwd.tflops);
    speedup(r.flash_fwd, r.std_fwd);
    num(r.flash_fwd.extra_bytes / kMiB), num(r.std_fwd.extra_bytes / kMiB);
    num(r.flash_bwd.ms), num(r.flash_bwd.tflops), num(r.std_bwd.ms), num(r.std_bwd.tflops);
    speedup(r.flash_bwd, r.std_bwd);
    num(r.flash_bwd.extra_bytes / kMiB), num(r.std_bwd.extra_bytes / kMiB);
    num(r.std_fwd.needs_bytes / kMiB), num(r.std_bwd.needs_bytes / kMiB);
    num(r.fwd_diff), num(r.bwd_diff), num(peaks.fp32.tflops), num(peaks.of(r.dtype).tflops);
    fprintf(f, "\n");
    fflush(f);
}

// One markdown table of one dtype's rows; without a backward (--no-backward), its columns are
// left out.
static void print_markdown_summary(const std::vector<RowResult>& rows, Dtype dtype,
                                   bool backward) {
    auto mib = [](const Measurement& m) {
        char buf[32] = "-";
        if (m.oom) snprintf(buf, sizeof buf, "OOM");
        else if (m.ran) snprintf(buf, sizeof buf, "%.0f", m.extra_bytes / kMiB);
        return std::string(buf);
    };
    printf("\n%s%s:\n\n", dtype_name(dtype), backward ? "" : ", forward only");
    printf("| head_dim | heads x batch | seq | causal | flash fwd ms | standard fwd ms "
           "| fwd speed-up |");
    if (backward)
        printf(" flash bwd ms | standard bwd ms | bwd speed-up "
               "| extra MiB flash fwd / bwd | extra MiB standard fwd / bwd |\n"
               "|---:|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    else
        printf(" extra MiB flash fwd | extra MiB standard fwd |\n"
               "|---:|---:|---:|:---:|---:|---:|---:|---:|---:|\n");
    for (const RowResult& r : rows) {
        if (r.dtype != dtype) continue;
        const AttentionShape& s = r.shape;
        printf("| %d | %d x %d | %d | %s | %s | %s | %s |", s.head_dim, s.heads, s.batch, s.q_len,
               s.causal ? "yes" : "no", fmt_ms(r.flash_fwd, 0).c_str(),
               fmt_ms(r.std_fwd, 0).c_str(), fmt_speedup(r.flash_fwd, r.std_fwd).c_str());
        if (backward)
            printf(" %s | %s | %s | %s / %s | %s / %s |\n", fmt_ms(r.flash_bwd, 0).c_str(),
                   fmt_ms(r.std_bwd, 0).c_str(), fmt_speedup(r.flash_bwd, r.std_bwd).c_str(),
                   mib(r.flash_fwd).c_str(), mib(r.flash_bwd).c_str(), mib(r.std_fwd).c_str(),
                   mib(r.std_bwd).c_str());
        else
            printf(" %s | %s |\n", mib(r.flash_fwd).c_str(), mib(r.std_fwd).c_str());
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
        {"--dtype", "TYPE", false,
         "fp32 (default; chapter 1, CUDA cores) or fp16 (chapter 2, tensor cores);\n"
         "                  --protocol without it runs both",
         [](Options& o, const char* v) {
             if (strcmp(v, "fp32") == 0) o.dtype = Dtype::fp32;
             else if (strcmp(v, "fp16") == 0) o.dtype = Dtype::fp16;
             else return "needs fp32 or fp16, got '" + std::string(v) + "'";
             o.dtype_given = true;
             return std::string();
         }},
        {"--tile", "BC", false,
         "keys per K/V tile Bc of the flash forward (default: chosen for the device;\n"
         "                  fp16 takes 32 or 64)",
         [](Options& o, const char* v) { return set_int(v, &o.tile_bc, 1); }},
        {"--repeat", "N", false,
         "timed runs per measurement, at least " + std::to_string(kMinTimedRuns) +
             " (default 20); the median is reported",
         [](Options& o, const char* v) { return set_int(v, &o.repeat, kMinTimedRuns); }},
        {"--protocol", nullptr, false,
         "the FlashAttention-2 benchmark: batch*seq = 16384, hidden 2048\n"
         "                  (head_dim 64 x 32 heads, 128 x 16 heads), seq 512..16384, causal\n"
         "                  0 and 1, fp32 then fp16 (--dtype picks one); the shape flags do\n"
         "                  not combine with it",
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
               "fp32 or fp16.\n"
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
    // Checked once every flag is in: --dtype may come after --tile.
    if (opt.tile_bc > 0 && opt.runs(Dtype::fp16) && opt.tile_bc != 32 && opt.tile_bc != 64) {
        fprintf(stderr, "flash_bench: --tile %d: the fp16 forward takes 32 or 64%s\n",
                opt.tile_bc, opt.dtype_given ? "" : " (--dtype fp32 runs fp32 alone)");
        return false;
    }
    if (opt.kv_seq == 0) opt.kv_seq = opt.seq;
    return true;
}

// The memory the cuBLAS handle takes, for each element type: its workspace and what its first
// GEMM loads. Measured once; the handle serves every row, and its memory is counted in the
// standard method's extra.
struct CublasBytes {
    double fp32 = 0, fp16 = 0;
    double of(Dtype d) const { return d == Dtype::fp16 ? fp16 : fp32; }
};

// The handle, then one tiny fp32 GEMM, then one tiny fp16 GEMM, free memory read between them:
// fp32's figure is the handle and the first GEMM; fp16's is all of it (which also holds the
// fp32 GEMM's kernels, below the measurement's granularity, but misses nothing of its own, such
// as a workspace the first GEMM may have allocated).
static cublasHandle_t create_cublas(CublasBytes* bytes) {
    float* tiny = nullptr;  // allocated outside the measurement: ours, not cuBLAS's
    __half* tiny16 = nullptr;
    const int n = 64;
    FLASH_CUDA_CHECK(cudaMalloc(&tiny, 3 * n * n * sizeof(float)));
    FLASH_CUDA_CHECK(cudaMalloc(&tiny16, 3 * n * n * sizeof(__half)));
    fill_normal(tiny, 2 * n * n, 7);
    fill_normal(tiny16, 2 * n * n, 7);
    const size_t before = free_device_bytes();
    cublasHandle_t cublas = nullptr;
    CUBLAS_CHECK(cublasCreate(&cublas));
    // Default math: plain FP32 GEMMs for fp32. TF32 tensor-core math (CUBLAS_TF32_TENSOR_OP_MATH)
    // would be faster but rounds inputs to 10 mantissa bits; the fp32 baseline must be as exact as
    // flash (which is plain fp32), so TF32 stays off. fp16 GEMMs use the tensor cores in this mode.
    CUBLAS_CHECK(cublasSetMathMode(cublas, CUBLAS_DEFAULT_MATH));
    gemm_rowmajor(cublas, false, true, n, n, n, 1.f, tiny, 0, tiny + n * n, 0, tiny + 2 * n * n,
                  0, 1);
    const size_t after_fp32 = free_device_bytes();
    gemm_rowmajor(cublas, false, true, n, n, n, 1.f, tiny16, 0, tiny16 + n * n, 0,
                  tiny16 + 2 * n * n, 0, 1);
    const size_t after_fp16 = free_device_bytes();
    bytes->fp32 = std::max(0.0, double(before) - double(after_fp32));
    bytes->fp16 = std::max(0.0, double(before) - double(after_fp16));
    FLASH_CUDA_CHECK(cudaFree(tiny));
    FLASH_CUDA_CHECK(cudaFree(tiny16));
    return cublas;
}

// A tiny row of everything before the first measured row: the first call of each kernel loads
// its module (lazy loading), which would otherwise be counted as the first row's extra memory.
template <typename T>
static void warm_up(const Options& opt, int dim, cublasHandle_t cublas) {
    const AttentionShape tiny{1, 1, 128, 128, dim, true};
    Options quick = opt;
    quick.repeat = kMinTimedRuns;
    Tensors<T> t;
    alloc_tensors(t, tiny, opt.standard, opt.backward, 99);
    bench_row(tiny, quick, cublas, 0, 0, t);
    free_tensors(t);
}

// The demo's default batch: enough (batch, head) pairs that the forward's grid (one block per
// Q tile per head) fills every slot of the GPU (SMs x resident blocks per SM) kDefaultWaves times.
// Resident blocks per SM are estimated from the tile's shared memory and threads. Says why.
static int default_batch(const cudaDeviceProp& prop, const Options& opt, const FlashTile& tile) {
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

template <typename T>
static int run_demo(const Options& opt, const cudaDeviceProp& prop, const Peaks& peaks,
                    cublasHandle_t cublas, const CublasBytes& cublas_bytes, FILE* csv) {
    constexpr Dtype dtype = kDtype<T>;
    const bool fp16 = dtype == Dtype::fp16;
    const Peak& peak = peaks.of(dtype);
    const FlashTile tile = forward_tile(prop, opt.dim, opt.tile_bc, dtype);
    const int batch = opt.batch > 0 ? opt.batch : default_batch(prop, opt, tile);
    const AttentionShape s{batch, opt.heads, opt.seq, opt.kv_seq, opt.dim, opt.causal};
    validate_shape(s);
    printf("shape: batch %d, heads %d, q_len %d, kv_len %d, head_dim %d, causal %d, %s\n",
           s.batch, s.heads, s.q_len, s.kv_len, s.head_dim, int(s.causal), dtype_name(dtype));
    const bool backward = opt.backward;
    print_tiles(prop, s.head_dim, opt.tile_bc, dtype, backward);
    warm_up<T>(opt, s.head_dim, cublas);

    Tensors<T> t;
    alloc_tensors(t, s, opt.standard, backward, 1234);
    const RowResult r = bench_row(s, opt, cublas, cublas_bytes.of(dtype), 0, t);

    printf("timing: median of %d timed runs after warm-up (CUDA events)\n"
           "TFLOP/s counts 4 * head_dim FLOPs per (query, key) pair the mask lets through, per\n"
           "  head (2.5x that backward), for both methods; ", opt.repeat);
    if (fp16)
        printf("this GPU's dense FP16 tensor peak (fp32\n  accumulate) is %.1f TFLOP/s, and "
               "flash runs on its tensor cores (fp16 mma.sync, fp32 sums)\n", peak.tflops);
    else
        printf("this GPU's FP32 peak is %.1f TFLOP/s,\n  and flash runs on its CUDA cores (fp32 "
               "FMAs; tensor cores are chapter 2's: --dtype fp16)\n", peak.tflops);
    const char* peak_name = fp16 ? "FP16 tensor peak" : "FP32 peak";
    auto line = [&](const char* name, const Measurement& m) {
        if (m.oom)
            printf("  %-18s: OOM (its workspace needs %.2f GiB)\n", name, m.needs_bytes / kGiB);
        else if (m.ran)
            printf("  %-18s: %9.3f ms  %7.2f TFLOP/s (%4.1f%% of %s)  extra memory %9.1f MiB\n",
                   name, m.ms, m.tflops, 100 * m.tflops / peak.tflops, peak_name,
                   m.extra_bytes / kMiB);
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
           "  Expected:\n");
    if (backward && dtype == Dtype::fp16)
        printf("  flash forward 0; flash backward dQ in fp32, D, turn counters "
               "(flash_backward_fp16_scratch_bytes) = %.2f MiB\n",
               flash_backward_fp16_scratch_bytes(s) / kMiB);
    else if (backward)
        printf("  flash forward 0; flash backward its D buffer, B*H*q_len floats = %.2f MiB\n",
               l_elems(s) * sizeof(float) / kMiB);
    else printf("  flash forward 0\n");
    if (opt.standard)
        printf("  standard: S/P (B*H, q_len, kv_len) %s = %.1f MiB%s, plus the cuBLAS\n"
               "  handle's %.1f MiB\n", dtype_name(dtype),
               double(l_elems(s)) * s.kv_len * sizeof(T) / kMiB,
               backward ? ", twice that in the backward (P and dP)" : "",
               cublas_bytes.of(dtype) / kMiB);
    if (r.std_fwd.ran) printf("max |flash - standard|: O %.1e", r.fwd_diff);
    if (r.std_bwd.ran) printf(", dQ/dK/dV %.1e", r.bwd_diff);
    if (r.std_fwd.ran) printf("\n");
    if (csv) write_csv_row(csv, r, peaks);

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

// The protocol's rows of one element type, appended to rows.
template <typename T>
static void run_protocol_block(const Options& opt, const cudaDeviceProp& prop, const Peaks& peaks,
                               cublasHandle_t cublas, const CublasBytes& cublas_bytes, FILE* csv,
                               std::vector<RowResult>& rows) {
    constexpr Dtype dtype = kDtype<T>;
    struct Config {
        int dim, heads;
    };
    const Config configs[] = {{64, 32}, {128, 16}};  // hidden = dim * heads = 2048
    const int seqs[] = {512, 1024, 2048, 4096, 8192, 16384};
    const int tokens = 16384;  // batch * seq
    const double budget_s = 1.0;  // per measurement: large rows time 10 runs, not opt.repeat
    const bool backward = opt.backward;
    printf("\n==== %s: FlashAttention-2 protocol: batch * seq = %d, hidden 2048, %s%s\n",
           dtype_name(dtype), tokens, opt.standard ? "flash vs standard attention" : "flash only",
           backward ? ", forward and backward" : ", forward only");
    printf("times: median of %d..%d timed runs after warm-up (CUDA events); extra = device memory "
           "beyond inputs and outputs (MiB); %%peak: of the %s peak, %.1f TFLOP/s\n",
           kMinTimedRuns, opt.repeat,
           dtype == Dtype::fp16 ? "dense FP16 tensor (fp32 accumulate)" : "FP32",
           peaks.of(dtype).tflops);
    for (const Config& c : configs) {
        printf("\nhead_dim %d, %d heads:\n", c.dim, c.heads);
        print_tiles(prop, c.dim, opt.tile_bc, dtype, backward);
        warm_up<T>(opt, c.dim, cublas);
        print_protocol_header();
        auto run_row = [&](const AttentionShape& s) {
            Tensors<T> t;
            alloc_tensors(t, s, opt.standard, backward, 1000 + s.q_len);
            const RowResult r = bench_row(s, opt, cublas, cublas_bytes.of(dtype), budget_s, t);
            free_tensors(t);
            print_pass(r, false, peaks.of(dtype));
            if (backward) print_pass(r, true, peaks.of(dtype));
            if (csv) write_csv_row(csv, r, peaks);
            rows.push_back(r);
        };
        for (int causal = 0; causal <= 1; ++causal)
            for (int seq : seqs) run_row({tokens / seq, c.heads, seq, seq, c.dim, causal == 1});
        // Past the protocol, the memory wall: batch 1 at twice the longest length. Standard
        // attention's (B*H, N, N) scores alone are then sizeof(T) * heads * N^2 bytes: in fp32
        // 128 GiB at 32 heads, which no 80 GB card holds; in fp16 64 GiB, which may fit, and
        // twice that for its backward (P and dP), which no 80 GB card holds: an OOM row.
        // Flash attention still needs no more than O(B*H*N).
        run_row({1, c.heads, 2 * tokens, 2 * tokens, c.dim, false});
    }
}

static int run_protocol(const Options& opt, const cudaDeviceProp& prop, const Peaks& peaks,
                        cublasHandle_t cublas, const CublasBytes& cublas_bytes, FILE* csv) {
    std::vector<RowResult> rows;
    bool fp16 = opt.runs(Dtype::fp16);
    if (fp16 && !opt.dtype_given && prop.major < 8) {  // asked for by name, the library says why
        printf("fp16 block skipped: flash_forward_fp16 needs compute capability 8.0 or newer; "
               "this GPU is %d.%d\n", prop.major, prop.minor);
        fp16 = false;
    }
    if (opt.runs(Dtype::fp32))
        run_protocol_block<float>(opt, prop, peaks, cublas, cublas_bytes, csv, rows);
    if (fp16) run_protocol_block<__half>(opt, prop, peaks, cublas, cublas_bytes, csv, rows);
    if (opt.runs(Dtype::fp32)) print_markdown_summary(rows, Dtype::fp32, opt.backward);
    if (fp16) print_markdown_summary(rows, Dtype::fp16, opt.backward);
    return 0;
}

// Refuses (false, after saying why) a forced --tile whose forward tile cannot fit this device's
// shared memory: now, not after minutes of protocol.
static bool tile_fits(const Options& opt, const cudaDeviceProp& prop) {
    if (opt.tile_bc <= 0) return true;
    for (Dtype dtype : {Dtype::fp32, Dtype::fp16}) {
        if (!opt.runs(dtype) || (dtype == Dtype::fp16 && prop.major < 8)) continue;
        for (int dim : {opt.protocol ? 64 : opt.dim, opt.protocol ? 128 : opt.dim}) {
            const size_t need = forward_tile(prop, dim, opt.tile_bc, dtype).shared_bytes;
            if (need > prop.sharedMemPerBlockOptin) {
                fprintf(stderr, "flash_bench: --tile %d needs %zu bytes of shared memory at "
                        "head_dim %d in %s; this device allows %zu per block\n", opt.tile_bc,
                        need, dim, dtype_name(dtype), size_t(prop.sharedMemPerBlockOptin));
                return false;
            }
        }
    }
    return true;
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
        const Peaks peaks = device_peaks(prop, dev);
        const char* assumed = " (assumed: architecture not in the table)";
        printf("device: %s, %d SMs, compute capability %d.%d, %.1f GiB\n", prop.name,
               prop.multiProcessorCount, prop.major, prop.minor, prop.totalGlobalMem / kGiB);
        printf("FP32 peak: %.1f TFLOP/s, computed from device properties: %d SMs x %d FP32 "
               "lanes/SM%s x 2 FLOP/FMA x %.3f GHz max clock\n",
               peaks.fp32.tflops, prop.multiProcessorCount, peaks.fp32.flops_per_clock / 2,
               peaks.fp32.known ? "" : assumed, peaks.fp32.ghz);
        printf("FP16 tensor peak (dense, fp32 accumulate): %.1f TFLOP/s, computed the same way: "
               "%d SMs x %d FLOP/clock/SM%s x %.3f GHz\n",
               peaks.fp16.tflops, prop.multiProcessorCount, peaks.fp16.flops_per_clock,
               peaks.fp16.known ? "" : assumed, peaks.fp16.ghz);
        if (!tile_fits(opt, prop)) {
            usage(stderr);
            return 2;
        }

        FILE* csv = nullptr;
        if (!opt.csv.empty()) {
            csv = fopen(opt.csv.c_str(), "w");
            if (!csv) throw std::runtime_error("cannot write " + opt.csv + ": " + strerror(errno));
            fprintf(csv, "%s\n", kCsvHeader);
        }
        CublasBytes cublas_bytes;
        cublasHandle_t cublas = create_cublas(&cublas_bytes);
        int rc = 0;
        if (opt.protocol) rc = run_protocol(opt, prop, peaks, cublas, cublas_bytes, csv);
        else if (opt.dtype == Dtype::fp16)
            rc = run_demo<__half>(opt, prop, peaks, cublas, cublas_bytes, csv);
        else rc = run_demo<float>(opt, prop, peaks, cublas, cublas_bytes, csv);
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
