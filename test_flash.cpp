// test_flash.cpp: the classroom core of the test suite (Catch2 v2), to read beside the papers.
//
//   [reference]  the CPU reference (reference.cpp) against facts you can work out by hand, and its
//                gradients against finite differences: the ground truth the GPU is checked on
//   [tile]       the tile chooser on four real GPUs' figures
//   [forward], [backward]  the GPU kernels against the reference over grids of shapes (odd and
//                unequal lengths, causal on and off, batched heads, every head dim); [sanitize]
//                is the small subset `make sanitize` runs under compute-sanitizer
//   [masking]    rows that see no key: O = 0, L = -inf, zero gradients
//   [fp32], [fp16], [bf16]  the element types: a test whose body is the same in every type is
//                one TEMPLATE_TEST_CASE over (fp32, fp16, bf16), its instances named "<name> - fp32",
//                "<name> - fp16" and "<name> - bf16" (so a name's ending selects one type's run;
//                the tags select all three); chapter 2's own tests are over (fp16, bf16). fp32
//                runs chapter 1's kernels, fp16 and bf16 chapter 2's (Kernel::chapter2(), whatever
//                the GPU) against the reference run in double on the exact rounded inputs, within
//                tolerances16 and backward_tolerances16; on compute capability 9.0, where the
//                public forward runs chapter 3, the backward's O and L come from it
//   [hopper]     chapter 3's forward (flash_forward_fp16_hopper, _bf16_hopper) on chapter 2's
//                forward grid, sanitizer shapes, 100 identical calls, >65535 heads, >2^31
//                elements (with the [big] tests), its validation, and which chapter the public
//                forward runs; on a GPU other than compute capability 9.0 each says SKIPPED
// Everything else (argument validation, determinism, the caller-chosen Bc, extreme inputs, tensors
// past 65535 heads and 2^31 elements, the [.stress] and [.timing] tests) is in
// tests/test_hardening.cpp; the deadline every GPU wait runs under in tests/test_deadline.cpp; the
// helpers in tests/test_util.h, main() in tests/test_util.cpp; the documentation checks in
// tests/test_docs.cpp (make check).
//
// `make test` builds the one binary, test_flash, from these files and runs it. [cpu] tests run
// everywhere; [gpu] tests need a CUDA device, and without one they are left out (one line says
// so) unless a test spec is given on the command line. Every GPU call waits under a deadline: a
// kernel that hangs fails its test, naming the shape and what likely waits forever, and ends the
// run. [.stress] tests are hidden: `make stress` runs them. The last line printed is always
//   flash tests: N passed, M failed, K skipped
// Examples: ./test_flash "[cpu]"     ./test_flash "[reference]"     ./test_flash "[gpu]~[big]"
//           ./test_flash -s "[tile]"     ./test_flash --list-tests     ./test_flash "[fp16]"
//           ./test_flash "[fp16]~[big]"  (the tensor-core tests; "[fp16][cpu]" without a GPU)
//           ./test_flash "[fp16][backward]"  (the backward's tests that run in fp16, both files)
//           ./test_flash "* - bf16"      (the bf16 runs alone, by name; "* - fp16", "* - fp32")
//           ./test_flash "[stress]"      (the long runs: make stress)

#include "test_util.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;

// =============================================================================================
// CPU: the reference against facts derivable by hand

TEST_CASE("The reference gives the mean of the V rows when all keys are equal",
          "[cpu][reference]") {
    const AttentionShape s{2, 1, 4, 7, 16, false};
    auto p = random_problem<double>(s, 1);
    for (size_t bh = 0; bh < 2; ++bh)  // every key of a head = that head's key 0
        for (size_t j = 1; j < 7; ++j)
            for (size_t x = 0; x < 16; ++x) p.K[(bh * 7 + j) * 16 + x] = p.K[bh * 7 * 16 + x];
    const auto r = reference_forward(p);
    // Equal scores: P_ij = 1/7, O_i = mean of V, L_i = S_i + ln 7.
    Outputs<double> want{std::vector<double>(q_elems(s)), std::vector<double>(l_elems(s)), {}, {}, {}};
    for (size_t bh = 0; bh < 2; ++bh)
        for (size_t i = 0; i < 4; ++i) {
            double dot = 0;
            for (size_t x = 0; x < 16; ++x) dot += p.Q[(bh * 4 + i) * 16 + x] * p.K[bh * 7 * 16 + x];
            want.L[bh * 4 + i] = dot / 4.0 + std::log(7.0);
            for (size_t x = 0; x < 16; ++x) {
                double sum = 0;
                for (size_t j = 0; j < 7; ++j) sum += p.V[(bh * 7 + j) * 16 + x];
                want.O[(bh * 4 + i) * 16 + x] = sum / 7;
            }
        }
    check_close("O", r.O, want.O, 1e-14, s, q_layout(s));
    check_close("L", r.L, want.L, 1e-14, s, l_layout(s));
}

TEST_CASE("The reference gives the V row of a key whose score dominates", "[cpu][reference]") {
    const AttentionShape s{1, 2, 3, 6, 16, false};
    auto p = random_problem<double>(s, 2);
    std::mt19937 rng(7);
    std::uniform_real_distribution<double> pos(0.5, 1.0), small(-1.0, 1.0);
    for (auto& x : p.Q) x = pos(rng);
    for (auto& x : p.K) x = small(rng);
    const size_t hot = 4;  // key 4 of each head: entries 20, so its score >= 16 * 0.5 * 20 / 4 = 40
    for (size_t bh = 0; bh < 2; ++bh)
        for (size_t x = 0; x < 16; ++x) p.K[(bh * 6 + hot) * 16 + x] = 20.0;
    // Every other score is at most 16 * 1 * 1 / 4 = 4: the other five keys' weights add up to
    // less than 5 e^-36 ~ 1.2e-15, which moves O by less than 1e-14 (|V| < 6 here).
    const auto r = reference_forward(p);
    std::vector<double> want(q_elems(s));
    for (size_t bh = 0; bh < 2; ++bh)
        for (size_t i = 0; i < 3; ++i)
            for (size_t x = 0; x < 16; ++x)
                want[(bh * 3 + i) * 16 + x] = p.V[(bh * 6 + hot) * 16 + x];
    REQUIRE(max_abs(p.V) < 6);
    check_close("O", r.O, want, 1e-13, s, q_layout(s));
}

TEST_CASE("The reference's causal row 0 sees key 0 only when q_len == kv_len",
          "[cpu][reference][causal]") {
    const int n = GENERATE(1, 2, 9);
    const AttentionShape s{2, 2, n, n, 32, true};
    CAPTURE(n);
    const auto p = random_problem<double>(s, 3);
    const auto r = reference_forward(p);
    for (size_t bh = 0; bh < 4; ++bh) {
        // One key: P_00 = 1 exactly, so O_0 = V_0 and L_0 = S_00.
        double dot = 0;
        for (size_t x = 0; x < 32; ++x) dot += p.Q[bh * n * 32 + x] * p.K[bh * n * 32 + x];
        const std::vector<double> got_O(r.O.begin() + bh * n * 32, r.O.begin() + bh * n * 32 + 32);
        const std::vector<double> want_O(p.V.begin() + bh * n * 32, p.V.begin() + bh * n * 32 + 32);
        check_close("O row 0", got_O, want_O, 0.0, s, q_layout(s, bh));
        CHECK_THAT(r.L[bh * n], WithinRel(dot / std::sqrt(32.0), 1e-14));
    }
}

TEST_CASE("The reference gives O = 0 and L = -inf to rows that see no key",
          "[cpu][reference][causal][masking]") {
    const auto qk = GENERATE(std::make_pair(5, 3), std::make_pair(4, 1), std::make_pair(9, 8));
    const AttentionShape s{2, 3, qk.first, qk.second, 16, true};
    INFO(describe(s));
    const auto p = random_problem<double>(s, 4);
    const auto r = reference_forward(p);
    const int masked = masked_rows(s);
    REQUIRE(masked == qk.first - qk.second);
    for (size_t bh = 0; bh < 6; ++bh)
        for (int i = 0; i < s.q_len; ++i) {
            CAPTURE(bh, i);
            const double L = r.L[bh * s.q_len + i];
            if (i < masked) {
                CHECK(L == -std::numeric_limits<double>::infinity());
                for (int x = 0; x < 16; ++x) CHECK(r.O[(bh * s.q_len + i) * 16 + x] == 0.0);
            } else {
                CHECK(std::isfinite(L));
            }
        }
    // The first row that sees anything sees key 0 alone: O = V_0 exactly.
    for (size_t bh = 0; bh < 6; ++bh)
        for (int x = 0; x < 16; ++x)
            CHECK(r.O[(bh * s.q_len + masked) * 16 + x] == p.V[bh * s.kv_len * 16 + x]);
}

TEST_CASE("The reference's L is the log-sum-exp of the scaled scores", "[cpu][reference]") {
    const bool causal = GENERATE(false, true);
    const AttentionShape s{1, 2, 6, 9, 64, causal};
    INFO(describe(s));
    const auto p = random_problem<double>(s, 5);
    const auto r = reference_forward(p);
    // Straight from the definition, without the max-subtraction trick (fine for these scores).
    std::vector<double> want(l_elems(s));
    for (size_t bh = 0; bh < 2; ++bh)
        for (int i = 0; i < 6; ++i) {
            long double sum = 0;
            for (int j = 0; j <= (causal ? i + 3 : 8); ++j) {
                long double dot = 0;
                for (int x = 0; x < 64; ++x)
                    dot += (long double)p.Q[(bh * 6 + i) * 64 + x] * p.K[(bh * 9 + j) * 64 + x];
                sum += std::exp(dot / 8.0L);
            }
            want[bh * 6 + i] = double(std::log(sum));
        }
    check_close("L", r.L, want, 1e-13, s, l_layout(s));
}

TEST_CASE("The reference's causal mask is bottom-right aligned", "[cpu][reference][causal]") {
    // Causal query i sees keys 0 .. i + kv_len - q_len, so its output must equal non-causal
    // attention of that one query over just those keys.
    const auto qk = GENERATE(std::make_pair(3, 8), std::make_pair(1, 5), std::make_pair(7, 4),
                             std::make_pair(6, 6));
    const AttentionShape s{1, 1, qk.first, qk.second, 16, true};
    INFO(describe(s));
    const auto p = random_problem<double>(s, 6);
    const auto r = reference_forward(p);
    for (int i = 0; i < s.q_len; ++i) {
        const int seen = i + s.kv_len - s.q_len + 1;
        if (seen <= 0) continue;  // the rows that see nothing: the test above
        CAPTURE(i, seen);
        const AttentionShape one{1, 1, 1, seen, 16, false};
        const std::vector<double> q(p.Q.begin() + i * 16, p.Q.begin() + (i + 1) * 16);
        const std::vector<double> k(p.K.begin(), p.K.begin() + seen * 16);
        const std::vector<double> v(p.V.begin(), p.V.begin() + seen * 16);
        std::vector<double> o(16), l(1);
        attention_reference(q.data(), k.data(), v.data(), o.data(), l.data(), one);
        const std::vector<double> got(r.O.begin() + i * 16, r.O.begin() + (i + 1) * 16);
        check_close("O", got, o, 1e-15, s, q_layout(s));
        CHECK_THAT(r.L[i], WithinAbs(l[0], 1e-15));
    }
}

TEST_CASE("The float and double references agree", "[cpu][reference]") {
    const AttentionShape s{1, 2, 33, 20, 32, true};
    const auto p = random_problem<double>(s, 7);
    const auto pf = converted<float>(p);
    const auto pd = converted<double>(pf);  // the same float inputs, exactly, in double
    const auto rf = reference_backward(pf);
    const auto rd = reference_backward(pd);
    // Both accumulate in double; the float version only rounds its results to float (and its
    // backward reads O and L so rounded, which moves P by about u |L|): well within 1e-5 of the
    // largest entry.
    auto check = [&](const char* name, const std::vector<float>& f, const std::vector<double>& d,
                     const FlatLayout& layout) {
        check_close(name, f, d, 1e-5 * std::max(1.0, max_abs(d)), s, layout);
    };
    check("O", rf.O, rd.O, q_layout(s));
    check("L", rf.L, rd.L, l_layout(s));
    check("dQ", rf.dQ, rd.dQ, q_layout(s));
    check("dK", rf.dK, rd.dK, kv_layout(s));
    check("dV", rf.dV, rd.dV, kv_layout(s));
}

TEST_CASE("The reference gives the same bits on any number of threads", "[cpu][reference]") {
    // It shares its rows (and keys) out over the cores: each row's sums run in their own order
    // whatever the threads do, so 1 thread and 7 must agree in every bit, forward and backward.
    const AttentionShape s = GENERATE(AttentionShape{2, 3, 100, 77, 64, true},
                                      AttentionShape{1, 1, 300, 257, 128, false},
                                      AttentionShape{1, 2, 257, 33, 16, true});
    INFO(describe(s));
    const auto p = random_problem<double>(s, 9);
    attention_reference_threads(1);
    const auto one = reference_backward(p);
    attention_reference_threads(7);
    const auto seven = reference_backward(p);
    attention_reference_threads(0);
    for (const auto& [name, a, b] :
         {std::tuple{"O", &one.O, &seven.O}, std::tuple{"L", &one.L, &seven.L},
          std::tuple{"dQ", &one.dQ, &seven.dQ}, std::tuple{"dK", &one.dK, &seven.dK},
          std::tuple{"dV", &one.dV, &seven.dV}}) {
        INFO(name);
        REQUIRE(a->size() == b->size());
        CHECK(std::memcmp(a->data(), b->data(), a->size() * sizeof(double)) == 0);
    }
}

TEST_CASE("The reference's gradients match central finite differences of its forward",
          "[cpu][reference][backward]") {
    // loss = sum(O * dO) for a random dO, so dloss/dO = dO; each input element is nudged by
    // +-h and (loss(+h) - loss(-h)) / 2h compared with the reference backward's gradient. In
    // double with h = 1e-5, truncation (~h^2) and cancellation (~1e-16 / h) errors are ~1e-10.
    const AttentionShape s = GENERATE(AttentionShape{1, 2, 3, 5, 16, true},   // q < kv
                                      AttentionShape{1, 2, 5, 3, 16, true},   // rows 0, 1 masked
                                      AttentionShape{2, 1, 4, 4, 16, false},
                                      AttentionShape{1, 1, 1, 6, 16, true},
                                      AttentionShape{1, 1, 6, 2, 32, true},   // rows 0..3 masked
                                      AttentionShape{1, 1, 7, 3, 16, false});
    INFO(describe(s));
    const auto p = random_problem<double>(s, 8);
    const auto r = reference_backward(p);
    for (double x : r.dQ) REQUIRE(std::isfinite(x));
    auto loss = [&](const Problem<double>& q) {
        const auto f = reference_forward(q);
        double sum = 0;
        for (size_t e = 0; e < f.O.size(); ++e) sum += f.O[e] * q.dO[e];
        return sum;
    };
    const double h = 1e-5;
    auto numeric = [&](std::vector<double> Problem<double>::*tensor) {
        Problem<double> q = p;
        std::vector<double> g((q.*tensor).size());
        for (size_t e = 0; e < g.size(); ++e) {
            const double keep = (q.*tensor)[e];
            (q.*tensor)[e] = keep + h;
            const double up = loss(q);
            (q.*tensor)[e] = keep - h;
            const double down = loss(q);
            (q.*tensor)[e] = keep;
            g[e] = (up - down) / (2 * h);
        }
        return g;
    };
    const double tol = 1e-8 * std::max({1.0, max_abs(r.dQ), max_abs(r.dK), max_abs(r.dV)});
    check_close("dQ (analytic vs numeric)", r.dQ, numeric(&Problem<double>::Q), tol, s, q_layout(s));
    check_close("dK (analytic vs numeric)", r.dK, numeric(&Problem<double>::K), tol, s, kv_layout(s));
    check_close("dV (analytic vs numeric)", r.dV, numeric(&Problem<double>::V), tol, s, kv_layout(s));
    // Rows that see nothing have no gradient at all.
    for (int i = 0; i < masked_rows(s); ++i)
        for (int x = 0; x < s.head_dim; ++x) CHECK(r.dQ[size_t(i) * s.head_dim + x] == 0.0);
}

// =============================================================================================
// CPU: the tile chooser on four real GPUs' figures

TEST_CASE("The tile chooser gives valid tiles on T4, A100, RTX 4090 and H100", "[cpu][tile]") {
    for (const cudaDeviceProp& prop : known_gpus())
        for (int d : kFlashHeadDims) {
            check_tile("forward", flash_choose_tile(prop, d), prop, d);
            check_tile("backward", flash_choose_tile_backward(prop, d), prop, d);
        }
}

TEST_CASE("The fp16 tile chooser gives valid tiles on A100, RTX 4090 and H100, and refuses the T4",
          "[cpu][tile][fp16]") {
    for (const cudaDeviceProp& prop : known_gpus()) {
        INFO(prop.name << " (sm_" << prop.major << prop.minor << ")");
        if (prop.major < 8) {  // the T4: no mma.m16n8k16 nor cp.async
            for (int d : kFlashFp16HeadDims) {
                CAPTURE(d);
                std::string msg;  // stays empty unless a std::runtime_error is thrown
                try {
                    flash_choose_tile_fp16(prop, d);
                } catch (const std::runtime_error& e) {
                    msg = e.what();
                }
                CHECK_THAT(msg, Catch::Matchers::Contains("compute capability 8.0"));
            }
            continue;
        }
        for (int d : kFlashFp16HeadDims) {
            const FlashTile t = flash_choose_tile_fp16(prop, d);
            check_tile_fp16(t, prop, d);
            // The rule: the most keys registers allow (128 to d = 64, 64 to d = 128, 32 at 256),
            // halved while the block does not fit the device's shared memory.
            int Bc = d <= 64 ? 128 : d <= 128 ? 64 : 32;
            while (Bc > 32 && size_t(t.Br + 4 * Bc) * (d + 8) * 2 > prop.sharedMemPerBlockOptin)
                Bc /= 2;
            INFO("head_dim " << d << ": the block may have " << prop.sharedMemPerBlockOptin
                             << " bytes");
            CHECK(t.Bc == Bc);
        }
    }
    // By hand: (Br + 4 Bc)(d + 8) * 2 bytes, Br = 128 (64 at d = 256). The H100 (227 KiB a block)
    // and the A100 (163 KiB) take the register-bound Bc at every d; the RTX 4090 (99 KiB) fits
    // d = 128 with Bc = 32 only (Bc = 64 needs 104448 bytes, it has 101376), and d = 256 exactly.
    const std::vector<std::pair<int, size_t>> h100_bytes = {
        {16, 30720}, {32, 51200}, {64, 92160}, {96, 79872}, {128, 104448}, {256, 101376}};
    for (const cudaDeviceProp& prop : known_gpus()) {
        if (prop.major < 8) continue;
        const bool small = prop.sharedMemPerBlockOptin < 104448;  // the RTX 4090
        for (const auto& db : h100_bytes) {
            const int d = int(db.first);
            CAPTURE(prop.name, d);
            const FlashTile t = flash_choose_tile_fp16(prop, d);
            CHECK(t.Bc == (d <= 64 ? 128 : d == 256 ? 32 : small && d == 128 ? 32 : 64));
            if (!(small && d == 128)) CHECK(t.shared_bytes == db.second);
        }
    }
}

TEST_CASE("The fp16 backward tile chooser takes the first tile of its list whose block fits "
          "shared memory, and refuses the T4", "[cpu][tile][fp16][backward]") {
    // The block holds K_j and V_j (Bc rows each), two stages of Q_i and dO_i (Br rows each), P^T
    // and dS^T (Bc rows of Br + 8 halves each) and two stages of L_i and D_i (Br floats each);
    // rows of d + 8 halves. By hand, (Bc, Br) = (128, 64): (256 + 256)(d + 8) * 2 + 2 * 128 * 72
    // * 2 + 1024 is 78848, 111616, 144384, 177152 at d = 32, 64, 96, 128. (128, 128) at d = 64:
    // (256 + 512) * 72 * 2 + 2 * 128 * 136 * 2 + 2048 = 182272. (64, 64): (128 + 256)(d + 8) * 2
    // + 2 * 64 * 72 * 2 + 1024 is 37888, 50176, 74752, 99328, 123904 at d = 16 .. 128, and at
    // d = 256 384 * 264 * 2 + 18432 + 1024 = 222208. (64, 32) at d = 256: 256 * 264 * 2 + 2 * 64
    // * 40 * 2 + 512 = 145920. Opt-in limits: H100 232448 (the first tile everywhere); A100 166912
    // ((128, 64) at d = 64, (64, 64) at d = 128, (64, 32) at d = 256); RTX 4090 101376 ((64, 64)
    // at d = 64 and 96; d = 128 and 256 refused with std::runtime_error naming the device). The
    // T4 (sm_75) is refused before any of that: compute capability 8.0.
    const std::tuple<int, int, int, size_t> by_hand[] = {
        {32, 128, 64, 78848},   {64, 128, 64, 111616}, {96, 128, 64, 144384},
        {128, 128, 64, 177152}, {64, 128, 128, 182272}, {16, 64, 64, 37888},
        {32, 64, 64, 50176},    {64, 64, 64, 74752},   {96, 64, 64, 99328},
        {128, 64, 64, 123904},  {256, 64, 64, 222208}, {256, 64, 32, 145920}};
    for (const auto& [d, Bc, Br, bytes] : by_hand) CHECK(fp16_backward_bytes(d, Bc, Br) == bytes);
    int named = 0;
    for (const cudaDeviceProp& prop : known_gpus()) {
        const std::string name = prop.name;
        INFO(name << " (sm_" << prop.major << prop.minor << "), opt-in limit "
                  << prop.sharedMemPerBlockOptin << " bytes");
        for (int d : kFlashFp16HeadDims) {
            CAPTURE(d);
            std::string msg;  // stays empty unless a std::runtime_error is thrown
            FlashTile t{};
            try {
                t = flash_choose_tile_fp16_backward(prop, d);
            } catch (const std::runtime_error& e) {
                msg = e.what();
            }
            INFO("message: " << msg);
            if (prop.major < 8) {  // the T4: no mma.m16n8k16 nor cp.async
                CHECK_THAT(msg, Catch::Matchers::Contains("compute capability 8.0"));
                continue;
            }
            // The figures above, GPU by GPU: the (Bc, Br) it takes, (0, 0) where it refuses.
            std::pair<int, int> want = d == 16 ? std::pair(64, 64)
                                       : d == 64  ? std::pair(128, 128)
                                       : d == 256 ? std::pair(64, 64)
                                                  : std::pair(128, 64);
            if (name.find("A100") != std::string::npos) {
                if (d == 64) want = {128, 64};
                if (d == 128) want = {64, 64};
                if (d == 256) want = {64, 32};
            }
            if (name.find("4090") != std::string::npos) {
                if (d == 64 || d == 96) want = {64, 64};
                if (d >= 128) want = {0, 0};
            }
            if (want.first == 0) {
                CHECK_THAT(msg, Catch::Matchers::Contains(prop.name) &&
                                    Catch::Matchers::Contains("shared memory") &&
                                    Catch::Matchers::Contains("head_dim " + std::to_string(d)));
            } else {
                CHECK(msg.empty());
                CHECK(std::pair(t.Bc, t.Br) == want);
                check_tile_fp16_backward(t, prop, d);
            }
        }
        named += name.find("A100") != std::string::npos || name.find("4090") != std::string::npos ||
                 name.find("H100") != std::string::npos;
    }
    CHECK(named == 3);
}

// =============================================================================================
// GPU: the kernels against the reference. One body for every element type (TEMPLATE_TEST_CASE
// over fp32, fp16, bf16): fp32 against the reference in float within tolerances(); fp16 and bf16
// against the reference run in double on the exact rounded inputs, within tolerances16 and
// backward_tolerances16 (derived in test_util.h from the type's rounding).

namespace {
// The grid tests' bodies: each test case below and its [.stress] twin run one on their share of
// the list (tests/test_util.h, Share), with the same salt, so that together they run it all
// (bf16's backward: a fifth of the default share in the default run, share_for).
template <typename T>
void check_forward_grid(Share share) {
    const AttentionShape s = GENERATE_COPY(from_range(forward_grid(head_dims_of<T>(), share)));
    check_forward_on_gpu<T>(s, per_type<T>(100u, 1100u), own_chapter<T>());
}
template <typename T>
void check_hopper_forward_grid(Share share) {
    if (!hopper_or_warn()) return;
    const AttentionShape s = GENERATE_COPY(from_range(forward_grid(kHopperHeadDims, share)));
    check_forward_on_gpu<T>(s, 1100, Kernel::chapter3());
}
template <typename T>
void check_backward_grid(Share share) {
    const std::vector<int>& dims = head_dims_of<T>();
    const AttentionShape s = GENERATE_COPY(from_range(share_for<T>(
        backward_grid(dims, Share::fast), backward_grid(dims, Share::stress), share)));
    for (const Kernel kernel : backward_kernels<T>(s.head_dim))
        check_backward_on_gpu<T>(s, per_type<T>(200u, 2100u), kernel);
}
template <typename T>
void check_masked_backward(Share share) {
    const AttentionShape s = GENERATE_COPY(from_range(masking_shapes(head_dims_of<T>(), share)));
    INFO(describe(s) << ": rows 0.." << masked_rows(s) - 1 << " of every head see no key");
    for (const Kernel kernel : backward_kernels<T>(s.head_dim))  // chapters 2 and 3
        check_masked_rows(check_backward_on_gpu<T>(s, per_type<T>(300u, 2400u), kernel), s);
}
template <typename T>
void check_masked_forward(Share share) {
    const Kernel kernel = GENERATE(Kernel::chapter2(), Kernel::public_call());
    const AttentionShape s = GENERATE_COPY(from_range(masking_shapes(kFp16HeadDims, share)));
    if (kernel == Kernel::public_call() && !public_forward_runs_hopper(s.head_dim))
        NOT_HERE("chapter 2 again");
    INFO(describe(s) << ": rows 0.." << masked_rows(s) - 1 << " of every head see no key");
    check_masked_rows(check_forward_on_gpu<T>(s, 1400, kernel), s);
}
}  // namespace

TEMPLATE_TEST_CASE("The forward matches the reference over a grid of shapes",
                   "[gpu][forward][fp32][fp16][bf16]", fp32, fp16, bf16) {
    // Odd lengths, q_len != kv_len both ways, causal and not, batched heads, every head dim of the
    // type's chapter, on that chapter's kernel whatever the GPU (own_chapter: chapter 1 for fp32,
    // chapter 2 for fp16 and bf16); the reference runs on the inputs as rounded to TestType.
    check_forward_grid<TestType>(Share::fast);
}

TEMPLATE_TEST_CASE("The forward matches the reference over a grid of shapes, the rest (make "
                   "stress)",
                   "[gpu][forward][fp32][fp16][bf16][.stress]", fp32, fp16, bf16) {
    check_forward_grid<TestType>(Share::stress);
}

TEMPLATE_TEST_CASE("The Hopper forward matches the reference over a grid of shapes",
                   "[gpu][forward][hopper][fp16][bf16]", fp16, bf16) {
    // Chapter 3 (flash_forward_*_hopper) on chapter 2's grid (odd lengths, q_len != kv_len both
    // ways, causal and not, rows that see no key, batched heads) at the head dims it runs, against
    // the same reference and the same tolerances. Only a GPU of compute capability 9.0 runs it.
    check_hopper_forward_grid<TestType>(Share::fast);
}

TEMPLATE_TEST_CASE("The Hopper forward matches the reference over a grid of shapes, the rest "
                   "(make stress)",
                   "[gpu][forward][hopper][fp16][bf16][.stress]", fp16, bf16) {
    check_hopper_forward_grid<TestType>(Share::stress);
}

TEMPLATE_TEST_CASE("flash_forward_fp16 and _bf16 run chapter 3 on compute capability 9.0 at its "
                   "head dims and chapter 2 everywhere else", "[gpu][forward][hopper][fp16][bf16]",
                   fp16, bf16) {
    // The public call's O and L, bitwise, against those of the chapter it should have run (both
    // are deterministic, and the two chapters differ in the last bits: their sums run in other
    // orders), over every head dim.
    const int d = GENERATE(16, 32, 64, 96, 128, 256);
    const AttentionShape s{2, 3, 200, 333, d, true};
    const bool hopper = public_forward_runs_hopper(d);
    INFO(describe(s) << ", expecting chapter " << (hopper ? 3 : 2));
    const auto p = rounded_problem<TestType>(s, 1450);
    GpuAttention<TestType> gpu(p);
    gpu.forward(Kernel::public_call());
    const Outputs<float> chosen = gpu.outputs(false);
    gpu.forward(hopper ? Kernel::chapter3() : Kernel::chapter2());
    check_bitwise(chosen, gpu.outputs(false), s);
    if (hopper) {  // and the test can tell the chapters apart: chapter 2's bits differ
        gpu.forward(Kernel::chapter2());
        CHECK_FALSE(bitwise_equal(chosen, gpu.outputs(false)));
    }
}

TEMPLATE_TEST_CASE("The backward matches the reference over a grid of shapes",
                   "[gpu][backward][fp32][fp16][bf16]", fp32, fp16, bf16) {
    // The same kinds of shape, fewer (the reference's backward costs three times its forward).
    // Q, K, V and a random dO are rounded to TestType; the kernels run the forward for their own
    // O and L, then the backward; the reference computes its own O and L.
    // fp16 and bf16: chapter 2's backward, then on an H100 at chapter 3's head dims chapter 3's.
    check_backward_grid<TestType>(Share::fast);
}

TEMPLATE_TEST_CASE("The backward matches the reference over a grid of shapes, the rest (make "
                   "stress)",
                   "[gpu][backward][fp32][fp16][bf16][.stress]", fp32, fp16, bf16) {
    check_backward_grid<TestType>(Share::stress);
}

TEMPLATE_TEST_CASE("The Hopper backward is right when its tickets go out a few heads at a time",
                   "[gpu][backward][hopper][gqa][fp16][bf16]", fp16, bf16) {
    // Under the mask chapter 3's launcher hands out the blocks' tickets HG heads at a time, HG =
    // 2 SMs / (K/V tiles), at most 32: on a 132-SM H100, 7 at 4500 keys (36 tiles), so 9 heads go
    // as a group of 7 and one of 2, and 36 blocks add into each dQ_i in turn. The grid's lengths
    // (at most 8 tiles) all give 32. Short queries keep the reference cheap. (GQA's such shape:
    // tests/test_gqa.cpp, "GQA at head dim 256 and on a longer sequence".)
    if (!hopper_or_warn()) return;
    check_backward_on_gpu<TestType>(AttentionShape{1, 9, 130, 4500, 64, true}, 4500,
                                    Kernel::public_call());
}

// The subset `make sanitize` runs under compute-sanitizer (which slows kernels 10-100x): small
// shapes that still cover odd and unequal lengths, a partial last tile, causal on and off,
// batched heads and every head dim, forward and backward (sanitizer_shapes). In fp16 and bf16 the
// long pair is 150 for fp32's 100, so that a head has two or three Q tiles (of 64 rows; 128 at
// d = 64 on an H100; the last partial) and two K/V tiles (128 keys; three of 64 at d = 16 and
// 256), whose blocks add into each dQ_i in turn: the ordered add runs under the sanitizer.
TEMPLATE_TEST_CASE("Small shapes for the sanitizer: forward and backward match the reference",
                   "[gpu][.sanitize][forward][backward][fp32][fp16][bf16]", fp32, fp16, bf16) {
    const int n = per_type<TestType>(100, 150);
    const AttentionShape s = GENERATE_COPY(from_range(sanitizer_shapes(head_dims_of<TestType>(), n)));
    for (const Kernel kernel : backward_kernels<TestType>(s.head_dim))  // chapters 2 and 3
        check_backward_on_gpu<TestType>(s, per_type<TestType>(300u, 2300u), kernel);
}

// Chapter 2's forward's share of the sanitizer's subset, in fp16 and bf16: the same small shapes,
// forward only, on chapter 2's kernel whatever the GPU (the test above runs the public call).
TEMPLATE_TEST_CASE("Small shapes for the sanitizer: the tensor-core forward matches the reference",
                   "[gpu][.sanitize][forward][fp16][bf16]", fp16, bf16) {
    const AttentionShape s = GENERATE(from_range(sanitizer_shapes(kFp16HeadDims, 100)));
    check_forward_on_gpu<TestType>(s, 1300, Kernel::chapter2());
}

TEMPLATE_TEST_CASE("Small shapes for the sanitizer: the Hopper forward matches the reference",
                   "[gpu][.sanitize][forward][hopper][fp16][bf16]", fp16, bf16) {
    if (!hopper_or_warn()) return;
    const AttentionShape s = GENERATE(from_range(sanitizer_shapes(kHopperHeadDims, 150)));
    check_forward_on_gpu<TestType>(s, 1350, Kernel::chapter3());
}

// The masking tests check every output against the reference, masked rows included (dK and dV
// get nothing from the masked rows: the reference's contributions are exactly zero there), then
// that the masked rows hold exactly O = 0, L = -inf and dQ = 0.
TEMPLATE_TEST_CASE("Rows that see no key get O = 0, L = -inf and zero gradients on the GPU",
                   "[gpu][masking][forward][backward][hardening][fp32][fp16][bf16]", fp32, fp16,
                   bf16) {
    check_masked_backward<TestType>(Share::fast);
}

TEMPLATE_TEST_CASE("Rows that see no key get O = 0, L = -inf and zero gradients on the GPU, the "
                   "rest (make stress)",
                   "[gpu][masking][forward][backward][hardening][fp32][fp16][bf16][.stress]", fp32, fp16,
                   bf16) {
    check_masked_backward<TestType>(Share::stress);
}

TEMPLATE_TEST_CASE("Rows that see no key get O = 0 and L = -inf from the tensor-core forward",
                   "[gpu][masking][forward][hardening][fp16][bf16]", fp16, bf16) {
    // Chapter 2's kernel, then the public call where it runs chapter 3 (public_forward_runs_hopper).
    check_masked_forward<TestType>(Share::fast);
}

TEMPLATE_TEST_CASE("Rows that see no key get O = 0 and L = -inf from the tensor-core forward, the "
                   "rest (make stress)",
                   "[gpu][masking][forward][hardening][fp16][bf16][.stress]", fp16, bf16) {
    check_masked_forward<TestType>(Share::stress);
}
