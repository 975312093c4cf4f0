// test_util.h: what the test files share (Catch2 v2). Nothing here is a test: the tests are in
// test_flash.cpp (the classroom core), test_hardening.cpp, test_deadline.cpp (the GPU waits' deadline)
// and test_docs.cpp (README.md's figures);
// main() is in test_util.cpp.
//
//   Element types      float (chapter 1's tensors), __half and __nv_bfloat16 (chapter 2's, named
//                      fp16 and bf16 in its tests' type lists) and double (the reference): NaN
//                      and the conversion to float for each; Format16, what the tests need to
//                      know of each 16-bit type (its name, its API's names, its rounding)
//   Shapes, inputs     describe(), masked_rows(), seeds, random problems (fp32, and rounded to
//                      fp16 or bf16: rounded_problem<T>), the reference's outputs
//   Shape lists        the head dims (fp32's, chapter 2's), the forward and backward grids, the
//                      sanitizer's and the masking tests' shapes, the determinism shapes
//   Tolerances         fp32's error bounds, and chapter 2's forward's and backward's
//                      (tolerances16, backward_tolerances16: one derivation for fp16 and bf16,
//                      from the type's rounding), each with its derivation
//   Comparing          check_close (the one comparison every test uses), masked rows, bitwise;
//                      any element type's outputs against the reference run on its exact inputs
//                      (check_against_reference, ..._backward)
//   Device memory      DeviceBuffer<T> and GpuAttention<T>: upload, poison with NaN, run, download
//                      (T = float runs chapter 1's kernels, T = __half or __nv_bfloat16 chapter
//                      2's, through launch_forward<T> and launch_backward<T>); one random problem
//                      checked on the GPU; the same calls repeated, every call's outputs bitwise
//                      the first's
//   Which kernel       Kernel: the public call, chapter 2's, chapter 3's, or a caller-chosen Bc
//   Waiting            wait_for_gpu: every wait for the GPU, with a deadline scaled to the shape
//   Validation         refusal(), NamesWord, FakeTensors<T>: for the argument-validation tests
//   Tile chooser       four real GPUs' properties, and what every tile (fp32, chapter 2's forward
//                      and backward: one for both types) must satisfy
//   Big tensors        inputs built from a repeating pattern, checked one head at a time
//   Source files       the lines of a file of the project (NOTES.md, flash.cu, README.md, data/),
//                      for the [notes] and [readme] tests
//
// A test whose body is the same for every element type is one TEMPLATE_TEST_CASE over (fp32, fp16,
// bf16), tagged [fp32][fp16][bf16]; chapter 2's own tests are over (fp16, bf16), tagged
// [fp16][bf16]. A helper's "16" (tolerances16, kSafety16, u16) stands for either 16-bit type.
#pragma once

#include <catch2/catch.hpp>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "checks.h"
#include "chapters.h"
#include "flash.h"
#include "reference.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iomanip>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// =============================================================================================
// Element types. Every helper below that touches tensor elements goes through these, so that a
// new element type needs only its own versions of them.

// The element types, by the names the tests list them under: TEMPLATE_TEST_CASE(name, tags, fp32,
// fp16, bf16) runs the one body as "name - fp32", "name - fp16" and "name - bf16" (chapter 1's
// float, chapter 2's two 16-bit types).
using fp32 = float;
using fp16 = __half;
using bf16 = __nv_bfloat16;

// The element type's name, for messages: "fp32", "fp16" or "bf16"; and the API calls that take
// it, as their refusals name them.
template <typename T>
constexpr const char* type_name() {
    return std::is_same<T, float>::value ? "fp32" : std::is_same<T, __half>::value ? "fp16" : "bf16";
}
template <typename T>
constexpr const char* forward_api() {
    return std::is_same<T, float>::value    ? "flash_forward"
           : std::is_same<T, __half>::value ? "flash_forward_fp16"
                                            : "flash_forward_bf16";
}
template <typename T>
constexpr const char* backward_api() {
    return std::is_same<T, float>::value    ? "flash_backward"
           : std::is_same<T, __half>::value ? "flash_backward_fp16"
                                            : "flash_backward_bf16";
}

// The NaN that outputs are filled with before a kernel runs: an element still NaN afterwards was
// never written.
template <typename T>
T quiet_nan() {
    return std::numeric_limits<T>::quiet_NaN();
}
// fp16 and bf16 have NaN too: exponent all ones and a nonzero mantissa. The quiet one is 0x7E00
// in fp16, and 0x7FC0 in bf16 (fp32's 0x7FC00000 cut to its upper 16 bits).
template <>
inline __half quiet_nan<__half>() {
    return __half(__half_raw{0x7E00});
}
template <>
inline __nv_bfloat16 quiet_nan<__nv_bfloat16>() {
    return __nv_bfloat16(__nv_bfloat16_raw{0x7FC0});
}

// An element as a float, to compare and print. Exact for every element type: every fp16 value is
// a float, and so is every bf16 value (a float's upper 16 bits). The GPU's results come back to
// the host in this form.
inline float to_float(float x) { return x; }
inline float to_float(__half x) { return __half2float(x); }
inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// What the tests need to know of each 16-bit type T, fp16 or bf16 (one beside the other on each
// line): its name (for messages) and its rounding: `unit_roundoff`, the largest relative error of rounding a float to T
// (to nearest), and `tiny_weight_error`, the largest absolute error of a softmax weight too small
// for that relative bound. Both are derived under "Tolerances".
template <typename T>
struct Format16 {
    static constexpr bool bf = std::is_same<T, __nv_bfloat16>::value;
    static_assert(bf || std::is_same<T, __half>::value, "chapter 2's types: __half, __nv_bfloat16");
    static constexpr const char* name = bf ? "bf16" : "fp16";
    // 8 or 11 significant bits
    static constexpr double unit_roundoff = bf ? 1.0 / (1 << 8) : 1.0 / (1 << 11);
    // what ex2.approx.ftz flushes to 0 (2^-126), or half the spacing of fp16's subnormals (2^-25)
    static constexpr double tiny_weight_error = bf ? 0x1p-126 : 1.0 / (1 << 25);
};

// =============================================================================================
// Shapes and random inputs

// "shape (b=2, h=3, q_len=5, kv_len=7, d=16, causal=1)": how every failure names its shape
// (", kv_heads=1" before the ")" where the shape groups its K/V heads).
std::string describe(const AttentionShape& s);

// Rows at the top of each head that see no key: with causal masking and q_len > kv_len, query i
// sees key j iff j <= i + kv_len - q_len, so rows 0 .. q_len - kv_len - 1 see nothing.
int masked_rows(const AttentionShape& s);

// A seed of its own for every shape (and test), so every case gets fresh inputs, the same on
// every run.
uint32_t seed_of(const AttentionShape& s, uint32_t salt);

// Elements 2k and 2k + 1 of a tensor keyed by `key`, drawn from N(0, 1) by Box-Muller: two
// uniforms of 53 bits, u1 in (0, 1] and u2 in [0, 1), from splitmix64 of key + 2k and key + 2k + 1
// (a counter-based draw: it needs nothing but the key and k).
void normal_pair(uint64_t key, uint64_t k, double& z0, double& z1);
// n values drawn from N(0, 1): one draw of rng keys the tensor, then elements come in normal_pair's
// pairs, drawn in chunks on the reference's threads: the same values on any number of them, and
// on every run (the default run draws about 440 million values).
template <typename T>
std::vector<T> normal_values(size_t n, std::mt19937& rng) {
    constexpr size_t kChunk = size_t(1) << 16;  // (even: no pair across two chunks)
    const uint64_t key = uint64_t(rng()) << 32 | rng();
    std::vector<T> v(n);
    attention_reference_for_each((n + kChunk - 1) / kChunk, 10.0 * n, [&](size_t c) {
        const size_t end = std::min(n, (c + 1) * kChunk);
        for (size_t e = c * kChunk; e < end; e += 2) {
            double z0, z1;
            normal_pair(key, e / 2, z0, z1);
            v[e] = static_cast<T>(z0);
            if (e + 1 < end) v[e + 1] = static_cast<T>(z1);
        }
    });
    return v;
}

// One attention problem on the host: inputs and an upstream gradient dO, all random N(0, 1).
template <typename T>
struct Problem {
    AttentionShape s;
    std::vector<T> Q, K, V, dO;
};

// The problem of shape s for this salt: the same inputs on every run. with_dO = false leaves dO
// empty (a forward's test: drawn last, so Q, K and V are the same either way).
template <typename T = float>
Problem<T> random_problem(const AttentionShape& s, uint32_t salt, bool with_dO = true) {
    std::mt19937 rng(seed_of(s, salt));
    Problem<T> p{s, {}, {}, {}, {}};
    p.Q = normal_values<T>(q_elems(s), rng);
    p.K = normal_values<T>(kv_elems(s), rng);
    p.V = normal_values<T>(kv_elems(s), rng);
    if (with_dO) p.dO = normal_values<T>(q_elems(s), rng);
    return p;
}

// v with every element converted to To: float to __half or __nv_bfloat16 rounds to nearest;
// either to float or double, and float to double, are exact. In chunks on the reference's
// threads (each element converted alone: a plain loop's bits; a vector under a million elements
// in a plain loop): the default run converts about 1.6 billion elements.
template <typename To, typename From>
std::vector<To> converted(const std::vector<From>& v) {
    constexpr size_t kChunk = size_t(1) << 16;
    std::vector<To> out(v.size());
    const size_t n = v.size(), chunks = (n + kChunk - 1) / kChunk;
    attention_reference_for_each(chunks, double(n), [&](size_t c) {
        for (size_t e = c * kChunk; e < std::min(n, (c + 1) * kChunk); ++e)
            out[e] = static_cast<To>(v[e]);
    });
    return out;
}

// The same problem with every element converted to To (e.g. float inputs, exactly, in double).
template <typename To, typename From>
Problem<To> converted(const Problem<From>& p) {
    return {p.s, converted<To>(p.Q), converted<To>(p.K), converted<To>(p.V), converted<To>(p.dO)};
}

// The problem of shape s for this salt in element type T: random_problem's N(0, 1) floats, as
// they are for float (a copy), rounded to nearest for chapter 2's fp16 or bf16. The reference
// runs on these very values (converted<double>, exact), so the rounding of the inputs is no part
// of the error chapter 2's tests measure.
template <typename T>
Problem<T> rounded_problem(const AttentionShape& s, uint32_t salt, bool with_dO = true) {
    return converted<T>(random_problem(s, salt, with_dO));
}

// A problem's outputs on the host: the reference's (in float or double), or the GPU's (as float).
// The backward's tests fill dQ, dK and dV too.
template <typename T>
struct Outputs {
    std::vector<T> O, L, dQ, dK, dV;
};

// The CPU reference's O and L for p.
template <typename T>
Outputs<T> reference_forward(const Problem<T>& p) {
    Outputs<T> r;
    r.O.assign(q_elems(p.s), T(0));
    r.L.assign(l_elems(p.s), T(0));
    attention_reference(p.Q.data(), p.K.data(), p.V.data(), r.O.data(), r.L.data(), p.s);
    return r;
}

// The CPU reference's O, L, dQ, dK and dV for p.
template <typename T>
Outputs<T> reference_backward(const Problem<T>& p) {
    Outputs<T> r = reference_forward(p);
    r.dQ.assign(q_elems(p.s), T(0));
    r.dK.assign(kv_elems(p.s), T(0));
    r.dV.assign(kv_elems(p.s), T(0));
    attention_reference_backward(p.Q.data(), p.K.data(), p.V.data(), r.O.data(), p.dO.data(),
                                 r.L.data(), r.dQ.data(), r.dK.data(), r.dV.data(), p.s);
    return r;
}

// The largest |element|.
template <typename T>
double max_abs(const std::vector<T>& v) {
    double m = 0;
    for (T x : v) m = std::max(m, std::fabs(static_cast<double>(x)));
    return m;
}

// The largest Euclidean norm of a row of length d.
template <typename T>
double max_row_norm(const std::vector<T>& v, int d) {
    double m = 0;
    for (size_t r = 0; r < v.size() / size_t(d); ++r) {
        double sum = 0;
        for (int x = 0; x < d; ++x) sum += double(v[r * d + x]) * double(v[r * d + x]);
        m = std::max(m, std::sqrt(sum));
    }
    return m;
}

// =============================================================================================
// Shape lists, named once. The CPU reference costs about batch*heads * q_len * kv_len * head_dim,
// so the long sequences get one head only: the whole [gpu] suite's reference work stays a few
// seconds on one core (the hidden test [.timing] measures it).

// Every head dim with a kernel (flash.h's kFlashHeadDims), for GENERATE(from_range(kHeadDims)).
inline const std::vector<int> kHeadDims(std::begin(kFlashHeadDims), std::end(kFlashHeadDims));
// The same for chapter 2, forward and backward, fp16 and bf16 (kFlashFp16HeadDims).
inline const std::vector<int> kFp16HeadDims(std::begin(kFlashFp16HeadDims),
                                            std::end(kFlashFp16HeadDims));
// Chapter 3's (kFlashHopperHeadDims): the Hopper kernels' tests generate from it.
inline const std::vector<int> kHopperHeadDims(std::begin(kFlashHopperHeadDims),
                                              std::end(kFlashHopperHeadDims));

// The forward grid's lengths, each paired with itself: odd lengths, and the tile edges 32 and 256
// with a neighbour on each side (31, 33, 255, 257). Then unequal pairs on both sides: q_len <
// kv_len (the causal diagonal moves right) and q_len > kv_len (the leading rows see nothing),
// down to 1 against 1000.
inline const std::vector<int> kForwardLengths = {1, 17, 31, 32, 33, 100, 255, 256, 257, 1000};
inline const std::vector<std::pair<int, int>> kForwardUnequalLengths = {
    {1, 1000}, {1000, 1}, {17, 257}, {257, 17}, {33, 100}, {100, 31}, {255, 1000}, {1000, 256}};
// The backward grid's: the same kinds of length, fewer of them (the reference's backward costs
// three times its forward).
inline const std::vector<int> kBackwardLengths = {1, 17, 32, 33, 100, 257};
inline const std::vector<std::pair<int, int>> kBackwardUnequalLengths = {
    {1, 257}, {257, 1}, {17, 100}, {100, 17}, {31, 256}, {255, 33}};

// The head dims of T's chapter: kHeadDims for float, kFp16HeadDims for fp16 and bf16.
template <typename T>
const std::vector<int>& head_dims_of() {
    return std::is_same<T, float>::value ? kHeadDims : kFp16HeadDims;
}
// One value for float, another for fp16 and bf16 (e.g. a test's seed salt, which each type's
// test had before the types shared one body: the same inputs as then).
template <typename T, typename V>
V per_type(V fp32, V tensor_cores) {
    return std::is_same<T, float>::value ? fp32 : tensor_cores;
}

// Every (q_len, kv_len) pair in `lengths`, then causal off and on, then every head dim in
// `head_dims`; each pair with batch 1, heads 1, and again with batch 2, heads 3 where q_len *
// kv_len <= max_batched (the batched heads catch a kernel that reads the wrong head).
std::vector<AttentionShape> grid(const std::vector<std::pair<int, int>>& lengths,
                                 long long max_batched, const std::vector<int>& head_dims);
// The forward's grid (kForwardLengths, then kForwardUnequalLengths) and the backward's.
std::vector<AttentionShape> forward_grid(const std::vector<int>& head_dims);
std::vector<AttentionShape> backward_grid(const std::vector<int>& head_dims);

// The default run and `make stress` share the long lists: the default run (make test, every GPU
// test case not tagged [.stress]) takes a few shapes of each list that still run every kernel,
// type and feature (each head dim, causal and not, q_len below, at and above kv_len, batched heads,
// several tiles with a partial last one); the [.stress] twin of a test case takes the rest, with
// the same inputs (the same salt). `make stress` runs before a kernel change is called done.
enum class Share { fast, stress };
// The shapes of `all` in `share`: those whose (batch, heads, q_len, kv_len) is one of `fast`
// for Share::fast, the others for Share::stress.
std::vector<AttentionShape> share_of(const std::vector<AttentionShape>& all, Share share,
                                     const std::vector<std::array<int, 4>>& fast);
// The forward and backward grids' shares: the default run keeps 4 of their (batch, heads, q_len,
// kv_len): two equal lengths (33 batched; 257, several tiles), q_len < kv_len and q_len > kv_len
// (batched), at every head dim, causal and not.
std::vector<AttentionShape> forward_grid(const std::vector<int>& head_dims, Share share);
std::vector<AttentionShape> backward_grid(const std::vector<int>& head_dims, Share share);
// A long grid's share for element type T, from the grid's default share `fast` and the rest:
// Share::fast gives `fast` and Share::stress `rest`, but for bf16, which runs the kernel templates
// fp16 runs with another element type: its default run takes every fifth shape of `fast` (5 is
// prime to the grids' inner loops of 2, 4, 6 and 8 shapes, so the kept ones still reach every
// head dim, mask and group), its [.stress] twin the others of `fast`, then `rest`.
template <typename T>
std::vector<AttentionShape> share_for(const std::vector<AttentionShape>& fast,
                                      const std::vector<AttentionShape>& rest, Share share) {
    const bool bf = std::is_same<T, bf16>::value;
    std::vector<AttentionShape> shapes;
    for (size_t k = 0; k < fast.size(); ++k)
        if ((!bf || k % 5 == 0) == (share == Share::fast)) shapes.push_back(fast[k]);
    if (share == Share::stress) shapes.insert(shapes.end(), rest.begin(), rest.end());
    return shapes;
}

// The sanitizer's subset (`make sanitize` runs the [sanitize] tests under compute-sanitizer, which
// slows kernels 10-100x): small shapes that still cover odd and unequal lengths, a partial last
// tile, causal on and off, batched heads and every head dim in `head_dims`. grid() over
// (1, 1), (17, 33), (33, 17) and (n, n), every pair batched too.
std::vector<AttentionShape> sanitizer_shapes(const std::vector<int>& head_dims, int n);

// The masking tests' shapes: causal with q_len > kv_len (rows 0 .. q_len - kv_len - 1 of every
// head see no key: from one, 257 against 256, to 999, 1000 against 1), batch 2, heads 3, every
// head dim in `head_dims`.
std::vector<AttentionShape> masking_shapes(const std::vector<int>& head_dims);
// Its shares: the default run takes 100 against 17 and 257 against 256.
std::vector<AttentionShape> masking_shapes(const std::vector<int>& head_dims, Share share);

// The determinism tests' shapes: odd and unequal lengths, batched heads, causal on and off, every
// head dim once. long_kv_len is the kv_len of the one long case, (1, 2, 100, long_kv_len, 128).
std::vector<AttentionShape> determinism_shapes(int long_kv_len);

// =============================================================================================
// Tolerances: the fp32 kernels against the reference, which accumulates in double and so is
// exact to within its own float rounding of the results.
//
// fp32 rounds each operation with relative error at most u = 2^-24. Summing n rounded terms, the
// errors add up like sqrt(n) u when their signs are random (Rounding::random: random inputs) and
// up to n u when they line up (Rounding::aligned: the hardening tests' identical rows and entries,
// where every partial sum rounds the same way). With M = max|Q_i| max|K_j| / sqrt(d), which bounds
// every |S_ij| and every partial sum of the dot product (Cauchy-Schwarz):
//  - each score S_ij is off by about u M (random; d u M aligned), and so is L_i (|L_i| <= M + ln N);
//  - exp turns a score error e into a relative error e of P_ij, and the N-term sums of P_ij and
//    P_ij V_j add sqrt(N) u (N u aligned), so O is off by max|V| times the same amount;
//  so  tol_L = 32 u (M + sqrt(N) + 8)  and  tol_O = max|V| tol_L  (random; M -> d M, sqrt(N) -> N
//  aligned). The tolerance grows linearly with the score magnitude M: scores 30^2 times larger
//  (the hardening test) give tolerances about 900 times larger.
//  - gradients: the same errors in P, plus the q_len-term sums for dK and dV, relative to the
//    reference's largest entry: grad_rel = 32 u (M + sqrt(N) + sqrt(q_len) + 8) (aligned: d M, N,
//    q_len). dS = P (dP - D) cancels where dP_ij ~ D_i (e.g. all keys equal: dQ = 0, or
//    kv_len = 1: dQ = dK = 0), leaving fp32 noise of about u |dO_i| |V_j| in each dS_ij, which no
//    relative bound covers; so dQ and dK get a floor: dQ_i sums that noise over keys with weights
//    P_ij adding to 1 (times |K_j| / sqrt(d)), dK_j over queries with weights P_ij <= 1 (random:
//    sqrt(q_len), aligned: q_len); aligned, dQ's N-term accumulation adds a factor N too.
// The factor 32 is a safety margin: an fp32 CPU emulation of the kernels' arithmetic, run through
// these very tests, stays below 1/12 of every tolerance (1/25 for the N(0, 1) grids), while the
// bugs these tests exist for (a wrong mask, a lost tile, a wrong scale, even O off by 1e-4
// relative) exceed them.
// (Chapter 2's kernels have their own derivation, from fp16's and bf16's rounding: below,
// tolerances16.)
constexpr double kUnitRoundoff = 1.0 / (1 << 24);
constexpr double kSafety = 32.0;

enum class Rounding { random, aligned };

struct Tolerances {
    double M;                   // max|Q_i| max|K_j| / sqrt(d): bounds every |S_ij|
    double L, O;                // absolute
    double grad_rel;            // relative to the reference gradient's largest entry
    double dQ_floor, dK_floor;  // absolute floors for dQ and dK (see above)
};

// The fp32 tolerances for problem p (see above).
Tolerances tolerances(const Problem<float>& p, Rounding rounding);

// ---------------------------------------------------------------------------------------------
// Tolerances of chapter 2's forward, in either 16-bit element type T (fp16 or bf16), against the
// reference, which runs in double on exactly the rounded inputs (rounded_problem<T>, then
// converted<double>): the rounding of the inputs is not an error here, only the kernel's own
// arithmetic is. u16 is T's unit roundoff (Format16<T>::unit_roundoff): 2^-11 for fp16 (11
// significant bits), 2^-8 for bf16 (8); u = 2^-24 is fp32's; M = max|Q_i| max|K_j| / sqrt(d) as
// above; N = kv_len.
//  - S = Q K^T on the tensor cores: a product of two T values (11 by 11 significant bits, or 8 by
//    8) is exact in fp32 (24), and the products are summed in fp32, but the tensor cores' fp32
//    accumulation is not guaranteed to round to nearest (it may truncate), so the errors can all
//    have one sign: the aligned case above, |error of S_ij| <= d u M. That is already a worst
//    case, so it takes no statistical safety factor, only 2 (the fp32 scaling of S by
//    log2(e)/sqrt(d) and exp2's few ulp add about one more u M). From S on, m, l and L are fp32,
//    as in chapter 1, so
//        tol_L = 2 d u M + 32 u (sqrt(N) + 8)
//    (the fp32 formula's random-rounding terms, 32 = kSafety as there, and the score term): the
//    same formula for both types, as nothing on L's way is rounded to 16 bits.
//  - O: P~ = exp(S - m) <= 1 is rounded to T before P~ V. Each weight is off by at most u16
//    relative, plus e16 absolute (Format16<T>::tiny_weight_error) where it is too small for T's
//    normal numbers. fp16 rounds weights below 2^-14 ~ 6.1e-5 to its subnormals, spaced 2^-24:
//    e16 = 2^-25. bf16's normal numbers reach down to fp32's 2^-126, and below that the kernels'
//    exp2 (ex2.approx.ftz) has already flushed a weight to 0: e16 = 2^-126 (bf16's own
//    subnormals, spaced 2^-133, never arise). fp16's e16 covers that flush too: a weight is
//    flushed or rounded, never both, and 2^-126 is far below 2^-25. The weights (divided by l)
//    sum to 1, so O moves by at most u16 max|V| + N e16 max|V|. l is summed from the unrounded
//    fp32 P~, so the rounded weights sum to 1 only within u16: another u16 max|V|. O itself is
//    rounded to T (|O| <= max|V|): u16 max|V|. A score error e moves each weight by a relative e:
//    tol_L max|V|. So
//        tol_O = max|V| (3 u16 + N e16 + tol_L).
//    The P~ V products are exact in fp32 (T by T) and their fp32 sums add about N u, far below
//    u16. This bound is a worst case (every error aligned), not a statistical estimate, so it
//    needs no safety factor beyond tol_L's. In fp16 its u16 terms alone are about 7 times the
//    worst |error| on O an H100 showed on N(0, 1) inputs (9e-4, with max|V| ~ 4.5). In bf16 they
//    are 8 times larger, and so are the errors: over the forward grid an H100's worst |error| on
//    O was 2.4e-3 max|V| in bf16 (3e-4 max|V| in fp16), a fifth of bf16's 3 u16 = 1.2e-2. The
//    bugs the tests exist for (a wrong mask, a lost tile, a wrong scale) give errors of 0.1 to 1.
//    The score term 2 d u M grows with d and with the scores: on N(0, 1) inputs tol_L is about
//    1e-4 at d = 16 and 8e-4 at d = 256 (tol_O about 7e-3 and 1e-2 in fp16, 6e-2 at both in
//    bf16), and with Q and K scaled by 30 (the hardening test) tol_O approaches max|V|: there L,
//    whose values are in the thousands, carries the check.
// Never loosen these to make a test pass: a test that fails them has found a bug, or a flaw in
// this derivation (then fix the derivation, here, first).

// Chapter 5's options change the scores, and so the score terms above: with a softmax scale c the
// bound is M = c max|Q_i| max|K_j| (c = 1/sqrt(d) by default). Softcap's cap tanh(s / cap) has a
// slope of at most 1, so it carries a score's error through unchanged, but the kernels'
// tanh.approx.f32 adds up to 2^-10.9 relative to tanh: cap |tanh(s / cap)| <= min(cap, |s|), so
// a score gains at most 2^-10 min(cap, M), with a margin (softcap_term). At Gemma 2's cap of 50
// and d = 128 (M about 16 on N(0, 1) inputs) that is a third of 2^-10 cap: tol_L 0.016, which a
// tanh 1% off exceeds on L (0.020, in double on the CPU), where 2^-10 cap let 2% (0.040) by. The
// backward's derivative 1 - t^2 is off by up to 2 |t| 2^-10.9 |t|: relative to itself, below that
// term wherever |s| <= cap / 2 (cap >= 1); past that 1 - t^2 is small, and so is the dS it scales.
// ALiBi's slope |i' - j|, computed in fp32, adds a few u of the largest bias, 4 u max_bias. Both
// terms add to every score's error, so to tol_L and to the backward's eps. ScoreTerms carries
// them (all 0: the plain scores).
struct ScoreTerms {
    double scale = 0;          // the softmax scale; 0: 1/sqrt(d)
    double softcap = 0;        // the cap; 0: none
    double extra = 0;          // any other absolute error a score gains beyond the products' sums
};
// The softcap's tanh.approx term for score bound M (0 without a cap).
inline double softcap_term(const ScoreTerms& terms, double M) {
    return terms.softcap > 0 ? std::exp2(-10.0) * std::min(terms.softcap, M) : 0;
}

// Chapter 2's forward tolerances for problem p (its T values, exactly): M, L and O (see above);
// the gradient fields stay 0 (backward_tolerances16 fills them). T: __half or __nv_bfloat16.
template <typename T>
Tolerances tolerances16(const Problem<T>& p, const ScoreTerms& terms = {});

// ---------------------------------------------------------------------------------------------
// Tolerances of chapter 2's backward (flash_backward_fp16, flash_backward_bf16) against the
// reference, which runs in double on exactly the rounded inputs Q, K, V and dO and computes its
// own exact O and L, while the kernels read the forward's O (in T) and L (fp32). Those two are
// inputs of the backward, and the test has both them and the reference's: so their actual errors
// are measured, element by element, and carried through, rather than bounded by the forward's
// worst-case tol_O and tol_L. u16 (2^-11 in fp16, 2^-8 in bf16), u, M, d as above.
//  (a) P_ij = exp(S_ij - L_i) is recomputed: S_ij once more from exact products of T values
//      summed in fp32 (aligned at worst, as in the forward: d u M, and 2 d u M with the scaling
//      and exp2), L_i as the forward wrote it, off by dL = max_i |L_i - L_i(reference)|. An
//      absolute error e of the exponent is a relative error e of P, so every P_ij is off by at
//      most
//          eps = dL + 2 d u M   (relative).
//  (b) Three roundings to T, each u16 relative to the element it rounds: P to T for
//      dV = P^T dO; dS = P o (dP - D) to T for dQ = dS K and dK = dS^T Q; each gradient to T
//      when it is written. dP = dO V^T itself is fp32 sums of exact products: d u M_dP with
//      M_dP = max|dO_i| max|V_j|, far below u16, so it adds nothing worth a term.
//  (c) D_i = rowsum(dO_i o O_i) is computed from the forward's O (in T): it is off by exactly
//      dD_i = sum_x dO_ix (O_ix - O_ix(reference)), plus its fp32 sum's rounding, d u max|dO| max|V|
//      at worst. dD = max_i |dD_i| + d u max|dO| max|V|.
//  Each gradient element is a sum of many terms (over keys for dQ, over queries for dK and dV),
//  each term carrying its own, independent roundings from (a) and (b). Measured against the
//  reference gradient's largest entry, the error is then a few u16 plus the error of P:
//      grad_rel = kSafety16 (3 u16 + eps)
//  (on N(0, 1) inputs about 1.2e-2 + 8 eps in fp16, 9.4e-2 + 8 eps in bf16; over the backward
//  grid an H100's worst gradient error stayed below a ninth of its tolerance in either type).
//  kSafety16 = 8 is a statistical margin, not a worst case. The terms' rounding errors have
//  random signs, so they add up as a random walk (the square root of their sum of squares), just
//  as random terms themselves do: a sum's error stays a few u16 of the sum's typical size, not of
//  the sum of the terms' sizes. 8 covers the tail: the worst of the many thousand elements one
//  test compares sits some 5 standard deviations out. (A worst case, every rounding of a sum's
//  terms aligned, would grow with the number of terms, and at u16 = 4.9e-4, fp16's, let alone
//  bf16's 3.9e-3, would leave no test.)
//  Cancellation, as in the fp32 derivation: where dP_ij ~ D_i (e.g. kv_len = 1, where the exact
//  dQ and dK are 0), dS_ij is nothing but the error of D_i, and no bound relative to the (tiny)
//  reference gradient covers it. So the floors carry (c) through the two products:
//      dQ_floor = 2 dD max|K| / sqrt(d)    (with a softmax scale c: 2 dD max|K| c, ScoreTerms)
//  (dQ_i sums that error over keys with weights P_ij adding up to 1, times K_j / sqrt(d); every
//  term of the sum has the same dD_i, so it is a worst case: 2 covers the rounding of dS and of
//  dQ to T on top), and
//      dK_floor = 4 dD max|Q| sqrt(q_len) / sqrt(d)
//  (dK_j sums it over queries with weights P_ij <= 1, each query's dD_i of its own sign: a random
//  walk over at most q_len terms, with the margin 4). dD carries the forward's rounding of O to
//  T, so the floors are larger in bf16, as they should be.
//  Nothing above depends on the tiles or on how many launches compute a gradient: at d = 256,
//  where the kernel streams 32-row Q tiles and computes dV and (dK, dQ) in a launch each, each
//  launch recomputes P as in (a) and rounds as in (b); dQ's sum over K/V tiles runs in fp32 in
//  memory (in a fixed order) and is rounded to T once, as (b) counts; the terms that grow with
//  d (2 d u M, d u max|dO| max|V|) are computed from the shape's own d.
// As above: never loosen these to make a test pass; fix the derivation first if it is wrong.
constexpr double kSafety16 = 8.0;

// Chapter 2's backward tolerances for problem p (its T values, dO included), given the forward
// outputs the kernels read (got.O, got.L: the forward's, as float) and the reference's (want.O,
// want.L): the forward's tolerances (tolerances16), then grad_rel, dQ_floor and dK_floor as
// derived above. T: __half or __nv_bfloat16; W: float or double.
template <typename T, typename W>
Tolerances backward_tolerances16(const Problem<T>& p, const Outputs<float>& got,
                                 const Outputs<W>& want, const ScoreTerms& terms = {});

// =============================================================================================
// Comparing tensors

// How a flat tensor maps to (b, h, row, x), to say where an element is.
struct FlatLayout {
    int heads;         // heads per batch: splits a batch*head index into (b, h)
    int rows;          // rows per head: q_len or kv_len
    int row_len;       // head_dim, or 1 for L
    const char* row;   // "i" (a query row) or "j" (a key row)
    size_t first_bh;   // batch*head index of the vector's first head (when it holds a slice)
};
// The layouts of Q, O, dQ, dO; of K, V, dK, dV; of L. first_bh: where a slice starts.
FlatLayout q_layout(const AttentionShape& s, size_t first_bh = 0);
FlatLayout kv_layout(const AttentionShape& s, size_t first_bh = 0);
FlatLayout l_layout(const AttentionShape& s, size_t first_bh = 0);

// Where flat element e is: "(b=1, h=2, i=30, x=5)".
std::string where(const FlatLayout& l, size_t e);

// The one comparison every test uses: `got` (the GPU's, or the value under test) against `want`
// (the reference's), element by element. Each may hold float or double: e.g. the GPU's results
// as float against a double reference. Every element must be written (not NaN: outputs are
// poisoned with NaN before each call), an infinite `want` (L = -inf for a row that sees nothing)
// must be matched exactly, and the rest must agree within `tol`. It asserts on the worst element
// (through WithinAbs), or on the count of NaN when there are any, and on failure says which
// tensor, the shape, the worst error and where it is, and how many elements are out of tolerance
// or unwritten.
template <typename G, typename W>
void check_close(const char* name, const std::vector<G>& got, const std::vector<W>& want,
                 double tol, const AttentionShape& s, const FlatLayout& layout) {
    REQUIRE(got.size() == want.size());
    REQUIRE(!got.empty());
    size_t worst = 0, beyond = 0, nans = 0, first_nan = 0, infinite = 0;
    double worst_err = -1;
    for (size_t e = 0; e < got.size(); ++e) {
        const double g = double(got[e]), w = double(want[e]);
        double err;
        if (std::isnan(g)) {
            if (nans++ == 0) first_nan = e;
            err = std::numeric_limits<double>::infinity();
        } else if (std::isnan(w)) {
            err = std::numeric_limits<double>::infinity();  // the reference never gives NaN
        } else if (std::isinf(g) || std::isinf(w)) {
            err = g == w ? 0.0 : std::numeric_limits<double>::infinity();
            if (err > 0) ++infinite;
        } else {
            err = std::fabs(g - w);
        }
        if (err > tol) ++beyond;
        if (err > worst_err) worst_err = err, worst = e;
    }
    std::ostringstream os;
    os << std::setprecision(9) << name << " on " << describe(s) << ": worst |error| "
       << std::setprecision(3) << worst_err << " at " << where(layout, worst) << ": got "
       << std::setprecision(9) << got[worst] << ", want " << want[worst] << "; tolerance "
       << std::setprecision(3) << tol << "; " << beyond << " of " << got.size()
       << " elements beyond it";
    if (nans > 0) os << "; " << nans << " NaN (never written?), first at " << where(layout, first_nan);
    if (infinite > 0) os << "; " << infinite << " infinite where the reference is not, or -inf where it is finite";
    INFO(os.str());
    if (nans > 0)
        CHECK(nans == 0);
    else
        CHECK_THAT(double(got[worst]), Catch::Matchers::WithinAbs(double(want[worst]), tol));
}

// The forward's outputs (the GPU's, as float) against the reference's (float or double).
template <typename W>
void check_forward(const Outputs<float>& got, const Outputs<W>& want, const Tolerances& tol,
                   const AttentionShape& s) {
    check_close("O", got.O, want.O, tol.O, s, q_layout(s));
    check_close("L", got.L, want.L, tol.L, s, l_layout(s));
}

// The backward's outputs against the reference's.
template <typename W>
void check_backward(const Outputs<float>& got, const Outputs<W>& want, const Tolerances& tol,
                    const AttentionShape& s) {
    check_close("dQ", got.dQ, want.dQ, tol.grad_rel * max_abs(want.dQ) + tol.dQ_floor, s,
                q_layout(s));
    check_close("dK", got.dK, want.dK, tol.grad_rel * max_abs(want.dK) + tol.dK_floor, s,
                kv_layout(s));
    check_close("dV", got.dV, want.dV, tol.grad_rel * max_abs(want.dV), s, kv_layout(s));
}

// Any element type's forward outputs (the GPU's, as float: exact) against the reference's, on
// p's exact values: for float (chapter 1), the reference in float, within tolerances(p,
// Rounding::random); for __half and __nv_bfloat16 (chapter 2), the reference in double, within
// tolerances16(p). On failure, the tolerances and the score bound M they come from are printed.
template <typename T>
void check_against_reference(const Outputs<float>& got, const Problem<T>& p);
// The same for the forward's and the backward's outputs (O, L, dQ, dK, dV), dO included in p:
// chapter 2's within backward_tolerances16 (which reads the GPU's O and L, as the kernels do).
template <typename T>
void check_against_reference_backward(const Outputs<float>& got, const Problem<T>& p);

// Rows 0 .. masked-1 of every head must hold exactly `value` (0 for O and dQ, -inf for L).
void check_masked_rows(const char* name, const std::vector<float>& got, const AttentionShape& s,
                       int row_len, float value);
// Every output's: O = 0 and L = -inf in the rows that see no key, and dQ = 0 where got holds
// gradients.
void check_masked_rows(const Outputs<float>& got, const AttentionShape& s);

// How many elements are NaN (e.g. still the poison: never written) or infinite.
size_t count_bad(const std::vector<float>& v);

// True iff a and b hold the same bits (two empty vectors do).
bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b);
// The same for every output: O, L, dQ, dK and dV (the last three empty in both after a forward).
bool bitwise_equal(const Outputs<float>& a, const Outputs<float>& b);

// Two results that must be bitwise identical (the kernels are deterministic: no atomics).
void check_bitwise(const char* name, const std::vector<float>& a, const std::vector<float>& b,
                   const AttentionShape& s, const FlatLayout& layout);
// The same for every output of two calls: O and L, and dQ, dK and dV where they hold any.
void check_bitwise(const Outputs<float>& first, const Outputs<float>& again,
                   const AttentionShape& s);

// =============================================================================================
// Device memory

// An array of T on the GPU: cudaMalloc in the constructor, cudaFree in the destructor.
template <typename T>
struct DeviceBuffer {
    T* ptr = nullptr;
    size_t count = 0;

    DeviceBuffer() = default;
    explicit DeviceBuffer(size_t n) : count(n) {
        FLASH_CUDA_CHECK(cudaMalloc(&ptr, n * sizeof(T)));
    }
    explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
        upload(host);
    }
    ~DeviceBuffer() {
        if (ptr) cudaFree(ptr);
    }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    DeviceBuffer(DeviceBuffer&& other) noexcept : ptr(other.ptr), count(other.count) {
        other.ptr = nullptr, other.count = 0;
    }
    DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
        std::swap(ptr, other.ptr), std::swap(count, other.count);
        return *this;
    }

    // host's elements, from element offset on.
    void upload(const std::vector<T>& host, size_t offset = 0) {
        REQUIRE(offset + host.size() <= count);
        FLASH_CUDA_CHECK(cudaMemcpy(ptr + offset, host.data(), host.size() * sizeof(T),
                                    cudaMemcpyHostToDevice));
    }
    // n elements from offset (all of it by default).
    std::vector<T> download(size_t offset = 0, size_t n = SIZE_MAX) const {
        if (n == SIZE_MAX) n = count - offset;
        REQUIRE(offset + n <= count);
        std::vector<T> host(n);
        FLASH_CUDA_CHECK(cudaMemcpy(host.data(), ptr + offset, n * sizeof(T),
                                    cudaMemcpyDeviceToHost));
        return host;
    }
    // The same, each element converted to float (exactly: see to_float), to compare.
    std::vector<float> download_float(size_t offset = 0, size_t n = SIZE_MAX) const {
        const std::vector<T> host = download(offset, n);
        std::vector<float> out(host.size());
        for (size_t e = 0; e < host.size(); ++e) out[e] = to_float(host[e]);
        return out;
    }
    // Element e becomes pattern[e % pattern.size()] (for tensors too big to build on the host).
    void fill_repeating(const std::vector<T>& pattern) {
        for (size_t at = 0; at < count; at += pattern.size()) {
            const size_t n = std::min(pattern.size(), count - at);
            FLASH_CUDA_CHECK(cudaMemcpy(ptr + at, pattern.data(), n * sizeof(T),
                                        cudaMemcpyHostToDevice));
        }
    }
    // Every element NaN, copied from the host (cudaMemset cannot write a float NaN), so that an
    // element a kernel forgets to write shows up.
    void poison() {
        fill_repeating(std::vector<T>(std::min<size_t>(count, size_t(1) << 22), quiet_nan<T>()));
    }
};

// =============================================================================================
// Which kernel a GPU test runs: a Kernel, named, never a number. Every GPU helper below takes one
// (as the argument before the stream, wherever there is a stream).
//   Kernel::public_call()  the API's own call for the element type: flash_forward (chapter 1) for
//                          float; flash_forward_fp16 / _bf16 for fp16 / bf16, which runs chapter 3
//                          on compute capability 9.0 at its head dims and chapter 2 everywhere else
//                          (public_forward_runs_hopper); the backward's flash_backward,
//                          flash_backward_fp16 / _bf16
//   Kernel::chapter2()     flash_forward_fp16_ampere / _bf16_ampere: chapter 2 whatever the GPU
//                          (the backward: flash_backward_fp16_ampere / _bf16_ampere)
//   Kernel::chapter3()     flash_forward_fp16_hopper / _bf16_hopper: chapter 3 (sm_90 only)
//                          (the backward: flash_backward_fp16_hopper / _bf16_hopper)
//   Kernel::with_bc(Bc)    a caller-chosen K/V tile of Bc keys: flash_forward_bc (fp32),
//                          flash_forward_fp16_bc, flash_backward_fp16_bc (bf16 has no such call,
//                          nor chapter 1's backward: asked for one, the test fails, saying so)
//   own_chapter<T>()       the kernel of T's own chapter: chapter 1's public call for float,
//                          chapter 2's for fp16 and bf16 (the backward: the public call, whose
//                          only kernel is chapter 2's)
struct Kernel {
    enum Which { Public, Chapter2, Chapter3, WithBc };
    Which which = Public;
    int Bc = 0;  // keys per K/V tile, for WithBc only

    static Kernel public_call() { return {Public, 0}; }
    static Kernel chapter2() { return {Chapter2, 0}; }
    static Kernel chapter3() { return {Chapter3, 0}; }
    static Kernel with_bc(int Bc) { return {WithBc, Bc}; }
    bool operator==(const Kernel& other) const { return which == other.which && Bc == other.Bc; }
    bool operator!=(const Kernel& other) const { return !(*this == other); }
    // For messages: "the public call", "chapter 2's kernel", "chapter 3's kernel", "Bc = 64".
    std::string name() const;
};
template <typename T>
Kernel own_chapter() {
    return std::is_same<T, float>::value ? Kernel::public_call() : Kernel::chapter2();
}
// The public fp16 / bf16 backward follows the forward's rule (public_forward_runs_hopper, below):
// chapter 3 where it holds.
// Whether element type T has calls with a caller-chosen Bc: the forward's flash_forward_bc and
// flash_forward_fp16_bc (bf16 has none); the backward's flash_backward_fp16_bc alone.
template <typename T>
constexpr bool forward_takes_bc() {
    return !std::is_same<T, __nv_bfloat16>::value;
}
template <typename T>
constexpr bool backward_takes_bc() {
    return std::is_same<T, __half>::value;
}
// The calls a validation test of T's forward makes, for GENERATE(from_range(...)): the public
// call, and where T has one, the call with a caller-chosen Bc for each of `bcs`.
template <typename T>
std::vector<Kernel> forward_calls(const std::vector<int>& bcs) {
    std::vector<Kernel> calls = {Kernel::public_call()};
    if (forward_takes_bc<T>())
        for (int Bc : bcs) calls.push_back(Kernel::with_bc(Bc));
    return calls;
}

// True iff the public forward (flash_forward_fp16 / _bf16) runs chapter 3 at this head dim on
// the current GPU (compute capability 9.0, a head dim in kFlashHopperHeadDims): the rule stated
// on its own, not through the library's flash_forward_runs_hopper, so that the tests check it.
// Tests of the tensor-core forward run Kernel::chapter2(), then the public call where this holds:
// both chapters on an H100, chapter 2 once elsewhere.
bool public_forward_runs_hopper(int head_dim);

// The kernels under test, by element type T (L is always float): float runs chapter 1's
// flash_forward and flash_backward, __half chapter 2's (and 3's) fp16 calls, __nv_bfloat16 the
// bf16 ones: so that GpuAttention<T> and one validation test body serve every type. They launch
// and return; waiting is wait_for_gpu's (below).
template <typename T>
void launch_forward(const T* Q, const T* K, const T* V, T* O, float* L, const AttentionShape& s,
                    Kernel kernel = Kernel::public_call(), cudaStream_t stream = 0);
template <typename T>
void launch_backward(const T* Q, const T* K, const T* V, const T* O, const T* dO, const float* L,
                     T* dQ, T* dK, T* dV, const AttentionShape& s,
                     Kernel kernel = Kernel::public_call(), cudaStream_t stream = 0);

// =============================================================================================
// Waiting for the GPU, with a deadline. A kernel that waits forever (on an mbarrier whose phase
// or expected bytes are wrong, for a dQ turn that never comes) cannot be cancelled: the test
// would hang with no message until something killed it. So every wait of the harness goes
// through wait_for_gpu: it records an event after the call, polls it, and if the deadline passes
// first, fails the test in Catch's output (naming the test case, the shape, the kernel and what
// is likely waiting forever), prints the summary line and ends the process with exit code 3 (the
// CUDA context is lost anyway).

// One GPU call, as a test makes it: enough to name it and to scale its deadline.
struct GpuCall {
    const char* direction;  // "forward" or "backward"
    const char* type;       // "fp32", "fp16" or "bf16"
    Kernel kernel;
    AttentionShape s;
    int chapter;            // the chapter whose kernel runs: 1, 2 or 3
};
// The call of T's kernel: which chapter runs it (the public fp16 / bf16 forward runs chapter 3
// where public_forward_runs_hopper says so).
template <typename T>
GpuCall gpu_call(const char* direction, Kernel kernel, const AttentionShape& s);

// The deadline of a call, in seconds: 10 s, plus its floating-point work (the forward's
// 4 B H q_len kv_len d, the backward's 10 B H q_len kv_len d, the mask ignored) at 1e11 flop/s,
// a tenth or less of what the slowest GPU the kernels run on does, all times
// FLASH_TEST_DEADLINE_SCALE (environment, default 1; e.g. 20 under compute-sanitizer).
double deadline_seconds(const GpuCall& call, double scale = 1.0);
// The scale from the environment (1 where FLASH_TEST_DEADLINE_SCALE is unset or not a number > 0).
double deadline_scale_from_env();
// What is most likely waiting forever in this call, as the failure line says it.
std::string likely_hang(const GpuCall& call);
// The failure line: the test case, the call (direction, type, kernel, shape), the deadline, and
// likely_hang.
std::string deadline_message(const std::string& test_case, const GpuCall& call, double seconds);

// The wait itself, apart from CUDA, so that a CPU test can check it: calls poll() (cudaEventQuery
// in the harness) until it returns something other than cudaErrorNotReady, which it returns, or
// until now() (seconds) reaches now() at the start + seconds: then cudaErrorNotReady. pause()
// runs between polls (a short sleep in the harness).
template <typename Poll, typename Now, typename Pause>
cudaError_t poll_until(Poll&& poll, Now&& now, Pause&& pause, double seconds) {
    const double until = now() + seconds;
    for (;;) {
        const cudaError_t status = poll();
        if (status != cudaErrorNotReady) return status;
        if (now() >= until) return cudaErrorNotReady;
        pause();
    }
}

// How a run ends when a deadline passes: `line` as a failure of the current test case (Catch
// prints it with the test's name and INFO context) and on stderr, then the summary line (this test
// case counted as failed), then std::_Exit(3), running no destructor (they would call CUDA).
[[noreturn]] void end_run_on_deadline(const std::string& line);

// Waits for everything queued so far on `stream` (and on the legacy default stream, which a
// blocking stream waits for), within deadline_seconds(call): a CUDA error fails the test as
// FLASH_CUDA_CHECK does (std::runtime_error); the deadline passing ends the process, as above.
void wait_for_gpu(cudaStream_t stream, const GpuCall& call);
// The watchdog behind every GPU call: a DeadlineGuard made before the launch arms it, and its end
// (the call waited for, or an exception) disarms it. If the host is blocked anywhere meanwhile (a
// launcher, a copy or a pool trim that waits on a kernel that never ends), a thread of its own
// ends the run the same way at 1.5 times the call's deadline, saying the host was blocked.
struct DeadlineGuard {
    explicit DeadlineGuard(const GpuCall& call);
    ~DeadlineGuard();
    DeadlineGuard(const DeadlineGuard&) = delete;
    DeadlineGuard& operator=(const DeadlineGuard&) = delete;
};
// Every GPU test case runs under an alarm too (every test case where FLASH_TEST_CASE_SECONDS is
// set), armed as it starts: test_case_seconds(), the environment's FLASH_TEST_CASE_SECONDS or
// 300 s times FLASH_TEST_DEADLINE_SCALE. Past it the run ends as a passed deadline does: no test
// case hangs without a message.
double test_case_seconds();
// A kernel that spins on the GPU's clock for `seconds` (tests/spin.cu): the deadline's own test.
void launch_spinning_kernel(double seconds, cudaStream_t stream = 0);

// =============================================================================================
// One problem on the GPU

// One problem on the GPU, tensors of T (L is always float): inputs uploaded once; forward() and
// backward() poison their outputs, run the kernel and wait for it (wait_for_gpu). dO, dQ, dK and
// dV are allocated only for a backward.
template <typename T>
struct GpuAttention {
    AttentionShape s;
    DeviceBuffer<T> Q, K, V, O;
    DeviceBuffer<float> L;
    DeviceBuffer<T> dO, dQ, dK, dV;

    // Inputs left for the caller to fill.
    explicit GpuAttention(const AttentionShape& shape)
        : s(shape), Q(q_elems(shape)), K(kv_elems(shape)), V(kv_elems(shape)),
          O(q_elems(shape)), L(l_elems(shape)) {}
    explicit GpuAttention(const Problem<T>& p) : GpuAttention(p.s) {
        Q.upload(p.Q);
        K.upload(p.K);
        V.upload(p.V);
        if (!p.dO.empty()) dO = DeviceBuffer<T>(p.dO);
    }

    void forward(Kernel kernel = Kernel::public_call(), cudaStream_t stream = 0) {
        O.poison();
        L.poison();
        const DeadlineGuard guard(gpu_call<T>("forward", kernel, s));
        launch_forward(Q.ptr, K.ptr, V.ptr, O.ptr, L.ptr, s, kernel, stream);
        FLASH_CUDA_CHECK(cudaGetLastError());
        wait_for_gpu(stream, gpu_call<T>("forward", kernel, s));
    }
    // Uses O and L as the last forward() left them.
    void backward(Kernel kernel = Kernel::public_call(), cudaStream_t stream = 0) {
        REQUIRE(dO.count == q_elems(s));
        if (dQ.count == 0) {
            dQ = DeviceBuffer<T>(q_elems(s));
            dK = DeviceBuffer<T>(kv_elems(s));
            dV = DeviceBuffer<T>(kv_elems(s));
        }
        dQ.poison();
        dK.poison();
        dV.poison();
        const DeadlineGuard guard(gpu_call<T>("backward", kernel, s));
        launch_backward(Q.ptr, K.ptr, V.ptr, O.ptr, dO.ptr, L.ptr, dQ.ptr, dK.ptr, dV.ptr, s,
                        kernel, stream);
        FLASH_CUDA_CHECK(cudaGetLastError());
        wait_for_gpu(stream, gpu_call<T>("backward", kernel, s));
    }
    // The outputs, as float.
    Outputs<float> outputs(bool with_gradients) const {
        Outputs<float> r;
        r.O = O.download_float();
        r.L = L.download_float();
        if (with_gradients) {
            r.dQ = dQ.download_float();
            r.dK = dK.download_float();
            r.dV = dV.download_float();
        }
        return r;
    }
};

// The [determinism] tests' repeated calls: the forward (and, with_gradients, the backward after
// it) `calls` times on gpu's same inputs, each call's outputs poisoned with NaN first (forward()
// and backward() do that). Every call's outputs (O and L; dQ, dK, dV with gradients), downloaded
// whole, must hold the very bits of the first call's: the first call that differs fails the test,
// naming the call and, for every output that differs, its first differing element. Returns the
// first call's outputs, for the caller to check against the reference. `kernel`: the forward's
// (the backward runs the public call).
template <typename T>
Outputs<float> outputs_of_identical_calls(GpuAttention<T>& gpu, int calls, bool with_gradients,
                                          Kernel kernel = Kernel::public_call()) {
    const auto call_once = [&] {
        gpu.forward(kernel);
        if (with_gradients) gpu.backward();
        return gpu.outputs(with_gradients);
    };
    const Outputs<float> first = call_once();
    for (int call = 2; call <= calls; ++call) {
        const Outputs<float> again = call_once();
        if (bitwise_equal(first, again)) continue;
        INFO("call " << call << " of " << calls << " differs from call 1");
        check_bitwise(first, again, gpu.s);
        FAIL("results changed between identical calls");
    }
    return first;
}

// One random problem checked on the GPU, in element type T (float: chapter 1; __half or
// __nv_bfloat16: chapter 2 or 3): fresh inputs of shape s for this salt (rounded_problem<T>),
// the forward of `kernel`, and O and L against the reference (check_against_reference). Returns
// the GPU's outputs, for any further check. The grids, the sanitizer subset, the masking tests
// and the Bc tests share it.
template <typename T>
Outputs<float> check_forward_on_gpu(const AttentionShape& s, uint32_t salt,
                                    Kernel kernel = Kernel::public_call());
// The same, with dO: the forward for the kernels' own O and L, then the backward with them (its
// outputs poisoned with NaN first) of `kernel`, and O, L, dQ, dK and dV against the reference.
template <typename T>
Outputs<float> check_backward_on_gpu(const AttentionShape& s, uint32_t salt,
                                     Kernel kernel = Kernel::public_call());
// The backwards a test of T runs at head_dim: fp32's public call; for fp16 and bf16 chapter 2's,
// then, where public_forward_runs_hopper(head_dim) (the backward's rule too), the public call,
// which runs chapter 3's: both chapters on an H100, chapter 2 once elsewhere.
template <typename T>
std::vector<Kernel> backward_kernels(int head_dim) {
    if (std::is_same<T, float>::value) return {Kernel::public_call()};
    if (public_forward_runs_hopper(head_dim)) return {Kernel::chapter2(), Kernel::public_call()};
    return {Kernel::chapter2()};
}

// The device's properties (of the current device), for the tests that depend on its shared memory
// (fetched once a device, then kept).
cudaDeviceProp current_device_props();
// Chapter 3's tests start with `if (!hopper_or_warn()) return;`: true on a GPU of compute
// capability 9.0; elsewhere a WARN that says the test is skipped and why, then false (Catch2 v2
// has no SKIP, so the test passes, saying so, with a passing assertion).
bool hopper_or_warn();
// Every run of a test case must assert something: main turns Catch's --warn NoAssertions on, so a
// test that returns before its first check fails. A generated case that does not apply (the same
// kernel as another case, a GPU without chapter 3) returns through NOT_HERE(why): a passing
// assertion that names why (a skip the student should see adds a WARN, as hopper_or_warn does).
#define NOT_HERE(why)                            \
    do {                                         \
        SUCCEED("not run here: " << why);        \
        return;                                  \
    } while (false)

// =============================================================================================
// Validation helpers

// Runs `call`, which must throw std::invalid_argument, and returns its message. Anything else it
// throws reaches Catch as an unexpected exception (and fails the test).
template <typename F>
std::string refusal(F&& call) {
    try {
        call();
    } catch (const std::invalid_argument& e) {
        return e.what();
    }
    FAIL("expected std::invalid_argument, but the call returned normally");
    return {};
}

// Matches a message that names `word` as a whole word: "shape.q_len = 0" names q_len; "dQ is
// null" names dQ but not Q.
class NamesWord : public Catch::MatcherBase<std::string> {
    std::string word_;

public:
    explicit NamesWord(std::string word) : word_(std::move(word)) {}
    bool match(const std::string& msg) const override;
    std::string describe() const override { return "names \"" + word_ + "\""; }
};

// Stand-ins for tensors in the validation tests: real, separate, 16-byte-aligned host arrays of
// T (float, __half or __nv_bfloat16; L is always float), never read: validation refuses the call
// first. The inputs hold a pattern, the outputs NaN, and the outputs must be bitwise unchanged
// afterwards.
template <typename T = float>
struct FakeTensors {
    static constexpr size_t kN = 64;
    alignas(16) T Q[kN], K[kN], V[kN], O[kN], dO[kN], dQ[kN], dK[kN], dV[kN];
    alignas(16) float L[kN];
    alignas(16) T snapshot[4][kN];  // O, dQ, dK, dV
    alignas(16) float snapshot_L[kN];

    FakeTensors();                   // fills the inputs and poisons the outputs
    bool outputs_untouched() const;  // every output still bitwise as the constructor left it
};

// A small shape every check accepts, for the tests to spoil one field of.
inline AttentionShape valid_shape() { return {2, 3, 5, 7, 16, true}; }
// The refusal message of flash_forward_fp16 / flash_backward_fp16 with chapter 5's options o on
// the stand-ins t (refusal(): the call must throw std::invalid_argument).
std::string forward_refusal(FakeTensors<__half>& t, const AttentionShape& s,
                            const AttentionOptions& o);
std::string backward_refusal(FakeTensors<__half>& t, const AttentionShape& s,
                             const AttentionOptions& o);

// =============================================================================================
// The tile chooser

// The four GPUs the tile chooser is checked on (T4, A100, RTX 4090, H100), as
// cudaGetDeviceProperties would describe them.
std::vector<cudaDeviceProp> known_gpus();

// Everything a tile for head dim d must satisfy on this device (whole warps, rows within a warp,
// K_j and V_j in shared memory, ...).
void check_tile(const char* which, const FlashTile& t, const cudaDeviceProp& prop, int d);

// The same for chapter 2's forward tile (one tile serves fp16 and bf16): Br = 128 (four warps of
// two mma tiles of 16 rows; 64 at d = 256), 128 threads, 4 threads a row (an mma fragment's row),
// Bc 32 or 64 (or 128 up to d = 64), and shared memory for Q_i and two stages of K_j and V_j,
// rows padded by 8 halves: (Br + 4 Bc) (d + 8) halves, within the device's opt-in limit.
void check_tile_fp16(const FlashTile& t, const cudaDeviceProp& prop, int d);

// The fp16 backward's bytes of shared memory at head dim d, Bc keys a K/V tile and Br query rows a
// Q tile, as flash_fp16.cu counts them (rows padded by 8 halves): K_j and V_j (Bc rows each), two
// stages of Q_i and dO_i (Br rows each), P^T and dS^T (Bc rows of Br + 8 halves each), two stages
// of L_i and D_i (Br floats each).
size_t fp16_backward_bytes(int d, int Bc, int Br);
// What chapter 2's backward tile (fp16's and bf16's) must be, as the list below names it, best
// first: d = 16 (64, 64); d = 32, 96, 128 (128, 64) else (64, 64); d = 64 (128, 128) else (128, 64)
// else (64, 64); d = 256 (64, 64) else (64, 32), as (Bc, Br). A warp per 16 keys (8 warps at
// d = 256), 4 threads a row, shared_bytes as above within the device's opt-in limit and beside
// its reserve; the first tile of the list whose block fits, never a later one.
void check_tile_fp16_backward(const FlashTile& t, const cudaDeviceProp& prop, int d);

// =============================================================================================
// The big tests' inputs: tensors filled on the GPU with a random pattern of prime length, so
// that no two heads hold the same data (a kernel that reads the wrong head is caught), while
// the host can rebuild any head's data without holding the whole tensor.
constexpr size_t kPatternLength = 1000003;

// kPatternLength values from N(0, 1).
std::vector<float> random_pattern(uint32_t seed);

// Elements [first, first + n) of a tensor filled with `pattern`.
template <typename T>
std::vector<T> pattern_slice(const std::vector<T>& pattern, size_t first, size_t n) {
    std::vector<T> out(n);
    for (size_t e = 0; e < n; ++e) out[e] = pattern[(first + e) % pattern.size()];
    return out;
}

// Checks head `bh` of a big problem: rebuilds its inputs from `patterns` (Q, K, V, and
// with_gradients dO), runs the reference on that head alone, and compares with that head's slice
// of the GPU's outputs: O and L, and with_gradients dQ, dK and dV. T = float (chapter 1): the
// reference on the float inputs, fp32's tolerances; T = __half or __nv_bfloat16 (chapter 2;
// patterns: random_pattern's values rounded to T): the reference in double on the exact values,
// tolerances16 (backward_tolerances16 with gradients). Defined for float, __half and
// __nv_bfloat16.
template <typename T>
void check_big_head(const GpuAttention<T>& gpu, size_t bh,
                    const std::vector<std::vector<T>>& patterns, bool with_gradients);

// =============================================================================================
// Source files

// The lines of a file next to the test sources (or in the working directory), each trimmed.
std::vector<std::string> source_lines(const std::string& name);
