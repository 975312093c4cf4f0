"""flash_torch.py: this project's FlashAttention kernels (flash.h) as a PyTorch function.

    from flash_torch import flash_attention, flash_attention_with_lse
    o = flash_attention(q, k, v, causal=True)            # differentiable: o.backward(...) works
    o, lse = flash_attention_with_lse(q, k, v)           # lse: (batch, heads, q_len), float32

q: (batch, heads, q_len, head_dim), k and v: (batch, heads, kv_len, head_dim), CUDA tensors of
one dtype: float32 (chapter 1's kernels, CUDA cores), float16 or bfloat16 (chapter 2's, tensor
cores, compute capability 8.0 or newer); head_dim 16, 32, 64, 96, 128 or 256; any lengths. The
scale is 1/sqrt(head_dim), as in F.scaled_dot_product_attention.

The causal mask is bottom-right aligned, as in FlashAttention-2 >= 2.1: query i sees key j iff
j <= i + kv_len - q_len. PyTorch's is_causal=True is top-left aligned (j <= i); the two agree
when q_len == kv_len. For q_len != kv_len the matching PyTorch mask is
torch.nn.attention.bias.causal_lower_right(q_len, kv_len). A query row that sees no key (causal,
q_len > kv_len) gets o = 0, lse = -inf and zero gradients (SDPA gives NaN there).

Inputs that are not contiguous are copied to contiguous tensors first (a copy of the input's
size); the outputs are contiguous. Bad input raises ValueError naming the argument and what is
allowed (the C++ checks' own messages); a CUDA failure raises RuntimeError.

The C++ half (flash_torch.cpp over flash.cu, flash_fp16.cu, flash_hopper.cu, lib/) is
compiled on first import with torch.utils.cpp_extension.load (nvcc and ninja; a minute or two,
then cached in .torch_build/ beside this file), or ahead of time by `make torch`. Run the tests
with `pytest test_torch.py`; see example_train.py for a model that uses it.
"""
import os

import torch
from torch.utils.cpp_extension import load

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)  # the repository root: flash.h and the chapters' kernels


def _build():
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
    sources = [os.path.join(_HERE, "flash_torch.cpp")] + [
        os.path.join(_ROOT, s) for s in ("flash.cu", "flash_fp16.cu", "flash_hopper.cu", "lib/checks.cpp",
                                         "lib/dispatch.cpp")]
    return load(name="flash_torch_ext", sources=sources,
                extra_include_paths=[_ROOT, os.path.join(_ROOT, "lib")],
                extra_cflags=["-O3", "-std=c++17"],
                extra_cuda_cflags=["-O3", "-std=c++17", "-lineinfo"],
                build_directory=build_dir, verbose=os.environ.get("FLASH_TORCH_VERBOSE") == "1")


_ext = _build()


class FlashAttention(torch.autograd.Function):
    """Algorithms 1 and 2 of FlashAttention-2 as one autograd node.

    forward saves q, k, v, o and lse (fp32, one number a query row), not P: the backward
    recomputes P = exp(q k^T / sqrt(d) - lse) tile by tile, which is what keeps the memory of
    attention linear in the sequence length. Saving o lets the backward form D = rowsum(do * o).
    """

    @staticmethod
    def forward(ctx, q, k, v, causal):
        q, k, v = (t.contiguous() for t in (q, k, v))
        o, lse = _ext.forward(q, k, v, bool(causal))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = bool(causal)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _ext.backward(q, k, v, o, do.contiguous(), lse, ctx.causal)
        return dq, dk, dv, None


def flash_attention_with_lse(q, k, v, causal=False):
    """(o, lse): attention and the natural-log logsumexp of each row of scaled scores."""
    return FlashAttention.apply(q, k, v, causal)


def flash_attention(q, k, v, causal=False):
    """softmax(q k^T / sqrt(head_dim)) v, differentiable in q, k and v."""
    return FlashAttention.apply(q, k, v, causal)[0]
