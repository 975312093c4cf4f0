"""example_ring.py: example_train.py's small causal transformer trained with its sequence split
across GPUs, attention by ring_attention (context parallelism over NCCL), beside the same model
on one GPU.

    torchrun --nproc-per-node 2 pytorch/example_ring.py [--steps 100] [--seq 512] [--dtype bf16]

Each rank holds its shard of every sequence (ring_attention.shard's zigzag: the tokens, their
positions and their labels alike); everything but attention is per position, so only attention
talks across ranks. The loss is the sum over the rank's positions divided by the whole count, so
the ranks' losses and gradients add up to the one-GPU ones: the gradients are all-reduced (the
weights are replicated, as in data parallelism) before each AdamW step. seq 512 gives the model
511 positions (the last token is only a label): not a multiple of 2 x 2 chunks, on purpose.

Then rank 0 trains the same model from the same seed on the whole sequence with flash_attention
and with SDPA's flash backend. Those two one-GPU curves differ by rounding alone; the ring is one
more rounding of the same arithmetic (fp32 merges through L), so its largest gap from the
one-GPU curve (ours) should be of that size: the run prints both gaps and PASS when the ring's is
at most twice the one-GPU pair's, FAIL otherwise (exit status 1).
"""
import argparse
import os
import sys

try:
    import flash_torch  # first: it names in one line what is missing (torch, its version, CUDA)
except ImportError as e:
    if not str(e).startswith("flash_torch: "):
        raise
    sys.exit(str(e))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from example_train import PERIOD, VOCAB, Model, batch, ours, sdpa  # noqa: E402
from ring_attention import ring_attention, shard_positions  # noqa: E402


class RingModel(Model):
    """example_train's Model on this rank's positions: the positional embedding is read at their
    global indices (the same parameters, created in the same order: the same seed, the same
    weights)."""

    def forward(self, tokens, positions):                   # tokens: (B, n_local)
        x = self.embed(tokens) + self.pos[positions]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def ring_attend(q, k, v):
    return ring_attention(q, k, v, causal=True)


def train_ring(args, dtype, rank, world):
    torch.manual_seed(0)
    n = args.seq - 1                                        # the model's positions
    model = RingModel(ring_attend, args.seq).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    gen = torch.Generator(device="cuda").manual_seed(1)    # every rank draws the whole batch
    positions = torch.tensor(shard_positions(n, world, rank), device="cuda")
    counted = positions >= PERIOD - 1                       # position p predicts token p + 1
    total = args.batch * (n - (PERIOD - 1))
    losses = []
    for _ in range(args.steps):
        tokens = batch(gen, args.batch, args.seq)
        inp, tgt = tokens[:, :-1][:, positions], tokens[:, 1:][:, positions]
        with torch.autocast("cuda", dtype=dtype):
            logits = model(inp, positions)
        loss = F.cross_entropy(logits[:, counted].float().reshape(-1, VOCAB),
                               tgt[:, counted].reshape(-1), reduction="sum") / total
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():                        # the ranks' shares add up
            dist.all_reduce(p.grad)
        opt.step()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        losses.append(whole.item())
    return losses


def train_one(attend, args, dtype):
    """example_train.train's loop without its timing: the whole sequence on this GPU."""
    torch.manual_seed(0)
    model = Model(attend, args.seq).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(args.steps):
        tokens = batch(gen, args.batch, args.seq)
        with torch.autocast("cuda", dtype=dtype):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits[:, PERIOD - 1:].float().reshape(-1, VOCAB),
                               tokens[:, PERIOD:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = ap.parse_args()
    if "RANK" not in os.environ:
        sys.exit("example_ring: run it with torchrun --nproc-per-node 2 pytorch/example_ring.py")
    why = flash_torch.missing(need_gpu=True)
    if why:
        sys.exit(why)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if rank == 0:
        flash_torch.build()                                 # one rank compiles, the others load
    dist.init_process_group("nccl")
    dist.barrier()
    flash_torch.build()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    ring = train_ring(args, dtype, rank, world)
    if rank == 0:
        print(f"device: {torch.cuda.get_device_name()} x {world}, torch {torch.__version__}; "
              f"seq {args.seq} ({args.seq - 1} positions, split in {2 * world} chunks), batch "
              f"{args.batch}, {args.dtype}, {args.steps} steps")
        one = train_one(ours, args, dtype)
        ref = train_one(sdpa, args, dtype)
        print(f"{'step':>5} {'ring, ' + str(world) + ' GPUs':>14} {'one GPU (ours)':>15} "
              f"{'gap':>9} {'one GPU (SDPA)':>15}")
        for s in list(range(0, args.steps, 10)) + [args.steps - 1]:
            print(f"{s:5d} {ring[s]:14.4f} {one[s]:15.4f} {ring[s] - one[s]:+9.4f} {ref[s]:15.4f}")
        gap = max(abs(x - y) for x, y in zip(ring, one))
        yardstick = max(abs(x - y) for x, y in zip(ref, one))
        ok = gap <= 2 * yardstick
        print(f"largest gap: ring vs one GPU {gap:.4f}; one GPU, SDPA flash vs ours {yardstick:.4f}"
              f" -> {'PASS' if ok else 'FAIL'} (the ring's gap at most twice the one-GPU pair's)")
    else:
        ok = True
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
