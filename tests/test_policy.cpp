// test_policy.cpp: chapter 5's mask and score policies (lib/mask_policy.cuh),
// checked on the CPU, exhaustively on small shapes: each tile's kind and each Q tile's K/V tiles
// against every score's own visibility, each score's change and derivative against the rules
// the CPU reference follows (reference.h), and what chapter 2's kernels ask of PlainPolicy and
// ModelPolicy (the tiles each loads, masks and walks, forward and backward) against the rule.

#include "mask_policy.cuh"
#include "test_util.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace {
// The rule as reference.h states it, written again: query i sees key j.
bool sees(int q_len, int kv_len, bool causal, int left, int right, int i, int j) {
    const long long shifted = (long long)i + kv_len - q_len;
    return j >= 0 && j < kv_len && (left < 0 || j >= shifted - left) &&
           (right < 0 || j <= shifted + right) && (!causal || j <= shifted);
}
}  // namespace

TEST_CASE("The window mask's tiles and K/V tile ranges are what its scores say, on every small "
          "shape", "[cpu][policy]") {
    // Every q_len and kv_len to 11, windows open and closed on each side, causal and not, Q tiles
    // of 1 to 5 rows and K/V tiles of 1 to 4 keys: every (Q tile, K/V tile) pair's kind against
    // its scores, and each Q tile's loaded range against the tiles that hold a visible score.
    int pairs = 0, kinds[3] = {0, 0, 0};
    for (int q_len = 1; q_len <= 11; ++q_len)
        for (int kv_len = 1; kv_len <= 11; ++kv_len)
            for (int left : {-1, 0, 1, 3})
                for (int right : {-1, 0, 2})
                    for (bool causal : {false, true}) {
                        const WindowMask m = WindowMask::of(q_len, kv_len, causal, left, right);
                        for (int i = 0; i < q_len; ++i)
                            for (int j = 0; j < kv_len; ++j)
                                if (m.visible(i, j) != sees(q_len, kv_len, causal, left, right, i, j)) {
                                    FAIL_CHECK("visible(" << i << ", " << j << ") for q_len " << q_len
                                                          << ", kv_len " << kv_len << ", window ("
                                                          << left << ", " << right << "), causal "
                                                          << causal);
                                }
                        for (int Br : {1, 2, 5})
                            for (int Bc : {1, 3, 4})
                                for (int q0 = 0; q0 < q_len; q0 += Br) {
                                    const int q1 = std::min(q0 + Br, q_len);
                                    int first = 0, last = -1;
                                    m.key_tiles(q0, q1, Bc, first, last);
                                    for (int k0 = 0, t = 0; k0 < kv_len; k0 += Bc, ++t) {
                                        const int k1 = std::min(k0 + Bc, kv_len);
                                        int seen = 0;
                                        for (int i = q0; i < q1; ++i)
                                            for (int j = k0; j < k1; ++j)
                                                seen += sees(q_len, kv_len, causal, left, right, i, j);
                                        const TileKind want = seen == 0 ? TileKind::none
                                                              : seen == (q1 - q0) * (k1 - k0)
                                                                  ? TileKind::full
                                                                  : TileKind::partial;
                                        const TileKind got = m.tile(q0, q1, k0, k1);
                                        ++pairs, ++kinds[int(want)];
                                        const bool loaded = first <= t && t <= last;
                                        if (got != want || loaded != (seen > 0)) {
                                            FAIL_CHECK("q_len " << q_len << ", kv_len " << kv_len
                                                       << ", window (" << left << ", " << right
                                                       << "), causal " << causal << ": rows " << q0
                                                       << ".." << q1 - 1 << ", keys " << k0 << ".."
                                                       << k1 - 1 << ": " << seen << " visible, kind "
                                                       << int(got) << " (want " << int(want)
                                                       << "), loaded " << loaded << " (tiles "
                                                       << first << ".." << last << ")");
                                        }
                                    }
                                }
                    }
    INFO(pairs << " tile pairs: " << kinds[0] << " invisible, " << kinds[1] << " partly, "
               << kinds[2] << " fully visible");
    CHECK(kinds[0] > 1000);  // the test meets every kind, many times
    CHECK(kinds[1] > 1000);
    CHECK(kinds[2] > 1000);
}

TEST_CASE("A window costs O(N w): the K/V tiles a Q tile loads do not grow with the sequence",
          "[cpu][policy]") {
    // A window of 256 keys to the left, causal, tiles of 128: a Q tile loads at most 4 K/V tiles
    // at any length (its 128 rows reach 256 + 127 keys back, 3 tiles, plus the diagonal's).
    for (int n : {1024, 8192, 65536}) {
        const WindowMask m = WindowMask::of(n, n, true, 256, -1);
        int most = 0, total = 0;
        for (int q0 = 0; q0 < n; q0 += 128) {
            int first = 0, last = -1;
            m.key_tiles(q0, std::min(q0 + 128, n), 128, first, last);
            most = std::max(most, last - first + 1);
            total += last - first + 1;
        }
        CAPTURE(n, most, total);
        CHECK(most <= 4);
        CHECK(total <= 4 * (n / 128));  // linear in N; the causal mask alone loads ~(n/128)^2 / 2
    }
}

TEST_CASE("The score policy changes a score as the CPU reference does, and its derivative is "
          "the change's", "[cpu][policy]") {
    // The policy works in units of the scale: scale u is the score, scale du its derivative.
    // fp32 arithmetic against the rule in double: within a few float ulps of the largest term
    // (4e-7 of |s| plus the ALiBi term, plus 1e-6); on the host tanh is the library's (the GPU's
    // tanh.approx is checked by the kernels' tests). The derivative against a central difference
    // in double of the double rule, h = 1e-4: truncation ~h^2 = 1e-8, so 1e-4 relative is loose.
    const double dots[] = {-30.0, -2.5, -0.1, 0.0, 0.3, 4.0, 45.0};
    struct Mod {
        float scale, softcap, slope;
    };
    for (const Mod mod : {Mod{0.125f, 0.f, 0.f}, Mod{0.125f, 5.f, 0.f}, Mod{0.5f, 1.f, 0.25f},
                          Mod{1.f, 30.f, 0.0625f}})
        for (double dot : dots)
            for (int j : {0, 3, 17}) {
                const long long shifted = 9;
                const auto rule = [&](double x) {
                    double s = mod.scale * x;
                    if (mod.softcap > 0) s = mod.softcap * std::tanh(s / mod.softcap);
                    return s - mod.slope * std::fabs(double(shifted - j));
                };
                const ScoreMod policy = ScoreMod::of(mod.scale, mod.softcap, mod.slope);
                float du = 0;
                const double s = double(mod.scale) * policy.score(float(dot), int(shifted - j), du);
                const double ds = double(mod.scale) * du;
                const double want = rule(dot), h = 1e-4;
                const double dwant = (rule(dot + h) - rule(dot - h)) / (2 * h);
                const double alibi = mod.slope * std::fabs(double(shifted - j));
                CAPTURE(mod.scale, mod.softcap, mod.slope, dot, j, s, want, ds, dwant);
                CHECK(std::fabs(s - want) <= 4e-7 * (std::fabs(want) + alibi) + 1e-6);
                CHECK(std::fabs(ds - dwant) <= 1e-4 * std::fabs(dwant) + 1e-7);
            }
}

TEST_CASE("Without a softcap the policy instance with no derivative scores the same bits, and "
          "in_units scales every term of a score", "[cpu][policy]") {
    // ModelPolicy<false> (a window, ALiBi, a scale: every du 1) against ModelPolicy<true> with the
    // softcap left at 0, bit for bit. in_units(c), the decode kernel's scores that carry c = scale
    // log2 e: score(c x) = c score(x) up to fp32 rounding of the few products (1e-6 relative to the
    // largest term, plus 1e-6).
    const AttentionShape s{1, 2, 9, 20, 64, true};
    const float slopes[] = {0.5f, 0.125f};
    AttentionOptions o;
    o.window_left = 5, o.alibi_slopes = slopes;
    const auto plain = model_policy<false>(s, o).for_head(1);
    const auto with_cap = model_policy<true>(s, o).for_head(1);
    AttentionOptions capped = o;
    capped.softcap = 5.f, capped.softmax_scale = 0.3f;
    const float c = 0.3f * 1.4426950f;
    for (int i = 0; i < s.q_len; ++i)
        for (int j = 0; j < s.kv_len; ++j)
            for (float x : {-7.5f, -0.25f, 0.f, 1.5f, 40.f}) {
                CAPTURE(i, j, x);
                float du0 = 0, du1 = 0;
                const float a = plain.score(x, i, j, du0), b = with_cap.score(x, i, j, du1);
                CHECK(std::memcmp(&a, &b, sizeof a) == 0);
                CHECK(du0 == 1.f);
                CHECK(du1 == 1.f);
                for (bool cap : {false, true}) {
                    const AttentionOptions& oc = cap ? capped : o;
                    const auto p = model_policy<true>(s, oc).for_head(1);
                    const auto pc = model_policy<true>(s, oc).in_units(c).for_head(1);
                    const float want = c * p.score(x, i, j, du0);
                    const float got = pc.score(c * x, i, j, du1);
                    CAPTURE(cap, want, got);
                    CHECK(std::fabs(got - want) <= 1e-6f * (std::fabs(want) + 20.f * c) + 1e-6f);
                }
            }
}

TEST_CASE("A score taken near another (at(i, j).score(x, k)) has the bits of the pair at that "
          "distance, for distances below 2^24", "[cpu][policy]") {
    // The kernels take ALiBi's distance once a row in float and add each score's constant k in
    // float (lib/mask_policy.cuh, ModelPolicy::Near): exact while every distance is below 2^24,
    // so the same bits as the pair's own distance, converted once. Checked with and without a
    // softcap, from short sequences to distances just under 2^24, for k on both sides.
    const float slopes[] = {0.75f};
    for (int kv_len : {20, 4096, (1 << 24) - 48}) {
        const AttentionShape s{1, 1, 3, kv_len, 64, false};
        AttentionOptions o;
        o.alibi_slopes = slopes;
        AttentionOptions capped = o;
        capped.softcap = 7.f;
        for (bool cap : {false, true}) {
            const auto p = cap ? model_policy<true>(s, capped).for_head(0)
                               : model_policy<true>(s, o).for_head(0);
            const auto q = model_policy<false>(s, o).for_head(0);
            for (int i = 0; i < s.q_len; ++i)
                for (int j : {0, 5, kv_len / 2, kv_len - 1})
                    for (int k = -40; k <= 40; k += 3)
                        for (float x : {-3.5f, 0.25f, 9.f}) {
                            if (j - k < 0 || j - k >= kv_len) continue;  // (a key of the shape)
                            CAPTURE(kv_len, cap, i, j, k, x);
                            float du0 = 0, du1 = 0;
                            // Key j - k is at distance (i' - j) + k: its own at(), k = 0.
                            const float near = p.at(i, j).score(x, k, du0);
                            const float own = p.at(i, j - k).score(x, 0, du1);
                            CHECK(std::memcmp(&near, &own, sizeof near) == 0);
                            CHECK(std::memcmp(&du0, &du1, sizeof du0) == 0);
                            if (!cap) {
                                const float a = q.at(i, j).score(x, k, du0);
                                const float b = q.at(i, j - k).score(x, 0, du1);
                                CHECK(std::memcmp(&a, &b, sizeof a) == 0);
                            }
                        }
        }
    }
}

TEST_CASE("The backward's exponent is c times the score plus the offset, c folded into the cap's "
          "and the slope's factors, with the score's derivative", "[cpu][policy]") {
    // Chapter 3's backward asks at(i, j).exponent(x, k, du, c, o) for c u + o (c = scale log2 e,
    // o = -L_i log2 e); with a softcap the policy puts c into the cap's and the slope's factors
    // (c cap_u, c slope_u) instead of multiplying the score by c. Checked on every instance that
    // with_policy<true> runs (chapter 3's: plain; ALiBi alone and softcap alone, ScoredPolicy; a
    // window alone, with ALiBi, with softcap, and softcap with ALiBi, ModelPolicy)
    // against fmaf(score(x, k), c, o): du bit for bit; the exponent within 2^-21 (4 float ulps)
    // of the sum of the terms' magnitudes, |c u| + |c slope d| + |o|, the few products rounded
    // in another order. Leaving c out of either factor moves it by (1 - 1/c) of that term.
    const AttentionShape s{1, 2, 9, 20, 64, true};
    const float slopes[] = {0.5f, 0.125f};
    const float c = 0.3f * 1.4426950f;
    struct Case {
        const char* name;
        int left;
        float softcap;
        const float* slopes;
    };
    for (const Case cs : {Case{"plain", -1, 0.f, nullptr}, Case{"window", 5, 0.f, nullptr},
                          Case{"alibi", -1, 0.f, slopes}, Case{"softcap", -1, 5.f, nullptr},
                          Case{"window and alibi", 5, 0.f, slopes},
                          Case{"window and softcap", 5, 5.f, nullptr},
                          Case{"softcap and alibi", 5, 5.f, slopes}}) {
        AttentionOptions o;
        o.window_left = cs.left, o.softcap = cs.softcap, o.alibi_slopes = cs.slopes;
        o.softmax_scale = 0.3f;
        with_policy<true>(s, o, [&](const auto& policy) {
            const auto p = policy.for_head(1);
            for (int i = 0; i < s.q_len; ++i)
                for (int j = 0; j < s.kv_len; ++j)
                    for (int k : {-3, 0, 2})
                        for (float x : {-7.5f, -0.25f, 0.f, 1.5f, 40.f})
                            for (float offset : {0.f, -6.25f}) {
                                float du = 0, du_want = 0;
                                const float u = p.at(i, j).score(x, k, du_want);
                                const float want = fmaf(u, c, offset);
                                const float got = p.at(i, j).exponent(x, k, du, c, offset);
                                const double alibi =
                                    cs.slopes ? c * slopes[1] / 0.3 * std::abs(i + 11 - j + k) : 0;
                                const double tol =
                                    std::ldexp(std::fabs(c * u) + alibi + std::fabs(offset), -21);
                                CAPTURE(cs.name, i, j, k, x, offset, got, want, du, du_want);
                                CHECK(std::fabs(double(got) - want) <= tol);
                                CHECK(std::memcmp(&du, &du_want, sizeof du) == 0);
                            }
        });
    }
}

namespace {
// One kernel policy against the visibility rule, on one shape and tile: what chapter 2's forward
// and backward ask of it (lib/mask_policy.cuh's list). Returns the number of mismatches, each
// reported.
template <typename Policy, typename Sees>
int check_kernel_policy(const Policy& p, const Sees& sees, int Br, int Bc, const std::string& what) {
    const int q_len = p.q_len, kv_len = p.kv_len;
    const int Tr = (q_len + Br - 1) / Br, Tc = (kv_len + Bc - 1) / Bc;
    int bad = 0;
    const auto fail = [&](const std::string& why) {
        if (++bad <= 5) FAIL_CHECK(what << ", Br " << Br << ", Bc " << Bc << ": " << why);
    };
    for (int i = 0; i < q_len; ++i)
        for (int j = 0; j < kv_len; ++j) {
            const Span r = p.row_keys(i), k = p.key_queries(j);
            const bool by_row = r.first <= j && j <= r.last, by_key = k.first <= i && i <= k.last;
            if (by_row != sees(i, j) || by_key != sees(i, j))
                fail("score (" + std::to_string(i) + ", " + std::to_string(j) + ")");
        }
    for (int j = 0; j < Tc; ++j)                       // a key past kv_len is seen by no query
        for (int k = kv_len; k < (j + 1) * Bc; ++k)
            if (p.key_queries(k).first <= p.key_queries(k).last) fail("key past kv_len seen");
    // seen[ti][tj]: the pair has a visible score.
    std::vector<std::vector<int>> seen(Tr, std::vector<int>(Tc, 0));
    for (int ti = 0; ti < Tr; ++ti)
        for (int tj = 0; tj < Tc; ++tj)
            for (int i = ti * Br; i < std::min((ti + 1) * Br, q_len); ++i)
                for (int j = tj * Bc; j < std::min((tj + 1) * Bc, kv_len); ++j)
                    seen[ti][tj] += sees(i, j);
    for (int ti = 0; ti < Tr; ++ti) {
        const int q0 = ti * Br, q1 = std::min(q0 + Br, q_len);
        const KeySpan keys = p.keys(q0, Br);
        for (int tj = 0; tj < Tc; ++tj) {
            const int k0 = tj * Bc, k1 = (tj + 1) * Bc;
            // The forward loads tile tj iff it holds a visible score (j from keys.begin / Bc while
            // j Bc < keys.end), and skips the mask only where every score is visible.
            const bool loaded = tj >= keys.begin / Bc && k0 < keys.end;
            const std::string pair = "(" + std::to_string(ti) + ", " + std::to_string(tj) + ")";
            if (loaded != (seen[ti][tj] > 0)) fail("forward loads tile pair " + pair);
            const bool unmasked = loaded && !(k0 < keys.all_begin || k1 > keys.all_end);
            if (unmasked && seen[ti][tj] != (q1 - q0) * (std::min(k1, kv_len) - k0))
                fail("forward leaves a tile unmasked that has a hidden score");
            if (keys.end > kv_len) fail("forward loads past kv_len");
            // The backward's block tj walks Q tile ti iff it holds a visible score.
            const Span rows = p.queries(k0, std::min(k1, kv_len));
            const int i_first = rows.first / Br;
            const int i_last = rows.last < rows.first ? -1 : rows.last / Br;
            if ((i_first <= ti && ti <= i_last) != (seen[ti][tj] > 0))
                fail("backward walks tile pair " + pair);
            if (k1 <= kv_len && q0 + Br <= q_len && p.full(q0, q0 + Br, k0, k1) &&
                seen[ti][tj] != Br * Bc)
                fail("backward leaves a tile unmasked that has a hidden score");
            if (ti == 0 && k1 <= kv_len) {             // (once a K/V tile) the rows that see all
                int first = q_len, last = -1, rows = 0;  // its keys: a span, all_queries'
                for (int i = 0; i < q_len; ++i) {
                    bool all = true;
                    for (int j = k0; j < k1; ++j) all = all && sees(i, j);
                    if (all) first = std::min(first, i), last = i, ++rows;
                }
                const Span a = p.all_queries(k0, k1);
                const bool same = rows == 0 ? a.last < a.first
                                            : a.first == first && a.last == last &&
                                                  rows == last - first + 1;
                if (!same)
                    fail("all_queries of keys " + std::to_string(k0) + " .. " +
                         std::to_string(k1 - 1) + ": " + std::to_string(a.first) + " .. " +
                         std::to_string(a.last) + ", the rule's " + std::to_string(first) +
                         " .. " + std::to_string(last));
            }
        }
        // The ordered add: dQ_i's adds come from the tiles keys.begin / Bc .. (keys.end - 1) / Bc,
        // each exactly one (the turn a block waits for counts them).
        if (keys.end > keys.begin)
            for (int tj = keys.begin / Bc; tj <= (keys.end - 1) / Bc; ++tj)
                if (!seen[ti][tj]) fail("a gap in a Q tile's K/V tiles");
    }
    return bad;
}
}  // namespace

TEST_CASE("Chapter 2's kernel policies load, mask and walk exactly the tiles with a visible "
          "score, on every small shape", "[cpu][policy]") {
    // PlainPolicy and ScoredPolicy (causal or none) and ModelPolicy (windows with causal), q_len
    // and kv_len to 13, Q tiles of 2, 4 or 5 rows, K/V tiles of 1, 3 or 4 keys, against the rule
    // score by score.
    int shapes = 0;
    for (int q_len = 1; q_len <= 13; ++q_len)
        for (int kv_len = 1; kv_len <= 13; ++kv_len)
            for (int Br : {2, 4, 5})
                for (int Bc : {1, 3, 4}) {
                    for (bool causal : {false, true}) {
                        const PlainPolicy plain{q_len, kv_len, causal};
                        const auto rule = [&](int i, int j) {
                            return sees(q_len, kv_len, causal, -1, -1, i, j);
                        };
                        check_kernel_policy(plain, rule, Br, Bc,
                                            "plain, q_len " + std::to_string(q_len) + ", kv_len " +
                                                std::to_string(kv_len) + ", causal " +
                                                std::to_string(causal));
                        AttentionOptions capped;  // ScoredPolicy: the plain mask's tiles
                        capped.softcap = 5.f;
                        check_kernel_policy(
                            scored_policy<true, false>({1, 1, q_len, kv_len, 64, causal}, capped),
                            rule, Br, Bc,
                            "softcap alone, q_len " + std::to_string(q_len) + ", kv_len " +
                                std::to_string(kv_len) + ", causal " + std::to_string(causal));
                        for (int left : {-1, 0, 2, 5})
                            for (int right : {-1, 0, 3}) {
                                AttentionShape s{1, 1, q_len, kv_len, 64, causal};
                                AttentionOptions o;
                                o.window_left = left, o.window_right = right;
                                const ModelPolicy<true> model = model_policy<true>(s, o);
                                const auto wrule = [&](int i, int j) {
                                    return sees(q_len, kv_len, causal, left, right, i, j);
                                };
                                check_kernel_policy(model, wrule, Br, Bc,
                                                    "window (" + std::to_string(left) + ", " +
                                                        std::to_string(right) + "), q_len " +
                                                        std::to_string(q_len) + ", kv_len " +
                                                        std::to_string(kv_len) + ", causal " +
                                                        std::to_string(causal));
                                ++shapes;
                            }
                    }
                }
    CHECK(shapes == 13 * 13 * 9 * 2 * 12);
}

TEST_CASE("A packed batch's layout finds each head's rows and lengths from cu_seqlens",
          "[cpu][layout][varlen]") {
    // Three sequences of 5, 0 and 7 queries over 3, 6 and 0 keys; 2 query heads, 1 K/V head, d 8,
    // packed contiguous: rows heads * d apart, so head bh = 2b + h of sequence b starts at
    // cu_q[b] * 16 + 8 h.
    const int cu_q[] = {0, 5, 5, 12}, cu_k[] = {0, 3, 9, 9};
    const PackedBatch p{cu_q, cu_k, 12, 9};
    const AttentionShape s{3, 2, 7, 6, 8, true, 1};
    const Layout lay = packed_layout({}, s, p);
    const int q_want[] = {5, 0, 7}, k_want[] = {3, 6, 0};
    for (size_t bh = 0; bh < 6; ++bh) {
        INFO("head bh = " << bh);
        const size_t b = bh / 2, h = bh % 2;
        CHECK(lay.Q.len(bh, 7) == q_want[b]);
        CHECK(lay.K.len(b, 6) == k_want[b]);  // the K/V head of sequence b
        CHECK(lay.Q.at(bh) == (long long)(cu_q[b] * 16 + 8 * h));
        CHECK(lay.O.at(bh) == lay.Q.at(bh));
        CHECK(lay.K.at(b) == (long long)(cu_k[b] * 8));
        CHECK(lay.L.at(bh) == (long long)(h * 12 + cu_q[b]));  // L: [heads][total_q]
    }
    CHECK(contiguous_layout(s).Q.len(3, 7) == 7);  // not packed: the shape's
}
