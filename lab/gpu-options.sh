#!/usr/bin/env bash
# lab/gpu-options.sh OUT [BASE]: one GPU run for chapter 5's options (lab/chapter5.md): the build,
# the options' tests, the default suite, lab/options-bench.cu, with BASE (a tree before chapter 5,
# e.g. from `git archive`) chapter 2's plain kernels of both trees in turns (flash_bench), last.
# After the default suite the options' stress grid (STRESS_SECONDS at most); after the bench,
# with EXERCISES="5.1 5.2", exercises/run.sh for those, and with TORCH=1 `pytest pytorch`. Logs
# under OUT; a short table last. Catch2 from CPPFLAGS (e.g. CPPFLAGS=-I.deps/include).
set -uo pipefail
out=${1:?usage: lab/gpu-options.sh OUT [BASE]} base=${2:-}
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
mkdir -p "$out"
rows=()
objs="build/flash.o build/backward_passes.o build/flash_decode.o build/checks.o build/dispatch.o"
[ -n "$base" ] && (cd "$base" && make -j8 flash_bench >"$out/base-build.log" 2>&1) &
t0=$SECONDS; make test_flash flash_bench >"$out/build.log" 2>&1; rc=$?
rows+=("build|$((SECONDS - t0)) s|exit $rc")
[ -f build/flash_hopper.o ] && objs="$objs build/flash_hopper.o build/flash_hopper_backward.o"
t0=$SECONDS; ./test_flash "[options]~[stress]" --durations yes >"$out/options.log" 2>&1; rc=$?
rows+=("[options] tests|$((SECONDS - t0)) s|exit $rc, $(tail -n 1 "$out/options.log")")
t0=$SECONDS; ./test_flash >"$out/default.log" 2>&1; rc=$?
rows+=("default suite|$((SECONDS - t0)) s|exit $rc, $(tail -n 1 "$out/default.log")")
t0=$SECONDS; timeout "${STRESS_SECONDS:-120}" ./test_flash "[options][stress]" >"$out/stress.log" 2>&1; rc=$?
rows+=("[options][stress]|$((SECONDS - t0)) s|exit $rc, $(tail -n 1 "$out/stress.log")")
wait
t0=$SECONDS
nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/options-bench.cu build/flash_fp16.o $objs \
    -o options_bench >"$out/bench-build.log" 2>&1
./options_bench >"$out/bench.csv" 2>&1; rc=$?
rows+=("options bench|$((SECONDS - t0)) s|exit $rc")
if [ -n "${EXERCISES:-}" ]; then
    t0=$SECONDS; timeout 300 exercises/run.sh $EXERCISES >"$out/exercises.log" 2>&1; rc=$?
    rows+=("exercises $EXERCISES|$((SECONDS - t0)) s|exit $rc")
    mkdir -p "$out/exercises" && for id in $EXERCISES; do cp "exercises/$id.log" "$out/exercises/"; done
fi
if [ "${TORCH:-0}" = 1 ]; then
    t0=$SECONDS; timeout 300 python3 -m pytest pytorch >"$out/torch.log" 2>&1; rc=$?
    rows+=("pytest pytorch|$((SECONDS - t0)) s|exit $rc, $(tail -n 1 "$out/torch.log")")
fi
if [ -n "$base" ]; then
    for round in 1 2; do
        for tree in base new; do
            dir=.; [ $tree = base ] && dir=$base
            for d in 64 128; do
                echo "== round $round, $tree, d $d"
                (cd "$dir" && ./flash_bench --dtype fp16 --chapter2 --dim $d --seq 4096 --batch 4 \
                    --heads 16 --causal 1 --no-standard) 2>&1 | grep -E "(fwd|bwd) \|"
            done
        done
    done >"$out/ab.log"
fi
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)"
cat "$out/bench.csv"; [ -n "$base" ] && grep -E "round|fwd|bwd" "$out/ab.log"
for r in "${rows[@]}"; do IFS='|' read -r what time how <<<"$r"; printf '%-20s %7s  %s\n' "$what" "$time" "$how"; done
