// mask_policy.cuh: masks and score changes as policies (the planned chapter 5), for the host and
// the device. A mask is a tile policy: for each pair (a Q tile, a K/V tile) it says whether the
// pair is invisible (the tile is never loaded), fully visible (no score is tested) or partly
// visible (each score is tested), and which K/V tiles a Q tile must load at all. A sliding window
// then costs O(N w), not O(N^2): a Q tile loads only the tiles its window touches. A score policy
// changes each visible score, and gives the change's derivative for the backward. The rules are
// FlashAttention-2's (flash_attn_func's window_size, softcap, alibi_slopes), as reference.h states
// them; tests/test_policy.cpp checks them against those rules, score by score. No kernel uses them
// yet.
#pragma once

#include <cmath>

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
    // the right side at 0.
    POLICY_FN static WindowMask of(int q_len, int kv_len, bool causal, int left, int right) {
        return {q_len, kv_len, left, causal ? 0 : right};
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

// The score changes: s = scale (Q_i . K_j); s = softcap tanh(s / softcap) where softcap > 0;
// s -= slope |i' - j| where an ALiBi slope is given (the head's: 0 for none). score() returns the
// changed score and, through dscore, ds/d(Q_i . K_j), what the backward multiplies dS_ij by.
struct ScoreMod {
    float scale, softcap, slope;

    POLICY_FN float score(float dot, long long shifted_i, int j, float* dscore) const {
        float s = scale * dot, d = scale;
        if (softcap > 0) {
            const float t = tanhf(s / softcap);
            s = softcap * t;
            d *= 1.0f - t * t;  // d/ds of c tanh(s / c)
        }
        if (slope != 0) s -= slope * fabsf(float(shifted_i - j));
        if (dscore) *dscore = d;
        return s;
    }
};

#undef POLICY_FN
