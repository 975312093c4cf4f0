"""example_train.py: a small causal transformer trained twice from the same seed, once with
PyTorch's scaled_dot_product_attention (its FlashAttention-2 backend) and once with this
project's flash_attention (flash_torch.py), to show the kernels doing their job in a model.

    python3 example_train.py [--steps 300] [--seq 512] [--dtype bf16] [--csv F] [--plot F.png]

The task is synthetic and needs attention: each sequence is 8 random tokens repeated to fill it
(a lookup 8 positions back), and the loss is counted where the answer is in context (the second
copy onward). 4 layers, width 256, 4 heads of 64, pre-norm, causal, AdamW, mixed precision (the
weights fp32, the matmuls and attention in --dtype). Prints both loss curves side by side, the
largest gap between them, and the median step time of each (CUDA events, after 20 warm-up steps).
"""
import argparse
import math
import statistics
import sys

try:
    import flash_torch  # first: it names in one line what is missing (torch, its version, CUDA)
except ImportError as e:
    if not str(e).startswith("flash_torch: "):
        raise
    sys.exit(str(e))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from flash_torch import flash_attention  # noqa: E402

VOCAB, WIDTH, HEADS, LAYERS, PERIOD = 64, 256, 4, 4, 8


class Block(nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.attend = attend
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):                                   # x: (B, N, WIDTH)
        B, N, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(WIDTH, dim=-1)
        q, k, v = (t.view(B, N, HEADS, WIDTH // HEADS).transpose(1, 2) for t in (q, k, v))
        y = self.attend(q, k, v)                            # (B, HEADS, N, 64)
        x = x + self.proj(y.transpose(1, 2).reshape(B, N, WIDTH))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, attend, seq):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(seq, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block(attend) for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):                              # tokens: (B, N)
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))                      # (B, N, VOCAB)


def sdpa(q, k, v):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def ours(q, k, v):
    return flash_attention(q, k, v, causal=True)  # q_len == kv_len: the same mask as is_causal


def batch(gen, size, seq):
    pattern = torch.randint(0, VOCAB, (size, PERIOD), generator=gen, device="cuda")
    return pattern.repeat(1, math.ceil(seq / PERIOD))[:, :seq]


def train(attend, args, dtype):
    torch.manual_seed(0)                                    # the same weights for both runs
    model = Model(attend, args.seq).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    gen = torch.Generator(device="cuda").manual_seed(1)    # the same data for both runs
    losses, times = [], []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for step in range(args.steps):
        tokens = batch(gen, args.batch, args.seq)
        start.record()
        with torch.autocast("cuda", dtype=dtype):
            logits = model(tokens[:, :-1])
        # Positions from the second period on can be predicted; the first PERIOD cannot.
        loss = F.cross_entropy(logits[:, PERIOD - 1:].float().reshape(-1, VOCAB),
                               tokens[:, PERIOD:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        stop.record()
        stop.synchronize()
        losses.append(loss.item())
        if step >= 20:
            times.append(start.elapsed_time(stop))
    return losses, statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--csv", default="")
    ap.add_argument("--plot", default="")
    args = ap.parse_args()
    why = flash_torch.missing(need_gpu=True)
    if why:
        sys.exit(why)
    flash_torch.build()  # before the runs: compiling (the first time) is no part of either
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; {LAYERS} layers, "
          f"width {WIDTH}, {HEADS} heads of {WIDTH // HEADS}, causal, seq {args.seq}, batch "
          f"{args.batch}, {args.dtype}, {args.steps} steps")
    a, t_a = train(sdpa, args, dtype)
    b, t_b = train(ours, args, dtype)
    print(f"{'step':>5} {'loss (SDPA flash)':>18} {'loss (ours)':>12} {'gap':>9}")
    for s in list(range(0, args.steps, 25)) + [args.steps - 1]:
        print(f"{s:5d} {a[s]:18.4f} {b[s]:12.4f} {b[s] - a[s]:+9.4f}")
    gap = max(abs(x - y) for x, y in zip(a, b))
    print(f"largest gap between the curves: {gap:.4f} (final losses {a[-1]:.4f} and {b[-1]:.4f})")
    print(f"median step time: SDPA flash {t_a:.2f} ms, ours {t_b:.2f} ms (forward, backward and "
          f"optimizer step of the whole model)")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("step,loss_sdpa_flash,loss_ours\n")
            f.writelines(f"{s},{x:.6f},{y:.6f}\n" for s, (x, y) in enumerate(zip(a, b)))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        plt.figure(figsize=(7, 4))
        plt.plot(a, label=f"SDPA flash backend ({t_a:.1f} ms/step)")
        plt.plot(b, "--", label=f"flash_attention, ours ({t_b:.1f} ms/step)")
        plt.yscale("log")
        plt.xlabel("step")
        plt.ylabel("training loss")
        plt.title(f"{LAYERS}-layer causal transformer, seq {args.seq}, {args.dtype}, same seed")
        plt.legend()
        plt.tight_layout()
        plt.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
