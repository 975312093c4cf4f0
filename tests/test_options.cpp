// test_options.cpp: chapter 5's options (flash.h's AttentionOptions: sliding windows, softcap,
// ALiBi, the softmax scale) in the forward and backward the public calls run (chapter 3 or 2, and
// the decode kernel for a short query), fp16 and bf16: against the general CPU reference
// (reference.h, in double on the very inputs), bitwise against the calls without options where
// the options change nothing, deterministic, and refused where bad. The policy's tile maps are
// checked on the CPU, exhaustively, in tests/test_policy.cpp.

#include "mask_policy.cuh"
#include "test_util.h"

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

namespace {

// One case: a shape and the options; slopes, when ALiBi is on, are drawn per head (per batch and
// head where per_batch), as BLOOM's geometric slopes would be: 2^(-8 (h + 1) / heads).
struct OptionsCase {
    const char* what;
    AttentionShape s;
    float scale = 0, softcap = 0;
    int left = -1, right = -1;
    bool alibi = false, per_batch = false;
};

std::string describe(const OptionsCase& c) {
    std::ostringstream os;
    os << c.what << ": " << describe(c.s) << ", window (" << c.left << ", " << c.right
       << "), softcap " << c.softcap << ", scale " << c.scale << ", alibi "
       << (c.alibi ? c.per_batch ? "per batch and head" : "per head" : "none");
    return os.str();
}

std::vector<double> slopes_of(const OptionsCase& c) {
    if (!c.alibi) return {};
    std::vector<double> v;
    for (int b = 0; b < (c.per_batch ? c.s.batch : 1); ++b)
        for (int h = 0; h < c.s.heads; ++h)
            v.push_back(std::exp2(-8.0 * (h + 1) / c.s.heads) * (1 + 0.25 * b));
    return v;
}

// The reference's outputs for the problem with these options (forward, and the backward with dO).
Outputs<double> reference_with(const Problem<double>& x, const OptionsCase& c,
                               const std::vector<double>& slopes, bool with_gradients) {
    const AttentionShape& s = x.s;
    Outputs<double> r;
    r.O.assign(q_elems(s), 0), r.L.assign(l_elems(s), 0);
    ReferenceProblem p;
    p.batch = s.batch, p.heads = s.heads, p.kv_heads = flash_kv_heads(s), p.head_dim = s.head_dim;
    p.q_len = s.q_len, p.kv_len = s.kv_len, p.causal = s.causal;
    p.softmax_scale = c.scale, p.window_left = c.left, p.window_right = c.right;
    p.softcap = c.softcap;
    p.alibi_slopes = slopes.empty() ? nullptr : slopes.data(), p.alibi_per_batch = c.per_batch;
    p.Q = x.Q.data(), p.K = x.K.data(), p.V = x.V.data(), p.O = r.O.data(), p.L = r.L.data();
    p.q = p.o = p.dq = p.d_o = reference_contiguous(s.heads, s.q_len, s.head_dim);
    p.k = p.v = p.dk = p.dv = reference_contiguous(flash_kv_heads(s), s.kv_len, s.head_dim);
    attention_reference_general(p);
    if (with_gradients) {
        r.dQ.assign(q_elems(s), 0), r.dK.assign(kv_elems(s), 0), r.dV.assign(kv_elems(s), 0);
        p.dO = x.dO.data(), p.dQ = r.dQ.data(), p.dK = r.dK.data(), p.dV = r.dV.data();
        attention_reference_general_backward(p);
    }
    return r;
}

// The score terms of the tolerances (test_util.h's ScoreTerms): the scale; the cap (its
// tanh.approx); ALiBi's fp32 bias, 4 u of the largest.
ScoreTerms score_terms(const OptionsCase& c, const std::vector<double>& slopes) {
    ScoreTerms t;
    t.scale = c.scale;
    t.softcap = c.softcap;
    for (double slope : slopes)  // |i' - j| < q_len + kv_len
        t.extra += 4 * kUnitRoundoff * slope * (c.s.q_len + c.s.kv_len);
    return t;
}

// The forward and backward of chapter 2 with options, on gpu's buffers: outputs poisoned first,
// every call watched by the deadline.
template <typename T>
void forward_with(GpuAttention<T>& g, const AttentionOptions& o) {
    g.O.poison();
    g.L.poison();
    const GpuCall call = gpu_call<T>("forward", Kernel::chapter2(), g.s);
    const DeadlineGuard guard(call);
    if constexpr (std::is_same<T, __half>::value)
        flash_forward_fp16(g.Q.ptr, g.K.ptr, g.V.ptr, g.O.ptr, g.L.ptr, g.s, o);
    else
        flash_forward_bf16(g.Q.ptr, g.K.ptr, g.V.ptr, g.O.ptr, g.L.ptr, g.s, o);
    wait_for_gpu(0, call);
}
template <typename T>
void backward_with(GpuAttention<T>& g, const AttentionOptions& o) {
    if (g.dQ.count == 0) {
        g.dQ = DeviceBuffer<T>(q_elems(g.s));
        g.dK = DeviceBuffer<T>(kv_elems(g.s));
        g.dV = DeviceBuffer<T>(kv_elems(g.s));
    }
    g.dQ.poison();
    g.dK.poison();
    g.dV.poison();
    const GpuCall call = gpu_call<T>("backward", Kernel::chapter2(), g.s);
    const DeadlineGuard guard(call);
    if constexpr (std::is_same<T, __half>::value)
        flash_backward_fp16(g.Q.ptr, g.K.ptr, g.V.ptr, g.O.ptr, g.dO.ptr, g.L.ptr, g.dQ.ptr,
                            g.dK.ptr, g.dV.ptr, g.s, o);
    else
        flash_backward_bf16(g.Q.ptr, g.K.ptr, g.V.ptr, g.O.ptr, g.dO.ptr, g.L.ptr, g.dQ.ptr,
                            g.dK.ptr, g.dV.ptr, g.s, o);
    wait_for_gpu(0, call);
}

// One case on the GPU against the reference: the forward, then the backward from its O and L.
template <typename T>
void check_options_case(const OptionsCase& c, uint32_t salt) {
    INFO(describe(c));
    const Problem<T> p = rounded_problem<T>(c.s, salt);
    const std::vector<double> slopes = slopes_of(c);
    const DeviceBuffer<float> slopes_gpu(converted<float>(slopes.empty() ? std::vector<double>{0.0}
                                                                         : slopes));
    AttentionOptions o;
    o.softmax_scale = c.scale, o.softcap = c.softcap;
    o.window_left = c.left, o.window_right = c.right;
    o.alibi_slopes = c.alibi ? slopes_gpu.ptr : nullptr, o.alibi_per_batch = c.per_batch;
    // The reference's slopes are the float ones the kernels read, exactly.
    const std::vector<double> slopes_f = converted<double>(converted<float>(slopes));
    const Outputs<double> want = reference_with(converted<double>(p), c, slopes_f, true);
    GpuAttention<T> g(p);
    forward_with(g, o);
    backward_with(g, o);
    const Outputs<float> got = g.outputs(true);
    const Tolerances tol = backward_tolerances16(p, got, want, score_terms(c, slopes_f));
    CAPTURE(tol.M, tol.L, tol.O, tol.grad_rel, tol.dQ_floor, tol.dK_floor);
    check_forward(got, want, tol, c.s);
    check_backward(got, want, tol, c.s);
}

// The default run's cases: each option alone and together, windows that skip tiles on both
// sides (Q tiles of 128 rows, K/V tiles of 64 or 128 keys), q_len below and above kv_len (rows
// that see no key), GQA, head dims 64, 128 and 256. The stress run's grid: head dims 32, 96 and
// 256, three length pairs, causal or not, four windows (softcap under causal, ALiBi without).
std::vector<OptionsCase> fast_cases() {
    return {
        {"a causal sliding window (Mistral)", {1, 2, 600, 600, 64, true}, 0, 0, 100, 0},
        {"a two-sided window, GQA", {2, 4, 300, 461, 128, false, 2}, 0, 0, 70, 40},
        {"softcap, a small cap", {1, 3, 257, 130, 64, true}, 0, 5.f},
        // Gemma 2's cap on its own (chapter 3's softcap kernel): exp(s - c) at scores near 0 is
        // about e^-50, so a forward that took the cap for the row's max (exercise 5.10) would
        // write fp16 P~ as zeros; caps 5 and 2 above keep P~ in fp16's range either way.
        {"softcap alone at Gemma 2's cap", {1, 2, 300, 520, 128, true}, 0, 50.f},
        // Scores of about 2.8 against a cap of 2: tanh saturates, so its derivative 1 - t^2 is
        // far from 1 (about 0.48 on average), where at cap 5 it is about 0.96, inside bf16's
        // tolerance.
        {"softcap that saturates, a larger scale", {1, 2, 200, 260, 128, false}, 0.25f, 2.f},
        {"ALiBi per head (BLOOM)", {2, 3, 200, 333, 128, true}, 0, 0, -1, -1, true},
        // ALiBi alone under the causal mask at d = 64, GQA: chapter 3's backward adds the key's
        // term on the tensor cores (KeyBias), a K/V head's blocks walking two heads' slopes.
        {"ALiBi alone, causal, GQA, d 64", {1, 4, 450, 700, 64, true, 2}, 0, 0, -1, -1, true},
        {"ALiBi per batch and head, a window", {2, 2, 190, 190, 64, false}, 0, 0, 64, 64, true,
         true},
        {"a larger scale", {1, 2, 150, 300, 64, false}, 0.3f},
        {"everything, causal", {2, 4, 333, 333, 256, true, 1}, 0.1f, 20.f, 90, 0, true},
        // Scale 1 at d = 256: scores of about N(0, 16^2), so a row's max often grows by more than
        // 2^8 from one K/V tile to the next: chapter 3's lazy rescale moves m (hopper_lazy).
        {"a row's max that grows along the row, d 256", {1, 2, 200, 400, 256, false}, 1.f},
        {"a window past q_len > kv_len: rows that see nothing", {1, 2, 300, 100, 128, true}, 0, 0,
         20, 0},
        // A short query: the forward runs the decode kernel (chapter 4), the backward chapter 3
        // or 2. The window's keys are the only ones split; rows of one block have their own heads
        // (ALiBi's slopes) and their own windows.
        {"decode: a window, softcap and ALiBi, GQA", {2, 8, 1, 1000, 128, true, 2}, 0, 30.f, 300,
         0, true},
        {"decode: 6 rows a head, MQA, a two-sided window and a scale", {1, 4, 6, 700, 64, false, 1},
         0.2f, 0, 100, 3},
        {"decode: q_len > kv_len, a window of one key: rows that see nothing",
         {1, 2, 5, 3, 256, true}, 0, 0, 0, 0},
    };
}
std::vector<OptionsCase> stress_cases() {
    std::vector<OptionsCase> v;
    for (int d : {32, 96, 256})
        for (auto len : {std::make_pair(1, 700), std::make_pair(513, 513),
                         std::make_pair(700, 129)})
            for (bool causal : {false, true})
                for (auto w : {std::make_pair(-1, -1), std::make_pair(0, 0),
                               std::make_pair(200, -1), std::make_pair(63, 129)})
                    v.push_back({"the stress grid", {2, 2, len.first, len.second, d, causal},
                                 d == 96 ? 0.2f : 0.f, causal ? 30.f : 0.f, w.first, w.second,
                                 !causal, !causal && d == 32});
    // ALiBi alone under the causal mask (chapter 3's backward: the key's term on the tensor
    // cores, KeyBias) over rows longer than the default run's, GQA: the key's term, up to
    // slope (q_len + kv_len) / scale, is the largest any case gives its three-part split.
    v.push_back({"ALiBi alone, causal, GQA, long rows", {1, 4, 1200, 2000, 64, true, 2}, 0, 0, -1,
                 -1, true});
    v.push_back({"ALiBi per batch and head alone, causal, GQA, long rows",
                 {2, 4, 900, 1500, 128, true, 2}, 0, 0, -1, -1, true, true});
    return v;
}

}  // namespace

TEMPLATE_TEST_CASE("Chapter 5's options: windows, softcap, ALiBi and the scale match the "
                   "reference, forward and backward",
                   "[gpu][fp16][bf16][options][forward][backward]", fp16, bf16) {
    const OptionsCase c = GENERATE(from_range(fast_cases()));
    check_options_case<TestType>(c, 501);
}

TEMPLATE_TEST_CASE("Chapter 5's options over more head dims, lengths, masks and windows",
                   "[.stress][stress][gpu][fp16][bf16][options]", fp16, bf16) {
    const OptionsCase c = GENERATE(from_range(stress_cases()));
    check_options_case<TestType>(c, 502);
}

TEMPLATE_TEST_CASE("Options that change nothing give the plain call's bits, and options give the "
                   "same bits on every call", "[gpu][fp16][bf16][options][determinism]", fp16,
                   bf16) {
    // A window wider than the sequence, and the default scale written out, are no options at all:
    // the plain calls, bit for bit (forward and backward).
    const AttentionShape s = GENERATE(AttentionShape{2, 3, 300, 411, 64, true},
                                      AttentionShape{1, 4, 257, 200, 128, false, 2},
                                      AttentionShape{2, 8, 3, 900, 128, true, 2});  // (decode)
    INFO(describe(s));
    const Problem<TestType> p = rounded_problem<TestType>(s, 503);
    GpuAttention<TestType> plain(p);
    plain.forward();
    plain.backward();
    const Outputs<float> want = plain.outputs(true);
    AttentionOptions wide;
    wide.window_left = s.q_len + s.kv_len, wide.window_right = s.causal ? 0 : s.q_len + s.kv_len;
    wide.softmax_scale = 1.0f / std::sqrt(float(s.head_dim));
    GpuAttention<TestType> g(p);
    forward_with(g, wide);
    backward_with(g, wide);
    check_bitwise(want, g.outputs(true), s);
    // Every option at once, twice: the same bits (the ordered add keeps dQ's sums in one order).
    const DeviceBuffer<float> slopes(std::vector<float>(s.heads, 0.0625f));
    AttentionOptions all;
    all.window_left = 77, all.window_right = s.causal ? 0 : 31, all.softcap = 15.f;
    all.softmax_scale = 0.2f, all.alibi_slopes = slopes.ptr;
    forward_with(g, all);
    backward_with(g, all);
    const Outputs<float> first = g.outputs(true);
    forward_with(g, all);
    backward_with(g, all);
    check_bitwise(first, g.outputs(true), s);
}

TEST_CASE("Bad options are refused, naming the field, before anything runs",
          "[cpu][options][validation]") {
    // Refused before any pointer is looked at: host stand-ins (FakeTensors), left untouched.
    FakeTensors<__half> t;
    const AttentionShape s = valid_shape();
    struct Bad {
        const char* field;
        AttentionOptions o;
    };
    // Beyond the signs: a scale or cap whose kernel constants would not be finite (the scale
    // times the -1e30 standing in for -inf, 1 / scale, softcap / scale), and -0.
    std::vector<Bad> bad(10);
    bad[0] = {"window_left", {}}, bad[0].o.window_left = -2;
    bad[1] = {"window_right", {}}, bad[1].o.window_right = -5;
    bad[2] = {"softcap", {}}, bad[2].o.softcap = -1.f;
    bad[3] = {"softcap", {}}, bad[3].o.softcap = std::nanf("");
    bad[4] = {"softmax_scale", {}}, bad[4].o.softmax_scale = -0.5f;
    bad[5] = {"alibi_per_batch", {}}, bad[5].o.alibi_per_batch = true;
    bad[6] = {"softmax_scale", {}}, bad[6].o.softmax_scale = 1e9f;
    bad[7] = {"softmax_scale", {}}, bad[7].o.softmax_scale = 1e-39f;
    bad[8] = {"softmax_scale", {}}, bad[8].o.softmax_scale = -0.0f;
    bad[9] = {"softcap", {}}, bad[9].o.softcap = 1e-40f;
    for (const Bad& b : bad) {
        INFO("options." << b.field);
        CHECK_THAT(forward_refusal(t, s, b.o), NamesWord(b.field));
        CHECK_THAT(backward_refusal(t, s, b.o), NamesWord(b.field));
    }
    CHECK(t.outputs_untouched());
}

TEST_CASE("ALiBi slopes in host memory, or over an output, are refused, naming them, with the "
          "outputs untouched", "[gpu][options][validation]") {
    const AttentionShape s{1, 2, 64, 64, 64, true};
    GpuAttention<__half> g(rounded_problem<__half>(s, 504));
    g.O.poison();
    alignas(16) static float host_slopes[2] = {0.5f, 0.25f};
    AttentionOptions o;
    o.alibi_slopes = host_slopes;
    const std::string msg =
        refusal([&] { flash_forward_fp16(g.Q.ptr, g.K.ptr, g.V.ptr, g.O.ptr, g.L.ptr, s, o); });
    CHECK_THAT(msg, NamesWord("alibi_slopes"));
    CHECK(count_bad(g.O.download_float()) == q_elems(s));  // still all NaN: nothing ran
    // Slopes that are L itself: blocks would read slopes other blocks have overwritten.
    o.alibi_slopes = g.L.ptr;
    const std::string overlap =
        refusal([&] { flash_forward_fp16(g.Q.ptr, g.K.ptr, g.V.ptr, g.O.ptr, g.L.ptr, s, o); });
    CHECK_THAT(overlap, NamesWord("overlaps"));
    CHECK(count_bad(g.O.download_float()) == q_elems(s));
}

TEMPLATE_TEST_CASE("Without the order (deterministic false) the backward matches the reference, "
                   "and dK, dV, O and L keep the ordered call's bits",
                   "[gpu][fp16][bf16][options][backward][determinism]", fp16, bf16) {
    // Chapter 3's plain kernels at head dims 128 and 256 (256: where its blocks wait longest for
    // their turn) drop the order. A softcap (another policy) and chapter 2 (head dim 96, on any
    // GPU) keep it, since false only permits: there dQ must keep its bits too.
    const OptionsCase c = GENERATE(
        OptionsCase{"no order, causal", {2, 2, 333, 333, 256, true}},
        OptionsCase{"no order, GQA", {2, 4, 300, 461, 128, false, 2}},
        OptionsCase{"a softcap: the order kept", {1, 3, 257, 300, 64, true}, 0, 5.f},
        OptionsCase{"chapter 2: the order kept", {2, 2, 200, 390, 96, true}});
    INFO(describe(c));
    const Problem<TestType> p = rounded_problem<TestType>(c.s, 504);
    AttentionOptions ordered;
    ordered.softcap = c.softcap;
    AttentionOptions unordered = ordered;
    unordered.deterministic = false;
    GpuAttention<TestType> g(p);
    forward_with(g, ordered);
    backward_with(g, ordered);
    const Outputs<float> in_order = g.outputs(true);
    backward_with(g, unordered);                       // dQ, dK, dV poisoned again first
    const Outputs<float> got = g.outputs(true);
    // dQ: the same fp32 parts summed in another order. That sum's rounding, far below u16, is no
    // term of the 16-bit tolerances (test_util.h) in any order, so they hold as in order.
    const Outputs<double> want = reference_with(converted<double>(p), c, {}, true);
    const Tolerances tol = backward_tolerances16(p, got, want, score_terms(c, {}));
    CAPTURE(tol.grad_rel, tol.dQ_floor, tol.dK_floor);
    check_backward(got, want, tol, c.s);
    // Only dQ's adds lose their order: each block sums its own dK_j and dV_j in registers.
    check_bitwise("O", in_order.O, got.O, c.s, q_layout(c.s));
    check_bitwise("L", in_order.L, got.L, c.s, l_layout(c.s));
    check_bitwise("dK", in_order.dK, got.dK, c.s, kv_layout(c.s));
    check_bitwise("dV", in_order.dV, got.dV, c.s, kv_layout(c.s));
    if (c.softcap > 0 || c.s.head_dim == 96)
        check_bitwise("dQ", in_order.dQ, got.dQ, c.s, q_layout(c.s));
}
