"""test_torch.py: flash_torch.py against PyTorch, on the GPU.

    pytest test_torch.py            (skips, with one line, where PyTorch or a CUDA GPU is missing)

Every check compares with a float64 reference run on exactly the inputs the kernels saw (already
rounded to their dtype), so the rounding of the inputs is no part of the error measured: the
same method as the C++ suite. The reference is plain PyTorch attention in float64 with the
bottom-right causal mask; a separate test shows that F.scaled_dot_product_attention agrees with
it (is_causal=True when q_len == kv_len, causal_lower_right otherwise).
"""
import math

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the PyTorch tests skip")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: the PyTorch tests skip", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

from flash_torch import flash_attention, flash_attention_with_lse  # noqa: E402

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


def reference(q, k, v, causal):
    """(o, lse) in float64, differentiable; rows that see no key get o = 0 and lse = -inf."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~sees(q.shape[-2], k.shape[-2], q.device), -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    o = (e / l.clamp_min(1e-300)) @ v
    return o, (m + torch.log(l)).squeeze(-1), (q, k, v)


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
    tol_lse, tol_o, grad_rel = tolerances(dtype, q, k, v, shape[3])
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert lse.shape == shape[:3]
    empty = torch.isinf(want_lse)  # rows that see no key: -inf in both
    assert torch.equal(torch.isinf(lse), empty), f"{label}: lse is -inf on the wrong rows"
    check("lse", lse[~empty], want_lse[~empty], tol_lse, label)
    check("o", o, want_o, tol_o, label)
    # dq, dk: dS = P (dP - D) cancels, leaving fp32 noise of about u |do| |v| a term that no
    # relative bound covers: a floor of that noise summed over keys / queries (test_util.h).
    u = unit_roundoff(dtype)
    floor = 32 * u * do.abs().max().item() * v.abs().max().item() * max(
        q.abs().max().item(), k.abs().max().item()) / math.sqrt(d) * math.sqrt(max(shape[2:]))
    for name, got, ref in [("dq", q_.grad, leaves[0].grad), ("dk", k_.grad, leaves[1].grad),
                           ("dv", v_.grad, leaves[2].grad)]:
        assert got.dtype == dtype and got.shape == ref.shape
        check(name, got, ref, grad_rel * ref.abs().max().item() + floor, label)


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


def test_non_contiguous_inputs_are_copied_and_give_the_same_result():
    q, k, v, do = inputs((2, 3, 65, 65), 64, torch.bfloat16, seed=5)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, not contiguous
    assert not qt.is_contiguous()
    assert torch.equal(flash_attention(qt, k, v), flash_attention(q, k, v))


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
    (bad(**{n: torch.randn(1, 2, 8, 48, device="cuda", dtype=torch.float16)
            for n in "qkv"}), ["head_dim", "16, 32, 64, 96, 128, 256"]),
    (bad(**{n: torch.randn(1, 2, 8, 48, device="cuda") for n in "qkv"}), ["head_dim"]),
], ids=["cpu", "float64", "mixed-dtype", "3-D", "v-length", "heads", "head_dim-16bit",
        "head_dim-fp32"])
def test_bad_input_raises_value_error_with_the_message(args, words):
    with pytest.raises(ValueError) as e:
        flash_attention(**args)
    for w in words:
        assert w in str(e.value), f"{str(e.value)!r} does not name {w!r}"
