"""mask-bench.py: chapter 5's masks and score changes against PyTorch's own ways to get them.

    python3 lab/mask-bench.py [--seq 32768] [--window 4096] [--heads 16] [--dim 128] [--csv F]

Issue 45's floors name two baselines for a sliding window (causal, window_size = (W, 0), Mistral's):
FlexAttention with the same mask (torch.nn.attention.flex_attention, compiled, its block mask
skipping the invisible tiles as ours does) and SDPA with a boolean mask (which computes every
pair). Each row: forward, and forward + backward, of
  ours window      flash_torch.flash_attention(q, k, v, causal=True, window_size=(W, 0))
  ours causal      the same without the window (the dense causal figure the floor compares with)
  flex window      flex_attention with the sliding-window block mask
  sdpa bool mask   F.scaled_dot_product_attention with the (N, N) boolean mask (skipped where
                   the mask would not fit in a quarter of the GPU's memory)
and, at N = 4096 (batch 4), softcap 30 and ALiBi as score changes: ours, and FlexAttention's
score_mod. TFLOP/s count the visible (query, key) pairs (4 d a pair forward, 2.5 times that
backward, FlashAttention-2's count). fp16, batch 1 at --seq. Times: the median of 5 runs of 5
calls between CUDA events, after warm-up. A baseline that cannot run here (no FlexAttention
before torch 2.5, no compiler) is printed as skipped, with why.
"""
import argparse
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pytorch"))

try:
    import flash_torch
except ImportError as e:
    if not str(e).startswith("flash_torch: "):
        raise
    sys.exit(str(e))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def timed(fn, warmup=2, iters=5, rounds=5):
    """ms a call of fn(): iters calls between two CUDA events, the median of `rounds` runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / iters)
    return statistics.median(times)


def visible_pairs(n, window):
    """(query, key) pairs a head sees, causal, with a window of `window` keys back (None: none)."""
    if window is None:
        return n * (n + 1) / 2
    w = min(window, n - 1)
    return (w + 1) * n - w * (w + 1) / 2


def flex():
    """(flex_attention compiled, create_block_mask), or (None, why)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        return None, f"no FlexAttention in torch {torch.__version__} ({e})"
    try:
        return (torch.compile(flex_attention), create_block_mask), None
    except Exception as e:  # noqa: BLE001: any compiler failure is a skip, said
        return None, f"torch.compile failed: {e}"


def measure(label, attention, q, k, v, do, pairs, d, rows):
    """One row: attention() forward, then forward + backward (do), TFLOP/s on `pairs`."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    try:
        fwd = timed(lambda: attention(*[t.detach() for t in leaves]))
        both = timed(lambda: torch.autograd.grad(attention(*leaves), leaves, do))
    except Exception as e:  # noqa: BLE001: a baseline that fails here is a skip, said
        print(f"{label:28s} skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        return
    flops = 4 * d * pairs
    rows.append((label, fwd, both, flops / fwd / 1e9, 3.5 * flops / both / 1e9))
    print(f"{label:28s} fwd {fwd:8.3f} ms {flops / fwd / 1e9:7.1f} TFLOP/s   fwd+bwd {both:8.3f} "
          f"ms {3.5 * flops / both / 1e9:7.1f} TFLOP/s", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--csv", default=None)
    a = p.parse_args()
    torch.manual_seed(0)
    dev, dt, H, d, N, W = "cuda", torch.float16, a.heads, a.dim, a.seq, a.window
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    compiled, why = flex()

    def inputs(b, n):
        return [torch.randn(b, H, n, d, device=dev, dtype=dt) for _ in range(4)]

    # The sliding window at --seq.
    q, k, v, do = inputs(1, N)
    win = visible_pairs(N, W) * H
    measure(f"ours window {W}", lambda q, k, v: flash_torch.flash_attention(
        q, k, v, causal=True, window_size=(W, 0)), q, k, v, do, win, d, rows)
    measure("ours causal", lambda q, k, v: flash_torch.flash_attention(q, k, v, causal=True),
            q, k, v, do, visible_pairs(N, None) * H, d, rows)
    if compiled:
        flex_attention, create_block_mask = compiled

        def sliding(b, h, qi, kj):
            return (kj <= qi) & (qi - kj <= W)
        block_mask = create_block_mask(sliding, None, None, N, N, device=dev)
        measure(f"flex window {W}", lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask),
                q, k, v, do, win, d, rows)
    else:
        print(f"{'flex window':28s} skipped: {why}")
    free = torch.cuda.mem_get_info()[0]
    if N * N <= free // 4:
        i = torch.arange(N, device=dev)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] <= W)
        measure(f"sdpa bool mask {W}", lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask), q, k, v, do, win, d, rows)
        del mask
    else:
        print(f"{'sdpa bool mask':28s} skipped: an ({N}, {N}) mask is past a quarter of memory")
    del q, k, v, do

    # Softcap and ALiBi as score changes, N = 4096, batch 4, causal.
    n = 4096
    q, k, v, do = inputs(4, n)
    pairs = 4 * visible_pairs(n, None) * H
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)], device=dev)
    measure("ours plain 4096", lambda q, k, v: flash_torch.flash_attention(q, k, v, causal=True),
            q, k, v, do, pairs, d, rows)
    measure("ours softcap 30", lambda q, k, v: flash_torch.flash_attention(
        q, k, v, causal=True, softcap=30.0), q, k, v, do, pairs, d, rows)
    measure("ours alibi", lambda q, k, v: flash_torch.flash_attention(
        q, k, v, causal=True, alibi_slopes=slopes), q, k, v, do, pairs, d, rows)
    if compiled:
        flex_attention, create_block_mask = compiled
        causal_mask = create_block_mask(lambda b, h, qi, kj: kj <= qi, None, None, n, n,
                                        device=dev)
        scale = 1 / math.sqrt(d)

        def softcap(s, b, h, qi, kj):  # s is scaled already
            return 30.0 * torch.tanh(s / 30.0)

        def alibi(s, b, h, qi, kj):
            return s - slopes[h] * (qi - kj).abs()
        measure("flex softcap 30", lambda q, k, v: flex_attention(
            q, k, v, score_mod=softcap, block_mask=causal_mask, scale=scale), q, k, v, do, pairs,
            d, rows)
        measure("flex alibi", lambda q, k, v: flex_attention(
            q, k, v, score_mod=alibi, block_mask=causal_mask, scale=scale), q, k, v, do, pairs, d,
            rows)
    if a.csv:
        with open(a.csv, "w") as f:
            f.write("case,ms_fwd,ms_fwd_bwd,tflops_fwd,tflops_fwd_bwd\n")
            for r in rows:
                f.write(f"{r[0]},{r[1]:.3f},{r[2]:.3f},{r[3]:.1f},{r[4]:.1f}\n")


if __name__ == "__main__":
    main()
