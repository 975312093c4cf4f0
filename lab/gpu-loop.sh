#!/usr/bin/env bash
# lab/gpu-loop.sh OUT [BASE [ab]]: one GPU run for the classroom loop (make test's times) and, with
# BASE (a copy of an older tree, e.g. from `git archive`), the speed of chapters 1-4 against it
# (with "ab", that alone).
#   1. a clean `make test` (the build on every core, then the default tests), timed;
#   2. `make ch1` after a one-line change to flash.cu, timed;
#   3. the default suite again, with Catch's durations (OUT/default.log);
#   4. with BASE: flash_bench and flash_decode_bench of both trees, in turns (OUT/ab.log).
# Catch2 from CPPFLAGS (e.g. CPPFLAGS=-I.deps/include). Prints a short table last.
set -uo pipefail
out=${1:?usage: lab/gpu-loop.sh OUT [BASE [ab]]} base=${2:-} mode=${3:-all}
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
mkdir -p "$out"
now() { date +%s%N; }
secs() { echo "$(( ($2 - $1) / 1000000 ))" | sed 's/\(...\)$/.\1/'; }
rows=()

if [ "$mode" != ab ]; then
make clean >/dev/null
t0=$(now); make test >"$out/fresh-make-test.log" 2>&1; rc=$?; t1=$(now)
rows+=("clean make test (build + default tests)|$(secs "$t0" "$t1") s|exit $rc, $(tail -n 1 "$out/fresh-make-test.log")")

cp flash.cu "$out/flash.cu.orig"
sed -i '1s/$/ /' flash.cu  # a one-line change: flash.cu is compiled again
t0=$(now); make ch1 >"$out/ch1.log" 2>&1; rc=$?; t1=$(now)
cp "$out/flash.cu.orig" flash.cu && rm "$out/flash.cu.orig"
rows+=("make ch1 after a one-line change to flash.cu|$(secs "$t0" "$t1") s|exit $rc, $(tail -n 1 "$out/ch1.log")")
make test_flash >/dev/null 2>&1

t0=$(now); ./test_flash --durations yes >"$out/default.log" 2>&1; rc=$?; t1=$(now)
rows+=("./test_flash (the default run, built)|$(secs "$t0" "$t1") s|exit $rc, $(tail -n 1 "$out/default.log")")
fi

if [ -n "$base" ]; then
    (cd "$base" && make -j"$(nproc)" flash_bench flash_decode_bench >/dev/null 2>&1) || echo "BASE does not build"
    make flash_bench flash_decode_bench >/dev/null 2>&1 || echo "this tree does not build the benchmarks"
    shapes=("--dtype fp32 --dim 64 --seq 2048 --batch 4 --heads 16"
            "--dtype fp16 --chapter2 --dim 128 --seq 4096 --batch 2 --heads 16"
            "--dtype fp16 --dim 64 --seq 8192 --batch 1 --heads 16 --causal 0"
            "--dtype fp16 --dim 128 --seq 8192 --batch 1 --heads 16 --causal 0"
            "--dtype fp16 --dim 128 --seq 8192 --batch 1 --heads 16 --causal 1"
            "--dtype bf16 --dim 256 --seq 4096 --batch 1 --heads 16 --causal 0")
    for round in 1 2; do
        for tree in base new; do
            dir=.; [ $tree = base ] && dir=$base
            for k in "${!shapes[@]}"; do
                echo "== round $round, $tree: flash_bench ${shapes[$k]}"
                (cd "$dir" && ./flash_bench ${shapes[$k]} --no-standard) 2>&1 | tail -n 8
            done >>"$out/ab.log"
            { echo "== round $round, $tree: flash_decode_bench"
              (cd "$dir" && ./flash_decode_bench --kv-len 8192,32768 --batch 1,8) 2>&1 | tail -n 8
            } >>"$out/ab.log"
        done
    done
fi

echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)"
for r in "${rows[@]}"; do IFS='|' read -r what time how <<<"$r"; printf '%-46s %9s  %s\n' "$what" "$time" "$how"; done
