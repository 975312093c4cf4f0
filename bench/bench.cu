// bench.cu: flash_bench, the demo and the benchmark. It measures the time and the memory of flash
// attention against standard attention done the way frameworks do it (standard.cu: cuBLAS GEMMs
// around a softmax kernel, with the whole (q_len, kv_len) score matrix of every head in device
// memory), in fp32 (chapter 1, flash.cu, on the CUDA cores), fp16 or bf16 (chapter 2,
// flash_fp16.cu, on the tensor cores; at head_dim 128 and 256 its backward needs 121 and 142.5 KiB
// of shared memory a block at least: A100, H100).
//
// Build and run:  make flash_bench && ./flash_bench   (make run: the demo, one shape, timed and
//                 checked against the CPU reference; exit 1 on FAIL, 77 without a GPU)
//   by hand, from the repository root, chapters 1 and 2 (chapter 3 needs an nvcc line of its own
//   for sm_90a, which the Makefile has; FLASH_NO_HOPPER says it is left out):
//                 nvcc -O3 -std=c++17 -arch=native -I. -Ilib -DFLASH_NO_HOPPER bench/bench.cu
//                 bench/standard.cu flash.cu flash_fp16.cu lib/checks.cpp lib/dispatch.cpp
//                 reference.cpp -lcublas -o flash_bench
//   one shape:    ./flash_bench --batch 2 --heads 16 --seq 4096 --dim 128 --causal 0 --tile 32
//                 (--tile forces keys per tile Bc; --dtype bf16 takes none)
//   the protocol: ./flash_bench --protocol --csv bench.csv   (make bench: FlashAttention-2's,
//                 fp32, fp16 then bf16; --dtype runs one alone), then its plot (make plot):
//                 gnuplot -e "csv='bench.csv'; out='bench.png'" bench/plot.gp
//   every flag:   ./flash_bench --help
//
// In order: the element types (a row each of kDtypes; the code after it is one for all three),
// the command line, device buffers, measuring, one shape (bench_row), reporting, the runs. Each
// figure comes from one helper that both methods, both passes and all three types share, and
// says how: time_median_ms, forward_flops, MemProbe (extra memory), max_abs_diff (flash against
// standard), max_error (the demo's check against the CPU reference), device_peaks (%peak).

#include "checks.h"
#include "chapters.h"
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

// The exit status when there is no GPU to run on: 77, the status build tools read as "skipped"
// (make run says so in one line and succeeds; a script can tell it from a failure, 1).
constexpr int kExitNoGpu = 77;

// Every kernel launch is followed by this: a bad launch configuration only shows up here.
#define LAUNCH_CHECK() FLASH_CUDA_CHECK(cudaGetLastError())

static constexpr int kMinTimedRuns = 10;    // never report a median of fewer runs
static constexpr int kDefaultWaves = 8;     // the demo's batch fills the GPU this often
static constexpr int kRowThreads = 256;     // threads per block of the fill and diff kernels
static constexpr double kTolerance = 2e-4;  // max |gpu - ref| <= kTolerance * max(1, max|ref|)
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

// ---------------------------------------------------------------------------------------------
// The element types, as data.

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
    // Chapter 2's forward and backward whatever the GPU (--chapter2; the _ampere calls), so that
    // one Hopper times both chapters; nullptr for fp32 (chapter 1 has no other).
    decltype(forward) forward_ch2;
    decltype(backward) backward_ch2;
};

// One element type: what runs and how its results are read. `api`, its entry points, also names
// by its alternative the C++ type T that the templates below take (with_type).
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
     FlashApi<float>{flash_forward, flash_forward_bc, flash_backward, nullptr, nullptr}},
    {"fp16", "its tensor cores (fp16 mma.sync, fp32 sums)", 8, true, "FP16 tensor peak", 11, 1, 4,
     flash_choose_tile_fp16, flash_choose_tile_fp16_backward,
     [](int bc, int d) { return bc == 32 || bc == 64 || (bc == 128 && d <= 64); },
     "dQ in fp32, D, turn counters", flash_backward_fp16_scratch_bytes,
     FlashApi<__half>{flash_forward_fp16, flash_forward_fp16_bc, flash_backward_fp16,
                      flash_forward_fp16_ampere, flash_backward_fp16_ampere}},
    {"bf16", "its tensor cores (bf16 mma.sync, fp32 sums)", 8, true, "BF16 tensor peak", 8, 1, 4,
     flash_choose_tile_fp16, flash_choose_tile_fp16_backward, nullptr,
     "dQ in fp32, D, turn counters", flash_backward_fp16_scratch_bytes,
     FlashApi<__nv_bfloat16>{flash_forward_bf16, nullptr, flash_backward_bf16,
                             flash_forward_bf16_ampere, flash_backward_bf16_ampere}},
};

// Calls f(T{}) with dt's C++ element type T, so that f can instantiate its templates at T.
template <typename F>
static void with_type(const Dtype& dt, const F& f) {
    std::visit([&](const auto& api) { f(typename std::decay_t<decltype(api)>::Elem{}); }, dt.api);
}

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

// ---------------------------------------------------------------------------------------------
// The command line: one table of flags, which parse_args reads and --help prints.

struct Options {
    int batch = 0;  // 0: derived from the device (default_batch)
    int heads = 16, seq = 2048, kv_seq = 0, dim = 64;  // kv_seq 0: = seq
    int kv_heads = 0;  // K/V heads (grouped-query attention); 0: = heads
    bool causal = true;
    int tile_bc = 0, repeat = 20;  // tile_bc 0: the device-derived Bc
    bool protocol = false, standard = true, backward = true;
    bool chapter2 = false;  // --chapter2: the _ampere calls, chapter 2 on any GPU
    const Dtype* dtype = nullptr;  // --dtype; without it the demo runs fp32, --protocol each type
    std::string csv;
};

using IntOption = int Options::*;  // named: nvcc warns on a field declared as a bare one

// One flag. An integer flag names its option (`number`, at least `minimum`); `set` does what any
// other flag does, or checks the integer further, and returns why it refuses the value, or "".
struct Flag {
    const char* name;
    const char* value;  // the value's name in --help, or nullptr: a switch, which takes none
    bool shape;         // part of the shape, which --protocol fixes itself
    std::string help;
    IntOption number = nullptr;
    int minimum = 1;
    std::string (*set)(Options& opt, const char* value) = nullptr;
};

static const std::vector<Flag>& flags() {
    static const std::vector<Flag> table = {
        {"--batch", "N", true,
         "batch size (default: enough for " + std::to_string(kDefaultWaves) +
             " full waves of forward blocks on this GPU)", &Options::batch},
        {"--heads", "N", true, "heads (default 16)", &Options::heads},
        {"--seq", "N", true, "query length q_len (default 2048)", &Options::seq},
        {"--kv-seq", "N", true, "key/value length kv_len (default: --seq)", &Options::kv_seq},
        {"--kv-heads", "N", true,
         "K/V heads, a divisor of --heads (grouped-query attention; 1: multi-query;\n"
         "                  default: --heads); no standard baseline then (it has none)",
         &Options::kv_heads},
        {"--dim", "N", true, "head_dim, one of " + flash_head_dims_string() + " (default 64)",
         &Options::dim, 1, [](Options& o, const char* v) {
             if (flash_head_dim_supported(o.dim)) return std::string();
             return std::string(v) + " is not supported (supported: " +
                    flash_head_dims_string() + ")";
         }},
        {"--causal", "0|1", true, "bottom-right causal mask (default 1)", nullptr, 0,
         [](Options& o, const char* v) {
             if (strcmp(v, "0") != 0 && strcmp(v, "1") != 0)
                 return "needs 0 or 1, got '" + std::string(v) + "'";
             o.causal = v[0] == '1';
             return std::string();
         }},
        {"--dtype", "TYPE", false,
         "fp32 (default; chapter 1, CUDA cores), fp16 or bf16 (chapter 2, tensor\n"
         "                  cores); --protocol without it runs all three", nullptr, 0,
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
         &Options::tile_bc},
        {"--repeat", "N", false,
         "timed runs per measurement, at least " + std::to_string(kMinTimedRuns) +
             " (default 20); the median is reported", &Options::repeat, kMinTimedRuns},
        {"--protocol", nullptr, false,
         "the FlashAttention-2 benchmark: batch*seq = 16384, hidden 2048\n"
         "                  (head_dim 64 x 32 heads, 128 x 16 heads), seq 512..16384, causal\n"
         "                  0 and 1, fp32, fp16, then bf16 (--dtype picks one); the shape\n"
         "                  flags do not combine with it", nullptr, 0,
         [](Options& o, const char*) { o.protocol = true; return std::string(); }},
        {"--csv", "FILE", false, "also write the rows as CSV to FILE (for plot.gp)", nullptr, 0,
         [](Options& o, const char* v) {
             o.csv = v;
             return std::string(*v ? "" : "needs a file name");
         }},
        {"--no-standard", nullptr, false, "skip the standard-attention baseline", nullptr, 0,
         [](Options& o, const char*) { o.standard = false; return std::string(); }},
        {"--no-backward", nullptr, false, "skip the backward pass", nullptr, 0,
         [](Options& o, const char*) { o.backward = false; return std::string(); }},
        {"--chapter2", nullptr, false,
         "fp16, bf16: chapter 2's kernels (the _ampere calls) even where chapter 3\n"
         "                  runs (compute capability 9.0), to time the two side by side", nullptr, 0,
         [](Options& o, const char*) { o.chapter2 = true; return std::string(); }},
    };
    return table;
}

static void usage(FILE* f) {
    fprintf(f, "usage: flash_bench [options]\n"
               "  Times flash attention against standard attention (cuBLAS + softmax kernels)\n"
               "  in fp32, fp16 or bf16. Default: one shape, timed, checked against the CPU\n"
               "  reference; exit 1 on FAIL, or where no GPU is found.\n");
    for (const Flag& flag : flags()) {
        const std::string name = flag.name + (flag.value ? std::string(" ") + flag.value : "");
        fprintf(f, "  %-15s %s\n", name.c_str(), flag.help.c_str());
    }
    fprintf(f, "  %-15s %s\n", "--help", "this message");
}

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
        std::string why = flag->number ? set_int(value, &(opt.*flag->number), flag->minimum) : "";
        if (why.empty() && flag->set) why = flag->set(opt, value);
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
    // Standard attention (standard.cu) reads one K/V head a query head: grouped heads run flash
    // alone (run_demo says so).
    if (opt.kv_heads != 0 && opt.kv_heads != opt.heads) opt.standard = false;
    return true;
}

// ---------------------------------------------------------------------------------------------
// Device buffers: random inputs, each method's outputs, and the largest difference of two.

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

static int grid_stride_blocks(size_t n) {
    return int(std::min<size_t>((n + kRowThreads - 1) / kRowThreads, 65536));
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

// One method's outputs: O and L (fp32 in both chapters), and the gradients where the backward runs.
template <typename T>
struct Outputs {
    T *O = nullptr, *dQ = nullptr, *dK = nullptr, *dV = nullptr;
    float* L = nullptr;
};

// The device buffers of one shape: the inputs, and the outputs of each method (the backward's
// only when it runs, standard attention's only when it does).
template <typename T>
struct Tensors {
    T *Q = nullptr, *K = nullptr, *V = nullptr, *dO = nullptr;
    Outputs<T> flash, standard;
    unsigned int* scratch = nullptr;  // for max_abs_diff
};

template <typename T>
static void alloc_tensors(Tensors<T>& t, const AttentionShape& s, bool standard, bool backward,
                          uint64_t seed) {
    const size_t nq = q_elems(s), nkv = kv_elems(s), nl = l_elems(s);
    Outputs<T> &f = t.flash, &st = t.standard;
    auto alloc = [](auto** p, size_t n) { FLASH_CUDA_CHECK(cudaMalloc(p, n * sizeof(**p))); };
    alloc(&t.Q, nq), alloc(&t.K, nkv), alloc(&t.V, nkv), alloc(&f.O, nq), alloc(&f.L, nl);
    if (backward) alloc(&t.dO, nq), alloc(&f.dQ, nq), alloc(&f.dK, nkv), alloc(&f.dV, nkv);
    if (standard) alloc(&st.O, nq), alloc(&st.L, nl);
    if (standard && backward) alloc(&st.dQ, nq), alloc(&st.dK, nkv), alloc(&st.dV, nkv);
    alloc(&t.scratch, 1);
    auto fill = [](T* x, size_t n, uint64_t x_seed) {
        fill_normal_kernel<T><<<grid_stride_blocks(n), kRowThreads>>>(x, n, x_seed);
        LAUNCH_CHECK();
    };
    fill(t.Q, nq, seed + 1), fill(t.K, nkv, seed + 2), fill(t.V, nkv, seed + 3);  // (B, H, N|M, d)
    if (backward) fill(t.dO, nq, seed + 4);
}

template <typename T>
static void free_tensors(Tensors<T>& t) {
    const Outputs<T> &f = t.flash, &st = t.standard;
    void* const all[] = {t.Q,  t.K,  t.V,  t.dO,  f.O,   f.L,   f.dQ,     f.dK,
                         f.dV, st.O, st.L, st.dQ, st.dK, st.dV, t.scratch};
    for (void* p : all) FLASH_CUDA_CHECK(cudaFree(p));  // cudaFree(nullptr): a no-op
    t = Tensors<T>{};
}

// ---------------------------------------------------------------------------------------------
// Measuring: time, memory, FLOPs, peaks, and errors against the CPU reference.

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

static size_t free_device_bytes() {
    size_t free_b = 0, total_b = 0;
    FLASH_CUDA_CHECK(cudaDeviceSynchronize());  // let frees and pool trimming land first
    FLASH_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return free_b;
}

// The one memory helper: a method's extra device memory (beyond the inputs and outputs it is
// given) from the probe's construction to extra(). The sum of three measurements:
//  (a) free memory (cudaMemGetInfo) then minus free memory after a synchronize: the workspace
//      allocated in between (standard: the score buffers) and what the calls leave allocated,
//      less what the library's pool newly reserved (it keeps that for later calls; (c) counts
//      what a call used of it);
//  (b) the growth of the device's stream-ordered memory pool: its reserved-memory high watermark
//      minus what it holds at the end (memory taken with cudaMallocAsync and given back inside a
//      call, which (a) cannot see);
//  (c) the used-memory high watermark of the library's pool (flash.h: flash_release_scratch),
//      from which the flash calls take their scratch (fp32 backward: D; fp16, bf16:
//      flash_backward_fp16_scratch_bytes; chapter 3's forward: its tile counter) and give it back
//      inside the call: the bytes they asked for, not rounded up.
// Not seen: memory a call takes with plain cudaMalloc and frees before it returns. Free memory
// is per device, so another process allocating meanwhile would show up; granularity is ~2 MiB.
struct MemProbe {
    cudaMemPool_t pool = nullptr;  // the device's default pool; null when there are no pools
    cudaMemPool_t kept = nullptr;  // the library's (flash_kept_pool)
    size_t free_before = 0;
    uint64_t kept_before = 0;      // what the library's pool had reserved at the start

    MemProbe() {
        // First synchronize (inside free_device_bytes), so that the pool has trimmed itself
        // before its watermark restarts; nothing runs between the two readings.
        free_before = free_device_bytes();
        int dev = 0, pools = 0;
        FLASH_CUDA_CHECK(cudaGetDevice(&dev));
        FLASH_CUDA_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, dev));
        if (!pools) return;
        FLASH_CUDA_CHECK(cudaDeviceGetMemPool(&pool, dev));  // the pool cudaMallocAsync uses
        kept = flash_kept_pool();
        uint64_t zero = 0;  // a high watermark can only be reset, by writing 0
        FLASH_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero));
        FLASH_CUDA_CHECK(cudaMemPoolSetAttribute(kept, cudaMemPoolAttrUsedMemHigh, &zero));
        FLASH_CUDA_CHECK(
            cudaMemPoolGetAttribute(kept, cudaMemPoolAttrReservedMemCurrent, &kept_before));
    }
    double extra() const {
        double extra = double(free_before) - double(free_device_bytes());  // (a)
        if (pool) {
            uint64_t high = 0, now = 0, kept_used = 0, kept_now = 0;
            FLASH_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &high));
            FLASH_CUDA_CHECK(
                cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &now));
            extra += std::max(0.0, double(high) - double(now));  // (b)
            FLASH_CUDA_CHECK(cudaMemPoolGetAttribute(kept, cudaMemPoolAttrUsedMemHigh, &kept_used));
            FLASH_CUDA_CHECK(
                cudaMemPoolGetAttribute(kept, cudaMemPoolAttrReservedMemCurrent, &kept_now));
            extra += double(kept_used) - (double(kept_now) - double(kept_before));  // (c)
        }
        return std::max(extra, 0.0);
    }
};

// The forward's FLOPs: S = QK^T and O = PV, 2 * 2 * head_dim per (query, key) pair the mask lets
// through. The backward's are 2.5 times that: S again, dV, dP, dQ, dK.
static double forward_flops(const AttentionShape& s) {
    double pairs = 0;
    for (int i = 0; i < s.q_len; ++i) pairs += visible_keys(i, s.q_len, s.kv_len, s.causal);
    return 4.0 * s.batch * s.heads * pairs * s.head_dim;
}

// FP32 lanes per SM: 128 from Maxwell (5.x) to Blackwell (10.x to 12.x), but 64 on P100 (6.0),
// Volta and Turing (7.x) and A100 (8.0). Anything else is assumed: 128.
static int fp32_lanes_per_sm(int major, int minor, bool* known) {
    *known = major >= 5 && major <= 12;
    return major == 7 || ((major == 6 || major == 8) && minor == 0) ? 64 : 128;
}

// Dense 16-bit tensor-core FLOPs per clock per SM with FP32 accumulate (flash_fp16.cu's mma,
// standard attention's CUBLAS_COMPUTE_32F GEMMs): each whitepaper's dense "peak FP16 Tensor
// TFLOPS with FP32 accumulate" / (SMs x the boost clock it is quoted at). BF16's is the same in
// each from 8.0 on (bf16 needs 8.0 here), so one rate serves fp16 and bf16.
//   7.0 V100: 1024 (8 tensor cores x 64 FMA; Volta whitepaper: 125 TFLOPS, 80 SMs, 1.53 GHz)
//   8.0 A100: 2048 (4 tensor cores x 256 FMA; A100 whitepaper: 312 TFLOPS, 108 SMs, 1.41 GHz)
//   8.6 GA10x, 8.9 Ada: 512, the GeForce rate, FP32 accumulate at half the FP16-accumulate rate
//       (GA102 whitepaper: RTX 3090 71 TFLOPS, 82 SMs, 1.695 GHz; Ada: RTX 4090 165.2, 128,
//       2.52). Their professional parts (RTX A6000, A40, A10, L40, L40S, RTX 6000 Ada) run the
//       full 1024: there %peak reads twice too high.
//   9.0 H100: 4096 (H100 whitepaper: 989.4 TFLOPS, SXM5, 132 SMs, 1.83 GHz), reached with wgmma
//       (which cuBLAS uses); flash_fp16.cu's mma.sync reaches only part of it.
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

// The peaks %peak divides by, in TFLOP/s: SMs x FLOPs per clock per SM x the maximum clock the
// device reports (whitepapers may quote tensor peaks at a lower boost clock, H100 SXM5: 1.83 GHz
// against the 1.98 GHz reported, so the tensor figure here can be a few percent above theirs).
struct Peaks {
    double fp32;    // FP32 FMAs on the CUDA cores: what chapter 1 runs on
    double tensor;  // dense FP16 or BF16 on the tensor cores, fp32 accumulate: chapter 2's
    double of(const Dtype& d) const { return d.tensor ? tensor : fp32; }
};

// Prints the device and its peaks, and returns the peaks.
static Peaks device_peaks(const cudaDeviceProp& prop, int dev) {
    int khz = 0;  // CUDA 13 dropped cudaDeviceProp::clockRate; the attribute remains
    FLASH_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev));
    bool known32 = false, known_tensor = false;  // false: assumed, not in the tables
    const int lanes = fp32_lanes_per_sm(prop.major, prop.minor, &known32);
    const int tensor = tensor_flops_per_clock(prop.major, prop.minor, &known_tensor);
    const int sms = prop.multiProcessorCount;
    auto tflops = [&](int per_clock) { return double(sms) * per_clock * khz * 1e3 * 1e-12; };
    const Peaks peaks{tflops(2 * lanes), tflops(tensor)};  // an FMA is 2 FLOPs
    const char* assumed = " (assumed: architecture not in the table)";
    printf("device: %s, %d SMs, compute capability %d.%d, %.1f GiB\n", prop.name, sms, prop.major,
           prop.minor, prop.totalGlobalMem / kGiB);
    printf("FP32 peak: %.1f TFLOP/s, computed from device properties: %d SMs x %d FP32 "
           "lanes/SM%s x 2 FLOP/FMA x %.3f GHz max clock\n",
           peaks.fp32, sms, lanes, known32 ? "" : assumed, khz * 1e-6);
    printf("FP16 and BF16 tensor peak (dense, fp32 accumulate): %.1f TFLOP/s, computed the "
           "same way: %d SMs x %d FLOP/clock/SM%s x %.3f GHz\n",
           peaks.tensor, sms, tensor, known_tensor ? "" : assumed, khz * 1e-6);
    return peaks;
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

// The one validation helper: max |gpu - ref| over one head of a device tensor (ref.size()
// elements a head) against the CPU reference. Equal infinities agree (L = -inf on rows that see
// no key); anything else non-finite is a NaN error, which no tolerance passes.
template <typename T>
static double max_error(const T* device, size_t head, const std::vector<float>& ref) {
    const std::vector<float> got = copy_head(device, head, ref.size());
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

// ---------------------------------------------------------------------------------------------
// One shape: both methods measured the same way, and the demo's check of what they computed.

// One pass of one method: its time, throughput and extra memory, or why it did not run.
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

// Times and measures flash and standard attention, forward and backward (unless --no-backward),
// on one shape whose tensors t holds: `repeat` timed runs, or fewer within budget_s (see
// time_median_ms). Afterwards t holds each method's outputs.
template <typename T>
static RowResult bench_row(const Bench& b, const Dtype& dt, const AttentionShape& s,
                           Tensors<T>& t, double budget_s, int repeat) {
    const FlashApi<T>& api = std::get<FlashApi<T>>(dt.api);
    const bool backward = b.opt.backward;
    if (b.opt.chapter2 && !api.forward_ch2)
        throw std::invalid_argument("--chapter2 needs --dtype fp16 or bf16 (fp32 is chapter 1)");
    const bool ch2 = b.opt.chapter2;
    const double fwd_flops = forward_flops(s), bwd_flops = 2.5 * fwd_flops;
    Outputs<T> &f = t.flash, &st = t.standard;
    RowResult r;
    r.shape = s;
    r.dtype = &dt;
    // Every pass: one call, its extra memory since `probe` began (plus add_bytes), then its time.
    auto measure = [&](Measurement& m, const MemProbe& probe, double flops, double add_bytes,
                       const auto& call) {
        call();
        m.extra_bytes = probe.extra() + add_bytes;
        m.ran = true;
        m.ms = time_median_ms(call, repeat, budget_s);
        m.tflops = flops / (m.ms * 1e-3) * 1e-12;
    };
    measure(r.flash_fwd, MemProbe(), fwd_flops, 0, [&] {  // it leaves O, L for the backward
        if (b.opt.tile_bc > 0) api.forward_bc(t.Q, t.K, t.V, f.O, f.L, s, b.opt.tile_bc, 0);
        else if (ch2) api.forward_ch2(t.Q, t.K, t.V, f.O, f.L, s, 0);
        else api.forward(t.Q, t.K, t.V, f.O, f.L, s, 0);
        LAUNCH_CHECK();
    });
    if (backward)
        measure(r.flash_bwd, MemProbe(), bwd_flops, 0, [&] {
            (ch2 ? api.backward_ch2 : api.backward)(t.Q, t.K, t.V, f.O, t.dO, f.L, f.dQ, f.dK, f.dV,
                                                     s, 0);
            LAUNCH_CHECK();
        });
    if (!b.opt.standard) return r;

    // Standard attention's extra: its score buffers, and the cuBLAS handle's memory (measured
    // once). The backward's counts from the same probe: it needs the forward's P alive, plus dP.
    const size_t score_elems = l_elems(s) * size_t(s.kv_len);  // S/P: (B*H, q_len, kv_len)
    r.std_fwd.needs_bytes = double(score_elems) * sizeof(T);
    if (backward) r.std_bwd.needs_bytes = 2 * r.std_fwd.needs_bytes;  // P and dP
    // cudaMalloc where out of memory is an answer, not an error: the memory wall is reported.
    auto try_alloc = [&](T** p) {
        const cudaError_t err = cudaMalloc(p, score_elems * sizeof(T));
        if (err == cudaErrorMemoryAllocation) {
            (void)cudaGetLastError();  // clear it, so the next check does not see it
            *p = nullptr;
            return false;
        }
        FLASH_CUDA_CHECK(err);
        return true;
    };
    T *P = nullptr, *dP = nullptr;
    const MemProbe probe;
    if (!try_alloc(&P)) {
        r.std_fwd.oom = true;
        r.std_bwd.oom = backward;
        return r;
    }
    measure(r.std_fwd, probe, fwd_flops, b.cublas_bytes,
            [&] { standard_forward(b.cublas, t.Q, t.K, t.V, P, st.O, st.L, s); });
    r.fwd_diff = max_abs_diff(f.O, st.O, q_elems(s), t.scratch);
    if (backward && !try_alloc(&dP)) {
        r.std_bwd.oom = true;
    } else if (backward) {
        measure(r.std_bwd, probe, bwd_flops, b.cublas_bytes, [&] {
            standard_backward(b.cublas, t.Q, t.K, t.V, t.dO, P, dP, st.dQ, st.dK, st.dV, s);
        });
        const float dq = max_abs_diff(f.dQ, st.dQ, q_elems(s), t.scratch);
        const float dk = max_abs_diff(f.dK, st.dK, kv_elems(s), t.scratch);
        const float dv = max_abs_diff(f.dV, st.dV, kv_elems(s), t.scratch);
        r.bwd_diff = std::isnan(dq) || std::isnan(dk) || std::isnan(dv) ? NAN
                                                                      : std::max({dq, dk, dv});
    }
    FLASH_CUDA_CHECK(cudaFree(dP));
    FLASH_CUDA_CHECK(cudaFree(P));
    return r;
}

// Checks the first and the last (batch, head) of each method that ran against the CPU
// reference, run on those heads alone (a batch = 1, heads = 1 shape on the slices; in fp16 and
// bf16 on their inputs widened exactly to float, so only the GPU's own rounding is measured).
// The reference's backward runs from its own O and L, on the same dO. Tolerances: kTolerance,
// kRoundoffsO, kRoundoffsGrad. Prints one line per head and method; returns whether all passed.
template <typename T>
static bool check_against_reference(const RowResult& r, const Tensors<T>& t) {
    const AttentionShape& s = r.shape;
    const Dtype& dt = *r.dtype;
    const double u = dt.bits > 0 ? std::ldexp(1.0, -dt.bits) : 0;  // 0: fp32, kTolerance's rule
    const bool backward = r.flash_bwd.ran;
    const size_t bh = size_t(s.batch) * s.heads, d = s.head_dim;
    const size_t nq = size_t(s.q_len) * d, nkv = size_t(s.kv_len) * d, nl = s.q_len;
    const size_t group = size_t(s.heads / flash_kv_heads(s));  // query heads a K/V head (GQA)
    AttentionShape one = s;
    one.batch = one.heads = 1;
    one.kv_heads = 0;
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
        // Query head `head` reads K/V head head / group (b H + h -> b H_kv + h / group).
        const auto q = copy_head(t.Q, head, nq), k = copy_head(t.K, head / group, nkv);
        const auto v = copy_head(t.V, head / group, nkv);
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
        for (bool standard : {false, true}) {
            if (standard && !r.std_fwd.ran) continue;
            const Outputs<T>& m = standard ? t.standard : t.flash;
            printf("  %-8s head (b=%zu, h=%zu)", standard ? "standard" : "flash", head / s.heads,
                   head % s.heads);
            bool ok = true;
            auto report = [&](const char* what, double err, double tol) {
                printf("  %s %.1e%s", what, err, err <= tol ? "" : " (too large)");
                ok = ok && err <= tol;  // false for NaN
            };
            report("O", max_error(m.O, head, o), o_tol);
            report("L", max_error(m.L, head, l),
                   standard ? l_tol + kRoundoffsO * u * scale_of(l) : l_tol);
            if (standard ? r.std_bwd.ran : backward) {
                report("dQ", max_error(m.dQ, head, dq), grad_rel * scale_of(dq));
                if (group == 1) {  // grouped: dK, dV sum the group (test_flash "[gqa]" checks)
                    report("dK", max_error(m.dK, head, dk), grad_rel * scale_of(dk));
                    report("dV", max_error(m.dV, head, dv), grad_rel * scale_of(dv));
                }
            }
            printf("  %s\n", ok ? "ok" : "FAIL");
            all_ok = all_ok && ok;
        }
    }
    return all_ok;
}

// ---------------------------------------------------------------------------------------------
// Reporting: the tiles, the listing (a line a pass), the CSV, the summary tables.

// The tiles of one element type and head_dim; the backward's only where it runs, so that with
// --no-backward a GPU too small for chapter 2's backward tile (99 KB at d 128, 256) still runs.
static void print_tiles(const cudaDeviceProp& prop, int dim, int tile_bc, const Dtype& dt,
                        bool backward) {
    auto line = [&](const char* pass, const FlashTile& t, const char* origin) {
        printf("%s %s tile: Br %d, Bc %d, %d threads, %d threads/row, %.1f KiB shared (%s)\n",
               dt.name, pass, t.Br, t.Bc, t.threads, t.threads_per_row, t.shared_bytes / 1024.0,
               origin);
    };
    // flash_forward_fp16 / _bf16 may run chapter 3; --tile runs chapter 2's _bc
    if (dt.tensor && tile_bc == 0 && flash_forward_runs_hopper(prop, dim))
        printf("%s forward  tile: chapter 3's kernel (flash_hopper.cu, NOTES.md section 17)\n",
               dt.name);
    else
        line("forward ", forward_tile(prop, dim, tile_bc, dt),
             tile_bc > 0 ? "Bc from --tile: chapter 2's kernel" : "chosen for this device");
    if (backward) line("backward", dt.tile_backward(prop, dim), "chosen for this device");
}

// "12.345" / "OOM (needs 32.0 GiB)" / "-" (not run), right-aligned in `width`.
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

static void print_listing_header() {
    printf("%4s %4s %5s %6s %4s %4s | %9s %8s %6s %9s | %9s %8s %6s %9s | %7s | %s\n", "d", "H",
           "B", "N", "caus", "pass", "flash ms", "TFLOP/s", "%peak", "extra MiB", "std ms",
           "TFLOP/s", "%peak", "extra MiB", "speedup", "max|flash-std|");
}

// One line of the listing: one pass (fwd or bwd, which ran) of one row; peak: its dtype's.
static void print_pass(const RowResult& r, bool backward, double peak) {
    const AttentionShape& s = r.shape;
    const Measurement& f = backward ? r.flash_bwd : r.flash_fwd;
    const Measurement& st = backward ? r.std_bwd : r.std_fwd;
    const double diff = backward ? r.bwd_diff : r.fwd_diff;
    auto method = [&](const Measurement& m) {
        if (m.ran)
            printf(" %s %8.2f %5.1f%% %9.1f |", fmt_ms(m, 9).c_str(), m.tflops,
                   100 * m.tflops / peak, m.extra_bytes / kMiB);
        else
            printf(" %-37s |", fmt_ms(m, 0).c_str());
    };
    if (!backward)
        printf("%4d %4d %5d %6d %4d  fwd |", s.head_dim, s.heads, s.batch, s.q_len, int(s.causal));
    else
        printf("%27s  bwd |", "");
    method(f);
    method(st);
    if (std::isfinite(diff)) printf(" %7s | %.1e\n", fmt_speedup(f, st).c_str(), diff);
    else printf(" %7s | -\n", fmt_speedup(f, st).c_str());
    fflush(stdout);  // a long protocol shows each row as it finishes
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
    auto pass = [&](const Measurement& flash, const Measurement& standard) {
        num(flash.ms), num(flash.tflops), num(standard.ms), num(standard.tflops);
        num(flash.ran && standard.ran ? standard.ms / flash.ms : NAN);
        num(flash.extra_bytes / kMiB), num(standard.extra_bytes / kMiB);
    };
    fprintf(f, "%s,%d,%d,%d,%d,%d,%d", r.dtype->name, s.head_dim, s.heads, s.batch,
            s.q_len, s.kv_len, int(s.causal));
    pass(r.flash_fwd, r.std_fwd);
    pass(r.flash_bwd, r.std_bwd);
    num(r.std_fwd.needs_bytes / kMiB), num(r.std_bwd.needs_bytes / kMiB);
    num(r.fwd_diff), num(r.bwd_diff), num(peaks.fp32), num(peaks.of(*r.dtype));
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

// ---------------------------------------------------------------------------------------------
// The runs: what to run, the cuBLAS handle, the listed rows, the demo, the protocol, main.

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

// The cuBLAS handle, and the memory it takes: its workspace and what its first GEMMs load (a
// tiny GEMM of each element type this run measures). Measured once and counted in the standard
// method's extra, the same in every type's rows: what one type's GEMM kernels add is below the
// measurement's granularity (on an H100 the demo reads 66 MiB in each of the three types).
static void create_cublas(Bench& b, const std::vector<const Dtype*>& todo) {
    const int n = 64;
    const size_t bytes = 3 * n * n * sizeof(float);  // A, B, C of any of the types
    void* tiny = nullptr;  // allocated outside the measurement: ours, not cuBLAS's
    FLASH_CUDA_CHECK(cudaMalloc(&tiny, bytes));
    FLASH_CUDA_CHECK(cudaMemset(tiny, 0, bytes));
    const size_t before = free_device_bytes();
    CUBLAS_CHECK(cublasCreate(&b.cublas));
    // Default math: plain FP32 GEMMs, as exact as flash; TF32 (CUBLAS_TF32_TENSOR_OP_MATH) would
    // be faster but rounds inputs to 10 mantissa bits. fp16 and bf16 use the tensor cores in it.
    CUBLAS_CHECK(cublasSetMathMode(b.cublas, CUBLAS_DEFAULT_MATH));
    for (const Dtype* d : todo)
        with_type(*d, [&](auto elem) {
            auto* m = static_cast<decltype(elem)*>(tiny);
            gemm_rowmajor(b.cublas, false, true, n, n, n, 1.f, m, 0, m + n * n, 0, m + 2 * n * n,
                          0, 1);
        });
    b.cublas_bytes = std::max(0.0, double(before) - double(free_device_bytes()));
    FLASH_CUDA_CHECK(cudaFree(tiny));
}

// The rows of one head_dim, listed: first a tiny unlisted row of everything (the first call of
// a kernel loads its module, which would count as the first row's extra memory), the header,
// then each shape on new tensors: measured (bench_row), printed, written to the CSV and handed
// with its tensors to done(row, tensors) before they are freed. budget_s: see time_median_ms.
template <typename T, typename Done>
static void list_rows(const Bench& b, const Dtype& dt, const std::vector<AttentionShape>& shapes,
                      double budget_s, const Done& done) {
    Tensors<T> t;
    const AttentionShape tiny{1, 1, 128, 128, shapes[0].head_dim, true};
    alloc_tensors(t, tiny, b.opt.standard, b.opt.backward, 99);
    bench_row(b, dt, tiny, t, 0, kMinTimedRuns);
    free_tensors(t);
    print_listing_header();
    for (const AttentionShape& s : shapes) {
        alloc_tensors(t, s, b.opt.standard, b.opt.backward, 1000 + s.q_len);
        const RowResult r = bench_row(b, dt, s, t, budget_s, b.opt.repeat);
        print_pass(r, false, b.peaks.of(dt));
        if (b.opt.backward) print_pass(r, true, b.peaks.of(dt));
        if (b.csv) write_csv_row(b.csv, r, b.peaks);
        done(r, t);
        free_tensors(t);
    }
}

// The demo's default batch: the forward's grid (a block per Q tile per head) fills every slot of
// the GPU (SMs x resident blocks per SM, from the tile's shared memory and threads) kDefaultWaves
// times: one partial wave leaves SMs idle and reports a fraction of the kernel's speed. Says why.
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

// The demo: one shape, listed, then checked against the CPU reference. Returns the exit code.
template <typename T>
static int run_demo(const Bench& b, const Dtype& dt) {
    const Options& opt = b.opt;
    const FlashTile tile = forward_tile(b.prop, opt.dim, opt.tile_bc, dt);
    const int batch = opt.batch > 0 ? opt.batch : default_batch(b.prop, opt, tile);
    const AttentionShape s{batch, opt.heads, opt.seq, opt.kv_seq, opt.dim, opt.causal,
                           opt.kv_heads};
    validate_shape(s);
    printf("shape: batch %d, heads %d, q_len %d, kv_len %d, head_dim %d, causal %d, %s\n",
           s.batch, s.heads, s.q_len, s.kv_len, s.head_dim, int(s.causal), dt.name);
    const bool grouped = flash_kv_heads(s) != s.heads;
    if (grouped)
        printf("grouped-query attention: %d K/V heads, %d query heads each; no standard "
               "baseline (standard.cu reads a K/V head a query head); the CPU check covers O, L "
               "and dQ (dK, dV sum a group: test_flash \"[gqa]\" checks them)\n",
               flash_kv_heads(s), s.heads / flash_kv_heads(s));
    print_tiles(b.prop, s.head_dim, opt.tile_bc, dt, opt.backward);
    printf("timing: median of %d timed runs after warm-up (CUDA events)\n"
           "TFLOP/s counts 4 * head_dim FLOPs per (query, key) pair the mask lets through, per\n"
           "  head (2.5x that backward), for both methods; %%peak: of the %s, %.1f TFLOP/s\n"
           "flash runs on %s\n", opt.repeat, dt.peak_name, b.peaks.of(dt), dt.runs_on);
    // The CPU reference is plain double-precision loops: past ~2^30 multiply-adds per head it
    // would take minutes, so large shapes are checked only against standard attention.
    const double macs_per_head = double(s.q_len) * s.kv_len * s.head_dim;
    const bool check = macs_per_head <= kMaxCheckMacs;
    bool ok = true;
    list_rows<T>(b, dt, {s}, 0, [&](const RowResult& r, const Tensors<T>& t) {
        // The tensors themselves (what GQA shrinks): Q, O (and dO, dQ) at every query head; K, V
        // (and dK, dV) at the K/V heads; L.
        const double per_q = double(q_elems(s)) * sizeof(T);
        const double per_kv = double(kv_elems(s)) * sizeof(T);
        const int n = opt.backward ? 4 : 2;  // tensors of each kind
        printf("tensors: %.1f MiB: Q, O%s %.1f MiB each; K, V%s %.1f MiB each (%d K/V heads for "
               "%d query heads); L %.1f MiB\n",
               (n * (per_q + per_kv) + l_elems(s) * sizeof(float)) / kMiB,
               opt.backward ? ", dO, dQ" : "", per_q / kMiB, opt.backward ? ", dK, dV" : "",
               per_kv / kMiB, flash_kv_heads(s), s.heads, l_elems(s) * sizeof(float) / kMiB);
        printf("extra memory = device memory beyond inputs and outputs, measured (cudaMemGetInfo\n"
               "  and the memory pool's high watermark, so rounded up to allocation granularity)."
               "\n  Expected:\n  flash forward 0");
        if (opt.backward)
            printf("; flash backward %s = %.2f MiB", dt.bwd_scratch,
                   dt.bwd_scratch_bytes(s) / kMiB);
        printf("\n");
        if (opt.standard)
            printf("  standard: S/P (B*H, q_len, kv_len) %s = %.1f MiB%s,\n"
                   "  plus the cuBLAS handle's %.1f MiB\n", dt.name,
                   double(l_elems(s)) * s.kv_len * sizeof(T) / kMiB,
                   opt.backward ? ", twice that in the backward (P and dP)" : "",
                   b.cublas_bytes / kMiB);
        if (!check)
            printf("CPU reference check skipped: %.1e multiply-adds per head is over %.1e "
                   "(use a shorter --seq to check)\n", macs_per_head, kMaxCheckMacs);
        ok = !check || check_against_reference(r, t);
    });
    printf("%s\n", !check ? "NOT CHECKED" : ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
}

// The protocol's rows of one element type, appended to rows.
template <typename T>
static void run_protocol_block(const Bench& b, const Dtype& dt, std::vector<RowResult>& rows) {
    const Options& opt = b.opt;
    const int hidden = 2048;   // head_dim * heads: 64 x 32 and 128 x 16
    const int tokens = 16384;  // batch * seq
    printf("\n==== %s: FlashAttention-2 protocol: batch * seq = %d, hidden %d, %s%s\n",
           dt.name, tokens, hidden, opt.standard ? "flash vs standard attention" : "flash only",
           opt.backward ? ", forward and backward" : ", forward only");
    printf("times: median of %d..%d timed runs after warm-up (CUDA events); extra = device memory "
           "beyond inputs and outputs (MiB); %%peak: of the %s, %.1f TFLOP/s\n",
           kMinTimedRuns, opt.repeat, dt.peak_name, b.peaks.of(dt));
    for (int dim : {64, 128}) {
        const int heads = hidden / dim;
        printf("\nhead_dim %d, %d heads:\n", dim, heads);
        print_tiles(b.prop, dim, opt.tile_bc, dt, opt.backward);
        std::vector<AttentionShape> shapes;
        for (int causal = 0; causal <= 1; ++causal)
            for (int seq : {512, 1024, 2048, 4096, 8192, 16384})
                shapes.push_back({tokens / seq, heads, seq, seq, dim, causal == 1});
        // Past the protocol, the memory wall: batch 1 at twice the longest length. Standard
        // attention's scores alone are then sizeof(T) * heads * N^2 bytes, 128 GiB in fp32 at 32
        // heads; 64 GiB in fp16 and bf16, which may fit, but twice that for the backward (P and
        // dP) does not on an 80 GB card: an OOM row. Flash attention still needs O(B*H*N).
        shapes.push_back({1, heads, 2 * tokens, 2 * tokens, dim, false});
        // A budget of 1 s a measurement: the large rows time 10 runs, not --repeat.
        list_rows<T>(b, dt, shapes, 1.0,
                     [&](const RowResult& r, const Tensors<T>&) { rows.push_back(r); });
    }
}

// What this command line runs on the GPU, in words: for the line a machine without one gets.
static std::string what_would_run(const Options& opt) {
    if (opt.protocol)
        return std::string("the FlashAttention-2 benchmark protocol (") +
               (opt.dtype ? opt.dtype->name : "fp32, fp16 and bf16") + ")";
    char shape[200];
    snprintf(shape, sizeof shape, "%s flash attention %s, %s%d heads%s, seq %d%s, head_dim %d, "
             "causal %d", (opt.dtype ? opt.dtype : kDtypes)->name,
             opt.backward ? "forward and backward" : "forward",
             opt.batch ? ("batch " + std::to_string(opt.batch) + ", ").c_str() : "", opt.heads,
             opt.kv_heads ? (" (" + std::to_string(opt.kv_heads) + " K/V)").c_str() : "",
             opt.seq,
             opt.kv_seq != opt.seq ? (", kv_seq " + std::to_string(opt.kv_seq)).c_str() : "",
             opt.dim, int(opt.causal));
    return std::string("the demo (") + shape + ", timed" +
           (opt.standard ? " against standard attention" : "") +
           " and checked against the CPU reference)";
}

int main(int argc, char** argv) {
    Options opt;
    bool help = false;
    if (!parse_args(argc, argv, opt, &help) || help) {
        usage(help ? stdout : stderr);
        return help ? 0 : 2;
    }
    int devices = 0;
    const cudaError_t err = cudaGetDeviceCount(&devices);
    if (err == cudaSuccess ? devices == 0 : flash_no_gpu(err)) {  // a machine without a GPU
        fprintf(stderr, "flash_bench: no CUDA GPU or driver was found, so %s did not run; "
                "`make test` still runs the CPU tests\n", what_would_run(opt).c_str());
        return kExitNoGpu;
    }
    if (err != cudaSuccess) {  // a GPU the runtime cannot use, e.g. a driver older than it
        int driver = 0, runtime = 0;
        cudaDriverGetVersion(&driver);
        cudaRuntimeGetVersion(&runtime);
        fprintf(stderr, "flash_bench: cudaGetDeviceCount failed: %s (CUDA driver %d.%d, runtime "
                "%d.%d)\n", cudaGetErrorString(err), driver / 1000, driver % 1000 / 10,
                runtime / 1000, runtime % 1000 / 10);
        return 1;
    }
    try {
        int dev = 0;
        FLASH_CUDA_CHECK(cudaGetDevice(&dev));
        cudaDeviceProp prop;
        FLASH_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
        Bench b{opt, prop, device_peaks(prop, dev), nullptr};
        const std::vector<const Dtype*> todo = dtypes_to_run(opt, prop);
        if (!opt.csv.empty()) {
            if (!(b.csv = fopen(opt.csv.c_str(), "w")))
                throw std::runtime_error("cannot write " + opt.csv + ": " + strerror(errno));
            fprintf(b.csv, "%s\n", kCsvHeader);
        }
        create_cublas(b, todo);
        int rc = 0;
        std::vector<RowResult> rows;  // the protocol's, for its summary tables
        for (const Dtype* d : todo)  // the demo has one
            with_type(*d, [&](auto elem) {
                if (opt.protocol) run_protocol_block<decltype(elem)>(b, *d, rows);
                else rc = run_demo<decltype(elem)>(b, *d);
            });
        for (const Dtype* d : todo)
            if (opt.protocol) print_markdown_summary(rows, *d, opt.backward);
        CUBLAS_CHECK(cublasDestroy(b.cublas));
        if (b.csv && fclose(b.csv) != 0) throw std::runtime_error("cannot write " + opt.csv);
        if (b.csv) printf("wrote %s\n", opt.csv.c_str());
        return rc;
    } catch (const std::invalid_argument& e) {  // a shape or tile the library refuses
        fprintf(stderr, "flash_bench: %s\n", e.what());
        return 2;
    } catch (const std::exception& e) {
        fprintf(stderr, "flash_bench: error: %s\n", e.what());
        return 1;
    }
}
