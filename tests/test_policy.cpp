// test_policy.cpp: the mask and score policies of lib/mask_policy.cuh (the planned chapter 5),
// checked on the CPU, exhaustively on small shapes: each tile's kind and each Q tile's K/V tiles
// against every score's own visibility, and each score's change and derivative against the rules
// the CPU reference follows (reference.h).

#include "mask_policy.cuh"
#include "test_util.h"

#include <cmath>

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
    // fp32 arithmetic against the rule in double: within a few float ulps of |s| (4e-7 relative,
    // plus 1e-6 for the ALiBi term's size); the derivative against a central difference in
    // double of the double rule, h = 1e-4: truncation ~h^2 = 1e-8, so 1e-4 relative is loose.
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
                const ScoreMod policy{mod.scale, mod.softcap, mod.slope};
                float ds = 0;
                const float s = policy.score(float(dot), shifted, j, &ds);
                const double want = rule(dot), h = 1e-4;
                const double dwant = (rule(dot + h) - rule(dot - h)) / (2 * h);
                CAPTURE(mod.scale, mod.softcap, mod.slope, dot, j, s, want, ds, dwant);
                CHECK(std::fabs(s - want) <= 4e-7 * std::fabs(want) + 1e-6);
                CHECK(std::fabs(ds - dwant) <= 1e-4 * std::fabs(dwant) + 1e-7);
            }
}
