// test_varlen.cpp: chapter 5's packed batches (flash.h's PackedBatch, FlashAttention-2's
// flash_attn_varlen_func): sequences of their own lengths packed one after another, Q (total_q,
// heads, d), K and V (total_k, kv_heads, d). Each sequence of a packed batch gets the bits that
// sequence gets alone (on the kernels a packed batch runs: chapter 3's where the public call
// runs it, else chapter 2's; the plain policy, or chapter 5's with a score-changing option),
// forward and backward (and, with deterministic = false, the ordered call's dK and dV, and a dQ
// within the reference's tolerances); a sequence with no keys gets O = 0, L =
// -inf, dQ = 0, one with no queries dK = dV = 0; padded rows are neither read nor written; the
// plain sequences without GQA agree with the CPU reference; and bad cu_seqlens are refused,
// naming the entry.

#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

namespace {

// One case: each sequence's query and key lengths, the heads, and the options (softcap > 0, a
// window left >= 0 or ALiBi: chapter 2's policy; scale > 0: the softmax scale). pad: rows given
// strides with 8 elements after each row (NaN there, which any read would spread into an output).
struct VarlenCase {
    const char* what;
    std::vector<int> q_lens, k_lens;
    int heads, kv_heads, d;
    bool causal;
    float softcap = 0;
    int left = -1;
    bool alibi = false, pad = false;
    float scale = 0;
    bool plain() const { return softcap == 0 && left < 0 && !alibi && scale == 0; }
};
std::string describe(const VarlenCase& c) {
    std::ostringstream os;
    os << c.what << ": heads " << c.heads << " over " << c.kv_heads << ", d " << c.d << ", causal "
       << c.causal << ", softcap " << c.softcap << ", window left " << c.left << ", alibi "
       << c.alibi << ", scale " << c.scale << "; (q_len, kv_len) per sequence:";
    for (size_t b = 0; b < c.q_lens.size(); b++)
        os << " (" << c.q_lens[b] << ", " << c.k_lens[b] << ")";
    return os.str();
}
std::vector<int> offsets(const std::vector<int>& lens) {  // cu_seqlens: 0, then running sums
    std::vector<int> cu(1, 0);
    for (int n : lens) cu.push_back(cu.back() + n);
    return cu;
}
// Sequence b alone, as a dense call: one batch of its lengths.
AttentionShape alone(const VarlenCase& c, size_t b) {
    return {1, c.heads, c.q_lens[b], c.k_lens[b], c.d, c.causal, c.kv_heads};
}

// A packed tensor of `heads` heads, rows `row` elements apart, and where the rows of one
// sequence's dense [1][heads][len][d] tensor go in it.
struct Packed {
    int heads, d;
    long long row;
    size_t at(int first_row, int h, int i, int x) const {
        return size_t(first_row + i) * row + size_t(h) * d + x;
    }
};
Packed packed_of(const VarlenCase& c, bool kv) {
    const int heads = kv ? c.kv_heads : c.heads;
    return {heads, c.d, (long long)heads * c.d + (c.pad ? 8 : 0)};
}
// Sequence b's rows (first row `first`, `len` rows) of dense into the packed buffer, or back.
template <typename T>
void pack(std::vector<T>& buffer, const Packed& p, int first, int len,
          const std::vector<T>& dense) {
    for (int h = 0; h < p.heads; h++)
        for (int i = 0; i < len; i++)
            for (int x = 0; x < p.d; x++)
                buffer[p.at(first, h, i, x)] = dense[(size_t(h) * len + i) * p.d + x];
}
std::vector<float> unpack(const std::vector<float>& buffer, const Packed& p, int first, int len) {
    std::vector<float> dense(size_t(p.heads) * len * p.d);
    for (int h = 0; h < p.heads; h++)
        for (int i = 0; i < len; i++)
            for (int x = 0; x < p.d; x++)
                dense[(size_t(h) * len + i) * p.d + x] = buffer[p.at(first, h, i, x)];
    return dense;
}

// The calls: the packed batch's, and each sequence alone on the kernels the packed batch runs:
// chapter 3's forward and backward where the public call runs chapter 3
// (public_forward_runs_hopper), else chapter 2's. A plain sequence alone takes the chapter's own
// call (the public one could run the decode); one with options the options' call, which takes
// the packed batch's path.
template <typename T>
void forward_call(const T* Q, const T* K, const T* V, T* O, float* L, const AttentionShape& s,
                  const AttentionOptions& o, bool plain) {
    const bool hopper = public_forward_runs_hopper(s.head_dim);
    const GpuCall call =
        gpu_call<T>("forward", hopper ? Kernel::chapter3() : Kernel::chapter2(), s);
    const DeadlineGuard guard(call);
    if (plain && !o.packed.cu_seqlens_q) {  // alone, without options: the chapter's own call
        if constexpr (std::is_same<T, __half>::value) {
            if (hopper) flash_forward_fp16_hopper(Q, K, V, O, L, s);
            else flash_forward_fp16_ampere(Q, K, V, O, L, s);
        } else {
            if (hopper) flash_forward_bf16_hopper(Q, K, V, O, L, s);
            else flash_forward_bf16_ampere(Q, K, V, O, L, s);
        }
    } else if constexpr (std::is_same<T, __half>::value) {
        flash_forward_fp16(Q, K, V, O, L, s, o);
    } else {
        flash_forward_bf16(Q, K, V, O, L, s, o);
    }
    wait_for_gpu(0, call);
}
template <typename T>
void backward_call(const T* Q, const T* K, const T* V, const T* O, const T* dO, const float* L,
                   T* dQ, T* dK, T* dV, const AttentionShape& s, const AttentionOptions& o,
                   bool plain) {
    const bool hopper = public_forward_runs_hopper(s.head_dim);  // (the backward's rule too)
    const GpuCall call =
        gpu_call<T>("backward", hopper ? Kernel::chapter3() : Kernel::chapter2(), s);
    const DeadlineGuard guard(call);
    if (plain && !o.packed.cu_seqlens_q) {
        if constexpr (std::is_same<T, __half>::value) {
            if (hopper) flash_backward_fp16_hopper(Q, K, V, O, dO, L, dQ, dK, dV, s);
            else flash_backward_fp16_ampere(Q, K, V, O, dO, L, dQ, dK, dV, s);
        } else {
            if (hopper) flash_backward_bf16_hopper(Q, K, V, O, dO, L, dQ, dK, dV, s);
            else flash_backward_bf16_ampere(Q, K, V, O, dO, L, dQ, dK, dV, s);
        }
    } else if constexpr (std::is_same<T, __half>::value) {
        flash_backward_fp16(Q, K, V, O, dO, L, dQ, dK, dV, s, o);
    } else {
        flash_backward_bf16(Q, K, V, O, dO, L, dQ, dK, dV, s, o);
    }
    wait_for_gpu(0, call);
}

// The packed call's outputs, as floats in their packed buffers.
struct PackedOutputs {
    std::vector<float> O, L, dQ, dK, dV;
};

template <typename T>
void check_varlen_case(const VarlenCase& c, uint32_t salt) {
    INFO(describe(c));
    const int B = int(c.q_lens.size()), H = c.heads, d = c.d;
    const std::vector<int> cu_q = offsets(c.q_lens), cu_k = offsets(c.k_lens);
    const int total_q = cu_q.back(), total_k = cu_k.back();
    const Packed pq = packed_of(c, false), pk = packed_of(c, true);
    // Each sequence's inputs, drawn as a dense problem of its own, then packed (NaN in the pads).
    std::vector<Problem<T>> seq;
    const T nan = quiet_nan<T>();
    std::vector<T> Q(total_q * pq.row, nan), dO(Q.size(), nan), K(total_k * pk.row, nan),
        V(K.size(), nan);
    for (int b = 0; b < B; b++) {
        seq.push_back(rounded_problem<T>(alone(c, b), salt + b));
        pack(Q, pq, cu_q[b], c.q_lens[b], seq[b].Q), pack(dO, pq, cu_q[b], c.q_lens[b], seq[b].dO);
        pack(K, pk, cu_k[b], c.k_lens[b], seq[b].K), pack(V, pk, cu_k[b], c.k_lens[b], seq[b].V);
    }
    std::vector<float> slopes;  // BLOOM-like slopes, one a head
    for (int h = 0; h < H; h++) slopes.push_back(std::exp2(-8.0f * (h + 1) / H));
    const DeviceBuffer<float> slopes_gpu(slopes);
    AttentionOptions o;
    o.softcap = c.softcap, o.window_left = c.left, o.softmax_scale = c.scale;
    if (c.alibi) o.alibi_slopes = slopes_gpu.ptr;
    // The packed call, its outputs poisoned first.
    const DeviceBuffer<int> cu_q_gpu(cu_q), cu_k_gpu(cu_k);
    const DeviceBuffer<T> Qg(Q), Kg(K), Vg(V), dOg(dO);
    DeviceBuffer<T> Og(Q.size()), dQg(Q.size()), dKg(K.size()), dVg(K.size());
    DeviceBuffer<float> Lg(size_t(H) * total_q);
    Og.poison(), dQg.poison(), dKg.poison(), dVg.poison(), Lg.poison();
    AttentionOptions po = o;
    po.packed = {cu_q_gpu.ptr, cu_k_gpu.ptr, total_q, total_k};
    const TensorStrides q_rows{0, d, pq.row}, k_rows{0, d, pk.row};
    if (c.pad) po.layout = {q_rows, k_rows, k_rows, q_rows, q_rows, q_rows, k_rows, k_rows};
    const int max_q = *std::max_element(c.q_lens.begin(), c.q_lens.end());
    const int max_k = *std::max_element(c.k_lens.begin(), c.k_lens.end());
    const AttentionShape s{B, H, max_q, max_k, d, c.causal, c.kv_heads};
    forward_call(Qg.ptr, Kg.ptr, Vg.ptr, Og.ptr, Lg.ptr, s, po, c.plain());
    backward_call(Qg.ptr, Kg.ptr, Vg.ptr, Og.ptr, dOg.ptr, Lg.ptr, dQg.ptr, dKg.ptr, dVg.ptr, s,
                  po, c.plain());
    const PackedOutputs got{Og.download_float(), Lg.download_float(), dQg.download_float(),
                            dKg.download_float(), dVg.download_float()};
    // The plain cases' backward again with deterministic = false (chapter 3's unordered kernel,
    // padded rows included, where the public call runs chapter 3): its dQ against the reference
    // below, its dK and dV the ordered call's bits (only dQ's adds may lose their order).
    PackedOutputs unordered;
    if (c.plain()) {
        AttentionOptions uo = po;
        uo.deterministic = false;
        dQg.poison(), dKg.poison(), dVg.poison();
        backward_call(Qg.ptr, Kg.ptr, Vg.ptr, Og.ptr, dOg.ptr, Lg.ptr, dQg.ptr, dKg.ptr, dVg.ptr,
                      s, uo, c.plain());
        unordered = {got.O, got.L, dQg.download_float(), dKg.download_float(),
                     dVg.download_float()};
    }
    if (c.pad) {  // The pads (the columns past a row's heads * d): never written, still NaN.
        const auto written_in_pads = [](const std::vector<float>& out, const Packed& p) {
            size_t n = 0;
            for (size_t e = 0; e < out.size(); e++)
                n += e % p.row >= size_t(p.heads) * p.d && !std::isnan(out[e]);
            return n;
        };
        CHECK(written_in_pads(got.O, pq) == 0);
        CHECK(written_in_pads(got.dQ, pq) == 0);
        CHECK(written_in_pads(got.dK, pk) == 0);
        CHECK(written_in_pads(got.dV, pk) == 0);
        if (c.plain()) CHECK(written_in_pads(unordered.dQ, pq) == 0);
    }
    // Each sequence against the same sequence alone (or the rule, where it has no queries or
    // no keys, which no dense call takes).
    for (int b = 0; b < B; b++) {
        const AttentionShape sb = alone(c, b);
        INFO("sequence " << b << ": " << describe(sb));
        Outputs<float> mine;
        mine.O = unpack(got.O, pq, cu_q[b], sb.q_len);
        mine.dQ = unpack(got.dQ, pq, cu_q[b], sb.q_len);
        mine.dK = unpack(got.dK, pk, cu_k[b], sb.kv_len);
        mine.dV = unpack(got.dV, pk, cu_k[b], sb.kv_len);
        for (int h = 0; h < H; h++)  // L: [heads][total_q]
            for (int i = 0; i < sb.q_len; i++)
                mine.L.push_back(got.L[size_t(h) * total_q + cu_q[b] + i]);
        Outputs<float> mine_unordered = mine;
        if (c.plain()) {
            mine_unordered.dQ = unpack(unordered.dQ, pq, cu_q[b], sb.q_len);
            mine_unordered.dK = unpack(unordered.dK, pk, cu_k[b], sb.kv_len);
            mine_unordered.dV = unpack(unordered.dV, pk, cu_k[b], sb.kv_len);
        }
        if (sb.q_len == 0 || sb.kv_len == 0) {
            const auto all_are = [](const std::vector<float>& v, float x) {
                return std::all_of(v.begin(), v.end(), [x](float y) { return y == x; });
            };
            CHECK(all_are(mine.O, 0.f));
            CHECK(all_are(mine.L, -INFINITY));
            CHECK(all_are(mine.dQ, 0.f));
            CHECK(all_are(mine.dK, 0.f));
            CHECK(all_are(mine.dV, 0.f));
            CHECK(all_are(mine_unordered.dQ, 0.f));
            CHECK(all_are(mine_unordered.dK, 0.f));
            CHECK(all_are(mine_unordered.dV, 0.f));
            continue;
        }
        if (c.plain()) {
            INFO("deterministic = false (second) against the ordered call (first)");
            check_bitwise("dK", mine.dK, mine_unordered.dK, sb, kv_layout(sb));
            check_bitwise("dV", mine.dV, mine_unordered.dV, sb, kv_layout(sb));
            CHECK(count_bad(mine_unordered.dQ) == 0);
        }
        GpuAttention<T> g(seq[b]);
        g.O.poison(), g.L.poison();
        g.dQ = DeviceBuffer<T>(q_elems(sb)), g.dK = DeviceBuffer<T>(kv_elems(sb));
        g.dV = DeviceBuffer<T>(kv_elems(sb));
        g.dQ.poison(), g.dK.poison(), g.dV.poison();
        forward_call(g.Q.ptr, g.K.ptr, g.V.ptr, g.O.ptr, g.L.ptr, sb, o, c.plain());
        backward_call(g.Q.ptr, g.K.ptr, g.V.ptr, g.O.ptr, g.dO.ptr, g.L.ptr, g.dQ.ptr, g.dK.ptr,
                      g.dV.ptr, sb, o, c.plain());
        {
            INFO("the sequence in the packed batch (second) against the sequence alone (first)");
            check_bitwise(g.outputs(true), mine, sb);
        }
        // The reference (test_util's, without GQA: chapter 2's GQA has its own tests).
        if (c.plain() && c.kv_heads == c.heads) {
            check_against_reference_backward(mine, seq[b]);
            INFO("deterministic = false");
            check_against_reference_backward(mine_unordered, seq[b]);
        }
    }
}

std::vector<VarlenCase> varlen_cases() {
    return {
        {"ragged, causal, GQA, an empty sequence and a one-row one",
         {200, 1, 64, 0, 129, 300}, {200, 1, 64, 0, 129, 300}, 4, 2, 64, true},
        {"queries and keys of other lengths, a sequence without keys, one without queries",
         {5, 100, 37, 0}, {300, 60, 0, 50}, 2, 2, 128, true},
        {"no mask, padded rows (given strides), d 256", {70, 190}, {90, 33}, 2, 2, 256, false,
         0, -1, false, true},
        {"a window with softcap and ALiBi (chapter 2's policy), d 32", {150, 77, 260},
         {150, 90, 260}, 2, 2, 32, true, 30.f, 40, true},
        {"ALiBi alone, causal, GQA (chapter 3's key term on the tensor cores)", {130, 64, 300},
         {200, 64, 300}, 4, 2, 128, true, 0, -1, true},
        // Scores of about N(0, 16^2): a row's max often grows by 2^8 from one K/V tile to the
        // next. Sequence 1's first Q tile (at d = 256, 128 rows, the last ending on its last row)
        // starts 126 rows before it, in sequence 0's rows, whose growth must not move sequence
        // 1's (chapter 3's lazy rescale, hopper_lazy: a warp's 16 rows decide together, and rows
        // -14 .. 1 share one).
        {"scores whose max grows along the row, d 256", {70, 130}, {150, 150}, 2, 2, 256, false,
         0, -1, false, false, 1.f},
    };
}

}  // namespace

TEMPLATE_TEST_CASE("Each sequence of a packed batch gets the bits it gets alone, forward and "
                   "backward, and the reference's values",
                   "[gpu][fp16][bf16][varlen][forward][backward]", fp16, bf16) {
    const VarlenCase c = GENERATE(from_range(varlen_cases()));
    check_varlen_case<TestType>(c, 701);
}

TEST_CASE("A packed batch's bad fields are refused before anything runs, naming the field",
          "[cpu][varlen][validation]") {
    FakeTensors<__half> t;
    const AttentionShape s{2, 3, 5, 7, 64, true};
    alignas(16) static const int cu[3] = {0, 2, 5};  // never read: refused first
    struct Bad {
        const char* names;
        PackedBatch p;
    };
    const Bad bad[] = {{"cu_seqlens_k", {cu, nullptr, 5, 7}},
                       {"cu_seqlens_q", {nullptr, cu, 5, 7}},
                       {"total_q", {nullptr, nullptr, 5, 0}},
                       {"total_q", {cu, cu, 0, 7}},
                       {"total_k", {cu, cu, 5, -1}}};
    for (const Bad& b : bad) {
        INFO("options.packed." << b.names);
        AttentionOptions o;
        o.packed = b.p;
        CHECK_THAT(forward_refusal(t, s, o), Catch::Contains(b.names));
        CHECK_THAT(backward_refusal(t, s, o), Catch::Contains(b.names));
    }
    CHECK(t.outputs_untouched());
}

TEST_CASE("Bad cu_seqlens are refused with the entry named and the outputs untouched",
          "[gpu][varlen][validation]") {
    const AttentionShape s{3, 2, 6, 6, 64, true};  // three sequences, the longest 6 rows
    const Problem<__half> p = rounded_problem<__half>({1, 2, 12, 12, 64, true}, 702);
    const DeviceBuffer<__half> Q(p.Q), K(p.K), V(p.V), dO(p.dO);
    DeviceBuffer<__half> O(Q.count), dQ(Q.count), dK(K.count), dV(K.count);
    DeviceBuffer<float> L(2 * 12);
    for (auto* out : {&O, &dQ, &dK, &dV}) out->poison();
    L.poison();
    struct Bad {
        std::vector<int> cu;
        const char* names;
    };
    const Bad bad[] = {{{1, 4, 8, 12}, "cu_seqlens_q[0] = 1"},
                       {{0, 6, 4, 12}, "cu_seqlens_q[2] = 4"},
                       {{0, 4, 8, 11}, "cu_seqlens_q[3] = 11"},
                       {{0, 2, 3, 12}, "sequence 2 has 9 rows"}};
    const DeviceBuffer<int> good(std::vector<int>{0, 4, 8, 12});
    for (const Bad& b : bad) {
        INFO("cu_seqlens_q " << b.names);
        const DeviceBuffer<int> cu(b.cu);
        AttentionOptions o;
        o.packed = {cu.ptr, good.ptr, 12, 12};
        CHECK_THAT(refusal([&] { flash_forward_fp16(Q.ptr, K.ptr, V.ptr, O.ptr, L.ptr, s, o); }),
                   Catch::Contains(b.names));
        CHECK_THAT(refusal([&] {
                       flash_backward_fp16(Q.ptr, K.ptr, V.ptr, O.ptr, dO.ptr, L.ptr, dQ.ptr,
                                           dK.ptr, dV.ptr, s, o);
                   }),
                   Catch::Contains(b.names));
    }
    {
        const std::vector<int> host{0, 4, 8, 12};  // host memory: refused
        AttentionOptions o;
        o.packed = {good.ptr, host.data(), 12, 12};
        CHECK_THAT(refusal([&] { flash_forward_fp16(Q.ptr, K.ptr, V.ptr, O.ptr, L.ptr, s, o); }),
                   Catch::Contains("cu_seqlens_k is host memory"));
    }
    for (auto* out : {&O, &dQ, &dK, &dV}) CHECK(count_bad(out->download_float()) == out->count);
    CHECK(count_bad(L.download_float()) == L.count);
}
