"""options-op-bench.py: softcap, ALiBi and a scale through the PyTorch op, against plain, in turns.

    python3 lab/options-op-bench.py [--rounds 5] [--order plain,softcap,alibi,scale]

lab/mask-bench.py times each case once, one after the other (plain first); lab/power-states.cu
times the C++ calls in pairs, cold and hot. This times the op's calls (the public path a model
takes) in rounds, the cases in turns within a round (the order given, rotated by one each round),
so a case's ratio to plain is read against a plain measured next to it. fp16, batch 4, 16 heads,
N 4096, d 128, causal; the median of 5 runs of 5 calls between CUDA events per case per round.
TFLOP/s count the causal pairs (FlashAttention-2's count, the backward 2.5 times the forward).
Prints each round's f+b TFLOP/s and, last, each case's median ratio to plain (fwd, f+b).
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pytorch"))
import flash_torch  # noqa: E402
import torch  # noqa: E402


def timed(fn, iters=5, runs=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--order", default="plain,softcap,alibi,scale")
    a = p.parse_args()
    torch.manual_seed(0)
    B, H, N, d = 4, 16, 4096, 128
    q, k, v, do = [torch.randn(B, H, N, d, device="cuda", dtype=torch.float16) for _ in range(4)]
    for t in (q, k, v):
        t.requires_grad_(True)
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)], device="cuda")
    kwargs = {"plain": {}, "softcap": {"softcap": 30.0}, "alibi": {"alibi_slopes": slopes},
              "scale": {"softmax_scale": 0.1}}
    flops = 4 * d * B * H * N * (N + 1) / 2  # the forward's, causal
    order = a.order.split(",")
    res = {c: [] for c in order}  # per round: (fwd ms, f+b ms)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for r in range(a.rounds):
        turn = order[r % len(order):] + order[:r % len(order)]
        for c in turn:
            kw = kwargs[c]
            with torch.no_grad():
                fwd = timed(lambda: flash_torch.flash_attention(q, k, v, causal=True, **kw))

            def fb():
                o = flash_torch.flash_attention(q, k, v, causal=True, **kw)
                torch.autograd.grad(o, (q, k, v), do)
            res[c].append((fwd, timed(fb)))
        print(f"round {r}: " + "  ".join(
            f"{c} {3.5 * flops / res[c][-1][1] / 1e9:.1f}" for c in order) + "  TFLOP/s f+b")
    print("case     fwd ms  f+b ms  fwd/plain  f+b/plain (medians over rounds of the ratios)")
    for c in order:
        fr = statistics.median(x[0] / y[0] for x, y in zip(res["plain"], res[c]))
        br = statistics.median(x[1] / y[1] for x, y in zip(res["plain"], res[c]))
        print(f"{c:8s} {statistics.median(x[0] for x in res[c]):6.3f} "
              f"{statistics.median(x[1] for x in res[c]):7.3f}  {fr:9.3f}  {br:9.3f}")


if __name__ == "__main__":
    main()
