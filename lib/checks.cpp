// checks.cpp: the host-side argument checks and launch helpers of checks.h, shared by every
// chapter, and flash.h's head-dim queries. No kernels here: the GPU code is the four chapters'
// (flash.cu; flash_fp16.cu; flash_hopper.cu and flash_hopper_backward.cu; flash_decode.cu); which
// of them a public call runs is dispatch.cpp's.
#include "checks.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

void require(bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument(what);
}

void throw_failed_call(const char* call, const char* file, int line, const char* why) {
    throw std::runtime_error(std::string(call) + " failed at " + file + ":" +
                             std::to_string(line) + ": " + why);
}

void throw_cuda_failed(cudaError_t err, const char* call, const char* file, int line) {
    std::string why = cudaGetErrorString(err);
    if (flash_no_gpu(err)) why += " (no CUDA GPU or driver was found on this machine)";
    throw_failed_call(call, file, line, why.c_str());
}

bool flash_no_gpu(cudaError_t err) {
    int driver = 0;  // cudaDriverGetVersion's 0: no driver installed
    return err == cudaErrorNoDevice ||
           (err == cudaErrorInsufficientDriver && cudaDriverGetVersion(&driver) == cudaSuccess &&
            driver == 0);
}

// ---------------------------------------------------------------------------------------------
// Head dims

bool head_dim_in(int head_dim, HeadDims supported) {
    for (size_t k = 0; k < supported.count; ++k)
        if (supported.dims[k] == head_dim) return true;
    return false;
}

std::string head_dims_string(HeadDims supported) {
    std::string s;
    for (size_t k = 0; k < supported.count; ++k)
        s += (k == 0 ? "" : ", ") + std::to_string(supported.dims[k]);
    return s;
}

void require_head_dim(int head_dim, HeadDims supported) {
    if (head_dim_in(head_dim, supported)) return;
    throw std::invalid_argument("shape.head_dim = " + std::to_string(head_dim) +
                                " is not supported; allowed values: " +
                                head_dims_string(supported));
}

bool flash_head_dim_supported(int head_dim) { return head_dim_in(head_dim, kFlashHeadDims); }
std::string flash_head_dims_string() { return head_dims_string(kFlashHeadDims); }

// ---------------------------------------------------------------------------------------------
// Shapes

// a * b, or an invalid_argument naming `what` when it does not fit in size_t
static size_t mul_checked(size_t a, size_t b, const std::string& what) {
    size_t r;
    require(!__builtin_mul_overflow(a, b, &r), "shape: " + what + " overflows size_t");
    return r;
}

void validate_shape(const AttentionShape& s, HeadDims supported, size_t elem_bytes) {
    const std::pair<const char*, int> fields[] = {
        {"batch", s.batch}, {"heads", s.heads}, {"q_len", s.q_len}, {"kv_len", s.kv_len}};
    for (const auto& f : fields)
        require(f.second >= 1, std::string("shape.") + f.first + " = " + std::to_string(f.second) +
                                   " is invalid; allowed values: 1 or more");
    require_head_dim(s.head_dim, supported);
    require(s.kv_heads >= 0 && s.kv_heads <= s.heads && (s.kv_heads == 0 || s.heads % s.kv_heads == 0),
            "shape.kv_heads = " + std::to_string(s.kv_heads) + " is invalid; allowed values: 0 " +
                "(= heads) or a divisor of heads = " + std::to_string(s.heads));
    // (Grouped-query attention: query head h reads K/V head h / (heads / kv_heads); every
    // chapter's kernels do, forward and backward.)
    // Q and O run along q_len, K and V along kv_len: bytes = batch * heads * len * head_dim *
    // elem_bytes, each product checked. (L, batch * heads * q_len floats, is smaller than Q.)
    const size_t bh = mul_checked(s.batch, s.heads, "batch * heads");
    const std::string bytes = " * " + std::to_string(elem_bytes) + " bytes";
    for (const auto& len : {std::make_pair("q_len", s.q_len), std::make_pair("kv_len", s.kv_len)}) {
        const std::string name = std::string("batch * heads * ") + len.first;
        const size_t rows = mul_checked(bh, size_t(len.second), name);
        const size_t elems = mul_checked(rows, size_t(s.head_dim), name + " * head_dim");
        mul_checked(elems, elem_bytes, name + " * head_dim" + bytes);
    }
}

// Chapter 1: fp32. (sizeof(float) is also the largest element any chapter uses.)
void validate_shape(const AttentionShape& s) { validate_shape(s, kFlashHeadDims, sizeof(float)); }

size_t q_elems(const AttentionShape& s) {
    return size_t(s.batch) * s.heads * s.q_len * s.head_dim;
}
size_t kv_elems(const AttentionShape& s) {
    return size_t(s.batch) * flash_kv_heads(s) * s.kv_len * s.head_dim;
}
size_t l_elems(const AttentionShape& s) { return size_t(s.batch) * s.heads * s.q_len; }

// ---------------------------------------------------------------------------------------------
// Layouts (chapter 5's strides)

size_t span_elems(const Rows& r, const AttentionShape& s, int len) {
    return size_t(s.batch - 1) * r.batch + size_t(r.heads - 1) * r.head +
           size_t(len - 1) * r.row + s.head_dim;
}

// One tensor's given strides: each in [0, 2^39) and a multiple of 8; an output's apart.
static void check_strides(const std::string& call, const char* name, const TensorStrides& t,
                          const AttentionShape& s, int heads, int len, bool output) {
    if (!strides_given(t)) return;  // contiguous
    const struct { const char* field; long long stride; int extent; } given[] = {
        {"batch", t.batch, s.batch}, {"head", t.head, heads}, {"row", t.row, len}};
    for (const auto& g : given) {  // (a dimension of one index: its stride is never used)
        const long long least = g.field[0] == 'r' ? std::max(s.head_dim, 8) : 8;  // rows apart
        require(g.extent == 1 || (g.stride >= least && g.stride < (1LL << 39) && g.stride % 8 == 0),
                call + "options.layout." + name + "." + g.field + " = " +
                    std::to_string(g.stride) + " is invalid; allowed values: " +
                    std::to_string(least) + " to 2^39 - 8, a multiple of 8 elements (16 bytes, " +
                    "so that every row stays aligned)" +
                    (g.field[0] == 'r' ? "; a row at least head_dim" : ""));
    }
    const unsigned __int128 span = (unsigned __int128)(s.batch - 1) * t.batch +
                                   (unsigned __int128)(heads - 1) * t.head +
                                   (unsigned __int128)(len - 1) * t.row + s.head_dim;
    require(span < ((unsigned __int128)1 << 60),
            call + "options.layout." + name + ": the tensor would span 2^60 elements or more");
    if (!output) return;
    // Apart: sorted by stride, each dimension of more than one index steps past everything the
    // smaller ones reach (the columns reach head_dim - 1).
    std::pair<long long, long long> dims[] = {{t.batch, s.batch}, {t.head, heads}, {t.row, len}};
    std::sort(std::begin(dims), std::end(dims));
    long long reach = s.head_dim - 1;
    for (const auto& d : dims) {
        if (d.second == 1) continue;
        require(d.first > reach, call + "options.layout." + name + " = {" +
                                     std::to_string(t.batch) + ", " + std::to_string(t.head) +
                                     ", " + std::to_string(t.row) + "} is invalid for an " +
                                     "output: two of its elements would share a place; allowed: " +
                                     "strides that keep every element apart");
        reach += d.first * (d.second - 1);  // within the span, < 2^60: no overflow
    }
}

void validate_layout(const char* fn, const AttentionLayout& a, const AttentionShape& s,
                     bool backward) {
    const std::string call = std::string(fn) + ": ";
    const int H = s.heads, KH = flash_kv_heads(s), q = s.q_len, k = s.kv_len;
    check_strides(call, "Q", a.Q, s, H, q, false);
    check_strides(call, "K", a.K, s, KH, k, false);
    check_strides(call, "V", a.V, s, KH, k, false);
    check_strides(call, "O", a.O, s, H, q, !backward);
    if (!backward) return;
    check_strides(call, "dO", a.dO, s, H, q, false);
    check_strides(call, "dQ", a.dQ, s, H, q, true);
    check_strides(call, "dK", a.dK, s, KH, k, true);
    check_strides(call, "dV", a.dV, s, KH, k, true);
}

// ---------------------------------------------------------------------------------------------
// Pointers

void validate_pointers(const char* fn, std::initializer_list<Arg> args) {
    const std::string call = std::string(fn) + ": ";
    for (const Arg& a : args) {
        require(a.ptr != nullptr, call + a.name + " is null");
        require(reinterpret_cast<uintptr_t>(a.ptr) % 16 == 0,
                call + a.name + " must be 16-byte aligned (cudaMalloc is)");
    }
    for (const Arg& a : args)
        for (const Arg& b : args) {
            if (&a == &b || !a.output) continue;
            const char* pa = static_cast<const char*>(a.ptr);
            const char* pb = static_cast<const char*>(b.ptr);
            const size_t na = a.elems * a.elem_bytes;  // no overflow: validate_shape came first
            const size_t nb = b.elems * b.elem_bytes;
            const bool overlap = pa < pb + nb && pb < pa + na;
            require(!overlap, call + "output " + a.name + " overlaps " + b.name);
        }
    for (const Arg& a : args) {
        cudaPointerAttributes attr;
        FLASH_CUDA_CHECK(cudaPointerGetAttributes(&attr, a.ptr));
        require(attr.type != cudaMemoryTypeUnregistered,
                call + a.name + " is host memory; pass a device pointer");
    }
}

// The scale and the cap within [2^-32, 2^16]: the kernels' constants stay finite (scale log2 e
// times the -1e30 that stands in for -inf, 1 / scale, softcap / scale, scale / softcap).
static bool in_kernel_range(float x) { return x >= 0x1p-32f && x <= 0x1p16f; }

void validate_options(const char* fn, const AttentionOptions& o) {
    const std::string call = std::string(fn) + ": options.";
    const auto shown = [](float x) {  // 1e-50 is not "0.000000"
        char text[32];
        std::snprintf(text, sizeof text, "%g", double(x));
        return std::string(text);
    };
    require((o.softmax_scale == 0 && !std::signbit(o.softmax_scale)) ||
                in_kernel_range(o.softmax_scale),
            call + "softmax_scale = " + shown(o.softmax_scale) + " is invalid; allowed values: 0 "
                "(1/sqrt(head_dim)) or 2^-32 to 2^16");
    require(o.window_left >= -1, call + "window_left = " + std::to_string(o.window_left) +
                                     " is invalid; allowed values: -1 (no bound) or 0 or more");
    require(o.window_right >= -1, call + "window_right = " + std::to_string(o.window_right) +
                                      " is invalid; allowed values: -1 (no bound) or 0 or more");
    require((o.softcap == 0 && !std::signbit(o.softcap)) || in_kernel_range(o.softcap),
            call + "softcap = " + shown(o.softcap) + " is invalid; allowed values: 0 (none) or "
                "2^-32 to 2^16");
    require(o.alibi_slopes || !o.alibi_per_batch,
            call + "alibi_per_batch is set but alibi_slopes is null");
}

Arg alibi_arg(const AttentionOptions& o, const AttentionShape& s) {
    const size_t n = size_t(s.heads) * (o.alibi_per_batch ? size_t(s.batch) : 1);
    return input_arg("options.alibi_slopes", o.alibi_slopes, n);
}

bool flash_options_plain(const AttentionOptions& o) {
    return o.softmax_scale == 0 && o.window_left == -1 && o.window_right == -1 &&
           o.softcap == 0 && o.alibi_slopes == nullptr && !o.alibi_per_batch &&
           !layout_given(o.layout) && !o.packed.cu_seqlens_q && !o.packed.cu_seqlens_k &&
           o.packed.total_q == 0 && o.packed.total_k == 0;
}

void validate_packed(const char* fn, const PackedBatch& p, const AttentionShape&) {
    const std::string call = std::string(fn) + ": options.packed.";
    require(!p.cu_seqlens_q == !p.cu_seqlens_k,
            call + (p.cu_seqlens_q ? "cu_seqlens_k" : "cu_seqlens_q") + " is null but " +
                (p.cu_seqlens_q ? "cu_seqlens_q" : "cu_seqlens_k") + " is not; allowed: both " +
                "(a packed batch) or neither");
    if (!p.cu_seqlens_q) {
        require(p.total_q == 0 && p.total_k == 0,
                call + "total_q = " + std::to_string(p.total_q) + ", total_k = " +
                    std::to_string(p.total_k) + " without cu_seqlens; allowed: 0 (not packed)");
        return;
    }
    require(p.total_q >= 1, call + "total_q = " + std::to_string(p.total_q) +
                                " is invalid; allowed values: >= 1 (the packed Q's rows)");
    require(p.total_k >= 1, call + "total_k = " + std::to_string(p.total_k) +
                                " is invalid; allowed values: >= 1 (the packed K's rows)");
}

void validate_packed_lengths(const char* fn, const PackedBatch& p, const AttentionShape& s,
                             cudaStream_t stream) {
    if (!p.cu_seqlens_q) return;
    const std::string call = std::string(fn) + ": options.packed.";
    const struct {
        const char *name, *total_name, *max;
        const int* cu;
        int total, longest;
    } seqs[] = {{"cu_seqlens_q", "total_q", "shape.q_len", p.cu_seqlens_q, p.total_q, s.q_len},
                {"cu_seqlens_k", "total_k", "shape.kv_len", p.cu_seqlens_k, p.total_k, s.kv_len}};
    std::vector<int> cu(size_t(s.batch) + 1);
    for (const auto& q : seqs) {
        require(reinterpret_cast<uintptr_t>(q.cu) % alignof(int) == 0,
                call + q.name + " must be 4-byte aligned");
        cudaPointerAttributes attr;
        FLASH_CUDA_CHECK(cudaPointerGetAttributes(&attr, q.cu));
        require(attr.type != cudaMemoryTypeUnregistered,
                call + q.name + " is host memory; pass a device pointer");
        FLASH_CUDA_CHECK(cudaMemcpyAsync(cu.data(), q.cu, cu.size() * sizeof(int),
                                         cudaMemcpyDefault, stream));
        FLASH_CUDA_CHECK(cudaStreamSynchronize(stream));
        const auto entry = [&](int b) {
            return call + q.name + "[" + std::to_string(b) + "] = " + std::to_string(cu[b]);
        };
        require(cu[0] == 0, entry(0) + " is invalid; allowed value: 0");
        for (int b = 0; b < s.batch; b++) {
            require(cu[b + 1] >= cu[b], entry(b + 1) + " is below " + q.name + "[" +
                                            std::to_string(b) + "]; allowed: non-decreasing");
            require(cu[b + 1] - cu[b] <= q.longest,
                    call + q.name + ": sequence " + std::to_string(b) + " has " +
                        std::to_string(cu[b + 1] - cu[b]) + " rows, more than " + q.max + " = " +
                        std::to_string(q.longest) + " (max_seqlen" + (q.name + 10) +
                        "); allowed: at most the longest given");
        }
        require(cu[s.batch] == q.total, entry(s.batch) + " is invalid; allowed value: " +
                                            q.total_name + " = " + std::to_string(q.total));
    }
}

// ---------------------------------------------------------------------------------------------
// Launch helpers

// What make(device) gives for the current device, made on the device's first call and kept: one
// cache for each caller (each passes its own lambda type), behind a lock.
template <typename T, typename Make>
static T once_per_device(Make make) {
    static std::mutex mutex;
    static std::map<int, T> cache;  // device -> its T
    int dev = 0;
    FLASH_CUDA_CHECK(cudaGetDevice(&dev));
    const std::lock_guard<std::mutex> lock(mutex);
    auto found = cache.find(dev);
    if (found == cache.end()) found = cache.emplace(dev, make(dev)).first;
    return found->second;
}

cudaDeviceProp flash_device_props() {
    return once_per_device<cudaDeviceProp>([](int dev) {
        cudaDeviceProp prop;
        FLASH_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
        return prop;
    });
}

cudaMemPool_t flash_kept_pool() {
    return once_per_device<cudaMemPool_t>([](int dev) {
        cudaMemPoolProps props = {};
        props.allocType = cudaMemAllocationTypePinned;
        props.location.type = cudaMemLocationTypeDevice;
        props.location.id = dev;
        cudaMemPool_t pool;
        FLASH_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
        uint64_t keep = UINT64_MAX;  // release threshold: keep all it reserves
        FLASH_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
        return pool;
    });
}

bool flash_zero_scratch() {
    static const bool on = [] {
        const char* v = std::getenv("FLASH_ZERO_SCRATCH");
        return v != nullptr && std::strcmp(v, "1") == 0;
    }();
    return on;
}

void flash_release_scratch() {
    FLASH_CUDA_CHECK(cudaMemPoolTrimTo(flash_kept_pool(), 0));
}

int grid_blocks(const AttentionShape& s, int rows, int tile, const char* what) {
    const int tiles = (rows - 1) / tile + 1;
    require(tiles <= INT_MAX / s.batch / s.heads,  // checked before multiplying: no overflow
            std::string("shape: batch * heads * ceil(") + what + " / tile) exceeds the grid " +
                "limit " + std::to_string(INT_MAX));
    return tiles * s.batch * s.heads;
}
