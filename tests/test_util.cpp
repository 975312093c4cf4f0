// test_util.cpp: the bodies of test_util.h's helpers, and the test binary's main(), which leaves
// out the [gpu] tests when there is no usable CUDA device (one line says so) and ends with
//   flash tests: N passed, M failed, K skipped
// (CI greps that line). The tests themselves: test_flash.cpp and test_hardening.cpp.

#define CATCH_CONFIG_RUNNER
#include "test_util.h"

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <thread>
#include <type_traits>
#include <unistd.h>

// =============================================================================================
// Shapes and random inputs

std::string describe(const AttentionShape& s) {
    std::ostringstream os;
    os << "shape (b=" << s.batch << ", h=" << s.heads << ", q_len=" << s.q_len
       << ", kv_len=" << s.kv_len << ", d=" << s.head_dim << ", causal=" << (s.causal ? 1 : 0);
    if (s.kv_heads != 0) os << ", kv_heads=" << s.kv_heads;  // grouped K/V heads (GQA)
    os << ")";
    return os.str();
}

int masked_rows(const AttentionShape& s) {
    return s.causal && s.q_len > s.kv_len ? s.q_len - s.kv_len : 0;
}

uint32_t seed_of(const AttentionShape& s, uint32_t salt) {
    uint32_t h = 2166136261u;  // FNV-1a over the fields
    for (int v : {s.batch, s.heads, s.q_len, s.kv_len, s.head_dim, int(s.causal), int(salt)}) {
        h ^= static_cast<uint32_t>(v);
        h *= 16777619u;
    }
    // Grouped K/V heads (GQA) mixed in only where set, so every other shape keeps its seed.
    if (s.kv_heads != 0) h = (h ^ static_cast<uint32_t>(s.kv_heads)) * 16777619u;
    return h;
}

void normal_pair(uint64_t key, uint64_t k, double& z0, double& z1) {
    const auto splitmix64 = [](uint64_t x) {  // (Steele, Lea and Flood's SplitMix64 finalizer)
        x += 0x9e3779b97f4a7c15ull;
        x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
        x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
        return x ^ (x >> 31);
    };
    const double u1 = double((splitmix64(key + 2 * k) >> 11) + 1) * 0x1p-53;
    const double u2 = double(splitmix64(key + 2 * k + 1) >> 11) * 0x1p-53;
    const double r = std::sqrt(-2.0 * std::log(u1)), theta = 2.0 * M_PI * u2;
    z0 = r * std::cos(theta), z1 = r * std::sin(theta);
}

// =============================================================================================
// Shape lists

std::vector<AttentionShape> grid(const std::vector<std::pair<int, int>>& lengths,
                                 long long max_batched, const std::vector<int>& head_dims) {
    std::vector<AttentionShape> shapes;
    for (const auto& qk : lengths) {
        std::vector<std::pair<int, int>> batch_heads = {{1, 1}};  // (batch, heads)
        if (static_cast<long long>(qk.first) * qk.second <= max_batched) batch_heads.push_back({2, 3});
        for (const auto& bh : batch_heads)
            for (bool causal : {false, true})
                for (int d : head_dims)
                    shapes.push_back({bh.first, bh.second, qk.first, qk.second, d, causal});
    }
    return shapes;
}

std::vector<AttentionShape> forward_grid(const std::vector<int>& head_dims) {
    std::vector<std::pair<int, int>> lengths;
    for (int n : kForwardLengths) lengths.push_back({n, n});
    for (const auto& qk : kForwardUnequalLengths) lengths.push_back(qk);
    return grid(lengths, 257 * 257, head_dims);
}

std::vector<AttentionShape> backward_grid(const std::vector<int>& head_dims) {
    std::vector<std::pair<int, int>> lengths;
    for (int n : kBackwardLengths) lengths.push_back({n, n});
    for (const auto& qk : kBackwardUnequalLengths) lengths.push_back(qk);
    return grid(lengths, 100 * 100, head_dims);
}

std::vector<AttentionShape> share_of(const std::vector<AttentionShape>& all, Share share,
                                     const std::vector<std::array<int, 4>>& fast) {
    std::vector<AttentionShape> shapes;
    for (const AttentionShape& s : all) {
        const std::array<int, 4> key = {s.batch, s.heads, s.q_len, s.kv_len};
        const bool in_fast = std::find(fast.begin(), fast.end(), key) != fast.end();
        if (in_fast == (share == Share::fast)) shapes.push_back(s);
    }
    return shapes;
}

std::vector<AttentionShape> forward_grid(const std::vector<int>& head_dims, Share share) {
    return share_of(forward_grid(head_dims), share,
                    {{2, 3, 33, 33}, {1, 1, 257, 257}, {2, 3, 17, 257}, {2, 3, 100, 31}});
}

std::vector<AttentionShape> backward_grid(const std::vector<int>& head_dims, Share share) {
    return share_of(backward_grid(head_dims), share,
                    {{2, 3, 33, 33}, {1, 1, 257, 257}, {2, 3, 17, 100}, {2, 3, 255, 33}});
}

std::vector<AttentionShape> masking_shapes(const std::vector<int>& head_dims, Share share) {
    return share_of(masking_shapes(head_dims), share, {{2, 3, 100, 17}, {2, 3, 257, 256}});
}

std::vector<AttentionShape> sanitizer_shapes(const std::vector<int>& head_dims, int n) {
    return grid({{1, 1}, {17, 33}, {33, 17}, {n, n}}, static_cast<long long>(n) * n, head_dims);
}

std::vector<AttentionShape> masking_shapes(const std::vector<int>& head_dims) {
    std::vector<AttentionShape> shapes;
    for (const auto& qk : {std::make_pair(5, 1), std::make_pair(100, 17), std::make_pair(257, 256),
                           std::make_pair(1000, 1), std::make_pair(300, 64)})
        for (int d : head_dims) shapes.push_back({2, 3, qk.first, qk.second, d, true});
    return shapes;
}

std::vector<AttentionShape> determinism_shapes(int long_kv_len) {
    return {{2, 3, 257, 257, 64, true},  {1, 2, 100, long_kv_len, 128, false},
            {1, 1, 333, 77, 256, true},  {3, 1, 65, 129, 16, false},
            {1, 2, 200, 31, 32, false},  {1, 3, 96, 96, 96, true}};
}

// =============================================================================================
// Tolerances (derived in test_util.h)

Tolerances tolerances(const Problem<float>& p, Rounding rounding) {
    const double u = kUnitRoundoff, d = p.s.head_dim, N = p.s.kv_len, q = p.s.q_len;
    const bool aligned = rounding == Rounding::aligned;
    auto grow = [&](double n) { return aligned ? n : std::sqrt(n); };
    Tolerances t{};
    t.M = max_row_norm(p.Q, p.s.head_dim) * max_row_norm(p.K, p.s.head_dim) / std::sqrt(d);
    const double score = (aligned ? d : 1.0) * t.M;
    t.L = kSafety * u * (score + grow(N) + 8);
    t.O = t.L * max_abs(p.V);
    t.grad_rel = kSafety * u * (score + grow(N) + grow(q) + 8);
    const double noise = kSafety * u * max_row_norm(p.dO, p.s.head_dim) *
                         max_row_norm(p.V, p.s.head_dim) / std::sqrt(d);  // of dS, times 1/sqrt(d)
    t.dQ_floor = noise * (aligned ? N : 1.0) * max_abs(p.K);
    t.dK_floor = noise * grow(q) * max_abs(p.Q);
    return t;
}

template <typename T>
Tolerances tolerances16(const Problem<T>& p, const ScoreTerms& terms) {
    const Problem<double> x = converted<double>(p);  // the T values, exactly
    const double u = kUnitRoundoff, u16 = Format16<T>::unit_roundoff, d = p.s.head_dim,
                 N = p.s.kv_len;
    const double scale = terms.scale > 0 ? terms.scale : 1 / std::sqrt(d);
    Tolerances t{};
    t.M = max_row_norm(x.Q, p.s.head_dim) * max_row_norm(x.K, p.s.head_dim) * scale;
    t.L = 2 * d * u * t.M + softcap_term(terms, t.M) + terms.extra + kSafety * u * (std::sqrt(N) + 8);
    t.O = max_abs(x.V) * (3 * u16 + N * Format16<T>::tiny_weight_error + t.L);
    return t;
}
template Tolerances tolerances16(const Problem<__half>&, const ScoreTerms&);
template Tolerances tolerances16(const Problem<__nv_bfloat16>&, const ScoreTerms&);

template <typename T, typename W>
Tolerances backward_tolerances16(const Problem<T>& p, const Outputs<float>& got,
                                 const Outputs<W>& want, const ScoreTerms& terms) {
    Tolerances t = tolerances16(p, terms);  // M; the forward's own tol_L, tol_O (for O and L)
    const Problem<double> x = converted<double>(p);
    const int dim = p.s.head_dim;
    const double u = kUnitRoundoff, u16 = Format16<T>::unit_roundoff, d = dim, q = p.s.q_len;
    REQUIRE(x.dO.size() == q_elems(p.s));
    REQUIRE(got.O.size() == want.O.size());
    REQUIRE(got.L.size() == want.L.size());
    // (a) P recomputed from S (aligned fp32 sums) and from the forward's L, off by dL.
    double dL = 0;
    for (size_t i = 0; i < got.L.size(); ++i)
        if (std::isfinite(double(want.L[i])))
            dL = std::max(dL, std::fabs(got.L[i] - double(want.L[i])));
    const double eps = dL + 2 * d * u * t.M + softcap_term(terms, t.M) + terms.extra;
    const double scale = terms.scale > 0 ? terms.scale : 1 / std::sqrt(d);
    // (b) P, dS and each gradient rounded to T: 3 u16, with the statistical margin.
    t.grad_rel = kSafety16 * (3 * u16 + eps);
    // (c) D_i from the forward's O: its exact error over each row of dO, and its fp32 sum.
    double dD = 0;
    for (size_t row = 0; row < got.L.size(); ++row) {
        double e = 0;
        for (int c = 0; c < dim; ++c) {
            const size_t at = row * dim + c;
            e += x.dO[at] * (double(got.O[at]) - double(want.O[at]));
        }
        dD = std::max(dD, std::fabs(e));
    }
    dD += d * u * max_abs(x.dO) * max_abs(x.V);
    t.dQ_floor = 2 * dD * max_abs(x.K) * scale;
    t.dK_floor = 4 * dD * max_abs(x.Q) * std::sqrt(q) * scale;
    return t;
}
template Tolerances backward_tolerances16(const Problem<__half>&, const Outputs<float>&,
                                          const Outputs<double>&, const ScoreTerms&);
template Tolerances backward_tolerances16(const Problem<__nv_bfloat16>&, const Outputs<float>&,
                                          const Outputs<double>&, const ScoreTerms&);

// =============================================================================================
// Comparing tensors

FlatLayout q_layout(const AttentionShape& s, size_t first_bh) {
    return {s.heads, s.q_len, s.head_dim, "i", first_bh};
}
FlatLayout kv_layout(const AttentionShape& s, size_t first_bh) {
    return {flash_kv_heads(s), s.kv_len, s.head_dim, "j", first_bh};  // K/V heads (GQA)
}
FlatLayout l_layout(const AttentionShape& s, size_t first_bh) {
    return {s.heads, s.q_len, 1, "i", first_bh};
}

std::string where(const FlatLayout& l, size_t e) {
    if (l.heads <= 0 || l.rows <= 0 || l.row_len <= 0) return "(an empty tensor)";  // (no divisions)
    const size_t row = e / size_t(l.row_len), x = e % size_t(l.row_len);
    const size_t bh = l.first_bh + row / size_t(l.rows);
    std::ostringstream os;
    os << "(b=" << bh / size_t(l.heads) << ", h=" << bh % size_t(l.heads) << ", " << l.row << "="
       << row % size_t(l.rows);
    if (l.row_len > 1) os << ", x=" << x;
    os << ")";
    return os.str();
}

// The type the reference runs in for inputs of T: float for float (chapter 1's tolerances allow
// for its rounding of the results to float), double for chapter 2's types (on their exact values).
template <typename T>
using Reference = typename std::conditional<std::is_same<T, float>::value, float, double>::type;

// The tolerances for problem p in element type T (derived in test_util.h): fp32's (random
// rounding), or chapter 2's, whose backward tolerances read the GPU's O and L (got) beside the
// reference's (want).
template <typename T, typename W>
static Tolerances tolerances_of(const Problem<T>& p, const Outputs<float>& got,
                                const Outputs<W>& want, bool with_gradients) {
    if constexpr (std::is_same<T, float>::value) return tolerances(p, Rounding::random);
    else return with_gradients ? backward_tolerances16(p, got, want) : tolerances16(p);
}

template <typename T>
void check_against_reference(const Outputs<float>& got, const Problem<T>& p) {
    const auto want = reference_forward(converted<Reference<T>>(p));
    const Tolerances tol = tolerances_of(p, got, want, false);
    INFO(type_name<T>() << " forward, score bound M = " << tol.M << ": tolerance on O " << tol.O
                      << ", on L " << tol.L);
    check_forward(got, want, tol, p.s);
}

template <typename T>
void check_against_reference_backward(const Outputs<float>& got, const Problem<T>& p) {
    const auto want = reference_backward(converted<Reference<T>>(p));
    const Tolerances tol = tolerances_of(p, got, want, true);
    INFO(type_name<T>() << " backward, score bound M = " << tol.M << ": tolerance on O " << tol.O
                      << ", on L " << tol.L << "; gradients: " << tol.grad_rel
                      << " of the largest entry, + " << tol.dQ_floor << " on dQ, + "
                      << tol.dK_floor << " on dK");
    check_forward(got, want, tol, p.s);
    check_backward(got, want, tol, p.s);
}

void check_masked_rows(const char* name, const std::vector<float>& got, const AttentionShape& s,
                       int row_len, float value) {
    const int masked = masked_rows(s);
    REQUIRE(masked > 0);
    const FlatLayout layout{s.heads, s.q_len, row_len, "i", 0};
    const size_t heads = size_t(s.batch) * s.heads, per_head = size_t(s.q_len) * row_len;
    REQUIRE(got.size() == heads * per_head);
    size_t wrong = 0, first = 0;
    for (size_t bh = 0; bh < heads; ++bh)
        for (size_t e = bh * per_head; e < bh * per_head + size_t(masked) * row_len; ++e)
            if (!(got[e] == value) && wrong++ == 0) first = e;  // NaN != anything: caught
    INFO(name << " on " << describe(s) << ": rows 0.." << masked - 1 << " see no key and must be "
              << value << "; " << wrong << " element(s) are not, first at " << where(layout, first)
              << " = " << got[first]);
    CHECK_THAT(double(got[first]), Catch::Matchers::WithinAbs(double(value), 0.0));
}

void check_masked_rows(const Outputs<float>& got, const AttentionShape& s) {
    check_masked_rows("O", got.O, s, s.head_dim, 0.0f);
    check_masked_rows("L", got.L, s, 1, -std::numeric_limits<float>::infinity());
    if (!got.dQ.empty()) check_masked_rows("dQ", got.dQ, s, s.head_dim, 0.0f);
}

size_t count_bad(const std::vector<float>& v) {
    size_t n = 0;
    for (float x : v) n += !std::isfinite(x);
    return n;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() &&
           (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

bool bitwise_equal(const Outputs<float>& a, const Outputs<float>& b) {
    return bitwise_equal(a.O, b.O) && bitwise_equal(a.L, b.L) && bitwise_equal(a.dQ, b.dQ) &&
           bitwise_equal(a.dK, b.dK) && bitwise_equal(a.dV, b.dV);
}

void check_bitwise(const char* name, const std::vector<float>& a, const std::vector<float>& b,
                   const AttentionShape& s, const FlatLayout& layout) {
    REQUIRE(a.size() == b.size());
    const bool same = bitwise_equal(a, b);
    size_t first = 0;
    while (!same && first < a.size() &&
           std::memcmp(&a[first], &b[first], sizeof(float)) == 0)
        ++first;
    INFO(name << " on " << describe(s) << " differs between two identical calls, first at "
              << where(layout, first) << ": " << std::setprecision(9)
              << (same ? 0.f : a[first]) << " vs " << (same ? 0.f : b[first]));
    CHECK(same);
}

void check_bitwise(const Outputs<float>& first, const Outputs<float>& again,
                   const AttentionShape& s) {
    check_bitwise("O", first.O, again.O, s, q_layout(s));
    check_bitwise("L", first.L, again.L, s, l_layout(s));
    if (first.dQ.empty() && again.dQ.empty()) return;  // a forward's outputs alone
    check_bitwise("dQ", first.dQ, again.dQ, s, q_layout(s));
    check_bitwise("dK", first.dK, again.dK, s, kv_layout(s));
    check_bitwise("dV", first.dV, again.dV, s, kv_layout(s));
}

// =============================================================================================
// Device memory

std::string Kernel::name() const {
    switch (which) {
        case Public: return "the public call";
        case Chapter2: return "chapter 2's kernel";
        case Chapter3: return "chapter 3's kernel";
        case WithBc: return "Bc = " + std::to_string(Bc);
    }
    return "?";
}

template <typename T>
void launch_forward(const T* Q, const T* K, const T* V, T* O, float* L, const AttentionShape& s,
                    Kernel kernel, cudaStream_t stream) {
    if constexpr (std::is_same<T, float>::value) {
        switch (kernel.which) {
            case Kernel::Public: return flash_forward(Q, K, V, O, L, s, stream);
            case Kernel::WithBc: return flash_forward_bc(Q, K, V, O, L, s, kernel.Bc, stream);
            default: FAIL(kernel.name() << " asked of the fp32 forward: fp32 has chapter 1's only");
        }
    } else if constexpr (std::is_same<T, __half>::value) {
        switch (kernel.which) {
            case Kernel::Public: return flash_forward_fp16(Q, K, V, O, L, s, stream);
            case Kernel::Chapter2: return flash_forward_fp16_ampere(Q, K, V, O, L, s, stream);
            case Kernel::Chapter3: return flash_forward_fp16_hopper(Q, K, V, O, L, s, stream);
            case Kernel::WithBc: return flash_forward_fp16_bc(Q, K, V, O, L, s, kernel.Bc, stream);
        }
    } else {
        switch (kernel.which) {
            case Kernel::Public: return flash_forward_bf16(Q, K, V, O, L, s, stream);
            case Kernel::Chapter2: return flash_forward_bf16_ampere(Q, K, V, O, L, s, stream);
            case Kernel::Chapter3: return flash_forward_bf16_hopper(Q, K, V, O, L, s, stream);
            case Kernel::WithBc:
                FAIL(kernel.name() << " asked of the bf16 forward: there is no flash_forward_bf16_bc");
        }
    }
}

template <typename T>
void launch_backward(const T* Q, const T* K, const T* V, const T* O, const T* dO, const float* L,
                     T* dQ, T* dK, T* dV, const AttentionShape& s, Kernel kernel,
                     cudaStream_t stream) {
    if (kernel.which == Kernel::WithBc) {
        if constexpr (backward_takes_bc<T>())
            return flash_backward_fp16_bc(Q, K, V, O, dO, L, dQ, dK, dV, s, kernel.Bc, stream);
        FAIL(kernel.name() << " asked of the " << type_name<T>() << " backward: only fp16's takes "
                           "a caller-chosen Bc (flash_backward_fp16_bc)");
    }
    if constexpr (std::is_same<T, float>::value) {
        if (kernel.which != Kernel::Public)
            FAIL(kernel.name() << " asked of the fp32 backward: fp32 has chapter 1's only");
        flash_backward(Q, K, V, O, dO, L, dQ, dK, dV, s, stream);
    } else if constexpr (std::is_same<T, __half>::value) {
        switch (kernel.which) {
            case Kernel::Chapter2:
                return flash_backward_fp16_ampere(Q, K, V, O, dO, L, dQ, dK, dV, s, stream);
            case Kernel::Chapter3:
                return flash_backward_fp16_hopper(Q, K, V, O, dO, L, dQ, dK, dV, s, stream);
            default: return flash_backward_fp16(Q, K, V, O, dO, L, dQ, dK, dV, s, stream);
        }
    } else {
        switch (kernel.which) {
            case Kernel::Chapter2:
                return flash_backward_bf16_ampere(Q, K, V, O, dO, L, dQ, dK, dV, s, stream);
            case Kernel::Chapter3:
                return flash_backward_bf16_hopper(Q, K, V, O, dO, L, dQ, dK, dV, s, stream);
            default: return flash_backward_bf16(Q, K, V, O, dO, L, dQ, dK, dV, s, stream);
        }
    }
}

template <typename T>
Outputs<float> check_forward_on_gpu(const AttentionShape& s, uint32_t salt, Kernel kernel) {
    INFO(describe(s) << ", " << type_name<T>() << " forward, " << kernel.name());
    const auto p = rounded_problem<T>(s, salt, false);  // no dO
    GpuAttention<T> gpu(p);
    gpu.forward(kernel);
    const Outputs<float> got = gpu.outputs(false);
    check_against_reference(got, p);
    return got;
}

template <typename T>
Outputs<float> check_backward_on_gpu(const AttentionShape& s, uint32_t salt, Kernel kernel) {
    INFO(describe(s) << ", " << type_name<T>() << " forward and backward, " << kernel.name());
    const auto p = rounded_problem<T>(s, salt);
    GpuAttention<T> gpu(p);
    gpu.forward();        // the kernels' own O and L, which the backward reads
    gpu.backward(kernel);  // dQ, dK, dV poisoned with NaN first
    const Outputs<float> got = gpu.outputs(true);
    check_against_reference_backward(got, p);
    return got;
}

// =============================================================================================
// Waiting for the GPU, with a deadline

template <typename T>
GpuCall gpu_call(const char* direction, Kernel kernel, const AttentionShape& s) {
    int chapter = std::is_same<T, float>::value ? 1 : 2;
    if (kernel.which == Kernel::Chapter3) chapter = 3;
    if (chapter == 2 && kernel.which == Kernel::Public && public_forward_runs_hopper(s.head_dim))
        chapter = 3;
    return {direction, type_name<T>(), kernel, s, chapter};
}

double deadline_seconds(const GpuCall& call, double scale) {
    const AttentionShape& s = call.s;
    const double work = double(s.batch) * s.heads * s.q_len * s.kv_len * s.head_dim;
    const double flops = (std::strcmp(call.direction, "backward") == 0 ? 10.0 : 4.0) * work;
    return scale * (10.0 + flops / 1e11);
}

double deadline_scale_from_env() {
    const char* text = std::getenv("FLASH_TEST_DEADLINE_SCALE");
    if (!text) return 1.0;
    char* end = nullptr;
    const double scale = std::strtod(text, &end);
    return end != text && std::isfinite(scale) && scale > 0 ? scale : 1.0;
}

std::string likely_hang(const GpuCall& call) {
    if (call.chapter == 3 && std::strcmp(call.direction, "backward") == 0)
        return "chapter 3's backward: an mbarrier phase, arrival count or expected bytes (the "
               "producer's stages, K_j/V_j), a named barrier not every consumer reaches, or a turn "
               "into dQ_i that never comes (the ticket order, each block passing it once)";
    if (call.chapter == 3)
        return "chapter 3's pipeline: a consumer or the producer waits forever on an mbarrier: "
               "check a barrier's phase, its expected bytes or its arrival count, the stage a tile "
               "is read from or given back, and the tile counter";
    if (call.chapter == 2 && std::strcmp(call.direction, "backward") == 0)
        return "chapter 2's backward: a block waits forever for its turn to add into dQ_i: check "
               "the turn order (the turn each K/V tile waits for, the ticket, and that every "
               "block hands its turn on exactly once, after its adds)";
    return std::string("chapter ") + std::to_string(call.chapter) + "'s " + call.direction +
           ": a loop that never ends (a tile count or a bound) or a __syncthreads() that not "
           "every thread of the block reaches";
}

std::string deadline_message(const std::string& test_case, const GpuCall& call, double seconds) {
    std::ostringstream os;
    os << "DEADLINE: \"" << test_case << "\": the " << call.type << " " << call.direction << " ("
       << call.kernel.name() << ", chapter " << call.chapter << ") on " << describe(call.s)
       << " did not finish within " << std::setprecision(3) << seconds
       << " s; likely waiting forever: " << likely_hang(call);
    return os.str();
}

namespace {
// Test-case totals so far (the listener at the end of this file keeps them), for the summary line
// of a run that a deadline ends.
struct RunTotals {
    bool ended = false;
    std::size_t passed = 0, failed = 0;
};
RunTotals g_totals;
int g_gpu_cases_skipped = 0;
// One line of the FLASH_TEST_TABLE file (main's listener writes one a test case).
void table_line(const char* outcome, const std::string& name, const std::string& first_failure);
// The summary line; `unfinished` more test cases counted as failed (the one a deadline ends).
std::string summary_line(std::size_t unfinished = 0) {
    return "flash tests: " + std::to_string(g_totals.passed) + " passed, " +
           std::to_string(g_totals.failed + unfinished) + " failed, " +
           std::to_string(g_gpu_cases_skipped) + " skipped";
}
void print_summary_line() { std::cout << summary_line() << std::endl; }
// The last words of a run a deadline ends, the test case that never ends counted as failed,
// straight to the file descriptors: a reporter that captures output (junit, xml) has std::cout
// and std::cerr redirected into its buffers, which the exit would drop. Then the exit, running no
// destructor (they would call CUDA).
[[noreturn]] void say_and_exit(const std::string& line) {
    std::cout.flush();
    std::cerr.flush();
    const std::string err = line + "\n", out = summary_line(1) + "\n";
    if (write(STDERR_FILENO, err.data(), err.size()) < 0 ||
        write(STDOUT_FILENO, out.data(), out.size()) < 0)
        std::_Exit(4);
    std::_Exit(3);
}
}  // namespace

void end_run_on_deadline(const std::string& line) {
    // Fail the test where Catch shows it (its name, the INFO context: the shape), say so on
    // stderr too, print the summary line and end the process: a hung kernel cannot be cancelled,
    // and any later CUDA call (even the runtime's own at exit) would wait for it. Under -a or
    // -x N the failure makes Catch abort the run by throwing out of FAIL_CHECK, which would skip
    // the exit and leave the process waiting on the kernel at exit: the exit must come first.
    try {
        FAIL_CHECK(line);
    } catch (...) {  // Catch aborting the run (-a, -x N): the exit below still comes
    }
    table_line("FAIL", Catch::getResultCapture().getCurrentTestName(), line);
    say_and_exit(line);
}

namespace {
// The watchdog: two alarms, a GPU call's (a DeadlineGuard's) and the running GPU test case's
// (armed by main's listener as it starts, for a wait on the GPU that no guard covers: a test's own
// synchronising call, say). Its thread checks them ten times a second, and whichever passes first
// ends the run. It cannot call Catch (not thread-safe): it prints and exits on its own.
struct Alarm {
    bool armed = false;
    std::chrono::steady_clock::time_point until;
    std::string test_case, line;
};
struct Watchdog {
    std::mutex lock;
    Alarm call, test_case;
};
Watchdog g_watchdog;
[[noreturn]] void watch() {
    for (;;) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        std::string test_case, line;
        {
            const std::lock_guard<std::mutex> hold(g_watchdog.lock);
            const auto now = std::chrono::steady_clock::now();
            const Alarm* rung = nullptr;
            for (const Alarm* a : {&g_watchdog.call, &g_watchdog.test_case})
                if (a->armed && now >= a->until) rung = a;
            if (!rung) continue;
            test_case = rung->test_case;
            line = rung->line;
        }
        table_line("FAIL", test_case, line);
        say_and_exit(line);
    }
}
void set_alarm(Alarm& alarm, double seconds, const std::string& test_case, const std::string& line) {
    static std::once_flag started;
    std::call_once(started, [] { std::thread(watch).detach(); });
    const std::lock_guard<std::mutex> hold(g_watchdog.lock);
    alarm.armed = true;
    alarm.until = std::chrono::steady_clock::now() +
                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                      std::chrono::duration<double>(seconds));
    alarm.test_case = test_case;
    alarm.line = line;
}
void clear_alarm(Alarm& alarm) {
    const std::lock_guard<std::mutex> hold(g_watchdog.lock);
    alarm.armed = false;
}
}  // namespace

// The watchdog rings later than the call's deadline, so that where the host does reach
// wait_for_gpu's poll, the poll's failure (through Catch, with the test's context) comes first.
constexpr double kWatchdogMargin = 1.5;

DeadlineGuard::DeadlineGuard(const GpuCall& call) {
    const double seconds = kWatchdogMargin * deadline_seconds(call, deadline_scale_from_env());
    const std::string test_case = Catch::getResultCapture().getCurrentTestName();
    set_alarm(g_watchdog.call, seconds, test_case,
              deadline_message(test_case, call, seconds) +
                  " (the host was blocked in a CUDA call that waits for it)");
}
DeadlineGuard::~DeadlineGuard() { clear_alarm(g_watchdog.call); }

double test_case_seconds() {
    const char* text = std::getenv("FLASH_TEST_CASE_SECONDS");
    char* end = nullptr;
    const double seconds = text ? std::strtod(text, &end) : 0.0;
    if (text && end != text && std::isfinite(seconds) && seconds > 0) return seconds;
    return 300.0 * deadline_scale_from_env();
}

void wait_for_gpu(cudaStream_t stream, const GpuCall& call) {
    const DeadlineGuard guard(call);  // the host's own waits below are under the watchdog too
    cudaEvent_t done = nullptr;
    FLASH_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    cudaError_t status = cudaEventRecord(done, stream);
    const double seconds = deadline_seconds(call, deadline_scale_from_env());
    if (status == cudaSuccess) {
        using clock = std::chrono::steady_clock;
        const auto start = clock::now();
        status = poll_until([&] { return cudaEventQuery(done); },
                            [&] { return std::chrono::duration<double>(clock::now() - start).count(); },
                            [] { std::this_thread::sleep_for(std::chrono::microseconds(50)); },
                            seconds);
    }
    if (status == cudaErrorNotReady)  // never finished: the run ends here
        end_run_on_deadline(
            deadline_message(Catch::getResultCapture().getCurrentTestName(), call, seconds));
    cudaEventDestroy(done);
    FLASH_CUDA_CHECK(status);
    // The work is done, so this returns at once; but only a synchronising call lets the memory
    // pools take back what cudaFreeAsync gave them (an event query alone does not: seen on an
    // H200, where flash_release_scratch then found the kept pool's memory still held).
    FLASH_CUDA_CHECK(cudaStreamSynchronize(stream));
}

bool public_forward_runs_hopper(int head_dim) {
    return flash_hopper_built() && current_device_props().major == 9 &&
           head_dim_in(head_dim, kFlashHopperHeadDims);
}

// Fetched once a device: cudaGetDeviceProperties costs a millisecond or more a call (CUTLASS and
// cuDF measured 1 to 10 ms), and every wait for the GPU asks (gpu_call: does the public call run
// chapter 3?), thousands of times a run.
cudaDeviceProp current_device_props() {
    static std::mutex lock;
    static std::map<int, cudaDeviceProp> fetched;
    int dev = 0;
    FLASH_CUDA_CHECK(cudaGetDevice(&dev));
    const std::lock_guard<std::mutex> hold(lock);
    auto it = fetched.find(dev);
    if (it == fetched.end()) {
        cudaDeviceProp prop;
        FLASH_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
        it = fetched.emplace(dev, prop).first;
    }
    return it->second;
}

bool hopper_or_warn() {
    if (!flash_hopper_built()) {
        WARN("SKIPPED: chapter 3 was not built (nvcc without the sm_90a target, or make "
             "HAVE_SM90A=): flash_hopper.cu is left out");
        SUCCEED("not run here: chapter 3 not built");
        return false;
    }
    const cudaDeviceProp prop = current_device_props();
    if (prop.major == 9) return true;
    WARN("SKIPPED: chapter 3's Hopper forward needs compute capability 9.0; this GPU is "
         << prop.major << "." << prop.minor);
    SUCCEED("not run here: chapter 3 needs compute capability 9.0");
    return false;
}

// =============================================================================================
// Validation helpers

bool NamesWord::match(const std::string& msg) const {
    auto ident = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
    for (size_t at = msg.find(word_); at != std::string::npos; at = msg.find(word_, at + 1)) {
        const bool left = at == 0 || !ident(msg[at - 1]);
        const bool right = at + word_.size() == msg.size() || !ident(msg[at + word_.size()]);
        if (left && right) return true;
    }
    return false;
}

template <typename T>
FakeTensors<T>::FakeTensors() {
    T* inputs[] = {Q, K, V, dO};
    for (size_t t = 0; t < 4; ++t)
        for (size_t e = 0; e < kN; ++e) inputs[t][e] = T(float(t * 100 + e) + 0.5f);
    T* outs[] = {O, dQ, dK, dV};
    for (size_t t = 0; t < 4; ++t) {
        std::fill(outs[t], outs[t] + kN, quiet_nan<T>());
        std::memcpy(snapshot[t], outs[t], sizeof(snapshot[t]));
    }
    std::fill(L, L + kN, std::numeric_limits<float>::quiet_NaN());
    std::memcpy(snapshot_L, L, sizeof(snapshot_L));
}

template <typename T>
bool FakeTensors<T>::outputs_untouched() const {
    const T* outs[] = {O, dQ, dK, dV};
    for (size_t t = 0; t < 4; ++t)
        if (std::memcmp(snapshot[t], outs[t], sizeof(snapshot[t])) != 0) return false;
    return std::memcmp(snapshot_L, L, sizeof(snapshot_L)) == 0;
}
template struct FakeTensors<float>;
template struct FakeTensors<__half>;
template struct FakeTensors<__nv_bfloat16>;

// =============================================================================================
// The tile chooser

// One GPU's properties, as cudaGetDeviceProperties would give them (the fields the chooser reads).
static cudaDeviceProp gpu_props(const char* name, int major, int minor, int sms, size_t optin,
                                size_t per_sm, size_t reserved, int threads_per_sm) {
    cudaDeviceProp p;
    std::memset(&p, 0, sizeof p);
    std::strncpy(p.name, name, sizeof p.name - 1);
    p.major = major;
    p.minor = minor;
    p.multiProcessorCount = sms;
    p.sharedMemPerBlock = 49152;
    p.sharedMemPerBlockOptin = optin;
    p.sharedMemPerMultiprocessor = per_sm;
    p.reservedSharedMemPerBlock = reserved;
    p.maxThreadsPerBlock = 1024;
    p.maxThreadsPerMultiProcessor = threads_per_sm;
    p.regsPerMultiprocessor = 65536;
    p.regsPerBlock = 65536;
    p.warpSize = 32;
    return p;
}

std::vector<cudaDeviceProp> known_gpus() {
    return {gpu_props("Tesla T4", 7, 5, 40, 65536, 65536, 0, 1024),
            gpu_props("NVIDIA A100-SXM4-80GB", 8, 0, 108, 166912, 167936, 1024, 2048),
            gpu_props("NVIDIA GeForce RTX 4090", 8, 9, 128, 101376, 102400, 1024, 1536),
            gpu_props("NVIDIA H100 80GB HBM3", 9, 0, 132, 232448, 233472, 1024, 2048)};
}

void check_tile(const char* which, const FlashTile& t, const cudaDeviceProp& prop, int d) {
    INFO(which << " tile on " << prop.name << " (sm_" << prop.major << prop.minor
               << "), head_dim " << d << ": Br=" << t.Br << " Bc=" << t.Bc << " threads="
               << t.threads << " threads_per_row=" << t.threads_per_row
               << " shared_bytes=" << t.shared_bytes);
    CHECK(t.Br >= 1);
    CHECK(t.Bc >= 1);
    CHECK(t.threads >= 1);
    CHECK(t.threads % prop.warpSize == 0);  // whole warps
    CHECK(t.threads <= prop.maxThreadsPerBlock);
    CHECK(t.threads <= prop.maxThreadsPerMultiProcessor);
    CHECK(t.threads_per_row >= 1);
    CHECK(32 % t.threads_per_row == 0);         // a row's threads sit in one warp (shuffles)
    CHECK(t.threads % t.threads_per_row == 0);  // every thread belongs to one row
    CHECK(d % (4 * t.threads_per_row) == 0);    // a row splits into whole float4s per thread
    CHECK((t.Br * t.threads_per_row) % t.threads == 0);  // every thread owns as many rows
    CHECK(t.shared_bytes == 2 * size_t(t.Bc) * d * sizeof(float));  // K_j and V_j
    CHECK(t.shared_bytes <= prop.sharedMemPerBlockOptin);
    CHECK(t.shared_bytes + prop.reservedSharedMemPerBlock <= prop.sharedMemPerMultiprocessor);
}

void check_tile_fp16(const FlashTile& t, const cudaDeviceProp& prop, int d) {
    INFO("fp16 tile on " << prop.name << " (sm_" << prop.major << prop.minor << "), head_dim "
                         << d << ": Br=" << t.Br << " Bc=" << t.Bc << " threads=" << t.threads
                         << " threads_per_row=" << t.threads_per_row
                         << " shared_bytes=" << t.shared_bytes);
    CHECK(t.Br == (d <= 128 ? 128 : 64));  // four warps of two mma tiles of 16 rows (one at 256)
    CHECK(t.threads == 128);               // four warps
    CHECK(t.threads_per_row == 4);         // an mma fragment spreads a row over 4 threads
    CHECK((t.Bc == 32 || t.Bc == 64 || (t.Bc == 128 && d <= 64)));  // registers: M (d + Bc) / 2
    CHECK(t.shared_bytes == size_t(t.Br + 4 * t.Bc) * (d + 8) * sizeof(__half));
    CHECK(t.shared_bytes <= prop.sharedMemPerBlockOptin);
    CHECK(t.shared_bytes + prop.reservedSharedMemPerBlock <= prop.sharedMemPerMultiprocessor);
}

size_t fp16_backward_bytes(int d, int Bc, int Br) {
    return size_t(2 * Bc + 4 * Br) * (d + 8) * sizeof(__half) +
           size_t(2 * Bc) * (Br + 8) * sizeof(__half) + 4 * Br * sizeof(float);
}

void check_tile_fp16_backward(const FlashTile& t, const cudaDeviceProp& prop, int d) {
    INFO("fp16 backward tile on " << prop.name << " (sm_" << prop.major << prop.minor
                                  << "), head_dim " << d << ": Br=" << t.Br << " Bc=" << t.Bc
                                  << " threads=" << t.threads << " threads_per_row="
                                  << t.threads_per_row << " shared_bytes=" << t.shared_bytes);
    // (Bc, Br), best first, as the comment in test_util.h lists them.
    std::vector<std::pair<int, int>> list = {{128, 64}, {64, 64}};
    if (d == 16) list = {{64, 64}};
    if (d == 64) list = {{128, 128}, {128, 64}, {64, 64}};
    if (d == 256) list = {{64, 64}, {64, 32}};
    size_t n = 0;
    while (n < list.size() && list[n] != std::make_pair(t.Bc, t.Br)) n++;
    REQUIRE(n < list.size());                                  // a tile of the list
    for (size_t k = 0; k < n; k++)                              // and no better one fits
        CHECK(fp16_backward_bytes(d, list[k].first, list[k].second) > prop.sharedMemPerBlockOptin);
    CHECK(t.threads == 32 * (d == 256 ? 8 : t.Bc / 16));        // a warp per 16 keys, 8 at d = 256
    CHECK(t.threads_per_row == 4);  // an mma fragment spreads a row over 4 threads
    CHECK(t.shared_bytes == fp16_backward_bytes(d, t.Bc, t.Br));
    CHECK(t.shared_bytes <= prop.sharedMemPerBlockOptin);
    CHECK(t.shared_bytes + prop.reservedSharedMemPerBlock <= prop.sharedMemPerMultiprocessor);
}

// =============================================================================================
// Big tensors

std::vector<float> random_pattern(uint32_t seed) {
    std::mt19937 rng(seed);
    return normal_values<float>(kPatternLength, rng);
}

template <typename T>
void check_big_head(const GpuAttention<T>& gpu, size_t bh,
                    const std::vector<std::vector<T>>& patterns, bool with_gradients) {
    const AttentionShape& s = gpu.s;
    const size_t d = s.head_dim, q_head = size_t(s.q_len) * d, kv_head = size_t(s.kv_len) * d;
    Problem<T> one{{1, 1, s.q_len, s.kv_len, s.head_dim, s.causal}, {}, {}, {}, {}};
    one.Q = pattern_slice(patterns[0], bh * q_head, q_head);
    one.K = pattern_slice(patterns[1], bh * kv_head, kv_head);
    one.V = pattern_slice(patterns[2], bh * kv_head, kv_head);
    if (with_gradients) one.dO = pattern_slice(patterns[3], bh * q_head, q_head);
    // The reference runs on the float inputs as they are (fp32), or in double on the exact values
    // (fp16, bf16): converted<float> of floats is a plain copy.
    const Problem<Reference<T>> exact = converted<Reference<T>>(one);
    const Outputs<Reference<T>> want =
        with_gradients ? reference_backward(exact) : reference_forward(exact);
    Outputs<float> got;
    got.O = gpu.O.download_float(bh * q_head, q_head);
    got.L = gpu.L.download(bh * s.q_len, s.q_len);
    const Tolerances tol = tolerances_of(one, got, want, with_gradients);
    INFO(type_name<T>() << (with_gradients ? " forward and backward" : " forward") << ", head "
                      << bh << " of " << size_t(s.batch) * s.heads << " (elements from "
                      << bh * q_head << ")");
    check_close("O", got.O, want.O, tol.O, s, q_layout(s, bh));
    check_close("L", got.L, want.L, tol.L, s, l_layout(s, bh));
    if (!with_gradients) return;
    got.dQ = gpu.dQ.download_float(bh * q_head, q_head);
    got.dK = gpu.dK.download_float(bh * kv_head, kv_head);
    got.dV = gpu.dV.download_float(bh * kv_head, kv_head);
    check_close("dQ", got.dQ, want.dQ, tol.grad_rel * max_abs(want.dQ) + tol.dQ_floor, s,
                q_layout(s, bh));
    check_close("dK", got.dK, want.dK, tol.grad_rel * max_abs(want.dK) + tol.dK_floor, s,
                kv_layout(s, bh));
    check_close("dV", got.dV, want.dV, tol.grad_rel * max_abs(want.dV), s, kv_layout(s, bh));
}

// The generic helpers above, for every element type the tests run: float, __half, __nv_bfloat16.
#define FLASH_TEST_INSTANTIATE(T)                                                                  \
    template void launch_forward(const T*, const T*, const T*, T*, float*,                         \
                                 const AttentionShape&, Kernel, cudaStream_t);                     \
    template void launch_backward(const T*, const T*, const T*, const T*, const T*, const float*,  \
                                  T*, T*, T*, const AttentionShape&, Kernel, cudaStream_t);        \
    template GpuCall gpu_call<T>(const char*, Kernel, const AttentionShape&);                      \
    template void check_against_reference(const Outputs<float>&, const Problem<T>&);               \
    template void check_against_reference_backward(const Outputs<float>&, const Problem<T>&);      \
    template Outputs<float> check_forward_on_gpu<T>(const AttentionShape&, uint32_t, Kernel);      \
    template Outputs<float> check_backward_on_gpu<T>(const AttentionShape&, uint32_t, Kernel);     \
    template void check_big_head(const GpuAttention<T>&, size_t,                                   \
                                 const std::vector<std::vector<T>>&, bool);
FLASH_TEST_INSTANTIATE(float)
FLASH_TEST_INSTANTIATE(__half)
FLASH_TEST_INSTANTIATE(__nv_bfloat16)
#undef FLASH_TEST_INSTANTIATE

// =============================================================================================
// Source files

std::vector<std::string> source_lines(const std::string& name) {
    const std::string here = __FILE__;
    const size_t slash = here.find_last_of('/');
    std::ifstream in(slash == std::string::npos ? name : here.substr(0, slash + 1) + name);
    if (!in) in.open(name);
    INFO("opening " << name);
    REQUIRE(in.good());
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);) {
        const size_t b = line.find_first_not_of(" \t"), e = line.find_last_not_of(" \t\r");
        lines.push_back(b == std::string::npos ? "" : line.substr(b, e - b + 1));
    }
    return lines;
}

// =============================================================================================
// main: leaves out the [gpu] tests when there is no usable device (one line says so), fails a
// test case that asserts nothing, and ends with one summary line

namespace {
// The test cases a run selects: Catch's default (every test case but the hidden ones) or those its
// test spec matches, as Catch itself picks them.
std::vector<Catch::TestCase> selected_test_cases(Catch::Session& session) {
    const Catch::IConfig& config = session.config();
    return Catch::filterTests(Catch::getAllTestCasesSorted(config), config.testSpec(), config);
}
bool is_gpu_test(const Catch::TestCaseInfo& tc) {
    return std::find(tc.lcaseTags.begin(), tc.lcaseTags.end(), "gpu") != tc.lcaseTags.end();
}
// A spec's alternatives, its comma-separated terms (commas inside quotes or escaped are a name's
// own), each with [gpu] left out; an alternative that then selects nothing is dropped, so that
// Catch does not report it as matching no test case.
std::string without_gpu(const Catch::ConfigData& given, const std::string& spec) {
    std::vector<std::string> terms(1);
    bool quoted = false;
    for (size_t k = 0; k < spec.size(); ++k) {
        const char c = spec[k];
        if (c == '\\' && k + 1 < spec.size()) {
            terms.back() += c;
            terms.back() += spec[++k];
            continue;
        }
        if (c == '"') quoted = !quoted;
        if (c == ',' && !quoted) terms.emplace_back();
        else terms.back() += c;
    }
    std::string out;
    for (const std::string& term : terms) {
        Catch::ConfigData one = given;
        one.testsOrTags = {term + "~[gpu]"};
        const Catch::Config config(one);
        if (Catch::filterTests(Catch::getAllTestCasesSorted(config), config.testSpec(), config)
                .empty())
            continue;
        out += (out.empty() ? "" : ",") + term + "~[gpu]";
    }
    return out;
}
// A test case's name as a test spec matches it exactly: the spec's special characters escaped.
std::string exact_spec(const std::string& name) {
    std::string spec;
    for (char c : name) {
        if (std::strchr("\\,[]~*\"", c)) spec += '\\';
        spec += c;
    }
    return spec;
}

// Records the run's test-case totals, as they come (for a run a deadline ends) and at the end;
// main prints them after Catch's own summary, so that the summary line is the very last line.
// With FLASH_TEST_TABLE=FILE it also writes FILE: one line a test case as it ends, "PASS" or
// "FAIL", its name, and its first failure's expression or message (the exercises' tables).
struct SummaryListener : Catch::TestEventListenerBase {
    using TestEventListenerBase::TestEventListenerBase;
    std::string first_failure;
    void testCaseStarting(Catch::TestCaseInfo const& info) override {
        first_failure.clear();
        TestEventListenerBase::testCaseStarting(info);
        // The GPU test cases (a CPU test case cannot wait on a kernel; the reference's own
        // timing runs long on purpose), or every test case where FLASH_TEST_CASE_SECONDS is set.
        if (!is_gpu_test(info) && !std::getenv("FLASH_TEST_CASE_SECONDS")) return;
        const double seconds = test_case_seconds();
        std::ostringstream line;
        line << "DEADLINE: \"" << info.name << "\" did not end within " << seconds
             << " s (FLASH_TEST_CASE_SECONDS): likely a kernel that never finishes, waited for "
                "by a CUDA call outside the harness's guarded calls";
        set_alarm(g_watchdog.test_case, seconds, info.name, line.str());
    }
    bool assertionEnded(Catch::AssertionStats const& stats) override {
        const Catch::AssertionResult& r = stats.assertionResult;
        if (!r.isOk() && first_failure.empty()) {
            std::string what = r.hasExpression() ? r.getExpressionInMacro() : std::string();
            if (r.hasMessage()) what += (what.empty() ? "" : ": ") + r.getMessage();
            for (const Catch::MessageInfo& m : stats.infoMessages)
                if (m.type == Catch::ResultWas::Info) what += " [" + m.message + "]";
            first_failure = what.empty() ? "failed" : what;
        }
        return TestEventListenerBase::assertionEnded(stats);
    }
    void testCaseEnded(Catch::TestCaseStats const& stats) override {
        clear_alarm(g_watchdog.test_case);
        const bool failed = stats.totals.testCases.failed > 0;
        (failed ? g_totals.failed : g_totals.passed) += 1;
        table_line(failed ? "FAIL" : "PASS", stats.testInfo.name, failed ? first_failure : "");
        TestEventListenerBase::testCaseEnded(stats);
    }
    void testRunEnded(Catch::TestRunStats const& stats) override {
        g_totals.ended = true;
        g_totals.passed = stats.totals.testCases.passed + stats.totals.testCases.failedButOk;
        g_totals.failed = stats.totals.testCases.failed;
        TestEventListenerBase::testRunEnded(stats);
    }
};
}  // namespace
CATCH_REGISTER_LISTENER(SummaryListener)

namespace {
// Runs only the CPU test cases of the selection (cpu_specs: their exact names): the selection's
// own spec with ~[gpu] in every alternative (Catch's default, no spec: ~[gpu]~[.], hidden ones
// left out as it does), where that selects exactly those; else their names (Catch ANDs separate
// spec strings; a "," between them makes an OR, as its --input-file does).
void select_cpu_tests(Catch::Session& session, const std::vector<std::string>& cpu_specs) {
    const Catch::ConfigData given = session.configData();
    Catch::ConfigData narrowed = given;
    if (given.testsOrTags.size() <= 1) {
        narrowed.testsOrTags = {given.testsOrTags.empty()
                                    ? std::string("~[gpu]~[.]")
                                    : without_gpu(given, given.testsOrTags[0])};
        session.useConfigData(narrowed);
        if (selected_test_cases(session).size() == cpu_specs.size()) return;
    }
    narrowed.testsOrTags.clear();
    for (const std::string& spec : cpu_specs) {
        if (!narrowed.testsOrTags.empty()) narrowed.testsOrTags.push_back(",");
        narrowed.testsOrTags.push_back(spec);
    }
    session.useConfigData(narrowed);
}

void table_line(const char* outcome, const std::string& name, const std::string& first_failure) {
    static const char* path = std::getenv("FLASH_TEST_TABLE");
    if (!path || !*path) return;
    std::ofstream table(path, std::ios::app);
    std::string flat = first_failure;  // one line: the message's line breaks become " / "
    for (std::string::size_type at; (at = flat.find('\n')) != std::string::npos;)
        flat.replace(at, 1, " / ");
    table << outcome << " | " << name << (flat.empty() ? "" : " | " + flat) << '\n';
}

// The run's exit: Catch's result, the summary line last.
int finish(int result) {
    if (g_totals.ended) print_summary_line();
    return result;
}
}  // namespace

int main(int argc, char* argv[]) {
    Catch::Session session;
    if (int rc = session.applyCommandLine(argc, argv)) return rc;
    // Every run of a test case must check something (Catch's --warn NoAssertions, always on): a
    // test that returns early by mistake fails instead of passing silently.
    session.configData().warnings = static_cast<Catch::WarnAbout::What>(
        session.configData().warnings | Catch::WarnAbout::NoAssertions);

    int devices = 0;
    const cudaError_t err = cudaGetDeviceCount(&devices);
    if (err == cudaSuccess && devices > 0) {
        cudaDeviceProp prop;
        int dev = 0;
        if (cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&prop, dev) == cudaSuccess)
            std::cout << "CUDA device " << dev << ": " << prop.name << " (sm_" << prop.major
                      << prop.minor << ", " << prop.multiProcessorCount << " SMs, "
                      << std::setprecision(3) << prop.totalGlobalMem / double(1 << 30)
                      << " GiB)" << std::endl;
    } else {
        // No driver (cudaErrorInsufficientDriver, cudaErrorNoDevice, ...) or no device: of the
        // test cases the run selects (whatever its test spec), the CPU ones run and the [gpu] ones
        // are left out, and one line says how many of each and why. cudaDriverGetVersion gives 0
        // where no driver is installed at all: then the runtime's "driver version is
        // insufficient" would send a student to upgrade a driver they lack.
        int driver = 0;
        cudaDriverGetVersion(&driver);
        const std::string why = driver == 0          ? std::string("no NVIDIA driver is installed")
                                : err != cudaSuccess ? std::string(cudaGetErrorString(err))
                                                     : std::string("the driver sees no GPU");
        cudaGetLastError();  // clear the error so that nothing later trips on it
        const Catch::ConfigData& config = session.configData();
        const bool listing = config.listTests || config.listTestNamesOnly || config.listTags ||
                             config.listReporters;
        if (!listing) {  // --list-tests and friends list everything, [gpu] included
            std::vector<std::string> cpu_specs;
            for (const Catch::TestCase& tc : selected_test_cases(session)) {
                if (is_gpu_test(tc)) ++g_gpu_cases_skipped;
                else cpu_specs.push_back(exact_spec(tc.name));
            }
            if (g_gpu_cases_skipped == 0) return finish(session.run());  // nothing to leave out
            std::cout << "No CUDA GPU or driver found (" << why << "): running the "
                      << cpu_specs.size() << " CPU test cases selected; skipping the "
                      << g_gpu_cases_skipped << " GPU test cases (they need an NVIDIA GPU and "
                         "its driver: compute capability 7.5+; 8.0+ for chapter 2; 9.0 for "
                         "chapter 3)" << std::endl;
            if (cpu_specs.empty()) {  // nothing to run: that is not a failure here
                print_summary_line();
                return 0;
            }
            select_cpu_tests(session, cpu_specs);
        }
    }
    return finish(session.run());
}

std::string forward_refusal(FakeTensors<__half>& t, const AttentionShape& s,
                            const AttentionOptions& o) {
    return refusal([&] { flash_forward_fp16(t.Q, t.K, t.V, t.O, t.L, s, o); });
}
std::string backward_refusal(FakeTensors<__half>& t, const AttentionShape& s,
                             const AttentionOptions& o) {
    return refusal([&] {
        flash_backward_fp16(t.Q, t.K, t.V, t.O, t.dO, t.L, t.dQ, t.dK, t.dV, s, o);
    });
}
