#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention backends on the FlashAttention-2 protocol shapes, fp16
(or bf16): the yardstick NOTES.md chapter 2 compares the fp16 and bf16 kernels against.

Run on a GPU machine with PyTorch:
    python3 lab/sdpa-reference.py [--csv FILE] [--seqs 1024,2048] [--dims 64,128,256] [--backward]
        [--backends flash,cudnn] [--dtype fp16|bf16]
Counts FLOPs as flash_bench does: forward 4 * batch * heads * (visible query-key pairs) *
head_dim; backward 2.5 times that. Times: median of 10 timed calls after 3 warm-up calls, CUDA
events. With --backward, the row's pass is the backward alone: torch.autograd.grad of the output
given a random dO (the forward is run once, outside the timed region, and its graph kept).
"""
import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("mem_efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)]


def time_ms(fn, warmup=3, runs=10):
    for _ in range(warmup):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(runs):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="")
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--backward", action="store_true", help="time the backward, not the forward")
    ap.add_argument("--backends", default=",".join(name for name, _ in BACKENDS))
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = ["backend,dtype,pass,dim,heads,batch,seq,causal,ms,tflops"]
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    which = "backward" if args.backward else "forward"
    print(f"{'backend':>14} {'d':>4} {'H':>3} {'B':>3} {'N':>6} {'causal':>6} {'ms':>9} {'TFLOP/s':>8}")
    for dim in map(int, args.dims.split(",")):
        heads = 2048 // dim
        for causal in (False, True):
            for seq in map(int, args.seqs.split(",")):
                batch = 16384 // seq
                gen = torch.Generator(device="cuda").manual_seed(seq)
                q, k, v, do = (torch.randn(batch, heads, seq, dim, device="cuda",
                                           dtype=dtype, generator=gen,
                                           requires_grad=args.backward) for _ in range(4))
                pairs = seq * (seq + 1) / 2 if causal else seq * seq
                flops = 4 * batch * heads * pairs * dim * (2.5 if args.backward else 1)
                for name, backend in BACKENDS:
                    if name not in args.backends.split(","):
                        continue
                    if name == "math" and seq > 8192:
                        continue  # (B, H, N, N) scores: tens of GiB, and slow
                    try:
                        with sdpa_kernel(backend):
                            if args.backward:
                                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                                ms = time_ms(lambda: torch.autograd.grad(
                                    out, (q, k, v), do, retain_graph=True))
                                del out
                            else:
                                ms = time_ms(lambda: F.scaled_dot_product_attention(
                                    q, k, v, is_causal=causal))
                    except RuntimeError as e:  # a backend that refuses the shape or is absent
                        print(f"{name:>14} {dim:4d} {heads:3d} {batch:3d} {seq:6d} {int(causal):6d}"
                              f"  not run: {str(e).splitlines()[0][:60]}")
                        continue
                    tflops = flops / (ms * 1e-3) / 1e12
                    print(f"{name:>14} {dim:4d} {heads:3d} {batch:3d} {seq:6d} {int(causal):6d} "
                          f"{ms:9.3f} {tflops:8.1f}", flush=True)
                    rows.append(f"{name},{args.dtype},{which},{dim},{heads},{batch},{seq},{int(causal)},{ms:.4f},"
                                f"{tflops:.2f}")
                del q, k, v, do
                torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("\n".join(rows) + "\n")
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
