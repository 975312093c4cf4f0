#!/usr/bin/env bash
# lab/gpu-varlen.sh OUT [BASE]: one GPU run for chapter 5's packed batches (lab/chapter5.md): the
# build (CLEAN=1: make clean first, to time make test from nothing), the [varlen] tests, the
# default suite, lab/varlen-bench.cu, then, with BASE (a tree
# before packed batches, e.g. from `git archive`), the plain contiguous kernels of both trees in
# turns (flash_bench: chapter 3's public call and chapter 2's, forward and backward), to show
# what packing costs the calls that do not pack. With OPTIONS=1 lab/options-bench.cu too; with
# TORCH=1 `pytest pytorch` and lab/mask-bench.py after. Logs under OUT; a short table last. Catch2 from CPPFLAGS (e.g.
# CPPFLAGS=-I.deps/include).
set -uo pipefail
out=${1:?usage: lab/gpu-varlen.sh OUT [BASE]} base=${2:-}
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
mkdir -p "$out"
rows=()
[ -n "$base" ] && (cd "$base" && make -j8 flash_bench >"$out/base-build.log" 2>&1) &
[ "${CLEAN:-0}" = 1 ] && make clean >/dev/null
t0=$SECONDS; make -j8 test_flash flash_bench >"$out/build.log" 2>&1; rc=$?
rows+=("build|$((SECONDS - t0)) s|exit $rc")
t0=$SECONDS; ./test_flash "[varlen]" --durations yes >"$out/varlen.log" 2>&1; rc=$?
rows+=("[varlen] tests|$((SECONDS - t0)) s|exit $rc, $(tail -n 1 "$out/varlen.log")")
t0=$SECONDS; ./test_flash >"$out/default.log" 2>&1; rc=$?
rows+=("default suite|$((SECONDS - t0)) s|exit $rc, $(tail -n 1 "$out/default.log")")
objs="build/flash.o build/flash_fp16.o build/backward_passes.o build/flash_decode.o"
objs="$objs build/checks.o build/dispatch.o build/flash_hopper.o build/flash_hopper_backward.o"
t0=$SECONDS
nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/varlen-bench.cu $objs -o varlen_bench \
    >"$out/varlen-bench.csv" 2>&1 && ./varlen_bench >"$out/varlen-bench.csv" 2>&1; rc=$?
rows+=("varlen bench|$((SECONDS - t0)) s|exit $rc")
if [ "${OPTIONS:-0}" = 1 ]; then  # chapter 5's options, timed (lab/options-bench.cu)
    t0=$SECONDS
    nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/options-bench.cu $objs -o options_bench \
        >"$out/options-bench.csv" 2>&1 && ./options_bench >"$out/options-bench.csv" 2>&1; rc=$?
    rows+=("options bench|$((SECONDS - t0)) s|exit $rc")
fi
wait
if [ -n "$base" ]; then
    for round in 1 2; do
        for tree in base new; do
            dir=.; [ $tree = base ] && dir=$base
            for chapter in "" --chapter2; do
                for d in 64 128; do
                    echo "== round $round, $tree, ${chapter:-public} d $d"
                    (cd "$dir" && ./flash_bench --dtype fp16 $chapter --dim $d --seq 4096 \
                        --batch 4 --heads 16 --causal 1 --no-standard) 2>&1 | grep -E "(fwd|bwd) \|"
                done
            done
        done
    done >"$out/ab.log"
fi
if [ "${TORCH:-0}" = 1 ]; then
    t0=$SECONDS; timeout 400 python3 -m pytest -q pytorch >"$out/torch.log" 2>&1; rc=$?
    rows+=("pytest pytorch|$((SECONDS - t0)) s|exit $rc, $(tail -n 1 "$out/torch.log")")
    t0=$SECONDS; timeout 300 python3 lab/mask-bench.py --csv "$out/mask-bench.csv" \
        >"$out/mask-bench.txt" 2>&1; rc=$?
    rows+=("mask bench|$((SECONDS - t0)) s|exit $rc")
fi
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)"
if [ -n "$base" ]; then  # ms: tree, call, d, direction, round 1, round 2
    awk '/^==/{t=$4; c=$5; d=$7} /(fwd|bwd) \|/{split($0,a,"|"); split(a[2],b," ");
         k=t" "c" d"d" "(index($0,"fwd")?"fwd":"bwd"); ms[k]=ms[k]" "b[1]}
         END{for (k in ms) print k, ms[k]}' "$out/ab.log" | sort -k3,3 -k2,2 -k4,4 -k1,1
fi
grep -h -A12 "^-\{20\}" "$out/varlen.log" | grep -E "FAILED|with expansion|REQUIRE|CHECK|failed" | head -20
tail -n 3 "$out/varlen.log"
cat "$out/varlen-bench.csv"
[ -f "$out/options-bench.csv" ] && cat "$out/options-bench.csv"
printf '%s\n' "${rows[@]}"
