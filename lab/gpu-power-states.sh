#!/usr/bin/env bash
# lab/gpu-power-states.sh OUT: chapter 3's fp16 forward and backward against SDPA's cuDNN backend,
# each in two power states taken alike (lab/power-states.cu, lab/power-states.py), two rounds in
# turns, nvidia-smi's SM clock sampled every 20 ms beside them. About 5 minutes on an H200; a
# short table last (lab/power-states-table.py), every log in OUT/power-states.tgz.
# With AB="NAME=SOURCE ..." instead: this tree's flash_hopper.cu ("main") and each version of it
# named, the forward only at d = ${AB_DIM:-128}, through lab/power-states-ab.cu (no cuDNN); the
# table's ratio is the first version named over main. With AB_KIND=bwd too, versions of
# flash_hopper_backward.cu the same way, the backward only. With OPTIONS=1: issue 45's options against
# the plain call in the two states (lab/power-states.cu --options), two rounds, no cuDNN; about
# 2 minutes after the build. ROUNDS (default 2) rounds; with FWD_ONLY=1 the forward alone, and with
# DIM=D too one head dim (DIM=D alone: both passes at D). With UNORDERED=1 ours runs a second time
# each round with the backward's options.deterministic false (tag "free"), three ratios.
set -uo pipefail
out=${1:?usage: lab/gpu-power-states.sh OUT} && mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
t0=$SECONDS
if [ -n "${AB:-}" ]; then
    for v in $AB; do  # the table reads the round from a tag's last digits (main1, rsq2)
        [[ ${v%%=*} =~ [0-9]$ ]] && { echo "AB: a NAME must not end in a digit: $v"; exit 2; }
    done
    base=flash_hopper.cu need=build/checks.o  # AB_KIND=bwd: versions of the backward
    [ "${AB_KIND:-}" = bwd ] && base=flash_hopper_backward.cu need="$need build/backward_passes.o"
    make -j"$(nproc)" $need >"$out/build.log" 2>&1 &&
        AB_DRIVER=lab/power-states-ab.cu lab/hopper-ab.sh main=$base $AB \
            >>"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
    echo "built in $((SECONDS - t0)) s"
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader -lms 20 \
        >"$out/smi.csv" 2>&1 &
    smi=$!
    ./power_states_ab 2 "${AB_DIM:-128}" >"$out/ab.txt" 2>&1 || tail -5 "$out/ab.txt"
    kill $smi
    first=${AB%%=*}
    python3 lab/power-states-table.py --ratio "$first/main" "$out/smi.csv" "$out/ab.txt" \
        >"$out/table.txt"
    (cd "$out" && tar czf power-states.tgz smi.csv ab.txt table.txt build.log)
    cat "$out/table.txt"
    exit 0
fi
objs="build/flash.o build/flash_fp16.o build/backward_passes.o build/flash_decode.o build/checks.o"
objs="$objs build/dispatch.o build/flash_hopper.o build/flash_hopper_backward.o"
objs="$objs build/flash_hopper_fp8.o"
make -j"$(nproc)" $objs >"$out/build.log" 2>&1 &&
    nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/power-states.cu $objs -o power_states \
        >>"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
echo "built in $((SECONDS - t0)) s"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader |
    tee "$out/gpu.txt"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader -lms 20 \
    >"$out/smi.csv" 2>&1 &
smi=$!
if [ -n "${OPTIONS:-}" ]; then
    ./power_states --options 2 >"$out/options.txt" 2>&1 || tail -5 "$out/options.txt"
    kill $smi
    python3 lab/power-states-table.py --ratio softcap/plain,alibi/plain,scale/plain,window/dense \
        "$out/smi.csv" "$out/options.txt" >"$out/table.txt"
    (cd "$out" && tar czf power-states.tgz gpu.txt smi.csv options.txt table.txt build.log)
    cat "$out/table.txt"
    exit 0
fi
fwd=""; [ -n "${FWD_ONLY:-}" ] && fwd="fwd ${DIM:-}"
[ -z "${FWD_ONLY:-}" ] && [ -n "${DIM:-}" ] && fwd="both $DIM"
ratios=""  # UNORDERED=1: ours without dQ's order too ("free"), each round after ours
[ -n "${UNORDERED:-}" ] && ratios="--ratio ours/cudnn,free/cudnn,free/ours"
for r in $(seq "${ROUNDS:-2}"); do
    ./power_states "ours$r" $fwd >"$out/ours$r.txt" 2>&1 || tail -5 "$out/ours$r.txt"
    [ -n "${UNORDERED:-}" ] && { BWD_DETERMINISTIC=0 ./power_states "free$r" $fwd \
        >"$out/free$r.txt" 2>&1 || tail -5 "$out/free$r.txt"; }
    python3 lab/power-states.py cudnn $fwd >"$out/cudnn$r.txt" 2>&1 || tail -5 "$out/cudnn$r.txt"
    sed -i "s/^cudnn /cudnn$r /" "$out/cudnn$r.txt"
    echo "round $r at $((SECONDS - t0)) s"
done
kill $smi
python3 lab/power-states-table.py $ratios "$out/smi.csv" "$out"/ours?.txt "$out"/cudnn?.txt \
    $(ls "$out"/free?.txt 2>/dev/null) >"$out/table.txt"
(cd "$out" && tar czf power-states.tgz gpu.txt smi.csv ours?.txt cudnn?.txt \
    $(ls free?.txt 2>/dev/null) table.txt build.log)
cat "$out/table.txt"
