#!/usr/bin/env bash
# lab/gpu-options.sh OUT: one GPU run for chapter 5's options (lab/chapter5.md): the build, the
# options' tests, the default suite, lab/options-bench.cu, then the options' stress grid (as time
# allows). Logs under OUT; a short table last. Catch2 from CPPFLAGS (e.g. CPPFLAGS=-I.deps/include).
set -uo pipefail
out=${1:?usage: lab/gpu-options.sh OUT}
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
mkdir -p "$out"
rows=()
t0=$SECONDS; make test_flash >"$out/build.log" 2>&1; rc=$?
rows+=("build|$((SECONDS - t0)) s|exit $rc")
t0=$SECONDS; ./test_flash "[options]" --durations yes >"$out/options.log" 2>&1; rc=$?
rows+=("[options] tests|$((SECONDS - t0)) s|exit $rc, $(tail -n 1 "$out/options.log")")
t0=$SECONDS; ./test_flash >"$out/default.log" 2>&1; rc=$?
rows+=("default suite|$((SECONDS - t0)) s|exit $rc, $(tail -n 1 "$out/default.log")")
objs="build/flash.o build/flash_fp16.o build/backward_passes.o build/flash_decode.o build/checks.o build/dispatch.o"
[ -f build/flash_hopper.o ] && objs="$objs build/flash_hopper.o build/flash_hopper_backward.o"
t0=$SECONDS
nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/options-bench.cu $objs -o options_bench >"$out/bench.log" 2>&1 &&
    ./options_bench >>"$out/bench.log" 2>&1; rc=$?
rows+=("options bench|$((SECONDS - t0)) s|exit $rc")
t0=$SECONDS; timeout "${STRESS_SECONDS:-150}" ./test_flash "[options][stress]" >"$out/stress.log" 2>&1; rc=$?
rows+=("[options][stress]|$((SECONDS - t0)) s|exit $rc, $(tail -n 1 "$out/stress.log")")
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)"
grep -v "^nvcc\|warning" "$out/bench.log" | column -t -s, | head -n 12
for r in "${rows[@]}"; do IFS='|' read -r what time how <<<"$r"; printf '%-20s %7s  %s\n' "$what" "$time" "$how"; done
