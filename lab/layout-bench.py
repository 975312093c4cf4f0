"""layout-bench.py: chapter 5's strides at the real-text client's shape, forward + backward.

    python3 lab/layout-bench.py [--batch 16] [--heads 6] [--seq 1024] [--dim 64] [--dtype bf16]
                                [--iters 20] [--csv F]

A model's fused projection qkv (B, N, 3 H d), viewed (B, N, 3, H, d) and permuted to q, k, v
(B, H, N, d) views, causal (issue 45's floor: the op with no copy kernels, at most SDPA's flash
backend's time, aiming for cuDNN's). Each row: the time of o = attention(q, k, v) plus
torch.autograd.grad(o, (q, k, v), do), do a (B, N, H, d) tensor seen transposed (as a model's
output projection hands it back), so the time is the attention's alone, not the stack that
gathers dq, dk, dv into the projection's gradient:
  ours views        flash_torch.flash_attention on the views (chapter 5's strides: read in place)
  ours contiguous   the same on contiguous copies made beforehand (the kernels' own time)
  sdpa flash        F.scaled_dot_product_attention on the views, flash backend
  sdpa cudnn        the same, cuDNN backend
Times: a call's share of --iters calls back to back between two CUDA events (as a training loop
runs them: the host queues a call while the GPU runs the last), the median of 5 such runs, after
warm-up; beside it the sum of the call's kernels' own times. The kernels each row launches are
listed with their times (torch.profiler), and the ones that copy or convert tensors (names with
"copy", "elementwise", "transpose", "contiguous") are named: the floor wants none in the first
row.
"""
import argparse
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
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

COPYING = ("copy", "elementwise", "transpose", "contiguous")


def timed(fn, warmup, iters, rounds=5):
    """ms a call of fn(), as a training loop sees it: iters calls back to back between two CUDA
    events (the host queues the next call while the GPU runs this one), the median of `rounds`
    such runs, after warmup calls."""
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


def kernels(fn):
    """(name, microseconds) of each CUDA kernel one fn() launches, in launch order."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name, e.device_time) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
            and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", default="bf16", choices=["fp16", "bf16"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--csv")
    a = ap.parse_args()
    dtype = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    b, h, n, d = a.batch, a.heads, a.seq, a.dim
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(b, n, 3 * h * d, device="cuda", generator=g).to(dtype)
    # The views, each its own leaf (detach keeps the strides): the gradients stop at them.
    q, k, v = (t.detach().requires_grad_() for t in
               qkv.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0))
    qc, kc, vc = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    do = torch.randn(b, n, h, d, device="cuda", generator=g).to(dtype).transpose(1, 2)

    def ours(x, y, z):
        return lambda: torch.autograd.grad(flash_torch.flash_attention(x, y, z, causal=True),
                                           (x, y, z), do)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return torch.autograd.grad(o, (q, k, v), do)
        return run

    rows = [("ours views", ours(q, k, v)), ("ours contiguous", ours(qc, kc, vc)),
            ("sdpa flash", sdpa(SDPBackend.FLASH_ATTENTION)),
            ("sdpa cudnn", sdpa(SDPBackend.CUDNN_ATTENTION))]
    flops = 3.5 * 2 * b * h * n * n * d  # causal: half of 4 N^2 d, forward + 2.5x backward
    dev = torch.cuda.get_device_name()
    print(f"# {dev}, torch {torch.__version__}; B={b} H={h} N={n} d={d} {a.dtype} causal, "
          f"fused-QKV views")
    out = ["device,call,us_fwd_bwd,us_in_kernels,tflops,kernels,copying_kernels"]
    for name, fn in rows:
        try:
            ms = timed(fn, 10, a.iters)
            names = kernels(fn)
        except RuntimeError as e:  # a backend this torch or GPU lacks
            print(f"{name:18s} failed: {str(e).splitlines()[0]}")
            continue
        copying = [x for x, _ in names if any(c in x.lower() for c in COPYING)]
        gpu_us = sum(us for _, us in names)
        print(f"{name:18s} {1000 * ms:8.1f} us a call ({gpu_us:6.1f} us in kernels)  "
              f"{flops / ms / 1e9:6.1f} TFLOP/s  {len(names)} kernels, copying: {len(copying)}"
              + (f" ({'; '.join(sorted(set(x[:60] for x in copying)))})" if copying else ""))
        for x, us in names:  # each kernel's own time, profiled
            print(f"    {us:8.1f} us  {x[:90]}")
        out.append(f"{dev},{name},{1000 * ms:.1f},{gpu_us:.1f},{flops / ms / 1e9:.1f},"
                   f"{len(names)},{len(copying)}")
    if a.csv:
        with open(a.csv, "w") as f:
            f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
