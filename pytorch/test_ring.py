"""test_ring.py: ring_attention.py, on the CPU (its schedule and arithmetic), on one GPU (the
kernels accept an O and L they did not produce) and on two (the ring over NCCL).

    pytest test_ring.py            (pytest.ini adds -rfEs: a skip prints its one-line reason)

CPU (any torch): the zigzag's kernel calls cover the causal mask exactly once with equal work a
rank; shard/unshard invert each other; the merge through L handles rows without keys; and the
whole ring, simulated in one process with float64 attention in place of the kernels
(ring_attention.simulate), gives the whole sequence's O, L, dQ, dK, dV to 1e-10: the schedule,
the merge, the backward with the global O and L and the routing of dK, dV home.

GPU: compared with a float64 reference on exactly the inputs the kernels saw (rounded to their
dtype) and with one GPU's op on the whole sequence, within tolerances derived from
test_torch.tolerances (see ring_tolerances). The two-GPU cases run in one spawn of two processes
(NCCL on localhost), each rank checking its own positions; fewer than 2 GPUs, no NCCL or no
torch: they skip, with one line.
"""
import json
import math
import os
import socket
import tempfile
import time
import zlib

import pytest

try:
    import torch
except ModuleNotFoundError:
    pytest.skip("test_ring: PyTorch is not installed (pip install torch)", allow_module_level=True)

import ring_attention as ra  # noqa: E402  (its helpers need torch only, not CUDA)

# ----------------------------------------------------------------------------------------------
# float64 attention, the stand-in for the kernels: (o, lse) and the backward from a given o, lse.


def _sees(q_len, kv_len, device):
    """Bottom-right causal mask, as the kernels: query i sees key j iff j <= i + kv_len - q_len."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    return j <= i + kv_len - q_len


def _scores(q, k, causal):
    group = q.shape[1] // k.shape[1]
    kx = k.repeat_interleave(group, dim=1)
    s = q @ kx.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~_sees(q.shape[-2], k.shape[-2], q.device), -math.inf)
    return s, group


def attend64(q, k, v, causal):
    """(o, lse) in float64, k, v with kv_heads heads; rows that see no key: o = 0, lse = -inf."""
    s, group = _scores(q, k, causal)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe.unsqueeze(-1))
    return p @ v.repeat_interleave(group, dim=1), lse


def grad64(q, k, v, o, do, lse, causal):
    """Algorithm 2 in float64 from a GIVEN o and lse (not necessarily this call's):
    P = exp(S - L), dP = dO V^T, D = rowsum(dO o O), dS = P (dP - D)."""
    s, group = _scores(q, k, causal)
    p = torch.exp(s - lse.unsqueeze(-1))
    vx = v.repeat_interleave(group, dim=1)
    dp = do @ vx.transpose(-1, -2)
    D = (do * o).sum(-1, keepdim=True)
    ds = p * (dp - D) / math.sqrt(q.shape[-1])
    kx = k.repeat_interleave(group, dim=1)
    dq = ds @ kx
    b, h_kv, n, d = k.shape
    dk = (ds.transpose(-1, -2) @ q).view(b, h_kv, group, n, d).sum(2)
    dv = (p.transpose(-1, -2) @ do).view(b, h_kv, group, n, d).sum(2)
    return dq, dk, dv


def whole64(q, k, v, do, causal):
    """o, lse, dq, dk, dv of the whole sequence in float64 by autograd."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, lse = attend64(q, k, v, causal)
    o.backward(do.double())
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


# ----------------------------------------------------------------------------------------------
# CPU: the schedule and the arithmetic.

@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16])
@pytest.mark.parametrize("seq_len_over", [0, 1, 3, 7])
def test_zigzag_covers_the_causal_mask_once_with_equal_work(world, seq_len_over):
    """Every (query, key) the causal mask allows is computed by exactly one kernel call, none it
    forbids; the diagonal calls are square; each rank's count of (query, key) pairs is the same
    when 2 world divides seq_len, and within the chunks' one-position differences otherwise."""
    seq_len = 24 * world + seq_len_over
    lens = ra.shard_lengths(seq_len, world)
    pos = [ra.shard_positions(seq_len, world, r) for r in range(world)]
    assert sorted(p for ps in pos for p in ps) == list(range(seq_len)), "shards: every position once"
    seen, work = {}, []
    for rank in range(world):
        count = 0
        for step in range(world):
            src = (rank - step) % world
            for rows, keys, diag in ra.pairs(rank, src, lens, True):
                nq, nk = rows.stop - rows.start, keys.stop - keys.start
                assert not diag or nq == nk, f"a diagonal call of {nq} queries, {nk} keys"
                for a in range(rows.start, rows.stop):
                    for b in range(keys.start, keys.stop):
                        if diag and b > a + nk - nq:
                            continue
                        ij = (pos[rank][a], pos[src][b])
                        assert ij not in seen, f"world {world} N {seq_len}: {ij} computed twice"
                        seen[ij] = rank
                        count += 1
        work.append(count)
    want = {(i, j) for i in range(seq_len) for j in range(i + 1)}
    assert set(seen) == want, f"world {world} N {seq_len}: {len(set(seen) ^ want)} pairs wrong"
    if seq_len_over == 0:
        assert len(set(work)) == 1, f"world {world} N {seq_len}: work {work}"
    else:  # a chunk one longer adds at most one row or column of every block it is in
        assert max(work) - min(work) <= 4 * world * (seq_len // world + 2), work


def test_shard_and_unshard_invert_each_other():
    for world in (1, 2, 3, 4, 8, 16):
        for seq_len in (2 * world, 2 * world + 1, 101):
            x = torch.arange(seq_len * 2, dtype=torch.float64).view(1, 1, seq_len, 2)
            parts = [ra.shard(x, r, world) for r in range(world)]
            for r, p in enumerate(parts):
                assert p[0, 0, :, 0].long().div(2, rounding_mode="floor").tolist() == \
                    ra.shard_positions(seq_len, world, r)
            assert torch.equal(ra.unshard(parts), x)
    with pytest.raises(ValueError, match="at least 2 \\* world"):
        ra.chunk_lengths(3, 2)


def test_merge_through_lse_is_exact_and_handles_rows_without_keys():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64)
    o_want, lse_want = attend64(q, k, v, False)
    o = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float64)
    for keys in (slice(0, 4), slice(4, 9)):
        ra.merge_(o, lse, *attend64(q, k[:, :, keys], v[:, :, keys], False))
    assert (o - o_want).abs().max() < 1e-12 and (lse - lse_want).abs().max() < 1e-12
    # A part whose rows see no key (causal, 5 queries over 2 keys: rows 0-2 see none) has weight
    # 0; merging it into an empty accumulator leaves those rows at o = 0, lse = -inf, no NaN.
    o2 = torch.zeros_like(q)
    lse2 = torch.full(q.shape[:3], -math.inf, dtype=torch.float64)
    ra.merge_(o2, lse2, *attend64(q, k[:, :, :2], v[:, :, :2], True))
    assert torch.isneginf(lse2[..., :3]).all() and (o2[..., :3, :] == 0).all()
    assert torch.isfinite(o2).all() and torch.isfinite(lse2[..., 3:]).all()


def simulated_ring(q, k, v, do, causal, world, attend=attend64, grad=grad64):
    """The ring's forward and backward for every rank, in one process (ring_attention.simulate),
    on the whole q, k, v, do; returns unsharded o, lse, dq, dk, dv. o passed to the backward is
    the merged one in q's dtype, as RingAttention saves it."""
    n = q.shape[2]
    lens = ra.shard_lengths(n, world)
    parts = [[ra.shard(t, r, world) for t in (q, k, v, do)] for r in range(world)]
    fwd = ra.simulate([ra._forward_steps(qs, ks, vs, causal, r, world, lens, attend)
                       for r, (qs, ks, vs, _) in enumerate(parts)])
    outs = [(o.to(q.dtype), lse) for o, lse in fwd]
    bwd = ra.simulate([ra._backward_steps(qs, ks, vs, outs[r][0], dos, outs[r][1], causal, r,
                                          world, lens, grad)
                       for r, (qs, ks, vs, dos) in enumerate(parts)])
    return (ra.unshard([o for o, _ in outs]), ra.unshard([lse for _, lse in outs]),
            *(ra.unshard([b[i] for b in bwd]) for i in range(3)))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(3, 3), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_simulated_ring_in_float64_equals_the_whole_sequence(world, causal, heads):
    """The ring with float64 attention in place of the kernels: O, L and every gradient equal
    the whole sequence's to 1e-10 (float64 rounding only), seq_len not a multiple of 2 world."""
    h, h_kv = heads
    g = torch.Generator().manual_seed(world * 10 + causal)
    n = 8 * world + 3
    q = torch.randn(2, h, n, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, h_kv, n, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, h_kv, n, 16, generator=g, dtype=torch.float64)
    do = torch.randn(2, h, n, 16, generator=g, dtype=torch.float64)
    got = simulated_ring(q, k, v, do, causal, world)
    want = whole64(q, k, v, do, causal)
    for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        err = (x - y).abs().max().item()
        assert err < 1e-10, f"world {world} causal {causal} heads {heads}: {name} off by {err:.3g}"


# ----------------------------------------------------------------------------------------------
# GPU: tolerances, and the checks.

def ring_tolerances(dtype, q, k, v, do, parts_max, calls, want):
    """Bounds for the ring's results (or any merge of `calls` kernel calls a row), derived from
    test_torch.tolerances for one call over the whole sequence (whose terms grow with the number
    of keys, so they bound every call over fewer):
      lse: each call's L_s within tol_lse; L = logsumexp of them moves by at most the largest
           error (its weights sum to 1); each fp32 merge adds a few u32 |L|, |L| <= M + ln N:
           tol_lse + 4 calls u32 (M + ln N + 1).
      o:   each partial O_s within vmax (3 u16 + tol_lse) (test_torch's bound, its rounding to the
           dtype included); the merge is a convex combination (no growth), its weights exp(L_s -
           L) each off by 2 tol_lse relative (vmax 2 tol_lse), fp32 merging 2 calls u32 vmax, and
           one more rounding to the dtype at the end (u16 vmax): vmax (4 u16 + 3 tol_lse_ring +
           2 calls u32).
      dq, dk, dv: each call's share within grad_rel m + floor (test_torch's bound; m: the largest
           entry of that share, parts_max, from the float64 simulation), summed over at most
           `calls` shares in fp32, then rounded once: calls (grad_rel m + floor) + u16 max|want|.
           Grouped heads: the kernel's own sum over the group adds test_torch's GQA terms.
    want: dict name -> the float64 reference (for max|want|). Returns dict name -> tolerance."""
    import test_torch  # the single-GPU derivation, reused (flash_torch is built by then)
    u32 = 2.0 ** -24
    u16 = test_torch.unit_roundoff(dtype)
    n, d = q.shape[-2], q.shape[-1]
    M = q.abs().max().item() * k.abs().max().item() / math.sqrt(d)
    tol_lse, _, grad_rel = test_torch.tolerances(dtype, q, k, v, n)
    vmax = v.abs().max().item()
    tol = {"lse": tol_lse + 4 * calls * u32 * (M + math.log(n) + 1)}
    tol["o"] = vmax * (4 * u16 + 3 * tol["lse"] + 2 * calls * u32)
    floor = 32 * u16 * do.abs().max().item() * vmax * max(
        q.abs().max().item(), k.abs().max().item()) / math.sqrt(d) * math.sqrt(n)
    group = q.shape[1] // k.shape[1]
    grow = 8 * 32 * u32 * (math.sqrt(group * n) - math.sqrt(n))
    for name in ("dq", "dk", "dv"):
        rel, fl = (grad_rel, floor) if name == "dq" else (grad_rel + grow, floor * math.sqrt(group))
        tol[name] = calls * (rel * parts_max[name] + fl) + u16 * want[name].abs().max().item()
    return tol


def single_tolerances(dtype, q, k, v, do, want):
    """test_torch's bounds for one GPU's op on the whole sequence (check_against_reference's, and
    the GQA test's for dk, dv)."""
    import test_torch
    n, d = q.shape[-2], q.shape[-1]
    tol_lse, tol_o, grad_rel = test_torch.tolerances(dtype, q, k, v, n)
    u = test_torch.unit_roundoff(dtype)
    floor = 32 * u * do.abs().max().item() * v.abs().max().item() * max(
        q.abs().max().item(), k.abs().max().item()) / math.sqrt(d) * math.sqrt(n)
    group = q.shape[1] // k.shape[1]
    grow = 8 * 32 * 2.0 ** -24 * (math.sqrt(group * n) - math.sqrt(n))
    tol = {"lse": tol_lse, "o": tol_o, "dq": grad_rel * want["dq"].abs().max().item() + floor}
    for name in ("dk", "dv"):
        tol[name] = ((grad_rel + grow) * want[name].abs().max().item() +
                     floor * math.sqrt(group))
    return tol


def largest_shares(q, k, v, do, causal, world):
    """The largest entry of any one kernel call's share of dq, dk, dv in the ring's schedule,
    from the float64 simulation (for ring_tolerances); and the most calls a row takes part in."""
    biggest = {"dq": 0.0, "dk": 0.0, "dv": 0.0}

    def grad(*args):
        shares = grad64(*args)
        for name, t in zip(("dq", "dk", "dv"), shares):
            biggest[name] = max(biggest[name], t.abs().max().item())
        return shares
    qd, kd, vd, dod = (t.double() for t in (q, k, v, do))
    simulated_ring(qd, kd, vd, dod, causal, world, grad=grad)
    return biggest, world


def compare(label, results, want, tol, want_tol_extra=None):
    """Failure lines for each name: finite everywhere, and within tol of want (plus, for a
    comparison with another approximation, that one's own bound). lse compared where finite."""
    bad = []
    for name, got in results.items():
        ref = want[name]
        if not torch.isfinite(got).all():
            bad.append(f"{label}: {name} has NaN or inf (or was not fully written)")
            continue
        err = (got.double() - ref.double()).abs()
        at = tuple(int(x) for x in torch.unravel_index(err.argmax(), err.shape))
        bound = tol[name] + (want_tol_extra[name] if want_tol_extra else 0.0)
        if err.max().item() > bound:
            bad.append(f"{label}: {name} off by {err.max().item():.3g} at {at} "
                       f"(tolerance {bound:.3g})")
    return bad


def _gpu_missing(n_gpus):
    """None, or one line saying why the GPU tests cannot run here."""
    try:
        import flash_torch
    except ImportError as e:
        return str(e)
    why = flash_torch.missing(need_gpu=True)
    if why:
        return why
    if torch.cuda.device_count() < n_gpus:
        return (f"test_ring: the ring tests need {n_gpus} GPUs on one host; this machine has "
                f"{torch.cuda.device_count()}")
    if n_gpus > 1 and not torch.distributed.is_nccl_available():
        return "test_ring: this torch has no NCCL (torch.distributed.is_nccl_available() is False)"
    return None


def _inputs(shape, d, dtype, seed, device):
    b, h, h_kv, n = shape
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, h, n, d, device=device, generator=g).to(dtype)
    k = torch.randn(b, h_kv, n, d, device=device, generator=g).to(dtype)
    v = torch.randn(b, h_kv, n, d, device=device, generator=g).to(dtype)
    do = torch.randn(b, h, n, d, device=device, generator=g).to(dtype)
    return q, k, v, do


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_kernel_accepts_an_o_and_lse_it_did_not_produce(dtype, causal, d):
    """One GPU: the keys cut in two unequal parts; the forward of each part, merged through L;
    then the backward of each part given the MERGED o and L, its dq summed and its dk, dv put
    side by side: equal to the whole op's and to the float64 reference, within bounds derived
    from the single-GPU ones. Causal: part A is the queries before the cut against the keys
    before it (causal, square), part B the queries after the cut against every key before it
    (full) and against the keys after it (causal, square)."""
    why = _gpu_missing(1)
    if why:
        pytest.skip(why)
    import flash_torch
    ext = flash_torch.build()
    dt = getattr(torch, dtype)
    b, h, n, cut = 2, 3, 300, 111
    label = f"split keys {dtype} B,H,N=({b}, {h}, {n}) cut {cut} d={d} causal={causal}"
    q, k, v, do = _inputs((b, h, h, n), d, dt, seed=600 + d + causal, device="cuda")
    before, after = slice(0, cut), slice(cut, n)
    calls = ([(slice(0, n), before, False), (slice(0, n), after, False)] if not causal else
             [(before, before, True), (after, before, False), (after, after, True)])
    o32 = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device="cuda")
    for rows, keys, diag in calls:
        o_s, lse_s = ext.forward(*(t[:, :, s].contiguous() for t, s in
                                   ((q, rows), (k, keys), (v, keys))), diag)
        ra.merge_(o32[:, :, rows], lse[:, :, rows], o_s, lse_s)
    o = o32.to(dt)
    dq = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    dk = torch.zeros(k.shape, dtype=torch.float32, device="cuda")
    dv = torch.zeros(v.shape, dtype=torch.float32, device="cuda")
    biggest = {"dq": 0.0, "dk": 0.0, "dv": 0.0}
    want_o, want_lse, *want_g = whole64(q, k, v, do, causal)
    for rows, keys, diag in calls:
        args = [t[:, :, s].contiguous() for t, s in ((q, rows), (k, keys), (v, keys), (o, rows),
                                                     (do, rows), (lse, rows))]
        dq_s, dk_s, dv_s = ext.backward(*args, diag)
        dq[:, :, rows] += dq_s
        dk[:, :, keys] += dk_s
        dv[:, :, keys] += dv_s
        exact = grad64(*(a.double() for a in args[:5]), want_lse[:, :, rows], diag)
        for name, t in zip(("dq", "dk", "dv"), exact):
            biggest[name] = max(biggest[name], t.abs().max().item())
    got = {"o": o, "lse": lse, "dq": dq.to(dt), "dk": dk.to(dt), "dv": dv.to(dt)}
    want = {"o": want_o, "lse": want_lse, "dq": want_g[0], "dk": want_g[1], "dv": want_g[2]}
    tol = ring_tolerances(dt, q, k, v, do, biggest, 2, want)
    bad = compare(label + " vs float64", got, want, tol)
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    o1, lse1 = flash_torch.flash_attention_with_lse(q_, k_, v_, causal=causal)
    o1.backward(do)
    one = {"o": o1, "lse": lse1, "dq": q_.grad, "dk": k_.grad, "dv": v_.grad}
    bad += compare(label + " vs the whole op", got, one, tol,
                   single_tolerances(dt, q, k, v, do, want))
    assert not bad, "\n".join(bad)


# ----------------------------------------------------------------------------------------------
# Two GPUs: one spawn runs every case; each rank checks its own positions.

# (batch, heads, kv_heads, seq_len): seq_len not a multiple of 2 world = 4 (1001 % 4 = 1,
# 518 % 4 = 2, 7 % 4 = 3: chunks of 2, 2, 2 and 1), grouped heads once.
RING_SHAPES = [(2, 3, 3, 1001), (1, 4, 2, 518), (1, 2, 2, 7)]
RING_CASES = [(dtype, d, causal, shape) for dtype in ("float16", "bfloat16") for d in (64, 128)
              for causal in (False, True) for shape in RING_SHAPES]


def _case_id(case):
    dtype, d, causal, shape = case
    return f"{dtype}-d{d}-{'causal' if causal else 'full'}-{'x'.join(map(str, shape))}"


def _run_case(case, rank, world):
    """The ring on this rank's part, one GPU's op and the float64 reference on the whole; the
    failure lines for this rank's positions."""
    import flash_torch
    dtype, d, causal, shape = case
    dt = getattr(torch, dtype)
    label = f"rank {rank}/{world} {_case_id(case)}"
    q, k, v, do = _inputs(shape, d, dt, seed=zlib.crc32(_case_id(case).encode()), device="cuda")
    mine = [ra.shard(t, rank, world).requires_grad_() for t in (q, k, v)]
    o, lse = ra.ring_attention_with_lse(*mine, causal=causal)
    o.backward(ra.shard(do, rank, world))
    got = {"o": o, "lse": lse, "dq": mine[0].grad, "dk": mine[1].grad, "dv": mine[2].grad}
    for name in ("dq", "dk", "dv"):
        assert got[name].dtype == dt, f"{label}: {name} is {got[name].dtype}"
    torch.cuda.synchronize()

    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    o1, lse1 = flash_torch.flash_attention_with_lse(q_, k_, v_, causal=causal)
    o1.backward(do)
    whole_one = {"o": o1, "lse": lse1, "dq": q_.grad, "dk": k_.grad, "dv": v_.grad}
    want_o, want_lse, dq, dk, dv = whole64(q, k, v, do, causal)
    whole_want = {"o": want_o, "lse": want_lse, "dq": dq, "dk": dk, "dv": dv}
    biggest, calls = largest_shares(q, k, v, do, causal, world)
    tol = ring_tolerances(dt, q, k, v, do, biggest, calls, whole_want)
    tol_one = single_tolerances(dt, q, k, v, do, whole_want)
    want = {n: ra.shard(t, rank, world) for n, t in whole_want.items()}
    one = {n: ra.shard(t, rank, world) for n, t in whole_one.items()}
    return (compare(label + " vs float64", got, want, tol) +
            compare(label + " vs one GPU's op", got, one, tol, tol_one))


def _worker(rank, world, port, cases, out_dir):
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    results = {}
    for case in cases:
        try:
            results[_case_id(case)] = _run_case(case, rank, world)
        except AssertionError as e:  # raised after the case's ring calls: no rank left waiting
            results[_case_id(case)] = [str(e)]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ring_results():
    """Every RING_CASE on 2 ranks, one spawn; {case id: [failure lines of both ranks]}. A rank
    that dies (a crash, a kernel error) fails every case with the spawn's error; a spawn that
    outlives its deadline (a rank stuck on the ring) is killed and fails them too."""
    why = _gpu_missing(2)
    if why:
        pytest.skip(why)
    import flash_torch
    import torch.multiprocessing as mp
    flash_torch.build()  # once, here, not in two processes at once
    world, deadline = 2, time.time() + 400
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.spawn(_worker, args=(world, _free_port(), RING_CASES, out), nprocs=world,
                       join=False)
        try:
            while not ctx.join(timeout=5):
                if time.time() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    return {_case_id(c): ["the 2-rank spawn passed its 400 s deadline"]
                            for c in RING_CASES}
        except Exception as e:  # a rank raised: spawn ended the others
            return {_case_id(c): [f"a rank failed: {e}"] for c in RING_CASES}
        merged = {}
        for r in range(world):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                for case, lines in json.load(f).items():
                    merged.setdefault(case, []).extend(lines)
        return merged


@pytest.mark.parametrize("case", RING_CASES, ids=_case_id)
def test_ring_on_two_gpus_matches_one_gpu_and_the_float64_reference(case, ring_results):
    bad = ring_results[_case_id(case)]
    assert not bad, "\n".join(bad)
