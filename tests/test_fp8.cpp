// tests/test_fp8.cpp: chapter 3's fp8 forward (flash_hopper_fp8.cu, flash_forward_fp8_hopper).
// Run: ./test_flash "[fp8]"
//
// The reference is the kernel's own arithmetic in double on the e4m3 inputs (fp8_reference,
// below): keys in tiles of 128, each tile's P~ = 256 exp(S - m) against the running max m after
// the tile, rounded to e4m3 as cvt.rn does, l summing P~ unrounded. Where the kernel's fp32 lands
// on the same side of every e4m3 rounding midpoint, its P~ is the reference's, bit for bit; the
// tolerance of each row is what the rest can move (fp8_tolerance says how much). A second check
// holds the reference against exact softmax attention, within the error bound of P~'s rounding.
#include "checks.h"
#include "flash.h"
#include "test_util.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace {

using fp8 = __nv_fp8_e4m3;

double e4m3(double x) { return double(float(fp8(float(x)))); }  // (round to nearest even)
// The e4m3 step at x >= 0 (one unit in the last place): 2^(e - 3) for normal numbers, 2^-9 below.
double e4m3_step(double x) {
    return x < 0.015625 ? std::ldexp(1.0, -9) : std::ldexp(1.0, std::ilogb(x) - 3);
}

struct Fp8Problem {
    AttentionShape s;
    std::vector<fp8> Q, K, V;
    std::vector<float> dq, dk, dv;  // descales: [batch][heads], [batch][kv_heads] twice
};

// Random inputs: normal values rounded to e4m3 (scores of a few units: peaked rows and flat), V's
// shifted by v_mean (models' V have channels with a mean), and descales not 1.
Fp8Problem fp8_problem(const AttentionShape& s, uint32_t salt, float v_mean = 0.f) {
    Fp8Problem p{s, {}, {}, {}, {}, {}, {}};
    std::mt19937 rng(seed_of(s, salt));
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_real_distribution<float> scale(0.25f, 2.f);
    const auto fill = [&](std::vector<fp8>& x, size_t n, float mean) {
        x.resize(n);
        for (fp8& e : x) e = fp8(normal(rng) + mean);
    };
    fill(p.Q, q_elems(s), 0.f), fill(p.K, kv_elems(s), 0.f), fill(p.V, kv_elems(s), v_mean);
    const size_t hq = size_t(s.batch) * s.heads, hk = size_t(s.batch) * flash_kv_heads(s);
    for (size_t h = 0; h < hq; h++) p.dq.push_back(scale(rng));
    for (size_t h = 0; h < hk; h++) p.dk.push_back(scale(rng)), p.dv.push_back(scale(rng));
    return p;
}

struct Fp8Want {
    std::vector<double> O, L, O_tol, L_tol;  // per element of O; per row
    std::vector<double> O_exact;             // exact softmax attention on the e4m3 inputs
};

// The kernel's arithmetic in double, and each row's tolerance:
//  - S: exact here; in the kernel an fp32 accumulation whose fp8 tensor-core sums may keep fewer
//    bits (about 14, DeepSeek-V3's report on H800): |dS| <= (d / 32) 2^-13 sum_k |q_k k_k| a
//    score, which moves log2 P~ by w = 2 scale |dS| (the score and the max).
//  - P~: where 256 P~ lies within relative w of a rounding midpoint, the kernel may round the
//    other way: one e4m3 step times |v| for that key in O's numerator, and one step in l (which
//    sums the same rounded P~, on the tensor cores): |O| step / l. Elsewhere the same bits.
//  - l and the P~ V sums: relative w + 2^-12; O rounded to bf16 / fp16: 2^-8 relative, bf16's
//    unit roundoff (8 significant bits; fp16's is 2^-11). With V centred, O is mostly mu, and
//    this is the only term that bounds its rounding.
//  - L = m + log l: |dm scale| + w, in log2 units, and l's steps.
//  - V centred (flash_fp8_centred_v): the kernel's V' = e4m3(v - mu) and mu as the kernel makes
//    them (flash_fp8_centre), and O = descale_v (mu + P~ V' / l); l's steps move the second part.
// With row_step > 1, only rows i % row_step == 0 (of each head); the others want NaN (unchecked).
Fp8Want fp8_reference(const Fp8Problem& p, int row_step = 1) {
    const AttentionShape& s = p.s;
    const int d = s.head_dim, group = flash_kv_group(s);
    const double scale = 1.0 / std::sqrt(double(d)) / std::log(2.0);  // log2 units
    // e4m3 -> float is exact; made once, not in the inner loops (a software conversion on the CPU)
    const auto widen = [](const std::vector<fp8>& x) {
        std::vector<float> f(x.size());
        for (size_t e = 0; e < x.size(); e++) f[e] = float(x[e]);
        return f;
    };
    const std::vector<float> Qf = widen(p.Q), Kf = widen(p.K), Vx = widen(p.V);
    std::vector<float> Vf = Vx, mu(size_t(s.batch) * flash_kv_heads(s) * d, 0.f);
    if (flash_fp8_centred_v(d))
        for (size_t h = 0; h < size_t(s.batch) * flash_kv_heads(s); h++)
            for (int x = 0; x < d; x++) {
                float* col = &Vf[h * s.kv_len * d + x];
                long long sum512 = 0;
                float lo = INFINITY, hi = -INFINITY;
                for (int j = 0; j < s.kv_len; j++) {
                    const float v = col[size_t(j) * d];
                    sum512 += (long long)(v * 512.f), lo = std::min(lo, v), hi = std::max(hi, v);
                }
                mu[h * d + x] = flash_fp8_centre(sum512, s.kv_len, lo, hi);
                for (int j = 0; j < s.kv_len; j++)
                    col[size_t(j) * d] = float(fp8(col[size_t(j) * d] - mu[h * d + x]));
            }
    Fp8Want w;
    w.O.assign(q_elems(s), 0), w.O_tol.assign(q_elems(s), 0), w.O_exact.assign(q_elems(s), 0);
    w.L.assign(l_elems(s), 0), w.L_tol.assign(l_elems(s), 0);
    // A row at a time, on the reference's threads (each row writes only its own entries of w).
    const size_t rows = size_t(s.batch) * s.heads * s.q_len;
    const double work = double(rows) * s.kv_len * d / row_step;
    attention_reference_for_each(rows, work, [&](size_t row) {
        const int bh = int(row / s.q_len), i = int(row % s.q_len), kv = bh / group;
        const double sc = scale * p.dq[bh] * p.dk[kv], dv = p.dv[kv];
        const float* Q = &Qf[size_t(bh) * s.q_len * d];
        const float* K = &Kf[size_t(kv) * s.kv_len * d];
        const float* V = &Vf[size_t(kv) * s.kv_len * d];   // (centred or not)
        const float* Vo = &Vx[size_t(kv) * s.kv_len * d];  // as given
        const float* mu_h = &mu[size_t(kv) * d];
        if (i % row_step != 0) {
            std::fill_n(&w.O[row * d], d, NAN), w.L[row] = NAN;
            return;
        }
        const int last = s.causal ? i + s.kv_len - s.q_len : s.kv_len - 1;
        std::vector<double> S(s.kv_len), mag(s.kv_len);
        double m = -INFINITY, mag_max = 0;
        for (int j = 0; j <= last && j < s.kv_len; j++) {
            double dot = 0, abs = 0;
            for (int x = 0; x < d; x++) {
                const double a = Q[size_t(i) * d + x], b = K[size_t(j) * d + x];
                dot += a * b, abs += std::fabs(a * b);
            }
            S[j] = dot, mag_max = std::max(mag_max, abs);
        }
        const double wlog = 2 * sc * (d / 32) * std::ldexp(mag_max, -13) + 1e-6;
        const double wrel = wlog * std::log(2.0);
        std::vector<double> o(d, 0), oabs(d, 0), near(d, 0);
        double l = 0, near_l = 0;
        const int Bc = flash_fp8_bc(d);  // the kernel's tile of keys
        for (int j0 = 0; j0 <= last && j0 < s.kv_len; j0 += Bc) {  // tile by tile
            const int j1 = std::min({j0 + Bc, last + 1, s.kv_len});
            double m_new = m;
            for (int j = j0; j < j1; j++) m_new = std::max(m_new, S[j]);
            const double alpha = m == -INFINITY ? 0 : std::exp2((m - m_new) * sc);
            l *= alpha, near_l *= alpha;
            for (int x = 0; x < d; x++) o[x] *= alpha, oabs[x] *= alpha, near[x] *= alpha;
            m = m_new;
            for (int j = j0; j < j1; j++) {
                const double pt = std::exp2((S[j] - m) * sc + 8), ph = e4m3(pt);
                l += ph;
                // Within relative wrel of the midpoint between ph and its neighbour?
                // (below a power of two the step is half the one above it)
                const double step = e4m3_step(pt > ph ? ph : ph * (1 - 1e-12));
                const double mid = pt > ph ? ph + step / 2 : ph - step / 2;
                const bool flips = std::fabs(pt - mid) <= wrel * pt;
                if (flips) near_l += step;
                for (int x = 0; x < d; x++) {
                    const double v = V[size_t(j) * d + x];
                    o[x] += ph * v, oabs[x] += ph * std::fabs(v);
                    if (flips) near[x] += step * std::fabs(v);
                }
            }
        }
        for (int x = 0; x < d; x++) {
            const double divided = l > 0 ? dv * o[x] / l : 0;  // the part divided by l
            const double O = l > 0 ? divided + dv * mu_h[x] : 0;
            w.O[row * d + x] = O;
            w.O_tol[row * d + x] =
                l > 0 ? dv * (near[x] + (wrel + std::ldexp(1.0, -12)) * oabs[x]) / l +
                            std::fabs(divided) * near_l / l + std::ldexp(std::fabs(O), -8) +
                            1e-6
                      : 0;
        }
        w.L[row] = l > 0 ? (m * sc + std::log2(l) - 8) * std::log(2.0) : -INFINITY;
        w.L_tol[row] = (2 * wlog + 1e-6) * std::log(2.0) + (l > 0 ? near_l / l : 0);
        // Exact attention: P unrounded against the row's final max.
        double lx = 0;
        std::vector<double> ox(d, 0);
        for (int j = 0; j <= last && j < s.kv_len; j++) {
            const double pe = std::exp2((S[j] - m) * sc);
            lx += pe;
            for (int x = 0; x < d; x++) ox[x] += pe * Vo[size_t(j) * d + x];
        }
        for (int x = 0; x < d; x++) w.O_exact[row * d + x] = lx > 0 ? dv * ox[x] / lx : 0;
    });
    return w;
}

template <typename TO>
std::vector<float> run_fp8(const Fp8Problem& p, std::vector<float>* L_out) {
    const AttentionShape& s = p.s;
    const DeviceBuffer<fp8> Q(p.Q), K(p.K), V(p.V);
    const DeviceBuffer<float> dq(p.dq), dk(p.dk), dv(p.dv);
    DeviceBuffer<TO> O(q_elems(s));
    DeviceBuffer<float> L(l_elems(s));
    O.poison(), L.poison();
    {
        const GpuCall call = gpu_call<TO>("forward", Kernel::public_call(), s);
        const DeadlineGuard guard(call);
        flash_forward_fp8_hopper(Q.ptr, K.ptr, V.ptr, O.ptr, L.ptr, s, {dq.ptr, dk.ptr, dv.ptr});
        wait_for_gpu(0, call);
    }
    *L_out = L.download();
    return O.download_float();
}

// Every element against its tolerance (those the reference left NaN: not checked); the first
// failures named (shape, element, error, bound).
void check_rows(const char* what, const std::vector<float>& got, const std::vector<double>& want,
                const std::vector<double>& tol, const AttentionShape& s, int width) {
    int bad = 0;
    double worst = 0;
    size_t worst_at = 0;
    for (size_t e = 0; e < want.size(); e++) {
        if (std::isnan(want[e])) continue;
        const double err = std::isnan(got[e]) ? INFINITY : std::fabs(got[e] - want[e]);
        const bool ok = std::isinf(want[e]) ? got[e] == want[e] : err <= tol[e];
        if (err / (tol[e] + 1e-30) > worst) worst = err / (tol[e] + 1e-30), worst_at = e;
        if (!ok && bad++ < 3)
            FAIL_CHECK(what << " on " << describe(s) << " at (row " << e / width << ", column "
                            << e % width << "): " << got[e] << " vs " << want[e] << ", error "
                            << err << " past " << tol[e]);
    }
    INFO(what << ": the worst error is " << worst << " of its bound, at element " << worst_at);
    CHECK(bad == 0);
}

}  // namespace

TEST_CASE("flash_fp8_v_slot deals each 32 keys out as a thread's accumulators meet the fp8 A "
          "fragment", "[cpu][fp8]") {
    std::vector<int> seen(32, 0);
    for (int j = 0; j < 32; j++) seen.at(flash_fp8_v_slot(j))++;
    CHECK(std::count(seen.begin(), seen.end(), 1) == 32);  // a permutation
    for (int t = 0; t < 4; t++)  // thread t's keys 2t + e + 8h (+16) at A's k = 4t + 2h + e (+16)
        for (int h = 0; h < 2; h++)
            for (int e = 0; e < 2; e++)
                for (int upper = 0; upper < 32; upper += 16) {
                    CAPTURE(t, h, e, upper);
                    CHECK(flash_fp8_v_slot(upper + 2 * t + e + 8 * h) == upper + 4 * t + 2 * h + e);
                }
    CHECK(flash_fp8_v_slot(32 + 9) == 32 + flash_fp8_v_slot(9));  // each group alike
}

TEST_CASE("Each thread's P~ bytes meet the fp8 A fragment at the V^T slot of their own key",
          "[cpu][fp8]") {
    // For every thread (g, t), 32-key step kk, register a and byte i: the S accumulator that
    // flash_fp8_p_index picks is (row, key) by chapter 3's accumulator layout; the A fragment
    // reads that byte as (row', k) (lib/hopper.cuh's fp8 layout). P~ V is right iff row = row'
    // and V^T holds key's row at k: flash_fp8_v_slot(key) = k.
    int wrong = 0;
    for (int g = 0; g < 8; g++)
        for (int t = 0; t < 4; t++)
            for (int kk = 0; kk < 4; kk++)
                for (int a = 0; a < 4; a++)
                    for (int i = 0; i < 4; i++) {
                        const int n = flash_fp8_p_index(kk, a, i);
                        const int row = g + 8 * (n % 4 / 2), key = 8 * (n / 4) + 2 * t + n % 2;
                        const int row_a = g + 8 * (a % 2), k = 32 * kk + 4 * t + i + 16 * (a / 2);
                        if ((row != row_a || key / 32 * 32 + flash_fp8_v_slot(key % 32) != k) &&
                            wrong++ < 3)
                            FAIL_CHECK("thread (g " << g << ", t " << t << "), step " << kk
                                       << ", register " << a << ", byte " << i << ": S's (row "
                                       << row << ", key " << key << ") read as (row " << row_a
                                       << ", k " << k << ")");
                    }
    CHECK(wrong == 0);
}

TEST_CASE("The fp8 reference's own rounding: e4m3 steps, 448 and round to nearest even",
          "[cpu][fp8]") {
    CHECK(e4m3(448.0) == 448.0);
    CHECK(e4m3(1000.0) == 448.0);                  // (saturating, as cvt.rn.satfinite)
    CHECK(e4m3(1.0 + 1.0 / 16) == 1.0);            // a midpoint: to the even neighbour
    CHECK(e4m3(1.0 + 3.0 / 16) == 1.25);           // the other way
    CHECK(e4m3(256.0) == 256.0);                   // 256 P~ at P~ = 1
    CHECK(e4m3_step(1.0) == 0.125);
    CHECK(e4m3_step(std::ldexp(1.0, -8)) == std::ldexp(1.0, -9));  // subnormal
    CHECK(e4m3(std::ldexp(1.0, -11)) == 0.0);      // below half the smallest subnormal
}

TEST_CASE("flash_fp8_centre is a column's mean, moved just enough that no v - mu passes 448",
          "[cpu][fp8]") {
    // (sums in units of 2^-9, as centre_v and the reference add them)
    const auto centre = [](std::vector<float> col) {
        long long sum512 = 0;
        for (float v : col) sum512 += (long long)(v * 512.f);
        const auto [lo, hi] = std::minmax_element(col.begin(), col.end());
        return flash_fp8_centre(sum512, int(col.size()), *lo, *hi);
    };
    CHECK(centre({1.f, 2.f, 3.5f, 0.25f}) == 1.6875f);        // the mean, exactly
    CHECK(centre({448.f, 448.f, 448.f, -448.f}) == 0.f);      // mean 224: 448 - mu would be 672
    CHECK(centre({448.f, -16.f}) == 216.f);                   // within both bounds: the mean
    CHECK(centre({-448.f, -448.f, 448.f}) == 0.f);            // mean -149.3: 448 - mu > 448
    CHECK(centre({0.001953125f, 0.f, 0.f, 0.f}) == 0.00048828125f);  // 2^-9 / 4 (subnormal v)
}

TEST_CASE("The fp8 reference's P rounding stays within its bound of exact attention",
          "[cpu][fp8]") {
    // Each key's e4m3 P~ is within half a step (2^-4 relative, or 2^-10 absolute below 2^-6, of
    // 256 P~), and l sums the rounded P~, so O - O_exact = sum (P^ - P)(v - O_exact) / sum P^:
    // |O - O_exact| <= dv (2^-4 sum P + n 2^-10 / 256) 2 max|v| / ((1 - 2^-4) sum P). V centred
    // (d = 128 and 256) adds its own rounding, a weighted mean of e4m3(v - mu) - (v - mu): at
    // most dv (2^-4 max|v - mu| + 2^-10), and |v - mu| <= 2 max|v| (mu lies between v's extremes).
    const int d = GENERATE(64, 128, 256);
    AttentionShape s{1, 2, 70, 300, d, true};
    CAPTURE(d);
    const Fp8Problem p = fp8_problem(s, 24, d >= 128 ? 1.f : 0.f);
    const Fp8Want w = fp8_reference(p);
    double max_v = 0;
    for (const fp8& v : p.V) max_v = std::max(max_v, std::fabs(double(float(v))));
    const double dv = *std::max_element(p.dv.begin(), p.dv.end());
    const double centring = flash_fp8_centred_v(d) ? max_v / 8 + std::ldexp(1.0, -10) : 0;
    double worst = 0;
    for (size_t e = 0; e < w.O.size(); e++)
        worst = std::max(worst, std::fabs(w.O[e] - w.O_exact[e]) /
                                    (dv * (max_v * (1.0 / 8 + s.kv_len * std::ldexp(1.0, -17)) /
                                               (1 - 1.0 / 16) +
                                           centring)));
    CAPTURE(worst);
    CHECK(worst <= 1.0);
    CHECK(worst > 0.0);  // (it rounds at all)
}

TEMPLATE_TEST_CASE("The fp8 forward matches its arithmetic in double: shapes, causal, odd "
                   "lengths, GQA, head dims 64, 128, 256, descales not 1",
                   "[gpu][hopper][fp8]", __nv_bfloat16, __half) {
    if (!hopper_or_warn()) return;
    const auto [b, h, kvh, q, k, d, causal] = GENERATE(table<int, int, int, int, int, int, bool>(
        {{1, 2, 2, 128, 128, 128, false},
         {2, 4, 2, 200, 333, 128, true},    // odd lengths, GQA, a partial tile
         {1, 2, 1, 77, 1000, 64, false},    // d 64 (rows padded to 128 bytes), MQA
         {1, 2, 2, 129, 257, 256, true},    // d 256
         {1, 1, 1, 300, 100, 64, true}}));  // rows that see no key (causal, q_len > kv_len)
    AttentionShape s{b, h, q, k, d, causal};
    s.kv_heads = kvh;
    CAPTURE(describe(s), kvh);
    const Fp8Problem p = fp8_problem(s, 2400);
    const Fp8Want w = fp8_reference(p);
    std::vector<float> L;
    const std::vector<float> O = run_fp8<TestType>(p, &L);
    check_rows("O", O, w.O, w.O_tol, s, d);
    check_rows("L", L, w.L, w.L_tol, s, 1);
}

TEST_CASE("The fp8 forward on every SM: 32 heads of 4096 causal keys at d = 128 (GQA) match its "
          "arithmetic in double (one row in 61 checked) and give the same bits twice",
          "[gpu][hopper][fp8]") {
    // Each consumer makes the next tile's P~ while P~ V_{j-1} still reads the last one from
    // registers (a_operand_fence). Whether an early reuse of those registers shows depends on
    // timing: small grids ran right without the fence, a full GPU of 1,024 blocks did not (one
    // sampled row of 2,176 was off). The tolerance is the other test's; only the reference's cost
    // (rows sampled) differs. A race also varies from call to call: two calls compared bit for
    // bit check every row, at no cost to the CPU.
    if (!hopper_or_warn()) return;
    AttentionShape s{1, 32, 4096, 4096, 128, true};
    s.kv_heads = 8;  // (GQA: a quarter of the K, V to draw)
    CAPTURE(describe(s));
    const Fp8Problem p = fp8_problem(s, 2402);
    const Fp8Want w = fp8_reference(p, 61);
    std::vector<float> L, L2;
    const std::vector<float> O = run_fp8<__nv_bfloat16>(p, &L);
    check_rows("O", O, w.O, w.O_tol, s, s.head_dim);
    check_rows("L", L, w.L, w.L_tol, s, 1);
    const std::vector<float> O2 = run_fp8<__nv_bfloat16>(p, &L2);
    size_t differ = 0, first = 0;
    for (size_t e = 0; e < O.size(); e++)
        if (std::memcmp(&O[e], &O2[e], sizeof(float)) != 0 && differ++ == 0) first = e;
    INFO("O's elements that differ between two calls: " << differ << ", the first at row "
         << first / s.head_dim << ", column " << first % s.head_dim);
    CHECK(differ == 0);
    CHECK(std::memcmp(L.data(), L2.data(), L.size() * sizeof(float)) == 0);
}

TEST_CASE("The fp8 forward's long rows: sums over 16k keys stay within its model when V has a "
          "mean, at d = 64, 128 and 256 (two levels, or V centred)", "[gpu][hopper][fp8]") {
    // V's mean makes every P~ v of a column add the same way: a sum that drops low bits as it
    // grows (an fp8 wgmma's accumulator, carried from the first tile to the last) then drifts
    // from the model by several times its tolerance (0.08 of O at 16k keys, 0.28 of L); summed a
    // tile at a time and in fp32 across tiles (Fp8Sums), or of centred columns, it stays within.
    if (!hopper_or_warn()) return;
    const int d = GENERATE(64, 128, 256);
    AttentionShape s{1, 2, 64, 16384, d, false};
    CAPTURE(describe(s));
    const Fp8Problem p = fp8_problem(s, 2403, 1.f);
    const Fp8Want w = fp8_reference(p, 4);
    std::vector<float> L;
    const std::vector<float> O = run_fp8<__nv_bfloat16>(p, &L);
    check_rows("O", O, w.O, w.O_tol, s, d);
    check_rows("L", L, w.L, w.L_tol, s, 1);
}

TEST_CASE("The fp8 forward gives the same bits on every call", "[gpu][hopper][fp8]") {
    if (!hopper_or_warn()) return;
    // (d = 256: V's column stats are summed with atomics, on integers: the same in any order)
    AttentionShape s{2, 4, 300, 1100, GENERATE(128, 256), true};
    s.kv_heads = 2;
    const Fp8Problem p = fp8_problem(s, 2401);
    std::vector<float> L1, L2;
    const std::vector<float> O1 = run_fp8<__nv_bfloat16>(p, &L1);
    const std::vector<float> O2 = run_fp8<__nv_bfloat16>(p, &L2);
    CHECK(std::memcmp(O1.data(), O2.data(), O1.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(L1.data(), L2.data(), L1.size() * sizeof(float)) == 0);
}

TEST_CASE("The fp8 forward refuses a bad head dim and a descale array an output overlaps",
          "[gpu][hopper][fp8]") {
    if (!hopper_or_warn()) return;
    AttentionShape s{1, 2, 64, 64, 96, false};
    DeviceBuffer<fp8> Q(q_elems(s)), K(kv_elems(s)), V(kv_elems(s));
    DeviceBuffer<__nv_bfloat16> O(q_elems(s));
    DeviceBuffer<float> L(l_elems(s));
    CHECK_THROWS_WITH(flash_forward_fp8_hopper(Q.ptr, K.ptr, V.ptr, O.ptr, L.ptr, s),
                      Catch::Contains("head_dim"));
    s.head_dim = 64;
    DeviceBuffer<fp8> Q2(q_elems(s)), K2(kv_elems(s)), V2(kv_elems(s));
    DeviceBuffer<__nv_bfloat16> O2(q_elems(s));
    DeviceBuffer<float> L2(l_elems(s));
    Fp8Descales overlapping;
    overlapping.v = L2.ptr;  // the descales of V where L is written
    CHECK_THROWS_WITH(
        flash_forward_fp8_hopper(Q2.ptr, K2.ptr, V2.ptr, O2.ptr, L2.ptr, s, overlapping),
        Catch::Contains("descales.v"));
}
