#!/usr/bin/env bash
# lab/gpu-gqa.sh: grouped-query attention (GQA, MQA) on a GPU, in one run from the repository
# root: builds test_flash and flash_bench (and the PyTorch op, as `make torch` does, beside them),
# runs the C++ tests of GQA and of the MHA paths GQA touched ("[gqa]", "[backward]",
# "[determinism]", "[sanitize]": every kernel's small shapes), the PyTorch op's GQA tests against
# SDPA's enable_gqa=True, then times GQA (4 query heads a K/V head) against MHA with the same
# query heads on the FlashAttention-2 protocol's shapes (batch * seq = 16384, hidden 2048: d = 64
# x 32 heads, 128 x 16 heads), N = 2048, 4096, 8192, causal and not, fp16, forward and backward.
# Every step is bounded by `timeout`; logs go under $OUT (or lab/gpu-gqa-out/), and the last lines
# printed are a compact table: TFLOP/s of each, GQA / MHA, and the tensors' MiB.
#   OUT=/some/dir bash lab/gpu-gqa.sh      (about 5 minutes on an H100: build 2-3, tests 1-2,
#                                           timing 1-1.5)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-lab/gpu-gqa-out}
mkdir -p "$OUT"
status=()  # one "step: result" line a step, for the summary
step() {   # step NAME SECONDS COMMAND...: runs it under timeout, its output in $OUT/NAME.log
    local name=$1 secs=$2
    shift 2
    local t0=$SECONDS
    timeout --kill-after=10 "$secs" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local what="ok"
    [ $rc -eq 124 ] && what="TIMED OUT after ${secs}s"
    [ $rc -ne 0 ] && [ $rc -ne 124 ] && what="FAILED (exit $rc)"
    status+=("$(printf '%-14s %-22s %4ds  (%s)' "$name" "$what" $((SECONDS - t0)) \
        "$OUT/$name.log")")
    return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
echo "GPU: $(cat "$OUT/gpu.txt")"

# 1. Build: the C++ binaries and the PyTorch extension side by side (each compiles the kernels).
echo "building (make -j16 test_flash flash_bench; make torch) ..."
step torch-build 420 make torch &
torch_pid=$!
step build 420 make -j16 test_flash flash_bench CPPFLAGS=-I.deps/include
build_rc=$?
wait $torch_pid
torch_rc=$?
# (the background step's status line is lost with its subshell: say it here)
torch_what=ok
[ $torch_rc -ne 0 ] && torch_what="FAILED (exit $torch_rc)"
status+=("$(printf '%-14s %-22s        (%s)' torch-build "$torch_what" "$OUT/torch-build.log")")

# 2. Tests: the C++ suite's GQA tests and the MHA tests of the paths GQA touched; the PyTorch
# op's GQA tests (and its bad-input ones) against SDPA.
if [ $build_rc -eq 0 ]; then
    step test-gqa 240 ./test_flash "[gqa],[backward],[determinism],[sanitize]"
fi
if [ $torch_rc -eq 0 ]; then
    step pytest-gqa 240 python3 -m pytest pytorch/test_torch.py -q -k "gqa or bad_input"
fi

# 3. Timing: flash_bench's demo on each shape, MHA (kv_heads = heads) then GQA (heads / 4), flash
# only (--no-standard; GQA has no standard baseline), 10 timed runs, the CPU check as it runs.
rows=()
if [ $build_rc -eq 0 ]; then
    t0=$SECONDS
    for d in 64 128; do
        heads=$((2048 / d))
        for causal in 0 1; do
            for n in 2048 4096 8192; do
                batch=$((16384 / n))
                for kv in $heads $((heads / 4)); do
                    log="$OUT/bench-d$d-n$n-c$causal-kv$kv.log"
                    timeout 60 ./flash_bench --dtype fp16 --batch $batch --heads $heads \
                        --kv-heads $kv --seq $n --dim $d --causal $causal --no-standard \
                        --repeat 10 > "$log" 2>&1
                    # The listing: "d H B N caus fwd | ms TFLOP/s %peak MiB |", then "bwd |".
                    fwd=$(awk -F'|' '/ fwd \|/ {split($2, a, " "); print a[2]}' "$log")
                    bwd=$(awk -F'|' '/ bwd \|/ {split($2, a, " "); print a[2]}' "$log")
                    mib=$(sed -n 's/^tensors: \([0-9.]*\) MiB.*/\1/p' "$log")
                    check=$(grep -Eo '^(PASS|FAIL|NOT CHECKED)$' "$log" | tail -1)
                    rows+=("$d $heads $kv $n $causal ${fwd:-?} ${bwd:-?} ${mib:-?} ${check:-ERROR}")
                done
            done
        done
    done
    status+=("$(printf '%-14s %-22s %4ds  (%s)' timing done $((SECONDS - t0)) "$OUT/bench-*.log")")
fi

# Summary: each step, then the table (GQA beside MHA of the same d, N and mask).
echo
echo "==== steps"
printf '%s\n' "${status[@]}"
grep -E "test cases|flash tests:" "$OUT/test-gqa.log" 2>/dev/null | tail -2
tail -1 "$OUT/pytest-gqa.log" 2>/dev/null
echo
echo "==== GQA (4 query heads a K/V head) vs MHA, fp16, FA2 protocol shapes," \
    "$(cut -d, -f1 "$OUT/gpu.txt")"
printf '%4s %3s %5s %4s | %9s %9s %6s | %9s %9s %6s | %9s %9s | %s\n' d H N caus \
    "MHA fwd" "GQA fwd" "ratio" "MHA bwd" "GQA bwd" "ratio" "MHA MiB" "GQA MiB" "check"
for ((r = 0; r + 1 < ${#rows[@]}; r += 2)); do
    read -r d h kv n c f1 b1 m1 k1 <<< "${rows[r]}"
    read -r _ _ kv2 _ _ f2 b2 m2 k2 <<< "${rows[r + 1]}"
    ratio() {  # b / a, or ? where either is missing
        awk -v a="$1" -v b="$2" 'BEGIN { if (a + 0 > 0 && b != "?") printf "%.3f", b / a; else print "?" }'
    }
    printf '%4s %3s %5s %4s | %9s %9s %6s | %9s %9s %6s | %9s %9s | %s\n' "$d" "$h" "$n" "$c" \
        "$f1" "$f2" "$(ratio "$f1" "$f2")" "$b1" "$b2" "$(ratio "$b1" "$b2")" "$m1" "$m2" \
        "MHA $k1, GQA $k2 (kv_heads $kv2)"
done
echo "(TFLOP/s: 4 d FLOPs a (query, key) pair a query head, 2.5x backward; MiB: the tensors"
echo " Q, K, V, O, dO, dQ, dK, dV, L; check: flash_bench's CPU check of its first and last head)"
