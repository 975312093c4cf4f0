#!/usr/bin/env bash
# lab/gpu-fp8.sh OUT: one GPU run for chapter 3's fp8 forward and the forward's ping-pong
# (lab/chapter3.md, "fp8 and the ping-pong"): the build, the PyTorch op's build (beside it), the
# ping-pong A/B (lab/hopper-ab.sh: this tree's flash_hopper.cu with -DHOPPER_PINGPONG=0 and as it
# is, 5 rounds at d = 128 and 256), the default suite with Catch's durations, `pytest pytorch`,
# and lab/fp8-bench.cu. Logs under OUT (also as OUT/logs.tgz); a short table last. Catch2 from
# CPPFLAGS (e.g. CPPFLAGS=-I$PWD/.deps/include).
set -uo pipefail
out=${1:?usage: lab/gpu-fp8.sh OUT} && mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
rows=()
t0=$SECONDS
(python3 pytorch/flash_torch.py >"$out/torch-build.log" 2>&1) &
(until [ -f build/checks.o ]; do sleep 2; done; sleep 5
 (echo '#define HOPPER_PINGPONG 0'; cat flash_hopper.cu) >"$out/nopp.cu"
 lab/hopper-ab.sh off="$out/nopp.cu" on=flash_hopper.cu >"$out/ab-build.log" 2>&1) &
make -j"$(nproc)" test_flash >"$out/build.log" 2>&1; rc=$?
wait
rows+=("build (test_flash, the op, the A/B)|$((SECONDS - t0)) s|exit $rc")
[ $rc = 0 ] || { tail -30 "$out/build.log"; exit 1; }
t0=$SECONDS; (timeout 60 ./hopper_ab 5 128; timeout 60 ./hopper_ab 5 256) >"$out/pingpong-ab.txt" 2>&1
rows+=("ping-pong A/B|$((SECONDS - t0)) s|exit $?")
t0=$SECONDS; timeout 200 ./test_flash --durations yes >"$out/default.log" 2>&1; rc=$?
rows+=("default suite|$((SECONDS - t0)) s|exit $rc, $(tail -n 1 "$out/default.log")")
t0=$SECONDS; timeout 200 python3 -m pytest -q pytorch >"$out/torch.log" 2>&1; rc=$?
rows+=("pytest pytorch|$((SECONDS - t0)) s|exit $rc, $(tail -n 1 "$out/torch.log")")
objs="build/flash.o build/flash_fp16.o build/flash_decode.o build/checks.o build/dispatch.o"
objs="$objs build/backward_passes.o build/flash_hopper.o build/flash_hopper_backward.o"
t0=$SECONDS
nvcc -O3 -std=c++17 -arch=native -I. -Ilib -Ilab lab/fp8-bench.cu $objs build/flash_hopper_fp8.o \
    -o fp8_bench >"$out/fp8-bench.csv" 2>&1 && timeout 120 ./fp8_bench >"$out/fp8-bench.csv" 2>&1
rows+=("fp8 bench|$((SECONDS - t0)) s|exit $?")
tar -czf "$out/logs.tgz" -C "$out" --exclude logs.tgz . 2>/dev/null
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)"
grep -h -B2 -A14 "FAILED" "$out/default.log" | head -40
grep -h -E "FAILED|Error|error" "$out/torch.log" | head -20
grep -E "^[0-9]+\.[0-9]+ s: " "$out/default.log" | sort -rn | head -5
cat "$out/fp8-bench.csv" "$out/pingpong-ab.txt"
printf '%s\n' "${rows[@]}"
