/*
FlashAttention demo and benchmark: flash attention against standard attention done the way
frameworks do it (cuBLAS GEMMs around a softmax kernel, with the whole (q_len, kv_len) score
matrix of every head in device memory), in fp32 (chapter 1: flash_forward / flash_backward,
flash.cu, on the CUDA cores), fp16 or bf16 (chapter 2: flash_forward_fp16 / flash_backward_fp16
and their _bf16 twins, flash_fp16.cu, on the tensor cores; at head_dim 128 and 256 its backward
needs 121 and 142.5 KiB of shared memory a block at least: A100, H100). The element types are
data, one row each of kDtypes; everything below that table is one code for all three.

Build and run the demo (one shape, timed, checked against the CPU reference; exits 1 on FAIL):
make flash_bench && ./flash_bench
(by hand: nvcc -O3 -std=c++17 -arch=native bench.cu standard.cu flash.cu flash_fp16.cu checks.cpp
 reference.cpp -lcublas -o flash_bench)

One shape of your own, with keys-per-tile Bc forced to 32; the same in bf16 (whose Bc is always
the chosen one: flash.h has no bf16 forward that takes a Bc):
./flash_bench --batch 2 --heads 16 --seq 4096 --dim 128 --causal 0 --tile 32
./flash_bench --batch 2 --heads 16 --seq 4096 --dim 128 --causal 0 --dtype bf16

The FlashAttention-2 benchmark protocol (what `make bench` runs: fp32, then fp16, then bf16),
then the plot (`make plot`); `--protocol --dtype bf16` runs the bf16 block alone (seconds, not
minutes):
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
- the peaks printed next to TFLOP/s (FP32 on the CUDA cores; dense FP16 and BF16, one rate, on
  the tensor cores with fp32 accumulate) are computed from device properties, not measured (see
  device_peaks).
*/

#include "checks.h"
#include "flash.h"
#include "reference.h"
#include "standard.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
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
#include <variant>
#include <vector>

// Every kernel launch is followed by this: a bad launch configuration only shows up here.
#define LAUNCH_CHECK() FLASH_CUDA_CHECK(cudaGetLastError())

static constexpr int kMinTimedRuns = 10;       // never report a median of fewer runs
static constexpr int kRowThreads = 256;        // threads per block of the row-wise kernels
static constexpr double kTolerance = 2e-4;     // max |gpu - ref| <= kTolerance * max(1, max|ref|)
// fp16 and bf16 are checked in units of their unit roundoff u = 2^-p, p their significant bits
// (11 and 8). O: max |gpu - ref| <= kRoundoffsO * u * max(1, max|V| of the head). P~ and O are
// rounded to the element type; each O row is a convex combination of V rows, so its error is
// bounded by a few roundoffs times max|V|. Standard attention's L (fp32) comes from S rounded to
// T: rounding each score moves L = log sum exp(S) by a P-weighted mean of the moves, about u times
// the scores' size, which is L's: it gets kRoundoffsO * u * max(1, max|L|) more.
static constexpr double kRoundoffsO = 4;
// dQ, dK, dV: max |gpu - ref| <= kRoundoffsGrad * u * max(1, max|ref|), per tensor. P and dS are
// rounded before the tensor-core products, and each gradient once more at the end; a sum of such
// terms is off by a few unit roundoffs of its largest terms. 16 leaves room for the cancellation
// in dS = P (dP - D). All these errors scale with u: bf16's tolerances are 8 times fp16's.
static constexpr double kRoundoffsGrad = 16;
static constexpr double kMaxCheckMacs = 1073741824.0;  // 2^30: the CPU check's size limit
static constexpr double kMiB = 1024.0 * 1024.0;
static constexpr double kGiB = 1024.0 * kMiB;

// =============================================================================================
// The element types, as data
// =============================================================================================

// One chapter's entry points for element type T (float, __half or __nv_bfloat16). Called through
// pointers, they take no default arguments: the callers pass the stream (0).
template <typename T>
struct FlashApi {
    using Elem = T;
    void (*forward)(const T* Q, const T* K, const T* V, T* O, float* L, const AttentionShape&,
                    cudaStream_t);
    // The forward with keys-per-tile Bc given (--tile); nullptr where flash.h has none (bf16).
    void (*forward_bc)(const T* Q, const T* K, const T* V, T* O, float* L, const AttentionShape&,
                       int Bc, cudaStream_t);
    void (*backward)(const T* Q, const T* K, const T* V, const T* O, const T* dO, const float* L,
                     T* dQ, T* dK, T* dV, const AttentionShape&, cudaStream_t);
};

// One element type: what the benchmark runs and how it reads the results. `api`, its entry points,
// also names by its alternative the C++ type T (sizeof(T): the element size) that the templates
// below take: std::visit on it is where a dtype becomes a T.
struct Dtype {
    const char* name;       // as --dtype, the listings and the CSV's dtype column spell it
    const char* runs_on;    // what flash runs on, for the demo
    int min_major;          // the compute capability (major) it needs: chapter 2's mma.sync, 8.0
    bool tensor;            // its peak: dense 16-bit tensor math with fp32 accumulate; else FP32
    const char* peak_name;  // that peak, as the listings name it
    int bits;               // significant bits p of its rounding (see kRoundoffsO); fp32: 0
    int q_rows, kv_rows;    // the forward's shared-memory rows per query, per key (forward_tile)
    FlashTile (*tile)(const cudaDeviceProp&, int head_dim);
    FlashTile (*tile_backward)(const cudaDeviceProp&, int head_dim);
    bool (*bc_ok)(int Bc, int head_dim);  // the Bc forward_bc takes, as it checks; nullptr: none
    const char* bwd_scratch;              // the flash backward's extra memory, expected, in words
    size_t (*bwd_scratch_bytes)(const AttentionShape&);  // and in bytes
    std::variant<FlashApi<float>, FlashApi<__half>, FlashApi<__nv_bfloat16>> api;
};

static const Dtype kDtypes[] = {
    {"fp32", "its CUDA cores (fp32 FMAs; chapter 2's tensor cores: --dtype fp16, bf16)",
     0, false, "FP32 peak", 0, 0, 2, flash_choose_tile, flash_choose_tile_backward,
     [](int, int) { return true; }, "its D buffer, B*H*q_len floats",
     [](const AttentionShape& s) { return l_elems(s) * sizeof(float); },
     FlashApi<float>{flash_forward, flash_forward_bc, flash_backward}},
    {"fp16", "its tensor cores (fp16 mma.sync, fp32 sums)", 8, true, "FP16 tensor peak", 11, 1, 4,
     flash_choose_tile_fp16, flash_choose_tile_fp16_backward,
     [](int bc, int d) { return bc == 32 || bc == 64 || (bc == 128 && d <= 64); },
     "dQ in fp32, D, turn counters", flash_backward_fp16_scratch_bytes,
     FlashApi<__half>{flash_forward_fp16, flash_forward_fp16_bc, flash_backward_fp16}},
    {"bf16", "its tensor cores (bf16 mma.sync, fp32 sums)", 8, true, "BF16 tensor peak", 8, 1, 4,
     flash_choose_tile_fp16, flash_choose_tile_fp16_backward, nullptr,
     "dQ in fp32, D, turn counters", flash_backward_fp16_scratch_bytes,
     FlashApi<__nv_bfloat16>{flash_forward_bf16, nullptr, flash_backward_bf16}},
};

// Random inputs: x[i] ~ N(0, 1) from a hash of (seed, i), so any tensor is reproducible and the
// fill never depends on the launch shape. Normal inputs give scores of standard deviation ~1.
// fp16 and bf16 tensors get the same values, rounded to their type.
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

// The one timing helper, for all four methods. One warm-up call (it pays for lazy module
// loading, cold caches and clock ramp-up, and its time sizes the loop), then `repeat` timed calls,
// each between two CUDA events; the median, since a few runs slowed by the rest of the system
// would pull a mean. When budget_s > 0 fewer runs are made for slow calls, so that one measurement
// takes about budget_s, but never fewer than kMinTimedRuns.
template <typename Call>
static double time_median_ms(const Call& call, int repeat, double budget_s) {
    cudaEvent_t start, stop;
    FLASH_CUDA_CHECK(cudaEventCreate(&start));
    FLASH_CUDA_CHECK(cudaEventCreate(&stop));
    auto timed_call = [&] {
        float ms = 0.f;
        FLASH_CUDA_CHECK(cudaEventRecord(start));
        call();
        FLASH_CUDA_CHECK(cudaEventRecord(stop));
        FLASH_CUDA_CHECK(cudaEventSynchronize(stop));
        FLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
        return ms;
    };
    const float warm_ms = timed_call();
    int runs = repeat;
    if (budget_s > 0 && warm_ms > 0)
        runs = int(std::clamp(budget_s * 1e3 / warm_ms, double(kMinTimedRuns), double(repeat)));
    std::vector<float> times(runs);
    for (float& ms : times) ms = timed_call();
    FLASH_CUDA_CHECK(cudaEventDestroy(start));
    FLASH_CUDA_CHECK(cudaEventDestroy(stop));
    std::sort(times.begin(), times.end());
    return runs % 2 ? times[runs / 2] : 0.5 * (times[runs / 2 - 1] + times[runs / 2]);
}

// Extra device memory of a method: memory it takes beyond the inputs and outputs it is given.
// Two things are summed, both measured:
//  (a) free memory (cudaMemGetInfo) before allocating the method's workspace minus free memory
//      after one call and a synchronize: the workspace (standard: the score buffers) and anything
//      the call leaves allocated;
//  (b) the growth of the device's stream-ordered memory pool over the call: its reserved-memory
//      high watermark minus what it holds at the end. flash_backward takes its D buffer
//      (B*H*q_len floats), flash_backward_fp16 and _bf16 their scratch
//      (flash_backward_fp16_scratch_bytes: dQ in fp32, D, turn counters) from this pool with
//      cudaMallocAsync and return it inside the call, so after the synchronize (a) cannot see
//      it; the watermark does, at the pool's granularity.
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
    Peak fp32;    // FP32 FMAs on the CUDA cores: what chapter 1 runs on
    Peak tensor;  // dense FP16 or BF16 on the tensor cores, fp32 accumulate: chapter 2's
    const Peak& of(const Dtype& d) const { return d.tensor ? tensor : fp32; }
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

// Dense 16-bit tensor-core FLOPs per clock per SM with FP32 accumulate (the mode of
// flash_fp16.cu's mma and of standard attention's CUBLAS_COMPUTE_32F GEMMs): each whitepaper's
// dense "peak FP16 Tensor TFLOPS with FP32 accumulate" divided by SMs x the boost clock it is
// quoted at. BF16 with FP32 accumulate has the same peak in each whitepaper below from 8.0 on
// (V100 has no BF16, and bf16 needs 8.0 here), so one rate serves fp16 and bf16.
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
static int tensor_flops_per_clock(int major, int minor, bool* known) {
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
    // clock (H100 SXM5: 1.83 GHz against the 1.98 GHz reported), so the tensor figure here can
    // be a few percent above theirs.
    auto peak = [&](int flops_per_clock, bool known) {
        Peak p;
        p.flops_per_clock = flops_per_clock;
        p.known = known;
        p.ghz = khz * 1e-6;
        p.tflops = double(prop.multiProcessorCount) * flops_per_clock * khz * 1e3 * 1e-12;
        return p;
    };
    bool known32 = false, known_tensor = false;
    const int lanes = fp32_lanes_per_sm(prop.major, prop.minor, &known32);
    const int tensor = tensor_flops_per_clock(prop.major, prop.minor, &known_tensor);
    return {peak(2 * lanes, known32), peak(tensor, known_tensor)};  // an FMA is 2 FLOPs
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
    const Dtype* dtype = nullptr;
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
    const Dtype* dtype = nullptr;  // --dtype; without it the demo runs fp32, --protocol each type
    std::string csv;
};

// What every measurement shares: the options, the device and its peaks, the CSV file (or null),
// the cuBLAS handle and the memory it takes (create_cublas).
struct Bench {
    const Options& opt;
    const cudaDeviceProp& prop;
    Peaks peaks;
    FILE* csv;
    cublasHandle_t cublas = nullptr;
    double cublas_bytes = 0;
};

// The one benchmark helper: times and measures flash and standard attention, forward and
// backward (unless --no-backward), on one shape whose tensors t holds: `repeat` timed runs, or
// fewer within budget_s (see time_median_ms). Afterwards t holds each method's outputs.
template <typename T>
static RowResult bench_row(const Bench& b, const Dtype& dt, const AttentionShape& s,
                           Tensors<T>& t, double budget_s, int repeat) {
    const FlashApi<T>& api = std::get<FlashApi<T>>(dt.api);
    const Options& opt = b.opt;
    RowResult r;
    r.shape = s;
    r.dtype = &dt;
    const bool backward = opt.backward;
    const double fwd_flops = forward_flops(s), bwd_flops = backward_flops(s);
    auto finish = [&](Measurement& m, const MemProbe& probe, double flops, double add_bytes,
                      const auto& call) {
        m.extra_bytes = measure_end(probe) + add_bytes;
        m.ran = true;
        m.ms = time_median_ms(call, repeat, budget_s);
        m.tflops = flops / (m.ms * 1e-3) * 1e-12;
    };

    auto flash_fwd = [&] {
        if (opt.tile_bc > 0) api.forward_bc(t.Q, t.K, t.V, t.O, t.L, s, opt.tile_bc, 0);
        else api.forward(t.Q, t.K, t.V, t.O, t.L, s, 0);
        LAUNCH_CHECK();
    };
    MemProbe probe = measure_begin();
    flash_fwd();  // the measured call; it also leaves O and L for the backward
    finish(r.flash_fwd, probe, fwd_flops, 0, flash_fwd);
    if (backward) {
        auto flash_bwd = [&] {
            api.backward(t.Q, t.K, t.V, t.O, t.dO, t.L, t.dQ, t.dK, t.dV, s, 0);
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
    auto std_fwd = [&] { standard_forward(b.cublas, t.Q, t.K, t.V, P, t.Os, t.Ls, s); };
    std_fwd();
    finish(r.std_fwd, probe, fwd_flops, b.cublas_bytes, std_fwd);
    r.fwd_diff = max_abs_diff(t.O, t.Os, q_elems(s), t.scratch);
    if (backward) {
        if (!try_alloc(&dP, score_elems)) {
            r.std_bwd.oom = true;
        } else {
            auto std_bwd = [&] {
                standard_backward(b.cublas, t.Q, t.K, t.V, t.dO, P, dP, t.dQs, t.dKs, t.dVs, s);
            };
            std_bwd();
            finish(r.std_bwd, probe, bwd_flops, b.cublas_bytes, std_bwd);
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

// One head's slice of a device tensor, widened to float (exactly, for fp16 and bf16).
template <typename T>
static std::vector<float> copy_head(const T* device, size_t head, size_t per_head) {
    std::vector<T> h(per_head);
    FLASH_CUDA_CHECK(cudaMemcpy(h.data(), device + head * per_head, per_head * sizeof(T),
                                cudaMemcpyDeviceToHost));
    std::vector<float> f(per_head);
    for (size_t i = 0; i < per_head; ++i) f[i] = to_float(h[i]);
    return f;
}

// The one validation helper: copies ref.size() elements at `device` back and returns
// max |gpu - ref| against the CPU reference, which the caller holds to its tolerance (see
// check_against_reference). Equal infinities agree (L = -inf on rows that see no key); anything
// else non-finite is a NaN error, which no tolerance passes.
template <typename T>
static double max_error(const T* device, const std::vector<float>& ref) {
    const std::vector<float> got = copy_head(device, 0, ref.size());
    double err = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        const double e = (got[i] == ref[i]) ? 0.0 : std::fabs(double(got[i]) - double(ref[i]));
        if (!std::isnan(err) && !(e <= err)) err = e;  // a NaN error sticks
    }
    return err;
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
// reference, run on those heads alone (a batch = 1, heads = 1 shape on the slices; in fp16 and
// bf16 on their inputs widened exactly to float, so only the GPU's own rounding is measured).
// Prints one line per head and method; returns whether all passed.
// Tolerances (the constants above say why): fp32, kTolerance x max(1, max|ref|); fp16 and bf16,
// in units of their unit roundoff u, O kRoundoffsO x u x max(1, max|V| of the head) and dQ, dK,
// dV kRoundoffsGrad x u x max(1, max|ref|) each; L, fp32 in both chapters, the fp32 rule, and
// standard attention's kRoundoffsO x u x max(1, max|L|) more. The reference's backward runs from
// its own O and L, on the same dO (in fp16 and bf16, theirs widened exactly).
template <typename T>
static bool check_against_reference(const RowResult& r, const Tensors<T>& t) {
    const AttentionShape& s = r.shape;
    const Dtype& dt = *r.dtype;
    const double u = dt.bits > 0 ? std::ldexp(1.0, -dt.bits) : 0;  // 0: fp32, kTolerance's rule
    const bool backward = r.flash_bwd.ran;
    const size_t bh = size_t(s.batch) * s.heads, d = s.head_dim;
    const size_t nq = size_t(s.q_len) * d, nkv = size_t(s.kv_len) * d, nl = s.q_len;
    AttentionShape one = s;
    one.batch = one.heads = 1;
    std::vector<size_t> heads = {0};
    if (bh > 1) heads.push_back(bh - 1);
    printf("check against the CPU reference (double accumulation, on the %s inputs), tolerance\n  ",
           dt.name);
    if (u == 0) printf("%.0e x max(1, max|ref|)", kTolerance);
    else
        printf("O %.0f x 2^-%d x max(1, max|V|), L %.0e x max(1, max|ref|) (standard's: + %.0f x "
               "2^-%d x that)", kRoundoffsO, dt.bits, kTolerance, kRoundoffsO, dt.bits);
    if (u > 0 && backward)
        printf(",\n  dQ/dK/dV %.0f x 2^-%d x max(1, max|ref|) each", kRoundoffsGrad, dt.bits);
    printf(":\n");
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
        const double o_tol = u > 0 ? kRoundoffsO * u * scale_of(v) : kTolerance * scale_of(o);
        const double l_tol = kTolerance * scale_of(l);
        const double grad_rel = u > 0 ? kRoundoffsGrad * u : kTolerance;
        struct Method {
            const char* name;
            bool grads;  // whether its backward ran
            double l_tol;
            const T *O;
            const float* L;
            const T *dQ, *dK, *dV;
        };
        std::vector<Method> methods = {{"flash", backward, l_tol, t.O, t.L, t.dQ, t.dK, t.dV}};
        if (r.std_fwd.ran)
            methods.push_back({"standard", r.std_bwd.ran, l_tol + kRoundoffsO * u * scale_of(l),
                               t.Os, t.Ls, t.dQs, t.dKs, t.dVs});
        for (const Method& m : methods) {
            printf("  %-8s head (b=%zu, h=%zu)", m.name, head / s.heads, head % s.heads);
            bool ok = true;
            auto report = [&](const char* what, const auto* device, size_t offset_per_head,
                              const std::vector<float>& ref, double tol) {
                const double err = max_error(device + head * offset_per_head, ref);
                printf("  %s %.1e%s", what, err, err <= tol ? "" : " (too large)");
                ok = ok && err <= tol;  // false for NaN
            };
            report("O", m.O, nq, o, o_tol);
            report("L", m.L, nl, l, m.l_tol);
            if (m.grads) {
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

// The forward tile actually used: with --tile only Bc, and so the shared memory, changes. That
// memory is rows of one padded length (dt.q_rows, dt.kv_rows), read off the chosen tile.
static FlashTile forward_tile(const cudaDeviceProp& prop, int dim, int tile_bc, const Dtype& dt) {
    FlashTile fwd = dt.tile(prop, dim);
    if (tile_bc > 0 && tile_bc != fwd.Bc) {
        auto rows = [&](int Bc) { return size_t(dt.q_rows) * fwd.Br + size_t(dt.kv_rows) * Bc; };
        fwd.shared_bytes = fwd.shared_bytes / rows(fwd.Bc) * rows(tile_bc);
        fwd.Bc = tile_bc;
    }
    return fwd;
}
// The tiles of one element type and head_dim. The backward's only where the backward runs: with
// --no-backward, a GPU whose shared memory is too small for the chapter-2 backward's tile (99 KB
// at head_dim 128 and 256) still runs.
static void print_tiles(const cudaDeviceProp& prop, int dim, int tile_bc, const Dtype& dt,
                        bool backward) {
    auto line = [&](const char* pass, const FlashTile& t, const char* origin) {
        printf("%s %s tile: Br %d, Bc %d, %d threads, %d threads/row, %.1f KiB shared (%s)\n",
               dt.name, pass, t.Br, t.Bc, t.threads, t.threads_per_row, t.shared_bytes / 1024.0,
               origin);
    };
    line("forward ", forward_tile(prop, dim, tile_bc, dt),
         tile_bc > 0 ? "Bc from --tile" : "chosen for this device");
    if (backward) line("backward", dt.tile_backward(prop, dim), "chosen for this device");
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

// dtype: fp32, fp16 or bf16. fp32_peak_tflops: the FP32 peak on every row; peak_tflops: the peak
// of the row's dtype (FP32, or dense 16-bit tensor with fp32 accumulate), which %peak divides by.
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
    fprintf(f, "%s,%d,%d,%d,%d,%d,%d", r.dtype->name, s.head_dim, s.heads, s.batch,
            s.q_len, s.kv_len, int(s.causal));
    num(r.flash_fwd.ms), num(r.flash_fwd.tflops), num(r.std_fwd.ms), num(r.std_fwd.tflops);
    speedup(r.flash_fwd, r.std_fwd);
    num(r.flash_fwd.extra_bytes / kMiB), num(r.std_fwd.extra_bytes / kMiB);
    num(r.flash_bwd.ms), num(r.flash_bwd.tflops), num(r.std_bwd.ms), num(r.std_bwd.tflops);
    speedup(r.flash_bwd, r.std_bwd);
    num(r.flash_bwd.extra_bytes / kMiB), num(r.std_bwd.extra_bytes / kMiB);
    num(r.std_fwd.needs_bytes / kMiB), num(r.std_bwd.needs_bytes / kMiB);
    num(r.fwd_diff), num(r.bwd_diff), num(peaks.fp32.tflops), num(peaks.of(*r.dtype).tflops);
    fprintf(f, "\n");
    fflush(f);
}

// One markdown table of one dtype's rows; what did not run (--no-backward, say) reads "-".
static void print_markdown_summary(const std::vector<RowResult>& rows, const Dtype& dt,
                                   bool backward) {
    auto mib = [](const Measurement& m) {
        char buf[32] = "-";
        if (m.oom) snprintf(buf, sizeof buf, "OOM");
        else if (m.ran) snprintf(buf, sizeof buf, "%.0f", m.extra_bytes / kMiB);
        return std::string(buf);
    };
    printf("\n%s%s:\n\n", dt.name, backward ? "" : ", forward only (bwd columns: -)");
    printf("| head_dim | heads x batch | seq | causal | flash fwd ms | standard fwd ms "
           "| fwd speed-up | flash bwd ms | standard bwd ms | bwd speed-up "
           "| extra MiB flash fwd / bwd | extra MiB standard fwd / bwd |\n"
           "|---:|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const RowResult& r : rows) {
        if (r.dtype != &dt) continue;
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
        {"--dtype", "TYPE", false,
         "fp32 (default; chapter 1, CUDA cores), fp16 or bf16 (chapter 2, tensor\n"
         "                  cores); --protocol without it runs all three",
         [](Options& o, const char* v) {
             std::string names;
             for (const Dtype& d : kDtypes) {
                 if (strcmp(v, d.name) == 0) o.dtype = &d;
                 names += (names.empty() ? "" : ", ") + std::string(d.name);
             }
             if (o.dtype && strcmp(v, o.dtype->name) == 0) return std::string();
             return "needs one of " + names + ", got '" + v + "'";
         }},
        {"--tile", "BC", false,
         "keys per K/V tile Bc of the flash forward (default: chosen for the device;\n"
         "                  fp16 takes 32, 64, or 128 up to head_dim 64; bf16 takes none)",
         [](Options& o, const char* v) { return set_int(v, &o.tile_bc, 1); }},
        {"--repeat", "N", false,
         "timed runs per measurement, at least " + std::to_string(kMinTimedRuns) +
             " (default 20); the median is reported",
         [](Options& o, const char* v) { return set_int(v, &o.repeat, kMinTimedRuns); }},
        {"--protocol", nullptr, false,
         "the FlashAttention-2 benchmark: batch*seq = 16384, hidden 2048\n"
         "                  (head_dim 64 x 32 heads, 128 x 16 heads), seq 512..16384, causal\n"
         "                  0 and 1, fp32, fp16, then bf16 (--dtype picks one); the shape\n"
         "                  flags do not combine with it",
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
               "  Times flash attention against standard attention (cuBLAS + softmax kernels)\n"
               "  in fp32, fp16 or bf16. Default: one shape, timed, checked against the CPU\n"
               "  reference; exit 1 on FAIL.\n");
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
    // Checked once every flag is in: --dtype may come after --tile. (Which Bc a forward takes
    // is checked with the device, in dtypes_to_run.)
    if (opt.tile_bc > 0 && opt.dtype && !opt.dtype->bc_ok) {
        fprintf(stderr, "flash_bench: --tile: flash.h has no %s forward that takes a Bc\n",
                opt.dtype->name);
        return false;
    }
    if (opt.kv_seq == 0) opt.kv_seq = opt.seq;
    return true;
}

// The element types this run measures, in table order: --dtype's, or without it fp32 for the
// demo and each type for --protocol, less those this GPU or --tile cannot run (said here). Their
// tiles are chosen here, before anything is set up, so that what cannot run is refused now, not
// after minutes of protocol: a type --dtype names on a GPU too old for it (runtime_error), a
// --tile its forward does not take or whose tile does not fit (std::invalid_argument).
static std::vector<const Dtype*> dtypes_to_run(const Options& opt, const cudaDeviceProp& prop) {
    std::vector<const Dtype*> todo;
    for (const Dtype& d : kDtypes) {
        if (opt.dtype ? opt.dtype != &d : !opt.protocol && &d != kDtypes) continue;
        if (!opt.dtype && prop.major < d.min_major)
            printf("%s block skipped: it needs compute capability %d.0 or newer; this GPU is "
                   "%d.%d\n", d.name, d.min_major, prop.major, prop.minor);
        else if (!opt.dtype && opt.tile_bc > 0 && !d.bc_ok)
            printf("%s block skipped: no %s forward takes --tile's Bc\n", d.name, d.name);
        else todo.push_back(&d);
    }
    for (const Dtype* d : todo)
        for (int dim : {opt.protocol ? 64 : opt.dim, opt.protocol ? 128 : opt.dim}) {
            const size_t need = forward_tile(prop, dim, opt.tile_bc, *d).shared_bytes;
            char why[160] = "";
            if (opt.tile_bc > 0 && !d->bc_ok(opt.tile_bc, dim))
                snprintf(why, sizeof why, "the %s forward does not take it (--help)", d->name);
            else if (need > prop.sharedMemPerBlockOptin)
                snprintf(why, sizeof why, "%zu bytes of shared memory in %s; this device allows "
                         "%zu per block", need, d->name, size_t(prop.sharedMemPerBlockOptin));
            if (*why)
                throw std::invalid_argument("--tile " + std::to_string(opt.tile_bc) +
                                            " at head_dim " + std::to_string(dim) + ": " + why);
        }
    return todo;
}

// The cuBLAS handle, and the memory it takes: its workspace and what its first GEMMs load (one
// tiny GEMM of each element type this run measures). Measured once; the handle serves every row,
// and this memory is counted in the standard method's extra, the same in every type's rows: what
// one type's GEMM kernels add is below the measurement's granularity (on an H100 the demo reads
// 66 MiB in each of the three types).
static void create_cublas(Bench& b, const std::vector<const Dtype*>& todo) {
    const int n = 64;
    const size_t bytes = 3 * n * n * sizeof(float);  // A, B, C of any of the types
    void* tiny = nullptr;  // allocated outside the measurement: ours, not cuBLAS's
    FLASH_CUDA_CHECK(cudaMalloc(&tiny, bytes));
    FLASH_CUDA_CHECK(cudaMemset(tiny, 0, bytes));
    const size_t before = free_device_bytes();
    CUBLAS_CHECK(cublasCreate(&b.cublas));
    // Default math: plain FP32 GEMMs for fp32. TF32 tensor-core math (CUBLAS_TF32_TENSOR_OP_MATH)
    // would be faster but rounds inputs to 10 mantissa bits; the fp32 baseline must be as exact as
    // flash (which is plain fp32), so TF32 stays off. fp16 and bf16 GEMMs use the tensor cores in
    // this mode.
    CUBLAS_CHECK(cublasSetMathMode(b.cublas, CUBLAS_DEFAULT_MATH));
    for (const Dtype* d : todo)
        std::visit([&](const auto& api) {
            using T = typename std::decay_t<decltype(api)>::Elem;
            T* m = static_cast<T*>(tiny);
            gemm_rowmajor(b.cublas, false, true, n, n, n, 1.f, m, 0, m + n * n, 0, m + 2 * n * n,
                          0, 1);
        }, d->api);
    b.cublas_bytes = std::max(0.0, double(before) - double(free_device_bytes()));
    FLASH_CUDA_CHECK(cudaFree(tiny));
}

// Before the listed rows of one head_dim: a tiny unlisted row of everything (the first call of a
// kernel loads its module, which would count as the first row's extra memory), and the header.
template <typename T>
static void begin_rows(const Bench& b, const Dtype& dt, int dim) {
    const AttentionShape tiny{1, 1, 128, 128, dim, true};
    Tensors<T> t;
    alloc_tensors(t, tiny, b.opt.standard, b.opt.backward, 99);
    bench_row(b, dt, tiny, t, 0, kMinTimedRuns);
    free_tensors(t);
    print_protocol_header();
}

// One listed row: measured on new tensors t (bench_row; t keeps them), printed, written to the
// CSV. budget_s: see time_median_ms.
template <typename T>
static RowResult list_row(const Bench& b, const Dtype& dt, const AttentionShape& s,
                          Tensors<T>& t, double budget_s) {
    alloc_tensors(t, s, b.opt.standard, b.opt.backward, 1000 + s.q_len);
    const RowResult r = bench_row(b, dt, s, t, budget_s, b.opt.repeat);
    print_pass(r, false, b.peaks.of(dt));
    if (b.opt.backward) print_pass(r, true, b.peaks.of(dt));
    if (b.csv) write_csv_row(b.csv, r, b.peaks);
    return r;
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
static int run_demo(const Bench& b, const Dtype& dt) {
    const Options& opt = b.opt;
    const FlashTile tile = forward_tile(b.prop, opt.dim, opt.tile_bc, dt);
    const int batch = opt.batch > 0 ? opt.batch : default_batch(b.prop, opt, tile);
    const AttentionShape s{batch, opt.heads, opt.seq, opt.kv_seq, opt.dim, opt.causal};
    validate_shape(s);
    printf("shape: batch %d, heads %d, q_len %d, kv_len %d, head_dim %d, causal %d, %s\n",
           s.batch, s.heads, s.q_len, s.kv_len, s.head_dim, int(s.causal), dt.name);
    const bool backward = opt.backward;
    print_tiles(b.prop, s.head_dim, opt.tile_bc, dt, backward);
    printf("timing: median of %d timed runs after warm-up (CUDA events)\n"
           "TFLOP/s counts 4 * head_dim FLOPs per (query, key) pair the mask lets through, per\n"
           "  head (2.5x that backward), for both methods; %%peak: of the %s, %.1f TFLOP/s\n"
           "flash runs on %s\n", opt.repeat, dt.peak_name, b.peaks.of(dt).tflops, dt.runs_on);
    begin_rows<T>(b, dt, s.head_dim);
    Tensors<T> t;
    const RowResult r = list_row(b, dt, s, t, 0);
    printf("extra memory = device memory beyond inputs and outputs, measured (cudaMemGetInfo\n"
           "  and the memory pool's high watermark, so rounded up to allocation granularity).\n"
           "  Expected:\n  flash forward 0");
    if (backward)
        printf("; flash backward %s = %.2f MiB", dt.bwd_scratch, dt.bwd_scratch_bytes(s) / kMiB);
    printf("\n");
    if (opt.standard)
        printf("  standard: S/P (B*H, q_len, kv_len) %s = %.1f MiB%s,\n"
               "  plus the cuBLAS handle's %.1f MiB\n", dt.name,
               double(l_elems(s)) * s.kv_len * sizeof(T) / kMiB,
               backward ? ", twice that in the backward (P and dP)" : "", b.cublas_bytes / kMiB);
    // The CPU reference is plain double-precision loops: past ~2^30 multiply-adds per head it
    // would take minutes, so large shapes are checked only against standard attention above.
    const double macs_per_head = double(s.q_len) * s.kv_len * s.head_dim;
    const bool check = macs_per_head <= kMaxCheckMacs;
    if (!check)
        printf("CPU reference check skipped: %.1e multiply-adds per head is over %.1e "
               "(use a shorter --seq to check)\n", macs_per_head, kMaxCheckMacs);
    const bool ok = !check || check_against_reference(r, t);
    free_tensors(t);
    printf("%s\n", !check ? "NOT CHECKED" : ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
}

// The protocol's rows of one element type, appended to rows.
template <typename T>
static void run_protocol_block(const Bench& b, const Dtype& dt, std::vector<RowResult>& rows) {
    const Options& opt = b.opt;
    const int hidden = 2048;  // head_dim * heads: 64 x 32 and 128 x 16
    const int seqs[] = {512, 1024, 2048, 4096, 8192, 16384};
    const int tokens = 16384;  // batch * seq
    const double budget_s = 1.0;  // per measurement: large rows time 10 runs, not opt.repeat
    const bool backward = opt.backward;
    printf("\n==== %s: FlashAttention-2 protocol: batch * seq = %d, hidden %d, %s%s\n",
           dt.name, tokens, hidden, opt.standard ? "flash vs standard attention" : "flash only",
           backward ? ", forward and backward" : ", forward only");
    printf("times: median of %d..%d timed runs after warm-up (CUDA events); extra = device memory "
           "beyond inputs and outputs (MiB); %%peak: of the %s, %.1f TFLOP/s\n",
           kMinTimedRuns, opt.repeat, dt.peak_name, b.peaks.of(dt).tflops);
    for (int dim : {64, 128}) {
        const int heads = hidden / dim;
        printf("\nhead_dim %d, %d heads:\n", dim, heads);
        print_tiles(b.prop, dim, opt.tile_bc, dt, backward);
        begin_rows<T>(b, dt, dim);
        auto run_row = [&](const AttentionShape& s) {
            Tensors<T> t;
            rows.push_back(list_row(b, dt, s, t, budget_s));
            free_tensors(t);
        };
        for (int causal = 0; causal <= 1; ++causal)
            for (int seq : seqs) run_row({tokens / seq, heads, seq, seq, dim, causal == 1});
        // Past the protocol, the memory wall: batch 1 at twice the longest length. Standard
        // attention's (B*H, N, N) scores alone are then sizeof(T) * heads * N^2 bytes: in fp32
        // 128 GiB at 32 heads, which no 80 GB card holds; in fp16 and bf16 64 GiB, which may fit,
        // and twice that for its backward (P and dP), which no 80 GB card holds: an OOM row.
        // Flash attention still needs no more than O(B*H*N).
        run_row({1, heads, 2 * tokens, 2 * tokens, dim, false});
    }
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
        printf("FP16 and BF16 tensor peak (dense, fp32 accumulate): %.1f TFLOP/s, computed the "
               "same way: %d SMs x %d FLOP/clock/SM%s x %.3f GHz\n",
               peaks.tensor.tflops, prop.multiProcessorCount, peaks.tensor.flops_per_clock,
               peaks.tensor.known ? "" : assumed, peaks.tensor.ghz);
        const std::vector<const Dtype*> todo = dtypes_to_run(opt, prop);

        FILE* csv = nullptr;
        if (!opt.csv.empty()) {
            csv = fopen(opt.csv.c_str(), "w");
            if (!csv) throw std::runtime_error("cannot write " + opt.csv + ": " + strerror(errno));
            fprintf(csv, "%s\n", kCsvHeader);
        }
        Bench b{opt, prop, peaks, csv};
        create_cublas(b, todo);
        int rc = 0;
        std::vector<RowResult> rows;  // the protocol's, for its summary tables
        for (const Dtype* d : todo)  // the demo has one
            std::visit([&](const auto& api) {
                using T = typename std::decay_t<decltype(api)>::Elem;
                if (opt.protocol) run_protocol_block<T>(b, *d, rows);
                else rc = run_demo<T>(b, *d);
            }, d->api);
        for (const Dtype* d : todo)
            if (opt.protocol) print_markdown_summary(rows, *d, opt.backward);
        CUBLAS_CHECK(cublasDestroy(b.cublas));
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
