#!/usr/bin/env python3
"""SDPA's cuDNN (or flash) backend, forward and backward, fp16, in the two power states and on the
shapes of lab/power-states.cu, with its protocol and its output lines (lab/chapter3.md, "Against
cuDNN in like power states"). Run on a GPU machine with PyTorch:
    python3 lab/power-states.py [cudnn|flash] [fwd [D]]  (fwd: the forward alone; D: one head dim)
The backward is torch.autograd.grad of one forward's output given a random dO (graph kept), as in
lab/sdpa-reference.py; FLOPs as flash_bench counts them (backward 2.5 times the forward's)."""
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def time10(call):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms, t0 = [], time.time()
    for _ in range(10):
        a.record()
        call()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms), t0, time.time()


def both_states(tag, pass_, d, n, c, flop, call):
    time.sleep(1.0)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    cold = time10(call)
    h0 = time.time()
    while time.time() - h0 < 0.4:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    hot = time10(call)
    print(f"{tag} {pass_} d {d} N {n} causal {c} "
          f"cold {cold[0]:.4f} {flop / cold[0] * 1e-9:.1f} {cold[1]:.3f} {cold[2]:.3f} "
          f"hot {hot[0]:.4f} {flop / hot[0] * 1e-9:.1f} {hot[1]:.3f} {hot[2]:.3f}", flush=True)


def main():
    tag = sys.argv[1] if len(sys.argv) > 1 else "cudnn"
    fwd_only = len(sys.argv) > 2 and sys.argv[2] == "fwd"
    dims = (int(sys.argv[3]),) if len(sys.argv) > 3 else (64, 128, 256)
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[tag]
    with sdpa_kernel([backend]):
        for d in dims:
            for n in (4096, 16384):
                for c in (0, 1):
                    batch, heads = 16384 // n, 2048 // d
                    q, k, v = (torch.empty(batch, heads, n, d, device="cuda",
                                           dtype=torch.float16).uniform_(-1, 1).requires_grad_()
                               for _ in range(3))
                    pairs = n * (n + 1) / 2 if c else n * n
                    flop = 4.0 * batch * heads * pairs * d
                    with torch.no_grad():
                        both_states(tag, "fwd", d, n, c, flop,
                                    lambda: F.scaled_dot_product_attention(q, k, v,
                                                                           is_causal=bool(c)))
                    if fwd_only:
                        continue
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=bool(c))
                    do = torch.empty_like(out).uniform_(-1, 1)
                    both_states(tag, "bwd", d, n, c, 2.5 * flop,
                                lambda: torch.autograd.grad(out, (q, k, v), do,
                                                            retain_graph=True))
                    del out, do


if __name__ == "__main__":
    main()
