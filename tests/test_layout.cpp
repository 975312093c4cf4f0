// test_layout.cpp: chapter 5's strides (flash.h's AttentionLayout). A call on strided views (of
// one fused QKV projection, (batch, len, heads, d) views, rows and heads padded apart) gives the
// contiguous call's bits, forward and backward, in whichever chapter the shape runs (chapter 3 at
// its head dims on an H100 or H200, chapter 2 elsewhere and with a score-changing option); it
// reads nothing and writes nothing between the rows (the gaps hold NaN, which would spread into
// any output that read one, and must still hold it); and bad strides are refused, naming the
// tensor and the stride.

#include "test_util.h"

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

namespace {

// Where a tensor lies in its buffer: from `offset`, at strides `t`.
struct Placement {
    size_t offset;
    TensorStrides t;
};
size_t place(const Placement& p, int b, int h, int i, int x) {
    return p.offset + size_t(b) * p.t.batch + size_t(h) * p.t.head + size_t(i) * p.t.row + x;
}

// A tensor of `heads` heads and `len` rows (of the case's shape) in a buffer of `count` elements.
struct Placed {
    Placement at;
    int heads, len;
};

// dense, contiguous [batch][heads][len][d], written where `p` places it into `buffer`.
template <typename T>
void scatter(std::vector<T>& buffer, const std::vector<T>& dense, const Placed& p,
             const AttentionShape& s) {
    const int d = s.head_dim;
    for (int b = 0; b < s.batch; b++)
        for (int h = 0; h < p.heads; h++)
            for (int i = 0; i < p.len; i++)
                for (int x = 0; x < d; x++)
                    buffer[place(p.at, b, h, i, x)] =
                        dense[((size_t(b) * p.heads + h) * p.len + i) * d + x];
}
// The tensor `p` places in `buffer`, as contiguous floats; `in[e]` is set where element e of the
// buffer belongs to it.
std::vector<float> gather(const std::vector<float>& buffer, const Placed& p,
                          const AttentionShape& s, std::vector<bool>& in) {
    const int d = s.head_dim;
    std::vector<float> dense(size_t(s.batch) * p.heads * p.len * d);
    for (int b = 0; b < s.batch; b++)
        for (int h = 0; h < p.heads; h++)
            for (int i = 0; i < p.len; i++)
                for (int x = 0; x < d; x++) {
                    const size_t e = place(p.at, b, h, i, x);
                    dense[((size_t(b) * p.heads + h) * p.len + i) * d + x] = buffer[e];
                    in[e] = true;
                }
    return dense;
}

// One case: a shape, how its tensors are laid out, and a score option (softcap > 0 or a window
// left >= 0: chapter 2's policy) or none.
enum class Kind { Fused, Bshd, Padded };
struct LayoutCase {
    const char* what;
    AttentionShape s;
    Kind kind;
    float softcap = 0;
    int left = -1;
    bool bitwise = true;  // false: a shape the contiguous call gives the decode (other sums)
};
std::string describe(const LayoutCase& c) {
    std::ostringstream os;
    os << c.what << ": " << describe(c.s) << ", softcap " << c.softcap << ", window left "
       << c.left;
    return os.str();
}

// The layouts. Fused: Q, K, V of one (batch, len, 3, heads, d) buffer, the outputs and dO as
// (batch, len, heads, d), PyTorch's views of a fused projection. Bshd: every tensor
// (batch, len, heads, d) in its own buffer. Padded: [batch][heads][len][d] with 8 elements after
// every row and 16 after every head.
Placed placed(const LayoutCase& c, bool kv, int which_of_qkv, bool output) {
    const AttentionShape& s = c.s;
    const int H = kv ? flash_kv_heads(s) : s.heads, N = kv ? s.kv_len : s.q_len, d = s.head_dim;
    if (c.kind == Kind::Fused && !output)
        return {{size_t(which_of_qkv) * H * d, {3LL * N * H * d, d, 3LL * H * d}}, H, N};
    if (c.kind == Kind::Padded) {
        const long long row = d + 8, head = N * row + 16;
        return {{0, {H * head, head, row}}, H, N};
    }
    return {{0, {(long long)N * H * d, d, (long long)H * d}}, H, N};
}
size_t span(const Placed& p, const AttentionShape& s) {
    return place(p.at, s.batch - 1, p.heads - 1, p.len - 1, s.head_dim - 1) + 1;
}

// Calls the public options overloads of T's type.
template <typename T>
void forward_call(const T* Q, const T* K, const T* V, T* O, float* L, const AttentionShape& s,
                  const AttentionOptions& o) {
    if constexpr (std::is_same<T, __half>::value) flash_forward_fp16(Q, K, V, O, L, s, o);
    else flash_forward_bf16(Q, K, V, O, L, s, o);
}
template <typename T>
void backward_call(const T* Q, const T* K, const T* V, const T* O, const T* dO, const float* L,
                   T* dQ, T* dK, T* dV, const AttentionShape& s, const AttentionOptions& o) {
    if constexpr (std::is_same<T, __half>::value)
        flash_backward_fp16(Q, K, V, O, dO, L, dQ, dK, dV, s, o);
    else flash_backward_bf16(Q, K, V, O, dO, L, dQ, dK, dV, s, o);
}

// An output in its own buffer: poisoned, then, after the call, gathered, with the check that
// nothing between its elements was written.
template <typename T>
struct PlacedOutput {
    Placed p;
    DeviceBuffer<T> buf;
    PlacedOutput(const Placed& placed_at, const AttentionShape& s)
        : p(placed_at), buf(span(placed_at, s)) {
        buf.poison();
    }
    std::vector<float> result(const char* name, const AttentionShape& s) const {
        const std::vector<float> all = buf.download_float();
        std::vector<bool> in(all.size(), false);
        std::vector<float> dense = gather(all, p, s, in);
        size_t written_outside = 0;
        for (size_t e = 0; e < all.size(); e++) written_outside += !in[e] && !std::isnan(all[e]);
        INFO(name << ": elements written between its rows (outside the tensor)");
        CHECK(written_outside == 0);
        return dense;
    }
};

template <typename T>
void check_layout_case(const LayoutCase& c, uint32_t salt) {
    INFO(describe(c));
    const AttentionShape& s = c.s;
    const Problem<T> p = rounded_problem<T>(s, salt);
    AttentionOptions o;
    o.softcap = c.softcap, o.window_left = c.left;
    // The contiguous call first: what the strided one must give.
    GpuAttention<T> dense(p);
    dense.O.poison(), dense.L.poison();
    forward_call(dense.Q.ptr, dense.K.ptr, dense.V.ptr, dense.O.ptr, dense.L.ptr, s, o);
    dense.dQ = DeviceBuffer<T>(q_elems(s));
    dense.dK = DeviceBuffer<T>(kv_elems(s));
    dense.dV = DeviceBuffer<T>(kv_elems(s));
    backward_call(dense.Q.ptr, dense.K.ptr, dense.V.ptr, dense.O.ptr, dense.dO.ptr, dense.L.ptr,
                  dense.dQ.ptr, dense.dK.ptr, dense.dV.ptr, s, o);
    FLASH_CUDA_CHECK(cudaDeviceSynchronize());
    const Outputs<float> want = dense.outputs(true);
    // The inputs where the layout puts them, NaN between (a read of a gap would spread NaN).
    const Placed q = placed(c, false, 0, false), k = placed(c, true, 1, false),
                 v = placed(c, true, 2, false), d_o = placed(c, false, 0, true);
    const T nan = quiet_nan<T>();
    std::vector<T> qkv_host(c.kind == Kind::Fused ? span(v, s) : 0, nan);
    std::vector<T> q_host(span(q, s), nan), k_host(span(k, s), nan), v_host(span(v, s), nan),
        do_host(span(d_o, s), nan);
    const bool fused = c.kind == Kind::Fused;
    scatter(fused ? qkv_host : q_host, p.Q, q, s);
    scatter(fused ? qkv_host : k_host, p.K, k, s);
    scatter(fused ? qkv_host : v_host, p.V, v, s);
    scatter(do_host, p.dO, d_o, s);
    const DeviceBuffer<T> qkv(fused ? qkv_host : std::vector<T>(8, nan)), Qb(q_host), Kb(k_host),
        Vb(v_host), dOb(do_host);
    const T* Q = fused ? qkv.ptr + q.at.offset : Qb.ptr;
    const T* K = fused ? qkv.ptr + k.at.offset : Kb.ptr;
    const T* V = fused ? qkv.ptr + v.at.offset : Vb.ptr;
    PlacedOutput<T> O(placed(c, false, 0, true), s), dQ(placed(c, false, 0, true), s),
        dK(placed(c, true, 0, true), s), dV(placed(c, true, 0, true), s);
    DeviceBuffer<float> L(l_elems(s));
    L.poison();
    o.layout.Q = q.at.t, o.layout.K = k.at.t, o.layout.V = v.at.t, o.layout.O = O.p.at.t;
    o.layout.dO = d_o.at.t, o.layout.dQ = dQ.p.at.t, o.layout.dK = dK.p.at.t;
    o.layout.dV = dV.p.at.t;
    {
        const GpuCall call = gpu_call<T>("forward", Kernel::public_call(), s);
        const DeadlineGuard guard(call);
        forward_call(Q, K, V, O.buf.ptr, L.ptr, s, o);
        wait_for_gpu(0, call);
    }
    {
        const GpuCall call = gpu_call<T>("backward", Kernel::public_call(), s);
        const DeadlineGuard guard(call);
        backward_call(Q, K, V, O.buf.ptr, dOb.ptr, L.ptr, dQ.buf.ptr, dK.buf.ptr, dV.buf.ptr, s,
                      o);
        wait_for_gpu(0, call);
    }
    Outputs<float> got;
    got.O = O.result("O", s), got.L = L.download_float();
    got.dQ = dQ.result("dQ", s), got.dK = dK.result("dK", s), got.dV = dV.result("dV", s);
    if (c.bitwise) {
        INFO("the strided call (second) against the contiguous one (first)");
        check_bitwise(want, got, s);
    } else {  // another kernel than the contiguous call's: against the reference instead
        check_against_reference_backward(got, p);
    }
}

std::vector<LayoutCase> layout_cases() {
    return {
        {"a fused QKV projection, causal", {2, 3, 300, 300, 64, true}, Kind::Fused},
        {"a fused QKV projection at d 96 (chapter 2's plain kernels everywhere)",
         {1, 4, 257, 257, 96, false}, Kind::Fused},
        {"a fused QKV projection with softcap (chapter 2's policy)", {2, 2, 200, 200, 128, true},
         Kind::Fused, 20.f},
        {"(batch, len, heads, d) views, GQA, q_len > kv_len", {2, 4, 129, 70, 64, false, 2},
         Kind::Bshd},
        {"rows and heads padded apart, GQA, q_len < kv_len", {2, 4, 200, 333, 128, true, 2},
         Kind::Padded},
        {"padded, a window, d 256", {1, 2, 190, 260, 256, false}, Kind::Padded, 0.f, 50},
        {"a short query, strided (chapter 3 or 2: the decode reads contiguous tensors only)",
         {2, 4, 4, 300, 128, true}, Kind::Padded, 0.f, -1, false},
    };
}

}  // namespace

TEMPLATE_TEST_CASE("Strided views (a fused QKV projection, transposed views, padded rows) give the "
                   "contiguous call's bits, forward and backward, and nothing between the rows "
                   "is read or written", "[gpu][fp16][bf16][layout][forward][backward]", fp16,
                   bf16) {
    const LayoutCase c = GENERATE(from_range(layout_cases()));
    check_layout_case<TestType>(c, 601);
}

TEST_CASE("Bad strides are refused, naming the tensor and the stride, before anything runs",
          "[cpu][layout][validation]") {
    FakeTensors<__half> t;
    const AttentionShape s{2, 3, 5, 7, 64, true};  // head_dim 64: rows of 64 elements
    struct Bad {
        const char* names;  // what the message must contain
        char calls;         // refused by: 'f' the forward (O is an output there only), 'b'
                            // the backward (which alone reads dO, writes dQ, dK, dV), 'a' both
        AttentionOptions o;
    };
    std::vector<Bad> bad(10);
    bad[0] = {"layout.Q.row", 'a', {}}, bad[0].o.layout.Q = {3 * 5 * 72, 5 * 72, 68};
    bad[1] = {"layout.K.head", 'a', {}}, bad[1].o.layout.K = {3 * 7 * 64, 0, 64};
    bad[2] = {"layout.V.batch", 'a', {}}, bad[2].o.layout.V = {-3 * 7 * 64, 7 * 64, 64};
    bad[3] = {"layout.Q.batch", 'a', {}}, bad[3].o.layout.Q = {1LL << 39, 5 * 64, 64};
    // Outputs whose elements would share a place: rows closer than head_dim, heads on rows.
    bad[4] = {"layout.O", 'f', {}}, bad[4].o.layout.O = {3 * 5 * 64, 5 * 64, 32};
    bad[5] = {"layout.dQ", 'b', {}}, bad[5].o.layout.dQ = {3 * 5 * 64, 64, 64};
    bad[6] = {"layout.dK", 'b', {}}, bad[6].o.layout.dK = {64, 7 * 64, 64};
    bad[7] = {"layout.dO.row", 'b', {}}, bad[7].o.layout.dO = {3 * 5 * 64, 5 * 64, 4};
    bad[8] = {"layout.dV.row", 'b', {}}, bad[8].o.layout.dV = {3 * 7 * 64, 7 * 64, 0};
    // An input's rows closer than head_dim (overlapping): refused too (a copy engine's box is a
    // whole row wide).
    bad[9] = {"layout.K.row", 'a', {}}, bad[9].o.layout.K = {3 * 7 * 64, 7 * 64, 32};
    for (const Bad& b : bad) {
        INFO("options." << b.names);
        if (b.calls != 'b') CHECK_THAT(forward_refusal(t, s, b.o), Catch::Contains(b.names));
        if (b.calls != 'f') CHECK_THAT(backward_refusal(t, s, b.o), Catch::Contains(b.names));
    }
    CHECK(t.outputs_untouched());
}

TEST_CASE("Outputs whose spans overlap (dQ, dK, dV of one fused buffer) are refused, with the "
          "outputs untouched", "[gpu][layout][validation]") {
    const AttentionShape s{1, 2, 64, 64, 64, false};
    GpuAttention<__half> g(rounded_problem<__half>(s, 602));
    DeviceBuffer<__half> dqkv(3 * q_elems(s));
    dqkv.poison();
    AttentionOptions o;  // (batch, len, 3, heads, d): interleaved rows, overlapping spans
    const TensorStrides fused{3LL * 64 * 2 * 64, 64, 3LL * 2 * 64};
    o.layout.dQ = o.layout.dK = o.layout.dV = fused;
    const std::string msg = refusal([&] {
        flash_backward_fp16(g.Q.ptr, g.K.ptr, g.V.ptr, g.O.ptr, g.dO.ptr, g.L.ptr, dqkv.ptr,
                            dqkv.ptr + 2 * 64, dqkv.ptr + 4 * 64, s, o);
    });
    CHECK_THAT(msg, NamesWord("overlaps"));
    CHECK(count_bad(dqkv.download_float()) == dqkv.count);
}
