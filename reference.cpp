// reference.cpp: the CPU reference for attention, forward and backward: the ground truth the GPU
// kernels in flash.cu are tested against (test_flash.cpp) and checked against (flash_bench).
//
// It is written as plainly as the math, one query row at a time, with no tiling and no tricks
// beyond subtracting the row maximum before exp; the rows (and, backward, the keys) are shared out
// over the machine's cores, which changes no bit of the result. Every sum is accumulated in double, whether the
// tensors are float or double. The contract is the GPU's (see flash.h):
//   Q, O: [batch][heads][q_len][head_dim]   K, V: [batch][heads][kv_len][head_dim]
//   L:    [batch][heads][q_len]
//   S_ij = Q_i . K_j / sqrt(d)        L_i = log sum_j exp(S_ij)        P_ij = exp(S_ij - L_i)
//   O_i  = sum_j P_ij V_j
// Causal masking is bottom-right aligned: query i sees key j iff j <= i + kv_len - q_len. A row
// that sees no key gets O_i = 0 and L_i = -inf (never NaN), and contributes nothing backward.

#include "checks.h"
#include "reference.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <thread>
#include <vector>

namespace {

// How many keys query row i sees: the keys 0 .. visible-1 (0 when the row sees none).
size_t visible_keys(const AttentionShape& s, int i) {
    if (!s.causal) return static_cast<size_t>(s.kv_len);
    // Query i sees key j iff j <= i + kv_len - q_len, so it sees the first i + kv_len - q_len + 1.
    const long long last = static_cast<long long>(i) + s.kv_len - s.q_len;
    if (last < 0) return 0;
    return static_cast<size_t>(std::min<long long>(last + 1, s.kv_len));
}

// What both passes loop over, as size_t: head_dim, q_len, kv_len, batch * heads; and the score
// scale 1/sqrt(head_dim).
struct Sizes {
    size_t d, q_len, kv_len, heads;
    double scale;
};
Sizes sizes_of(const AttentionShape& s) {
    // The reference is multi-head attention only, on purpose: a test of grouped K/V heads runs it
    // on K and V repeated to every query head (tests/test_gqa.cpp), sharing no indexing with the
    // kernels. Refused, so that grouped tensors are never read as if they had every head.
    require(flash_kv_heads(s) == s.heads,
            "shape.kv_heads = " + std::to_string(s.kv_heads) + " is not supported by the CPU "
            "reference; allowed values: 0 or heads (repeat K and V to every query head)");
    return {static_cast<size_t>(s.head_dim), static_cast<size_t>(s.q_len),
            static_cast<size_t>(s.kv_len),
            static_cast<size_t>(s.batch) * static_cast<size_t>(s.heads),
            1.0 / std::sqrt(static_cast<double>(s.head_dim))};
}

// Runs body(k) for k = 0 .. n-1 on up to g_threads threads (thread t takes k = t, t + threads,
// ...: rows of different lengths under the causal mask share out evenly). Every k writes its own
// outputs and reads nothing another k writes, so the results are the same, bit for bit, as a plain
// loop's; a problem of less than a million multiply-adds (`work`) runs in a plain loop.
unsigned g_threads = 0;  // 0: std::thread::hardware_concurrency()

template <typename F>
void for_each_index(size_t n, double work, F&& body) {
    const unsigned cores = g_threads ? g_threads : std::max(1u, std::thread::hardware_concurrency());
    const size_t threads = work < 1e6 ? 1 : std::min<size_t>(cores, n);
    if (threads <= 1) {
        for (size_t k = 0; k < n; ++k) body(k);
        return;
    }
    std::vector<std::thread> pool;
    for (size_t t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
            for (size_t k = t; k < n; k += threads) body(k);
        });
    for (std::thread& thread : pool) thread.join();
}

// Forward: O and L from Q, K, V, one query row (of one head) at a time.
template <typename T>
void forward(const T* Q, const T* K, const T* V, T* O, T* L, const AttentionShape& s) {
    validate_shape(s);
    const auto [d, q_len, kv_len, heads, scale] = sizes_of(s);

    for_each_index(heads * q_len, double(heads) * q_len * kv_len * d, [&](size_t row) {
        const size_t bh = row / q_len, i = row % q_len;
        const T* Qh = Q + bh * q_len * d;
        const T* Kh = K + bh * kv_len * d;
        const T* Vh = V + bh * kv_len * d;
        T* Oh = O + bh * q_len * d;
        T* Lh = L + bh * q_len;
        const size_t n = visible_keys(s, static_cast<int>(i));
        if (n == 0) {  // sees nothing: O = 0, L = -inf
            for (size_t x = 0; x < d; ++x) Oh[i * d + x] = T(0);
            Lh[i] = -std::numeric_limits<T>::infinity();
            return;
        }
        // S_ij = Q_i . K_j / sqrt(d), and the row maximum.
        std::vector<double> S(n);  // the row's scores
        double m = -std::numeric_limits<double>::infinity();
        for (size_t j = 0; j < n; ++j) {
            double dot = 0.0;
            for (size_t x = 0; x < d; ++x)
                dot += static_cast<double>(Qh[i * d + x]) * static_cast<double>(Kh[j * d + x]);
            S[j] = dot * scale;
            m = std::max(m, S[j]);
        }
        // sum_j exp(S_ij - m) and sum_j exp(S_ij - m) V_j; exp never overflows (S_ij - m <= 0)
        // and the sum is at least 1 (the maximum's own term).
        double sum = 0.0;
        std::vector<double> o(d, 0.0);  // the row's output
        for (size_t j = 0; j < n; ++j) {
            const double e = std::exp(S[j] - m);
            sum += e;
            for (size_t x = 0; x < d; ++x) o[x] += e * static_cast<double>(Vh[j * d + x]);
        }
        for (size_t x = 0; x < d; ++x) Oh[i * d + x] = static_cast<T>(o[x] / sum);
        Lh[i] = static_cast<T>(m + std::log(sum));  // log sum_j exp(S_ij)
    });
}

// Backward: dQ, dK, dV from dO, with O and L as the forward left them. dQ_i sums over the keys
// row i sees, dK_j and dV_j over the rows that see key j: two passes, one a query row at a time,
// one a key at a time, each computing P_ij and dS_ij afresh (the same expressions, so the same
// values), so that every sum has its own row or key and runs in its own order (keys, or rows,
// ascending) whatever the threads do.
template <typename T>
void backward(const T* Q, const T* K, const T* V, const T* O, const T* dO, const T* L, T* dQ,
              T* dK, T* dV, const AttentionShape& s) {
    validate_shape(s);
    const auto [d, q_len, kv_len, heads, scale] = sizes_of(s);

    // D_i = dO_i . O_i, row i of head bh.
    const auto D_of = [&](size_t bh, size_t i) {
        const T* dOi = dO + (bh * q_len + i) * d;
        const T* Oi = O + (bh * q_len + i) * d;
        double D = 0.0;
        for (size_t x = 0; x < d; ++x) D += static_cast<double>(dOi[x]) * static_cast<double>(Oi[x]);
        return D;
    };
    // P_ij = exp(S_ij - L_i) and dS_ij = P_ij (dP_ij - D_i), with dP_ij = dO_i . V_j.
    const auto P_dS_of = [&](size_t bh, size_t i, size_t j, double D, double& P, double& dS) {
        const T* Qi = Q + (bh * q_len + i) * d;
        const T* dOi = dO + (bh * q_len + i) * d;
        const T* Kj = K + (bh * kv_len + j) * d;
        const T* Vj = V + (bh * kv_len + j) * d;
        double dot = 0.0, dP = 0.0;
        for (size_t x = 0; x < d; ++x) {
            dot += static_cast<double>(Qi[x]) * static_cast<double>(Kj[x]);
            dP += static_cast<double>(dOi[x]) * static_cast<double>(Vj[x]);
        }
        P = std::exp(dot * scale - static_cast<double>(L[bh * q_len + i]));
        dS = P * (dP - D);
    };
    const double work = double(heads) * q_len * kv_len * d;

    // dQ_i = sum_j dS_ij K_j / sqrt(d) over the keys row i sees (none: dQ_i = 0, L_i unread).
    for_each_index(heads * q_len, work, [&](size_t row) {
        const size_t bh = row / q_len, i = row % q_len;
        const size_t n = visible_keys(s, static_cast<int>(i));
        const double D = D_of(bh, i);
        std::vector<double> dq(d, 0.0);
        for (size_t j = 0; j < n; ++j) {
            double P, dS;
            P_dS_of(bh, i, j, D, P, dS);
            const T* Kj = K + (bh * kv_len + j) * d;
            for (size_t x = 0; x < d; ++x) dq[x] += dS * static_cast<double>(Kj[x]) * scale;
        }
        for (size_t x = 0; x < d; ++x) dQ[row * d + x] = static_cast<T>(dq[x]);
    });
    // dV_j = sum_i P_ij dO_i and dK_j = sum_i dS_ij Q_i / sqrt(d) over the rows that see key j.
    for_each_index(heads * kv_len, work, [&](size_t key) {
        const size_t bh = key / kv_len, j = key % kv_len;
        std::vector<double> dk(d, 0.0), dv(d, 0.0);
        for (size_t i = 0; i < q_len; ++i) {
            if (j >= visible_keys(s, static_cast<int>(i))) continue;
            double P, dS;
            P_dS_of(bh, i, j, D_of(bh, i), P, dS);
            const T* Qi = Q + (bh * q_len + i) * d;
            const T* dOi = dO + (bh * q_len + i) * d;
            for (size_t x = 0; x < d; ++x) {
                dv[x] += P * static_cast<double>(dOi[x]);
                dk[x] += dS * static_cast<double>(Qi[x]) * scale;
            }
        }
        for (size_t x = 0; x < d; ++x) {
            dK[key * d + x] = static_cast<T>(dk[x]);
            dV[key * d + x] = static_cast<T>(dv[x]);
        }
    });
}

}  // namespace

void attention_reference_threads(unsigned threads) { g_threads = threads; }

void attention_reference(const float* Q, const float* K, const float* V, float* O, float* L,
                         const AttentionShape& shape) {
    forward(Q, K, V, O, L, shape);
}

void attention_reference(const double* Q, const double* K, const double* V, double* O, double* L,
                         const AttentionShape& shape) {
    forward(Q, K, V, O, L, shape);
}

void attention_reference_backward(const float* Q, const float* K, const float* V, const float* O,
                                  const float* dO, const float* L, float* dQ, float* dK, float* dV,
                                  const AttentionShape& shape) {
    backward(Q, K, V, O, dO, L, dQ, dK, dV, shape);
}

void attention_reference_backward(const double* Q, const double* K, const double* V,
                                  const double* O, const double* dO, const double* L, double* dQ,
                                  double* dK, double* dV, const AttentionShape& shape) {
    backward(Q, K, V, O, dO, L, dQ, dK, dV, shape);
}
