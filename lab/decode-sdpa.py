#!/usr/bin/env python3
"""Issue 30's comparison for chapter 4's decode: PyTorch SDPA at the decode benchmark's shapes.

fp16, d = 128, 32 query heads over 8 K/V heads (enable_gqa=True), q_len = 1, batch 1, 8, 32,
kv_len 4k, 8k, 32k, 128k. Each SDPA backend that runs (flash, efficient, cudnn, math): the median
time of CUDA events around each call after warm-up, L2 flushed before every call (as
flash_decode_bench does), and K and V's bytes over it (GB/s). Prints one line a shape and backend,
then the best backend a shape. Needs torch >= 2.5 (enable_gqa).
    python3 lab/decode-sdpa.py [--flush write|read] [--csv FILE]
"""
import argparse
import sys

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # torch < 2.3
    sys.exit("decode-sdpa.py: needs torch >= 2.5 (torch.nn.attention, enable_gqa)")

BACKENDS = [("flash", "FLASH_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"),
            ("cudnn", "CUDNN_ATTENTION"), ("math", "MATH")]


def median_ms(fn, flush, read_flush=False, warm=3, reps=21):
    for _ in range(warm):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for r in range(reps):
        if read_flush:  # the L2 left clean (flash_decode_bench --flush read)
            flush.sum(dtype=torch.int64)
        else:  # the L2 left full of dirty lines (the default, as flash_decode_bench's)
            flush.fill_(r & 0xFF)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv")
    ap.add_argument("--kv-len", default="4096,8192,32768,131072")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--flush", choices=["write", "read"], default="write",
                    help="flush L2 by writing a buffer (default) or by reading one")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("decode-sdpa.py: no CUDA GPU; nothing to time")
        return 77
    dev = torch.device("cuda")
    heads, kv_heads, d = 32, 8, 128
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"SDPA fp16, d = {d}, {heads} query heads over {kv_heads} K/V heads, q_len = 1, "
          f"enable_gqa=True; L2 flushed by {'reading' if args.flush == 'read' else 'writing'}")
    print(f"{'batch':>6} {'kv_len':>8} {'backend':>10} {'time_us':>10} {'KV_GB/s':>9}")
    rows = []
    for batch in map(int, args.batch.split(",")):
        for kv_len in map(int, args.kv_len.split(",")):
            q = torch.randn(batch, heads, 1, d, device=dev, dtype=torch.float16)
            k = torch.randn(batch, kv_heads, kv_len, d, device=dev, dtype=torch.float16)
            v = torch.randn_like(k)
            kv_bytes = 2 * k.numel() * k.element_size()
            best = None
            for name, attr in BACKENDS:
                backend = getattr(SDPBackend, attr, None)
                if backend is None:
                    continue
                if name == "math" and kv_bytes * 4 > (8 << 30):
                    print(f"{batch:>6} {kv_len:>8} {name:>10} {'skipped (repeats K/V 4x)':>20}")
                    continue
                try:
                    with sdpa_kernel([backend]):
                        fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                        ms = median_ms(fn, flush, args.flush == "read")
                except Exception as e:  # not supported here, or out of memory
                    print(f"{batch:>6} {kv_len:>8} {name:>10} {'does not run':>20} "
                          f"({str(e).splitlines()[0][:60]})")
                    torch.cuda.empty_cache()
                    continue
                gbs = kv_bytes / (ms * 1e-3) / 1e9
                print(f"{batch:>6} {kv_len:>8} {name:>10} {ms * 1e3:>10.1f} {gbs:>9.0f}")
                rows.append((batch, kv_len, name, ms * 1e3, gbs))
                if best is None or ms < best[1]:
                    best = (name, ms)
            if best:
                print(f"{batch:>6} {kv_len:>8} {'best':>10} {best[1] * 1e3:>10.1f} "
                      f"{kv_bytes / (best[1] * 1e-3) / 1e9:>9.0f}  ({best[0]})")
                rows.append((batch, kv_len, "best:" + best[0], best[1] * 1e3,
                             kv_bytes / (best[1] * 1e-3) / 1e9))
            del q, k, v
            torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("device,batch,kv_len,backend,time_us,kv_gbs\n")
            for r in rows:
                f.write(f"{torch.cuda.get_device_name()},{r[0]},{r[1]},{r[2]},{r[3]:.2f},{r[4]:.1f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
