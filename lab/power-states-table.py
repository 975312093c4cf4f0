#!/usr/bin/env python3
"""lab/power-states-table.py [--ratio A/B] SMI.csv FILE...: joins lab/power-states.cu's,
lab/power-states-ab.cu's and lab/power-states.py's lines (each tagged WHO and its round, e.g.
ours1, cudnn2) with nvidia-smi's samples (timestamp, clocks.sm, power.draw; -lms 20) taken beside
them: each set of 10 calls gets the mean SM clock over its window and the sample before it.
Prints, per pass and shape, each WHO's TFLOP/s and clock in each round, cold and hot, and the
ratio A / B of the same round and state (default: the first WHO met over the second; several
ratios: --ratio A/B,C/D). Where a WHO has both passes of a shape, a pass "f+b" is added: the
forward and backward together, 3.5 forward FLOPs over the sum of the two medians (the backward's
lines count 2.5 forward FLOPs), at the mean of the two clocks."""
import collections
import datetime
import re
import sys

args = sys.argv[1:]
ratio = None
if args and args[0] == "--ratio":
    ratio, args = [r.split("/") for r in args[1].split(",")], args[2:]
smi = []
for line in open(args[0]):
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
whos = []
for f in args[1:]:
    for line in open(f):
        w = line.split()
        if len(w) != 18 or w[2] != "d":
            continue
        who, rnd = re.match(r"(.+?)(\d+)$", w[0]).groups()
        if who not in whos:
            whos.append(who)
        key = (w[1], int(w[3]), int(w[5]), int(w[7]))
        rows[key][(who, rnd)] = tuple((float(w[i + 1]), clock(float(w[i + 2]), float(w[i + 3])))
                                      for i in (9, 14))
for (p, d, n, c), r in list(rows.items()):
    if p != "fwd" or ("bwd", d, n, c) not in rows:
        continue
    rb = rows[("bwd", d, n, c)]
    rows[("f+b", d, n, c)] = {
        k: tuple((3.5 / (1 / f[0] + 2.5 / g[0]), (f[1] + g[1]) / 2) for f, g in zip(v, rb[k]))
        for k, v in r.items() if k in rb}
ratios = ratio or [whos[:2]]
print("pass   d     N c | state | " + " | ".join(f"{w} TFLOP/s (MHz)" for w in whos) + " | " +
      " | ".join(f"{a} / {b}" for a, b in ratios))
for key in sorted(rows):
    r = rows[key]
    rounds = sorted({rnd for who, rnd in r}, key=int)
    for s, state in enumerate(("cold", "hot")):
        cols = []
        for who in whos:
            v = [r.get((who, x)) for x in rounds]
            cols.append(" ".join(f"{x[s][0]:6.1f} ({x[s][1]:4.0f})" if x else "     -" for x in v))
        ra = [" ".join(f"{r[(a, x)][s][0] / r[(b, x)][s][0]:.3f}"
                       if (a, x) in r and (b, x) in r else "-" for x in rounds)
              for a, b in ratios]
        print(f"{key[0]:3s} {key[1]:3d} {key[2]:5d} {key[3]} | {state:5s} | " + " | ".join(cols) +
              " | " + " | ".join(ra))
