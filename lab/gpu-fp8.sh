#!/usr/bin/env bash
# lab/gpu-fp8.sh OUT: one GPU run for chapter 3's fp8 forward (flash_hopper_fp8.cu): the build,
# ptxas's registers and spills of the fp8 kernels, the [fp8] tests, the default suite with Catch's
# durations, and lab/fp8-bench.cu. Logs under OUT; a short table last. Catch2 from CPPFLAGS.
set -uo pipefail
out=${1:?usage: lab/gpu-fp8.sh OUT}
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
mkdir -p "$out"
rows=()
t0=$SECONDS; make -j16 test_flash >"$out/build.log" 2>&1; rc=$?
rows+=("build|$((SECONDS - t0)) s|exit $rc")
[ $rc = 0 ] || { tail -30 "$out/build.log"; exit 1; }
nvcc -I. -Ilib -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -c \
    flash_hopper_fp8.cu -o /dev/null 2>&1 | grep -E "spill|Used" >"$out/ptxas.txt"
t0=$SECONDS; timeout 120 ./test_flash "[fp8]" >"$out/fp8.log" 2>&1; rc=$?
rows+=("[fp8] tests|$((SECONDS - t0)) s|exit $rc, $(tail -n 1 "$out/fp8.log")")
t0=$SECONDS; timeout 200 ./test_flash --durations yes >"$out/default.log" 2>&1; rc=$?
rows+=("default suite|$((SECONDS - t0)) s|exit $rc, $(tail -n 1 "$out/default.log")")
objs="build/flash.o build/flash_fp16.o build/flash_decode.o build/checks.o build/dispatch.o"
objs="$objs build/backward_passes.o build/flash_hopper.o build/flash_hopper_backward.o"
objs="$objs build/flash_hopper_fp8.o"
t0=$SECONDS
nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/fp8-bench.cu $objs -o fp8_bench \
    >"$out/fp8-bench.csv" 2>&1 && timeout 180 ./fp8_bench >"$out/fp8-bench.csv" 2>&1
rows+=("fp8 bench|$((SECONDS - t0)) s|exit $?")
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)"
grep -h -B2 -A14 "FAILED" "$out/fp8.log" | head -60
sort -u "$out/ptxas.txt"
cat "$out/fp8-bench.csv"
printf '%s\n' "${rows[@]}"
