// reference.cpp: the CPU reference for attention, forward and backward: the ground truth the GPU
// kernels in flash.cu are tested against (test_flash.cpp) and checked against (flash_bench).
//
// It is written as plainly as the math, one query row at a time, with no tiling and no tricks
// beyond subtracting the row maximum before exp. Every sum is accumulated in double, whether the
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
    return {static_cast<size_t>(s.head_dim), static_cast<size_t>(s.q_len),
            static_cast<size_t>(s.kv_len),
            static_cast<size_t>(s.batch) * static_cast<size_t>(s.heads),
            1.0 / std::sqrt(static_cast<double>(s.head_dim))};
}

// Forward: O and L from Q, K, V.
template <typename T>
void forward(const T* Q, const T* K, const T* V, T* O, T* L, const AttentionShape& s) {
    validate_shape(s);
    const auto [d, q_len, kv_len, heads, scale] = sizes_of(s);

    std::vector<double> S(kv_len);  // one row of scores
    std::vector<double> o(d);       // one row of output
    for (size_t bh = 0; bh < heads; ++bh) {
        const T* Qh = Q + bh * q_len * d;
        const T* Kh = K + bh * kv_len * d;
        const T* Vh = V + bh * kv_len * d;
        T* Oh = O + bh * q_len * d;
        T* Lh = L + bh * q_len;
        for (size_t i = 0; i < q_len; ++i) {
            const size_t n = visible_keys(s, static_cast<int>(i));
            if (n == 0) {  // sees nothing: O = 0, L = -inf
                for (size_t x = 0; x < d; ++x) Oh[i * d + x] = T(0);
                Lh[i] = -std::numeric_limits<T>::infinity();
                continue;
            }
            // S_ij = Q_i . K_j / sqrt(d), and the row maximum.
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
            std::fill(o.begin(), o.end(), 0.0);
            for (size_t j = 0; j < n; ++j) {
                const double e = std::exp(S[j] - m);
                sum += e;
                for (size_t x = 0; x < d; ++x) o[x] += e * static_cast<double>(Vh[j * d + x]);
            }
            for (size_t x = 0; x < d; ++x) Oh[i * d + x] = static_cast<T>(o[x] / sum);
            Lh[i] = static_cast<T>(m + std::log(sum));  // log sum_j exp(S_ij)
        }
    }
}

// Backward: dQ, dK, dV from dO, with O and L as the forward left them.
template <typename T>
void backward(const T* Q, const T* K, const T* V, const T* O, const T* dO, const T* L, T* dQ,
              T* dK, T* dV, const AttentionShape& s) {
    validate_shape(s);
    const auto [d, q_len, kv_len, heads, scale] = sizes_of(s);

    // dK and dV of one head gather over all query rows: accumulate them in double, then store.
    std::vector<double> dK_acc(kv_len * d), dV_acc(kv_len * d), dq(d);
    for (size_t bh = 0; bh < heads; ++bh) {
        const T* Qh = Q + bh * q_len * d;
        const T* Kh = K + bh * kv_len * d;
        const T* Vh = V + bh * kv_len * d;
        const T* Oh = O + bh * q_len * d;
        const T* dOh = dO + bh * q_len * d;
        const T* Lh = L + bh * q_len;
        T* dQh = dQ + bh * q_len * d;
        T* dKh = dK + bh * kv_len * d;
        T* dVh = dV + bh * kv_len * d;
        std::fill(dK_acc.begin(), dK_acc.end(), 0.0);
        std::fill(dV_acc.begin(), dV_acc.end(), 0.0);

        for (size_t i = 0; i < q_len; ++i) {
            const size_t n = visible_keys(s, static_cast<int>(i));
            std::fill(dq.begin(), dq.end(), 0.0);
            // D_i = dO_i . O_i
            double D = 0.0;
            for (size_t x = 0; x < d; ++x)
                D += static_cast<double>(dOh[i * d + x]) * static_cast<double>(Oh[i * d + x]);
            // Only the keys the row sees (none when n == 0: then dQ_i = 0 and L_i is not read).
            for (size_t j = 0; j < n; ++j) {
                double dot = 0.0, dP = 0.0;
                for (size_t x = 0; x < d; ++x) {
                    dot += static_cast<double>(Qh[i * d + x]) * static_cast<double>(Kh[j * d + x]);
                    dP += static_cast<double>(dOh[i * d + x]) * static_cast<double>(Vh[j * d + x]);
                }
                const double P = std::exp(dot * scale - static_cast<double>(Lh[i]));  // P_ij
                const double dS = P * (dP - D);                                       // dS_ij
                for (size_t x = 0; x < d; ++x) {
                    dV_acc[j * d + x] += P * static_cast<double>(dOh[i * d + x]);
                    dK_acc[j * d + x] += dS * static_cast<double>(Qh[i * d + x]) * scale;
                    dq[x] += dS * static_cast<double>(Kh[j * d + x]) * scale;
                }
            }
            for (size_t x = 0; x < d; ++x) dQh[i * d + x] = static_cast<T>(dq[x]);
        }
        for (size_t e = 0; e < kv_len * d; ++e) {
            dKh[e] = static_cast<T>(dK_acc[e]);
            dVh[e] = static_cast<T>(dV_acc[e]);
        }
    }
}

}  // namespace

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
