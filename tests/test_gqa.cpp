// test_gqa.cpp: grouped-query attention (GQA) and multi-query attention (MQA), chapter 4: `heads`
// query heads over kv_heads K/V heads, query head h reading K/V head h / (heads / kv_heads)
// (flash.h). Every chapter's kernels, forward and backward, against the CPU reference, which
// stays multi-head on purpose: it runs on K and V repeated on the host to every query head, and
// the dK, dV of a K/V head are the sum of the reference's dK, dV over the query heads of its
// group. Then determinism (bitwise over reruns), the bitwise identity of GQA's O, L and dQ with
// those of multi-head attention on the repeated K/V, and the refusals of bad kv_heads.
//
// Tolerances: those of the multi-head tests (tests/test_util.h), with one honest change, derived
// at gqa_tolerances below: dK_j and dV_j sum over the group's query rows as well as a head's, so
// the terms of the derivation that count a gradient's summed terms (q_len, for dK and dV) count
// group * q_len of them.
#include "test_util.h"

#include <climits>

namespace {

// The group sizes heads / kv_heads the tests take: 1 (multi-head, given explicitly), 2, 4, 8, and
// MQA (kv_heads = 1), at heads = 8, and an odd pair (6 over 3, and 3 over 1: MQA with odd heads).
struct Heads {
    int heads, kv_heads;
};
const std::vector<Heads> kGroups = {{8, 8}, {8, 4}, {8, 2}, {8, 1}, {6, 3}, {3, 1}};

// Odd lengths, q_len != kv_len both ways (causal with q_len > kv_len: rows that see no key), a
// Q tile or K/V tile edge passed by one.
const std::vector<std::pair<int, int>> kGqaLengths = {{17, 17}, {33, 100}, {100, 33}, {129, 129}};

// The shapes: every group above, every length pair, causal and not, at batch 2 (so that a kernel
// that mixes up batch and head is caught too), at head dim d.
std::vector<AttentionShape> gqa_shapes(int d, const std::vector<std::pair<int, int>>& lengths) {
    std::vector<AttentionShape> shapes;
    for (const Heads& g : kGroups)
        for (const auto& qk : lengths)
            for (bool causal : {false, true}) {
                AttentionShape s{2, g.heads, qk.first, qk.second, d, causal};
                s.kv_heads = g.kv_heads;
                shapes.push_back(s);
            }
    return shapes;
}
// Their shares (tests/test_util.h, Share): the default run takes groups of 4 and 3 (8 over 2, 6
// over 3) and MQA (8 over 1) at 100 against 33 with the mask (rows that see no key) and 129
// against 129 without; make stress the rest.
std::vector<AttentionShape> gqa_shapes(int d, Share share) {
    std::vector<AttentionShape> shapes;
    for (const AttentionShape& s : gqa_shapes(d, kGqaLengths)) {
        const bool group = (s.heads == 8 && s.kv_heads <= 2) || (s.heads == 6 && s.kv_heads == 3);
        const bool length = (s.q_len == 100 && s.kv_len == 33 && s.causal) ||
                            (s.q_len == 129 && !s.causal);
        if ((group && length) == (share == Share::fast)) shapes.push_back(s);
    }
    return shapes;
}

// The reference's element type for inputs of T (as the harness's own checks take it): float for
// float, double for fp16 and bf16 (on their exact values).
template <typename T>
using Reference = typename std::conditional<std::is_same<T, float>::value, float, double>::type;

// The multi-head problem of a grouped one: the same Q and dO, K and V repeated to every query
// head (head h gets K/V head h / group), kv_heads = 0. What the reference runs on.
template <typename T>
Problem<T> repeated_kv(const Problem<T>& p) {
    const AttentionShape& s = p.s;
    const int kv_heads = flash_kv_heads(s), group = s.heads / kv_heads;
    Problem<T> m{s, p.Q, {}, {}, p.dO};
    m.s.kv_heads = 0;
    const size_t head = size_t(s.kv_len) * s.head_dim;  // elements of one K/V head
    m.K.resize(kv_elems(m.s));
    m.V.resize(kv_elems(m.s));
    for (size_t bh = 0; bh < size_t(s.batch) * s.heads; ++bh) {
        const size_t from = bh / group * head;  // (b H + h) / group = b H_kv + h / group
        std::copy(p.K.begin() + from, p.K.begin() + from + head, m.K.begin() + bh * head);
        std::copy(p.V.begin() + from, p.V.begin() + from + head, m.V.begin() + bh * head);
    }
    return m;
}

// A grouped shape's dK or dV from the multi-head reference's: the sum over each group's query
// heads, g = 0 .. group - 1 in order, in double.
template <typename W>
std::vector<double> group_sum(const std::vector<W>& per_head, const AttentionShape& s) {
    const int kv_heads = flash_kv_heads(s), group = s.heads / kv_heads;
    const size_t head = size_t(s.kv_len) * s.head_dim;
    std::vector<double> sum(kv_elems(s), 0.0);
    for (size_t bh = 0; bh < size_t(s.batch) * s.heads; ++bh)
        for (size_t e = 0; e < head; ++e)
            sum[bh / group * head + e] += double(per_head[bh * head + e]);
    return sum;
}

// The tolerances of the multi-head tests for the repeated problem m (test_util.h's derivations:
// fp32's tolerances(), chapter 2's tolerances16 and backward_tolerances16), and for a grouped
// shape the one change a sum over the group brings. dQ, O and L are per query head, as in
// multi-head attention: unchanged. dK_j and dV_j are sums over the queries that see key j: q_len
// of them in a head, group * q_len over a group, accumulated in fp32 (registers: chapter 1, 2) in
// one fixed order and rounded to T once. The relative part of the bound is relative to the
// largest entry of the summed reference gradient and, as derived there, a random walk of
// independent roundings stays a few units of the sum's own size however many terms it has: it
// stays. Two terms grow with the number of summed terms, as sqrt(n): fp32's grad_rel term
// sqrt(q_len) (its accumulation's random-walk rounding; it covers dK and dV alone here, as dQ's
// sum is over keys) and both types' dK_floor, sqrt(q_len) (the errors of D_i, each query its own
// sign). With n = group * q_len they grow by sqrt(group): so much, no more.
struct GqaTolerances {
    Tolerances q;   // O, L, dQ: the multi-head tests' own
    Tolerances kv;  // dK, dV: the same with q_len -> group * q_len in the two terms above
};
template <typename T, typename W>
GqaTolerances gqa_tolerances(const Problem<T>& m, const Outputs<float>& got,
                             const Outputs<W>& want, bool with_gradients, int group) {
    GqaTolerances t;
    if constexpr (std::is_same<T, float>::value) t.q = tolerances(m, Rounding::random);
    else t.q = with_gradients ? backward_tolerances16(m, got, want) : tolerances16(m);
    t.kv = t.q;
    const double q = m.s.q_len;
    if constexpr (std::is_same<T, float>::value)
        t.kv.grad_rel += kSafety * kUnitRoundoff * (std::sqrt(group * q) - std::sqrt(q));
    t.kv.dK_floor *= std::sqrt(double(group));
    return t;
}

// Problem p (grouped) on the GPU: the forward of `kernel` (and with_gradients its backward: the
// same chapter's), every output poisoned with NaN first (GpuAttention), against the reference
// on repeated_kv(p). Returns the GPU's outputs.
template <typename T>
Outputs<float> check_gqa_on_gpu(const Problem<T>& p, bool with_gradients, Kernel kernel) {
    const AttentionShape& s = p.s;
    const int group = s.heads / flash_kv_heads(s);
    INFO(describe(s) << ", " << type_name<T>() << (with_gradients ? " forward and backward, "
                                                                   : " forward, ")
                     << kernel.name() << "; " << group << " query heads a K/V head");
    GpuAttention<T> gpu(p);  // K, V (and dK, dV) of kv_elems(s): the grouped heads only
    gpu.forward(kernel);
    if (with_gradients) gpu.backward(kernel);
    const Outputs<float> got = gpu.outputs(with_gradients);
    const Problem<T> m = repeated_kv(p);
    const Problem<Reference<T>> exact = converted<Reference<T>>(m);
    const Outputs<Reference<T>> want =
        with_gradients ? reference_backward(exact) : reference_forward(exact);
    const GqaTolerances tol = gqa_tolerances(m, got, want, with_gradients, group);
    INFO("tolerance on O " << tol.q.O << ", on L " << tol.q.L << "; gradients: dQ "
                           << tol.q.grad_rel << " of the largest entry + " << tol.q.dQ_floor
                           << ", dK and dV " << tol.kv.grad_rel << " + " << tol.kv.dK_floor
                           << " on dK");
    check_forward(got, want, tol.q, s);
    if (!with_gradients) return got;
    check_close("dQ", got.dQ, want.dQ, tol.q.grad_rel * max_abs(want.dQ) + tol.q.dQ_floor, s,
                q_layout(s));
    const std::vector<double> dK = group_sum(want.dK, s), dV = group_sum(want.dV, s);
    check_close("dK", got.dK, dK, tol.kv.grad_rel * max_abs(dK) + tol.kv.dK_floor, s,
                kv_layout(s));
    check_close("dV", got.dV, dV, tol.kv.grad_rel * max_abs(dV), s, kv_layout(s));
    return got;
}

// The kernels of T to run, forward and backward: chapter 1's for fp32; for fp16 and bf16 chapter
// 2's, and chapter 3's at its head dims on a GPU of compute capability 9.0 (hopper_or_warn says when not).
template <typename T>
std::vector<Kernel> forward_kernels(int d) {
    if constexpr (std::is_same<T, float>::value) return {Kernel::public_call()};
    std::vector<Kernel> kernels = {Kernel::chapter2()};
    static const bool hopper = hopper_or_warn();  // (its warning once, not once a shape)
    if (hopper && std::count(kHopperHeadDims.begin(), kHopperHeadDims.end(), d))
        kernels.push_back(Kernel::chapter3());
    return kernels;
}

// The grid tests' body, forward (or forward and backward) on the share of gqa_shapes: the test
// case and its [.stress] twin below run one each, with the same salts.
template <typename T>
void check_gqa_grid(bool backward, Share share) {
    const int d = GENERATE(values<int>({std::is_same<T, float>::value ? 32 : 64, 128}));
    const AttentionShape s = GENERATE_COPY(from_range(gqa_shapes(d, share)));
    const auto p = rounded_problem<T>(s, backward ? 4100 : 4000, backward);
    for (const Kernel& kernel : forward_kernels<T>(d)) check_gqa_on_gpu(p, backward, kernel);
}

}  // namespace

TEMPLATE_TEST_CASE("GQA and MQA: the forward matches the reference on K and V repeated to every "
                   "query head", "[gpu][gqa][forward][fp32][fp16][bf16]", fp32, fp16, bf16) {
    // Every chapter's forward (forward_kernels), groups 1, 2, 4, 8 and MQA, odd and unequal
    // lengths, causal and not, two head dims each (64, and 128 where chapter 3 runs too; fp32 32
    // and 128: a row split over threads).
    check_gqa_grid<TestType>(false, Share::fast);
}

TEMPLATE_TEST_CASE("GQA and MQA: the forward matches the reference on K and V repeated to every "
                   "query head, the rest (make stress)", "[gpu][gqa][forward][fp32][fp16][bf16][.stress]", fp32, fp16, bf16) {
    check_gqa_grid<TestType>(false, Share::stress);
}

TEMPLATE_TEST_CASE("GQA and MQA: the backward matches the reference, dK and dV summed over each "
                   "group", "[gpu][gqa][backward][fp32][fp16][bf16]", fp32, fp16, bf16) {
    // Each chapter's forward and backward (forward_kernels: chapter 1 for fp32; chapter 2, and 3
    // on a Hopper), whose blocks each run a (K/V head, K/V tile) over every query head of the
    // group. d = 64 and 128 (fp32: 32 and 128); 256 in the next test.
    check_gqa_grid<TestType>(true, Share::fast);
}

TEMPLATE_TEST_CASE("GQA and MQA: the backward matches the reference, dK and dV summed over each "
                   "group, the rest (make stress)", "[gpu][gqa][backward][fp32][fp16][bf16][.stress]", fp32, fp16, bf16) {
    check_gqa_grid<TestType>(true, Share::stress);
}

TEMPLATE_TEST_CASE("GQA at head dim 256 and on a longer sequence, forward and backward",
                   "[gpu][gqa][backward][forward][fp32][fp16][bf16]", fp32, fp16, bf16) {
    // Several K/V tiles and Q tiles a head (the ordered dQ adds across a block that covers four
    // query heads) and the largest head dim. (The longest, 4500 keys, in make stress below.)
    const AttentionShape s = GENERATE(AttentionShape{1, 8, 300, 257, 256, true, 2},
                                      AttentionShape{1, 8, 513, 700, 64, false, 2},
                                      AttentionShape{2, 4, 400, 400, 128, true, 1});
    const auto p = rounded_problem<TestType>(s, 4200);
    for (const Kernel& kernel : forward_kernels<TestType>(s.head_dim)) check_gqa_on_gpu(p, true, kernel);
}

TEMPLATE_TEST_CASE("GQA at head dim 256 and on a longer sequence, forward and backward: 4500 keys "
                   "(make stress)",
                   "[gpu][gqa][backward][forward][fp32][fp16][bf16][.stress]", fp32, fp16, bf16) {
    // 36 K/V tiles under the mask, where chapter 3's backward hands out 9 K/V heads' tickets as a
    // group of 7 and one of 2 on an H100. The same body and salt as the test above.
    const AttentionShape s = GENERATE(AttentionShape{1, 18, 70, 4500, 128, true, 9});
    const auto p = rounded_problem<TestType>(s, 4200);
    for (const Kernel& kernel : forward_kernels<TestType>(s.head_dim)) check_gqa_on_gpu(p, true, kernel);
}

TEMPLATE_TEST_CASE("GQA: O, L and dQ are bitwise those of multi-head attention on K and V repeated",
                   "[gpu][gqa][forward][backward][fp32][fp16][bf16]", fp32, fp16, bf16) {
    // A query head's O, L and dQ read only its own K/V head: every kernel computes them with the
    // very arithmetic, in the very order, that multi-head attention on the repeated K/V uses (dQ's
    // adds over K/V tiles too). So they must agree to the bit: a wrong head read, or a group's
    // rows mixed up, cannot hide within a tolerance. (dK, dV differ: GQA sums a group in fp32,
    // multi-head rounds each head's.) kv_heads = heads must also be bitwise kv_heads = 0.
    const int kv_heads = GENERATE(1, 2, 6);
    AttentionShape s{2, 6, 150, 221, 64, GENERATE(false, true)};
    s.kv_heads = kv_heads;
    INFO(describe(s));
    const auto p = rounded_problem<TestType>(s, 4300);
    const Problem<TestType> m = repeated_kv(p);
    for (const Kernel& kernel : forward_kernels<TestType>(s.head_dim)) {
        INFO(kernel.name());
        GpuAttention<TestType> gqa(p), mha(m);
        gqa.forward(kernel);
        mha.forward(kernel);
        gqa.backward();
        mha.backward();
        const Outputs<float> a = gqa.outputs(true), b = mha.outputs(true);
        check_bitwise("O", a.O, b.O, s, q_layout(s));
        check_bitwise("L", a.L, b.L, s, l_layout(s));
        check_bitwise("dQ", a.dQ, b.dQ, s, q_layout(s));
        if (kv_heads == s.heads) {  // the same shape, kv_heads spelled out: dK, dV too
            check_bitwise("dK", a.dK, b.dK, s, kv_layout(s));
            check_bitwise("dV", a.dV, b.dV, s, kv_layout(s));
        }
    }
}

TEMPLATE_TEST_CASE("GQA and MQA are deterministic: identical calls give identical bits",
                   "[gpu][gqa][determinism][fp32][fp16][bf16]", fp32, fp16, bf16) {
    // dK, dV summed over the group in registers in a fixed order, dQ's adds in turn: no atomics
    // decide a bit. Five calls, forward and backward, each poisoned first.
    AttentionShape s = GENERATE(AttentionShape{2, 8, 257, 257, 64, true},
                                AttentionShape{1, 8, 200, 333, 128, false},
                                AttentionShape{3, 4, 65, 129, 64, true});
    s.kv_heads = GENERATE(1, 2);
    INFO(describe(s));
    GpuAttention<TestType> gpu(rounded_problem<TestType>(s, 4400));
    for (const Kernel& kernel : forward_kernels<TestType>(s.head_dim)) {
        INFO(kernel.name());
        outputs_of_identical_calls(gpu, 5, true, kernel);
    }
}

TEMPLATE_TEST_CASE("A kv_heads that does not divide heads, or is negative or above heads, is "
                   "refused naming kv_heads, outputs untouched",
                   "[cpu][gqa][validation][fp32][fp16][bf16]", fp32, fp16, bf16) {
    // Before anything reaches the GPU (FakeTensors are host arrays: the shape is refused first).
    AttentionShape s{2, 6, 5, 7, 64, true};
    s.kv_heads = GENERATE(4, 5, -1, 7, 12, INT_MIN, INT_MAX);
    INFO(describe(s));
    FakeTensors<TestType> t;
    const NamesWord names_kv_heads("kv_heads");
    CHECK_THAT(refusal([&] { validate_shape(s); }), names_kv_heads);
    for (const Kernel& kernel : {Kernel::public_call(), Kernel::chapter2(), Kernel::chapter3()}) {
        if (std::is_same<TestType, float>::value && !(kernel == Kernel::public_call())) continue;
        INFO(forward_api<TestType>() << ", " << kernel.name());
        CHECK_THAT(refusal([&] { launch_forward(t.Q, t.K, t.V, t.O, t.L, s, kernel); }),
                   names_kv_heads);
    }
    CHECK_THAT(refusal([&] {
                   launch_backward(t.Q, t.K, t.V, t.O, t.dO, t.L, t.dQ, t.dK, t.dV, s);
               }),
               names_kv_heads);
    if constexpr (!std::is_same<TestType, float>::value)
        CHECK_THAT(refusal([&] { flash_backward_fp16_scratch_bytes(s); }), names_kv_heads);
    CHECK(t.outputs_untouched());
}

TEST_CASE("Every divisor of heads is a valid kv_heads, and K and V count kv_heads heads",
          "[cpu][gqa][validation]") {
    for (int heads : {1, 6, 8, 32})
        for (int kv_heads = 0; kv_heads <= heads; ++kv_heads) {
            AttentionShape s{2, heads, 5, 7, 64, false};
            s.kv_heads = kv_heads;
            INFO(describe(s));
            if (kv_heads != 0 && heads % kv_heads != 0) continue;
            CHECK_NOTHROW(validate_shape(s));
            CHECK(flash_kv_heads(s) == (kv_heads == 0 ? heads : kv_heads));
            CHECK(kv_elems(s) == size_t(2) * flash_kv_heads(s) * 7 * 64);
            CHECK(q_elems(s) == size_t(2) * heads * 5 * 64);
            // The fp16 backward's scratch is per query head (dQ in fp32, D, turns): unchanged.
            AttentionShape mha = s;
            mha.kv_heads = 0;
            CHECK(flash_backward_fp16_scratch_bytes(s) == flash_backward_fp16_scratch_bytes(mha));
        }
}

TEST_CASE("The CPU reference refuses grouped K/V heads: the tests repeat K and V for it",
          "[cpu][gqa][reference]") {
    // It is multi-head only, so that it shares no indexing with the kernels it checks; read as
    // multi-head, grouped K and V would be read past their end.
    AttentionShape s{1, 4, 5, 7, 16, false};
    s.kv_heads = 2;
    FakeTensors<float> t;
    CHECK_THAT(refusal([&] { attention_reference(t.Q, t.K, t.V, t.O, t.L, s); }),
               NamesWord("kv_heads"));
    CHECK(t.outputs_untouched());
}

TEST_CASE("repeated_kv and group_sum: head h gets K/V head h / group, and a group's gradients add",
          "[cpu][gqa]") {
    // The tests' own host code, checked on a small shape: 2 batches, 4 query heads over 2.
    AttentionShape s{2, 4, 3, 5, 16, false};
    s.kv_heads = 2;
    const auto p = random_problem(s, 4500);
    const Problem<float> m = repeated_kv(p);
    const size_t head = size_t(s.kv_len) * s.head_dim;
    REQUIRE(m.K.size() == 2 * head * 4);
    for (size_t b = 0; b < 2; ++b)
        for (size_t h = 0; h < 4; ++h)
            for (size_t e = 0; e < head; ++e) {
                CHECK(m.K[(b * 4 + h) * head + e] == p.K[(b * 2 + h / 2) * head + e]);
                CHECK(m.V[(b * 4 + h) * head + e] == p.V[(b * 2 + h / 2) * head + e]);
            }
    const std::vector<double> sum = group_sum(m.K, s);
    for (size_t e = 0; e < sum.size(); ++e) CHECK(sum[e] == 2.0 * double(p.K[e]));
}
