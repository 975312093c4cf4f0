"""test_torch.py: flash_torch.py against PyTorch, on the GPU.

    pytest test_torch.py            (pytest.ini adds -rfEs: a skip prints its one-line reason)

Every check compares with a float64 reference run on exactly the inputs the kernels saw (already
rounded to their dtype), so the rounding of the inputs is no part of the error measured: the
same method as the C++ suite. The reference is plain PyTorch attention in float64 with the
bottom-right causal mask; a separate test shows that F.scaled_dot_product_attention agrees with
it (is_causal=True when q_len == kv_len, causal_lower_right otherwise). Beyond contiguous
tensors, the op is run as models call it: q, k, v as strided views (transposed, permuted, split
from one fused projection, sliced, expanded over heads, at an odd address) and gradients of o
that arrive expanded, transposed or sliced; forward and backward each time.

Without torch (>= flash_torch.MIN_TORCH, built with CUDA), a CUDA GPU, nvcc or ninja the module
skips, the reason in one line. A kernel or binding that does not compile is an error, not a skip.
"""
import math
import re

import pytest

try:
    import flash_torch
except ImportError as e:  # flash_torch's own one line: torch absent, too old or without CUDA
    if not str(e).startswith("flash_torch: "):
        raise
    pytest.skip(str(e), allow_module_level=True)
_missing = flash_torch.missing(need_gpu=True)
if _missing:
    pytest.skip(_missing, allow_module_level=True)
flash_torch.build()  # once, here: a compile error fails the module (the compiler's output shown)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flash_torch import (flash_attention, flash_attention_fp8,  # noqa: E402
                         flash_attention_varlen, flash_attention_varlen_with_lse,
                         flash_attention_with_kvcache, flash_attention_with_lse, quantize_fp8)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [16, 32, 64, 96, 128, 256]
# (batch, heads, q_len, kv_len): odd lengths, q_len != kv_len both ways, one tile and many.
SHAPES = [(1, 1, 1, 1), (2, 3, 17, 17), (1, 2, 100, 37), (2, 2, 37, 100), (1, 4, 257, 257),
          (1, 1, 130, 513)]


def sees(q_len, kv_len, device):
    """The bottom-right causal mask: query i sees key j iff j <= i + kv_len - q_len."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    return j <= i + kv_len - q_len


def attention64(q, k, v, causal):
    """(o, lse) of float64 q, k, v (any strides), differentiable in them; rows that see no key get
    o = 0 and lse = -inf."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~sees(q.shape[-2], k.shape[-2], q.device), -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    o = (e / l.clamp_min(1e-300)) @ v
    return o, (m + torch.log(l)).squeeze(-1)


def reference(q, k, v, causal):
    """(o, lse, (q, k, v)): attention64 of float64 leaves made from q, k, v."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, lse = attention64(q, k, v, causal)
    return o, lse, (q, k, v)


def unit_roundoff(dtype):
    return {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]


def tolerances(dtype, q, k, v, n_keys):
    """(tol_lse, tol_o, grad_rel): test_util.h's derivation, in brief. u32 = 2^-24, M = max|q|
    max|k| / sqrt(d) bounds every score. fp32: each score and the n-term sums are off by about
    u32 (M + sqrt(n)), times a safety factor 32: tol_lse = 32 u32 (M + sqrt(n) + 8), tol_o =
    max|v| tol_lse, gradients relative to their largest entry 32 u32 (M + sqrt(n) + sqrt(q_len) +
    8). fp16 / bf16 (u16 = 2^-11 / 2^-8): the tensor cores' products are exact, lse is fp32 (+2 u32
    M), and P and o are rounded to u16 once each, with the weights summing to 1 within u16: tol_o =
    max|v| (3 u16 + tol_lse); gradients: P, dS and the result rounded, dS's cancellation: 8 (3 u16
    + the fp32 term). Never loosen these to pass."""
    u32 = 2.0 ** -24
    d = q.shape[-1]
    M = q.abs().max().item() * k.abs().max().item() / math.sqrt(d)
    q_len = q.shape[-2]
    tol_lse = 32 * u32 * (M + math.sqrt(n_keys) + 8)
    grad32 = 32 * u32 * (M + math.sqrt(n_keys) + math.sqrt(q_len) + 8)
    vmax = v.abs().max().item()
    if dtype == torch.float32:
        return tol_lse, vmax * tol_lse, grad32
    u16 = unit_roundoff(dtype)
    tol_lse += 2 * u32 * M
    return tol_lse, vmax * (3 * u16 + tol_lse), 8 * (3 * u16 + grad32)


def inputs(shape, d, dtype, seed):
    """q, k, v ~ N(0, 1) rounded to dtype (never all ones or zeros), and a random do."""
    b, h, nq, nk = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, nq, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, h, nk, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, h, nk, d, device="cuda", generator=g).to(dtype)
    do = torch.randn(b, h, nq, d, device="cuda", generator=g).to(dtype)
    return q, k, v, do


def worst(got, want):
    """(largest |got - want|, where), for failure messages."""
    err = (got.double() - want.double()).abs()
    at = tuple(int(x) for x in torch.unravel_index(err.argmax(), err.shape))
    return err.max().item(), at


def check(name, got, want, tol, label):
    assert torch.isfinite(got).all(), f"{label}: {name} has NaN or inf"
    err, at = worst(got, want)
    assert err <= tol, f"{label}: {name} off by {err:.3g} at {at} (tolerance {tol:.3g})"


def check_against_reference(label, dtype, q, k, v, do, o, lse, want_o, want_lse, grads):
    """The checks of every run of the op: lse and o, then each (name, got, want) of grads, within
    tolerances() of the float64 reference. q, k, v, do: what the kernels were given (any strides).
    Returns (grad_rel, floor), the gradients' bound, for a test that derives another from it."""
    q_len, kv_len, d = q.shape[-2], k.shape[-2], q.shape[-1]
    tol_lse, tol_o, grad_rel = tolerances(dtype, q, k, v, kv_len)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert o.shape == q.shape and lse.shape == q.shape[:3]
    empty = torch.isinf(want_lse)  # rows that see no key: -inf in both
    assert torch.equal(torch.isinf(lse), empty), f"{label}: lse is -inf on the wrong rows"
    check("lse", lse[~empty], want_lse[~empty], tol_lse, label)
    check("o", o, want_o, tol_o, label)
    # dq, dk: dS = P (dP - D) cancels, leaving fp32 noise of about u |do| |v| a term that no
    # relative bound covers: a floor of that noise summed over keys / queries (test_util.h).
    u = unit_roundoff(dtype)
    floor = 32 * u * do.abs().max().item() * v.abs().max().item() * max(
        q.abs().max().item(), k.abs().max().item()) / math.sqrt(d) * math.sqrt(max(q_len, kv_len))
    for name, got, want in grads:
        assert got.dtype == dtype and got.shape == want.shape, f"{label}: {name} {got.shape}"
        check(name, got, want, grad_rel * want.abs().max().item() + floor, label)
    return grad_rel, floor


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_and_backward_match_the_float64_reference(dtype, d, shape, causal):
    label = f"{str(dtype).split('.')[-1]} B,H,Nq,Nk={shape} d={d} causal={causal}"
    q, k, v, do = inputs(shape, d, dtype, seed=hash((d, shape, causal)) % 2**31)
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = flash_attention_with_lse(q_, k_, v_, causal=causal)
    o.backward(do)
    want_o, want_lse, leaves = reference(q, k, v, causal)
    want_o.backward(do.double())
    check_against_reference(label, dtype, q, k, v, do, o, lse, want_o, want_lse, [
        ("dq", q_.grad, leaves[0].grad), ("dk", k_.grad, leaves[1].grad),
        ("dv", v_.grad, leaves[2].grad)])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_sdpa_agrees_with_the_causal_convention(dtype):
    """Ours is bottom-right aligned: PyTorch's is_causal=True when q_len == kv_len, and
    causal_lower_right(q_len, kv_len) otherwise (both on the math backend, in float64)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    for shape in [(2, 2, 64, 64), (1, 2, 40, 130)]:  # no row without a key
        q, k, v, _ = inputs(shape, 64, dtype, seed=7)
        o = flash_attention(q, k, v, causal=True)
        with sdpa_kernel(SDPBackend.MATH):
            qd, kd, vd = q.double(), k.double(), v.double()
            if shape[2] == shape[3]:
                want = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
            else:
                want = F.scaled_dot_product_attention(
                    qd, kd, vd, attn_mask=causal_lower_right(shape[2], shape[3]))
        _, tol_o, _ = tolerances(dtype, q, k, v, shape[3])
        check("o vs SDPA", o, want, tol_o, f"{dtype} {shape}")


def test_saved_tensors_are_inputs_output_and_lse_not_p():
    q, k, v, _ = inputs((1, 2, 300, 300), 64, torch.float16, seed=3)
    q.requires_grad_()
    o, lse = flash_attention_with_lse(q, k, v, causal=True)
    saved = o.grad_fn.saved_tensors
    shapes = sorted(tuple(t.shape) for t in saved)
    # q, k, v, o (B, H, N, d) and lse (B, H, N): nothing (N, N).
    assert shapes == sorted([(1, 2, 300, 64)] * 4 + [(1, 2, 300)]), shapes
    assert not lse.requires_grad


def test_non_contiguous_inputs_give_the_same_result():
    q, k, v, do = inputs((2, 3, 65, 65), 64, torch.bfloat16, seed=5)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, not contiguous
    assert not qt.is_contiguous()
    assert torch.equal(flash_attention(qt, k, v), flash_attention(q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_views_of_a_fused_projection_are_read_in_place_and_o_comes_back_in_their_layout(dtype):
    """Chapter 5's strides: q, k, v as (B, N, 3, H, d) views of one projection are what the
    kernels read (no copy), o (and dq, dk, dv) come back (B, N, H, d) in memory, so the model's
    o.transpose(1, 2).reshape(B, N, H d) is a view; an expanded or odd-offset tensor is copied."""
    from flash_torch import _readable
    b, n, h, d = 2, 100, 3, 64
    g = torch.Generator(device="cuda").manual_seed(7)
    qkv = randn(g, dtype, b, n, 3 * h * d).requires_grad_()
    q, k, v = qkv.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
    assert all(_readable(t) is t for t in (q, k, v))
    o = flash_attention(q, k, v, causal=True)
    assert o.transpose(1, 2).is_contiguous(), f"o's strides {o.stride()}"
    captured = {}
    o.register_hook(lambda grad: captured.setdefault("do", grad))
    o.backward(randn(g, dtype, b, n, h, d).transpose(1, 2))
    assert _readable(captured["do"]) is captured["do"], f"do's strides {captured['do'].stride()}"
    every_other = q[..., ::2]  # the last dimension strided: a copy
    assert _readable(every_other) is not every_other
    expanded = q[:, :1].expand(b, h, n, d)  # stride 0 over the heads: a copy
    assert _readable(expanded) is not expanded


# The op as models call it. A model's q, k, v are views of its own tensors (a projection viewed
# (B, N, H, d) and transposed, three slices of one fused projection, ...) and the gradient of o
# comes as the rest of the graph makes it (expanded by a sum, transposed, a slice of a larger
# one): the op reads them in place where its kernels can (float16 and bfloat16 views whose last
# dimension is contiguous) and copies the rest, and each case runs forward and backward.

def randn(g, dtype, *shape):
    """N(0, 1) rounded to dtype, on the GPU: random, never all ones or zeros."""
    return torch.randn(*shape, device="cuda", generator=g).to(dtype)


# name: (the tensors the model holds, made by (b, h, q_len, kv_len, d, dtype, generator); how it
# makes q, k, v of them, views all, given (tensors, b, h, q_len, kv_len, d); whether the layout
# needs q_len == kv_len).
LAYOUTS = {
    # (batch, seq, heads, head_dim), a projection's output viewed by head, then transposed.
    "bnhd-transposed": (
        lambda b, h, nq, nk, d, dt, g: [randn(g, dt, b, n, h, d) for n in (nq, nk, nk)],
        lambda ts, b, h, nq, nk, d: [t.transpose(1, 2) for t in ts], False),
    # (seq, batch, heads, head_dim), nn.MultiheadAttention's (L, N, E) order, permuted.
    "seq-first-permuted": (
        lambda b, h, nq, nk, d, dt, g: [randn(g, dt, n, b, h, d) for n in (nq, nk, nk)],
        lambda ts, b, h, nq, nk, d: [t.permute(1, 2, 0, 3) for t in ts], False),
    # One fused projection (B, N, 3 H d), viewed (B, N, 3, H, d) and permuted (3, B, H, N, d).
    "fused-qkv-permuted": (
        lambda b, h, nq, nk, d, dt, g: [randn(g, dt, b, nq, 3 * h * d)],
        lambda ts, b, h, nq, nk, d: ts[0].view(b, nq, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0),
        True),
    # The same projection split in three along its last dim, as example_train.py's Block does.
    "fused-qkv-split": (
        lambda b, h, nq, nk, d, dt, g: [randn(g, dt, b, nq, 3 * h * d)],
        lambda ts, b, h, nq, nk, d: [t.view(b, nq, h, d).transpose(1, 2)
                                     for t in ts[0].split(h * d, dim=-1)], True),
    # q: every other row of a longer tensor; k and v: the two halves of one (B, H, kv_len, 2 d)
    # tensor's last dim (v starts d elements in).
    "sliced": (
        lambda b, h, nq, nk, d, dt, g: [randn(g, dt, b, h, 2 * nq, d),
                                        randn(g, dt, b, h, nk, 2 * d)],
        lambda ts, b, h, nq, nk, d: [ts[0][:, :, ::2], ts[1][..., :d], ts[1][..., d:]], False),
    # q, k, v are themselves transposed views, and leaves: their gradients come back in that layout.
    "strided-leaves": (
        lambda b, h, nq, nk, d, dt, g: [randn(g, dt, b, n, h, d).transpose(1, 2)
                                        for n in (nq, nk, nk)],
        lambda ts, b, h, nq, nk, d: list(ts), False),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided_q_k_v_forward_and_backward(layout, dtype, causal):
    """q, k, v as views of a model's tensors (read in place by float16 and bfloat16, copied for
    float32: flash_torch._readable). o, lse and the gradients
    match the float64 reference run through the same views; each model tensor's gradient has its
    shape and strides, and 0 where no view reads it; and everything equals, bit for bit, the op
    on contiguous copies (flash.h: the kernels are deterministic)."""
    make, views, same_lengths = LAYOUTS[layout]
    b, h, nq, nk, d = (2, 3, 77, 77, 64) if same_lengths else (2, 3, 100, 37, 64)
    label = (f"{layout} {str(dtype).split('.')[-1]} B,H,Nq,Nk=({b}, {h}, {nq}, {nk}) d={d} "
             f"causal={causal}")
    g = torch.Generator(device="cuda").manual_seed(100 + 2 * list(LAYOUTS).index(layout) + causal)
    tensors = [t.requires_grad_() for t in make(b, h, nq, nk, d, dtype, g)]
    do = randn(g, dtype, b, h, nq, d)
    q, k, v = views(tensors, b, h, nq, nk, d)
    assert not any(t.is_contiguous() for t in (q, k, v)), f"{label}: a premise, strided views"
    o, lse = flash_attention_with_lse(q, k, v, causal=causal)
    o.backward(do)
    for t in tensors:
        assert t.grad.shape == t.shape and t.grad.stride() == t.stride(), (
            f"{label}: a gradient {tuple(t.grad.shape)} strides {t.grad.stride()} for a tensor "
            f"{tuple(t.shape)} strides {t.stride()}")
    read = [torch.zeros(t.shape, dtype=torch.bool, device="cuda") for t in tensors]
    for part in views(read, b, h, nq, nk, d):
        part.fill_(True)
    for t, r in zip(tensors, read):
        assert (t.grad[~r] == 0).all(), f"{label}: a gradient where no view reads"
    got = views([t.grad for t in tensors], b, h, nq, nk, d)

    leaves = [t.detach().double().requires_grad_() for t in tensors]
    want_o, want_lse = attention64(*views(leaves, b, h, nq, nk, d), causal)
    want_o.backward(do.double())
    want = views([t.grad for t in leaves], b, h, nq, nk, d)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    check_against_reference(label, dtype, qd, kd, vd, do, o, lse, want_o, want_lse,
                            list(zip(("dq", "dk", "dv"), got, want)))

    qc, kc, vc = (t.contiguous().requires_grad_() for t in (qd, kd, vd))
    oc, lsec = flash_attention_with_lse(qc, kc, vc, causal=causal)
    oc.backward(do)
    for name, x, y in [("o", o, oc), ("lse", lse, lsec)] + list(
            zip(("dq", "dk", "dv"), got, (qc.grad, kc.grad, vc.grad))):
        assert torch.equal(x, y), f"{label}: {name} differs from the op's on contiguous copies"


# name: (the shape of a random w, given (b, h, q_len, d); a backward through o that makes the
# gradient of o out of w, given (o, w)).
GRADIENTS = {
    # o.backward(w expanded over the query rows): stride 0 along q_len.
    "expanded": (lambda b, h, nq, d: (b, h, 1, d),
                 lambda o, w: o.backward(w.expand_as(o))),
    # A loss that sums o over the query rows: sum's backward hands w back expanded (stride 0).
    "from-a-sum": (lambda b, h, nq, d: (b, h, d),
                   lambda o, w: (o.sum(2) * w).sum().backward()),
    # o.backward(a (B, N, H, d) tensor transposed).
    "transposed": (lambda b, h, nq, d: (b, nq, h, d),
                   lambda o, w: o.backward(w.transpose(1, 2))),
    # A loss on o.transpose(1, 2), as a model's output projection reads o: the gradient of o
    # arrives transposed.
    "from-a-transpose": (lambda b, h, nq, d: (b, nq, h, d),
                         lambda o, w: (o.transpose(1, 2) * w).sum().backward()),
    # o.backward(the second half of a (B, H, N, 2 d) tensor's last dim): rows 2 d apart, offset.
    "sliced": (lambda b, h, nq, d: (b, h, nq, 2 * d),
               lambda o, w: o.backward(w[..., o.shape[-1]:])),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("gradient", list(GRADIENTS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradient_of_o_in_any_layout(gradient, dtype, causal):
    """The gradient of o as autograd hands it over, not contiguous (a hook sees it, so the
    premise is checked): the gradients match the float64 reference under the same backward, and
    equal, bit for bit, the op's with that gradient made contiguous."""
    w_shape, backward = GRADIENTS[gradient]
    b, h, nq, nk, d = 2, 3, 90, 130, 64
    label = (f"do {gradient} {str(dtype).split('.')[-1]} B,H,Nq,Nk=({b}, {h}, {nq}, {nk}) "
             f"d={d} causal={causal}")
    seed = 200 + 2 * list(GRADIENTS).index(gradient) + causal
    q, k, v, _ = inputs((b, h, nq, nk), d, dtype, seed=seed)
    w = randn(torch.Generator(device="cuda").manual_seed(seed), dtype, *w_shape(b, h, nq, d))
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = flash_attention_with_lse(q_, k_, v_, causal=causal)
    seen = []
    o.register_hook(seen.append)  # returns None: the gradient passes on unchanged
    backward(o, w)
    do = seen[0]
    assert not do.is_contiguous(), f"{label}: a premise, do arrives {do.stride()}"
    want_o, want_lse, leaves = reference(q, k, v, causal)
    backward(want_o, w.double())
    check_against_reference(label, dtype, q, k, v, do, o, lse, want_o, want_lse, [
        ("dq", q_.grad, leaves[0].grad), ("dk", k_.grad, leaves[1].grad),
        ("dv", v_.grad, leaves[2].grad)])

    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    flash_attention(qc, kc, vc, causal=causal).backward(do.contiguous())
    for name, x, y in [("dq", q_.grad, qc.grad), ("dk", k_.grad, kc.grad),
                       ("dv", v_.grad, vc.grad)]:
        assert torch.equal(x, y), f"{label}: {name} differs from the op's with do contiguous"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_keys_and_values_shared_by_every_head_through_expand(dtype, causal):
    """Multi-query attention written with expand: k and v are (B, 1, kv_len, d) tensors expanded
    over the heads (stride 0). The op copies them; autograd sums the heads' dk and dv into them."""
    b, h, nq, nk, d = 2, 4, 70, 45, 64
    label = (f"expanded k, v {str(dtype).split('.')[-1]} B,H,Nq,Nk=({b}, {h}, {nq}, {nk}) "
             f"causal={causal}")
    q, k, v, do = inputs((b, h, nq, nk), d, dtype, seed=300 + causal)
    k1, v1 = k[:, :1].clone(), v[:, :1].clone()
    q_, k1_, v1_ = (t.clone().requires_grad_() for t in (q, k1, v1))
    o, lse = flash_attention_with_lse(q_, k1_.expand(b, h, nk, d), v1_.expand(b, h, nk, d),
                                      causal=causal)
    o.backward(do)
    kx, vx = k1.expand(b, h, nk, d), v1.expand(b, h, nk, d)
    want_o, want_lse, leaves = reference(q, kx, vx, causal)  # leaves: one k and v per head
    want_o.backward(do.double())
    grad_rel, floor = check_against_reference(label, dtype, q, kx, vx, do, o, lse, want_o,
                                              want_lse, [("dq", q_.grad, leaves[0].grad)])
    # dk, dv: the sum over h heads of gradients each within grad_rel m + floor of its reference
    # (m: the largest per-head entry), then h roundings in the dtype of partial sums at most h m.
    u = unit_roundoff(dtype)
    for name, got, per_head in [("dk", k1_.grad, leaves[1].grad), ("dv", v1_.grad, leaves[2].grad)]:
        assert got.dtype == dtype and got.shape == (b, 1, nk, d), f"{label}: {name} {got.shape}"
        m = per_head.abs().max().item()
        check(name, got, per_head.sum(1, keepdim=True), h * (grad_rel * m + floor) + h * h * u * m,
              label)


def at_an_odd_address(t):
    """A contiguous copy of t that starts one element into its storage: not 16-byte aligned."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    return view


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_contiguous_views_at_an_odd_address_are_copied(dtype):
    """flash.h's kernels load 16 bytes at a time and refuse a pointer not 16-byte aligned; a
    contiguous view one element into a buffer is such a pointer. The op copies it (q, k, v and
    do): results equal, bit for bit, the op's on aligned copies, which match the reference."""
    b, h, nq, nk, d = 1, 2, 33, 50, 64
    label = f"odd address {str(dtype).split('.')[-1]}"
    q, k, v, do = inputs((b, h, nq, nk), d, dtype, seed=400)
    qm, km, vm = (at_an_odd_address(t).requires_grad_() for t in (q, k, v))
    o, lse = flash_attention_with_lse(qm, km, vm, causal=True)
    o.backward(at_an_odd_address(do))
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    o2, lse2 = flash_attention_with_lse(q_, k_, v_, causal=True)
    o2.backward(do)
    for name, x, y in [("o", o, o2), ("lse", lse, lse2), ("dq", qm.grad, q_.grad),
                       ("dk", km.grad, k_.grad), ("dv", vm.grad, v_.grad)]:
        assert torch.equal(x, y), f"{label}: {name} differs from the op's on aligned copies"
    want_o, want_lse, leaves = reference(q, k, v, True)
    want_o.backward(do.double())
    check_against_reference(label, dtype, q, k, v, do, o2, lse2, want_o, want_lse, [
        ("dq", q_.grad, leaves[0].grad), ("dk", k_.grad, leaves[1].grad),
        ("dv", v_.grad, leaves[2].grad)])


def test_a_second_derivative_raises_instead_of_being_dropped():
    """The kernels' gradients are not differentiable. Asked for a second derivative (here of a
    loss whose gradient of o depends on q), the op raises; it does not hand back a dq that
    autograd treats as a constant."""
    q, k, v, _ = inputs((1, 2, 40, 40), 64, torch.float32, seed=500)
    q.requires_grad_()
    o = flash_attention(q, k, v)
    (dq,) = torch.autograd.grad((o * o).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (dq * k).sum().backward()


def test_torch_compile_of_a_caller_gives_the_eager_result():
    """flash_attention is an opaque extension call to torch.compile: dynamo breaks the graph
    there and runs it eagerly (the count is printed); the result must not change."""
    def f(q, k, v):  # elementwise work around the call: exact in eager and compiled code alike
        return flash_attention(q * 2.0, k, v, causal=True) + 1.0
    q, k, v, _ = inputs((1, 2, 128, 128), 64, torch.float16, seed=11)
    eager = f(q, k, v)
    from torch import _dynamo
    explain = _dynamo.explain(f)(q, k, v)
    print(f"torch.compile: {explain.graph_break_count} graph break(s) around flash_attention")
    compiled = torch.compile(f)(q, k, v)
    assert torch.equal(compiled, eager)


def bad(**kw):
    base = dict(q=torch.randn(1, 2, 8, 64, device="cuda", dtype=torch.float16))
    base["k"] = base["q"].clone()
    base["v"] = base["q"].clone()
    base.update(kw)
    return base


@pytest.mark.parametrize("args, words", [
    (bad(q=torch.randn(1, 2, 8, 64, dtype=torch.float16)), ["q", "CUDA"]),
    (bad(q=torch.randn(1, 2, 8, 64, device="cuda", dtype=torch.float64)), ["float64", "dtype"]),
    (bad(k=torch.randn(1, 2, 8, 64, device="cuda")), ["k", "dtype"]),
    (bad(q=torch.randn(2, 8, 64, device="cuda", dtype=torch.float16)), ["4-D"]),
    (bad(v=torch.randn(1, 2, 9, 64, device="cuda", dtype=torch.float16)), ["v", "expected"]),
    (bad(k=torch.randn(1, 3, 8, 64, device="cuda", dtype=torch.float16)), ["heads"]),
    (bad(q=torch.randn(1, 6, 8, 64, device="cuda", dtype=torch.float16),
         k=torch.randn(1, 4, 8, 64, device="cuda", dtype=torch.float16),
         v=torch.randn(1, 4, 8, 64, device="cuda", dtype=torch.float16)), ["heads", "divide"]),
    (bad(k=torch.randn(1, 0, 8, 64, device="cuda", dtype=torch.float16),
         v=torch.randn(1, 0, 8, 64, device="cuda", dtype=torch.float16)), ["heads"]),
    (bad(q=torch.randn(1, 4, 8, 64, device="cuda", dtype=torch.float16),
         k=torch.randn(1, 2, 8, 64, device="cuda", dtype=torch.float16),
         v=torch.randn(1, 1, 8, 64, device="cuda", dtype=torch.float16)), ["v", "expected"]),
    (bad(**{n: torch.randn(1, 2, 8, 48, device="cuda", dtype=torch.float16)
            for n in "qkv"}), ["head_dim", "16, 32, 64, 96, 128, 256"]),
    (bad(**{n: torch.randn(1, 2, 8, 48, device="cuda") for n in "qkv"}), ["head_dim"]),
], ids=["cpu", "float64", "mixed-dtype", "3-D", "v-length", "heads", "gqa-not-a-divisor",
        "gqa-no-kv-heads", "gqa-v-heads", "head_dim-16bit", "head_dim-fp32"])
def test_bad_input_raises_value_error_with_the_message(args, words):
    with pytest.raises(ValueError) as e:
        flash_attention(**args)
    for w in words:
        assert w in str(e.value), f"{str(e.value)!r} does not name {w!r}"


# ---------------------------------------------------------------------------------------------
# Grouped-query attention (GQA) and multi-query attention (MQA): k and v with fewer heads than q,
# heads a multiple, against F.scaled_dot_product_attention(..., enable_gqa=True) (torch >= 2.5).

_TORCH = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
needs_enable_gqa = pytest.mark.skipif(
    _TORCH < (2, 5), reason=f"torch {torch.__version__} has no scaled_dot_product_attention("
    "enable_gqa=True), which the GQA tests compare against: it is new in torch 2.5")

# (batch, heads, kv_heads, q_len, kv_len): groups 1, 2, 4, 8 and MQA, odd lengths, q_len != kv_len
# both ways (causal with q_len > kv_len is left out: SDPA gives NaN in rows that see no key).
GQA_SHAPES = [(2, 4, 4, 33, 33), (2, 8, 4, 100, 137), (1, 8, 2, 37, 100), (2, 8, 1, 129, 129),
              (1, 6, 3, 65, 200), (2, 3, 1, 17, 17)]


@needs_enable_gqa
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", GQA_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_matches_sdpa_with_enable_gqa(dtype, d, shape, causal):
    """o, dq, dk, dv of the op with k, v of kv_heads heads against SDPA's enable_gqa=True in
    float64 (math backend; causal: the bottom-right mask as a boolean attn_mask), lse against the
    float64 reference on k, v repeated to every head. dk, dv sum over the group: their bound's
    terms that count summed terms (sqrt(q_len): fp32's accumulation, and the floor) count
    group * q_len of them (tests/test_gqa.cpp derives the same)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, h, h_kv, nq, nk = shape
    group = h // h_kv
    label = f"{str(dtype).split('.')[-1]} GQA B,H,H_kv,Nq,Nk={shape} d={d} causal={causal}"
    g = torch.Generator(device="cuda").manual_seed(hash((d, shape, causal)) % 2**31)
    q = torch.randn(b, h, nq, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, h_kv, nk, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, h_kv, nk, d, device="cuda", generator=g).to(dtype)
    do = torch.randn(b, h, nq, d, device="cuda", generator=g).to(dtype)
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = flash_attention_with_lse(q_, k_, v_, causal=causal)
    o.backward(do)
    assert k_.grad.shape == k.shape and v_.grad.shape == v.shape, label
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        mask = sees(nq, nk, q.device) if causal else None
        want_o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True)
    want_o.backward(do.double())
    # lse (SDPA gives none) from the float64 reference on k, v repeated to every query head.
    kx, vx = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    _, want_lse, _ = reference(q, kx, vx, causal)
    grad_rel, floor = check_against_reference(label, dtype, q, kx, vx, do, o, lse, want_o.detach(),
                                              want_lse.detach(), [("dq", q_.grad, qd.grad)])
    grow = (1 if dtype == torch.float32 else 8) * 32 * 2.0 ** -24 * (
        math.sqrt(group * nq) - math.sqrt(nq))
    for name, got, want in [("dk", k_.grad, kd.grad), ("dv", v_.grad, vd.grad)]:
        assert got.dtype == dtype, f"{label}: {name} {got.dtype}"
        check(name, got, want, (grad_rel + grow) * want.abs().max().item() +
              floor * math.sqrt(group), label)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_gqa_gradients_are_bitwise_deterministic(dtype):
    """dk, dv sum over each group in a fixed order (no atomics): three runs, the same bits."""
    q, do = (torch.randn(2, 8, 300, 64, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, 257, 64, device="cuda", dtype=dtype) for _ in range(2))
    runs = []
    for _ in range(3):
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        flash_attention(q_, k_, v_, causal=True).backward(do)
        runs.append((q_.grad, k_.grad, v_.grad))
    for again in runs[1:]:
        for name, x, y in zip(("dq", "dk", "dv"), runs[0], again):
            assert torch.equal(x, y), f"GQA {dtype}: {name} changed between identical runs"



@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("d", [64, 96, 256])
def test_deterministic_false_matches_the_reference_and_moves_only_dq(dtype, d):
    """deterministic=False: dq's parts added in whatever order the blocks reach them (chapter 3 at
    64 and 256; chapter 2 at 96 and chapter 1 in float32 keep the order, which False permits).
    dq is within the same tolerance of the float64 reference (an fp32 sum in another order); o,
    lse, dk and dv are the ordered call's bits."""
    label = f"{str(dtype).split('.')[-1]} d={d} deterministic=False"
    q, k, v, do = inputs((2, 3, 300, 333), d, dtype, seed=d + 7)
    runs = []
    for deterministic in (True, False):
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        o, lse = flash_attention_with_lse(q_, k_, v_, causal=True, deterministic=deterministic)
        o.backward(do)
        runs.append((o, lse, q_.grad, k_.grad, v_.grad))
    want_o, want_lse, leaves = reference(q, k, v, True)
    want_o.backward(do.double())
    o, lse, dq, dk, dv = runs[1]
    check_against_reference(label, dtype, q, k, v, do, o, lse, want_o, want_lse,
                            [("dq", dq, leaves[0].grad)])
    for name, x, y in zip(("o", "lse", "dk", "dv"), (o, lse, dk, dv),
                          (runs[0][0], runs[0][1], runs[0][3], runs[0][4])):
        assert torch.equal(x, y), f"{label}: {name} differs from the ordered call's"

# ---------------------------------------------------------------------------------------------
# Chapter 5's keyword arguments (float16, bfloat16): softmax_scale, window_size, softcap,
# alibi_slopes, against a float64 reference with the window as an explicit boolean mask and ALiBi
# as an explicit bias, and against F.scaled_dot_product_attention given that mask and bias.

def option_scores64(q, k, causal, scale, window, softcap, alibi):
    """(scores, visible) in float64: scale q k^T, capped, minus ALiBi's slope |i' - j|; visible is
    the window with causal, bottom-right (i' = i + kv_len - q_len), as FlashAttention-2's."""
    nq, nk = q.shape[-2], k.shape[-2]
    i = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
    j = torch.arange(nk, device=q.device)[None, :]
    visible = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if window[0] >= 0:
        visible &= j >= i - window[0]
    if window[1] >= 0:
        visible &= j <= i + window[1]
    if causal:
        visible &= j <= i
    s = scale * (q @ k.transpose(-1, -2))
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        slopes = alibi.double().reshape(*alibi.shape, 1, 1)  # (H, 1, 1) or (B, H, 1, 1)
        s = s - slopes * (i - j).abs().double()
    return s, visible


def attention64_options(q, k, v, causal, scale, window, softcap, alibi):
    """(o, lse) in float64 with the options, differentiable in q, k, v; empty rows o = 0,
    lse = -inf (attention64's softmax)."""
    s, visible = option_scores64(q, k, causal, scale, window, softcap, alibi)
    s = s.masked_fill(~visible, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    return (e / l.clamp_min(1e-300)) @ v, (m + torch.log(l)).squeeze(-1)


OPTION_CASES = [  # (batch, heads, q_len, kv_len, d, causal, scale, window, softcap, alibi)
    (1, 2, 300, 300, 64, True, None, (64, 0), 0.0, None),
    (2, 2, 200, 333, 128, False, None, (50, 30), 0.0, "per head"),
    (1, 3, 257, 130, 64, True, 0.2, (-1, -1), 5.0, None),
    (2, 2, 190, 190, 128, True, 0.1, (40, 0), 20.0, "per batch"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("case", OPTION_CASES, ids=["window", "two-sided+alibi", "softcap+scale",
                                                    "all"])
def test_options_match_the_float64_reference_and_sdpa(dtype, case):
    b, h, nq, nk, d, causal, scale, window, softcap, alibi_kind = case
    label = f"{str(dtype).split('.')[-1]} {case}"
    q, k, v, do = inputs((b, h, nq, nk), d, dtype, seed=500 + OPTION_CASES.index(case))
    alibi = None
    if alibi_kind:
        slopes = torch.tensor([2.0 ** (-8 * (x + 1) / h) for x in range(h)], device="cuda")
        alibi = slopes if alibi_kind == "per head" else torch.stack([slopes, slopes / 2])
    kw = dict(causal=causal, softmax_scale=scale, window_size=window, softcap=softcap,
              alibi_slopes=alibi)
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = flash_attention_with_lse(q_, k_, v_, **kw)
    o.backward(do)
    c = scale if scale is not None else 1 / math.sqrt(d)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want_o, want_lse = attention64_options(q64, k64, v64, causal, c, window, softcap, alibi)
    want_o.backward(do.double())
    # tolerances() with the scale's M (c max|q| max|k|) and the score terms of tanh.approx (c_cap
    # 2^-10) and of ALiBi's fp32 bias: test_util.h's ScoreTerms, the C++ suite's derivation.
    extra = softcap * 2.0 ** -10 + (0 if alibi is None else 4 * 2.0 ** -24 * alibi.max().item()
                                    * (nq + nk))
    tol_lse, tol_o, grad_rel = tolerances(dtype, q * (c * math.sqrt(d)), k, v, nk)
    tol_lse += extra
    tol_o += v.abs().max().item() * extra
    grad_rel += 8 * extra
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), empty), f"{label}: lse is -inf on the wrong rows"
    check("lse", lse[~empty], want_lse[~empty], tol_lse, label)
    check("o", o, want_o, tol_o, label)
    u = unit_roundoff(dtype)
    floor = 32 * u * do.abs().max().item() * v.abs().max().item() * max(
        q.abs().max().item(), k.abs().max().item()) * c * math.sqrt(max(nq, nk))
    for name, got, want in [("dq", q_.grad, q64.grad), ("dk", k_.grad, k64.grad),
                            ("dv", v_.grad, v64.grad)]:
        check(name, got, want, grad_rel * want.abs().max().item() + floor, label)
    if softcap == 0:  # SDPA takes the window as a mask and ALiBi as a bias: rows that see a key
        s, visible = option_scores64(q64.detach(), k64.detach(), causal, c, window, 0.0, alibi)
        bias = (s - c * (q64.detach() @ k64.detach().transpose(-1, -2))).masked_fill(~visible,
                                                                                     -math.inf)
        sdpa = F.scaled_dot_product_attention(q64.detach(), k64.detach(), v64.detach(),
                                              attn_mask=bias, scale=c)
        seen = ~empty
        check("o against SDPA", o[seen], sdpa[seen], tol_o, label)


def test_bad_options_raise_value_error_naming_them():
    q = torch.randn(1, 2, 8, 64, device="cuda", dtype=torch.float16)
    for kw, word in [(dict(window_size=(-2, 0)), "window_left"),
                     (dict(window_size=(0, -3)), "window_right"),
                     (dict(softcap=-1.0), "softcap"), (dict(softmax_scale=-0.5), "softmax_scale"),
                     (dict(alibi_slopes=torch.ones(3, device="cuda")), "alibi_slopes"),
                     (dict(alibi_slopes=torch.ones(2, device="cuda", dtype=torch.float16)),
                      "alibi_slopes")]:
        with pytest.raises(ValueError) as e:
            flash_attention(q, q, q, **kw)
        assert word in str(e.value), f"{kw}: {str(e.value)!r} does not name {word!r}"
    with pytest.raises(ValueError) as e:
        flash_attention(q.float(), q.float(), q.float(), softcap=5.0)
    assert "float16" in str(e.value)


VARLEN_CASES = [  # (query lengths, key lengths, heads, kv_heads, d, causal)
    ([100, 1, 257, 64], [100, 1, 257, 64], 4, 2, 64, True),
    ([30, 200, 5], [90, 60, 300], 2, 2, 128, False),
    ([77, 130], [200, 130], 2, 1, 256, True),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("case", VARLEN_CASES, ids=["gqa-causal", "cross", "mqa-d256"])
def test_packed_sequences_match_each_sequence_in_float64(dtype, case):
    """flash_attention_varlen (FlashAttention-2's flash_attn_varlen_func): each sequence of the
    packed batch, forward and backward, against the float64 reference of that sequence alone."""
    q_lens, k_lens, h, kh, d, causal = case
    g = torch.Generator(device="cuda").manual_seed(700 + VARLEN_CASES.index(case))
    nq, nk = sum(q_lens), sum(k_lens)
    q = torch.randn(nq, h, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(nk, kh, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(nk, kh, d, device="cuda", generator=g).to(dtype)
    do = torch.randn(nq, h, d, device="cuda", generator=g).to(dtype)
    cq = [0] + list(torch.tensor(q_lens).cumsum(0).tolist())
    ck = [0] + list(torch.tensor(k_lens).cumsum(0).tolist())
    cu_q = torch.tensor(cq, device="cuda", dtype=torch.int32)
    cu_k = torch.tensor(ck, device="cuda", dtype=torch.int32)
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = flash_attention_varlen_with_lse(q_, k_, v_, cu_q, cu_k, max(q_lens), max(k_lens),
                                             causal=causal)
    o.backward(do)
    assert o.shape == q.shape and lse.shape == (h, nq)
    group = h // kh
    for b in range(len(q_lens)):
        label = f"{str(dtype).split('.')[-1]} {case}, sequence {b}"
        rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        as_dense = lambda t: t.transpose(0, 1).unsqueeze(0)  # (n, H, d) -> (1, H, n, d)
        qb, dob = as_dense(q[rows]), as_dense(do[rows])
        kb, vb = (as_dense(t[keys]).repeat_interleave(group, dim=1) for t in (k, v))
        want_o, want_lse, (q64, k64, v64) = reference(qb, kb, vb, causal)
        want_o.backward(dob.double())
        per_kv = lambda t: t.view(1, kh, group, *t.shape[2:]).sum(2)  # GQA: sum the group
        check_against_reference(label, dtype, qb, kb, vb, dob, as_dense(o[rows]),
                                lse[:, rows].unsqueeze(0), want_o, want_lse,
                                [("dq", as_dense(q_.grad[rows]), q64.grad),
                                 ("dk", as_dense(k_.grad[keys]), per_kv(k64.grad)),
                                 ("dv", as_dense(v_.grad[keys]), per_kv(v64.grad))])


def test_bad_packed_sequences_raise_value_error_naming_them():
    q = torch.randn(12, 2, 64, device="cuda", dtype=torch.float16)
    good = torch.tensor([0, 4, 8, 12], device="cuda", dtype=torch.int32)
    for cu, longest, word in [([0, 6, 4, 12], 6, "cu_seqlens_q[2]"), ([1, 4, 8, 12], 6, "[0]"),
                              ([0, 2, 3, 12], 6, "max_seqlen_q"), ([0, 4, 8, 11], 6, "total_q")]:
        bad = torch.tensor(cu, device="cuda", dtype=torch.int32)
        with pytest.raises(ValueError) as e:
            flash_attention_varlen(q, q, q, bad, good, longest, 6)
        assert word in str(e.value), f"{cu}: {str(e.value)!r} does not name {word!r}"
    with pytest.raises(ValueError) as e:
        flash_attention_varlen(q, q, q, good.long(), good, 6, 6)
    assert "int32" in str(e.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("page", [16, 64], ids=["page16", "page64"])
def test_kvcache_paged_and_contiguous_match_the_float64_reference_and_each_other(dtype, page):
    """flash_attention_with_kvcache: 3 sequences of 0, 14 and 250 keys (8 query heads over 2,
    d = 128, 4 query rows, causal), 4 new keys appended, which cross a page for the second. The
    same keys in a contiguous cache and in shuffled pages: o bitwise the same, the appended rows in
    both caches, each sequence's o and lse within test_torch's tolerances of float64 attention
    over its own keys after the append."""
    g = torch.Generator(device="cuda").manual_seed(4603 + page)
    b, h, h_kv, nq, d, new = 3, 8, 2, 4, 128, 4
    pages_per_seq = 320 // page
    cap = pages_per_seq * page
    lens = [0, 14, 250]
    kc = torch.randn(b, h_kv, cap, d, device="cuda", generator=g).to(dtype)
    vc = torch.randn(b, h_kv, cap, d, device="cuda", generator=g).to(dtype)
    q = torch.randn(b, h, nq, d, device="cuda", generator=g).to(dtype)
    kn = torch.randn(b, h_kv, new, d, device="cuda", generator=g).to(dtype)
    vn = torch.randn(b, h_kv, new, d, device="cuda", generator=g).to(dtype)
    table = torch.randperm(b * pages_per_seq, device="cuda", generator=g).int().view(b, -1)
    kp = torch.empty(b * pages_per_seq, h_kv, page, d, device="cuda", dtype=dtype)
    vp = torch.empty_like(kp)
    for s in range(b):  # the contiguous cache's rows, page by page
        for p in range(pages_per_seq):
            kp[table[s, p]] = kc[s, :, p * page:(p + 1) * page]
            vp[table[s, p]] = vc[s, :, p * page:(p + 1) * page]
    seqlens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    o_c, lse_c = flash_attention_with_kvcache(q, kc, vc, seqlens, k=kn, v=vn, causal=True,
                                              return_lse=True)
    o_p = flash_attention_with_kvcache(q, kp, vp, seqlens, block_table=table, k=kn, v=vn,
                                       causal=True)
    assert torch.equal(o_c.view(torch.int16), o_p.view(torch.int16)), "paged o differs"
    for s, n in enumerate(lens):
        assert torch.equal(kc[s, :, n:n + new], kn[s]) and torch.equal(vc[s, :, n:n + new], vn[s])
        for r in range(new):
            p, row = table[s, (n + r) // page], (n + r) % page
            assert torch.equal(kp[p, :, row], kn[s, :, r]), f"sequence {s} row {n + r} not in page"
        keys = n + new
        kx = kc[s:s + 1, :, :keys].repeat_interleave(h // h_kv, dim=1)
        vx = vc[s:s + 1, :, :keys].repeat_interleave(h // h_kv, dim=1)
        want_o, want_lse = attention64(q[s:s + 1].double(), kx.double(), vx.double(), True)
        tol_lse, tol_o, _ = tolerances(dtype, q[s:s + 1], kx, vx, keys)
        label = f"{dtype} page {page} sequence {s} ({keys} keys)"
        check("o", o_c[s:s + 1], want_o, tol_o, label)
        check("lse", lse_c[s:s + 1], want_lse, tol_lse, label)


def test_kvcache_bad_input_raises_value_error_naming_it():
    q = torch.randn(1, 4, 1, 64, device="cuda").half()
    kc = torch.randn(1, 2, 64, 64, device="cuda").half()
    seqlens = torch.tensor([3], device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attention_with_kvcache(q, kc, kc.clone(), seqlens.long())
    with pytest.raises(ValueError, match="cache_seqlens\\[0\\] = 64"):
        flash_attention_with_kvcache(q, kc, kc.clone(), seqlens + 61, k=kc[:, :, :1].clone(),
                                     v=kc[:, :, :1].clone())
    with pytest.raises(ValueError, match="page_size"):  # pages of 24 keys
        flash_attention_with_kvcache(q, kc[:, :, :24].clone(), kc[:, :, :24].clone(), seqlens,
                                     block_table=torch.zeros(1, 2, device="cuda",
                                                             dtype=torch.int32))


_HOPPER = torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _HOPPER, reason="the fp8 forward needs an H100 or H200 (compute 9.0)")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_forward_is_within_the_rounding_bound_of_float64_attention(d, causal):
    # On the dequantized inputs (x8 * descale, exactly what the kernel multiplies), float64
    # attention differs from the kernel by P's rounding to e4m3 at most: |o - o64| <= (2^-4 +
    # n 2^-18) max|v| (NOTES.md section 24); by the scores' sums, if the fp8 tensor cores keep
    # only 14 bits (DeepSeek-V3's report): |dS| <= (d / 32) 2^-13 sum |q k| a score, which moves
    # each P by a relative 2 |dS| / sqrt(d) (the score and the row's max) = w, and lse by w; and
    # by o's rounding to bfloat16 and its fp32 sums (2^-8 |o|); at d >= 128, where v's columns
    # are centred and rounded again, by 2^-4 |v - mu| <= 2^-3 max|v| more (mu lies between the
    # column's extremes; and 2^-10 descale_v below e4m3's normal numbers). lse = m + log l, and
    # l sums the same e4m3-rounded P~ as o's numerator (on the tensor cores): each within 2^-4
    # of P~, or 2^-18 below e4m3's normal numbers, and l >= 1 (the max's P~ is 1, exact), so
    # log l moves by at most e = -log(1 - 2^-4 - n 2^-18), beside the scores' w.
    torch.manual_seed(d + causal)
    b, h, h_kv, n_q, n_k = 2, 4, 2, 200, 333
    q, k, v = (torch.randn(b, hh, n, d, device="cuda") for hh, n in
               ((h, n_q), (h_kv, n_k), (h_kv, n_k)))
    (q8, dq), (k8, dk), (v8, dv) = quantize_fp8(q), quantize_fp8(k), quantize_fp8(v)
    o, lse = flash_attention_fp8(q8, k8, v8, dq, dk, dv, causal=causal, return_lse=True)
    deq = [(x8.double() * ds.double()[:, :, None, None]) for x8, ds in ((q8, dq), (k8, dk),
                                                                       (v8, dv))]
    kx, vx = (x.repeat_interleave(h // h_kv, dim=1) for x in deq[1:])
    want, want_lse = attention64(deq[0], kx, vx, causal)
    max_v = vx.abs().amax(dim=(2, 3), keepdim=True)
    mag = (deq[0].abs() @ kx.abs().transpose(-1, -2)).amax(-1, keepdim=True)  # per row
    w = 2 * (d // 32) * 2.0 ** -13 * mag / math.sqrt(d)
    centred = 2.0 ** -3 * max_v + 2.0 ** -10 * dv.double()[:, :, None, None].repeat_interleave(
        h // h_kv, dim=1) if d >= 128 else 0
    bound = (2.0 ** -4 + n_k * 2.0 ** -18 + w) * max_v + 2.0 ** -8 * want.abs() + centred
    err = (o.double() - want).abs()
    worst = (err / bound).max().item()
    assert torch.isfinite(o).all(), "o has a NaN or an inf: not every element written"
    assert worst <= 1, f"d {d}, causal {causal}: o off by {worst:.3g} of its bound"
    seen = torch.isfinite(want_lse)
    assert (lse[~seen] == -math.inf).all()
    e = -math.log(1 - 2.0 ** -4 - n_k * 2.0 ** -18)
    lse_err = (lse.double() - want_lse).abs()[seen] / (w.squeeze(-1)[seen] + e)
    assert lse_err.max().item() <= 1, f"d {d}, causal {causal}: lse off by {lse_err.max():.3g}"


@pytest.mark.skipif(not _HOPPER, reason="the fp8 forward needs an H100 or H200 (compute 9.0)")
def test_fp8_bad_input_raises_value_error_naming_it():
    q = torch.randn(1, 2, 64, 64, device="cuda")
    with pytest.raises(ValueError, match="finite"):
        quantize_fp8(q.masked_fill(q > 2, math.inf))
    q8, dq = quantize_fp8(q)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        flash_attention_fp8(q, q8, q8)
    with pytest.raises(ValueError, match="descale_k"):
        flash_attention_fp8(q8, q8, q8, dq, dq[:, :1])
    with pytest.raises(ValueError, match="out_dtype"):
        flash_attention_fp8(q8, q8, q8, out_dtype=torch.float32)
