#!/usr/bin/env bash
# Chapter 4 on a GPU (split-KV decoding): build, the [decode] tests, the decode
# benchmark at the floor's shapes (fp16, d = 128, 32 query heads over 8 K/V heads, q_len = 1,
# kv_len 4k, 8k, 32k, 128k, batch 1, 8, 32) and SDPA at the same shapes, each with the L2 flushed
# by writing (dirty, the default) and by reading (clean), then a compact table.
# About 4 minutes on an H100: the build, the [decode] tests, the rest of the default suite (about
# a minute), the two timings. Logs under $OUT (else gpu-logs/decode).
#   bash lab/gpu-decode.sh
set -u
cd "$(dirname "$0")/.."
LOGS="${OUT:-gpu-logs/decode}"
mkdir -p "$LOGS"
status=0

echo "== build" | tee "$LOGS/build.log"
timeout 300 make -j16 test_flash flash_decode_bench CPPFLAGS=-I.deps/include >>"$LOGS/build.log" 2>&1 \
    || { echo "build FAILED (tail of $LOGS/build.log):"; tail -30 "$LOGS/build.log"; exit 1; }

echo "== ptxas: the split kernels' registers and spills at sm_90 (nvcc 13.0 gave: 4-row kernels 128"
echo "   registers, 2 blocks an SM, none spilled; 8-row kernels 238-250, none)"
probe=$(mktemp -d)
timeout 120 nvcc -std=c++17 -O3 -I. -Ilib -arch=sm_90 -Xptxas -v -c flash_decode.cu \
    -o "$probe/probe.o" >"$LOGS/ptxas.log" 2>&1 || echo "ptxas probe FAILED: see $LOGS/ptxas.log"
rm -rf "$probe"
awk '/Compiling entry function/ { n = match($0, /split_kernelI[^E]*ELi[0-9]+E/);
                                  f = n ? substr($0, RSTART + 13, RLENGTH - 13) : "" }
     /spill stores/ && f != "" { sp = $5 " B spilled" }
     /Used [0-9]+ registers/ && f != "" { print "  " f ": " $5 " registers, " sp; f = "" }' \
    "$LOGS/ptxas.log" | tee "$LOGS/ptxas-summary.txt"

echo "== ./test_flash [decode]"
timeout 150 ./test_flash "[decode]" >"$LOGS/test-decode.log" 2>&1
tests=$?
[ $tests = 0 ] || status=1
tail -3 "$LOGS/test-decode.log"

echo "== ./test_flash ~[decode]~[.]: every other default test (flash_forward_fp16 / _bf16 now run the"
echo "   decode for q_len <= 8, and the backward tests read its O and L)"
timeout 200 ./test_flash "~[decode]~[.]" >"$LOGS/test-rest.log" 2>&1
rest=$?
[ $rest = 0 ] || status=1
tail -2 "$LOGS/test-rest.log"

for flush in write read; do
    echo "== flash_decode_bench --flush $flush"
    timeout 120 ./flash_decode_bench --flush $flush --csv "$LOGS/decode-$flush.csv" \
        >"$LOGS/decode-bench-$flush.log" 2>&1 || status=1
    echo "== SDPA --flush $flush"
    timeout 150 python3 lab/decode-sdpa.py --flush $flush --csv "$LOGS/sdpa-$flush.csv" \
        >"$LOGS/sdpa-$flush.log" 2>&1 || status=1
done

echo
echo "================ summary"
echo "tests [decode]: exit $tests; the rest of the default suite: exit $rest"
grep -h "Li128ELi4E" "$LOGS/ptxas-summary.txt" | sed 's/^/ptxas d = 128, 4 rows: /' 
grep -E "FAILED|failed" "$LOGS/test-decode.log" | head -5
grep -E "test cases|assertions" "$LOGS/test-decode.log" | tail -2
head -1 "$LOGS/decode-bench-write.log"
for flush in write read; do
echo "-- L2 flushed by ${flush}ing"
python3 - "$LOGS/decode-$flush.csv" "$LOGS/sdpa-$flush.csv" <<'PY'
import csv, sys
try:
    ours = list(csv.DictReader(open(sys.argv[1])))
except OSError:
    sys.exit("no decode csv: see decode-bench-*.log")
best = {}
try:
    for r in csv.DictReader(open(sys.argv[2])):
        if r["backend"].startswith("best:"):
            best[(r["batch"], r["kv_len"])] = (r["backend"][5:], float(r["time_us"]))
except OSError:
    pass
print(f"{'batch':>5} {'kv_len':>7} {'splits':>6} {'us':>8} {'GB/s':>6} {'frac':>5} {'floor':>5} "
      f"{'SDPA best us':>13} {'speedup':>7}")
for r in ours:
    kv = int(r["kv_len"]); frac = float(r["fraction"])
    floor = 0.70 if kv >= 32768 else 0.50 if kv >= 8192 else None
    ok = "-" if floor is None else ("ok" if frac >= floor else "MISS")
    b = best.get((r["batch"], r["kv_len"]))
    sd = f"{b[1]:.1f} {b[0][:5]}" if b else "n/a"
    sp = f"{b[1] / float(r['time_us']):.2f}x" if b else ""
    print(f"{r['batch']:>5} {kv:>7} {r['splits']:>6} {float(r['time_us']):>8.1f} "
          f"{float(r['kv_gbs']):>6.0f} {frac:>5.2f} {ok:>5} {sd:>13} {sp:>7}")
PY
done
exit $status
