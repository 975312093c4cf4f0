#!/usr/bin/env bash
# lab/gpu-kernel-times.sh OUT [ARGS ...]: every kernel a flash_bench call launches, timed alone by
# Nsight Compute (gpu__time_duration.sum), the median of each kernel's launches: the passes around
# a kernel (the backward's D and dQ passes, fp8's transpose of V) show up beside it. Each ARGS is
# one quoted set of flash_bench's shape flags (default: chapter 3's fp16 forward and backward at d
# = 128, N = 2048, with and without the mask). Needs `make flash_bench` and ncu; OUT/ncu.csv keeps
# the raw rows, OUT/kernel-times.txt the table (lab/data/backward-kernel-times-h200.txt).
set -uo pipefail
out=${1:?usage: lab/gpu-kernel-times.sh OUT [ARGS ...]} && shift && mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
[ $# -gt 0 ] || set -- "--dim 128 --seq 2048 --batch 8 --causal 0" \
                      "--dim 128 --seq 2048 --batch 8 --causal 1"
: >"$out/ncu.csv"
for args in "$@"; do
    echo "== $args" >>"$out/ncu.csv"
    # shellcheck disable=SC2086  # (the flags split on purpose)
    timeout 120 ncu --metrics gpu__time_duration.sum --csv --print-units base ./flash_bench \
        --dtype fp16 --heads 16 $args --no-standard --repeat 10 2>&1 | grep -E '^"' >>"$out/ncu.csv"
done
python3 - "$out/ncu.csv" <<'PY' | tee "$out/kernel-times.txt"
import collections, csv, sys
times = collections.OrderedDict()
def table():
    for name, t in times.items():
        print(f"  {name[:66]:66s} n={len(t):3d} median={sorted(t)[len(t) // 2] / 1e3:9.1f} us")
    times.clear()
for line in open(sys.argv[1]):
    if line.startswith("=="):
        table()
        print(line.strip())
        continue
    f = next(csv.reader([line]))
    if len(f) >= 15 and f[0] != "ID":  # column 5 the kernel, 15 the value in ns
        times.setdefault(f[4].split("(")[0], []).append(float(f[14].replace(",", "")))
table()
PY
