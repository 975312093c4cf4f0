#!/usr/bin/env bash
# lab/forward-ab.sh OUT NAME=SOURCE [NAME=SOURCE ...]: versions of chapter 3's forward
# (flash_hopper.cu, e.g. from `git show COMMIT:flash_hopper.cu`, or with a patch applied) timed
# side by side on a GPU, the first the baseline: lab/hopper-ab.sh's driver (the plain forward,
# FlashAttention-2's shapes, d = 64, 128, 256, ROUNDS rounds, default 3; max|dO| against the
# first) and lab/options-bench.cu against each version's object (plain, softcap 30 and ALiBi at
# N = 4096, d = 128, causal: forward and backward, the versions in turn, ROUNDS rounds; AB_DIM=D
# times only head dim D in the first; AB_OPTIONS=0 skips the second). Run from
# the repository root with the library's other objects buildable (CPPFLAGS for Catch2 not needed).
# Logs under OUT; a short table last. lab/chapter3.md, "The exponentials before the max".
set -uo pipefail
out=${1:?usage: lab/forward-ab.sh OUT NAME=SOURCE [NAME=SOURCE ...]}
shift
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
mkdir -p "$out" .forward-ab
rounds=${ROUNDS:-3}
names=()
for arg in "$@"; do names+=("${arg%%=*}"); cp "${arg#*=}" ".forward-ab/${arg%%=*}.cu" || exit 1; done
objs="build/flash.o build/flash_fp16.o build/backward_passes.o build/flash_decode.o build/checks.o"
objs="$objs build/dispatch.o build/flash_hopper_backward.o build/flash_hopper_fp8.o"
t0=$SECONDS
make -j16 build/checks.o >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
lab/hopper-ab.sh "$@" >"$out/hopper-ab-build.log" 2>&1 &
ab=$!
make -j16 $objs >>"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
# The options bench against each tree's flash_hopper.o (the Makefile's flags for it)
flags="-I. -Ilib -O3 -std=c++17 -lineinfo -gencode=arch=compute_90a,code=sm_90a"
[ "${AB_OPTIONS:-1}" = 0 ] && names_opt=() || names_opt=("${names[@]}")
pids=()
for v in "${names_opt[@]}"; do
    nvcc $flags -c ".forward-ab/$v.cu" -o ".forward-ab/$v.o" >>"$out/build.log" 2>&1 &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || { tail -20 "$out/build.log"; exit 1; }; done
wait $ab || { tail -20 "$out/hopper-ab-build.log"; exit 1; }
for v in "${names_opt[@]}"; do
    nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/options-bench.cu $objs ".forward-ab/$v.o" \
        -o ".forward-ab/options_$v" >>"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
done
echo "built in $((SECONDS - t0)) s"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
./hopper_ab "$rounds" ${AB_DIM:-} >"$out/hopper-ab.txt" 2>&1
for r in $(seq 1 "$rounds"); do
    for v in "${names_opt[@]}"; do
        for c in plain softcap alibi; do
            OPTIONS_BENCH_ONLY=$c ".forward-ab/options_$v" | grep -v '^case' >>"$out/options-$v.csv"
        done
    done
done
cat "$out/hopper-ab.txt"
echo "options bench, public call (chapter 3), ms forward / backward, $rounds rounds:"
for v in "${names_opt[@]}"; do
    for c in plain softcap alibi; do
        printf '%-6s %-8s' "$v" "$c"
        grep "^$c[^,]*,options\|^$c[^,]*,plain" "$out/options-$v.csv" |
            awk -F, '{printf " %s/%s", $5, $6}'
        echo
    done
done
