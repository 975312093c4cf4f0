"""flash_torch.py: this project's FlashAttention kernels (flash.h) as a PyTorch function.

    from flash_torch import flash_attention, flash_attention_with_lse
    o = flash_attention(q, k, v, causal=True)            # differentiable: o.backward(...) works
    o, lse = flash_attention_with_lse(q, k, v)           # lse: (batch, heads, q_len), float32
    o = flash_attention(q, k, v, causal=True, window_size=(4096, 0), softcap=30.0,
                        alibi_slopes=slopes, softmax_scale=0.1)   # chapter 5: float16, bfloat16

q: (batch, heads, q_len, head_dim), k and v: (batch, kv_heads, kv_len, head_dim), CUDA tensors of
one dtype (kv_heads a divisor of heads: grouped-query attention, kv_heads = 1 multi-query, as
F.scaled_dot_product_attention's enable_gqa=True; query head h reads K/V head
h // (heads // kv_heads), and dk, dv sum over the query heads that share a K/V head): float32
(chapter 1's kernels, CUDA cores), float16 or bfloat16 (chapter 2's, tensor cores, compute
capability 8.0 or newer); head_dim 16, 32, 64, 96, 128 or 256; any lengths. The
scale is 1/sqrt(head_dim), as in F.scaled_dot_product_attention (softmax_scale, below, sets it).

Chapter 5's keyword arguments are FlashAttention-2's flash_attn_func's (float16 and bfloat16
only; flash.h's AttentionOptions says the rules): softmax_scale (None: 1/sqrt(head_dim)),
window_size=(left, right) (query i sees key j iff i' - left <= j <= i' + right, i' = i + kv_len -
q_len; -1 leaves a side open; causal bounds the right at 0), softcap (s -> softcap tanh(s /
softcap) where > 0) and alibi_slopes (float32, (heads,) or (batch, heads): s -> s - slope |i' -
j|; they must not change between the forward and the backward). They run where the calls
without them run (chapter 3 on an H100 or H200, the decode for a short query, chapter 2
elsewhere). deterministic (True by default here; FlashAttention-2's default is False): False lets
chapter 3's backward add dq's parts as its blocks get there, not in a fixed order, faster where
blocks would wait for their turn (head_dim 256), dq's last bits then varying from call to call;
dk, dv, o and lse keep their bits. False only permits: with window_size, softcap or alibi_slopes,
or off chapter 3 (float32 too), the order stays.

The causal mask is bottom-right aligned, as in FlashAttention-2 >= 2.1: query i sees key j iff
j <= i + kv_len - q_len. PyTorch's is_causal=True is top-left aligned (j <= i); the two agree
when q_len == kv_len. For q_len != kv_len the matching PyTorch mask is
torch.nn.attention.bias.causal_lower_right(q_len, kv_len). A query row that sees no key (causal,
q_len > kv_len) gets o = 0, lse = -inf and zero gradients (SDPA gives NaN there).

The kernels read tensors where they lie at 16-byte aligned addresses (flash.h): contiguous ones
and, in float16 and bfloat16 (chapter 5's strides), views whose last dimension is contiguous and
whose other strides are multiples of 8 elements, e.g. q, k, v as (batch, seq, 3, heads, d) of one
fused projection, transposed to (batch, heads, seq, d): no copy. Any other q, k, v or gradient of
o (an expanded tensor, a view at an odd offset, a float32 view) is copied first, a copy of its
size. The outputs o, dq, dk, dv take their input's row layout: (batch, seq, heads, d) in memory
where the input's heads lie closer than its rows (so that o.transpose(1, 2).reshape(batch, seq,
-1) is free), else contiguous; lse is contiguous. The backward runs once:
differentiating it again raises RuntimeError. Bad input raises ValueError naming the argument and
what is allowed (the C++ checks' own messages); a CUDA failure raises RuntimeError.

Needs torch >= 2.3 built with CUDA, nvcc and ninja (MIN_TORCH below says why). The C++ half
(flash_torch.cpp over the library's sources, LIBRARY_SOURCES below) is compiled on first use with
torch.utils.cpp_extension (a minute or two, then cached in .torch_build/ beside this file), or
ahead of time by `python3 flash_torch.py` (make torch), which names in one line whatever is
missing. Run the tests with `pytest test_torch.py`; see example_train.py for a model that uses it.
"""
import glob
import os
import re
import sys

# torch.utils.cpp_extension accepts the "9.0a" target (chapter 3's) from torch 2.2; the tests and
# example_train.py choose SDPA's backend with torch.nn.attention.sdpa_kernel, new in torch 2.3.
MIN_TORCH = (2, 3)
NEED = f"torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} built with CUDA"

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)  # the repository root: flash.h and the chapters' kernels

# The library the extension links, relative to the repository root: each chapter's kernels (the
# Makefile's LIB_OBJS) and every C++ or CUDA source in lib/ (what the chapters share). A library
# source that lives elsewhere is added to this list, the one place that names them.
LIBRARY_SOURCES = ["flash.cu", "flash_fp16.cu", "flash_hopper.cu", "flash_hopper_backward.cu",
                   "flash_hopper_fp8.cu", "flash_decode.cu"]
INCLUDE_DIRS = [".", "lib"]


def _torch_missing():
    """One line saying why this Python's torch cannot serve (absent, too old, no CUDA), or None."""
    try:
        import torch
    except ModuleNotFoundError as e:
        if e.name != "torch":
            return f"import torch failed: {e}"
        return f"PyTorch is not installed; the PyTorch op needs {NEED} (pip install torch)"
    except ImportError as e:
        return f"import torch failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    found = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    if not found or (int(found[1]), int(found[2])) < MIN_TORCH:
        return f"torch {torch.__version__} is too old: the PyTorch op needs {NEED}"
    if torch.version.cuda is None:
        kind = "a ROCm build" if getattr(torch.version, "hip", None) else "a CPU-only build"
        return f"torch {torch.__version__} has no CUDA ({kind}): the PyTorch op needs {NEED}"
    return None


_why_not = _torch_missing()
if _why_not:
    if __name__ == "__main__":
        sys.exit(f"flash_torch: {_why_not}")
    raise ImportError(f"flash_torch: {_why_not}")

import torch  # noqa: E402
from torch.autograd.function import once_differentiable  # noqa: E402


def missing(need_gpu=False):
    """None when this machine can build the extension (and, with need_gpu, run it); else one line
    naming what it lacks: setuptools (for torch.utils.cpp_extension), a CUDA GPU (or, to build
    for one elsewhere, TORCH_CUDA_ARCH_LIST), nvcc, ninja."""
    try:
        from torch.utils import cpp_extension  # it imports setuptools, which a new venv may lack
    except ImportError as e:
        return f"flash_torch: torch.utils.cpp_extension fails ({e}): pip install setuptools"
    if not torch.cuda.is_available() and (need_gpu or not os.environ.get("TORCH_CUDA_ARCH_LIST")):
        return ("flash_torch: no CUDA GPU visible to torch (no GPU, or no NVIDIA driver)" +
                ("" if need_gpu else "; to build for a GPU elsewhere set TORCH_CUDA_ARCH_LIST, "
                 "e.g. 9.0a for an H100"))
    home = cpp_extension.CUDA_HOME
    if home is None or not os.path.exists(os.path.join(home, "bin", "nvcc")):
        return ("flash_torch: nvcc not found (set CUDA_HOME, or put nvcc on PATH): install the "
                f"CUDA toolkit of torch's CUDA major version ({torch.version.cuda})")
    if not cpp_extension.is_ninja_available():
        return "flash_torch: ninja not found: pip install ninja (torch.utils.cpp_extension uses it)"
    return None


def sources():
    """The files compiled into the extension: the binding, then LIBRARY_SOURCES and lib/'s."""
    named = [os.path.join(_ROOT, s) for s in LIBRARY_SOURCES]
    absent = [s for s, path in zip(LIBRARY_SOURCES, named) if not os.path.exists(path)]
    if absent:
        raise FileNotFoundError(f"flash_torch: LIBRARY_SOURCES names {', '.join(absent)}, not in "
                                f"the repository ({_ROOT}): update the list in flash_torch.py")
    shared = sorted(glob.glob(os.path.join(_ROOT, "lib", "*.cpp")) +
                    glob.glob(os.path.join(_ROOT, "lib", "*.cu")))
    return [os.path.join(_HERE, "flash_torch.cpp")] + named + [s for s in shared if s not in named]


_ext = None


def build():
    """The compiled extension, built (or loaded from .torch_build/) on the first call. Raises
    ImportError naming what is missing, RuntimeError with the compiler's output if it fails."""
    global _ext
    if _ext is not None:
        return _ext
    why = missing()
    if why:
        raise ImportError(why)
    # One target, the GPU in this machine (TORCH_CUDA_ARCH_LIST overrides, as for any extension),
    # so the kernels are native code, not PTX compiled by the driver at start. On an H100 or H200
    # that is sm_90a ("9.0a"), the target with chapter 3's wgmma and setmaxnreg: there the forward
    # runs chapter 3, whose kernels built for any other target trap, so a list without 9.0a is
    # refused on such a GPU.
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if "TORCH_CUDA_ARCH_LIST" not in os.environ:
            os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}" + ("a" if major == 9 else "")
        elif major == 9 and "9.0a" not in os.environ["TORCH_CUDA_ARCH_LIST"]:
            raise ImportError("flash_torch: TORCH_CUDA_ARCH_LIST is "
                              f"'{os.environ['TORCH_CUDA_ARCH_LIST']}'; on this GPU (compute "
                              "capability 9.0) it must include 9.0a, chapter 3's target")
    build_dir = os.path.join(_HERE, ".torch_build")
    os.makedirs(build_dir, exist_ok=True)
    from torch.utils.cpp_extension import load
    includes = [os.path.normpath(os.path.join(_ROOT, d)) for d in INCLUDE_DIRS]
    _ext = load(name="flash_torch_ext", sources=sources(), extra_include_paths=includes,
                extra_cflags=["-O3", "-std=c++17"],
                extra_cuda_cflags=["-O3", "-std=c++17", "-lineinfo"],
                build_directory=build_dir, verbose=os.environ.get("FLASH_TORCH_VERBOSE") == "1")
    return _ext


def _readable(t):
    """t itself if the kernels can read it where it lies (flash.h): at a 16-byte aligned address,
    and contiguous or, in float16 and bfloat16 (chapter 5's strides), 4-D with its last dimension
    contiguous and every other stride a multiple of 8 elements, at least 8 (the rows' at least
    head_dim) and below 2^39 (but for a dimension of size 1): a transposed or sliced view, e.g.
    of one fused QKV projection, is read in place. Else a contiguous copy (fresh memory from
    PyTorch's allocator is aligned); contiguous() alone would keep a contiguous view at an odd
    offset. flash_torch.cpp's readable is the same rule."""
    if t.data_ptr() % 16 == 0:
        if t.is_contiguous():
            return t
        least = (8, 8, max(t.size(-1), 8))  # rows head_dim apart at least
        if (t.dtype in (torch.float16, torch.bfloat16) and t.dim() == 4 and t.stride(3) == 1 and
                all(t.size(i) == 1 or (least[i] <= t.stride(i) < 2**39 and t.stride(i) % 8 == 0)
                    for i in range(3))):
            return t
    return t.clone(memory_format=torch.contiguous_format)


class FlashAttention(torch.autograd.Function):
    """Algorithms 1 and 2 of FlashAttention-2 as one autograd node.

    forward saves q, k, v, o and lse (fp32, one number a query row), not P: the backward
    recomputes P = exp(q k^T / sqrt(d) - lse) tile by tile, which is what keeps the memory of
    attention linear in the sequence length. Saving o lets the backward form D = rowsum(do * o).
    What it saves are the tensors the kernels read (copies where an input had to be copied), so
    the backward runs on exactly what the forward saw.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, options, deterministic=True):
        q, k, v = (_readable(t) for t in (q, k, v))
        scale, left, right, softcap, alibi = options  # _options' tuple
        alibi = None if alibi is None else _readable(alibi)
        ctx.options = (bool(causal), scale, left, right, softcap, alibi)  # the binding's order
        ctx.deterministic = bool(deterministic)
        o, lse = build().forward(q, k, v, *ctx.options)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # lse takes no gradient: no zeros made for it
        return o, lse

    @staticmethod
    @once_differentiable  # the kernels' gradients are not themselves differentiable
    def backward(ctx, do, _dlse):
        # do comes as the rest of the graph made it: often expanded (stride 0, from a sum or a
        # mean), transposed (a transpose after attention) or a slice of a larger gradient.
        if do is None:  # o takes no part in the loss (lse takes no gradient): none for q, k, v
            return None, None, None, None, None, None
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = build().backward(q, k, v, o, _readable(do), lse, *ctx.options,
                                      ctx.deterministic)
        return dq, dk, dv, None, None, None


class FlashAttentionVarlen(torch.autograd.Function):
    """FlashAttention over packed sequences (FlashAttention-2's flash_attn_varlen_func): q
    (total_q, H, d), k and v (total_k, H_kv, d), sequence b's rows cu_seqlens[b] ..
    cu_seqlens[b + 1] - 1. The kernels see each as the (1, H, total, d) view it is, so the rules of
    _readable hold (a view is read in place, else copied)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, causal, options, deterministic=True):
        q, k, v = (_readable(t.unsqueeze(0).transpose(1, 2)) for t in (q, k, v))
        scale, left, right, softcap, alibi = options
        alibi = None if alibi is None else _readable(alibi)
        ctx.options = (bool(causal), scale, left, right, softcap, alibi)
        ctx.deterministic = bool(deterministic)
        ctx.packed = (cu_q, cu_k, int(max_q), int(max_k))
        o, lse = build().varlen_forward(q, k, v, *ctx.packed, *ctx.options)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return o.squeeze(0).transpose(0, 1), lse

    @staticmethod
    @once_differentiable
    def backward(ctx, do, _dlse):
        if do is None:
            return (None,) * 10
        q, k, v, o, lse = ctx.saved_tensors
        do = _readable(do.unsqueeze(0).transpose(1, 2))
        dq, dk, dv = build().varlen_backward(q, k, v, o, do, lse, *ctx.packed, *ctx.options,
                                             ctx.deterministic)
        return (*(t.squeeze(0).transpose(0, 1) for t in (dq, dk, dv)),) + (None,) * 7


def _options(softmax_scale, window_size, softcap, alibi_slopes):
    """(scale, left, right, softcap, alibi) as the binding takes them (scale 0: 1/sqrt(d))."""
    left, right = window_size
    if softmax_scale is not None and not softmax_scale > 0:  # None is the default, not 0
        raise ValueError(f"softmax_scale = {softmax_scale} is invalid; allowed: None "
                         "(1/sqrt(head_dim)) or a scale > 0")
    return (0.0 if softmax_scale is None else float(softmax_scale), int(left), int(right),
            float(softcap), alibi_slopes)


def flash_attention_with_lse(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=True):
    """(o, lse): attention and the natural-log logsumexp of each row of (changed) scores."""
    return FlashAttention.apply(q, k, v, causal,
                                _options(softmax_scale, window_size, softcap, alibi_slopes),
                                deterministic)


def flash_attention(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=True):
    """softmax(scores) v, scores = q k^T softmax_scale changed by the options, differentiable
    in q, k and v (not in alibi_slopes)."""
    return flash_attention_with_lse(q, k, v, causal, softmax_scale, window_size, softcap,
                                    alibi_slopes, deterministic)[0]


def flash_attention_varlen_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal=False, softmax_scale=None,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=True):
    """(o, lse) of packed sequences: o (total_q, H, d), lse (H, total_q)."""
    return FlashAttentionVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, causal,
                                      _options(softmax_scale, window_size, softcap, alibi_slopes),
                                      deterministic)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=True):
    """flash_attention over sequences of their own lengths packed one after another, with
    FlashAttention-2's flash_attn_varlen_func's arguments: q (total_q, H, d), k and v (total_k,
    H_kv, d), cu_seqlens_q and _k int32 CUDA tensors of batch + 1 offsets from 0, max_seqlen_q
    and _k the longest lengths (at least each; checked). Each sequence attends within itself
    (causal bottom-right at its own lengths); differentiable in q, k and v."""
    return flash_attention_varlen_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                           max_seqlen_k, causal, softmax_scale, window_size,
                                           softcap, alibi_slopes, deterministic)[0]


def flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None, k=None,
                                 v=None, causal=False, softmax_scale=None, window_size=(-1, -1),
                                 softcap=0.0, alibi_slopes=None, return_lse=False):
    """A decode step over a K/V cache, with FlashAttention-2's flash_attn_with_kvcache's argument
    names (inference: no gradient). q (B, H, q_len, d), q_len 1 to 8; k_cache and v_cache (B,
    H_kv, capacity, d), or, with block_table (B, pages_per_seq) int32, pages (num_pages, H_kv,
    page_size, d), page_size a multiple of 16 (key j of sequence b: row j % page_size of page
    block_table[b, j // page_size]); cache_seqlens (B,) int32, the keys each sequence has. k and
    v (B, H_kv, new_len, d), if given, are written into the caches at each sequence's end first
    (in place), and the step attends over cache_seqlens + new_len keys. The caches and tables
    contiguous CUDA tensors on q's device, float16 or bfloat16. Returns o (B, H, q_len, d), and
    lse (B, H, q_len) with return_lse."""
    with torch.no_grad():
        o, lse = build().kvcache_forward(
            q.contiguous(), k_cache, v_cache, cache_seqlens, block_table,
            None if k is None else k.contiguous(), None if v is None else v.contiguous(),
            bool(causal), *_options(softmax_scale, window_size, softcap, alibi_slopes))
    return (o, lse) if return_lse else o


def quantize_fp8(x):
    """x (B, H, len, d), float: (x8, descale), x8 float8_e4m3fn with each (batch, head) scaled so
    that its largest |x| becomes 448 (e4m3's largest finite value: nothing overflows, nothing is
    clamped), descale (B, H) float32 the factor back (1 for a head of zeros), as
    flash_attention_fp8 takes them. A non-finite element raises ValueError before anything is
    rounded."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError("quantize_fp8: x has an inf or a NaN; allowed: finite values")
    amax = x.detach().abs().amax(dim=(2, 3)).float()
    descale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    x8 = (x.detach().float() / descale[:, :, None, None]).to(torch.float8_e4m3fn)
    return x8, descale.contiguous()


def flash_attention_fp8(q, k, v, descale_q=None, descale_k=None, descale_v=None, causal=False,
                        out_dtype=torch.bfloat16, return_lse=False):
    """Chapter 3's fp8 forward (flash.h's flash_forward_fp8_hopper; inference: no gradient). q
    (B, H, q_len, d), k and v (B, H_kv, kv_len, d): contiguous float8_e4m3fn CUDA tensors
    (quantize_fp8 makes them), each (batch, head) standing for its elements times its descale
    (float32, (B, H) for q, (B, H_kv) for k and v; None: 1, FlashAttention-3's descale_q/k/v).
    head_dim 64, 128 or 256; an H100 or H200. P is rounded to e4m3 for P V (NOTES.md section 24:
    the error bound). Long rows: the fp8 tensor cores' accumulators drop low bits, so the sums
    over keys go through them a tile at a time, then into fp32; at head_dim 128 and 256, where
    o's sum keeps one level, v's columns are centred first (v - their mean, rounded to e4m3 again)
    so that o's sum does not grow with the row (NOTES.md section 24). Returns o
    (B, H, q_len, d) in out_dtype (bfloat16 or float16), and lse with return_lse."""
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"flash_attention_fp8: out_dtype is {out_dtype}; allowed: "
                         "torch.bfloat16, torch.float16")
    with torch.no_grad():
        o, lse = build().fp8_forward(q, k, v, descale_q, descale_k, descale_v, bool(causal),
                                     out_dtype == torch.bfloat16)
    return (o, lse) if return_lse else o


def _main():
    """`python3 flash_torch.py` (make torch): build the extension now, or say in one line what is
    missing; exit status 0 only when it is built."""
    why = missing()
    if why:
        return why
    try:
        build()
    except (ImportError, FileNotFoundError) as e:  # our checks' line, or a load that failed
        return f"flash_torch: {str(e).replace('flash_torch: ', '', 1)}"
    except (RuntimeError, OSError) as e:  # the compiler's output, then what failed
        return f"{e}\nflash_torch: building the extension failed (the compiler's output is above)"
    print(f"flash_torch: built in {os.path.relpath(os.path.join(_HERE, '.torch_build'))}/ "
          f"(torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST')})")
    return None


if __name__ == "__main__":
    sys.exit(_main())
