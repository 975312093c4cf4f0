// flash_torch.cpp: the PyTorch binding of flash.h, for flash_torch.py (which builds and loads it
// on first use, with torch.utils.cpp_extension; or: make torch). Two functions, forward and
// backward, over (batch, heads, seq, head_dim) CUDA tensors in fp32, fp16 or bf16, on PyTorch's
// current stream, with chapter 5's options (flash.h's AttentionOptions: fp16 and bf16 only), the
// same two over packed sequences (varlen_forward, varlen_backward), and a decode step over a K/V
// cache (kvcache_forward).
// Every check of flash.h's launchers runs as it does from C++; this file adds the ones only a
// tensor can fail (device, dtype, rank, layout, matching sizes). Bad input raises ValueError
// (pybind11's translation of std::invalid_argument) with the message; a CUDA failure raises
// RuntimeError.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "flash.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

// Bad input: std::invalid_argument, which pybind11 raises as ValueError. The messages are built
// only on failure, and without iostreams (c10::str): iostream code instantiated in this module
// can clash with the libstdc++ PyTorch was built with (a segfault on the H100 machine's image).
[[noreturn]] static void fail(const std::string& message) {
    throw std::invalid_argument(message);
}
// A dtype as Python spells it (torch.float16 is "float16"; c10 would say "Half").
static std::string name(c10::ScalarType t) {
    switch (t) {
        case torch::kFloat32: return "float32";
        case torch::kFloat16: return "float16";
        case torch::kBFloat16: return "bfloat16";
        case torch::kFloat64: return "float64";
        default: return c10::toString(t);
    }
}
// A tensor's shape as "(1, 2, 8, 64)".
static std::string dims(const torch::Tensor& t) {
    std::string out = "(";
    for (int64_t i = 0; i < t.dim(); i++) out += (i ? ", " : "") + std::to_string(t.size(i));
    return out + ")";
}

// Whether the kernels can read t where it lies: contiguous at a 16-byte aligned address, or, in
// float16 and bfloat16 (chapter 5's strides), its last dimension contiguous and every other
// stride a multiple of 8 elements (16 bytes), at least 8 (the rows' at least head_dim) and below
// 2^39, but for a dimension of one index (flash.h's AttentionLayout rule). flash_torch.py's
// _readable is the same rule.
static bool readable(const torch::Tensor& t) {
    if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
    if (t.is_contiguous()) return true;
    if (t.scalar_type() == torch::kFloat32 || t.dim() != 4 || t.stride(3) != 1) return false;
    for (int64_t i = 0; i < 3; i++) {
        const int64_t least = i == 2 ? std::max<int64_t>(t.size(3), 8) : 8;  // rows apart
        if (t.size(i) > 1 && (t.stride(i) < least || t.stride(i) % 8 != 0 ||
                              t.stride(i) >= (int64_t(1) << 39)))
            return false;
    }
    return true;
}

// The shape of q (B, H, q_len, d) and k (B, H_kv, kv_len, d), after checking what flash.h cannot
// see: that every tensor is a 4-D CUDA tensor of one dtype on one device that the kernels can
// read where it lies (readable, below), and that the sizes agree (flash.h's own checks then name
// anything out of range, e.g. the head dim, or a stride).
// Grouped-query attention as SDPA's enable_gqa=True: k and v may have H_kv heads, a divisor of
// q's H; query head h then reads K/V head h / (H / H_kv).
static AttentionShape shape_of(const char* fn, const std::vector<torch::Tensor>& ts,
                               const std::vector<std::string>& names, bool causal) {
    const torch::Tensor& q = ts[0];
    const torch::Tensor& k = ts[1];
    for (size_t i = 0; i < ts.size(); i++) {
        const std::string what = std::string(fn) + ": " + names[i];
        if (!ts[i].is_cuda())
            fail(what + " must be a CUDA tensor (it is on " + ts[i].device().str() + ")");
        if (ts[i].device() != q.device())
            fail(what + " is on " + ts[i].device().str() + ", q on " + q.device().str());
        if (ts[i].dim() != 4)
            fail(what + " must be 4-D (batch, heads, seq, head_dim); it is " + dims(ts[i]));
        if (!readable(ts[i]))
            fail(what + " must be contiguous (float16 and bfloat16: or strided with its last " +
                 "dimension contiguous, other strides multiples of 8 elements, 16-byte aligned; " +
                 "flash_torch.py copies any other)");
        for (int64_t size : ts[i].sizes())
            if (size > INT_MAX) fail(what + " is " + dims(ts[i]) + ": a size exceeds INT_MAX");
    }
    if (k.size(0) != q.size(0) || k.size(3) != q.size(3))
        fail(std::string(fn) + ": q is " + dims(q) + " and k is " + dims(k) +
             ": batch and head_dim must match");
    if (k.size(1) < 1 || q.size(1) % k.size(1) != 0)  // (a k of 0 heads is no kv_heads = 0)
        fail(std::string(fn) + ": q is " + dims(q) + " and k is " + dims(k) +
             ": k's heads must divide q's (grouped-query attention: H a multiple of H_kv)");
    for (size_t i = 0; i < ts.size(); i++) {
        if (ts[i].scalar_type() != q.scalar_type())
            fail(std::string(fn) + ": " + names[i] + " is " + name(ts[i].scalar_type()) +
                 ", q is " + name(q.scalar_type()) + "; all must have one dtype");
        const torch::Tensor& like = names[i] == "k" || names[i] == "v" ? k : q;
        if (ts[i].sizes() != like.sizes())
            fail(std::string(fn) + ": " + names[i] + " is " + dims(ts[i]) + ", expected " +
                 dims(like) + " (k and v: (B, H_kv, kv_len, d); q, o, do: (B, H, q_len, d))");
    }
    return AttentionShape{int(q.size(0)), int(q.size(1)), int(q.size(2)), int(k.size(2)),
                          int(q.size(3)), causal, int(k.size(1))};
}

// Chapter 5's strides: a tensor's (batch, head, row) strides in elements, as flash.h's
// AttentionLayout takes them; none (contiguous) where it is contiguous.
static TensorStrides strides_of(const torch::Tensor& t) {
    if (t.is_contiguous()) return {};
    return {t.stride(0), t.stride(1), t.stride(2)};
}
// An output shaped as t, laid out as t's rows are: (B, seq, H, d) in memory, seen as (B, H, seq,
// d), where t's heads lie closer together than its rows (a view of a (B, seq, H, d) tensor, as
// from a fused projection: the output is then what the model's transpose back expects, at no
// copy); else contiguous.
static torch::Tensor empty_laid_out_as(const torch::Tensor& t) {
    const bool rows_apart = t.size(1) > 1 && t.size(2) > 1 && t.stride(1) < t.stride(2);
    if (rows_apart && t.scalar_type() != torch::kFloat32)
        return torch::empty({t.size(0), t.size(2), t.size(1), t.size(3)}, t.options())
            .transpose(1, 2);
    return torch::empty_like(t, torch::MemoryFormat::Contiguous);
}

// Chapter 5's options from FlashAttention-2's keyword arguments (scale 0: 1/sqrt(d)); ALiBi's
// slopes, if any, a contiguous float32 CUDA tensor on q's device of shape (H,) or (B, H).
// flash.h checks the rest (the window's bounds, the softcap, the scale) and names the field.
static AttentionOptions options_of(const char* fn, const AttentionShape& s, const torch::Tensor& q,
                                   double scale, int64_t left, int64_t right, double softcap,
                                   const c10::optional<torch::Tensor>& alibi) {
    AttentionOptions o;
    o.softmax_scale = float(scale), o.softcap = float(softcap);
    if ((scale != 0 && o.softmax_scale == 0) || (softcap != 0 && o.softcap == 0))
        fail(std::string(fn) + ": softmax_scale and softcap must be 0 or at least 2^-32 (a value " +
             "that rounds to 0 as a float would silently mean the default)");
    if (left < INT_MIN || left > INT_MAX || right < INT_MIN || right > INT_MAX)
        fail(std::string(fn) + ": window_size must fit an int");
    o.window_left = int(left), o.window_right = int(right);
    if (alibi) {
        const torch::Tensor& a = *alibi;
        const bool per_head = a.dim() == 1 && a.size(0) == s.heads;
        const bool per_batch = a.dim() == 2 && a.size(0) == s.batch && a.size(1) == s.heads;
        if (!a.is_cuda() || a.device() != q.device() || a.scalar_type() != torch::kFloat32 ||
            !a.is_contiguous() || !(per_head || per_batch))
            fail(std::string(fn) + ": alibi_slopes is " + dims(a) + " " + name(a.scalar_type()) +
                 " on " + a.device().str() + "; allowed: a contiguous float32 tensor on q's " +
                 "device of shape (heads,) or (batch, heads), here (" + std::to_string(s.heads) +
                 ",) or (" + std::to_string(s.batch) + ", " + std::to_string(s.heads) + ")");
        o.alibi_slopes = a.data_ptr<float>(), o.alibi_per_batch = per_batch;
    }
    if (q.scalar_type() == torch::kFloat32 && !flash_options_plain(o))
        fail(std::string(fn) + ": softmax_scale, window_size, softcap and alibi_slopes need " +
             "float16 or bfloat16 (chapter 5 is chapter 2's kernels; float32 is chapter 1's)");
    return o;
}

// Calls f with the tensors' element type: float, __half or __nv_bfloat16.
template <typename F>
static void with_dtype(const char* fn, const torch::Tensor& q, F&& f) {
    switch (q.scalar_type()) {
        case torch::kFloat32: return f(float{});
        case torch::kFloat16: return f(__half{});
        case torch::kBFloat16: return f(__nv_bfloat16{});
        default:
            fail(std::string(fn) + ": dtype " + name(q.scalar_type()) +
                 " is not supported; allowed: float32, float16, bfloat16");
    }
}
template <typename T>
static T* ptr(const torch::Tensor& t) {
    return reinterpret_cast<T*>(t.data_ptr());
}

// O = softmax(q k^T / sqrt(d)) v and L = logsumexp of each row (fp32, (B, H, q_len)), the scores
// changed as the options say.
static std::tuple<torch::Tensor, torch::Tensor> forward(
    torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal, double scale, int64_t left,
    int64_t right, double softcap, c10::optional<torch::Tensor> alibi) {
    const AttentionShape s = shape_of("flash_attention", {q, k, v}, {"q", "k", "v"}, causal);
    const AttentionOptions options = options_of("flash_attention", s, q, scale, left, right,
                                                softcap, alibi);
    const c10::cuda::CUDAGuard guard(q.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    torch::Tensor o = empty_laid_out_as(q);
    torch::Tensor L = torch::empty({q.size(0), q.size(1), q.size(2)},
                                   q.options().dtype(torch::kFloat32));
    AttentionOptions opt = options;
    opt.layout.Q = strides_of(q), opt.layout.K = strides_of(k), opt.layout.V = strides_of(v);
    opt.layout.O = strides_of(o);
    with_dtype("flash_attention", q, [&](auto zero) {
        using T = decltype(zero);
        if constexpr (std::is_same_v<T, float>)
            flash_forward(ptr<T>(q), ptr<T>(k), ptr<T>(v), ptr<T>(o), ptr<float>(L), s, stream);
        else if constexpr (std::is_same_v<T, __half>)
            flash_forward_fp16(ptr<T>(q), ptr<T>(k), ptr<T>(v), ptr<T>(o), ptr<float>(L), s, opt,
                               stream);
        else
            flash_forward_bf16(ptr<T>(q), ptr<T>(k), ptr<T>(v), ptr<T>(o), ptr<float>(L), s, opt,
                               stream);
    });
    return {o, L};
}

// dq, dk, dv from the forward's o and L and the gradient do of the loss with respect to o.
static std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> backward(
    torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor o, torch::Tensor dO,
    torch::Tensor L, bool causal, double scale, int64_t left, int64_t right, double softcap,
    c10::optional<torch::Tensor> alibi, bool deterministic) {
    const AttentionShape s =
        shape_of("flash_attention backward", {q, k, v, o, dO}, {"q", "k", "v", "o", "do"}, causal);
    AttentionOptions opt = options_of("flash_attention backward", s, q, scale, left, right,
                                      softcap, alibi);
    opt.deterministic = deterministic;  // (chapter 1, float32, is deterministic either way)
    if (!L.is_cuda() || L.device() != q.device() || !L.is_contiguous() ||
        L.scalar_type() != torch::kFloat32 ||
        L.sizes() != torch::IntArrayRef({q.size(0), q.size(1), q.size(2)}))
        fail("flash_attention backward: L must be a contiguous float32 CUDA tensor of shape "
             "(B, H, q_len) on q's device");
    const c10::cuda::CUDAGuard guard(q.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    torch::Tensor dq = empty_laid_out_as(q), dk = empty_laid_out_as(k), dv = empty_laid_out_as(v);
    opt.layout = {strides_of(q),  strides_of(k),  strides_of(v),  strides_of(o),
                  strides_of(dO), strides_of(dq), strides_of(dk), strides_of(dv)};
    with_dtype("flash_attention backward", q, [&](auto zero) {
        using T = decltype(zero);
        if constexpr (std::is_same_v<T, float>)
            flash_backward(ptr<T>(q), ptr<T>(k), ptr<T>(v), ptr<T>(o), ptr<T>(dO), ptr<float>(L),
                           ptr<T>(dq), ptr<T>(dk), ptr<T>(dv), s, stream);
        else if constexpr (std::is_same_v<T, __half>)
            flash_backward_fp16(ptr<T>(q), ptr<T>(k), ptr<T>(v), ptr<T>(o), ptr<T>(dO),
                                ptr<float>(L), ptr<T>(dq), ptr<T>(dk), ptr<T>(dv), s, opt, stream);
        else
            flash_backward_bf16(ptr<T>(q), ptr<T>(k), ptr<T>(v), ptr<T>(o), ptr<T>(dO),
                                ptr<float>(L), ptr<T>(dq), ptr<T>(dk), ptr<T>(dv), s, opt, stream);
    });
    return {dq, dk, dv};
}

// Chapter 5's packed batches (flash.h's PackedBatch; FlashAttention-2's flash_attn_varlen_func):
// q (total_q, H, d), k and v (total_k, H_kv, d), seen by flash_torch.py as the (1, H, total, d)
// views they are (unsqueeze(0).transpose(1, 2): rows H d apart, heads d), so that shape_of and
// strides_of read them as they read any batch of one; cu_seqlens_q and _k int32 CUDA tensors of
// batch + 1 offsets, max_seqlen_q and _k the longest lengths. L is (H, total_q).
static AttentionShape packed_shape_of(const char* fn, const AttentionShape& one,
                                      const torch::Tensor& q, const torch::Tensor& cu_q,
                                      const torch::Tensor& cu_k, int64_t max_q, int64_t max_k) {
    for (const torch::Tensor* cu : {&cu_q, &cu_k})
        if (!cu->is_cuda() || cu->device() != q.device() || cu->scalar_type() != torch::kInt32 ||
            cu->dim() != 1 || !cu->is_contiguous() || cu->size(0) < 2 ||
            cu->size(0) != cu_q.size(0))
            fail(std::string(fn) + ": " + (cu == &cu_q ? "cu_seqlens_q" : "cu_seqlens_k") +
                 " is " + dims(*cu) + " " + name(cu->scalar_type()) + " on " +
                 cu->device().str() + "; allowed: a contiguous int32 tensor on q's device of " +
                 "batch + 1 offsets, the same size as the other");
    if (q.scalar_type() == torch::kFloat32)
        fail(std::string(fn) + ": packed sequences need float16 or bfloat16 (chapters 2 and "
             "3; float32 is chapter 1's)");
    if (max_q < 1 || max_q > INT_MAX || max_k < 1 || max_k > INT_MAX || cu_q.size(0) > INT_MAX)
        fail(std::string(fn) + ": max_seqlen_q = " + std::to_string(max_q) + ", max_seqlen_k = " +
             std::to_string(max_k) + "; allowed: 1 to INT_MAX each");
    AttentionShape s = one;
    s.batch = int(cu_q.size(0) - 1), s.q_len = int(max_q), s.kv_len = int(max_k);
    return s;
}
static PackedBatch packed_of(const AttentionShape& one, const torch::Tensor& cu_q,
                             const torch::Tensor& cu_k) {
    return {cu_q.data_ptr<int>(), cu_k.data_ptr<int>(), one.q_len, one.kv_len};
}

static std::tuple<torch::Tensor, torch::Tensor> varlen_forward(
    torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cu_q, torch::Tensor cu_k,
    int64_t max_q, int64_t max_k, bool causal, double scale, int64_t left, int64_t right,
    double softcap, c10::optional<torch::Tensor> alibi) {
    const char* fn = "flash_attention_varlen";
    const AttentionShape one = shape_of(fn, {q, k, v}, {"q", "k", "v"}, causal);
    const AttentionShape s = packed_shape_of(fn, one, q, cu_q, cu_k, max_q, max_k);
    AttentionOptions opt = options_of(fn, s, q, scale, left, right, softcap, alibi);
    const c10::cuda::CUDAGuard guard(q.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    torch::Tensor o = empty_laid_out_as(q);
    torch::Tensor L = torch::empty({q.size(1), q.size(2)}, q.options().dtype(torch::kFloat32));
    opt.packed = packed_of(one, cu_q, cu_k);
    opt.layout.Q = strides_of(q), opt.layout.K = strides_of(k), opt.layout.V = strides_of(v);
    opt.layout.O = strides_of(o);
    with_dtype(fn, q, [&](auto zero) {
        using T = decltype(zero);
        if constexpr (std::is_same_v<T, __half>)
            flash_forward_fp16(ptr<T>(q), ptr<T>(k), ptr<T>(v), ptr<T>(o), ptr<float>(L), s, opt,
                               stream);
        else if constexpr (std::is_same_v<T, __nv_bfloat16>)
            flash_forward_bf16(ptr<T>(q), ptr<T>(k), ptr<T>(v), ptr<T>(o), ptr<float>(L), s, opt,
                               stream);
    });
    return {o, L};
}

static std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> varlen_backward(
    torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor o, torch::Tensor dO,
    torch::Tensor L, torch::Tensor cu_q, torch::Tensor cu_k, int64_t max_q, int64_t max_k,
    bool causal, double scale, int64_t left, int64_t right, double softcap,
    c10::optional<torch::Tensor> alibi, bool deterministic) {
    const char* fn = "flash_attention_varlen backward";
    const AttentionShape one =
        shape_of(fn, {q, k, v, o, dO}, {"q", "k", "v", "o", "do"}, causal);
    const AttentionShape s = packed_shape_of(fn, one, q, cu_q, cu_k, max_q, max_k);
    AttentionOptions opt = options_of(fn, s, q, scale, left, right, softcap, alibi);
    opt.deterministic = deterministic;
    if (!L.is_cuda() || L.device() != q.device() || !L.is_contiguous() ||
        L.scalar_type() != torch::kFloat32 ||
        L.sizes() != torch::IntArrayRef({q.size(1), q.size(2)}))
        fail(std::string(fn) + ": L must be a contiguous float32 CUDA tensor of shape (H, "
             "total_q) on q's device");
    const c10::cuda::CUDAGuard guard(q.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    torch::Tensor dq = empty_laid_out_as(q), dk = empty_laid_out_as(k), dv = empty_laid_out_as(v);
    opt.packed = packed_of(one, cu_q, cu_k);
    opt.layout = {strides_of(q),  strides_of(k),  strides_of(v),  strides_of(o),
                  strides_of(dO), strides_of(dq), strides_of(dk), strides_of(dv)};
    with_dtype(fn, q, [&](auto zero) {
        using T = decltype(zero);
        if constexpr (std::is_same_v<T, __half>)
            flash_backward_fp16(ptr<T>(q), ptr<T>(k), ptr<T>(v), ptr<T>(o), ptr<T>(dO),
                                ptr<float>(L), ptr<T>(dq), ptr<T>(dk), ptr<T>(dv), s, opt, stream);
        else if constexpr (std::is_same_v<T, __nv_bfloat16>)
            flash_backward_bf16(ptr<T>(q), ptr<T>(k), ptr<T>(v), ptr<T>(o), ptr<T>(dO),
                                ptr<float>(L), ptr<T>(dq), ptr<T>(dk), ptr<T>(dv), s, opt, stream);
    });
    return {dq, dk, dv};
}

// Chapter 4's K/V cache (flash.h's KVCache; FlashAttention-2's flash_attn_with_kvcache), for
// inference: q (B, H, q_len, d); k_cache and v_cache (B, H_kv, capacity, d), or, with
// block_table (B, pages_per_seq), pages (num_pages, H_kv, page_size, d); cache_seqlens (B,); k
// and v (B, H_kv, new_len, d), appended into the caches in place first. All contiguous, on q's
// device; the tables int32. Returns o and L (B, H, q_len).
static std::tuple<torch::Tensor, torch::Tensor> kvcache_forward(
    torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor cache_seqlens,
    c10::optional<torch::Tensor> block_table, c10::optional<torch::Tensor> k_new,
    c10::optional<torch::Tensor> v_new, bool causal, double scale, int64_t left, int64_t right,
    double softcap, c10::optional<torch::Tensor> alibi) {
    const char* fn = "flash_attention_with_kvcache";
    if (k_new.has_value() != v_new.has_value()) fail(std::string(fn) + ": give k and v together");
    std::vector<std::pair<const torch::Tensor*, std::string>> ts = {
        {&q, "q"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}};
    if (k_new) ts.push_back({&*k_new, "k"}), ts.push_back({&*v_new, "v"});
    for (const auto& [t, what] : ts) {
        if (!t->is_cuda() || t->device() != q.device() || t->dim() != 4 || !t->is_contiguous() ||
            t->scalar_type() != q.scalar_type())
            fail(std::string(fn) + ": " + what + " is " + dims(*t) + " " +
                 name(t->scalar_type()) + " on " + t->device().str() + "; allowed: a " +
                 "contiguous 4-D tensor of q's dtype on q's device");
        for (int64_t size : t->sizes())
            if (size > INT_MAX) fail(std::string(fn) + ": " + what + " has a size above INT_MAX");
    }
    if (q.scalar_type() != torch::kFloat16 && q.scalar_type() != torch::kBFloat16)
        fail(std::string(fn) + ": q is " + name(q.scalar_type()) + "; allowed: float16, bfloat16");
    const auto int32_table = [&](const torch::Tensor& t, const char* what, int64_t dim) {
        if (!t.is_cuda() || t.device() != q.device() || t.scalar_type() != torch::kInt32 ||
            !t.is_contiguous() || t.dim() != dim || t.size(0) != q.size(0))
            fail(std::string(fn) + ": " + what + " is " + dims(t) + " " +
                 name(t.scalar_type()) + " on " + t.device().str() + "; allowed: a contiguous " +
                 "int32 tensor on q's device, " + (dim == 1 ? "(batch,)" : "(batch, pages)"));
    };
    int32_table(cache_seqlens, "cache_seqlens", 1);
    const int64_t heads_kv = k_cache.size(1), d = q.size(3);
    if (v_cache.sizes() != k_cache.sizes() || k_cache.size(3) != d || heads_kv < 1 ||
        q.size(1) % heads_kv != 0)
        fail(std::string(fn) + ": q is " + dims(q) + ", k_cache " + dims(k_cache) + ", v_cache " +
             dims(v_cache) + ": the caches alike, head_dim q's, their heads dividing q's");
    KVCache c;
    c.cache_seqlens = cache_seqlens.data_ptr<int>();
    int64_t capacity = k_cache.size(2);
    if (block_table) {
        int32_table(*block_table, "block_table", 2);
        c.block_table = block_table->data_ptr<int>();
        c.page_size = int(k_cache.size(2)), c.pages_per_seq = int(block_table->size(1));
        c.num_pages = int(k_cache.size(0));
        capacity = int64_t(c.pages_per_seq) * c.page_size;
        if (capacity > INT_MAX) fail(std::string(fn) + ": pages x page_size exceeds INT_MAX");
    } else if (k_cache.size(0) != q.size(0)) {
        fail(std::string(fn) + ": k_cache is " + dims(k_cache) + " without a block_table; " +
             "allowed: (batch, H_kv, capacity, d), batch q's");
    }
    if (k_new) {
        // (a vector: an IntArrayRef of a braced list would outlive the list it points to)
        const std::vector<int64_t> want{q.size(0), heads_kv, k_new->size(2), d};
        if (k_new->sizes().vec() != want || v_new->sizes().vec() != want)
            fail(std::string(fn) + ": k is " + dims(*k_new) + ", v " + dims(*v_new) +
                 "; allowed: (batch, H_kv, new_len, d), both alike");
        c.new_len = int(k_new->size(2));
    }
    const AttentionShape s{int(q.size(0)), int(q.size(1)), int(q.size(2)), int(capacity), int(d),
                           causal, int(heads_kv)};
    const AttentionOptions o = options_of(fn, s, q, scale, left, right, softcap, alibi);
    const c10::cuda::CUDAGuard guard(q.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    torch::Tensor out = torch::empty_like(q);
    torch::Tensor L = torch::empty({q.size(0), q.size(1), q.size(2)},
                                   q.options().dtype(torch::kFloat32));
    with_dtype(fn, q, [&](auto zero) {
        using T = decltype(zero);
        const T* kn = k_new ? ptr<T>(*k_new) : nullptr;
        const T* vn = v_new ? ptr<T>(*v_new) : nullptr;
        if constexpr (std::is_same_v<T, __half>)
            flash_decode_kvcache_fp16(ptr<T>(q), ptr<T>(k_cache), ptr<T>(v_cache), kn, vn,
                                      ptr<T>(out), ptr<float>(L), s, c, o, stream);
        else if constexpr (std::is_same_v<T, __nv_bfloat16>)
            flash_decode_kvcache_bf16(ptr<T>(q), ptr<T>(k_cache), ptr<T>(v_cache), kn, vn,
                                      ptr<T>(out), ptr<float>(L), s, c, o, stream);
    });
    return {out, L};
}

// Chapter 3's fp8 forward (flash_forward_fp8_hopper): q, k, v float8_e4m3fn, contiguous, (B, H,
// q_len, d) and (B, H_kv, kv_len, d); the descales float32 (B, H) for q, (B, H_kv) for k and v,
// or none (1); o bfloat16 (bf16_out) or float16, L float32 (B, H, q_len).
static std::tuple<torch::Tensor, torch::Tensor> fp8_forward(
    torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> descale_q,
    c10::optional<torch::Tensor> descale_k, c10::optional<torch::Tensor> descale_v, bool causal,
    bool bf16_out) {
    const char* fn = "flash_attention_fp8";
    for (const auto& [t, what] : {std::pair<const torch::Tensor*, const char*>{&q, "q"},
                                  {&k, "k"}, {&v, "v"}}) {
        if (!t->is_cuda() || t->device() != q.device() || t->dim() != 4 || !t->is_contiguous() ||
            t->scalar_type() != c10::ScalarType::Float8_e4m3fn)
            fail(std::string(fn) + ": " + what + " is " + dims(*t) + " " +
                 name(t->scalar_type()) + " on " + t->device().str() + "; allowed: a " +
                 "contiguous 4-D float8_e4m3fn tensor on q's device (quantize_fp8 makes one)");
        for (int64_t size : t->sizes())
            if (size > INT_MAX) fail(std::string(fn) + ": " + what + " has a size above INT_MAX");
    }
    if (v.sizes() != k.sizes() || k.size(0) != q.size(0) || k.size(3) != q.size(3) ||
        k.size(1) < 1 || q.size(1) % k.size(1) != 0)
        fail(std::string(fn) + ": q is " + dims(q) + ", k " + dims(k) + ", v " + dims(v) +
             ": k and v alike, batch and head_dim q's, their heads dividing q's");
    const AttentionShape s{int(q.size(0)), int(q.size(1)), int(q.size(2)), int(k.size(2)),
                           int(q.size(3)), causal, int(k.size(1))};
    const auto scales = [&](const c10::optional<torch::Tensor>& t, const char* what,
                            int64_t heads) -> const float* {
        if (!t) return nullptr;
        if (!t->is_cuda() || t->device() != q.device() || t->scalar_type() != torch::kFloat32 ||
            !t->is_contiguous() || t->dim() != 2 || t->size(0) != q.size(0) ||
            t->size(1) != heads)
            fail(std::string(fn) + ": " + what + " is " + dims(*t) + " " +
                 name(t->scalar_type()) + "; allowed: a contiguous float32 tensor on q's " +
                 "device, (batch, " + std::to_string(heads) + ")");
        return ptr<float>(*t);
    };
    const Fp8Descales descales{scales(descale_q, "descale_q", q.size(1)),
                               scales(descale_k, "descale_k", k.size(1)),
                               scales(descale_v, "descale_v", k.size(1))};
    const c10::cuda::CUDAGuard guard(q.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    torch::Tensor o = torch::empty(q.sizes(), q.options().dtype(bf16_out ? torch::kBFloat16
                                                                          : torch::kFloat16));
    torch::Tensor L = torch::empty({q.size(0), q.size(1), q.size(2)},
                                   q.options().dtype(torch::kFloat32));
    const auto* q8 = ptr<__nv_fp8_e4m3>(q);
    const auto* k8 = ptr<__nv_fp8_e4m3>(k);
    const auto* v8 = ptr<__nv_fp8_e4m3>(v);
    if (bf16_out)
        flash_forward_fp8_hopper(q8, k8, v8, ptr<__nv_bfloat16>(o), ptr<float>(L), s, descales,
                                 stream);
    else
        flash_forward_fp8_hopper(q8, k8, v8, ptr<__half>(o), ptr<float>(L), s, descales, stream);
    return {o, L};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "flash.h for PyTorch tensors: see flash_torch.py";
    namespace py = pybind11;  // the options' defaults: none (ring_attention.py calls without)
    m.def("forward", &forward,
          "O, L = forward(q, k, v, causal, scale, window_left, window_right, softcap, alibi)",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("causal"), py::arg("scale") = 0.0,
          py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("softcap") = 0.0,
          py::arg("alibi") = py::none());
    m.def("backward", &backward,
          "dq, dk, dv = backward(q, k, v, o, do, L, causal, scale, window_left, window_right, "
          "softcap, alibi, deterministic)",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("do"), py::arg("L"),
          py::arg("causal"), py::arg("scale") = 0.0, py::arg("window_left") = -1,
          py::arg("window_right") = -1, py::arg("softcap") = 0.0, py::arg("alibi") = py::none(),
          py::arg("deterministic") = true);
    m.def("varlen_forward", &varlen_forward,
          "O, L = varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window_left, "
          "window_right, softcap, alibi): q, k, v as (1, H, total, d) views");
    m.def("varlen_backward", &varlen_backward,
          "dq, dk, dv = varlen_backward(q, k, v, o, do, L, cu_q, cu_k, max_q, max_k, causal, "
          "scale, window_left, window_right, softcap, alibi, deterministic)");
    m.def("kvcache_forward", &kvcache_forward,
          "attention of q over a K/V cache (contiguous or paged), new keys appended first");
    m.def("fp8_forward", &fp8_forward,
          "O, L = fp8_forward(q, k, v, descale_q, descale_k, descale_v, causal, bf16_out): "
          "chapter 3's fp8 forward");
}
