// mask_policy.cuh: chapter 5's masks and score changes as policies, for the host and the device.
// A mask is a tile policy: for each pair (a Q tile, a K/V tile) it says whether the pair is
// invisible (the tile is never loaded), fully visible (no score is tested) or partly visible (each
// score is tested), and which K/V tiles a Q tile must load at all. A sliding window then costs
// O(N w), not O(N^2): a Q tile loads only the tiles its window touches. A score policy changes
// each visible score, and gives the change's derivative for the backward. The rules are
// FlashAttention-2's (flash_attn_func's window_size, softcap, alibi_slopes, softmax_scale), as
// reference.h states them; tests/test_policy.cpp checks them against those rules, score by score.
// Every tensor-core kernel and the decode take one of the kernel policies at the end as a
// template argument, with_policy's choice: PlainPolicy (causal or no mask, scores unchanged: the
// chapters as they were) or ModelPolicy (a window, ALiBi, softcap: an instance with softcap's
// derivative or without, and in chapter 3 each of them with ALiBi's term or without); in chapter
// 3, softcap or ALiBi alone without a window runs ScoredPolicy (their scores, the plain mask).
#pragma once

#include "checks.h"  // flash_kv_end, flash_first_query
#include "log2_units.h"

#include <cmath>
#include <cstddef>

#ifdef __CUDACC__
#define POLICY_FN __host__ __device__ __forceinline__
#else
#define POLICY_FN inline
#endif

enum class TileKind { none, partial, full };

// A sliding window, bottom-right aligned: with i' = i + kv_len - q_len, query row i sees key j iff
// i' - left <= j <= i' + right and 0 <= j < kv_len. A bound of -1 leaves that side open; the causal
// mask is right = 0 (so causal with a window is (left, 0), and no mask at all (-1, -1)).
struct WindowMask {
    int q_len, kv_len, left, right;

    // The mask of a call: FlashAttention-2's window_size = (left, right), and causal, which bounds
    // the right side at 0. A bound that no row reaches is none (-1): left >= kv_len - 1 (the last
    // row's i' is kv_len - 1), right >= q_len - 1 (the first row's i' is kv_len - q_len), so a
    // window wider than the sequence is the plain mask, down to the backward's order.
    POLICY_FN static WindowMask of(int q_len, int kv_len, bool causal, int left, int right) {
        if (causal) right = 0;
        return {q_len, kv_len, left >= kv_len - 1 ? -1 : left, right >= q_len - 1 ? -1 : right};
    }
    POLICY_FN long long shifted(int i) const { return (long long)i + kv_len - q_len; }
    // Row i's visible keys: first_key(i) .. last_key(i), none when last_key(i) < first_key(i).
    // Both are non-decreasing in i: a window only slides right, row after row.
    POLICY_FN long long first_key(int i) const {
        if (left < 0) return 0;
        const long long f = shifted(i) - left;
        return f < 0 ? 0 : f;
    }
    POLICY_FN long long last_key(int i) const {
        if (right < 0) return kv_len - 1;
        const long long l = shifted(i) + right;
        return l < kv_len - 1 ? l : kv_len - 1;
    }
    POLICY_FN bool visible(int i, int j) const { return first_key(i) <= j && j <= last_key(i); }
    // Key j's queries, read from the key's side: first_query(j) .. last_query(j) (none when
    // last < first), both non-decreasing in j (j - right <= i' <= j + left, rearranged).
    POLICY_FN long long first_query(int j) const {
        if (right < 0) return 0;
        const long long f = (long long)j - right - kv_len + q_len;
        return f < 0 ? 0 : f;
    }
    POLICY_FN long long last_query(int j) const {
        if (left < 0) return q_len - 1;
        const long long l = (long long)j + left - kv_len + q_len;
        return l < q_len - 1 ? l : q_len - 1;
    }

    // Rows q0 .. q1 - 1 against keys k0 .. k1 - 1 (k1 <= kv_len: a last tile's keys past kv_len
    // are the kernel's to leave out, as without a mask). Fully visible: every row's keys cover the tile,
    // which, the bounds being non-decreasing, the last row's first key and the first row's last
    // key decide. Invisible: no row reaches into it. The rows whose last key reaches k0 are a
    // suffix (last_key non-decreasing); of them the first has the smallest first key, so the tile
    // is seen iff that row exists in the tile and its first key is at most k1 - 1.
    POLICY_FN TileKind tile(int q0, int q1, int k0, int k1) const {
        if (first_key(q1 - 1) <= k0 && last_key(q0) >= k1 - 1) return TileKind::full;
        int i = q0;  // the first row of the tile whose last key reaches k0
        if (right >= 0 && last_key(q0) < k0) {
            const long long need = (long long)k0 - right - kv_len + q_len;  // shifted(i) + right >= k0
            if (need >= q1) return TileKind::none;
            if (need > q0) i = int(need);
        }
        if (last_key(i) < k0) return TileKind::none;  // kv_len - 1 < k0: a tile past the keys
        return first_key(i) <= k1 - 1 ? TileKind::partial : TileKind::none;
    }
    // The K/V tiles of Bc keys that rows q0 .. q1 - 1 must load: first_tile .. last_tile (none when
    // last_tile < first_tile). The rows' keys run without a gap (each row's window is the one
    // before it moved by one key) from the first row's first key to the last row's last key; a
    // row that sees nothing (i' + right < 0) has first key 0, as the first row that sees a key.
    POLICY_FN void key_tiles(int q0, int q1, int Bc, int& first_tile, int& last_tile) const {
        const long long first = first_key(q0), last = last_key(q1 - 1);
        first_tile = 0, last_tile = -1;
        if (last < first) return;
        first_tile = int(first / Bc);
        last_tile = int(last / Bc);
    }
};

// tanh, on the GPU in one instruction (tanh.approx.f32, sm_75 on: relative error below 2^-10.9,
// which the tests' tolerance carries as 2^-10 min(softcap, M) on each score, M bounding |s|); on
// the host the library's.
POLICY_FN float fast_tanh(float x) {
#ifdef __CUDA_ARCH__
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(x));
    return t;
#else
    return std::tanh(x);
#endif
}

// The score changes: s = scale (Q_i . K_j); s = softcap tanh(s / softcap) where softcap > 0;
// s -= slope |i' - j| where an ALiBi slope is given (the head's: 0 for none). The kernels keep
// their scores in units of the scale (S = Q_i K_j^T, unscaled, until the exponent's one fma), so
// score() returns u = s / scale, and through du the derivative du/d(Q_i . K_j): with no softcap
// 1, with one 1 - tanh^2, what the backward multiplies dS_ij by before its one final scale.
struct ScoreMod {
    float cap_u = 0, inv_cap = 0, slope_u = 0;  // softcap / scale, scale / softcap, slope / scale

    POLICY_FN static ScoreMod of(float scale, float softcap, float slope) {
        ScoreMod m;
        if (softcap > 0) m.cap_u = softcap / scale, m.inv_cap = scale / softcap;
        m.slope_u = slope / scale;
        return m;
    }
    // d = i' - j, the query's distance from the key (ALiBi's |i' - j|), in float (exact below
    // 2^24; see ModelPolicy::at).
    POLICY_FN float score(float dot, float d, float& du) const {
        float u = dot;
        du = 1.f;
        if (cap_u > 0) u = capped(dot, du);
        if (slope_u != 0) u = biased(u, d);
        return u;
    }
    // Its two terms, for the kernels' policies, which know at compile time which a call has;
    // the cap's in units of the cap too, t = tanh(x / c) (capped = cap_u t), with du either way.
    POLICY_FN float capped(float dot, float& du) const { return cap_u * tanh_of(dot, du); }
    POLICY_FN float tanh_of(float dot, float& du) const {
        const float t = fast_tanh(dot * inv_cap);
        du = 1.f - t * t;                               // d/dx of c tanh(x / c)
        return t;
    }
    POLICY_FN float biased(float u, float d) const { return u - slope_u * fabsf(d); }
};

// ---------------------------------------------------------------------------------------------
// The kernels' policies. What chapter 2's forward and backward ask of one:
//   q_len, kv_len                      the shape
//   for_sequence(q_len, kv_len)        the policy of one sequence of those lengths (a packed
//                                      batch's: lib/layout.h's len; the masks' rules are per
//                                      sequence)
//   for_head(bh)                       the policy of one (batch * heads + head): its ALiBi slope
//   keys(q0, rows)                     Q tile rows q0 .. q0 + rows - 1: the keys to load, [begin,
//                                      end), and those every row sees, [all_begin, all_end)
//   row_keys(i), key_queries(j)        one score's test, from the row's side and from the key's
//   queries(k0, k1)                    the rows that see any of keys k0 .. k1 - 1 (k1 <= kv_len)
//   all_queries(k0, k1)                the rows that see every one of them
//   full(q0, q1, k0, k1)               every score of the pair is visible (q1, k1 inside the
//                                      shape): rows q0 .. q1 - 1 are all_queries(k0, k1)
//   score(dot, i, j, du)               the changed score in units of the scale, and du (above)
//   at(i, j).score(dot, k, du)         the same for the pair at distance i' - j + k, k a constant
//                                      of the kernel's unrolled loop (below: what it saves)
//   at(i, j).exponent(dot, k, du, c, o)  c score + o, c folded into the terms' factors (chapter
//                                      3's backward: its exponent c u - L log2 e)
//   from_left()                        the backward's order: keys bounded on the right (causal)
//                                      start from the left
//   in_units(c)                        the policy for scores that carry a factor c already (the
//                                      decode kernel's, scale log2 e in its q): score() returns
//                                      c u for the dot product c x
//   kLeftEdge                          whether a row's first key can be past key 0 (a window's
//                                      left side): where not, chapter 3 tests one side only
//   kCapped                            whether scores take a softcap's tanh (chapter 3's backward
//                                      then takes some exponentials on the FMA pipe)
struct KeySpan {
    int begin, end, all_begin, all_end;
};
struct Span {  // first .. last, none when last < first
    int first, last;
};

// Chapter 2 as it was: causal (bottom-right) or no mask, the score unchanged.
struct PlainPolicy {
    int q_len, kv_len;  // the shape's (packed: the longest sequence's, until for_sequence)
    bool causal;
    static constexpr bool kLeftEdge = false;  // every row's keys start at key 0
    static constexpr bool kCapped = false;    // no softcap

    POLICY_FN PlainPolicy for_sequence(int q, int kv) const { return {q, kv, causal}; }
    POLICY_FN PlainPolicy for_head(size_t) const { return *this; }
    POLICY_FN PlainPolicy in_units(float) const { return *this; }
    POLICY_FN bool from_left() const { return causal; }
    POLICY_FN KeySpan keys(int q0, int rows) const {
        if (q0 >= q_len) return {0, 0, 0, 0};          // past a (packed) sequence's rows
        const int end = flash_kv_end(q0, rows, q_len, kv_len, causal);
        const int all = flash_last_key(q0, q_len, kv_len) + 1;
        return {0, end, 0, causal ? (all < end ? all : end) : kv_len};
    }
    POLICY_FN Span row_keys(int i) const {
        return {0, causal ? flash_last_key(i, q_len, kv_len) : kv_len - 1};
    }
    POLICY_FN Span key_queries(int j) const {
        return {j >= kv_len ? q_len : causal ? flash_first_query(j, q_len, kv_len) : 0, q_len - 1};
    }
    POLICY_FN Span queries(int k0, int) const {
        const int first = causal ? flash_first_query(k0, q_len, kv_len) : 0;
        return {first < 0 ? 0 : first, q_len - 1};
    }
    POLICY_FN Span all_queries(int, int k1) const {
        const int first = causal ? flash_first_query(k1 - 1, q_len, kv_len) : 0;
        return {first < 0 ? 0 : first, q_len - 1};
    }
    POLICY_FN bool full(int q0, int, int, int k1) const {  // (all_queries: q1 <= q_len here)
        return !causal || q0 >= flash_first_query(k1 - 1, q_len, kv_len);
    }
    struct Near {                                      // (at: nothing to keep)
        POLICY_FN float score(float dot, int, float& du) const {
            du = 1.f;
            return dot;
        }
        POLICY_FN float exponent(float dot, int, float& du, float c, float offset) const {
            du = 1.f;
            return dot * c + offset;                   // (one fma)
        }
    };
    POLICY_FN Near at(int, int) const { return {}; }
    POLICY_FN float score(float dot, int, int, float& du) const {
        return at(0, 0).score(dot, 0, du);
    }
};

// What the policies that change scores (ModelPolicy, ScoredPolicy) do alike with their score
// changes (mod, slopes, heads, per_batch, inv_scale): p for head bh (batch * heads + head: its
// ALiBi slope), and p for scores that carry a factor c already (c u(x) = u'(c x)).
template <typename P>
POLICY_FN P head_of(P p, size_t bh) {
    if (p.slopes) p.mod.slope_u = p.slopes[p.per_batch ? bh : bh % p.heads] * p.inv_scale;
    return p;
}
template <typename P>
POLICY_FN P units_of(P p, float c) {
    p.mod.cap_u *= c, p.mod.inv_cap /= c, p.mod.slope_u *= c, p.inv_scale *= c;
    return p;
}

// Chapter 5: a sliding window with causal (WindowMask) and the score changes (ScoreMod), with
// ALiBi's slopes per head (slopes: [heads], or [batch][heads] where per_batch; none: nullptr).
// kSoftcap: whether a softcap is given. Without one every du is 1, a constant: the backward then
// keeps no array of derivatives (which would spill registers in chapter 3's backward). kAlibi:
// whether slopes are given. Without them a score costs no ALiBi term (an add and an fma): a window
// alone, or a softcap alone, pays only for what it changes.
template <bool kSoftcap, bool kAlibi = true>
struct ModelPolicy : WindowMask {
    static constexpr bool kLeftEdge = true;  // a window's rows start past key 0
    static constexpr bool kCapped = kSoftcap;
    ScoreMod mod;
    const float* slopes;
    int heads;
    bool per_batch;
    float inv_scale;

    POLICY_FN ModelPolicy for_sequence(int q, int kv) const {
        ModelPolicy p = *this;
        p.q_len = q, p.kv_len = kv;
        return p;
    }
    POLICY_FN ModelPolicy for_head(size_t bh) const { return head_of(*this, bh); }
    POLICY_FN ModelPolicy in_units(float c) const { return units_of(*this, c); }
    POLICY_FN bool from_left() const { return right >= 0; }
    POLICY_FN KeySpan keys(int q0, int rows) const {
        const int q1 = q0 + rows < q_len ? q0 + rows : q_len;
        const int begin = int(first_key(q0)), end = int(last_key(q1 - 1)) + 1;
        if (end <= begin || q0 >= q_len) return {0, 0, 0, 0};  // (q0 past the sequence's rows)
        return {begin, end, int(first_key(q1 - 1)), int(last_key(q0)) + 1};
    }
    POLICY_FN Span row_keys(int i) const { return {int(first_key(i)), int(last_key(i))}; }
    POLICY_FN Span key_queries(int j) const {
        if (j >= kv_len) return {q_len, q_len - 1};
        return {int(first_query(j)), int(last_query(j))};
    }
    POLICY_FN Span queries(int k0, int k1) const {
        return {int(first_query(k0)), int(last_query(k1 - 1))};
    }
    // Every key of k0 .. k1 - 1 from the key's side: rows from the last key's first query (its
    // right side) to the first key's last query (its left side), both bounds non-decreasing.
    POLICY_FN Span all_queries(int k0, int k1) const {
        return {int(first_query(k1 - 1)), int(last_query(k0))};
    }
    POLICY_FN bool full(int q0, int q1, int k0, int k1) const {
        const Span all = all_queries(k0, k1);
        return q0 >= all.first && q1 - 1 <= all.last;
    }
    // The scores near query i and key j: the distance i' - j taken once, in int (no overflow),
    // then in float, so that each score adds its loop's constant k in float. In the kernels'
    // unrolled loops ALiBi's term then costs an add and an fma a score; a conversion from int to
    // float a score would run on the XU pipe, with exp2 and tanh, at 16 a clock an SM. (Exact
    // below 2^24 in distance: the same bits as float(i' - j + k).)
    struct Near {
        ScoreMod mod;
        float d0;
        POLICY_FN float score(float dot, int k, float& du) const {
            if (kSoftcap && kAlibi) return mod.score(dot, d0 + float(k), du);
            du = 1.f;
            if (kSoftcap) return mod.capped(dot, du);
            return kAlibi ? mod.biased(dot, d0 + float(k)) : dot;  // (a slope of 0: the same bits)
        }
        // c u + offset (c: the exponent's scale log2 e). With a softcap, c goes into the cap's
        // and the slope's own factors (c cap_u, c slope_u: once a kernel), a product fewer a
        // score than fmaf(score(), c, offset), which it equals up to the factors' rounding.
        POLICY_FN float exponent(float dot, int k, float& du, float c, float offset) const {
            if (!kSoftcap) return score(dot, k, du) * c + offset;  // (one fma after the score)
            du = 1.f;
            const float base =
                kAlibi ? fmaf(-c * mod.slope_u, fabsf(d0 + float(k)), offset) : offset;
            return fmaf(mod.tanh_of(dot, du), c * mod.cap_u, base);
        }
    };
    POLICY_FN Near at(int i, int j) const { return {mod, float((i - q_len) + (kv_len - j))}; }
    POLICY_FN float score(float dot, int i, int j, float& du) const {
        return at(i, j).score(dot, 0, du);
    }
};

// Chapter 5's score changes under PlainPolicy's mask (causal or none): softcap or ALiBi without a
// window. The scores change as ModelPolicy's do (its Near), and the kernels test the mask as the
// plain ones do: one side of a row, the causal tile rule, no window's bounds to hold. In chapter 3
// that spares the backward its spills at d = 128, and the softcap forward its spills at d = 64
// and 2-4% of its time at d = 128 (lab/chapter5.md, part 26). One base class and its own members,
// as ModelPolicy: with the score changes as a second base, nvcc laid out this kernel argument one
// way on the host and another on the device, and the kernels read every score term wrong.
template <bool kSoftcap, bool kAlibi>
struct ScoredPolicy : PlainPolicy {
    static constexpr bool kCapped = kSoftcap;
    using Near = typename ModelPolicy<kSoftcap, kAlibi>::Near;
    ScoreMod mod;
    const float* slopes;
    int heads;
    bool per_batch;
    float inv_scale;

    POLICY_FN ScoredPolicy for_sequence(int q, int kv) const {
        ScoredPolicy p = *this;
        p.q_len = q, p.kv_len = kv;
        return p;
    }
    POLICY_FN ScoredPolicy for_head(size_t bh) const { return head_of(*this, bh); }
    POLICY_FN ScoredPolicy in_units(float c) const { return units_of(*this, c); }
    POLICY_FN Near at(int i, int j) const { return {mod, float((i - q_len) + (kv_len - j))}; }
    POLICY_FN float score(float dot, int i, int j, float& du) const {
        return at(i, j).score(dot, 0, du);
    }
};

// The softmax scale of a call: the options', or 1/sqrt(head_dim) where they leave it at 0.
inline float options_scale(const AttentionShape& s, const AttentionOptions& o) {
    return o.softmax_scale > 0 ? o.softmax_scale : 1.0f / std::sqrt(float(s.head_dim));
}
// The factor the kernels' exponent takes (scale log2 e), as the calls without options take it
// where the scale is theirs: the same bits.
inline float options_scale_log2(const AttentionShape& s, const AttentionOptions& o) {
    return o.softmax_scale > 0 ? o.softmax_scale * kLog2e : scale_log2_for(s.head_dim);
}
// Whether PlainPolicy's mask serves a call: no window bound a row reaches (WindowMask::of: one the
// longest sequence does not reach, no shorter one does).
inline bool plain_mask(const AttentionOptions& o, const AttentionShape& s) {
    const WindowMask m = WindowMask::of(s.q_len, s.kv_len, false, o.window_left, o.window_right);
    return m.left == -1 && (s.causal || m.right == -1);
}
// Whether PlainPolicy computes a call with these options: its mask, no softcap, no ALiBi. The
// scale is not the policy's (the kernels take it beside it: options_scale_log2), nor are the
// layout and a packed batch (where rows are, not what is computed).
inline bool plain_policy_serves(const AttentionOptions& o, const AttentionShape& s) {
    return plain_mask(o, s) && o.softcap == 0 && !o.alibi_slopes;
}
// Whether options change no score and no mask beyond the plain call's: PlainPolicy serves them
// and the scale is the default (0, or 1/sqrt(d) written out).
inline bool scores_plain(const AttentionOptions& o, const AttentionShape& s) {
    const bool scale = o.softmax_scale == 0 || o.softmax_scale == options_scale(s, {});
    return scale && plain_policy_serves(o, s);
}
// The policy of a call with options (checked: lib/checks.h's validate_options); kSoftcap: o's
// softcap > 0; kAlibi: o has slopes (with kAlibi false they are not read).
template <bool kSoftcap, bool kAlibi = true>
inline ModelPolicy<kSoftcap, kAlibi> model_policy(const AttentionShape& s,
                                                  const AttentionOptions& o) {
    const float scale = options_scale(s, o);
    ModelPolicy<kSoftcap, kAlibi> p;
    static_cast<WindowMask&>(p) =
        WindowMask::of(s.q_len, s.kv_len, s.causal, o.window_left, o.window_right);
    p.mod = ScoreMod::of(scale, o.softcap, 0.f);
    p.slopes = kAlibi ? o.alibi_slopes : nullptr, p.heads = s.heads;
    p.per_batch = o.alibi_per_batch;
    p.inv_scale = 1.0f / scale;
    return p;
}
// The same score changes under the plain mask (plain_mask: no window bound a row reaches).
template <bool kSoftcap, bool kAlibi>
inline ScoredPolicy<kSoftcap, kAlibi> scored_policy(const AttentionShape& s,
                                                    const AttentionOptions& o) {
    const ModelPolicy<kSoftcap, kAlibi> m = model_policy<kSoftcap, kAlibi>(s, o);
    ScoredPolicy<kSoftcap, kAlibi> p;
    static_cast<PlainPolicy&>(p) = PlainPolicy{s.q_len, s.kv_len, s.causal};
    p.mod = m.mod, p.slopes = m.slopes, p.heads = m.heads, p.per_batch = m.per_batch;
    p.inv_scale = m.inv_scale;
    return p;
}
// The policy a call with options runs, handed to run (a generic lambda): PlainPolicy where it
// serves them, else ModelPolicy, with softcap's derivative only where a softcap is given. With
// kAlibiApart (chapter 3, whose speed chapter 5's floors measure), ALiBi's term only where slopes
// are (four ModelPolicy instances), and softcap or ALiBi alone without a window as ScoredPolicy
// (two more). Without it, ALiBi's term in every ModelPolicy and no ScoredPolicy (chapter 2 and
// the decode: two instances, whose kernels are most of the build's time). A slope of 0 changes
// no bit. kAlibiApart is tested by `if constexpr`: an ordinary `if` would still instantiate, and
// compile, all six everywhere.
template <bool kAlibiApart = false, typename Run>
inline void with_policy(const AttentionShape& s, const AttentionOptions& o, Run&& run) {
    const bool cap = o.softcap > 0, alibi = o.alibi_slopes != nullptr;
    if (plain_policy_serves(o, s)) run(PlainPolicy{s.q_len, s.kv_len, s.causal});
    else if constexpr (!kAlibiApart) {
        if (cap) run(model_policy<true>(s, o));
        else run(model_policy<false>(s, o));
    } else if (plain_mask(o, s) && cap != alibi) {  // softcap or ALiBi alone, no window
        if (cap) run(scored_policy<true, false>(s, o));
        else run(scored_policy<false, true>(s, o));
    } else if (cap && alibi) run(model_policy<true, true>(s, o));
    else if (cap) run(model_policy<true, false>(s, o));
    else if (alibi) run(model_policy<false, true>(s, o));
    else run(model_policy<false, false>(s, o));
}

#undef POLICY_FN
