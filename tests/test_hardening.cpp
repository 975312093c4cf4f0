// test_hardening.cpp: the tests that make the kernels trustworthy beyond the classroom grids
// (Catch2 v2; the classroom core is test_flash.cpp, the helpers test_util.h).
//
//   [validation]   bad arguments are refused with std::invalid_argument naming what is wrong,
//                  before any CUDA call (so the [cpu] ones need no GPU), and outputs stay untouched
//   [determinism]  identical calls give bitwise identical results, on any stream, 100 times over;
//                  dQ's adds in their fixed order (shares that cancel exactly leave no trace)
//   [tile]         flash_forward_bc: a caller-chosen Bc that does not divide the length, or does
//                  not fit in shared memory
//   [hardening]    extreme inputs: huge, tiny, equal and one-hot scores
//   [big]          more than 65535 batch*heads, and tensors of more than 2^31 elements (8.6 GB
//                  each, 4.3 GB in fp16 or bf16: skipped, with a warning, where the GPU has too
//                  little memory)
//   [fp32], [fp16], [bf16]  a test whose body is the same in every element type is one
//                  TEMPLATE_TEST_CASE over (fp32, fp16, bf16): chapter 1's calls in fp32, chapter
//                  2's (and on compute capability 9.0 the public forward's chapter 3) in fp16 and
//                  bf16; tests of one chapter's own calls (its tile chooser, its Bc, its pool)
//                  stay its own
//   [.stress]      hidden: the long runs (100 calls of the backward on grids of many more blocks
//                  than the GPU holds, chapter 3's persistent grid over 20 calls and in many
//                  rounds, tensors of more than 2^31 elements); `make stress` runs them, and a
//                  short version of each but the last stays in the default run
//   [.timing]      hidden: how long the CPU reference takes over the GPU grids
// They are built into the same binary, test_flash. Examples: ./test_flash "[validation]"
//   ./test_flash "[gpu]~[big]"     ./test_flash "[big]"     ./test_flash "[stress]"
//   ./test_flash "[.timing]"       ./test_flash "[fp16][cpu]"  (without a GPU)
//   ./test_flash "[determinism]"   ./test_flash "* - bf16"  (the bf16 runs, by name)

#include "test_util.h"

#include <chrono>
#include <climits>
#include <cmath>
#include <iostream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

using Catch::Matchers::Contains;

// "16, 32, 64, 96, 128, 256": kFlashFp16HeadDims as the refusals list them.
static std::string fp16_head_dims_string() {
    std::string list;
    for (int d : kFlashFp16HeadDims) list += (list.empty() ? "" : ", ") + std::to_string(d);
    return list;
}

// A CUDA stream for the length of a scope.
struct ScopedStream {
    cudaStream_t stream = nullptr;
    explicit ScopedStream(unsigned flags) {
        FLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, flags));
    }
    ~ScopedStream() { cudaStreamDestroy(stream); }
    ScopedStream(const ScopedStream&) = delete;
    ScopedStream& operator=(const ScopedStream&) = delete;
};

// =============================================================================================
// CPU: head dims the tile chooser and the kernels refuse

TEST_CASE("The tile chooser refuses head dims without a kernel", "[cpu][tile][validation]") {
    const cudaDeviceProp prop = known_gpus().back();
    const int d = GENERATE(0, -64, 8, 48, 100, 512);
    CAPTURE(d);
    CHECK_THROWS_AS(flash_choose_tile(prop, d), std::invalid_argument);
    CHECK_THROWS_AS(flash_choose_tile_backward(prop, d), std::invalid_argument);
}

TEST_CASE("The fp16 tile chooser refuses head dims without a kernel, listing the supported ones",
          "[cpu][tile][validation][fp16]") {
    const int d = GENERATE(0, -64, 8, 48, 100, 512);
    CAPTURE(d);
    for (const cudaDeviceProp& prop : known_gpus()) {  // the T4 too: the head dim is checked first
        INFO(prop.name);
        const std::string msg = refusal([&] { flash_choose_tile_fp16(prop, d); });
        CHECK_THAT(msg, NamesWord("head_dim") && Contains(fp16_head_dims_string()));
    }
}

TEST_CASE("The fp16 backward tile chooser refuses head dims without a kernel, listing the "
          "supported ones", "[cpu][tile][validation][fp16][backward]") {
    // The forward's six, 256 included.
    REQUIRE(fp16_head_dims_string() == "16, 32, 64, 96, 128, 256");
    const int d = GENERATE(0, -64, 8, 48, 100, 512, 24, 257);
    CAPTURE(d);
    for (const cudaDeviceProp& prop : known_gpus()) {  // the T4 too: the head dim is checked first
        INFO(prop.name);
        const std::string msg = refusal([&] { flash_choose_tile_fp16_backward(prop, d); });
        INFO("message: " << msg);
        CHECK_THAT(msg, NamesWord("head_dim") && Contains(fp16_head_dims_string()));
    }
}

TEST_CASE("The supported head dims are 16, 32, 64, 96, 128 and 256", "[cpu][validation]") {
    CHECK(flash_head_dims_string() == "16, 32, 64, 96, 128, 256");
    for (int d : kFlashHeadDims) CHECK(flash_head_dim_supported(d));
    for (int d : {0, -16, 8, 17, 48, 65, 192, 512}) {
        CAPTURE(d);
        CHECK_FALSE(flash_head_dim_supported(d));
    }
}

// =============================================================================================
// CPU: argument validation. It happens before any CUDA call, so these run without a GPU; the
// tensors are fake host arrays, never read.

// The calls a validation test of element type T makes: forward_calls with the Bc values each
// type's test has always passed (fp32's flash_forward_bc: 16; flash_forward_fp16_bc: 32 and 64;
// bf16 has no such call). The shape and pointers are checked before the Bc.
template <typename T>
static std::vector<Kernel> forward_calls_checked() {
    return forward_calls<T>(per_type<T>(std::vector<int>{16}, std::vector<int>{32, 64}));
}

TEMPLATE_TEST_CASE("Shape fields that are zero or negative are refused, naming the field",
                   "[cpu][validation][fp32][fp16][bf16]", fp32, fp16, bf16) {
    const int field = GENERATE(range(0, 5));
    const int value = GENERATE(0, -1, INT_MIN);
    const char* names[] = {"batch", "heads", "q_len", "kv_len", "head_dim"};
    AttentionShape s = valid_shape();
    int* fields[] = {&s.batch, &s.heads, &s.q_len, &s.kv_len, &s.head_dim};
    *fields[field] = value;
    INFO(names[field] << " = " << value);
    FakeTensors<TestType> t;
    const NamesWord names_field(names[field]);
    CHECK_THAT(refusal([&] { validate_shape(s); }), names_field);
    for (const Kernel& call : forward_calls_checked<TestType>()) {
        INFO(forward_api<TestType>() << ", " << call.name());
        CHECK_THAT(refusal([&] { launch_forward(t.Q, t.K, t.V, t.O, t.L, s, call); }), names_field);
    }
    CHECK_THAT(refusal([&] {
                   launch_backward(t.Q, t.K, t.V, t.O, t.dO, t.L, t.dQ, t.dK, t.dV, s);
               }),
               names_field);
    if constexpr (std::is_same<TestType, float>::value)  // the reference (float and double only)
        CHECK_THAT(refusal([&] { attention_reference(t.Q, t.K, t.V, t.O, t.L, s); }), names_field);
    CHECK(t.outputs_untouched());
}

// A shape whose tensors overflow size_t, and the length the overflowing tensor runs along.
struct Overflow {
    const char* what;
    AttentionShape s;
    const char* field;
};

// The cases for elements of `bytes` bytes (4: fp32; 2: fp16 and bf16). The last differs: 2^62
// 4-byte elements are 2^64 bytes, which overflow, but 2^62 2-byte elements (2^63 bytes) fit, so
// the 2-byte case takes 2^63 of them.
static std::vector<Overflow> overflows(size_t bytes) {
    std::vector<Overflow> cases = {
        {"Q: every field huge", {INT_MAX, INT_MAX, INT_MAX, 1, 64, false}, "q_len"},
        // 2^20 * 2^20 * 1 * 64 = 2^46 fits for Q; 2^20 * 2^20 * 2^30 * 64 does not for K, V
        {"K, V only", {1 << 20, 1 << 20, 1, 1 << 30, 64, false}, "kv_len"},
        // (2^31 - 1)^2 * 4 fits in 64 bits; times head_dim 16 it does not
        {"Q: only the last product", {INT_MAX, INT_MAX, 4, 1, 16, false}, "q_len"},
        // 2^30 * 2^30 * 16 = 2^64 wraps to exactly 0
        {"Q, K, V: wraps to 0", {1 << 30, 1 << 30, 1, 1, 16, true}, "q_len"}};
    if (bytes == 4)  // 2^29 * 2^29 * 16 = 2^62 elements fit, but not their 2^64 bytes
        cases.push_back({"Q, K, V: the byte count only", {1 << 29, 1 << 29, 1, 1, 16, false}, "q_len"});
    else  // 2^30 * 2^29 * 16 = 2^63 elements fit, but not their 2^64 bytes
        cases.push_back({"Q, K, V: the 2-byte count only", {1 << 30, 1 << 29, 1, 1, 16, false}, "q_len"});
    return cases;
}

TEMPLATE_TEST_CASE("Shapes whose tensors overflow size_t are refused",
                   "[cpu][validation][fp32][fp16][bf16]", fp32, fp16, bf16) {
    const Overflow c = GENERATE(from_range(overflows(sizeof(TestType))));
    INFO(c.what << ": " << describe(c.s));
    FakeTensors<TestType> t;
    if constexpr (std::is_same<TestType, float>::value) {  // 4-byte elements: validate_shape's own
        const std::string msg = refusal([&] { validate_shape(c.s); });
        INFO("message: " << msg);
        CHECK_THAT(msg, NamesWord(c.field));
    }
    for (const Kernel& call : forward_calls_checked<TestType>()) {
        INFO(forward_api<TestType>() << ", " << call.name());
        const std::string msg =
            refusal([&] { launch_forward(t.Q, t.K, t.V, t.O, t.L, c.s, call); });
        INFO("message: " << msg);
        CHECK_THAT(msg, NamesWord(c.field));
    }
    const std::string msg = refusal([&] {
        launch_backward(t.Q, t.K, t.V, t.O, t.dO, t.L, t.dQ, t.dK, t.dV, c.s);
    });
    INFO("backward's message: " << msg);
    CHECK_THAT(msg, NamesWord(c.field));
    CHECK(t.outputs_untouched());
}

TEMPLATE_TEST_CASE("Null pointers given to the forward are refused, naming the argument and the "
                   "call", "[cpu][validation][fp32][fp16][bf16]", fp32, fp16, bf16) {
    const AttentionShape s = valid_shape();
    const int which = GENERATE(range(0, 5));
    const Kernel call = GENERATE(from_range(forward_calls_checked<TestType>()));
    FakeTensors<TestType> t;
    const TestType* in[] = {t.Q, t.K, t.V};
    TestType* O = t.O;
    float* L = t.L;
    const char* names[] = {"Q", "K", "V", "O", "L"};
    if (which < 3) in[which] = nullptr; else if (which == 3) O = nullptr; else L = nullptr;
    INFO(names[which] << " = nullptr, " << call.name());
    const std::string msg = refusal([&] { launch_forward(in[0], in[1], in[2], O, L, s, call); });
    CHECK_THAT(msg, NamesWord(names[which]));
    // The public calls name themselves (flash_forward_bc names flash_forward, whose check it
    // shares; flash_forward_fp16_bc, flash_forward_fp16).
    CHECK_THAT(msg, NamesWord(forward_api<TestType>()));
    CHECK(t.outputs_untouched());
}

TEMPLATE_TEST_CASE("Null pointers given to the backward are refused, naming the argument and the "
                   "call", "[cpu][validation][fp32][fp16][bf16][backward]", fp32, fp16, bf16) {
    const AttentionShape s = valid_shape();
    const int which = GENERATE(range(0, 9));
    FakeTensors<TestType> t;
    const TestType* in[] = {t.Q, t.K, t.V, t.O, t.dO};
    const float* L = t.L;
    TestType* out[] = {t.dQ, t.dK, t.dV};
    const char* names[] = {"Q", "K", "V", "O", "dO", "L", "dQ", "dK", "dV"};
    if (which < 5) in[which] = nullptr; else if (which == 5) L = nullptr; else out[which - 6] = nullptr;
    INFO(names[which] << " = nullptr");
    CHECK_THAT(refusal([&] {
                   launch_backward(in[0], in[1], in[2], in[3], in[4], L, out[0], out[1], out[2],
                                   s);
               }),
               NamesWord(names[which]) && NamesWord(backward_api<TestType>()));
    CHECK(t.outputs_untouched());
}

// Shifts a pointer by `bytes` (to make it misaligned; the callee only looks at the address).
template <typename P>
static P* shifted(P* p, size_t bytes) {
    using Byte = typename std::conditional<std::is_const<P>::value, const char, char>::type;
    return reinterpret_cast<P*>(reinterpret_cast<Byte*>(p) + bytes);
}

TEMPLATE_TEST_CASE("Outputs overlapping another tensor, and misaligned tensors, are refused by "
                   "the forward", "[cpu][validation][fp32][fp16][bf16]", fp32, fp16, bf16) {
    const AttentionShape s = valid_shape();
    const size_t nq = q_elems(s), nkv = kv_elems(s), nl = l_elems(s);
    const Kernel call = GENERATE(from_range(forward_calls<TestType>({64})));
    INFO(forward_api<TestType>() << ", " << call.name());
    // Separate heap arrays (16-byte aligned, as malloc's are), 8 elements (one float for L)
    // longer than needed, so that a shifted pointer stays inside.
    std::vector<TestType> Q(nq + 8, TestType(0.5f)), K(nkv + 8, TestType(0.25f)),
        V(nkv, TestType(0.75f)), O(nq, quiet_nan<TestType>());
    std::vector<float> L(nl + 1, std::numeric_limits<float>::quiet_NaN());
    // The forward's arguments, all valid: each section spoils one, then calls launch_forward
    // through refused().
    struct {
        const TestType *Q, *K, *V;
        TestType* O;
        float* L;
    } a{Q.data(), K.data(), V.data(), O.data(), L.data()};
    const auto refused = [&] {
        return refusal([&] { launch_forward(a.Q, a.K, a.V, a.O, a.L, s, call); });
    };
    SECTION("O is Q") {
        a.O = Q.data();
        CHECK_THAT(refused(), NamesWord("O") && NamesWord("Q") && Contains("overlaps"));
    }
    SECTION("L lies inside V (in fp16 and bf16 a float L over a 2-byte V: the overlap is of bytes)") {
        a.L = reinterpret_cast<float*>(V.data() + 8);
        CHECK_THAT(refused(), NamesWord("L") && NamesWord("V") && Contains("overlaps"));
    }
    SECTION("O lies inside K") {
        a.O = K.data() + 8;
        CHECK_THAT(refused(), NamesWord("O") && NamesWord("K") && Contains("overlaps"));
    }
    SECTION("Q is not 16-byte aligned (one element off)") {
        a.Q = Q.data() + 1;
        CHECK_THAT(refused(), NamesWord("Q") && Contains("16-byte aligned"));
    }
    SECTION("Q is not 16-byte aligned (2 bytes off)") {
        a.Q = shifted(Q.data(), 2);
        CHECK_THAT(refused(), NamesWord("Q") && Contains("16-byte aligned"));
    }
    SECTION("K is not 16-byte aligned (8 bytes off)") {
        a.K = shifted(K.data(), 8);
        CHECK_THAT(refused(), NamesWord("K") && Contains("16-byte aligned"));
    }
    SECTION("L is not 16-byte aligned (4 bytes off)") {
        a.L = L.data() + 1;
        CHECK_THAT(refused(), NamesWord("L") && Contains("16-byte aligned"));
    }
    CHECK(std::all_of(O.begin(), O.end(), [](TestType x) { return std::isnan(to_float(x)); }));
    CHECK(std::all_of(L.begin(), L.end(), [](float x) { return std::isnan(x); }));
    CHECK(std::all_of(K.begin(), K.end(), [](TestType x) { return to_float(x) == 0.25f; }));
}

TEMPLATE_TEST_CASE("Outputs overlapping another tensor, and misaligned tensors, are refused by "
                   "the backward", "[cpu][validation][fp32][fp16][bf16][backward]", fp32, fp16,
                   bf16) {
    const AttentionShape s = valid_shape();
    const size_t nq = q_elems(s), nkv = kv_elems(s), nl = l_elems(s);
    // Separate heap arrays (16-byte aligned, as malloc's are), 8 elements (one float for L) longer
    // than needed where a shifted pointer must stay inside.
    const TestType nan = quiet_nan<TestType>();
    std::vector<TestType> Q(nq, TestType(0.5f)), K(nkv + 8, TestType(0.25f)),
        V(nkv, TestType(0.75f)), O(nq, TestType(0.375f)), dO(nq + 8, TestType(0.125f));
    std::vector<float> L(nl + 1, 1.5f);
    std::vector<TestType> dQ(nq + 8, nan), dK(nkv, nan), dV(nkv, nan);
    // The backward's arguments, all valid: each section spoils one, then calls launch_backward
    // through refused().
    struct {
        const TestType *Q, *K, *V, *O, *dO;
        const float* L;
        TestType *dQ, *dK, *dV;
    } a{Q.data(), K.data(), V.data(), O.data(), dO.data(), L.data(), dQ.data(), dK.data(),
        dV.data()};
    const auto refused = [&] {
        return refusal(
            [&] { launch_backward(a.Q, a.K, a.V, a.O, a.dO, a.L, a.dQ, a.dK, a.dV, s); });
    };
    SECTION("dK is dV") {
        a.dK = dV.data();
        CHECK_THAT(refused(), NamesWord("dK") && NamesWord("dV") && Contains("overlaps"));
    }
    SECTION("dQ is dO") {
        a.dQ = dO.data();
        CHECK_THAT(refused(), NamesWord("dQ") && NamesWord("dO") && Contains("overlaps"));
    }
    SECTION("dV lies inside K") {
        a.dV = K.data() + 8;
        CHECK_THAT(refused(), NamesWord("dV") && NamesWord("K") && Contains("overlaps"));
    }
    SECTION("L lies inside dQ (in fp16 and bf16 a float L over a 2-byte dQ: the overlap is of bytes)") {
        a.L = reinterpret_cast<const float*>(dQ.data() + 8);
        CHECK_THAT(refused(), NamesWord("dQ") && NamesWord("L") && Contains("overlaps"));
    }
    SECTION("K is not 16-byte aligned (one element off)") {
        a.K = K.data() + 1;
        CHECK_THAT(refused(), NamesWord("K") && Contains("16-byte aligned"));
    }
    SECTION("dO is not 16-byte aligned (2 bytes off)") {
        a.dO = shifted(dO.data(), 2);
        CHECK_THAT(refused(), NamesWord("dO") && Contains("16-byte aligned"));
    }
    SECTION("dQ is not 16-byte aligned (8 bytes off)") {
        a.dQ = shifted(dQ.data(), 8);
        CHECK_THAT(refused(), NamesWord("dQ") && Contains("16-byte aligned"));
    }
    SECTION("L is not 16-byte aligned (4 bytes off)") {
        a.L = L.data() + 1;
        CHECK_THAT(refused(), NamesWord("L") && Contains("16-byte aligned"));
    }
    auto all_nan = [](const std::vector<TestType>& v) {
        return std::all_of(v.begin(), v.end(), [](TestType x) { return std::isnan(to_float(x)); });
    };
    CHECK(all_nan(dQ));
    CHECK(all_nan(dK));
    CHECK(all_nan(dV));
    CHECK(std::all_of(K.begin(), K.end(), [](TestType x) { return to_float(x) == 0.25f; }));
    CHECK(std::all_of(dO.begin(), dO.end(), [](TestType x) { return to_float(x) == 0.125f; }));
    CHECK(std::all_of(L.begin(), L.end(), [](float x) { return x == 1.5f; }));
}

TEMPLATE_TEST_CASE("Unsupported head dims are refused, listing the supported ones",
                   "[cpu][validation][fp32][fp16][bf16]", fp32, fp16, bf16) {
    // Every call, forward and backward, in every type: the same six, 256 included (accepted on a
    // GPU with the shared memory for it).
    const int d = GENERATE(values({48, 0, 512, 8, 24, 257}));
    AttentionShape s = valid_shape();
    s.head_dim = d;
    INFO(describe(s));
    FakeTensors<TestType> t;
    std::vector<std::string> messages;
    for (const Kernel& call : forward_calls_checked<TestType>())
        messages.push_back(refusal([&] { launch_forward(t.Q, t.K, t.V, t.O, t.L, s, call); }));
    messages.push_back(refusal([&] {
        launch_backward(t.Q, t.K, t.V, t.O, t.dO, t.L, t.dQ, t.dK, t.dV, s);
    }));
    for (const std::string& msg : messages) {
        INFO("message: " << msg);
        CHECK_THAT(msg, NamesWord("head_dim"));
        CHECK_THAT(msg, Contains("16, 32, 64, 96, 128, 256"));
    }
    CHECK(t.outputs_untouched());
}

TEST_CASE("flash_forward_bc refuses Bc below 1, naming it", "[cpu][validation]") {
    const int Bc = GENERATE(0, -1, INT_MIN);
    CAPTURE(Bc);
    FakeTensors t;
    CHECK_THAT(refusal([&] { flash_forward_bc(t.Q, t.K, t.V, t.O, t.L, valid_shape(), Bc); }),
               NamesWord("Bc"));
    CHECK(t.outputs_untouched());
}

TEST_CASE("flash_forward_fp16_bc refuses Bc other than 32, 64 and 128 (to head_dim 64), naming it "
          "and the allowed values", "[cpu][validation][fp16]") {
    const int Bc = GENERATE(0, -1, -32, INT_MIN, 1, 16, 31, 33, 48, 63, 65, 96, 127, 129, 256,
                            INT_MAX);
    CAPTURE(Bc);
    FakeTensors<fp16> t;
    CHECK_THAT(refusal([&] {
                   flash_forward_fp16_bc(t.Q, t.K, t.V, t.O, t.L, valid_shape(), Bc);
               }),
               NamesWord("Bc") && NamesWord("32") && NamesWord("64") && NamesWord("128"));
    CHECK(t.outputs_untouched());
}

TEMPLATE_TEST_CASE("The Hopper forward refuses head dims it has no kernel for, naming the allowed "
                   "ones, before it looks for a GPU", "[cpu][validation][hopper][fp16][bf16]", fp16,
                   bf16) {
    AttentionShape s = valid_shape();
    s.head_dim = GENERATE(values({16, 32, 96, 512, 48, 0, -64}));
    CAPTURE(s.head_dim);
    FakeTensors<TestType> t;
    CHECK_THAT(refusal([&] {
                   if constexpr (std::is_same<TestType, __half>::value)
                       flash_forward_fp16_hopper(t.Q, t.K, t.V, t.O, t.L, s);
                   else
                       flash_forward_bf16_hopper(t.Q, t.K, t.V, t.O, t.L, s);
               }),
               NamesWord("head_dim") && NamesWord("64") && NamesWord("128") && NamesWord("256"));
    CHECK(t.outputs_untouched());
}

TEST_CASE("flash_forward_fp16_bc refuses Bc = 128 above head_dim 64 (registers)",
          "[cpu][validation][fp16]") {
    AttentionShape s = valid_shape();
    s.head_dim = GENERATE(96, 128, 256);
    CAPTURE(s.head_dim);
    FakeTensors<fp16> t;
    CHECK_THAT(refusal([&] { flash_forward_fp16_bc(t.Q, t.K, t.V, t.O, t.L, s, 128); }),
               NamesWord("Bc") && NamesWord("128") && NamesWord("head_dim"));
    CHECK(t.outputs_untouched());
}

TEST_CASE("flash_backward_fp16_bc refuses Bc other than 64 and 128 (128 from head_dim 32 to 128), "
          "naming it and the allowed values", "[cpu][validation][fp16][backward]") {
    const int Bc = GENERATE(0, -1, -64, INT_MIN, 1, 16, 32, 63, 65, 96, 127, 129, 256, INT_MAX);
    const int d = GENERATE(16, 64);
    AttentionShape s = valid_shape();
    s.head_dim = d;
    CAPTURE(Bc, d);
    FakeTensors<fp16> t;
    CHECK_THAT(refusal([&] {
                   flash_backward_fp16_bc(t.Q, t.K, t.V, t.O, t.dO, t.L, t.dQ, t.dK,
                                          t.dV, s, Bc);
               }),
               NamesWord("Bc") && NamesWord("64") && NamesWord("128"));
    CHECK(t.outputs_untouched());
    // And 128 at head_dim 16, where 8 warps would split dQ_i's 16 columns too finely, and at 256,
    // where a thread's share of dK_j and dV_j would be 256 floats.
    s.head_dim = GENERATE(16, 256);
    CHECK_THAT(refusal([&] {
                   flash_backward_fp16_bc(t.Q, t.K, t.V, t.O, t.dO, t.L, t.dQ, t.dK,
                                          t.dV, s, 128);
               }),
               NamesWord("Bc") && NamesWord("128"));
    CHECK(t.outputs_untouched());
}

TEST_CASE("The fp16 backward's extra memory is dQ in fp32, D, a turn counter per 32 query rows and "
          "a ticket", "[cpu][fp16][backward]") {
    // The turns are counted for the smallest Q tile, 32 rows, whatever tile the device takes, so
    // the figure is the same on every GPU. By hand: {2, 3, 100, 77, 64}: dQ in fp32 2*3*100*64 =
    // 38400 floats, D 600 floats, ceil(100 / 32) = 4 counters a head, 24, + 1 ticket:
    // 4 * (38400 + 600 + 24 + 1) = 156100 bytes. {1, 2, 100, 77, 256}: 4 * (51200 + 200 + 8 + 1)
    // = 205636.
    CHECK(flash_backward_fp16_scratch_bytes({2, 3, 100, 77, 64, false}) == 156100);
    CHECK(flash_backward_fp16_scratch_bytes({1, 2, 100, 77, 256, true}) == 205636);
    // The dominant term, B*H*q_len*d*4 bytes, twice dQ itself: at the protocol's 16384 tokens of
    // 2048 channels, 128 MiB.
    const AttentionShape protocol{4, 16, 4096, 4096, 128, false};
    CHECK(flash_backward_fp16_scratch_bytes(protocol) ==
          4 * (q_elems(protocol) + l_elems(protocol) + 4 * 16 * 128 + 1));
    // A bad shape is refused as the backward refuses it.
    CHECK_THAT(refusal([&] { flash_backward_fp16_scratch_bytes({1, 1, 0, 7, 64, false}); }),
               NamesWord("q_len"));
}

TEST_CASE("Element counts are 64-bit products", "[cpu][validation]") {
    const AttentionShape s{4097, 32, 128, 64, 128, false};  // Q: just past 2^31 elements
    CHECK(q_elems(s) == size_t(4097) * 32 * 128 * 128);
    CHECK(q_elems(s) > (size_t(1) << 31));
    CHECK(kv_elems(s) == size_t(4097) * 32 * 64 * 128);
    CHECK(l_elems(s) == size_t(4097) * 32 * 128);
    CHECK_NOTHROW(validate_shape(s));
    CHECK_NOTHROW(validate_shape({70000, 1, 16, 16, 16, true}));
}

TEST_CASE("A failure's place names batch, head, row and column, and an empty tensor has none",
          "[cpu][harness]") {
    const AttentionShape s{2, 3, 5, 7, 16, false};  // batch 2, 3 heads, q_len 5, kv_len 7, d 16
    // Element 4 * 5 * 16 + 2 * 16 + 9 of Q: the fifth (batch, head) = (1, 1), row 2, column 9.
    CHECK(where(q_layout(s), 4 * 5 * 16 + 2 * 16 + 9) == "(b=1, h=1, i=2, x=9)");
    CHECK(where(l_layout(s), 3 * 5 + 4) == "(b=1, h=0, i=4)");
    // A packed batch's empty sequence has no rows: no place to name, and no division by zero.
    const AttentionShape empty{1, 3, 0, 0, 16, false};
    CHECK(where(q_layout(empty), 0) == "(an empty tensor)");
    check_bitwise("O", {}, {}, empty, q_layout(empty));  // passes: nothing differs
}

// =============================================================================================
// GPU: determinism, and the caller-chosen Bc

TEMPLATE_TEST_CASE("The forward gives bitwise identical O and L on every call, on any stream",
                   "[gpu][forward][determinism][fp32][fp16][bf16]", fp32, fp16, bf16) {
    // The type's own chapter (own_chapter: chapter 1; chapter 2 whatever the GPU), then in fp16
    // and bf16 the public call where it runs chapter 3 (public_forward_runs_hopper).
    // (For fp32 own_chapter is the public call itself: the second generated kernel is the first.)
    const bool public_too = GENERATE(false, true);
    const Kernel kernel = public_too ? Kernel::public_call() : own_chapter<TestType>();
    const AttentionShape s = GENERATE(from_range(determinism_shapes(1000)));
    if (public_too && (std::is_same<TestType, float>::value || !public_forward_runs_hopper(s.head_dim)))
        NOT_HERE("the kernel the first run had");
    INFO(describe(s) << ", " << kernel.name());
    const auto p = rounded_problem<TestType>(s, per_type<TestType>(400u, 1500u));
    GpuAttention<TestType> gpu(p);
    gpu.forward(kernel);
    const auto first = gpu.outputs(false);
    REQUIRE(count_bad(first.O) == 0);  // every O written (L may be -inf in masked rows)
    gpu.forward(kernel);
    const auto second = gpu.outputs(false);
    check_bitwise(first, second, s);
    for (unsigned flags : {unsigned(cudaStreamDefault), unsigned(cudaStreamNonBlocking)}) {
        const char* which = flags == cudaStreamDefault ? "a stream of its own"
                                                       : "a non-blocking stream of its own";
        INFO("on " << which);
        ScopedStream stream(flags);
        gpu.forward(kernel, stream.stream);
        check_bitwise(first, gpu.outputs(false), s);
    }
}

TEMPLATE_TEST_CASE("The backward gives bitwise identical dQ, dK and dV on every call, on any "
                   "stream", "[gpu][backward][determinism][fp32][fp16][bf16]", fp32, fp16, bf16) {
    // d = 256 among the shapes (8 warps on 64 keys in chapter 2), and two streams of its own:
    // chapter 2's backward allocates its scratch (dQ in fp32, D, the turn counters) on the stream.
    const AttentionShape s = GENERATE(from_range(determinism_shapes(300)));
    INFO(describe(s));
    const auto p = rounded_problem<TestType>(s, per_type<TestType>(500u, 2500u));
    GpuAttention<TestType> gpu(p);
    gpu.forward();
    gpu.backward();
    const auto first = gpu.outputs(true);
    for (const auto* g : {&first.dQ, &first.dK, &first.dV}) REQUIRE(count_bad(*g) == 0);
    gpu.backward();
    check_bitwise(first, gpu.outputs(true), s);  // O and L too: the backward must not touch them
    for (unsigned flags : {unsigned(cudaStreamDefault), unsigned(cudaStreamNonBlocking)}) {
        const char* which = flags == cudaStreamDefault ? "a stream of its own"
                                                       : "a non-blocking stream of its own";
        INFO("on " << which);
        ScopedStream stream(flags);
        gpu.backward(Kernel::public_call(), stream.stream);
        check_bitwise(first, gpu.outputs(true), s);
    }
}

// The shares that cancel, at head dim d: the body of the two test cases below.
// Chapter 2's backward sums each K/V tile's share of dQ_i in fp32 in memory, in a fixed order
// (flash_fp16.cu; without the mask the tiles from the right: j = Tc - 1 stores, then Tc - 2
// adds, ...), each block waiting for its turn and handing it on once its adds have landed. On
// random inputs an add out of order moves dQ by its last bits at most, and rarely, so the
// tests above would not see a turn handed on too early. Here it shows in every element:
//  - Q = 0: every score is 0, so every P_ij = 1 / kv_len whatever K holds;
//  - the last two K/V tiles hold the same V rows (so the same dS_ij) and K rows of opposite
//    signs, huge (H): their shares of dQ_i are A and -A exactly (the same products negated,
//    summed in the same order; rounding to nearest and towards zero are both odd functions);
//  - the other tiles' K rows are small (k): their shares, s, lie far below A's last bit.
// In the fixed order dQ_i = ((A - A) + s) + ... , bit for bit what it is with the two tiles'
// K set to 0 (0 + 0 + s + ...), which the reference checks. An add landing between the two
// ((A + s) - A, or -A before A's store) moves dQ_i by A's rounding, about |A| 2^-24 =
// (H / k) 2^-24 |s|: 2^-8 |s| in fp16 (H / k = 2^16), 2^-4 |s| in bf16 (2^20), 16 times the
// output's last bit or more, or by A itself.
template <typename TestType>
void check_cancelling_shares(int d) {
    const FlashTile tile = flash_choose_tile_fp16_backward(current_device_props(), d);
    const int Bc = tile.Bc, Tc = 4;
    // 64 heads of 4 K/V tiles: 256 blocks, every dQ_i (2 to 4 Q tiles a head) a chain of 4 adds.
    const AttentionShape s{4, 16, 200, Tc * Bc, d, false};
    INFO(describe(s) << ", K/V tiles of Bc = " << Bc << ": tiles " << Tc - 1 << " and " << Tc - 2
                     << " cancel");
    Problem<float> f = random_problem(s, 3100);
    const float H = Format16<TestType>::bf ? 65536.0f : 4096.0f, k = 1.0f / 16;
    const size_t heads = size_t(s.batch) * s.heads, rows = s.kv_len, D = d;
    std::fill(f.Q.begin(), f.Q.end(), 0.0f);
    for (size_t bh = 0; bh < heads; ++bh)
        for (size_t j = 0; j < rows; ++j)
            for (size_t x = 0; x < D; ++x) {
                float& K = f.K[(bh * rows + j) * D + x];
                if (j < size_t(Tc - 2) * Bc) K *= k;        // the small tiles
                else if (j >= size_t(Tc - 1) * Bc) K *= H;  // tile Tc - 1, huge
            }
    for (size_t bh = 0; bh < heads; ++bh)  // tile Tc - 2: tile Tc - 1's V rows, its K rows negated
        for (size_t j = size_t(Tc - 2) * Bc; j < size_t(Tc - 1) * Bc; ++j)
            for (size_t x = 0; x < D; ++x) {
                const size_t at = (bh * rows + j) * D + x, mirror = at + size_t(Bc) * D;
                f.K[at] = -f.K[mirror];
                f.V[at] = f.V[mirror];
            }
    const Problem<TestType> cancelling = converted<TestType>(f);  // negation rounds exactly
    Problem<float> g = f;
    for (size_t bh = 0; bh < heads; ++bh)
        for (size_t j = size_t(Tc - 2) * Bc; j < rows; ++j)
            for (size_t x = 0; x < D; ++x) g.K[(bh * rows + j) * D + x] = 0.0f;
    const Problem<TestType> without = converted<TestType>(g);
    for (const float x : converted<float>(cancelling.K)) REQUIRE(std::isfinite(x));
    GpuAttention<TestType> gpu_without(without);
    gpu_without.forward();
    gpu_without.backward();
    const Outputs<float> want = gpu_without.outputs(true);
    check_against_reference_backward(want, without);
    GpuAttention<TestType> gpu(cancelling);
    const int calls = 5;
    for (int call = 1; call <= calls; ++call) {
        gpu.forward();
        gpu.backward();
        const Outputs<float> got = gpu.outputs(true);
        if (bitwise_equal(want, got)) continue;
        INFO("call " << call << ": with the cancelling tiles the outputs must be bitwise those "
             "without them (O, L, dK, dV do not depend on them; dQ gets A - A = 0 first): where "
             "dQ differs, an add landed out of its turn");
        check_bitwise(want, got, s);
        FAIL("dQ's adds out of order");
    }
}

TEMPLATE_TEST_CASE("The tensor-core backward adds into dQ in its fixed order: shares that cancel "
                   "exactly leave no trace", "[gpu][backward][determinism][fp16]", fp16) {
    // The other head dims, and bf16 (the same kernel template, its own H): make stress (the
    // reference's cost).
    check_cancelling_shares<TestType>(64);
}

TEMPLATE_TEST_CASE("The tensor-core backward adds into dQ in its fixed order: shares that cancel "
                   "exactly leave no trace, at head dims 16, 128 and 256, and bf16's at 64 (make "
                   "stress)", "[gpu][backward][determinism][fp16][bf16][.stress]", fp16, bf16) {
    const bool bf = std::is_same<TestType, bf16>::value;
    const int d = GENERATE_COPY(from_range(bf ? std::vector<int>{16, 64, 128, 256}
                                              : std::vector<int>{16, 128, 256}));
    check_cancelling_shares<TestType>(d);
}

TEST_CASE("flash_forward_bc matches the reference for tiles that do not divide the length",
          "[gpu][forward][tile]") {
    const int Bc = GENERATE(1, 7, 64);
    const AttentionShape base = GENERATE(AttentionShape{1, 2, 100, 257, 0, true},
                                         AttentionShape{2, 1, 257, 100, 0, false},
                                         AttentionShape{1, 1, 33, 33, 0, true});
    const int d = GENERATE(from_range(kHeadDims));
    AttentionShape s = base;
    s.head_dim = d;
    INFO(describe(s) << ", Bc = " << Bc);
    const cudaDeviceProp prop = current_device_props();
    const auto p = random_problem(s, 600);
    GpuAttention<float> gpu(p);
    if (2 * size_t(Bc) * d * sizeof(float) > prop.sharedMemPerBlockOptin) {
        // K_j and V_j would not fit in one block's shared memory: refused (and O untouched).
        INFO("does not fit in " << prop.sharedMemPerBlockOptin << " bytes of shared memory");
        gpu.O.poison();
        CHECK_THAT(refusal([&] { flash_forward_bc(gpu.Q.ptr, gpu.K.ptr, gpu.V.ptr, gpu.O.ptr,
                                                  gpu.L.ptr, s, Bc); }),
                   NamesWord("Bc"));
        CHECK(count_bad(gpu.O.download()) == q_elems(s));  // all still NaN
        return;
    }
    gpu.forward(Kernel::with_bc(Bc));
    check_forward(gpu.outputs(false), reference_forward(p), tolerances(p, Rounding::random), s);
}

TEST_CASE("flash_forward_fp16_bc with Bc = 32 and 64 matches the reference for lengths the tile "
          "does not divide", "[gpu][forward][tile][fp16]") {
    const int Bc = GENERATE(32, 64);
    const AttentionShape base = GENERATE(AttentionShape{1, 2, 100, 257, 0, true},
                                         AttentionShape{2, 1, 257, 100, 0, false},
                                         AttentionShape{1, 1, 33, 33, 0, true},
                                         AttentionShape{1, 3, 1, 95, 0, true});
    const int d = GENERATE(from_range(kFp16HeadDims));
    AttentionShape s = base;
    s.head_dim = d;
    INFO(describe(s) << ", Bc = " << Bc);
    const cudaDeviceProp prop = current_device_props();
    const size_t bytes = size_t(64 + 4 * Bc) * (d + 8) * sizeof(__half);  // Q_i, 2 K_j, 2 V_j
    if (bytes > prop.sharedMemPerBlockOptin) {
        // Not on an H100 (232448 bytes); on an A100 or an RTX 4090, Bc = 64 at d = 256: refused
        // with std::runtime_error, and O and L untouched.
        INFO("the tile needs " << bytes << " bytes of shared memory; the device has "
                               << prop.sharedMemPerBlockOptin);
        GpuAttention<__half> gpu(rounded_problem<__half>(s, 1600));
        gpu.O.poison();
        gpu.L.poison();
        CHECK_THROWS_AS(flash_forward_fp16_bc(gpu.Q.ptr, gpu.K.ptr, gpu.V.ptr, gpu.O.ptr,
                                              gpu.L.ptr, s, Bc),
                        std::runtime_error);
        CHECK(count_bad(gpu.O.download_float()) == q_elems(s));  // all still NaN
        CHECK(count_bad(gpu.L.download()) == l_elems(s));
        return;
    }
    check_forward_on_gpu<__half>(s, 1600, Kernel::with_bc(Bc));
}

TEST_CASE("flash_forward_bc refuses a Bc that does not fit in shared memory, naming it",
          "[gpu][validation][tile]") {
    const int d = GENERATE(from_range(kHeadDims));
    const AttentionShape s{1, 1, 64, 64, d, false};
    const cudaDeviceProp prop = current_device_props();
    const int most = int(prop.sharedMemPerBlockOptin / (2 * d * sizeof(float)));
    const int Bc = GENERATE_COPY(most + 1, 1 << 20, INT_MAX);
    INFO(describe(s) << ", Bc = " << Bc << " (at most " << most << " fit)");
    const auto p = random_problem(s, 700);
    GpuAttention<float> gpu(p);
    gpu.O.poison();
    gpu.L.poison();
    CHECK_THAT(refusal([&] {
                   flash_forward_bc(gpu.Q.ptr, gpu.K.ptr, gpu.V.ptr, gpu.O.ptr, gpu.L.ptr, s, Bc);
               }),
               NamesWord("Bc"));
    CHECK(count_bad(gpu.O.download()) == q_elems(s));  // all still NaN: untouched
    CHECK(count_bad(gpu.L.download()) == l_elems(s));
}

// =============================================================================================
// GPU: hardening

// Each test below: outputs_of_identical_calls runs the API 100 times on the same inputs (outputs
// poisoned with NaN before each call) and requires all of every call's outputs to be bitwise the
// first call's; then the first call's outputs are checked against the reference. The longest
// runs are tagged [.stress]: hidden from the default run, `make stress` (./test_flash "[stress]")
// runs them, before a kernel change is called done; a short version of each stays in the default
// run.

TEMPLATE_TEST_CASE("100 calls of the forward and the backward give bitwise identical results",
                   "[gpu][hardening][determinism][backward][fp32][fp16][bf16][.stress]", fp32, fp16, bf16) {
    const int d = GENERATE(from_range(head_dims_of<TestType>()));
    const AttentionShape s{1, 2, 100, 77, d, true};
    INFO(describe(s));
    const auto p = rounded_problem<TestType>(s, per_type<TestType>(800u, 2700u));
    GpuAttention<TestType> gpu(p);
    check_against_reference_backward(outputs_of_identical_calls(gpu, 100, true), p);  // all five
}

TEMPLATE_TEST_CASE("100 calls of the tensor-core forward give bitwise identical results",
                   "[gpu][hardening][determinism][fp16][bf16][.stress]", fp16, bf16) {
    // Chapter 2's kernel (chapter 3's 100 calls: the [hopper] test below).
    const int d = GENERATE(from_range(kFp16HeadDims));
    const AttentionShape s{1, 2, 100, 77, d, true};
    INFO(describe(s));
    const auto p = rounded_problem<TestType>(s, 1700);
    GpuAttention<TestType> gpu(p);
    check_against_reference(outputs_of_identical_calls(gpu, 100, false, Kernel::chapter2()), p);
}

// The ordered add of dQ (flash_fp16.cu) at work: many heads, several K/V tiles a head, and at
// least twice as many blocks as the GPU can hold (an upper bound: as many blocks an SM as its
// shared memory takes), so that blocks wait for turns held by blocks started waves earlier, and
// blocks of one head run on different waves. Causal and not (causal: the tiles of a head are of
// different lengths). One tile serves both types: flash_choose_tile_fp16_backward's. `calls`
// identical calls; q_len sets the Q tiles a block walks (and the reference's cost), not the
// block count.
template <typename T>
static void check_backward_on_many_blocks(int calls, int q_len) {
    const bool causal = GENERATE(false, true);
    const AttentionShape s = GENERATE_COPY(AttentionShape{16, 16, q_len, 600, 16, causal},
                                           AttentionShape{4, 8, q_len, 1100, 128, causal});
    const cudaDeviceProp prop = current_device_props();
    const FlashTile tile = flash_choose_tile_fp16_backward(prop, s.head_dim);
    const size_t blocks = size_t(s.batch) * s.heads * ((s.kv_len + tile.Bc - 1) / tile.Bc);
    const size_t resident = size_t(prop.multiProcessorCount) *
                            (prop.sharedMemPerMultiprocessor /
                             (tile.shared_bytes + prop.reservedSharedMemPerBlock));
    INFO(describe(s) << ": " << blocks << " blocks of Bc = " << tile.Bc << "; at most "
                     << resident << " fit the GPU at once");
    REQUIRE(blocks >= 2 * resident);
    const auto p = rounded_problem<T>(s, 2800);
    GpuAttention<T> gpu(p);
    check_against_reference_backward(outputs_of_identical_calls(gpu, calls, true), p);
}

TEMPLATE_TEST_CASE("100 calls of the tensor-core backward on grids of many more blocks than the "
                   "GPU holds at once give bitwise identical results",
                   "[gpu][hardening][determinism][backward][fp16][bf16][.stress]", fp16, bf16) {
    check_backward_on_many_blocks<TestType>(100, 300);
}

TEMPLATE_TEST_CASE("5 calls of the tensor-core backward on grids of many more blocks than the GPU "
                   "holds at once give bitwise identical results",
                   "[gpu][hardening][determinism][backward][fp16][bf16][.stress]", fp16, bf16) {
    // The [.stress] test above, short: 5 calls, and 100 query rows for 300 (two Q tiles a block;
    // the same blocks and waves).
    check_backward_on_many_blocks<TestType>(5, 100);
}

TEST_CASE("flash_backward_fp16_bc with Bc = 64 and 128 matches the reference", "[gpu][backward][tile][fp16]") {
    // The device takes Bc = 128 where it fits (to d = 128); Bc = 64 (4 warps) is what an A100
    // runs at d = 128, and an RTX 4090 at d = 64 and 96: here it runs on this GPU too. At d = 256
    // Bc = 64 is the only choice (8 warps).
    const int Bc = GENERATE(64, 128);
    const AttentionShape base = GENERATE(AttentionShape{1, 2, 100, 257, 0, true},
                                         AttentionShape{2, 1, 257, 100, 0, false},
                                         AttentionShape{1, 3, 1, 95, 0, true});
    const int d = GENERATE(from_range(kFp16HeadDims));
    if (Bc == 128 && (d == 16 || d == 256))
        NOT_HERE("Bc = 128 at d = " << d << ": refused (the validation test above)");
    AttentionShape s = base;
    s.head_dim = d;
    INFO(describe(s) << ", Bc = " << Bc);
    const cudaDeviceProp prop = current_device_props();
    const auto p = rounded_problem<__half>(s, 2900);
    GpuAttention<__half> gpu(p);
    gpu.forward();
    if (fp16_backward_bytes(d, Bc, d == 256 ? 32 : 64) > prop.sharedMemPerBlockOptin) {
        // Not on an H100; on an A100, Bc = 128 at d = 128: refused, outputs untouched.
        DeviceBuffer<__half> dQ(q_elems(s)), dK(kv_elems(s)), dV(kv_elems(s));
        for (auto* b : {&dQ, &dK, &dV}) b->poison();
        CHECK_THROWS_AS(flash_backward_fp16_bc(gpu.Q.ptr, gpu.K.ptr, gpu.V.ptr, gpu.O.ptr,
                                               gpu.dO.ptr, gpu.L.ptr, dQ.ptr, dK.ptr, dV.ptr, s,
                                               Bc),
                        std::runtime_error);
        CHECK(count_bad(dQ.download_float()) == q_elems(s));
        CHECK(count_bad(dK.download_float()) == kv_elems(s));
        CHECK(count_bad(dV.download_float()) == kv_elems(s));
        return;
    }
    gpu.backward(Kernel::with_bc(Bc));
    check_against_reference_backward(gpu.outputs(true), p);
}

TEMPLATE_TEST_CASE("The tensor-core backward takes the extra memory it states from the library's "
                   "pool, gives it back, and flash_release_scratch returns the pool's memory",
                   "[gpu][backward][fp16][bf16]", fp16, bf16) {
    // The kept pool's used-memory high watermark over one call: at least what
    // flash_backward_fp16_scratch_bytes states (dQ in fp32 dominates; the same for both types),
    // at most that rounded up to the pool's 2 MiB granularity; after the call the pool uses
    // nothing of it, but keeps it reserved (for the next call) until flash_release_scratch. The
    // stream's own pool is not touched.
    const AttentionShape s{2, 8, 1000, 700, 128, true};
    const auto p = rounded_problem<TestType>(s, 3000);
    GpuAttention<TestType> gpu(p);
    gpu.forward();
    gpu.backward();  // the first call may grow the pool; measure the second
    int dev = 0;
    FLASH_CUDA_CHECK(cudaGetDevice(&dev));
    cudaMemPool_t stream_pool = nullptr, kept = flash_kept_pool();
    FLASH_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&stream_pool, dev));
    uint64_t zero = 0, high = 0, used = 0, stream_high = 0, reserved = 0, released = 0;
    FLASH_CUDA_CHECK(cudaMemPoolSetAttribute(kept, cudaMemPoolAttrUsedMemHigh, &zero));
    FLASH_CUDA_CHECK(cudaMemPoolSetAttribute(stream_pool, cudaMemPoolAttrUsedMemHigh, &zero));
    gpu.backward();
    FLASH_CUDA_CHECK(cudaMemPoolGetAttribute(kept, cudaMemPoolAttrUsedMemHigh, &high));
    FLASH_CUDA_CHECK(cudaMemPoolGetAttribute(kept, cudaMemPoolAttrUsedMemCurrent, &used));
    FLASH_CUDA_CHECK(cudaMemPoolGetAttribute(kept, cudaMemPoolAttrReservedMemCurrent, &reserved));
    FLASH_CUDA_CHECK(
        cudaMemPoolGetAttribute(stream_pool, cudaMemPoolAttrUsedMemHigh, &stream_high));
    flash_release_scratch();
    FLASH_CUDA_CHECK(cudaMemPoolGetAttribute(kept, cudaMemPoolAttrReservedMemCurrent, &released));
    const size_t stated = flash_backward_fp16_scratch_bytes(s);
    INFO(describe(s) << ": states " << stated << " bytes; the kept pool's used high watermark "
                     << high << ", used after the call " << used << ", reserved " << reserved
                     << ", reserved after flash_release_scratch " << released
                     << "; the stream pool's used high watermark " << stream_high);
    CHECK(high >= stated);
    CHECK(high <= stated + (size_t(2) << 20));
    CHECK(used == 0);
    CHECK(reserved >= stated);
    CHECK(released == 0);
    CHECK(stream_high == 0);
    check_against_reference_backward(gpu.outputs(true), p);
}

// Chapter 3's persistent grid with Q tiles that see no key: q_len 1000 against kv_len 10, causal
// (bottom-right): rows 0..989 see no key, so at Br = 128 seven of a head's eight Q tiles have no
// K/V tile at all (Tc = 0; at d = 64, Br = 192, five of six), and `heads` heads (times batch 2)
// make 8 * 2 * heads tiles or so for an H100's 132 blocks: a block runs tiles with Tc = 0 before
// and after others, in later rounds too (its Q_i loaded and given back with no K/V tile between).
// Those rows must come out O = 0, L = -inf; the rest as the reference says.
template <typename T>
static void check_hopper_tiles_without_keys(int heads) {
    if (!hopper_or_warn()) return;
    const int d = GENERATE(from_range(kHopperHeadDims));
    check_forward_on_gpu<T>(AttentionShape{2, heads, 1000, 10, d, true}, 1770, Kernel::chapter3());
}

TEMPLATE_TEST_CASE("The Hopper forward's persistent grid runs Q tiles that see no key between "
                   "others, in any round", "[gpu][forward][hopper][fp16][bf16][.stress]", fp16,
                   bf16) {
    check_hopper_tiles_without_keys<TestType>(64);  // 768 to 1024 tiles: 6 to 8 rounds
}

TEMPLATE_TEST_CASE("The Hopper forward's persistent grid runs Q tiles that see no key between "
                   "others, in two rounds", "[gpu][forward][hopper][fp16][bf16]", fp16, bf16) {
    check_hopper_tiles_without_keys<TestType>(12);  // 144 to 192 tiles: 2 rounds
}

TEMPLATE_TEST_CASE("The Hopper forward takes nothing from the stream's pool; its tile counter "
                   "comes from the library's kept pool, whose reservation does not grow",
                   "[gpu][hopper][fp16][bf16]", fp16, bf16) {
    // Chapter 3's one extra allocation is the 4-byte counter its persistent grid hands tiles out
    // by, from flash_kept_pool(): that pool keeps what it reserves (no trimming at every
    // synchronisation, which costs a short call tens of microseconds), so, emptied first
    // (flash_release_scratch: earlier tests' backwards reserved more), its reservation is the
    // pool's smallest, reserved by the first call and never more. The driver reserves 32 MiB at
    // a time for a pool (measured on an H200, driver 580; a 2 MiB maxSize did not change it).
    if (!hopper_or_warn()) return;
    const AttentionShape s{2, 8, 1000, 700, 128, true};
    const auto p = rounded_problem<TestType>(s, 3010);
    GpuAttention<TestType> gpu(p);
    flash_release_scratch();
    gpu.forward(Kernel::chapter3());  // the first call reserves the kept pool's memory again
    int dev = 0;
    FLASH_CUDA_CHECK(cudaGetDevice(&dev));
    cudaMemPool_t stream_pool = nullptr, kept = flash_kept_pool();
    FLASH_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&stream_pool, dev));
    uint64_t zero = 0, high = 0, reserved = 0, reserved_after = 0, used = 0;
    FLASH_CUDA_CHECK(cudaMemPoolSetAttribute(stream_pool, cudaMemPoolAttrUsedMemHigh, &zero));
    FLASH_CUDA_CHECK(cudaMemPoolGetAttribute(kept, cudaMemPoolAttrReservedMemCurrent, &reserved));
    for (int call = 0; call < 10; ++call) gpu.forward(Kernel::chapter3());
    FLASH_CUDA_CHECK(cudaMemPoolGetAttribute(stream_pool, cudaMemPoolAttrUsedMemHigh, &high));
    FLASH_CUDA_CHECK(
        cudaMemPoolGetAttribute(kept, cudaMemPoolAttrReservedMemCurrent, &reserved_after));
    FLASH_CUDA_CHECK(cudaMemPoolGetAttribute(kept, cudaMemPoolAttrUsedMemCurrent, &used));
    INFO(describe(s) << ": the stream pool's used high watermark " << high << "; the kept pool "
                     << "reserves " << reserved << " then " << reserved_after << ", uses " << used);
    CHECK(high == 0);
    CHECK(reserved > 0);
    CHECK(reserved <= (size_t(32) << 20));
    CHECK(reserved_after == reserved);
    CHECK(used == 0);
    check_against_reference(gpu.outputs(false), p);
}

TEST_CASE("Extreme inputs give finite outputs within tolerance of the reference",
          "[gpu][hardening]") {
    // The tolerances grow with the score magnitude M (see "Tolerances"): scores of thousands make
    // them ~1000 times looser than for N(0, 1) inputs, which is what fp32 can promise there.
    enum Kind { large, tiny, equal_scores, one_huge, big_keys };
    const Kind kind = GENERATE(large, tiny, equal_scores, one_huge, big_keys);
    const char* names[] = {"Q and K scaled by 30: scores in the hundreds and thousands",
                           "Q and K scaled by 1e-3: scores ~1e-6, attention almost uniform",
                           "every key equal: all of a row's scores equal (dQ = 0)",
                           "one huge score: Q row 5 and K row 7 of norm 100 (score 1e4/sqrt(d))",
                           "keys of +-1e4: scores ~1e4, attention one-hot"};
    const bool causal = GENERATE(false, true);
    const int d = GENERATE(from_range(kHeadDims));
    const AttentionShape s{1, 2, 77, 80, d, causal};
    INFO(names[kind] << "; " << describe(s));
    auto p = random_problem(s, 900 + kind);
    Rounding rounding = Rounding::random;
    switch (kind) {
        case large:
            for (auto* t : {&p.Q, &p.K}) for (auto& x : *t) x *= 30.0f;
            break;
        case tiny:
            for (auto* t : {&p.Q, &p.K}) for (auto& x : *t) x *= 1e-3f;
            break;
        case equal_scores:  // rounding errors line up: identical terms
            rounding = Rounding::aligned;
            for (size_t bh = 0; bh < 2; ++bh)
                for (size_t j = 1; j < 80; ++j)
                    for (int x = 0; x < d; ++x) p.K[(bh * 80 + j) * d + x] = p.K[bh * 80 * d + x];
            break;
        case one_huge:  // the huge score's d equal products line up
            rounding = Rounding::aligned;
            for (int x = 0; x < d; ++x) {
                p.Q[5 * d + x] = 100.0f / std::sqrt(float(d));
                p.K[7 * d + x] = 100.0f / std::sqrt(float(d));
            }
            break;
        case big_keys:
            for (auto& x : p.K) x = x < 0 ? -1e4f : 1e4f;
            break;
    }
    GpuAttention<float> gpu(p);
    gpu.forward();
    gpu.backward();
    const auto got = gpu.outputs(true);
    const char* names_out[] = {"O", "L", "dQ", "dK", "dV"};
    const std::vector<float>* outs[] = {&got.O, &got.L, &got.dQ, &got.dK, &got.dV};
    for (int t = 0; t < 5; ++t) {  // no row is masked here: L is finite too
        INFO(names_out[t] << " has " << count_bad(*outs[t]) << " NaN or infinite elements");
        CHECK(count_bad(*outs[t]) == 0);
    }
    const auto want = reference_backward(p);
    const Tolerances tol = tolerances(p, rounding);
    INFO("score magnitude M = " << tol.M << ": tolerance on O " << tol.O << ", on L " << tol.L);
    check_forward(got, want, tol, s);
    check_backward(got, want, tol, s);
}

TEMPLATE_TEST_CASE("Extreme inputs give the tensor-core forward finite outputs within tolerance "
                   "of the reference", "[gpu][hardening][fp16][bf16]", fp16, bf16) {
    // The fp32 test's cases, each within fp16's range (largest finite 65504; these inputs stay
    // below 5e4 after rounding), plus one of fp16's own: V near that range. bf16 has fp32's
    // range, so there they are ordinary inputs, rounded more coarsely. The inputs are built in
    // float, then rounded to TestType; the reference runs on the rounded values. tolerances16
    // assume aligned score errors (d u M), so where M is large they are loose: with Q and K
    // scaled by 30, and with keys of +-1e4, the check on O is little more than "written and
    // finite", and L (in the thousands, checked to about 3e-3 relative or better, in either
    // type: L is fp32) carries it.
    enum Kind { large, tiny, equal_scores, one_huge, big_keys, big_values };
    const Kind kind = GENERATE(large, tiny, equal_scores, one_huge, big_keys, big_values);
    const char* names[] = {"Q and K scaled by 30: scores in the hundreds and thousands",
                           "Q and K scaled by 1e-3 (some subnormal in fp16): scores ~1e-6, "
                           "attention almost uniform",
                           "every key equal: all of a row's scores equal",
                           "one huge score: Q row 5 and K row 7 of norm 100 (score 1e4/sqrt(d))",
                           "keys of +-1e4: scores ~1e4, attention one-hot",
                           "V scaled by 1e4: O up to ~4e4, near fp16's largest finite value"};
    const bool causal = GENERATE(false, true);
    const int d = GENERATE(from_range(kFp16HeadDims));
    // Chapter 2's kernel, then the public call where it runs chapter 3 (public_forward_runs_hopper).
    const Kernel kernel = GENERATE(Kernel::chapter2(), Kernel::public_call());
    if (kernel == Kernel::public_call() && !public_forward_runs_hopper(d))
        NOT_HERE("chapter 2 again");
    const AttentionShape s{1, 2, 77, 80, d, causal};
    INFO(names[kind] << "; " << describe(s) << ", "
                     << (kernel == Kernel::public_call() ? "chapter 3" : "chapter 2"));
    auto f = random_problem(s, 1800 + kind);  // in float: rounded to TestType below
    switch (kind) {
        case large:
            for (auto* t : {&f.Q, &f.K}) for (auto& x : *t) x *= 30.0f;
            break;
        case tiny:
            for (auto* t : {&f.Q, &f.K}) for (auto& x : *t) x *= 1e-3f;
            break;
        case equal_scores:
            for (size_t bh = 0; bh < 2; ++bh)
                for (size_t j = 1; j < 80; ++j)
                    for (int x = 0; x < d; ++x) f.K[(bh * 80 + j) * d + x] = f.K[bh * 80 * d + x];
            break;
        case one_huge:
            for (int x = 0; x < d; ++x) {
                f.Q[5 * d + x] = 100.0f / std::sqrt(float(d));
                f.K[7 * d + x] = 100.0f / std::sqrt(float(d));
            }
            break;
        case big_keys:
            for (auto& x : f.K) x = x < 0 ? -1e4f : 1e4f;
            break;
        case big_values:
            for (auto& x : f.V) x *= 1e4f;
            break;
    }
    const Problem<TestType> p = converted<TestType>(f);
    for (const auto* t : {&p.Q, &p.K, &p.V}) {  // nothing rounded to infinity
        const std::vector<float> values = converted<float>(*t);
        INFO(count_bad(values) << " inputs are not finite in " << Format16<TestType>::name
                               << "; the largest is " << max_abs(values));
        REQUIRE(count_bad(values) == 0);
    }
    GpuAttention<TestType> gpu(p);
    gpu.forward(kernel);
    const auto got = gpu.outputs(false);
    for (const auto& out : {std::make_pair("O", &got.O), std::make_pair("L", &got.L)}) {
        // no row is masked here: L is finite too
        INFO(out.first << " has " << count_bad(*out.second) << " NaN or infinite elements");
        CHECK(count_bad(*out.second) == 0);
    }
    check_against_reference(got, p);
}

// =============================================================================================
// GPU: big tensors

// Fills gpu's Q, K, V (and with dO, dO) from random patterns (random_pattern(seed + t), rounded
// to T) and returns the patterns, for check_big_head to rebuild any head's inputs from.
template <typename T>
static std::vector<std::vector<T>> fill_from_patterns(GpuAttention<T>& gpu, uint32_t seed,
                                                      bool with_dO) {
    std::vector<std::vector<T>> patterns;
    for (uint32_t t = 0; t < (with_dO ? 4u : 3u); ++t)
        patterns.push_back(converted<T>(random_pattern(seed + t)));
    gpu.Q.fill_repeating(patterns[0]);
    gpu.K.fill_repeating(patterns[1]);
    gpu.V.fill_repeating(patterns[2]);
    if (with_dO) {
        gpu.dO = DeviceBuffer<T>(q_elems(gpu.s));
        gpu.dO.fill_repeating(patterns[3]);
    }
    return patterns;
}

namespace {
// 65535 is the limit of a grid's y and z dimensions: a launch that puts batch*heads there fails,
// and one that folds it wrongly leaves the last heads unwritten or wrong. The forward (the public
// call) and the backward at q_len x kv_len, 70000 heads, causal and not.
template <typename T>
void check_heads_past_65535(int q_len, int kv_len) {
    const bool causal = GENERATE(false, true);
    const AttentionShape s{70000, 1, q_len, kv_len, 16, causal};
    INFO(describe(s));
    GpuAttention<T> gpu(s);
    const auto patterns = fill_from_patterns(gpu, per_type<T>(1000u, 5000u), true);
    gpu.forward();
    gpu.backward();
    for (size_t bh : {size_t(0), size_t(65534), size_t(65535), size_t(65536), size_t(69998),
                      size_t(69999)})
        check_big_head(gpu, bh, patterns, true);
}
}  // namespace

TEMPLATE_TEST_CASE("More than 65535 batch*heads: the heads past 65535 are right, the last included",
                   "[gpu][big][backward][fp32][fp16][bf16]", fp32, fp16, bf16) {
    // 129 x 33: three Q tiles of 64 rows, one partial K/V tile; when causal, rows 0..95 see no
    // key, and chapter 2's backward adds to no dQ there.
    check_heads_past_65535<TestType>(129, 33);
}
TEMPLATE_TEST_CASE("More than 65535 batch*heads: the heads past 65535 are right, the last "
                   "included, at 16 x 16 (make stress)",
                   "[gpu][big][backward][fp32][fp16][bf16][.stress]", fp32, fp16, bf16) {
    check_heads_past_65535<TestType>(16, 16);  // one tile each way
}

namespace {
// As the test above. Chapter 2 (d = 16): two Q tiles a head (q_len 65 > Br = 64), a partial K
// tile, and, when causal, rows that see no key (0..31). Chapter 3 (d = 64, on compute capability
// 9.0 only): the same with q_len 193 > Br = 192.
template <typename TestType>
void check_tensor_core_heads_past_65535() {
    const Kernel kernel = GENERATE(Kernel::chapter2(), Kernel::chapter3());
    const bool causal = GENERATE(false, true);
    const bool hopper = kernel == Kernel::chapter3();
    if (hopper && !hopper_or_warn()) return;
    const AttentionShape s = hopper ? AttentionShape{70000, 1, 193, 33, 64, causal}
                                    : AttentionShape{70000, 1, 65, 33, 16, causal};
    INFO(describe(s) << ", " << kernel.name());
    GpuAttention<TestType> gpu(s);
    const auto patterns = fill_from_patterns(gpu, 3000, false);
    gpu.forward(kernel);
    for (size_t bh : {size_t(0), size_t(65534), size_t(65535), size_t(65536), size_t(69998),
                      size_t(69999)})
        check_big_head(gpu, bh, patterns, false);
}
}  // namespace

TEMPLATE_TEST_CASE("More than 65535 batch*heads: the tensor-core forwards' heads past 65535 are "
                   "right", "[gpu][big][fp16][hopper]", fp16) {
    check_tensor_core_heads_past_65535<TestType>();
}
TEMPLATE_TEST_CASE("More than 65535 batch*heads: the tensor-core forwards' heads past 65535 are "
                   "right in bf16 too, the same kernel templates (make stress)",
                   "[gpu][big][bf16][hopper][.stress]", bf16) {
    check_tensor_core_heads_past_65535<TestType>();
}

TEMPLATE_TEST_CASE("100 calls of the Hopper forward give bitwise identical results",
                   "[gpu][hardening][determinism][hopper][fp16][bf16][.stress]", fp16, bf16) {
    if (!hopper_or_warn()) return;
    const int d = GENERATE(from_range(kHopperHeadDims));
    // Two Q tiles at d = 64 (Br = 192), three elsewhere; three K/V tiles, six at d = 256 (Bc = 48).
    const AttentionShape s{1, 2, 300, 277, d, true};
    INFO(describe(s));
    const auto p = rounded_problem<TestType>(s, 1750);
    GpuAttention<TestType> gpu(p);
    check_against_reference(outputs_of_identical_calls(gpu, 100, false, Kernel::chapter3()), p);
}

// One block an SM takes the next Q tile from a counter as it finishes one, so which block runs
// which tile changes from call to call: `heads` heads (times batch 2) of 1000 rows are 6 to 8
// Q tiles each, and with the mask their lengths differ. Each tile's arithmetic is its own, so O
// and L must not change in any bit over `calls` calls. (The reference at this size would take
// minutes on the CPU; the grid tests check these kernels' values.) The inputs come from random
// patterns (fill_from_patterns), which cost the host nothing to make. both_masks: causal and not
// (make stress); else causal alone, where the tiles' lengths differ most.
template <typename T>
static void check_hopper_share_out(int heads, int calls, bool both_masks) {
    if (!hopper_or_warn()) return;
    const int d = GENERATE(from_range(kHopperHeadDims));
    const bool causal = both_masks ? GENERATE(false, true) : true;
    const AttentionShape s{2, heads, 1000, 1000, d, causal};
    INFO(describe(s) << ", " << calls << " calls");
    GpuAttention<T> gpu(s);
    fill_from_patterns(gpu, 1760, false);
    const Outputs<float> out = outputs_of_identical_calls(gpu, calls, false, Kernel::chapter3());
    CHECK(count_bad(out.O) == 0);  // every element written (outputs are poisoned before a call)
    CHECK(count_bad(out.L) == 0);
}

TEMPLATE_TEST_CASE("The Hopper forward's persistent grid gives bitwise identical results however "
                   "its blocks share out the tiles",
                   "[gpu][hardening][determinism][hopper][fp16][bf16][.stress]", fp16, bf16) {
    check_hopper_share_out<TestType>(64, 20, true);  // 768 to 1024 tiles: five or more a block
}

TEMPLATE_TEST_CASE("The Hopper forward's persistent grid gives bitwise identical results over 3 "
                   "calls however its blocks share out the tiles",
                   "[gpu][hardening][determinism][hopper][fp16][bf16]", fp16, bf16) {
    check_hopper_share_out<TestType>(16, 3, false);  // 192 to 256 tiles: one or two a block
}

TEMPLATE_TEST_CASE("Tensors of more than 2^31 elements: the heads past 2^31 are right",
                   "[gpu][big][hopper][fp32][fp16][bf16][.stress]", fp32, fp16, bf16) {
    // 4097 * 32 heads of 128 x 128: each of Q, K, V, O holds 2^31 + 2^19 elements (8.6 GB in
    // fp32, 4.3 GB in fp16 or bf16). In 2-byte elements head 65536 starts at element 2^30, byte
    // 2^31 (where a 32-bit byte offset wraps); heads 131072.. lie wholly past element 2^31 (where
    // a 32-bit element index wraps). The type's own chapter, and chapter 3 on compute capability
    // 9.0 (fp16, bf16).
    const Kernel kernel = GENERATE(own_chapter<TestType>(), Kernel::chapter3());
    if (kernel == Kernel::chapter3() && std::is_same<TestType, float>::value)
        NOT_HERE("chapter 3 has no fp32 kernel");
    if (kernel == Kernel::chapter3() && !hopper_or_warn()) return;
    AttentionShape s{4097, 32, 128, 128, 128, false};
    const size_t need = (2 * q_elems(s) + 2 * kv_elems(s)) * sizeof(TestType) +
                        l_elems(s) * sizeof(float);
    REQUIRE(q_elems(s) > (size_t(1) << 31));
    size_t free_bytes = 0, total_bytes = 0;
    FLASH_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    const double GiB = double(1 << 30);
    if (free_bytes < need + (size_t(1) << 30)) {
        WARN("skipped: needs " << need / GiB << " GiB of GPU memory (+1 GiB spare), but "
                               "cudaMemGetInfo reports " << free_bytes / GiB << " GiB free of "
                               << total_bytes / GiB);
        NOT_HERE("too little GPU memory");
    }
    GpuAttention<TestType> gpu(s);
    const auto patterns = fill_from_patterns(gpu, per_type<TestType>(2000u, 4000u), false);
    for (bool causal : {false, true}) {
        gpu.s.causal = s.causal = causal;
        INFO(describe(s) << ", " << kernel.name());
        gpu.forward(kernel);
        for (size_t bh : {size_t(0), size_t(65535), size_t(65536), size_t(131071), size_t(131072),
                          size_t(131103)})
            check_big_head(gpu, bh, patterns, false);
    }
}

// =============================================================================================
// Hidden: how long the CPU reference takes over the GPU tests' grids (./test_flash [.timing]).

TEST_CASE("The CPU reference over the GPU grids takes seconds", "[.timing]") {
    using clock = std::chrono::steady_clock;
    auto run = [](const std::vector<AttentionShape>& shapes, bool backward) {
        const auto start = clock::now();
        for (const AttentionShape& s : shapes) {
            const auto p = random_problem(s, 1);
            if (backward) reference_backward(p); else reference_forward(p);
        }
        return std::chrono::duration<double>(clock::now() - start).count();
    };
    const auto forward_shapes = forward_grid(kHeadDims), backward_shapes = backward_grid(kHeadDims);
    const double fwd = run(forward_shapes, false), bwd = run(backward_shapes, true);
    std::cout << "reference over the forward grid (" << forward_shapes.size()
              << " cases): " << fwd << " s; over the backward grid (" << backward_shapes.size()
              << " cases, forward + backward): " << bwd << " s\n";
    CHECK(fwd + bwd < 60);
}

