// test_decode.cpp: chapter 4's split-KV decode (flash_decode.cu) against the CPU reference. Tags:
// [decode], with [cpu] (the split rule, the scratch's size, the refusals: no GPU needed) or [gpu].
//
// The reference is multi-head (one K/V head a query head): each test repeats the K/V heads on the
// host to heads (query head h reads K/V head h / (heads / kv_heads)) and runs it on that. The
// tolerances are chapter 2's (tolerances16, derived in test_util.h), which bound a kernel that
// rounds P~ to fp16 / bf16 before P~ V; the decode kernel keeps S, P~ and O in fp32 and rounds O
// once, and its merge of the splits adds a few fp32 roundings per split (a relative 2^-24 each,
// far below u16 = 2^-11): its error is within that derivation, with room to spare.
#include "test_util.h"

#include <algorithm>
#include <climits>
#include <functional>
#include <string>
#include <vector>

namespace {

// The element type's decode calls: splits 0 for the call without _splits (the device's choice).
template <typename T>
void decode_call(const T* Q, const T* K, const T* V, T* O, float* L, const AttentionShape& s,
                 int splits) {
    if constexpr (std::is_same<T, __half>::value) {
        if (splits == 0) flash_decode_fp16(Q, K, V, O, L, s);
        else flash_decode_fp16_splits(Q, K, V, O, L, s, splits);
    } else {
        if (splits == 0) flash_decode_bf16(Q, K, V, O, L, s);
        else flash_decode_bf16_splits(Q, K, V, O, L, s, splits);
    }
}
template <typename T>
const char* decode_api(bool with_splits) {
    return std::is_same<T, __half>::value
               ? (with_splits ? "flash_decode_fp16_splits" : "flash_decode_fp16")
               : (with_splits ? "flash_decode_bf16_splits" : "flash_decode_bf16");
}

// The problem with its K/V heads repeated to heads: the multi-head problem the reference runs.
template <typename T>
Problem<T> repeated_kv(const Problem<T>& p) {
    const AttentionShape& s = p.s;
    const int kvh = flash_kv_heads(s), group = s.heads / kvh;
    Problem<T> mha{s, p.Q, {}, {}, p.dO};
    mha.s.kv_heads = 0;
    const size_t head = size_t(s.kv_len) * s.head_dim;
    for (const auto& pair : {std::make_pair(&p.K, &mha.K), std::make_pair(&p.V, &mha.V)}) {
        pair.second->reserve(kv_elems(mha.s));
        for (int b = 0; b < s.batch; ++b)
            for (int h = 0; h < s.heads; ++h) {
                const auto first = pair.first->begin() + (size_t(b) * kvh + h / group) * head;
                pair.second->insert(pair.second->end(), first, first + head);
            }
    }
    return mha;
}

// One decode call on the GPU: O and L poisoned with NaN first, waited for with the deadline.
template <typename T>
Outputs<float> run_decode(GpuAttention<T>& gpu, int splits) {
    gpu.O.poison();
    gpu.L.poison();
    const DeadlineGuard guard(gpu_call<T>("forward", Kernel::public_call(), gpu.s));
    decode_call(gpu.Q.ptr, gpu.K.ptr, gpu.V.ptr, gpu.O.ptr, gpu.L.ptr, gpu.s, splits);
    FLASH_CUDA_CHECK(cudaGetLastError());
    wait_for_gpu(0, gpu_call<T>("forward", Kernel::public_call(), gpu.s));
    return gpu.outputs(false);
}

// The decode of a random problem of shape s against the reference (every element written: the
// NaN poison; L = -inf exactly where a row sees no key).
template <typename T>
Outputs<float> check_decode(const AttentionShape& s, uint32_t salt, int splits) {
    INFO(describe(s) << ", kv_heads = " << flash_kv_heads(s) << ", " << type_name<T>() << " "
                     << decode_api<T>(splits != 0) << (splits ? ", splits = " : "")
                     << (splits ? std::to_string(splits) : std::string()));
    const auto p = rounded_problem<T>(s, salt, false);
    GpuAttention<T> gpu(p);
    const Outputs<float> got = run_decode(gpu, splits);
    check_against_reference(got, repeated_kv(p));
    return got;
}

AttentionShape decode_shape(int batch, int heads, int kv_heads, int q_len, int kv_len, int d,
                            bool causal) {
    AttentionShape s{batch, heads, q_len, kv_len, d, causal};
    s.kv_heads = kv_heads;
    return s;
}

// (heads, kv_heads): no grouping (3 over 3), groups of 4 (8 over 2) and 8 (16 over 2: 8 * q_len
// rows, up to 64, so the rows take several blocks), and MQA (8 over 1).
const std::vector<std::pair<int, int>> kGroups = {{3, 3}, {8, 2}, {16, 2}, {8, 1}};

// q_len 1..8 (odd and even, the bound), kv_len from 1 past the tile edges (64 keys a tile at
// d <= 128) to 4099, causal and not, every group, d = 128; batch 2 up to 1000 keys. The
// default run (make test) takes q_len 1 and 8 at kv_len 65 (a partial second tile) and 1000
// (several splits) for every group, causal and not (at q_len 1 not only: one row aligned at the
// end sees every key either way, the same call), and kv_len 1 (q_len 8, causal: rows that see
// no key) and 4099 (q_len 8, causal, 8 over 2); `make stress` the rest (stress = true).
std::vector<AttentionShape> decode_grid(bool stress) {
    std::vector<AttentionShape> shapes;
    for (int q_len : {1, 2, 3, 5, 8})
        for (int kv_len : {1, 5, 63, 64, 65, 1000, 4099})
            for (const auto& g : kGroups)
                for (bool causal : {false, true}) {
                    const bool short_kv = (kv_len == 1 && q_len == 8 && causal) || kv_len == 65 ||
                                          kv_len == 1000;
                    const bool long_kv = kv_len == 4099 && q_len == 8 && causal && g.first == 8;
                    const bool in_default = (q_len == 1 || q_len == 8) &&
                                            (short_kv || long_kv) && !(q_len == 1 && causal);
                    if (in_default == stress) continue;
                    shapes.push_back(decode_shape(kv_len <= 1000 ? 2 : 1, g.first, g.second,
                                                  q_len, kv_len, 128, causal));
                }
    return shapes;
}
// The other head dims (64; 256, whose tile is 32 keys), fewer lengths. The default run takes
// q_len 1 and 8 at kv_len 33 and 65 (one tile and a partial second at d = 64, two and a partial
// third at d = 256) and kv_len 1000 at q_len 4 at d = 256; `make stress` the rest.
std::vector<AttentionShape> decode_head_dim_grid(bool stress) {
    std::vector<AttentionShape> shapes;
    for (int d : {64, 256})
        for (int q_len : {1, 4, 8})
            for (int kv_len : {1, 31, 33, 65, 1000}) {
                const bool in_default = (kv_len == 33 || kv_len == 65) && q_len != 4;
                if ((in_default || (d == 256 && kv_len == 1000 && q_len == 4)) == stress) continue;
                for (const auto& g : {std::make_pair(8, 2), std::make_pair(8, 1)})
                    for (bool causal : {false, true})
                        shapes.push_back(decode_shape(2, g.first, g.second, q_len, kv_len, d,
                                                      causal));
            }
    return shapes;
}
// Past 100k keys: one batch, 4 query heads over 1 K/V head (MQA) and 8 over 2, q_len 1 and 8,
// causal and not (stress = true: `make stress`). The reference's work is heads * q_len * kv_len
// * d, but generating 100003 keys of K and V and repeating them to every query head, in double,
// costs seconds a shape: the default run takes one shape of fewer heads, 2 over 1 (MQA, q_len 8,
// causal: several rows a block, the mask's edge in the last split).
std::vector<AttentionShape> long_decode_shapes(bool stress) {
    if (!stress) return {decode_shape(1, 2, 1, 8, 100003, 128, true)};
    std::vector<AttentionShape> shapes;
    for (int q_len : {1, 8})
        for (bool causal : {false, true})
            for (const auto& g : {std::make_pair(4, 1), std::make_pair(8, 2)})
                shapes.push_back(decode_shape(1, g.first, g.second, q_len, 100003, 128, causal));
    return shapes;
}

}  // namespace

// =============================================================================================
// CPU: the split rule, the scratch, the refusals.

TEST_CASE("The decode's split rule fills the GPU with whole tiles, never fewer than 4 a split",
          "[cpu][decode]") {
    for (const cudaDeviceProp& prop : known_gpus()) {
        if (prop.major < 8) continue;
        for (int d : kFlashDecodeHeadDims)
            for (int kv_len : {1, 63, 64, 65, 4096, 8192, 32768, 131072, 100003})
                for (int batch : {1, 8, 32})
                    for (int q_len : {1, 8}) {
                        const AttentionShape s = decode_shape(batch, 32, 8, q_len, kv_len, d, false);
                        INFO(prop.name << ", " << describe(s) << ", kv_heads 8");
                        const int splits = flash_decode_choose_splits(prop, s);
                        const int Bc = d <= 128 ? 64 : 32;
                        const int tiles = (kv_len + Bc - 1) / Bc;
                        const int per_split = (tiles + splits - 1) / splits;
                        CHECK(splits >= 1);
                        CHECK(splits <= std::max(1, tiles / 4));         // >= 4 tiles a split
                        CHECK((splits - 1) * per_split < tiles);         // no split left empty
                        const long long blocks = (long long)splits * batch * 8 *
                                                 ((32 / 8 * q_len + 7) / 8);
                        // A wave of blocks at least, unless the 4-tile minimum stopped the
                        // splits (evening out the tiles a split can halve them, no more).
                        CHECK((blocks >= prop.multiProcessorCount ||
                               2 * splits >= std::max(1, tiles / 4)));
                    }
    }
}

TEST_CASE("The decode's scratch is splits * batch * heads * q_len * (head_dim + 1) floats and "
          "a counter for each run of 8 rows of a K/V group",
          "[cpu][decode]") {
    // 3 batches x 2 K/V heads, each group 4 heads x 5 rows = 20 rows: 3 runs of 8.
    const AttentionShape s = decode_shape(3, 8, 2, 5, 1000, 128, true);
    const size_t counters = 8 + size_t(3) * 2 * 3 * 8;
    CHECK(flash_decode_scratch_bytes(s, 1) == size_t(3) * 8 * 5 * 129 * 4 + counters);
    CHECK(flash_decode_scratch_bytes(s, 7) == size_t(7) * 3 * 8 * 5 * 129 * 4 + counters);
    CHECK_THAT(refusal([&] { flash_decode_scratch_bytes(s, 0); }), NamesWord("splits"));
    CHECK_THAT(refusal([&] { flash_decode_scratch_bytes(s, 1 << 24); }), NamesWord("splits"));
}

TEMPLATE_TEST_CASE("The decode refuses bad input, naming the field, outputs untouched",
                   "[cpu][decode][fp16][bf16]", fp16, bf16) {
    // Every refusal here comes from the shape or splits checks, before any CUDA call: no GPU needed.
    FakeTensors<TestType> t;
    const AttentionShape good = decode_shape(1, 8, 2, 1, 7, 128, false);
    struct Bad {
        AttentionShape s;
        int splits;
        const char* field;
    };
    const std::vector<Bad> bad = {
        {good, -1, "splits"},
        {good, INT_MIN, "splits"},
        {decode_shape(1, 8, 3, 1, 7, 128, false), 1, "kv_heads"},   // 3 does not divide 8
        {decode_shape(1, 8, 16, 1, 7, 128, false), 1, "kv_heads"},  // more K/V heads than heads
        {decode_shape(1, 8, -2, 1, 7, 128, false), 1, "kv_heads"},
        {decode_shape(1, 8, 2, kFlashDecodeMaxQLen + 1, 7, 128, false), 1, "q_len"},
        {decode_shape(1, 8, 2, 0, 7, 128, false), 1, "q_len"},
        {decode_shape(1, 8, 2, 1, 0, 128, false), 1, "kv_len"},
        {decode_shape(1, 8, 2, 1, 7, 96, false), 1, "head_dim"},
    };
    for (const Bad& b : bad)
        for (bool with_splits : {true, false}) {
            if (!with_splits && std::string(b.field) == "splits") continue;
            INFO(decode_api<TestType>(with_splits) << " on " << describe(b.s) << ", kv_heads = "
                                                   << b.s.kv_heads << ", splits = " << b.splits);
            // splits 0 is the call without _splits; the _splits call is given b.splits (or 0).
            const int splits = with_splits ? b.splits : 0;
            const std::string msg =
                refusal([&] { decode_call(t.Q, t.K, t.V, t.O, t.L, b.s, splits); });
            CHECK_THAT(msg, NamesWord(b.field));
            CHECK(t.outputs_untouched());
        }
    // splits = 0 given to the _splits call itself
    const std::string msg = refusal([&] {
        if constexpr (std::is_same<TestType, __half>::value)
            flash_decode_fp16_splits(t.Q, t.K, t.V, t.O, t.L, good, 0);
        else
            flash_decode_bf16_splits(t.Q, t.K, t.V, t.O, t.L, good, 0);
    });
    CHECK_THAT(msg, NamesWord("splits"));
    CHECK(t.outputs_untouched());
}

// =============================================================================================
// GPU: the decode against the reference.

TEMPLATE_TEST_CASE("The decode matches the reference over q_len 1..8, kv_len 1..4099, every group",
                   "[gpu][decode][fp16][bf16]", fp16, bf16) {
    const AttentionShape s =
        GENERATE(from_range(share_for<TestType>(decode_grid(false), {}, Share::fast)));
    check_decode<TestType>(s, 4000, 0);
}
TEMPLATE_TEST_CASE("The decode matches the reference over the rest of the grid",
                   "[gpu][decode][fp16][bf16][.stress]", fp16, bf16) {
    // The rest of the grid above (the same inputs: the same salt), bf16's four fifths of the
    // default share first (share_for).
    const auto shapes = share_for<TestType>(decode_grid(false), decode_grid(true), Share::stress);
    const AttentionShape s = GENERATE_COPY(from_range(shapes));
    check_decode<TestType>(s, 4000, 0);
}

TEMPLATE_TEST_CASE("The decode matches the reference at head dims 64 and 256",
                   "[gpu][decode][fp16][bf16]", fp16, bf16) {
    const AttentionShape s =
        GENERATE(from_range(share_for<TestType>(decode_head_dim_grid(false), {}, Share::fast)));
    check_decode<TestType>(s, 4100, 0);
}
TEMPLATE_TEST_CASE("The decode matches the reference at head dims 64 and 256, the rest of the grid",
                   "[gpu][decode][fp16][bf16][.stress]", fp16, bf16) {
    // The rest of the grid above (the same salt), bf16's four fifths of the default share first.
    const auto shapes = share_for<TestType>(decode_head_dim_grid(false),
                                            decode_head_dim_grid(true), Share::stress);
    const AttentionShape s = GENERATE_COPY(from_range(shapes));
    check_decode<TestType>(s, 4100, 0);
}

TEMPLATE_TEST_CASE("The decode matches the reference beyond 100k keys",
                   "[gpu][decode][long][fp16][bf16][.stress]", fp16, bf16) {
    const AttentionShape s = GENERATE(from_range(long_decode_shapes(false)));
    check_decode<TestType>(s, 4200, 0);
}
TEMPLATE_TEST_CASE("The decode matches the reference beyond 100k keys, every group, q_len and mask",
                   "[gpu][decode][long][fp16][bf16][.stress]", fp16, bf16) {
    // The shapes this test had before the default run took the short one above (the same salt).
    const AttentionShape s = GENERATE(from_range(long_decode_shapes(true)));
    check_decode<TestType>(s, 4200, 0);
}

namespace {
// The split-count test's cases: (kv_len, head dim, its tiles) by (q_len, causal). The default run
// takes kv_len 65, 333 (at d = 128), 33 (d = 256) and 5 (d = 64) at q_len 1 without the mask and
// 3 and 8 with it; make stress the rest, and kv_len 1 and the 35-tile cases.
struct SplitCase {
    int kv_len, d, tiles, q_len;
    bool causal;
};
std::vector<SplitCase> split_cases(Share share) {
    const SplitCase kv[] = {{1, 128, 1, 0, false},     {65, 128, 2, 0, false},
                            {333, 128, 6, 0, false},   {33, 256, 2, 0, false},
                            {5, 64, 1, 0, false},      {2200, 128, 35, 0, false},
                            {1100, 256, 35, 0, false}};
    std::vector<SplitCase> cases;
    for (SplitCase c : kv)
        for (int q_len : {1, 3, 8})
            for (bool causal : {false, true}) {
                const bool fast = c.kv_len != 1 && c.tiles < 32 && causal == (q_len != 1);
                if (fast != (share == Share::fast)) continue;
                c.q_len = q_len;
                c.causal = causal;
                cases.push_back(c);
            }
    return cases;
}
template <typename T>
void check_every_split_count(const SplitCase& c) {
    const AttentionShape s = decode_shape(2, 8, 2, c.q_len, c.kv_len, c.d, c.causal);
    for (int splits = 1; splits <= c.tiles + 3; ++splits)
        if (c.tiles < 32 || splits == 17 || splits == 33 || splits == c.tiles + 3)
            check_decode<T>(s, 4300, splits);
}
}  // namespace

TEMPLATE_TEST_CASE("The decode is right for every split count, splits that see no key or one",
                   "[gpu][decode][splits][fp16][bf16]", fp16, bf16) {
    // Tiles of 64 keys (32 at d = 256): kv_len 65 has 2 tiles, the second with one key; 333 has
    // 6; 1 has 1. Every count from 1 to 3 past the tiles: the splits past the last key see none
    // (L_s = -inf, adding nothing), and with q_len > kv_len under the causal mask some rows see
    // no key in any split (O = 0, L = -inf). Groups of 4 with q_len 3: 12 rows, two blocks.
    // kv_len 2200 (35 tiles) and, at d = 256, 1100 (35): counts that end inside the merge's
    // batches of 8 splits (merge_row loads 8 splits' O_s at once) past the first 32 L_s a warp
    // reads a lane each: 17, 33 and 38 only (every count there would take minutes).
    const SplitCase c = GENERATE(from_range(split_cases(Share::fast)));
    check_every_split_count<TestType>(c);
}
TEMPLATE_TEST_CASE("The decode is right for every split count, the rest (make stress)",
                   "[gpu][decode][fp16][bf16][splits][.stress]", fp16, bf16) {
    const SplitCase c = GENERATE(from_range(split_cases(Share::stress)));
    check_every_split_count<TestType>(c);
}

// The decode's share of `make sanitize` (compute-sanitizer slows kernels 10-100x): three small
// shapes that still cover what its two kernels do: the 4-row and the 8-row split kernel, rows
// in several blocks, a partial last tile, a split that sees no key, every head dim, the causal
// mask, the device's split count and a caller's.
TEMPLATE_TEST_CASE("Small shapes for the sanitizer: the decode matches the reference",
                   "[gpu][.sanitize][decode][fp16][bf16]", fp16, bf16) {
    struct Case {
        AttentionShape s;
        int splits;  // 0: the device's choice
    };
    const Case c = GENERATE(Case{decode_shape(1, 8, 2, 1, 300, 128, false), 0},  // 4 rows
                            // MQA, 24 rows (3 blocks of 8), 6 tiles over 7 splits: one empty
                            Case{decode_shape(2, 8, 1, 3, 333, 64, true), 7},
                            Case{decode_shape(1, 4, 2, 5, 100, 256, true), 2});  // 10 rows
    check_decode<TestType>(c.s, 4500, c.splits);
}

namespace {
// The device's split count and a caller's many, with a long kv_len: the merge's order is fixed.
template <typename T>
void check_decode_calls_agree(int kv_len) {
    const AttentionShape s = decode_shape(2, 8, 2, 3, kv_len, 128, true);
    const int splits = GENERATE(0, 1, 50);
    INFO(describe(s) << ", splits = " << splits);
    const auto p = rounded_problem<T>(s, 4400, false);
    GpuAttention<T> gpu(p);
    const Outputs<float> first = run_decode(gpu, splits);
    for (int call = 2; call <= 4; ++call) {
        const Outputs<float> again = run_decode(gpu, splits);
        if (bitwise_equal(first, again)) continue;
        INFO("call " << call << " differs from call 1");
        check_bitwise(first, again, s);
        FAIL("results changed between identical calls");
    }
}
}  // namespace

TEMPLATE_TEST_CASE("The decode gives bitwise identical O and L on every call",
                   "[gpu][decode][determinism][fp16][bf16]", fp16, bf16) {
    check_decode_calls_agree<TestType>(4099);
}
TEMPLATE_TEST_CASE("The decode gives bitwise identical O and L on every call, at 20011 keys (make "
                   "stress)",
                   "[gpu][decode][determinism][fp16][bf16][.stress]", fp16, bf16) {
    check_decode_calls_agree<TestType>(20011);
}

TEMPLATE_TEST_CASE("The decode without _splits runs flash_decode_choose_splits' count, and "
                   "flash_forward_fp16 / _bf16 run the decode for q_len <= 8",
                   "[gpu][decode][dispatch][fp16][bf16]", fp16, bf16) {
    // Bitwise: each result against the call it should be (all deterministic; another split count
    // differs in the last bits, as the last check shows the test can tell). (chosen + 1 might
    // not: with whole tiles a split, it can give the same splits plus one that sees no key.)
    const AttentionShape s = decode_shape(1, 4, 0, GENERATE(1, 8), 9001, 128, false);
    const int chosen = flash_decode_choose_splits(current_device_props(), s);
    INFO(describe(s) << ", chosen splits = " << chosen);
    const auto p = rounded_problem<TestType>(s, 4500, false);
    GpuAttention<TestType> gpu(p);
    const Outputs<float> automatic = run_decode(gpu, 0);
    check_bitwise(automatic, run_decode(gpu, chosen), s);
    gpu.forward(Kernel::public_call());  // flash_forward_fp16 / _bf16 (kv_heads = heads)
    check_bitwise(automatic, gpu.outputs(false), s);
    REQUIRE(chosen > 1);
    CHECK_FALSE(bitwise_equal(automatic, run_decode(gpu, 1)));
}
