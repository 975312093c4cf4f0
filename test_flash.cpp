// test_flash.cpp: the test suite (Catch2 v2). `make test` builds and runs it.
//
//   [cpu]  run everywhere: the CPU reference against facts derivable by hand and against finite
//          differences, the tile chooser on four real GPUs' figures, and argument validation
//          (which happens before any CUDA call, so it needs no GPU).
//   [gpu]  need a CUDA device: the kernels against the reference over grids of shapes, fully
//          masked rows, determinism, the caller-chosen Bc, extreme values ([hardening]) and
//          tensors past 65535 heads and 2^31 elements ([big]).
// With no usable CUDA device the [gpu] tests are left out (one line says so) unless a test spec
// is given on the command line. The last line printed is always
//   flash tests: N passed, M failed, K skipped
// Examples: ./test_flash [cpu]     ./test_flash "[gpu]~[big]"     ./test_flash -s "[tile]"

#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "flash.h"

#include <algorithm>
#include <chrono>
#include <cctype>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

using Catch::Matchers::Contains;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;

namespace {

// =============================================================================================
// Shapes and random inputs

std::string describe(const AttentionShape& s) {
    std::ostringstream os;
    os << "shape (b=" << s.batch << ", h=" << s.heads << ", q_len=" << s.q_len
       << ", kv_len=" << s.kv_len << ", d=" << s.head_dim << ", causal=" << (s.causal ? 1 : 0)
       << ")";
    return os.str();
}

// Rows at the top of each head that see no key: with causal masking and q_len > kv_len, query i
// sees key j iff j <= i + kv_len - q_len, so rows 0 .. q_len - kv_len - 1 see nothing.
int masked_rows(const AttentionShape& s) {
    return s.causal && s.q_len > s.kv_len ? s.q_len - s.kv_len : 0;
}

// A seed of its own for every shape (and test), so every case gets fresh inputs, the same on
// every run.
uint32_t seed_of(const AttentionShape& s, uint32_t salt) {
    uint32_t h = 2166136261u;  // FNV-1a over the fields
    for (int v : {s.batch, s.heads, s.q_len, s.kv_len, s.head_dim, int(s.causal), int(salt)}) {
        h ^= static_cast<uint32_t>(v);
        h *= 16777619u;
    }
    return h;
}

template <typename T>
std::vector<T> normal_values(size_t n, std::mt19937& rng) {
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<T> v(n);
    for (auto& x : v) x = static_cast<T>(normal(rng));
    return v;
}

// One attention problem on the host: inputs and an upstream gradient dO, all random N(0, 1).
template <typename T>
struct Problem {
    AttentionShape s;
    std::vector<T> Q, K, V, dO;
};

template <typename T = float>
Problem<T> random_problem(const AttentionShape& s, uint32_t salt) {
    std::mt19937 rng(seed_of(s, salt));
    Problem<T> p{s, {}, {}, {}, {}};
    p.Q = normal_values<T>(q_elems(s), rng);
    p.K = normal_values<T>(kv_elems(s), rng);
    p.V = normal_values<T>(kv_elems(s), rng);
    p.dO = normal_values<T>(q_elems(s), rng);
    return p;
}

template <typename T>
struct Outputs {
    std::vector<T> O, L, dQ, dK, dV;
};

template <typename T>
Outputs<T> reference_forward(const Problem<T>& p) {
    Outputs<T> r;
    r.O.assign(q_elems(p.s), T(0));
    r.L.assign(l_elems(p.s), T(0));
    attention_reference(p.Q.data(), p.K.data(), p.V.data(), r.O.data(), r.L.data(), p.s);
    return r;
}

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
constexpr double kUnitRoundoff = 1.0 / (1 << 24);
constexpr double kSafety = 32.0;

enum class Rounding { random, aligned };

struct Tolerances {
    double M;                   // max|Q_i| max|K_j| / sqrt(d): bounds every |S_ij|
    double L, O;                // absolute
    double grad_rel;            // relative to the reference gradient's largest entry
    double dQ_floor, dK_floor;  // absolute floors for dQ and dK (see above)
};

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

// =============================================================================================
// Comparing tensors

// How a flat tensor maps to (b, h, row, x), to say where an element is.
struct Layout {
    int heads;         // heads per batch: splits a batch*head index into (b, h)
    int rows;          // rows per head: q_len or kv_len
    int row_len;       // head_dim, or 1 for L
    const char* row;   // "i" (a query row) or "j" (a key row)
    size_t first_bh;   // batch*head index of the vector's first head (when it holds a slice)
};
Layout q_layout(const AttentionShape& s, size_t first_bh = 0) {
    return {s.heads, s.q_len, s.head_dim, "i", first_bh};
}
Layout kv_layout(const AttentionShape& s, size_t first_bh = 0) {
    return {s.heads, s.kv_len, s.head_dim, "j", first_bh};
}
Layout l_layout(const AttentionShape& s, size_t first_bh = 0) {
    return {s.heads, s.q_len, 1, "i", first_bh};
}

std::string where(const Layout& l, size_t e) {
    const size_t row = e / size_t(l.row_len), x = e % size_t(l.row_len);
    const size_t bh = l.first_bh + row / size_t(l.rows);
    std::ostringstream os;
    os << "(b=" << bh / size_t(l.heads) << ", h=" << bh % size_t(l.heads) << ", " << l.row << "="
       << row % size_t(l.rows);
    if (l.row_len > 1) os << ", x=" << x;
    os << ")";
    return os.str();
}

// The one comparison every test uses: `got` (the GPU's, or the value under test) against `want`
// (the reference's), element by element. Every element must be written (not NaN: outputs are
// poisoned with NaN before each call), an infinite `want` (L = -inf for a row that sees nothing)
// must be matched exactly, and the rest must agree within `tol`. It asserts on the worst element
// (through WithinAbs), or on the count of NaN when there are any, and on failure says which
// tensor, the shape, the worst error and where it is, and how many elements are out of tolerance
// or unwritten.
template <typename T>
void check_close(const char* name, const std::vector<T>& got, const std::vector<T>& want,
                 double tol, const AttentionShape& s, const Layout& layout) {
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
        CHECK_THAT(double(got[worst]), WithinAbs(double(want[worst]), tol));
}

// Rows 0 .. masked-1 of every head must hold exactly `value` (0 for O and dQ, -inf for L).
void check_masked_rows(const char* name, const std::vector<float>& got, const AttentionShape& s,
                       int row_len, float value) {
    const int masked = masked_rows(s);
    REQUIRE(masked > 0);
    const Layout layout{s.heads, s.q_len, row_len, "i", 0};
    const size_t heads = size_t(s.batch) * s.heads, per_head = size_t(s.q_len) * row_len;
    REQUIRE(got.size() == heads * per_head);
    size_t wrong = 0, first = 0;
    for (size_t bh = 0; bh < heads; ++bh)
        for (size_t e = bh * per_head; e < bh * per_head + size_t(masked) * row_len; ++e)
            if (!(got[e] == value) && wrong++ == 0) first = e;  // NaN != anything: caught
    INFO(name << " on " << describe(s) << ": rows 0.." << masked - 1 << " see no key and must be "
              << value << "; " << wrong << " element(s) are not, first at " << where(layout, first)
              << " = " << got[first]);
    CHECK_THAT(double(got[first]), WithinAbs(double(value), 0.0));
}

// How many elements are NaN (e.g. still the poison: never written) or infinite.
size_t count_bad(const std::vector<float>& v) {
    size_t n = 0;
    for (float x : v) n += !std::isfinite(x);
    return n;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Two results that must be bitwise identical (the kernels are deterministic: no atomics).
void check_bitwise(const char* name, const std::vector<float>& a, const std::vector<float>& b,
                   const AttentionShape& s, const Layout& layout) {
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

// =============================================================================================
// Device memory

// A float array on the GPU: cudaMalloc in the constructor, cudaFree in the destructor.
struct DeviceBuffer {
    float* ptr = nullptr;
    size_t count = 0;

    DeviceBuffer() = default;
    explicit DeviceBuffer(size_t n) : count(n) {
        FLASH_CUDA_CHECK(cudaMalloc(&ptr, n * sizeof(float)));
    }
    explicit DeviceBuffer(const std::vector<float>& host) : DeviceBuffer(host.size()) {
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

    void upload(const std::vector<float>& host, size_t offset = 0) {
        REQUIRE(offset + host.size() <= count);
        FLASH_CUDA_CHECK(cudaMemcpy(ptr + offset, host.data(), host.size() * sizeof(float),
                                    cudaMemcpyHostToDevice));
    }
    // n elements from offset (all of it by default).
    std::vector<float> download(size_t offset = 0, size_t n = SIZE_MAX) const {
        if (n == SIZE_MAX) n = count - offset;
        REQUIRE(offset + n <= count);
        std::vector<float> host(n);
        FLASH_CUDA_CHECK(cudaMemcpy(host.data(), ptr + offset, n * sizeof(float),
                                    cudaMemcpyDeviceToHost));
        return host;
    }
    // Element e becomes pattern[e % pattern.size()] (for tensors too big to build on the host).
    void fill_repeating(const std::vector<float>& pattern) {
        for (size_t at = 0; at < count; at += pattern.size()) {
            const size_t n = std::min(pattern.size(), count - at);
            FLASH_CUDA_CHECK(cudaMemcpy(ptr + at, pattern.data(), n * sizeof(float),
                                        cudaMemcpyHostToDevice));
        }
    }
    // Every element NaN, copied from the host (cudaMemset cannot write a float NaN), so that an
    // element a kernel forgets to write shows up.
    void poison() {
        fill_repeating(std::vector<float>(std::min<size_t>(count, size_t(1) << 22),
                                          std::numeric_limits<float>::quiet_NaN()));
    }
};

// One problem on the GPU: inputs uploaded once; forward() and backward() poison their outputs,
// run the kernels and wait for them. dO, dQ, dK and dV are allocated only for a backward.
struct GpuAttention {
    AttentionShape s;
    DeviceBuffer Q, K, V, O, L, dO, dQ, dK, dV;

    // Inputs left for the caller to fill.
    explicit GpuAttention(const AttentionShape& shape)
        : s(shape), Q(q_elems(shape)), K(kv_elems(shape)), V(kv_elems(shape)),
          O(q_elems(shape)), L(l_elems(shape)) {}
    explicit GpuAttention(const Problem<float>& p) : GpuAttention(p.s) {
        Q.upload(p.Q);
        K.upload(p.K);
        V.upload(p.V);
        if (!p.dO.empty()) dO = DeviceBuffer(p.dO);
    }

    // Bc = 0: flash_forward (the device's own tile); Bc > 0: flash_forward_bc.
    void forward(int Bc = 0, cudaStream_t stream = 0) {
        O.poison();
        L.poison();
        if (Bc > 0)
            flash_forward_bc(Q.ptr, K.ptr, V.ptr, O.ptr, L.ptr, s, Bc, stream);
        else
            flash_forward(Q.ptr, K.ptr, V.ptr, O.ptr, L.ptr, s, stream);
        FLASH_CUDA_CHECK(cudaGetLastError());
        FLASH_CUDA_CHECK(cudaDeviceSynchronize());
    }
    // Uses O and L as the last forward() left them.
    void backward(cudaStream_t stream = 0) {
        REQUIRE(dO.count == q_elems(s));
        if (dQ.count == 0) {
            dQ = DeviceBuffer(q_elems(s));
            dK = DeviceBuffer(kv_elems(s));
            dV = DeviceBuffer(kv_elems(s));
        }
        dQ.poison();
        dK.poison();
        dV.poison();
        flash_backward(Q.ptr, K.ptr, V.ptr, O.ptr, dO.ptr, L.ptr, dQ.ptr, dK.ptr, dV.ptr, s,
                       stream);
        FLASH_CUDA_CHECK(cudaGetLastError());
        FLASH_CUDA_CHECK(cudaDeviceSynchronize());
    }
    Outputs<float> outputs(bool with_gradients) const {
        Outputs<float> r;
        r.O = O.download();
        r.L = L.download();
        if (with_gradients) {
            r.dQ = dQ.download();
            r.dK = dK.download();
            r.dV = dV.download();
        }
        return r;
    }
};

// The forward's outputs against the reference's.
void check_forward(const Outputs<float>& got, const Outputs<float>& want, const Tolerances& tol,
                   const AttentionShape& s) {
    check_close("O", got.O, want.O, tol.O, s, q_layout(s));
    check_close("L", got.L, want.L, tol.L, s, l_layout(s));
}

// The backward's outputs against the reference's.
void check_backward(const Outputs<float>& got, const Outputs<float>& want, const Tolerances& tol,
                    const AttentionShape& s) {
    check_close("dQ", got.dQ, want.dQ, tol.grad_rel * max_abs(want.dQ) + tol.dQ_floor, s,
                q_layout(s));
    check_close("dK", got.dK, want.dK, tol.grad_rel * max_abs(want.dK) + tol.dK_floor, s,
                kv_layout(s));
    check_close("dV", got.dV, want.dV, tol.grad_rel * max_abs(want.dV), s, kv_layout(s));
}

// =============================================================================================
// Shape grids for the GPU tests. The CPU reference costs about batch*heads * q_len * kv_len *
// head_dim, so the long sequences get one head only: the whole [gpu] suite's reference work stays
// a few seconds on one core (the hidden test [.timing] measures it).

struct GridShape {
    int batch, heads, q_len, kv_len;
};

// Fresh random inputs for shape s; forward and backward on the GPU; every output against the
// reference (the backward grid and the sanitizer subset share it).
void check_forward_and_backward(const AttentionShape& s, uint32_t salt) {
    INFO(describe(s));
    const auto p = random_problem(s, salt);
    GpuAttention gpu(p);
    gpu.forward();
    gpu.backward();
    const auto got = gpu.outputs(true);
    const auto want = reference_backward(p);
    const Tolerances tol = tolerances(p, Rounding::random);
    check_forward(got, want, tol, s);
    check_backward(got, want, tol, s);
}

std::vector<GridShape> grid(const std::vector<std::pair<int, int>>& lengths, long long max_batched) {
    std::vector<GridShape> shapes;
    for (const auto& qk : lengths) {
        shapes.push_back({1, 1, qk.first, qk.second});
        if (static_cast<long long>(qk.first) * qk.second <= max_batched)
            shapes.push_back({2, 3, qk.first, qk.second});
    }
    return shapes;
}

// Every length paired with itself (tile edges: 31, 32, 33, 255, 256, 257), then unequal pairs on
// both sides: q_len < kv_len (the causal diagonal moves right) and q_len > kv_len (the leading
// rows see nothing), down to 1 against 1000.
std::vector<GridShape> forward_grid() {
    std::vector<std::pair<int, int>> lengths;
    for (int n : {1, 17, 31, 32, 33, 100, 255, 256, 257, 1000}) lengths.push_back({n, n});
    for (auto qk : {std::make_pair(1, 1000), {1000, 1}, {17, 257}, {257, 17}, {33, 100},
                    {100, 31}, {255, 1000}, {1000, 256}})
        lengths.push_back(qk);
    return grid(lengths, 257 * 257);
}

std::vector<GridShape> backward_grid() {
    std::vector<std::pair<int, int>> lengths;
    for (int n : {1, 17, 32, 33, 100, 257}) lengths.push_back({n, n});
    for (auto qk : {std::make_pair(1, 257), {257, 1}, {17, 100}, {100, 17}, {31, 256}, {255, 33}})
        lengths.push_back(qk);
    return grid(lengths, 100 * 100);
}

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
    static bool ident(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

public:
    explicit NamesWord(std::string word) : word_(std::move(word)) {}
    bool match(const std::string& msg) const override {
        for (size_t at = msg.find(word_); at != std::string::npos; at = msg.find(word_, at + 1)) {
            const bool left = at == 0 || !ident(msg[at - 1]);
            const bool right = at + word_.size() == msg.size() || !ident(msg[at + word_.size()]);
            if (left && right) return true;
        }
        return false;
    }
    std::string describe() const override { return "names \"" + word_ + "\""; }
};

// Stand-ins for tensors in the validation tests: real, separate, 16-byte-aligned host arrays
// (never read: validation refuses the call first). The inputs hold a pattern, the outputs NaN,
// and the outputs must be bitwise unchanged afterwards.
struct FakeTensors {
    static constexpr size_t kN = 64;
    alignas(16) float Q[kN], K[kN], V[kN], O[kN], L[kN], dO[kN], dQ[kN], dK[kN], dV[kN];
    alignas(16) float snapshot[5][kN];

    FakeTensors() {
        float* inputs[] = {Q, K, V, dO};
        for (size_t t = 0; t < 4; ++t)
            for (size_t e = 0; e < kN; ++e) inputs[t][e] = float(t * 1000 + e) + 0.5f;
        float* outs[] = {O, L, dQ, dK, dV};
        for (size_t t = 0; t < 5; ++t) {
            std::fill(outs[t], outs[t] + kN, std::numeric_limits<float>::quiet_NaN());
            std::memcpy(snapshot[t], outs[t], sizeof(snapshot[t]));
        }
    }
    bool outputs_untouched() const {
        const float* outs[] = {O, L, dQ, dK, dV};
        for (size_t t = 0; t < 5; ++t)
            if (std::memcmp(snapshot[t], outs[t], sizeof(snapshot[t])) != 0) return false;
        return true;
    }
};

AttentionShape valid_shape() { return {2, 3, 5, 7, 16, true}; }

// =============================================================================================
// The four GPUs the tile chooser is checked on, as cudaGetDeviceProperties would describe them.
cudaDeviceProp gpu_props(const char* name, int major, int minor, int sms, size_t optin,
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

// =============================================================================================
// The big tests' inputs: tensors filled on the GPU with a random pattern of prime length, so
// that no two heads hold the same data (a kernel that reads the wrong head is caught), while
// the host can rebuild any head's data without holding the whole tensor.
constexpr size_t kPatternLength = 1000003;

std::vector<float> random_pattern(uint32_t seed) {
    std::mt19937 rng(seed);
    return normal_values<float>(kPatternLength, rng);
}

// Elements [first, first + n) of a tensor filled with `pattern`.
std::vector<float> pattern_slice(const std::vector<float>& pattern, size_t first, size_t n) {
    std::vector<float> out(n);
    for (size_t e = 0; e < n; ++e) out[e] = pattern[(first + e) % pattern.size()];
    return out;
}

// Checks head `bh` of a big problem: rebuilds its inputs, runs the reference on it alone, and
// compares with that head's slice of the GPU's outputs.
void check_big_head(const GpuAttention& gpu, size_t bh,
                    const std::vector<std::vector<float>>& patterns, bool with_gradients) {
    const AttentionShape& s = gpu.s;
    const size_t d = s.head_dim, q_head = size_t(s.q_len) * d, kv_head = size_t(s.kv_len) * d;
    Problem<float> one{{1, 1, s.q_len, s.kv_len, s.head_dim, s.causal}, {}, {}, {}, {}};
    one.Q = pattern_slice(patterns[0], bh * q_head, q_head);
    one.K = pattern_slice(patterns[1], bh * kv_head, kv_head);
    one.V = pattern_slice(patterns[2], bh * kv_head, kv_head);
    if (with_gradients) one.dO = pattern_slice(patterns[3], bh * q_head, q_head);
    const Outputs<float> want = with_gradients ? reference_backward(one) : reference_forward(one);
    Outputs<float> got;
    got.O = gpu.O.download(bh * q_head, q_head);
    got.L = gpu.L.download(bh * s.q_len, s.q_len);
    const Tolerances tol = tolerances(one, Rounding::random);
    INFO("head " << bh << " of " << size_t(s.batch) * s.heads << " (elements from "
                 << bh * q_head << ")");
    check_close("O", got.O, want.O, tol.O, s, q_layout(s, bh));
    check_close("L", got.L, want.L, tol.L, s, l_layout(s, bh));
    if (!with_gradients) return;
    got.dQ = gpu.dQ.download(bh * q_head, q_head);
    got.dK = gpu.dK.download(bh * kv_head, kv_head);
    got.dV = gpu.dV.download(bh * kv_head, kv_head);
    check_close("dQ", got.dQ, want.dQ, tol.grad_rel * max_abs(want.dQ) + tol.dQ_floor, s,
                q_layout(s, bh));
    check_close("dK", got.dK, want.dK, tol.grad_rel * max_abs(want.dK) + tol.dK_floor, s,
                kv_layout(s, bh));
    check_close("dV", got.dV, want.dV, tol.grad_rel * max_abs(want.dV), s, kv_layout(s, bh));
}

}  // namespace

// =============================================================================================
// CPU: the reference against facts derivable by hand

TEST_CASE("The reference gives the mean of the V rows when all keys are equal",
          "[cpu][reference]") {
    const AttentionShape s{2, 1, 4, 7, 16, false};
    auto p = random_problem<double>(s, 1);
    for (size_t bh = 0; bh < 2; ++bh)  // every key of a head = that head's key 0
        for (size_t j = 1; j < 7; ++j)
            for (size_t x = 0; x < 16; ++x) p.K[(bh * 7 + j) * 16 + x] = p.K[bh * 7 * 16 + x];
    const auto r = reference_forward(p);
    // Equal scores: P_ij = 1/7, O_i = mean of V, L_i = S_i + ln 7.
    Outputs<double> want{std::vector<double>(q_elems(s)), std::vector<double>(l_elems(s)), {}, {}, {}};
    for (size_t bh = 0; bh < 2; ++bh)
        for (size_t i = 0; i < 4; ++i) {
            double dot = 0;
            for (size_t x = 0; x < 16; ++x) dot += p.Q[(bh * 4 + i) * 16 + x] * p.K[bh * 7 * 16 + x];
            want.L[bh * 4 + i] = dot / 4.0 + std::log(7.0);
            for (size_t x = 0; x < 16; ++x) {
                double sum = 0;
                for (size_t j = 0; j < 7; ++j) sum += p.V[(bh * 7 + j) * 16 + x];
                want.O[(bh * 4 + i) * 16 + x] = sum / 7;
            }
        }
    check_close("O", r.O, want.O, 1e-14, s, q_layout(s));
    check_close("L", r.L, want.L, 1e-14, s, l_layout(s));
}

TEST_CASE("The reference gives the V row of a key whose score dominates", "[cpu][reference]") {
    const AttentionShape s{1, 2, 3, 6, 16, false};
    auto p = random_problem<double>(s, 2);
    std::mt19937 rng(7);
    std::uniform_real_distribution<double> pos(0.5, 1.0), small(-1.0, 1.0);
    for (auto& x : p.Q) x = pos(rng);
    for (auto& x : p.K) x = small(rng);
    const size_t hot = 4;  // key 4 of each head: entries 20, so its score >= 16 * 0.5 * 20 / 4 = 40
    for (size_t bh = 0; bh < 2; ++bh)
        for (size_t x = 0; x < 16; ++x) p.K[(bh * 6 + hot) * 16 + x] = 20.0;
    // Every other score is at most 16 * 1 * 1 / 4 = 4: the other five keys' weights add up to
    // less than 5 e^-36 ~ 1.2e-15, which moves O by less than 1e-14 (|V| < 6 here).
    const auto r = reference_forward(p);
    std::vector<double> want(q_elems(s));
    for (size_t bh = 0; bh < 2; ++bh)
        for (size_t i = 0; i < 3; ++i)
            for (size_t x = 0; x < 16; ++x)
                want[(bh * 3 + i) * 16 + x] = p.V[(bh * 6 + hot) * 16 + x];
    REQUIRE(max_abs(p.V) < 6);
    check_close("O", r.O, want, 1e-13, s, q_layout(s));
}

TEST_CASE("The reference's causal row 0 sees key 0 only when q_len == kv_len",
          "[cpu][reference][causal]") {
    const int n = GENERATE(1, 2, 9);
    const AttentionShape s{2, 2, n, n, 32, true};
    CAPTURE(n);
    const auto p = random_problem<double>(s, 3);
    const auto r = reference_forward(p);
    for (size_t bh = 0; bh < 4; ++bh) {
        // One key: P_00 = 1 exactly, so O_0 = V_0 and L_0 = S_00.
        double dot = 0;
        for (size_t x = 0; x < 32; ++x) dot += p.Q[bh * n * 32 + x] * p.K[bh * n * 32 + x];
        const std::vector<double> got_O(r.O.begin() + bh * n * 32, r.O.begin() + bh * n * 32 + 32);
        const std::vector<double> want_O(p.V.begin() + bh * n * 32, p.V.begin() + bh * n * 32 + 32);
        check_close("O row 0", got_O, want_O, 0.0, s, q_layout(s, bh));
        CHECK_THAT(r.L[bh * n], WithinRel(dot / std::sqrt(32.0), 1e-14));
    }
}

TEST_CASE("The reference gives O = 0 and L = -inf to rows that see no key",
          "[cpu][reference][causal][masking]") {
    const auto qk = GENERATE(std::make_pair(5, 3), std::make_pair(4, 1), std::make_pair(9, 8));
    const AttentionShape s{2, 3, qk.first, qk.second, 16, true};
    INFO(describe(s));
    const auto p = random_problem<double>(s, 4);
    const auto r = reference_forward(p);
    const int masked = masked_rows(s);
    REQUIRE(masked == qk.first - qk.second);
    for (size_t bh = 0; bh < 6; ++bh)
        for (int i = 0; i < s.q_len; ++i) {
            CAPTURE(bh, i);
            const double L = r.L[bh * s.q_len + i];
            if (i < masked) {
                CHECK(L == -std::numeric_limits<double>::infinity());
                for (int x = 0; x < 16; ++x) CHECK(r.O[(bh * s.q_len + i) * 16 + x] == 0.0);
            } else {
                CHECK(std::isfinite(L));
            }
        }
    // The first row that sees anything sees key 0 alone: O = V_0 exactly.
    for (size_t bh = 0; bh < 6; ++bh)
        for (int x = 0; x < 16; ++x)
            CHECK(r.O[(bh * s.q_len + masked) * 16 + x] == p.V[bh * s.kv_len * 16 + x]);
}

TEST_CASE("The reference's L is the log-sum-exp of the scaled scores", "[cpu][reference]") {
    const bool causal = GENERATE(false, true);
    const AttentionShape s{1, 2, 6, 9, 64, causal};
    INFO(describe(s));
    const auto p = random_problem<double>(s, 5);
    const auto r = reference_forward(p);
    // Straight from the definition, without the max-subtraction trick (fine for these scores).
    std::vector<double> want(l_elems(s));
    for (size_t bh = 0; bh < 2; ++bh)
        for (int i = 0; i < 6; ++i) {
            long double sum = 0;
            for (int j = 0; j <= (causal ? i + 3 : 8); ++j) {
                long double dot = 0;
                for (int x = 0; x < 64; ++x)
                    dot += (long double)p.Q[(bh * 6 + i) * 64 + x] * p.K[(bh * 9 + j) * 64 + x];
                sum += std::exp(dot / 8.0L);
            }
            want[bh * 6 + i] = double(std::log(sum));
        }
    check_close("L", r.L, want, 1e-13, s, l_layout(s));
}

TEST_CASE("The reference's causal mask is bottom-right aligned", "[cpu][reference][causal]") {
    // Causal query i sees keys 0 .. i + kv_len - q_len, so its output must equal non-causal
    // attention of that one query over just those keys.
    const auto qk = GENERATE(std::make_pair(3, 8), std::make_pair(1, 5), std::make_pair(7, 4),
                             std::make_pair(6, 6));
    const AttentionShape s{1, 1, qk.first, qk.second, 16, true};
    INFO(describe(s));
    const auto p = random_problem<double>(s, 6);
    const auto r = reference_forward(p);
    for (int i = 0; i < s.q_len; ++i) {
        const int seen = i + s.kv_len - s.q_len + 1;
        if (seen <= 0) continue;  // the rows that see nothing: the test above
        CAPTURE(i, seen);
        const AttentionShape one{1, 1, 1, seen, 16, false};
        const std::vector<double> q(p.Q.begin() + i * 16, p.Q.begin() + (i + 1) * 16);
        const std::vector<double> k(p.K.begin(), p.K.begin() + seen * 16);
        const std::vector<double> v(p.V.begin(), p.V.begin() + seen * 16);
        std::vector<double> o(16), l(1);
        attention_reference(q.data(), k.data(), v.data(), o.data(), l.data(), one);
        const std::vector<double> got(r.O.begin() + i * 16, r.O.begin() + (i + 1) * 16);
        check_close("O", got, o, 1e-15, s, q_layout(s));
        CHECK_THAT(r.L[i], WithinAbs(l[0], 1e-15));
    }
}

TEST_CASE("The float and double references agree", "[cpu][reference]") {
    const AttentionShape s{1, 2, 33, 20, 32, true};
    const auto p = random_problem<double>(s, 7);
    Problem<float> pf{s, {}, {}, {}, {}};
    auto to_float = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
    pf.Q = to_float(p.Q), pf.K = to_float(p.K), pf.V = to_float(p.V), pf.dO = to_float(p.dO);
    Problem<double> pd{s, {}, {}, {}, {}};  // the same float inputs, exactly, in double
    auto to_double = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
    pd.Q = to_double(pf.Q), pd.K = to_double(pf.K), pd.V = to_double(pf.V), pd.dO = to_double(pf.dO);
    const auto rf = reference_backward(pf);
    const auto rd = reference_backward(pd);
    // Both accumulate in double; the float version only rounds its results to float (and its
    // backward reads O and L so rounded, which moves P by about u |L|): well within 1e-5 of the
    // largest entry.
    auto check = [&](const char* name, const std::vector<float>& f, const std::vector<double>& d,
                     const Layout& layout) {
        check_close(name, to_double(f), d, 1e-5 * std::max(1.0, max_abs(d)), s, layout);
    };
    check("O", rf.O, rd.O, q_layout(s));
    check("L", rf.L, rd.L, l_layout(s));
    check("dQ", rf.dQ, rd.dQ, q_layout(s));
    check("dK", rf.dK, rd.dK, kv_layout(s));
    check("dV", rf.dV, rd.dV, kv_layout(s));
}

TEST_CASE("The reference's gradients match central finite differences of its forward",
          "[cpu][reference][backward]") {
    // loss = sum(O * dO) for a random dO, so dloss/dO = dO; each input element is nudged by
    // +-h and (loss(+h) - loss(-h)) / 2h compared with the reference backward's gradient. In
    // double with h = 1e-5, truncation (~h^2) and cancellation (~1e-16 / h) errors are ~1e-10.
    const AttentionShape s = GENERATE(AttentionShape{1, 2, 3, 5, 16, true},   // q < kv
                                      AttentionShape{1, 2, 5, 3, 16, true},   // rows 0, 1 masked
                                      AttentionShape{2, 1, 4, 4, 16, false},
                                      AttentionShape{1, 1, 1, 6, 16, true},
                                      AttentionShape{1, 1, 6, 2, 32, true},   // rows 0..3 masked
                                      AttentionShape{1, 1, 7, 3, 16, false});
    INFO(describe(s));
    const auto p = random_problem<double>(s, 8);
    const auto r = reference_backward(p);
    for (double x : r.dQ) REQUIRE(std::isfinite(x));
    auto loss = [&](const Problem<double>& q) {
        const auto f = reference_forward(q);
        double sum = 0;
        for (size_t e = 0; e < f.O.size(); ++e) sum += f.O[e] * q.dO[e];
        return sum;
    };
    const double h = 1e-5;
    auto numeric = [&](std::vector<double> Problem<double>::*tensor) {
        Problem<double> q = p;
        std::vector<double> g((q.*tensor).size());
        for (size_t e = 0; e < g.size(); ++e) {
            const double keep = (q.*tensor)[e];
            (q.*tensor)[e] = keep + h;
            const double up = loss(q);
            (q.*tensor)[e] = keep - h;
            const double down = loss(q);
            (q.*tensor)[e] = keep;
            g[e] = (up - down) / (2 * h);
        }
        return g;
    };
    const double tol = 1e-8 * std::max({1.0, max_abs(r.dQ), max_abs(r.dK), max_abs(r.dV)});
    check_close("dQ (analytic vs numeric)", r.dQ, numeric(&Problem<double>::Q), tol, s, q_layout(s));
    check_close("dK (analytic vs numeric)", r.dK, numeric(&Problem<double>::K), tol, s, kv_layout(s));
    check_close("dV (analytic vs numeric)", r.dV, numeric(&Problem<double>::V), tol, s, kv_layout(s));
    // Rows that see nothing have no gradient at all.
    for (int i = 0; i < masked_rows(s); ++i)
        for (int x = 0; x < s.head_dim; ++x) CHECK(r.dQ[size_t(i) * s.head_dim + x] == 0.0);
}

// =============================================================================================
// CPU: the tile chooser on four real GPUs' figures

TEST_CASE("The tile chooser gives valid tiles on T4, A100, RTX 4090 and H100", "[cpu][tile]") {
    for (const cudaDeviceProp& prop : known_gpus())
        for (int d : kFlashHeadDims) {
            check_tile("forward", flash_choose_tile(prop, d), prop, d);
            check_tile("backward", flash_choose_tile_backward(prop, d), prop, d);
        }
}

TEST_CASE("The tile chooser refuses head dims without a kernel", "[cpu][tile][validation]") {
    const cudaDeviceProp prop = known_gpus().back();
    const int d = GENERATE(0, -64, 8, 48, 100, 512);
    CAPTURE(d);
    CHECK_THROWS_AS(flash_choose_tile(prop, d), std::invalid_argument);
    CHECK_THROWS_AS(flash_choose_tile_backward(prop, d), std::invalid_argument);
}

TEST_CASE("The supported head dims are 16, 32, 64, 96, 128 and 256", "[cpu][validation]") {
    CHECK(flash_head_dims_string() == "16, 32, 64, 96, 128, 256");
    for (int d : kFlashHeadDims) CHECK(flash_head_dim_supported(d));
    for (int d : {0, -16, 8, 17, 48, 65, 192, 512}) {
        CAPTURE(d);
        CHECK_FALSE(flash_head_dim_supported(d));
    }
}

// =============================================================================================
// CPU: argument validation. It happens before any CUDA call, so these run without a GPU; the
// tensors are fake host arrays, never read.

TEST_CASE("Shape fields that are zero or negative are refused, naming the field",
          "[cpu][validation]") {
    const int field = GENERATE(range(0, 5));
    const int value = GENERATE(0, -1, INT_MIN);
    const char* names[] = {"batch", "heads", "q_len", "kv_len", "head_dim"};
    AttentionShape s = valid_shape();
    int* fields[] = {&s.batch, &s.heads, &s.q_len, &s.kv_len, &s.head_dim};
    *fields[field] = value;
    INFO(names[field] << " = " << value);
    FakeTensors t;
    const NamesWord names_field(names[field]);
    CHECK_THAT(refusal([&] { validate_shape(s); }), names_field);
    CHECK_THAT(refusal([&] { flash_forward(t.Q, t.K, t.V, t.O, t.L, s); }), names_field);
    CHECK_THAT(refusal([&] { flash_forward_bc(t.Q, t.K, t.V, t.O, t.L, s, 16); }), names_field);
    CHECK_THAT(refusal([&] {
                   flash_backward(t.Q, t.K, t.V, t.O, t.dO, t.L, t.dQ, t.dK, t.dV, s);
               }),
               names_field);
    CHECK_THAT(refusal([&] { attention_reference(t.Q, t.K, t.V, t.O, t.L, s); }), names_field);
    CHECK(t.outputs_untouched());
}

TEST_CASE("Shapes whose tensors overflow size_t are refused", "[cpu][validation]") {
    struct Case {
        const char* what;
        AttentionShape s;
        const char* field;  // the length the overflowing tensor runs along
    };
    const Case c = GENERATE(
        Case{"Q: every field huge", {INT_MAX, INT_MAX, INT_MAX, 1, 64, false}, "q_len"},
        // 2^20 * 2^20 * 1 * 64 = 2^46 fits for Q; 2^20 * 2^20 * 2^30 * 64 does not for K, V
        Case{"K, V only", {1 << 20, 1 << 20, 1, 1 << 30, 64, false}, "kv_len"},
        // (2^31 - 1)^2 * 4 fits in 64 bits; times head_dim 16 it does not
        Case{"Q: only the last product", {INT_MAX, INT_MAX, 4, 1, 16, false}, "q_len"},
        // 2^30 * 2^30 * 16 = 2^64 wraps to exactly 0
        Case{"Q, K, V: wraps to 0", {1 << 30, 1 << 30, 1, 1, 16, true}, "q_len"},
        // 2^29 * 2^29 * 16 = 2^62 elements fit, but not their 2^64 bytes
        Case{"Q, K, V: the byte count only", {1 << 29, 1 << 29, 1, 1, 16, false}, "q_len"});
    INFO(c.what << ": " << describe(c.s));
    FakeTensors t;
    const std::string msg = refusal([&] { validate_shape(c.s); });
    INFO("message: " << msg);
    CHECK_THAT(msg, NamesWord(c.field));
    CHECK_THROWS_AS(flash_forward(t.Q, t.K, t.V, t.O, t.L, c.s), std::invalid_argument);
    CHECK_THROWS_AS(flash_forward_bc(t.Q, t.K, t.V, t.O, t.L, c.s, 16), std::invalid_argument);
    CHECK_THROWS_AS(flash_backward(t.Q, t.K, t.V, t.O, t.dO, t.L, t.dQ, t.dK, t.dV, c.s),
                    std::invalid_argument);
    CHECK(t.outputs_untouched());
}

TEST_CASE("Null pointers given to the forward are refused, naming the argument",
          "[cpu][validation]") {
    const AttentionShape s = valid_shape();
    const int which = GENERATE(range(0, 5));
    FakeTensors t;
    const float* in[] = {t.Q, t.K, t.V};
    float* out[] = {t.O, t.L};
    const char* names[] = {"Q", "K", "V", "O", "L"};
    if (which < 3) in[which] = nullptr; else out[which - 3] = nullptr;
    INFO(names[which] << " = nullptr");
    CHECK_THAT(refusal([&] { flash_forward(in[0], in[1], in[2], out[0], out[1], s); }),
               NamesWord(names[which]));
    CHECK_THAT(refusal([&] { flash_forward_bc(in[0], in[1], in[2], out[0], out[1], s, 16); }),
               NamesWord(names[which]));
    CHECK(t.outputs_untouched());
}

TEST_CASE("Outputs overlapping another tensor, and misaligned tensors, are refused",
          "[cpu][validation]") {
    const AttentionShape s = valid_shape();
    const size_t nq = q_elems(s), nkv = kv_elems(s), nl = l_elems(s);
    // Separate heap arrays (16-byte aligned, as malloc's are), one float longer than needed so
    // that a pointer shifted by one float stays inside.
    std::vector<float> Q(nq + 1, 0.5f), K(nkv + 1, 0.25f), V(nkv, 0.75f), dO(nq, 0.125f);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> O(nq, nan), L(nl, nan), dQ(nq, nan), dK(nkv, nan), dV(nkv, nan);
    auto all_nan = [](const std::vector<float>& v) {
        return std::all_of(v.begin(), v.end(), [](float x) { return std::isnan(x); });
    };
    SECTION("O is Q") {
        CHECK_THAT(refusal([&] { flash_forward(Q.data(), K.data(), V.data(), Q.data(), L.data(), s); }),
                   NamesWord("O") && NamesWord("Q") && Contains("overlaps"));
    }
    SECTION("L lies inside V") {
        CHECK_THAT(refusal([&] { flash_forward(Q.data(), K.data(), V.data(), O.data(), V.data() + 4, s); }),
                   NamesWord("L") && NamesWord("V") && Contains("overlaps"));
    }
    SECTION("dK is dV") {
        CHECK_THAT(refusal([&] {
                       flash_backward(Q.data(), K.data(), V.data(), O.data(), dO.data(), L.data(),
                                      dQ.data(), dV.data(), dV.data(), s);
                   }),
                   NamesWord("dK") && NamesWord("dV") && Contains("overlaps"));
    }
    SECTION("Q is not 16-byte aligned") {
        CHECK_THAT(refusal([&] { flash_forward(Q.data() + 1, K.data(), V.data(), O.data(), L.data(), s); }),
                   NamesWord("Q") && Contains("16-byte aligned"));
    }
    SECTION("K is not 16-byte aligned (backward)") {
        CHECK_THAT(refusal([&] {
                       flash_backward(Q.data(), K.data() + 1, V.data(), O.data(), dO.data(),
                                      L.data(), dQ.data(), dK.data(), dV.data(), s);
                   }),
                   NamesWord("K") && Contains("16-byte aligned"));
    }
    CHECK(all_nan(O));
    CHECK(all_nan(L));
    CHECK(all_nan(dQ));
    CHECK(all_nan(dK));
}

TEST_CASE("Null pointers given to the backward are refused, naming the argument",
          "[cpu][validation]") {
    const AttentionShape s = valid_shape();
    const int which = GENERATE(range(0, 9));
    FakeTensors t;
    const float* in[] = {t.Q, t.K, t.V, t.O, t.dO, t.L};
    float* out[] = {t.dQ, t.dK, t.dV};
    const char* names[] = {"Q", "K", "V", "O", "dO", "L", "dQ", "dK", "dV"};
    if (which < 6) in[which] = nullptr; else out[which - 6] = nullptr;
    INFO(names[which] << " = nullptr");
    CHECK_THAT(refusal([&] {
                   flash_backward(in[0], in[1], in[2], in[3], in[4], in[5], out[0], out[1],
                                  out[2], s);
               }),
               NamesWord(names[which]));
    CHECK(t.outputs_untouched());
}

TEST_CASE("Unsupported head dims are refused, listing the supported ones", "[cpu][validation]") {
    const int d = GENERATE(48, 0, 512, 8, 24, 257);
    AttentionShape s = valid_shape();
    s.head_dim = d;
    INFO(describe(s));
    FakeTensors t;
    for (const std::string& msg :
         {refusal([&] { flash_forward(t.Q, t.K, t.V, t.O, t.L, s); }),
          refusal([&] { flash_forward_bc(t.Q, t.K, t.V, t.O, t.L, s, 16); }),
          refusal([&] { flash_backward(t.Q, t.K, t.V, t.O, t.dO, t.L, t.dQ, t.dK, t.dV, s); })}) {
        CHECK_THAT(msg, NamesWord("head_dim"));
        CHECK_THAT(msg, Contains("16, 32, 64, 96, 128, 256"));
    }
    CHECK(t.outputs_untouched());
}

TEST_CASE("flash_forward_bc refuses Bc below 1, naming it", "[cpu][validation]") {
    const int Bc = GENERATE(0, -1, INT_MIN);
    CAPTURE(Bc);
    FakeTensors t;
    CHECK_THAT(refusal([&] { flash_forward_bc(t.Q, t.K, t.V, t.O, t.L, valid_shape(), Bc); }),
               NamesWord("Bc"));
    CHECK(t.outputs_untouched());
}

TEST_CASE("Element counts are 64-bit products", "[cpu][validation]") {
    const AttentionShape s{4097, 32, 128, 64, 128, false};  // Q: just past 2^31 elements
    CHECK(q_elems(s) == size_t(4097) * 32 * 128 * 128);
    CHECK(q_elems(s) > (size_t(1) << 31));
    CHECK(kv_elems(s) == size_t(4097) * 32 * 64 * 128);
    CHECK(l_elems(s) == size_t(4097) * 32 * 128);
    CHECK_NOTHROW(validate_shape(s));
    CHECK_NOTHROW(validate_shape({70000, 1, 16, 16, 16, true}));
}

// =============================================================================================
// GPU: the kernels against the reference

TEST_CASE("The forward matches the reference over a grid of shapes", "[gpu][forward]") {
    const GridShape g = GENERATE(from_range(forward_grid()));
    const bool causal = GENERATE(false, true);
    const int d = GENERATE(from_range(std::begin(kFlashHeadDims), std::end(kFlashHeadDims)));
    const AttentionShape s{g.batch, g.heads, g.q_len, g.kv_len, d, causal};
    INFO(describe(s));
    const auto p = random_problem(s, 100);
    GpuAttention gpu(p);
    gpu.forward();
    check_forward(gpu.outputs(false), reference_forward(p), tolerances(p, Rounding::random), s);
}

TEST_CASE("The backward matches the reference over a grid of shapes", "[gpu][backward]") {
    const GridShape g = GENERATE(from_range(backward_grid()));
    const bool causal = GENERATE(false, true);
    const int d = GENERATE(from_range(std::begin(kFlashHeadDims), std::end(kFlashHeadDims)));
    const AttentionShape s{g.batch, g.heads, g.q_len, g.kv_len, d, causal};
    check_forward_and_backward(s, 200);
}

// The subset `make sanitize` runs under compute-sanitizer (which slows kernels 10-100x): small
// shapes that still cover odd and unequal lengths, a partial last tile, causal on and off,
// batched heads and every head dim, forward and backward.
TEST_CASE("Small shapes for the sanitizer: forward and backward match the reference",
          "[gpu][sanitize][forward][backward]") {
    const auto qk = GENERATE(std::make_pair(1, 1), std::make_pair(17, 33), std::make_pair(33, 17),
                             std::make_pair(100, 100));
    const bool causal = GENERATE(false, true);
    const int bh = GENERATE(1, 6);
    const int d = GENERATE(from_range(std::begin(kFlashHeadDims), std::end(kFlashHeadDims)));
    const AttentionShape s{bh == 1 ? 1 : 2, bh == 1 ? 1 : 3, qk.first, qk.second, d, causal};
    check_forward_and_backward(s, 300);
}

TEST_CASE("Rows that see no key get O = 0, L = -inf and zero gradients on the GPU",
          "[gpu][masking][forward][backward][hardening]") {
    const auto qk = GENERATE(std::make_pair(5, 1), std::make_pair(100, 17), std::make_pair(257, 256),
                             std::make_pair(1000, 1), std::make_pair(300, 64));
    const int d = GENERATE(from_range(std::begin(kFlashHeadDims), std::end(kFlashHeadDims)));
    const AttentionShape s{2, 3, qk.first, qk.second, d, true};
    INFO(describe(s) << ": rows 0.." << masked_rows(s) - 1 << " of every head see no key");
    const auto p = random_problem(s, 300);
    GpuAttention gpu(p);
    gpu.forward();
    gpu.backward();
    const auto got = gpu.outputs(true);
    check_masked_rows("O", got.O, s, d, 0.0f);
    check_masked_rows("L", got.L, s, 1, -std::numeric_limits<float>::infinity());
    check_masked_rows("dQ", got.dQ, s, d, 0.0f);
    // And everything, masked rows included, against the reference (dK and dV get nothing from
    // the masked rows: the reference's contributions are exactly zero there).
    const auto want = reference_backward(p);
    const Tolerances tol = tolerances(p, Rounding::random);
    check_forward(got, want, tol, s);
    check_backward(got, want, tol, s);
}

TEST_CASE("The forward gives bitwise identical O and L on every call, on any stream",
          "[gpu][forward][determinism]") {
    const AttentionShape s = GENERATE(AttentionShape{2, 3, 257, 257, 64, true},
                                      AttentionShape{1, 2, 100, 1000, 128, false},
                                      AttentionShape{1, 1, 333, 77, 256, true},
                                      AttentionShape{3, 1, 65, 129, 16, false},
                                      AttentionShape{1, 2, 200, 31, 32, false},
                                      AttentionShape{1, 3, 96, 96, 96, true});
    INFO(describe(s));
    const auto p = random_problem(s, 400);
    GpuAttention gpu(p);
    gpu.forward();
    const auto first = gpu.outputs(false);
    gpu.forward();
    const auto second = gpu.outputs(false);
    check_bitwise("O", first.O, second.O, s, q_layout(s));
    check_bitwise("L", first.L, second.L, s, l_layout(s));
    cudaStream_t stream;
    FLASH_CUDA_CHECK(cudaStreamCreate(&stream));
    try {
        gpu.forward(0, stream);
    } catch (...) {
        cudaStreamDestroy(stream);
        throw;
    }
    FLASH_CUDA_CHECK(cudaStreamDestroy(stream));
    const auto third = gpu.outputs(false);
    check_bitwise("O (on a stream of its own)", first.O, third.O, s, q_layout(s));
    check_bitwise("L (on a stream of its own)", first.L, third.L, s, l_layout(s));
}

TEST_CASE("The backward gives bitwise identical dQ, dK and dV on every call",
          "[gpu][backward][determinism]") {
    const AttentionShape s = GENERATE(AttentionShape{2, 3, 257, 257, 64, true},
                                      AttentionShape{1, 2, 100, 300, 128, false},
                                      AttentionShape{1, 1, 333, 77, 256, true},
                                      AttentionShape{3, 1, 65, 129, 16, false},
                                      AttentionShape{1, 2, 200, 31, 32, false},
                                      AttentionShape{1, 3, 96, 96, 96, true});
    INFO(describe(s));
    const auto p = random_problem(s, 500);
    GpuAttention gpu(p);
    gpu.forward();
    gpu.backward();
    const auto first = gpu.outputs(true);
    gpu.backward();
    const auto second = gpu.outputs(true);
    check_bitwise("dQ", first.dQ, second.dQ, s, q_layout(s));
    check_bitwise("dK", first.dK, second.dK, s, kv_layout(s));
    check_bitwise("dV", first.dV, second.dV, s, kv_layout(s));
}

TEST_CASE("flash_forward_bc matches the reference for tiles that do not divide the length",
          "[gpu][forward][tile]") {
    const int Bc = GENERATE(1, 7, 64);
    const AttentionShape base = GENERATE(AttentionShape{1, 2, 100, 257, 0, true},
                                         AttentionShape{2, 1, 257, 100, 0, false},
                                         AttentionShape{1, 1, 33, 33, 0, true});
    const int d = GENERATE(from_range(std::begin(kFlashHeadDims), std::end(kFlashHeadDims)));
    AttentionShape s = base;
    s.head_dim = d;
    INFO(describe(s) << ", Bc = " << Bc);
    int dev = 0;
    cudaDeviceProp prop;
    FLASH_CUDA_CHECK(cudaGetDevice(&dev));
    FLASH_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    const auto p = random_problem(s, 600);
    GpuAttention gpu(p);
    if (2 * size_t(Bc) * d * sizeof(float) > prop.sharedMemPerBlockOptin) {
        // K_j and V_j would not fit in one block's shared memory: refused (and O untouched).
        INFO("does not fit in " << prop.sharedMemPerBlockOptin << " bytes of shared memory");
        gpu.O.poison();
        CHECK_THAT(refusal([&] { flash_forward_bc(gpu.Q.ptr, gpu.K.ptr, gpu.V.ptr, gpu.O.ptr,
                                                  gpu.L.ptr, s, Bc); }),
                   NamesWord("Bc"));
        CHECK(count_bad(gpu.O.download()) == q_elems(s));  // all still NaN
        return;
    }
    gpu.forward(Bc);
    check_forward(gpu.outputs(false), reference_forward(p), tolerances(p, Rounding::random), s);
}

TEST_CASE("flash_forward_bc refuses a Bc that does not fit in shared memory, naming it",
          "[gpu][validation][tile]") {
    const int d = GENERATE(from_range(std::begin(kFlashHeadDims), std::end(kFlashHeadDims)));
    const AttentionShape s{1, 1, 64, 64, d, false};
    int dev = 0;
    cudaDeviceProp prop;
    FLASH_CUDA_CHECK(cudaGetDevice(&dev));
    FLASH_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    const int most = int(prop.sharedMemPerBlockOptin / (2 * d * sizeof(float)));
    const int Bc = GENERATE_COPY(most + 1, 1 << 20, INT_MAX);
    INFO(describe(s) << ", Bc = " << Bc << " (at most " << most << " fit)");
    const auto p = random_problem(s, 700);
    GpuAttention gpu(p);
    gpu.O.poison();
    gpu.L.poison();
    CHECK_THAT(refusal([&] {
                   flash_forward_bc(gpu.Q.ptr, gpu.K.ptr, gpu.V.ptr, gpu.O.ptr, gpu.L.ptr, s, Bc);
               }),
               NamesWord("Bc"));
    CHECK(count_bad(gpu.O.download()) == q_elems(s));  // all still NaN: untouched
    CHECK(count_bad(gpu.L.download()) == l_elems(s));
}

// =============================================================================================
// GPU: hardening

TEST_CASE("100 calls of the forward and the backward give bitwise identical results",
          "[gpu][hardening][determinism]") {
    const int d = GENERATE(from_range(std::begin(kFlashHeadDims), std::end(kFlashHeadDims)));
    const AttentionShape s{1, 2, 100, 77, d, true};
    INFO(describe(s));
    const auto p = random_problem(s, 800);
    GpuAttention gpu(p);
    gpu.forward();
    gpu.backward();
    const auto first = gpu.outputs(true);
    for (int call = 2; call <= 100; ++call) {
        gpu.forward();
        gpu.backward();
        const auto again = gpu.outputs(true);
        const bool same = bitwise_equal(again.O, first.O) && bitwise_equal(again.L, first.L) &&
                          bitwise_equal(again.dQ, first.dQ) && bitwise_equal(again.dK, first.dK) &&
                          bitwise_equal(again.dV, first.dV);
        if (same) continue;
        INFO("call " << call << " of 100 differs from call 1");
        check_bitwise("O", first.O, again.O, s, q_layout(s));
        check_bitwise("L", first.L, again.L, s, l_layout(s));
        check_bitwise("dQ", first.dQ, again.dQ, s, q_layout(s));
        check_bitwise("dK", first.dK, again.dK, s, kv_layout(s));
        check_bitwise("dV", first.dV, again.dV, s, kv_layout(s));
        FAIL("results changed between identical calls");
    }
    const auto want = reference_backward(p);
    const Tolerances tol = tolerances(p, Rounding::random);
    check_forward(first, want, tol, s);
    check_backward(first, want, tol, s);
}

TEST_CASE("Extreme inputs give finite outputs within tolerance of the reference",
          "[gpu][hardening]") {
    // The tolerances grow with the score magnitude M (see "Tolerances"): scores of thousands make
    // them ~1000 times looser than for N(0, 1) inputs, which is what fp32 can promise there.
    enum Kind { large, tiny, equal_scores, one_huge, big_keys };
    const Kind kind = GENERATE(large, tiny, equal_scores, one_huge, big_keys);
    const char* names[] = {"Q and K scaled by 30: scores in the hundreds and thousands",
                           "Q and K scaled by 1e-3: scores ~1e-6, attention almost uniform",
                           "every key equal: all of a row's scores equal (dQ = 0)",
                           "one huge score: Q row 5 and K row 7 of norm 100 (score 1e4/sqrt(d))",
                           "keys of +-1e4: scores ~1e4, attention one-hot"};
    const bool causal = GENERATE(false, true);
    const int d = GENERATE(from_range(std::begin(kFlashHeadDims), std::end(kFlashHeadDims)));
    const AttentionShape s{1, 2, 77, 80, d, causal};
    INFO(names[kind] << "; " << describe(s));
    auto p = random_problem(s, 900 + kind);
    Rounding rounding = Rounding::random;
    switch (kind) {
        case large:
            for (auto* t : {&p.Q, &p.K}) for (auto& x : *t) x *= 30.0f;
            break;
        case tiny:
            for (auto* t : {&p.Q, &p.K}) for (auto& x : *t) x *= 1e-3f;
            break;
        case equal_scores:  // rounding errors line up: identical terms
            rounding = Rounding::aligned;
            for (size_t bh = 0; bh < 2; ++bh)
                for (size_t j = 1; j < 80; ++j)
                    for (int x = 0; x < d; ++x) p.K[(bh * 80 + j) * d + x] = p.K[bh * 80 * d + x];
            break;
        case one_huge:  // the huge score's d equal products line up
            rounding = Rounding::aligned;
            for (int x = 0; x < d; ++x) {
                p.Q[5 * d + x] = 100.0f / std::sqrt(float(d));
                p.K[7 * d + x] = 100.0f / std::sqrt(float(d));
            }
            break;
        case big_keys:
            for (auto& x : p.K) x = x < 0 ? -1e4f : 1e4f;
            break;
    }
    GpuAttention gpu(p);
    gpu.forward();
    gpu.backward();
    const auto got = gpu.outputs(true);
    const char* names_out[] = {"O", "L", "dQ", "dK", "dV"};
    const std::vector<float>* outs[] = {&got.O, &got.L, &got.dQ, &got.dK, &got.dV};
    for (int t = 0; t < 5; ++t) {  // no row is masked here: L is finite too
        INFO(names_out[t] << " has " << count_bad(*outs[t]) << " NaN or infinite elements");
        CHECK(count_bad(*outs[t]) == 0);
    }
    const auto want = reference_backward(p);
    const Tolerances tol = tolerances(p, rounding);
    INFO("score magnitude M = " << tol.M << ": tolerance on O " << tol.O << ", on L " << tol.L);
    check_forward(got, want, tol, s);
    check_backward(got, want, tol, s);
}

// =============================================================================================
// GPU: big tensors

TEST_CASE("More than 65535 batch*heads: the heads past 65535 are right, the last included",
          "[gpu][big]") {
    // 65535 is the limit of a grid's y and z dimensions: a launch that puts batch*heads there
    // fails, and one that folds it wrongly leaves the last heads unwritten or wrong.
    const bool causal = GENERATE(false, true);
    const AttentionShape s{70000, 1, 16, 16, 16, causal};
    INFO(describe(s));
    std::vector<std::vector<float>> patterns;
    for (uint32_t t = 0; t < 4; ++t) patterns.push_back(random_pattern(1000 + t));
    GpuAttention gpu(s);
    gpu.Q.fill_repeating(patterns[0]);
    gpu.K.fill_repeating(patterns[1]);
    gpu.V.fill_repeating(patterns[2]);
    gpu.dO = DeviceBuffer(q_elems(s));
    gpu.dO.fill_repeating(patterns[3]);
    gpu.forward();
    gpu.backward();
    for (size_t bh : {size_t(0), size_t(65534), size_t(65535), size_t(65536), size_t(69998),
                      size_t(69999)})
        check_big_head(gpu, bh, patterns, true);
}

TEST_CASE("Tensors of more than 2^31 elements: the heads past 2^31 are right", "[gpu][big]") {
    // 4097 * 32 heads of 128 x 128: each of Q, K, V, O holds 2^31 + 2^19 elements (8.6 GB), and
    // heads 131072.. lie wholly past element 2^31, where a 32-bit index wraps.
    AttentionShape s{4097, 32, 128, 128, 128, false};
    const size_t need = (2 * q_elems(s) + 2 * kv_elems(s) + l_elems(s)) * sizeof(float);
    size_t free_bytes = 0, total_bytes = 0;
    FLASH_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    const double GiB = double(1 << 30);
    if (free_bytes < need + (size_t(1) << 30)) {
        WARN("skipped: needs " << need / GiB << " GiB of GPU memory (+1 GiB spare), but "
                               "cudaMemGetInfo reports " << free_bytes / GiB << " GiB free of "
                               << total_bytes / GiB);
        return;
    }
    std::vector<std::vector<float>> patterns;
    for (uint32_t t = 0; t < 3; ++t) patterns.push_back(random_pattern(2000 + t));
    GpuAttention gpu(s);
    gpu.Q.fill_repeating(patterns[0]);
    gpu.K.fill_repeating(patterns[1]);
    gpu.V.fill_repeating(patterns[2]);
    for (bool causal : {false, true}) {
        gpu.s.causal = s.causal = causal;
        INFO(describe(s));
        gpu.forward();
        for (size_t bh : {size_t(0), size_t(131071), size_t(131072), size_t(131103)})
            check_big_head(gpu, bh, patterns, false);
    }
}

// =============================================================================================
// Hidden: how long the CPU reference takes over the GPU tests' grids (./test_flash [.timing]).

TEST_CASE("The CPU reference over the GPU grids takes seconds", "[.timing]") {
    using clock = std::chrono::steady_clock;
    auto run = [](const std::vector<GridShape>& shapes, bool backward) {
        const auto start = clock::now();
        for (const GridShape& g : shapes)
            for (bool causal : {false, true})
                for (int d : kFlashHeadDims) {
                    const auto p = random_problem({g.batch, g.heads, g.q_len, g.kv_len, d, causal}, 1);
                    if (backward) reference_backward(p); else reference_forward(p);
                }
        return std::chrono::duration<double>(clock::now() - start).count();
    };
    const double fwd = run(forward_grid(), false), bwd = run(backward_grid(), true);
    std::cout << "reference over the forward grid (" << forward_grid().size() * 12
              << " cases): " << fwd << " s; over the backward grid (" << backward_grid().size() * 12
              << " cases, forward + backward): " << bwd << " s\n";
    CHECK(fwd + bwd < 60);
}

// =============================================================================================
// NOTES.md must stay true to the code: every line it quotes from flash.cu (the fenced blocks that
// follow a `<!-- quoted from flash.cu -->` line) must still be a line of flash.cu.

// The lines of a file next to this source file (or in the working directory), each trimmed.
static std::vector<std::string> source_lines(const std::string& name) {
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

TEST_CASE("Every line NOTES.md quotes from flash.cu is still in flash.cu", "[cpu][notes]") {
    const std::vector<std::string> notes = source_lines("NOTES.md");
    const std::vector<std::string> code = source_lines("flash.cu");
    int quoted = 0;
    for (size_t n = 0; n < notes.size(); ++n) {
        if (notes[n] != "<!-- quoted from flash.cu -->") continue;
        REQUIRE(n + 1 < notes.size());
        REQUIRE(notes[n + 1].rfind("```", 0) == 0);  // the fence must follow at once
        for (size_t k = n + 2; k < notes.size() && notes[k].rfind("```", 0) != 0; ++k) {
            if (notes[k].empty()) continue;
            ++quoted;
            INFO("NOTES.md:" << k + 1 << " quotes a line flash.cu no longer has:\n  " << notes[k]);
            CHECK(std::find(code.begin(), code.end(), notes[k]) != code.end());
        }
    }
    INFO("NOTES.md should quote the forward kernel");
    CHECK(quoted >= 30);
}

// =============================================================================================
// main: leaves out the [gpu] tests when there is no usable device, and ends with one summary line

namespace {
struct RunTotals {
    bool ended = false;
    std::size_t passed = 0, failed = 0;
};
RunTotals g_totals;
int g_gpu_cases_skipped = 0;

// Records the run's test-case totals; main prints them after Catch's own summary, so that the
// summary line is the very last line.
struct SummaryListener : Catch::TestEventListenerBase {
    using TestEventListenerBase::TestEventListenerBase;
    void testRunEnded(Catch::TestRunStats const& stats) override {
        g_totals.ended = true;
        g_totals.passed = stats.totals.testCases.passed + stats.totals.testCases.failedButOk;
        g_totals.failed = stats.totals.testCases.failed;
        TestEventListenerBase::testRunEnded(stats);
    }
};
}  // namespace
CATCH_REGISTER_LISTENER(SummaryListener)

int main(int argc, char* argv[]) {
    Catch::Session session;
    if (int rc = session.applyCommandLine(argc, argv)) return rc;

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
        const std::string why = err != cudaSuccess
                                    ? std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err)
                                    : std::string("cudaGetDeviceCount found 0 devices");
        cudaGetLastError();  // clear the error so that nothing later trips on it
        const Catch::ConfigData& config = session.configData();
        const bool listing = config.listTests || config.listTestNamesOnly || config.listTags ||
                             config.listReporters;
        if (listing) {
            // --list-tests and friends list everything, [gpu] included
        } else if (config.testsOrTags.empty()) {
            for (const Catch::TestCase& tc : Catch::getRegistryHub().getTestCaseRegistry().getAllTests())
                if (!tc.isHidden() && std::find(tc.lcaseTags.begin(), tc.lcaseTags.end(), "gpu") !=
                                          tc.lcaseTags.end())
                    ++g_gpu_cases_skipped;
            // Catch's own default leaves hidden tests out; a spec of exclusions alone would not.
            session.configData().testsOrTags.push_back("~[gpu]~[.]");
            std::cout << "No usable CUDA device (" << why << "): skipping the "
                      << g_gpu_cases_skipped << " [gpu] test cases; the CPU tests run." << std::endl;
        } else {
            std::cout << "No usable CUDA device (" << why
                      << "): any [gpu] test the test spec selects will fail." << std::endl;
        }
    }

    const int result = session.run();
    if (g_totals.ended)
        std::cout << "flash tests: " << g_totals.passed << " passed, " << g_totals.failed
                  << " failed, " << g_gpu_cases_skipped << " skipped" << std::endl;
    return result;
}
