// test_reference_general.cpp: the CPU reference for attention as models call it (reference.h,
// attention_reference_general: softmax_scale, window_size, softcap, ALiBi, grouped K/V heads, any
// strides, packed sequences), checked on the CPU against what it must agree with: the chapters'
// reference where the features are off, a second, naive implementation written here from the
// rules, its own forward's finite differences for its gradients, and itself on other layouts.
// It is the ground truth of chapter 5's kernels (tests/test_options.cpp).

#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

using Catch::Matchers::Contains;

namespace {

// A dense problem of random inputs: [batch][heads][len][d] tensors, contiguous, with its buffers.
struct Dense {
    int batch, heads, kv_heads, q_len, kv_len, d;
    std::vector<double> Q, K, V, dO, O, L, dQ, dK, dV;
    ReferenceProblem p;
    Dense(int b, int h, int kvh, int q, int n, int dim, uint32_t seed)
        : batch(b), heads(h), kv_heads(kvh), q_len(q), kv_len(n), d(dim) {
        std::mt19937 rng(seed);
        std::normal_distribution<double> normal(0.0, 1.0);
        const auto fill = [&](std::vector<double>& t, size_t count) {
            t.resize(count);
            for (double& x : t) x = normal(rng);
        };
        fill(Q, size_t(b) * h * q * dim);
        fill(K, size_t(b) * kvh * n * dim);
        fill(V, size_t(b) * kvh * n * dim);
        fill(dO, size_t(b) * h * q * dim);
        O.assign(Q.size(), std::nan(""));
        dQ.assign(Q.size(), std::nan(""));
        dK.assign(K.size(), std::nan(""));
        dV.assign(K.size(), std::nan(""));
        L.assign(size_t(b) * h * q, std::nan(""));
        p.batch = b, p.heads = h, p.kv_heads = kvh, p.head_dim = dim, p.q_len = q, p.kv_len = n;
        point();
        p.q = p.o = p.dq = p.d_o = reference_contiguous(h, q, dim);
        p.k = p.v = p.dk = p.dv = reference_contiguous(kvh, n, dim);
    }
    void point() {
        p.Q = Q.data(), p.K = K.data(), p.V = V.data(), p.dO = dO.data();
        p.O = O.data(), p.L = L.data(), p.dQ = dQ.data(), p.dK = dK.data(), p.dV = dV.data();
    }
    void run() {
        point();
        attention_reference_general(p);
        attention_reference_general_backward(p);
    }
};

// The rules of reference.h written again, as plainly as possible: every score of the row, then
// the mask, then the softmax. Returns O_i and sets L_i (row i of head h of batch b).
std::vector<double> naive_row(const Dense& t, int b, int h, int i, double& L) {
    const ReferenceProblem& p = t.p;
    const int g = h / (t.heads / t.kv_heads), d = t.d;
    const double scale = p.softmax_scale > 0 ? p.softmax_scale : 1.0 / std::sqrt(double(d));
    const long long shifted = i + t.kv_len - t.q_len;
    std::vector<double> s(t.kv_len);
    std::vector<bool> seen(t.kv_len);
    for (int j = 0; j < t.kv_len; ++j) {
        double dot = 0;
        for (int x = 0; x < d; ++x)
            dot += t.Q[((size_t(b) * t.heads + h) * t.q_len + i) * d + x] *
                   t.K[((size_t(b) * t.kv_heads + g) * t.kv_len + j) * d + x];
        s[j] = scale * dot;
        if (p.softcap > 0) s[j] = p.softcap * std::tanh(s[j] / p.softcap);
        if (p.alibi_slopes) s[j] -= p.alibi_slopes[h] * std::fabs(double(shifted - j));
        seen[j] = (p.window_left < 0 || j >= shifted - p.window_left) &&
                  (p.window_right < 0 || j <= shifted + p.window_right) &&
                  (!p.causal || j <= shifted);
    }
    double sum = 0;
    for (int j = 0; j < t.kv_len; ++j)
        if (seen[j]) sum += std::exp(s[j]);
    std::vector<double> o(d, 0.0);
    L = sum > 0 ? std::log(sum) : -std::numeric_limits<double>::infinity();
    for (int j = 0; j < t.kv_len; ++j)
        if (seen[j])
            for (int x = 0; x < d; ++x)
                o[x] += std::exp(s[j] - L) * t.V[((size_t(b) * t.kv_heads + g) * t.kv_len + j) * d + x];
    return o;
}

// The loss whose gradients the backward gives: sum of O o dO (dO fixed), from a fresh forward.
double loss_of(Dense t) {
    t.point();
    attention_reference_general(t.p);
    double sum = 0;
    for (size_t k = 0; k < t.O.size(); ++k) sum += t.O[k] * t.dO[k];
    return sum;
}

}  // namespace

TEST_CASE("The general reference with every feature off is the chapters' reference",
          "[cpu][reference][general]") {
    // Same rules, another code path: agreement to 1e-12 of the output's size (both sum in double,
    // in other orders: a few ulps over sums of at most 40 terms of size ~1).
    const bool causal = GENERATE(false, true);
    const auto qk = GENERATE(std::make_pair(7, 7), std::make_pair(5, 11), std::make_pair(11, 5));
    Dense t(2, 3, 3, qk.first, qk.second, 16, 5100);  // 16: a head dim the chapters' reference takes
    t.p.causal = causal;
    t.run();
    const AttentionShape s{2, 3, qk.first, qk.second, 16, causal};
    std::vector<double> O(t.O.size()), L(t.L.size()), dQ(t.Q.size()), dK(t.K.size()), dV(t.K.size());
    attention_reference(t.Q.data(), t.K.data(), t.V.data(), O.data(), L.data(), s);
    attention_reference_backward(t.Q.data(), t.K.data(), t.V.data(), O.data(), t.dO.data(),
                                 L.data(), dQ.data(), dK.data(), dV.data(), s);
    INFO(describe(s));
    const auto near = [](const std::vector<double>& a, const std::vector<double>& b) {
        for (size_t k = 0; k < a.size(); ++k) {
            if (std::isinf(a[k]) && a[k] == b[k]) continue;
            if (!(std::fabs(a[k] - b[k]) <= 1e-12 * std::max(1.0, std::fabs(b[k])))) return false;
        }
        return true;
    };
    CHECK(near(t.O, O));
    CHECK(near(t.L, L));
    CHECK(near(t.dQ, dQ));
    CHECK(near(t.dK, dK));
    CHECK(near(t.dV, dV));
}

TEST_CASE("The general reference's forward is the rules computed plainly: windows, softcap, "
          "ALiBi, the scale, GQA", "[cpu][reference][general]") {
    struct Case {
        int left, right;
        bool causal;
        double softcap, scale;
        bool alibi;
    };
    const Case c = GENERATE(Case{2, 1, false, 0, 0, false}, Case{-1, 0, false, 0, 0, false},
                            Case{3, -1, true, 0, 0, false}, Case{0, 0, false, 0, 0, false},
                            Case{-1, -1, false, 1.5, 0, false}, Case{-1, -1, true, 0, 0.7, true},
                            Case{4, 2, true, 2.0, 0.3, true});
    const auto qk = GENERATE(std::make_pair(9, 9), std::make_pair(4, 13), std::make_pair(13, 4));
    Dense t(2, 4, 2, qk.first, qk.second, 8, 5200);
    const std::vector<double> slopes = {0.5, 0.25, 0.125, 0.0625};
    t.p.window_left = c.left, t.p.window_right = c.right, t.p.causal = c.causal;
    t.p.softcap = c.softcap, t.p.softmax_scale = c.scale;
    t.p.alibi_slopes = c.alibi ? slopes.data() : nullptr;
    t.run();
    CAPTURE(c.left, c.right, c.causal, c.softcap, c.scale, c.alibi, qk.first, qk.second);
    double worst = 0;
    int rows_without_keys = 0;
    for (int b = 0; b < 2; ++b)
        for (int h = 0; h < 4; ++h)
            for (int i = 0; i < t.q_len; ++i) {
                double L = 0;
                const std::vector<double> o = naive_row(t, b, h, i, L);
                const size_t row = (size_t(b) * 4 + h) * t.q_len + i;
                if (std::isinf(L)) {
                    ++rows_without_keys;
                    CHECK(t.L[row] == L);
                } else {
                    worst = std::max(worst, std::fabs(t.L[row] - L));
                }
                for (int x = 0; x < 8; ++x) worst = std::max(worst, std::fabs(t.O[row * 8 + x] - o[x]));
            }
    INFO("rows that see no key: " << rows_without_keys << "; worst difference " << worst);
    CHECK(worst <= 1e-12);  // double sums of at most 13 terms of size ~1, in other orders
}

TEST_CASE("The general reference's gradients are its forward's finite differences, every "
          "feature on", "[cpu][reference][general][backward]") {
    // d(loss)/d(x) for loss = sum O o dO by central differences, h = 1e-6: the truncation error is
    // h^2 times the third derivative, ~1e-12 here, the rounding error ~1e-16 / h = 1e-10. So 1e-7
    // (relative to the gradient's largest element) passes a right backward by three orders and
    // fails any wrong term (a missing softcap derivative changes dQ and dK by tens of percent).
    const bool softcap = GENERATE(false, true);
    Dense t(1, 4, 2, 6, 9, 4, 5300);
    const std::vector<double> slopes = {0.3, 0.2, 0.1, 0.05};
    t.p.window_left = 4, t.p.window_right = 1, t.p.causal = false;
    t.p.softcap = softcap ? 1.2 : 0.0;
    t.p.softmax_scale = 0.6;
    t.p.alibi_slopes = slopes.data();
    t.run();
    CAPTURE(softcap);
    const double h = 1e-6;
    for (auto [name, tensor, grad] : {std::make_tuple("Q", &Dense::Q, &Dense::dQ),
                                      std::make_tuple("K", &Dense::K, &Dense::dK),
                                      std::make_tuple("V", &Dense::V, &Dense::dV)}) {
        const std::vector<double>& g = t.*grad;
        double largest = 0, worst = 0;
        size_t where = 0;
        for (double x : g) largest = std::max(largest, std::fabs(x));
        for (size_t k = 0; k < g.size(); ++k) {
            Dense up = t, down = t;
            (up.*tensor)[k] += h;
            (down.*tensor)[k] -= h;
            const double fd = (loss_of(up) - loss_of(down)) / (2 * h);
            if (std::fabs(fd - g[k]) > worst) worst = std::fabs(fd - g[k]), where = k;
        }
        INFO("d" << name << ": worst difference " << worst << " at element " << where
                 << ", largest gradient " << largest);
        CHECK(largest > 0.01);  // the check means something: the gradient is not all zeros
        CHECK(worst <= 1e-7 * largest);
    }
}

TEST_CASE("The general reference reads any strides and packed sequences as the dense layout",
          "[cpu][reference][general]") {
    // The same arithmetic in the same order on other addresses: the results agree to the bit.
    Dense t(2, 2, 1, 5, 7, 4, 5400);  // GQA: 2 query heads over 1 K/V head
    t.p.causal = true, t.p.window_left = 3;
    t.run();
    SECTION("Q, K, V as slices of one fused (batch, len, 3, heads, d) projection") {
        // Q, K, V of equal lengths here: q_len 5 rows of Q, and 7 of K and V, in one buffer of
        // 7 positions, 3 tensors, 2 heads (K, V use head 0 only, kv_heads = 1).
        const int pos = 7, H = 2, d = 4;
        std::vector<double> fused(size_t(2) * pos * 3 * H * d, std::nan(""));
        const ReferenceStrides st{pos * 3LL * H * d, d, 3LL * H * d};
        auto put = [&](const std::vector<double>& src, int which, int heads, int len) {
            for (int b = 0; b < 2; ++b)
                for (int h = 0; h < heads; ++h)
                    for (int i = 0; i < len; ++i)
                        for (int x = 0; x < d; ++x)
                            fused[b * st.batch + which * H * d + h * st.head + i * st.row + x] =
                                src[((size_t(b) * heads + h) * len + i) * d + x];
        };
        put(t.Q, 0, 2, 5);
        put(t.K, 1, 1, 7);
        put(t.V, 2, 1, 7);
        Dense u = t;
        u.point();
        u.p.Q = fused.data(), u.p.K = fused.data() + H * d, u.p.V = fused.data() + 2 * H * d;
        u.p.q = u.p.k = u.p.v = st;
        std::fill(u.O.begin(), u.O.end(), std::nan(""));
        std::fill(u.dQ.begin(), u.dQ.end(), std::nan(""));
        attention_reference_general(u.p);
        attention_reference_general_backward(u.p);
        CHECK(u.O == t.O);
        CHECK(u.L == t.L);
        CHECK(u.dQ == t.dQ);
        CHECK(u.dK == t.dK);
        CHECK(u.dV == t.dV);
    }
    SECTION("Packed sequences of their own lengths: each as its own dense call") {
        // Two sequences, 3 and 5 queries over 6 and 2 keys, packed; each checked against a
        // dense problem of its lengths (the bottom-right causal alignment per sequence).
        const std::vector<int> cu_q = {0, 3, 8}, cu_k = {0, 6, 8};
        const int H = 2, d = 4;
        Dense packed(1, H, 1, 8, 8, d, 5500);  // [1][H][8][d] buffers: rows are the packed rows
        packed.p.batch = 2;
        packed.p.cu_seqlens_q = cu_q.data(), packed.p.cu_seqlens_k = cu_k.data();
        packed.p.causal = true, packed.p.window_left = 3;
        packed.run();
        for (int b = 0; b < 2; ++b) {
            const int q = cu_q[b + 1] - cu_q[b], n = cu_k[b + 1] - cu_k[b];
            Dense one(1, H, 1, q, n, d, 1);
            for (int h = 0; h < H; ++h)
                for (int i = 0; i < q; ++i)
                    for (int x = 0; x < d; ++x) {
                        one.Q[(h * q + i) * d + x] = packed.Q[(h * 8 + cu_q[b] + i) * d + x];
                        one.dO[(h * q + i) * d + x] = packed.dO[(h * 8 + cu_q[b] + i) * d + x];
                    }
            for (int j = 0; j < n; ++j)
                for (int x = 0; x < d; ++x) {
                    one.K[j * d + x] = packed.K[(cu_k[b] + j) * d + x];
                    one.V[j * d + x] = packed.V[(cu_k[b] + j) * d + x];
                }
            one.p.causal = true, one.p.window_left = 3;
            one.run();
            CAPTURE(b, q, n);
            for (int h = 0; h < H; ++h)
                for (int i = 0; i < q; ++i) {
                    // L of packed sequences is [heads][total_q]
                    CHECK(packed.L[h * 8 + cu_q[b] + i] == one.L[h * q + i]);
                    for (int x = 0; x < d; ++x) {
                        CHECK(packed.O[(h * 8 + cu_q[b] + i) * d + x] == one.O[(h * q + i) * d + x]);
                        CHECK(packed.dQ[(h * 8 + cu_q[b] + i) * d + x] == one.dQ[(h * q + i) * d + x]);
                    }
                }
            for (int j = 0; j < n; ++j)
                for (int x = 0; x < d; ++x) {
                    CHECK(packed.dK[(cu_k[b] + j) * d + x] == one.dK[j * d + x]);
                    CHECK(packed.dV[(cu_k[b] + j) * d + x] == one.dV[j * d + x]);
                }
        }
    }
}

TEST_CASE("The general reference refuses bad fields, naming them, before writing anything",
          "[cpu][reference][general][validation]") {
    Dense t(1, 4, 2, 3, 3, 4, 5600);
    const std::vector<int> bad_cu = {0, 3, 2};
    struct Bad {
        const char* field;
        void (*spoil)(ReferenceProblem&, const std::vector<int>&);
    };
    const Bad bad[] = {
        {"window_left", [](ReferenceProblem& p, const std::vector<int>&) { p.window_left = -2; }},
        {"window_right", [](ReferenceProblem& p, const std::vector<int>&) { p.window_right = -5; }},
        {"softcap", [](ReferenceProblem& p, const std::vector<int>&) { p.softcap = -1; }},
        {"softmax_scale", [](ReferenceProblem& p, const std::vector<int>&) { p.softmax_scale = -0.5; }},
        {"kv_heads", [](ReferenceProblem& p, const std::vector<int>&) { p.kv_heads = 3; }},
        {"cu_seqlens_k", [](ReferenceProblem& p, const std::vector<int>& cu) {
             p.cu_seqlens_q = cu.data();  // one given without the other
         }},
        {"cu_seqlens_q[2]", [](ReferenceProblem& p, const std::vector<int>& cu) {
             p.batch = 2, p.cu_seqlens_q = cu.data(), p.cu_seqlens_k = cu.data();
         }},
    };
    for (const Bad& b : bad) {
        ReferenceProblem p = t.p;
        b.spoil(p, bad_cu);
        CAPTURE(b.field);
        CHECK_THAT(refusal([&] { attention_reference_general(p); }), Contains(b.field));
        CHECK_THAT(refusal([&] { attention_reference_general_backward(p); }), Contains(b.field));
        const auto all_nan = [](const std::vector<double>& v) {
            return std::all_of(v.begin(), v.end(), [](double x) { return std::isnan(x); });
        };
        CHECK(all_nan(t.O));  // nothing written: the outputs are still NaN
        CHECK(all_nan(t.dQ));
    }
}

TEST_CASE("The general reference reads a paged K/V cache with ragged lengths as each sequence's "
          "own dense cache", "[cpu][reference][general][paged]") {
    // Three sequences of 2 query rows over 13, 1 and 0 cached keys; pages of 4 keys scattered in
    // one pool of 10 pages (vLLM's layout: [pages][page_size][kv_heads][d]), kv_heads 1 of 2.
    const int B = 3, H = 2, d = 4, q = 2, page = 4, pages_per_seq = 4, kv_len = 16;
    const std::vector<int> lens = {13, 1, 0};
    const std::vector<int> table = {7, 2, 9, 0, /**/ 5, -1, -1, -1, /**/ -1, -1, -1, -1};
    Dense paged(B, H, 1, q, kv_len, d, 5700);
    std::vector<double> pool(size_t(10) * page * d, std::nan(""));  // unused pages: NaN
    for (int b = 0; b < B; ++b)
        for (int j = 0; j < lens[b]; ++j)
            for (int x = 0; x < d; ++x)
                pool[(size_t(table[b * pages_per_seq + j / page]) * page + j % page) * d + x] =
                    paged.K[(size_t(b) * kv_len + j) * d + x];
    std::vector<double> vpool(pool.size(), std::nan(""));
    for (int b = 0; b < B; ++b)
        for (int j = 0; j < lens[b]; ++j)
            for (int x = 0; x < d; ++x)
                vpool[(size_t(table[b * pages_per_seq + j / page]) * page + j % page) * d + x] =
                    paged.V[(size_t(b) * kv_len + j) * d + x];
    paged.point();
    paged.p.K = pool.data(), paged.p.V = vpool.data();
    paged.p.k = paged.p.v = {page * d, d, d};  // a page's rows, then the next page
    paged.p.cache_seqlens = lens.data(), paged.p.block_table = table.data();
    paged.p.page_size = page, paged.p.pages_per_seq = pages_per_seq;
    paged.p.causal = true;
    attention_reference_general(paged.p);
    for (int b = 0; b < B; ++b) {
        CAPTURE(b, lens[b]);
        if (lens[b] == 0) {  // no keys: O = 0, L = -inf
            for (int e = 0; e < H * q; ++e) CHECK(std::isinf(paged.L[b * H * q + e]));
            continue;
        }
        Dense one(1, H, 1, q, lens[b], d, 1);
        std::copy_n(paged.Q.begin() + size_t(b) * H * q * d, H * q * d, one.Q.begin());
        std::copy_n(paged.K.begin() + size_t(b) * kv_len * d, lens[b] * d, one.K.begin());
        std::copy_n(paged.V.begin() + size_t(b) * kv_len * d, lens[b] * d, one.V.begin());
        one.p.causal = true;
        one.point();
        attention_reference_general(one.p);
        for (int e = 0; e < H * q; ++e) CHECK(paged.L[b * H * q + e] == one.L[e]);
        for (int e = 0; e < H * q * d; ++e) CHECK(paged.O[size_t(b) * H * q * d + e] == one.O[e]);
    }
    // Refused: a table without lengths, a page size of 0, a table too short, a missing page in
    // use, and a backward (a cache is for inference).
    struct Bad {
        const char* field;
        void (*spoil)(ReferenceProblem&);
    };
    const Bad bad[] = {
        {"block_table", [](ReferenceProblem& p) { p.cache_seqlens = nullptr; }},
        {"page_size", [](ReferenceProblem& p) { p.page_size = 0; }},
        {"pages_per_seq", [](ReferenceProblem& p) { p.pages_per_seq = 3; }},
        {"cache_seqlens[1]", [](ReferenceProblem& p) {
             static const int too_long[] = {13, 17, 0};
             p.cache_seqlens = too_long;
         }},
        {"block_table[0][3]", [](ReferenceProblem& p) {
             static const int holes[] = {7, 2, 9, -1, 5, -1, -1, -1, -1, -1, -1, -1};
             p.block_table = holes;
         }},
    };
    for (const Bad& b : bad) {
        ReferenceProblem p = paged.p;
        b.spoil(p);
        CAPTURE(b.field);
        CHECK_THAT(refusal([&] { attention_reference_general(p); }), Contains(b.field));
    }
    CHECK_THAT(refusal([&] { attention_reference_general_backward(paged.p); }),
               Contains("cache_seqlens"));
}
