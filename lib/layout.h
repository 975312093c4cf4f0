// layout.h: chapter 5's strides (flash.h's AttentionLayout) as the kernels take them. Each
// tensor's strides resolved (a tensor given as all 0 gets the contiguous ones) with its head
// count, which is what a kernel needs to find the rows of head bh = b * heads + h, the flattened
// (batch, head) every grid walks. The checks of given strides are in checks.h (validate_layout).
#pragma once

#include "flash.h"

#include <cstddef>
#include <initializer_list>

struct Rows {
    long long batch, head, row;  // in elements
    int heads;                   // heads of this tensor: the query heads, or the K/V heads
    // A packed batch (flash.h's PackedBatch): batch b starts at row starts[b] (cu_seqlens, on the
    // device), not b * batch elements on. nullptr: not packed.
    const int* starts = nullptr;
    // Where head bh's row 0 starts, in elements from the tensor's base (bh < batch * heads <
    // 2^31, as every grid's count). (len, the rows a head, is DenseRows' business: the strides
    // say it here.) Device code where starts is given.
    __host__ __device__ long long at(size_t bh, int /* len */ = 0) const {
        const int h = int(bh), b = h / heads;
        const long long first = starts ? starts[b] * row : (long long)b * batch;
        return first + (long long)(h % heads) * head;
    }
    // The rows of head bh: a packed batch's sequence's (device code), else len, the shape's.
    __host__ __device__ int len(size_t bh, int len) const {
        if (!starts) return len;
        const int b = int(bh) / heads;
        return starts[b + 1] - starts[b];
    }
    // Head bh's row r where chapter 3's TMA maps (lib/hopper.cuh's tensor_map) count it: (row,
    // head, batch); a packed tensor's map is one batch of its total rows. Device code.
    __host__ __device__ int3 box_at(size_t bh, int r) const {
        const int h = int(bh), b = h / heads;
        return starts ? int3{starts[b] + r, h % heads, 0} : int3{r, h % heads, b};
    }
    bool operator==(const Rows& o) const {
        return batch == o.batch && head == o.head && row == o.row && heads == o.heads &&
               starts == o.starts;
    }
};
// The tensors' rows; L's too (row stride 1), where the backward's D and fp32 dQ follow it.
struct Layout {
    Rows Q, K, V, O, dO, dQ, dK, dV, L;
};

// Whether a tensor's strides are given (any not 0), or it is contiguous; and any of a layout's.
inline bool strides_given(const TensorStrides& t) { return t.batch || t.head || t.row; }
inline bool layout_given(const AttentionLayout& a) {
    for (const TensorStrides* t : {&a.Q, &a.K, &a.V, &a.O, &a.dO, &a.dQ, &a.dK, &a.dV})
        if (strides_given(*t)) return true;
    return false;
}
// A tensor of batch x heads x len rows of d: its given strides, or, where all three are 0, the
// contiguous ones, [batch][heads][len][d]. A dimension of one index takes the contiguous stride
// whatever is given (it is never used), so that a layout that differs only there is the same.
inline Rows rows_of(const TensorStrides& t, int batch, int heads, int len, int d) {
    const Rows dense{(long long)heads * len * d, (long long)len * d, d, heads};
    if (!strides_given(t)) return dense;
    return {batch > 1 ? t.batch : dense.batch, heads > 1 ? t.head : dense.head,
            len > 1 ? t.row : dense.row, heads};
}
inline Layout layout_of(const AttentionLayout& a, const AttentionShape& s) {
    const int B = s.batch, H = s.heads, KH = flash_kv_heads(s), d = s.head_dim;
    const int q = s.q_len, k = s.kv_len;
    return {rows_of(a.Q, B, H, q, d),   rows_of(a.K, B, KH, k, d), rows_of(a.V, B, KH, k, d),
            rows_of(a.O, B, H, q, d),   rows_of(a.dO, B, H, q, d), rows_of(a.dQ, B, H, q, d),
            rows_of(a.dK, B, KH, k, d), rows_of(a.dV, B, KH, k, d), rows_of({}, B, H, q, 1)};
}
// Every tensor contiguous: the layout of the calls without options.
inline Layout contiguous_layout(const AttentionShape& s) { return layout_of({}, s); }

// A packed batch (flash.h's PackedBatch) as one batch of total_q query rows and total_k keys: the
// shape its tensors' extents and the backward's passes take (s: the call's, batch the sequences).
inline AttentionShape packed_shape(const AttentionShape& s, const PackedBatch& p) {
    AttentionShape one = s;
    one.batch = 1, one.q_len = p.total_q, one.kv_len = p.total_k;
    return one;
}
// Its strides: each tensor's given head and row strides, or where all three are 0 the contiguous
// (total, heads, head_dim) ones; checked with packed_shape (validate_layout).
inline AttentionLayout packed_strides(const AttentionLayout& a, const AttentionShape& s) {
    AttentionLayout full = a;
    const long long d = s.head_dim, rows = d * s.heads, kv_rows = d * flash_kv_heads(s);
    for (TensorStrides* t : {&full.Q, &full.O, &full.dO, &full.dQ})
        if (!strides_given(*t)) *t = {0, d, rows};
    for (TensorStrides* t : {&full.K, &full.V, &full.dK, &full.dV})
        if (!strides_given(*t)) *t = {0, d, kv_rows};
    return full;
}
// Its layout: packed_strides' rows, each sequence's from its first (cu_seqlens); L [heads][total_q]
inline Layout packed_layout(const AttentionLayout& a, const AttentionShape& s,
                            const PackedBatch& p) {
    Layout lay = layout_of(packed_strides(a, s), packed_shape(s, p));
    for (Rows* r : {&lay.Q, &lay.O, &lay.dO, &lay.dQ, &lay.L}) r->starts = p.cu_seqlens_q;
    for (Rows* r : {&lay.K, &lay.V, &lay.dK, &lay.dV}) r->starts = p.cu_seqlens_k;
    return lay;
}

// The contiguous layout as constants, for the kernels of chapter 2 (a layout policy, as the
// masks are a tile policy: lib/mask_policy.cuh): rows D elements apart, heads len rows apart (the
// kernel's own q_len or kv_len), the address arithmetic of a kernel without strides, in the
// registers of one (at 255 registers a thread, two more spill). Its members read as Rows' do, so
// that one kernel body takes either.
template <int D>
struct DenseRows {
    static constexpr long long row = D;
    __host__ __device__ size_t at(size_t bh, int len) const { return bh * len * D; }
    __host__ __device__ int len(size_t, int len) const { return len; }
};
template <int D>
struct DenseLayout {
    DenseRows<D> Q, K, V, O, dO, dQ, dK, dV;
    DenseRows<1> L;
};
// Whether lay is the contiguous layout in the tensors a call reads and writes (the forward's Q, K,
// V, O; with backward all eight).
inline bool dense(const Layout& lay, const AttentionShape& s, bool backward) {
    const Layout c = contiguous_layout(s);
    return lay.Q == c.Q && lay.K == c.K && lay.V == c.V && lay.O == c.O &&
           (!backward || (lay.dO == c.dO && lay.dQ == c.dQ && lay.dK == c.dK && lay.dV == c.dV));
}
