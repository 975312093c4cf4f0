#!/usr/bin/env bash
# lab/gpu-kvcache.sh OUT [BASE]: one GPU run for chapter 4's K/V cache (lab/chapter4.md part 4):
# the build, the [kvcache] tests, the default suite with Catch's durations (the slowest cases
# listed: the default run's budget is 40 s), lab/kvcache-bench.cu and, with BASE (a tree before the
# change, e.g. from `git archive`), the plain decode of both trees in turns (flash_decode_bench).
# Logs under OUT; a short table last. Catch2 from CPPFLAGS (e.g. CPPFLAGS=-I.deps/include).
set -uo pipefail
out=${1:?usage: lab/gpu-kvcache.sh OUT [BASE]} base=${2:-}
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
mkdir -p "$out"
rows=()
[ -n "$base" ] && (cd "$base" && make -j4 flash_decode_bench >"$out/base-build.log" 2>&1) &
t0=$SECONDS; make -j12 test_flash flash_decode_bench >"$out/build.log" 2>&1; rc=$?
rows+=("build|$((SECONDS - t0)) s|exit $rc")
[ $rc = 0 ] || { tail -30 "$out/build.log"; exit 1; }
t0=$SECONDS; ./test_flash "[kvcache]" >"$out/kvcache.log" 2>&1; rc=$?
rows+=("[kvcache] tests|$((SECONDS - t0)) s|exit $rc, $(tail -n 1 "$out/kvcache.log")")
t0=$SECONDS; ./test_flash --durations yes >"$out/default.log" 2>&1; rc=$?
rows+=("default suite|$((SECONDS - t0)) s|exit $rc, $(tail -n 1 "$out/default.log")")
objs="build/flash.o build/flash_fp16.o build/backward_passes.o build/flash_decode.o"
objs="$objs build/checks.o build/dispatch.o build/flash_hopper.o build/flash_hopper_backward.o"
t0=$SECONDS
nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/kvcache-bench.cu $objs -o kvcache_bench \
    >"$out/kvcache-bench.csv" 2>&1 && timeout 120 ./kvcache_bench >"$out/kvcache-bench.csv" 2>&1
rows+=("kvcache bench|$((SECONDS - t0)) s|exit $?")
wait
if [ -n "$base" ]; then
    for round in 1 2; do
        for tree in base new; do
            dir=.; [ $tree = base ] && dir=$base
            echo "== round $round, $tree"
            (cd "$dir" && timeout 60 ./flash_decode_bench --kv-len 8192,32768 --batch 1,8,32) 2>&1 |
                tail -n 7
        done
    done >"$out/decode-ab.txt"
fi
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)"
grep -h -B2 -A14 "FAILED" "$out/kvcache.log" "$out/default.log" | head -40
echo "-- the slowest test cases of the default run (s)"
grep -E "^[0-9]+\.[0-9]+ s: " "$out/default.log" | sort -rn | head -12
[ -f "$out/decode-ab.txt" ] && cat "$out/decode-ab.txt"
cat "$out/kvcache-bench.csv"
printf '%s\n' "${rows[@]}"
