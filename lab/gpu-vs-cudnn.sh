#!/usr/bin/env bash
# lab/gpu-vs-cudnn.sh OUT: chapter 3 against PyTorch SDPA's cuDNN and flash backends in one run
# (issue 47's fp16 floors), FlashAttention-2's protocol (batch * N = 16384, hidden 2048), fp16:
#   1. flash_bench --protocol (d = 64 and 128, forward and backward, the public calls);
#   2. lab/hopper-ab.sh with this tree's flash_hopper.cu alone (the forward at d = 64, 128, 256);
#   3. lab/sdpa-reference.py, forward and backward, flash and cudnn, d = 64, 128, 256.
# Logs and CSVs under OUT; a short table last. Catch2 is not needed (no tests are built).
set -uo pipefail
out=${1:?usage: lab/gpu-vs-cudnn.sh OUT} && mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
rows=()
t0=$SECONDS
(until [ -f build/checks.o ]; do sleep 2; done; sleep 5
 lab/hopper-ab.sh ch3=flash_hopper.cu >"$out/ab-build.log" 2>&1) &
make -j"$(nproc)" flash_bench >"$out/build.log" 2>&1; rc=$?
wait
rows+=("build|$((SECONDS - t0)) s|exit $rc")
[ $rc = 0 ] || { tail -30 "$out/build.log"; exit 1; }
t0=$SECONDS
timeout 200 ./flash_bench --protocol --dtype fp16 --no-standard --csv "$out/ours.csv" \
    >"$out/ours.log" 2>&1
rows+=("flash_bench --protocol fp16|$((SECONDS - t0)) s|exit $?")
t0=$SECONDS; timeout 60 ./hopper_ab 3 >"$out/ch3-forward.txt" 2>&1
rows+=("hopper_ab (forward, d 64-256)|$((SECONDS - t0)) s|exit $?")
for pass in forward backward; do
    t0=$SECONDS
    timeout 150 python3 lab/sdpa-reference.py $([ $pass = backward ] && echo --backward) \
        --backends flash,cudnn --dims 64,128,256 --seqs 1024,2048,4096,8192,16384 \
        --csv "$out/sdpa-$pass.csv" >"$out/sdpa-$pass.log" 2>&1
    rows+=("sdpa $pass|$((SECONDS - t0)) s|exit $?")
done
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)"
head -3 "$out/ours.csv"; cat "$out/ch3-forward.txt"; head -3 "$out/sdpa-forward.csv"
printf '%s\n' "${rows[@]}"
