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
// Its second half, attention_reference_general, is the ground truth for attention as models call
// it (the planned chapter 5): the softmax scale, sliding windows, softcap, ALiBi, grouped K/V
// heads, any strides and packed sequences of their own lengths (reference.h states the rules;
// tests/test_reference_general.cpp checks it on the CPU).

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

// ---------------------------------------------------------------------------------------------
// Chapter 5's reference (reference.h states the rules): one sequence's row i of head h at a time,
// the visible keys a window [first, last] of the sequence's keys.

// The K/V heads (kv_heads, or heads where 0), and the score scale (softmax_scale, or 1/sqrt(d)).
int kv_heads_of(const ReferenceProblem& p) { return p.kv_heads ? p.kv_heads : p.heads; }
double scale_of(const ReferenceProblem& p) {
    return p.softmax_scale > 0 ? p.softmax_scale : 1.0 / std::sqrt(double(p.head_dim));
}
// Sequence b's first row and length, of the queries (keys = false) or the keys.
std::pair<long long, int> sequence_of(const ReferenceProblem& p, int b, bool keys) {
    if (keys && p.cache_seqlens) return {0, p.cache_seqlens[b]};
    const int* cu = keys ? p.cu_seqlens_k : p.cu_seqlens_q;
    if (!cu) return {0, keys ? p.kv_len : p.q_len};
    return {cu[b], cu[b + 1] - cu[b]};
}
// Element x of row `row` (of sequence b, head h) in a tensor of strides st.
long long at(const ReferenceProblem& p, const ReferenceStrides& st, int b, int h, long long row) {
    const long long first = p.cu_seqlens_q || p.cu_seqlens_k ? 0 : b * st.batch;
    return first + h * st.head + row * st.row;
}
// The same for a key row (K, V, dK, dV): through the block table where the cache is paged.
long long key_at(const ReferenceProblem& p, const ReferenceStrides& st, int b, int h,
                 long long row) {
    if (!p.block_table) return at(p, st, b, h, row);
    const long long page = p.block_table[size_t(b) * p.pages_per_seq + row / p.page_size];
    return page * st.batch + h * st.head + (row % p.page_size) * st.row;
}

void check_problem(const ReferenceProblem& p) {
    require(p.batch >= 1, "batch = " + std::to_string(p.batch) + "; allowed values: >= 1");
    require(p.heads >= 1, "heads = " + std::to_string(p.heads) + "; allowed values: >= 1");
    require(p.head_dim >= 1, "head_dim = " + std::to_string(p.head_dim) + "; allowed values: >= 1");
    const int kv_heads = kv_heads_of(p);
    require(kv_heads >= 1 && p.heads % kv_heads == 0,
            "kv_heads = " + std::to_string(p.kv_heads) + "; allowed values: 0, or a divisor of heads");
    require(p.window_left >= -1, "window_left = " + std::to_string(p.window_left) +
                                     "; allowed values: -1 (no bound) or >= 0");
    require(p.window_right >= -1, "window_right = " + std::to_string(p.window_right) +
                                      "; allowed values: -1 (no bound) or >= 0");
    require(std::isfinite(p.softcap) && p.softcap >= 0,
            "softcap = " + std::to_string(p.softcap) + "; allowed values: 0 (none) or > 0");
    require(std::isfinite(p.softmax_scale) && p.softmax_scale >= 0,
            "softmax_scale = " + std::to_string(p.softmax_scale) +
                "; allowed values: 0 (1/sqrt(head_dim)) or > 0");
    require(!p.cu_seqlens_q == !p.cu_seqlens_k,
            "cu_seqlens_q and cu_seqlens_k: give both (packed sequences) or neither");
    require(!p.cache_seqlens || !p.cu_seqlens_q,
            "cache_seqlens: a K/V cache takes no cu_seqlens; give one or the other");
    require(!p.block_table || p.cache_seqlens,
            "block_table: a paged cache needs cache_seqlens (each sequence's keys)");
    if (p.cache_seqlens) {
        require(p.kv_len >= 1, "kv_len = " + std::to_string(p.kv_len) + "; allowed values: >= 1");
        for (int b = 0; b < p.batch; ++b) {
            const int n = p.cache_seqlens[b];
            require(n >= 0 && n <= p.kv_len, "cache_seqlens[" + std::to_string(b) + "] = " +
                                                 std::to_string(n) + "; allowed values: 0 to " +
                                                 "kv_len = " + std::to_string(p.kv_len));
        }
    }
    if (p.block_table) {
        require(p.page_size >= 1, "page_size = " + std::to_string(p.page_size) +
                                      "; allowed values: >= 1");
        require(p.pages_per_seq >= (p.kv_len + p.page_size - 1) / p.page_size,
                "pages_per_seq = " + std::to_string(p.pages_per_seq) + "; allowed values: at " +
                    "least ceil(kv_len / page_size) = " +
                    std::to_string((p.kv_len + p.page_size - 1) / p.page_size));
        for (int b = 0; b < p.batch; ++b)
            for (int j = 0; j < p.pages_per_seq && j * p.page_size < p.cache_seqlens[b]; ++j)
                require(p.block_table[size_t(b) * p.pages_per_seq + j] >= 0,
                        "block_table[" + std::to_string(b) + "][" + std::to_string(j) + "] = " +
                            std::to_string(p.block_table[size_t(b) * p.pages_per_seq + j]) +
                            "; allowed values: >= 0 (a page)");
    }
    if (p.cu_seqlens_q) {
        for (const int* cu : {p.cu_seqlens_q, p.cu_seqlens_k}) {
            const std::string name = cu == p.cu_seqlens_q ? "cu_seqlens_q" : "cu_seqlens_k";
            require(cu[0] == 0, name + "[0] = " + std::to_string(cu[0]) + "; allowed value: 0");
            for (int b = 0; b < p.batch; ++b)
                require(cu[b + 1] >= cu[b], name + "[" + std::to_string(b + 1) + "] = " +
                                                std::to_string(cu[b + 1]) + " < " + name + "[" +
                                                std::to_string(b) + "]; allowed: non-decreasing");
        }
    } else {
        require(p.q_len >= 1, "q_len = " + std::to_string(p.q_len) + "; allowed values: >= 1");
        require(p.kv_len >= 1, "kv_len = " + std::to_string(p.kv_len) + "; allowed values: >= 1");
    }
}

// One row's visible keys and its scores: row i of a sequence of q rows and n keys.
struct GeneralRow {
    long long first = 0, last = -1;  // the visible keys, first .. last (none when last < first)
    std::vector<double> s, cap;      // s_ij, and d(softcap)/d(scale Q.K) at each visible j
};
GeneralRow scores_of(const ReferenceProblem& p, int b, int h, int i) {
    const auto [q0, q] = sequence_of(p, b, false);
    const auto [k0, n] = sequence_of(p, b, true);
    const int group = p.heads / kv_heads_of(p);
    const long long shifted = static_cast<long long>(i) + n - q;  // i'
    GeneralRow r;
    r.first = p.window_left < 0 ? 0 : std::max<long long>(0, shifted - p.window_left);
    long long last = n - 1;
    if (p.window_right >= 0) last = std::min(last, shifted + p.window_right);
    if (p.causal) last = std::min(last, shifted);
    r.last = last;
    const double scale = scale_of(p);
    const double* Qi = p.Q + at(p, p.q, b, h, q0 + i);
    for (long long j = r.first; j <= r.last; ++j) {
        const double* Kj = p.K + key_at(p, p.k, b, h / group, k0 + j);
        double dot = 0.0;
        for (int x = 0; x < p.head_dim; ++x) dot += Qi[x] * Kj[x];
        double s = scale * dot, cap = 1.0;
        if (p.softcap > 0) {
            const double t = std::tanh(s / p.softcap);
            s = p.softcap * t;
            cap = 1.0 - t * t;  // d/ds of c tanh(s / c)
        }
        if (p.alibi_slopes)
            s -= p.alibi_slopes[p.alibi_per_batch ? size_t(b) * p.heads + h : size_t(h)] *
                 std::fabs(double(shifted - j));
        r.s.push_back(s);
        r.cap.push_back(cap);
    }
    return r;
}
// L_i = log sum_j exp(s_ij) over the visible keys (-inf when none).
double logsumexp(const std::vector<double>& s) {
    if (s.empty()) return -std::numeric_limits<double>::infinity();
    const double m = *std::max_element(s.begin(), s.end());
    double sum = 0.0;
    for (double v : s) sum += std::exp(v - m);
    return m + std::log(sum);
}
// Where L_i goes: [batch][heads][q_len], or [heads][total_q] for packed sequences.
long long l_index(const ReferenceProblem& p, int b, int h, int i) {
    if (p.cu_seqlens_q) return static_cast<long long>(h) * p.cu_seqlens_q[p.batch] + p.cu_seqlens_q[b] + i;
    return (static_cast<long long>(b) * p.heads + h) * p.q_len + i;
}

}  // namespace

ReferenceStrides reference_contiguous(int heads, int len, int head_dim) {
    const long long row = head_dim, head = row * len;
    return {head * heads, head, row};
}

void attention_reference_general(const ReferenceProblem& p) {
    check_problem(p);
    const int d = p.head_dim;
    for_each_index(size_t(p.batch) * p.heads, 1e7, [&](size_t bh) {
        const int b = int(bh / p.heads), h = int(bh % p.heads);
        const auto [q0, q] = sequence_of(p, b, false);
        const long long k0 = sequence_of(p, b, true).first;
        const int group = p.heads / kv_heads_of(p);
        for (int i = 0; i < q; ++i) {
            const GeneralRow r = scores_of(p, b, h, i);
            const double L = logsumexp(r.s);
            std::vector<double> o(d, 0.0);
            for (long long j = r.first; j <= r.last; ++j) {
                const double P = std::exp(r.s[j - r.first] - L);
                const double* Vj = p.V + key_at(p, p.v, b, h / group, k0 + j);
                for (int x = 0; x < d; ++x) o[x] += P * Vj[x];
            }
            double* Oi = p.O + at(p, p.o, b, h, q0 + i);
            for (int x = 0; x < d; ++x) Oi[x] = o[x];
            p.L[l_index(p, b, h, i)] = L;
        }
    });
}

// dS_ij = P_ij (dP_ij - D_i), dP_ij = dO_i . V_j, D_i = sum_j P_ij dP_ij; through the softcap and
// the scale, d(loss)/d(Q_i . K_j) = dS_ij cap_ij scale: dQ_i sums it times K_j, dK_j times Q_i,
// and dV_j sums P_ij dO_i. One task a (sequence, K/V head): its group's rows in order, so every
// sum runs in one fixed order.
void attention_reference_general_backward(const ReferenceProblem& p) {
    check_problem(p);
    require(!p.cache_seqlens, "cache_seqlens: a K/V cache has no backward here (inference)");
    const int d = p.head_dim, kv_heads = kv_heads_of(p);
    const int group = p.heads / kv_heads;
    const double scale = scale_of(p);
    for_each_index(size_t(p.batch) * kv_heads, 1e7, [&](size_t bg) {
        const int b = int(bg / kv_heads), g = int(bg % kv_heads);
        const auto [q0, q] = sequence_of(p, b, false);
        const auto [k0, n] = sequence_of(p, b, true);
        std::vector<double> dk(size_t(n) * d, 0.0), dv(size_t(n) * d, 0.0);
        for (int h = g * group; h < (g + 1) * group; ++h)
            for (int i = 0; i < q; ++i) {
                const GeneralRow r = scores_of(p, b, h, i);
                const double L = logsumexp(r.s);
                const double* Qi = p.Q + at(p, p.q, b, h, q0 + i);
                const double* dOi = p.dO + at(p, p.d_o, b, h, q0 + i);
                const size_t m = r.s.size();
                std::vector<double> P(m), dP(m);
                double D = 0.0;
                for (size_t c = 0; c < m; ++c) {
                    const double* Vj = p.V + at(p, p.v, b, g, k0 + r.first + (long long)c);
                    P[c] = std::exp(r.s[c] - L);
                    for (int x = 0; x < d; ++x) dP[c] += dOi[x] * Vj[x];
                    D += P[c] * dP[c];
                }
                std::vector<double> dq(d, 0.0);
                for (size_t c = 0; c < m; ++c) {
                    const long long j = r.first + (long long)c;
                    const double* Kj = p.K + at(p, p.k, b, g, k0 + j);
                    const double dS = P[c] * (dP[c] - D) * r.cap[c] * scale;
                    for (int x = 0; x < d; ++x) {
                        dq[x] += dS * Kj[x];
                        dk[j * d + x] += dS * Qi[x];
                        dv[j * d + x] += P[c] * dOi[x];
                    }
                }
                double* dQi = p.dQ + at(p, p.dq, b, h, q0 + i);
                for (int x = 0; x < d; ++x) dQi[x] = dq[x];
            }
        for (int j = 0; j < n; ++j) {
            double* dKj = p.dK + at(p, p.dk, b, g, k0 + j);
            double* dVj = p.dV + at(p, p.dv, b, g, k0 + j);
            for (int x = 0; x < d; ++x) {
                dKj[x] = dk[size_t(j) * d + x];
                dVj[x] = dv[size_t(j) * d + x];
            }
        }
    });
}

namespace {
}  // namespace

void attention_reference_threads(unsigned threads) { g_threads = threads; }
void attention_reference_for_each(size_t n, double work, const std::function<void(size_t)>& body) {
    for_each_index(n, work, body);
}

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
