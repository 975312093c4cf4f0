#!/usr/bin/env python3
"""lab/ncu-compare.py A.csv B.csv [FLOP]: two kernels' Nsight Compute metrics side by side
(`ncu --import R.ncu-rep --page raw --csv`, one kernel a report), the rows that say where a
kernel's time and energy go: time and cycles, instructions (all, and by pipe), each pipe's use,
shared memory's wavefronts, registers, spills, DRAM and L2 bytes. With FLOP (the kernel's), the
instructions are also given per 1,000 FLOP. lab/gpu-ncu-vs-cudnn.sh runs it."""
import csv
import re
import sys

KEEP = re.compile(r"^(gpu__time_duration\.sum|sm__cycles_(elapsed|active)\.(avg|sum)$|smsp__inst_executed\.sum$|"
                  r"smsp__inst_executed_pipe_\w+\.sum$|"
                  r"sm__inst_executed_pipe_\w+\.sum$|sm__pipe_\w+_cycles_active\.avg\.pct_of_peak"
                  r"_sustained_active$|sm__inst_executed_pipe_\w+\.avg\.pct_of_peak_sustained_active$|"
                  r"l1tex__data_pipe_lsu_wavefronts_mem_shared\w*\.sum$|"
                  r"smsp__sass_inst_executed_op_(shared|global|local)_(ld|st)\.sum$|"
                  r"launch__registers_per_thread$|launch__grid_size$|launch__block_size$|"
                  r"dram__bytes_(read|write)\.sum$|lts__t_bytes\.sum$|"
                  r"sm__warps_active\.avg\.pct_of_peak_sustained_active$|"
                  r"smsp__average_warps_issue_stalled_\w+_per_issue_active\.ratio$)")


SCALE = {"byte": ("MB", 1e-6), "Kbyte": ("MB", 1e-3), "Mbyte": ("MB", 1), "Gbyte": ("MB", 1e3),
         "Tbyte": ("MB", 1e6), "ns": ("us", 1e-3), "us": ("us", 1), "usecond": ("us", 1),
         "ms": ("us", 1e3), "msecond": ("us", 1e3), "s": ("us", 1e6)}


def read(path):
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    names, units, vals = rows[head], rows[head + 1], rows[head + 2]
    out = {}
    for n, u, v in zip(names, units, vals):
        if KEEP.match(n):
            try:
                x = float(v.replace(",", ""))
            except ValueError:
                continue
            unit, k = SCALE.get(u, (u, 1))  # one unit a quantity, whatever ncu chose
            out[n] = (x * k, unit)
    out["name"] = (vals[names.index("Kernel Name")][:60], "")
    return out


a, b = read(sys.argv[1]), read(sys.argv[2])
flop = float(sys.argv[3]) if len(sys.argv) > 3 else 0
print(f"{'':62s} {'A':>14s} {'B':>14s}  A / B")
print(f"{'kernel':62s} {a['name'][0]} | {b['name'][0]}")
for n in sorted(set(a) & set(b) - {"name"}):
    x, y = a[n][0], b[n][0]
    if x == 0 and y == 0:
        continue
    r = f"{x / y:6.3f}" if y else "     -"
    print(f"{n + ' (' + a[n][1] + ')':62s} {x:14.4g} {y:14.4g} {r}")
    if flop and n.startswith("smsp__inst_executed") and n.endswith(".sum"):
        print(f"{'  per 1000 FLOP':62s} {x / flop * 1e3:14.4g} {y / flop * 1e3:14.4g}")
