"""cp-bench.py: context parallelism on 2 GPUs, forward + backward, causal, d = 128.

    torchrun --nproc-per-node 2 lab/cp-bench.py [--seqs 65536 131072] [--dtypes fp16 bf16]
                                                 [--heads 16] [--iters 5] [--csv F]

For each dtype and total sequence length N (batch 1, --heads heads of 128):
  one GPU  ours (flash_torch.flash_attention) on the whole sequence, on each GPU at once (each
           its own copy; rank 0's median reported);
  ring     ring_attention over the 2 ranks, each holding N / 2 positions (the zigzag), and the
           time its stream stood waiting on the ring's receives (record_waits: CUDA events
           around each wait; the gap is time the GPU had nothing else to do);
  torch CP torch.distributed.tensor.experimental.context_parallel over
           F.scaled_dot_product_attention with the flash backend, and with cuDNN beside it (each
           in try/except: a failure prints its one-line reason instead of a time).
Times: medians of CUDA-event timings after warm-up, each iteration started after a barrier; a
2-GPU time is the larger of the two ranks' medians. TFLOP/s counts the causal work once (a
forward 2 N^2 d H, the backward 2.5 times that: 7 N^2 d H in all), so the ring's figure is the
two GPUs' together. The ratio one GPU / ring is the throughput gain (the issue's floor: 1.7x).
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
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ring_attention as ra  # noqa: E402


def timed(fn, warmup, iters, waits=None):
    """Median ms of fn() (CUDA events), after warm-up; with waits (a list) also appends the
    median ms the ring's stream waited on its receives."""
    for _ in range(warmup):
        fn()
    times, waited = [], []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with ra.record_waits() as w:
            start.record()
            fn()
            stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
        waited.append(w.ms())
    if waits is not None:
        waits.append(statistics.median(waited))
    return statistics.median(times)


def slowest(ms):
    """The larger of the ranks' values."""
    t = torch.tensor([ms], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def fwd_bwd(attend, q, k, v, do):
    def run():
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
        attend(q_, k_, v_).backward(do)
    return run


def torch_cp(mesh, backend, q, k, v, do, warmup, iters):
    """(ms, None) of SDPA under context_parallel with `backend`, or (None, the reason)."""
    try:
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel
        chosen = getattr(SDPBackend, backend)
        bufs = [t.clone() for t in (q, k, v, do)]          # sharded in place by context_parallel
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2],
                              no_restore_buffers=set(bufs)):
            ql, kl, vl, dol = bufs

            def attend(a, b, c):
                with sdpa_kernel(chosen):
                    return F.scaled_dot_product_attention(a, b, c, is_causal=True)
            ms = timed(fwd_bwd(attend, ql, kl, vl, dol), warmup, iters)
        return slowest(ms), None
    except Exception as e:  # noqa: BLE001 (reported, not hidden)
        line = str(e).strip().splitlines()
        return None, f"{type(e).__name__}: {line[0][:160] if line else ''}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--csv", default="")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        sys.exit("cp-bench: run it with torchrun --nproc-per-node 2 lab/cp-bench.py")
    why = flash_torch.missing(need_gpu=True)
    if why:
        sys.exit(why)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if rank == 0:
        flash_torch.build()
    dist.init_process_group("nccl")
    dist.barrier()
    flash_torch.build()
    mesh = None
    try:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda", (world,))
    except Exception as e:  # noqa: BLE001
        if rank == 0:
            print(f"torch CP: no device mesh ({type(e).__name__}: {e})")
    rows, notes = [], []
    for name in args.dtypes:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[name]
        for n in args.seqs:
            g = torch.Generator(device="cuda").manual_seed(n)
            q, k, v, do = (torch.randn(1, args.heads, n, args.d, device="cuda", generator=g)
                           .to(dtype) for _ in range(4))
            flops = 7 * n * n * args.d * args.heads
            one = slowest(timed(fwd_bwd(lambda a, b, c: flash_torch.flash_attention(
                a, b, c, causal=True), q, k, v, do), args.warmup, args.iters))
            mine = [ra.shard(t, rank, world) for t in (q, k, v, do)]
            waits = []
            ring = timed(fwd_bwd(lambda a, b, c: ra.ring_attention(a, b, c, causal=True,
                                                                   seq_len=n), *mine),
                         args.warmup, args.iters, waits)
            ring, wait = slowest(ring), slowest(waits[0])
            del mine
            cp = {}
            for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
                if mesh is None:
                    cp[backend] = (None, "no device mesh")
                    continue
                cp[backend] = torch_cp(mesh, backend, q, k, v, do, args.warmup, args.iters)
                if cp[backend][1] and rank == 0:
                    notes.append(f"torch CP {backend} {name} N={n}: {cp[backend][1]}")
            rows.append((name, n, one, ring, wait, cp["FLASH_ATTENTION"][0],
                         cp["CUDNN_ATTENTION"][0], flops))
            del q, k, v, do
            torch.cuda.empty_cache()
    if rank == 0:
        dev = torch.cuda.get_device_name()
        print(f"cp-bench: {dev} x {world}, torch {torch.__version__}, batch 1, {args.heads} "
              f"heads, d {args.d}, causal, forward + backward, median of {args.iters} after "
              f"{args.warmup} warm-up")
        head = (f"{'dtype':5} {'N':>7} {'1 GPU ms':>9} {'TFLOP/s':>7} {'ring ms':>8} "
                f"{'TFLOP/s':>7} {'1GPU/ring':>9} {'wait ms':>8} {'CP flash':>9} "
                f"{'ring÷':>6} {'CP cuDNN':>9} {'ring÷':>6}")
        print(head)
        csv = ["device,dtype,seq,one_gpu_ms,ring_ms,speedup,ring_wait_ms,torch_cp_flash_ms,"
               "torch_cp_cudnn_ms"]
        for name, n, one, ring, wait, cpf, cpc, flops in rows:
            def ms(x):
                return f"{x:9.1f}" if x is not None else f"{'-':>9}"

            def ratio(x):
                return f"{x / ring:6.2f}" if x is not None else f"{'-':>6}"
            print(f"{name:5} {n:7d} {one:9.1f} {flops / one / 1e9:7.0f} {ring:8.1f} "
                  f"{flops / ring / 1e9:7.0f} {one / ring:8.2f}x {wait:8.2f} {ms(cpf)} "
                  f"{ratio(cpf)} {ms(cpc)} {ratio(cpc)}")
            csv.append(f"{dev},{name},{n},{one:.3f},{ring:.3f},{one / ring:.3f},{wait:.3f},"
                       f"{'' if cpf is None else f'{cpf:.3f}'},"
                       f"{'' if cpc is None else f'{cpc:.3f}'}")
        print("1GPU/ring: throughput gain on the same total sequence (floor 1.7x); wait: the ring's"
              " stream waiting on receives, forward + backward; ring÷: torch CP's time / the "
              "ring's (> 1: the ring is faster)")
        for line in notes:
            print(line)
        if args.csv:
            with open(args.csv, "w") as f:
                f.write("\n".join(csv) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
