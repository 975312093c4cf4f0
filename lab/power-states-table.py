#!/usr/bin/env python3
"""lab/power-states-table.py SMI.csv FILE...: joins lab/power-states.cu's and lab/power-states.py's
lines (tags WHO + round, e.g. ours1, cudnn1) with nvidia-smi's samples (timestamp, clocks.sm,
power.draw; -lms 20) taken beside them: each set of 10 calls gets the mean SM clock over its
window. Prints, per pass and shape, each round's TFLOP/s and clock, cold and hot, and the ratio
ours / cuDNN of the same round and state."""
import collections
import datetime
import re
import sys

smi = []
for line in open(sys.argv[1]):
    p = [x.strip() for x in line.split(",")]
    try:
        t = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        smi.append((t, float(p[1].split()[0])))
    except (ValueError, IndexError):
        pass


def clock(t0, t1):
    s = [mhz for t, mhz in smi if t0 - 0.03 <= t <= t1]  # the sample just before, too
    return sum(s) / len(s) if s else float("nan")


rows = collections.defaultdict(dict)  # (pass, d, N, c) -> {(who, round): (cold, hot)}
for f in sys.argv[2:]:
    for line in open(f):
        w = line.split()
        if len(w) != 18 or w[2] != "d":
            continue
        who, rnd = re.match(r"([a-z]+)(\d*)", w[0]).groups()
        key = (w[1], int(w[3]), int(w[5]), int(w[7]))
        rows[key][(who, rnd)] = tuple((float(w[i + 1]), clock(float(w[i + 2]), float(w[i + 3])))
                                      for i in (9, 14))
print("pass   d     N c | state | ours TFLOP/s (MHz)      | cuDNN TFLOP/s (MHz)     | ours / cuDNN")
for key in sorted(rows):
    r = rows[key]
    rounds = sorted({rnd for who, rnd in r})
    for s, state in enumerate(("cold", "hot")):
        ours = [r.get(("ours", x)) for x in rounds]
        cud = [r.get(("cudnn", x)) for x in rounds]
        fmt = lambda v: " ".join(f"{x[s][0]:6.1f} ({x[s][1]:4.0f})" if x else "     -" for x in v)
        ratio = " ".join(f"{o[s][0] / c[s][0]:.3f}" if o and c else "-" for o, c in zip(ours, cud))
        print(f"{key[0]} {key[1]:3d} {key[2]:5d} {key[3]} | {state:5s} | {fmt(ours)} | {fmt(cud)} "
              f"| {ratio}")
