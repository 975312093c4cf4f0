#!/usr/bin/env bash
# lab/options-ab.sh OUT BASE [NAME=TREE ...]: chapter 5's options (lab/options-bench.cu) in several
# trees, timed in turns, for an A/B of one change at a time (lab/chapter5.md). BASE: the tree
# before the change (e.g. from `git archive`), "base", or "none" for this tree alone; this tree,
# "new"; each NAME=TREE one more variant. All the trees' libraries are built at once. ROUNDS
# (default 2) rounds, each running every tree in that order. With NCU=1, Nsight Compute on this
# tree's chapter 3 kernels for the bench's cases NCU_CASES names (default "plain softcap alibi":
# N = 4096, d = 128, causal; also "dense" and "window", the N = 32k pair): the pipes' use (XU,
# FMA, ALU), the issue slots, and with NCU_STALLS=1 where the warps wait (WarpStateStats). With
# SUITE=1, this tree's default suite. Logs under OUT; a short table last: each case's ms forward
# and backward, tree after tree.
set -uo pipefail
out=${1:?usage: lab/options-ab.sh OUT BASE [NAME=TREE ...]}
base=${2:?usage: lab/options-ab.sh OUT BASE [NAME=TREE ...]}
shift 2
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
mkdir -p "$out"
names=(base new) dirs=("$base" .)
[ "$base" = none ] && names=(new) dirs=(.)  # BASE "none": this tree alone (e.g. NCU=1 only)
for arg in "$@"; do names+=("${arg%%=*}") dirs+=("${arg#*=}"); done
objs="build/flash.o build/flash_fp16.o build/backward_passes.o build/flash_decode.o build/checks.o"
objs="$objs build/dispatch.o build/flash_hopper.o build/flash_hopper_backward.o"
objs="$objs build/flash_hopper_fp8.o"
bench() {  # bench DIR: the options bench against DIR's library
    (cd "$1" && make -j16 $objs && nvcc -O3 -std=c++17 -arch=native -I. -Ilib \
        lab/options-bench.cu $objs -o options_bench)
}
t0=$SECONDS
for k in "${!names[@]}"; do bench "${dirs[$k]}" >"$out/build-${names[$k]}.log" 2>&1 & done
[ "${SUITE:-0}" = 1 ] && make -j16 test_flash >"$out/build-suite.log" 2>&1
wait
echo "built ${#names[@]} trees in $((SECONDS - t0)) s"
for k in "${!names[@]}"; do
    [ -x "${dirs[$k]}/options_bench" ] || { tail -20 "$out/build-${names[$k]}.log"; exit 1; }
done
for round in $(seq 1 "${ROUNDS:-2}"); do
    for k in "${!names[@]}"; do
        "${dirs[$k]}/options_bench" >"$out/${names[$k]}-$round.csv" 2>&1
    done
done
if [ "${NCU:-0}" = 1 ]; then
    # One launch of each kernel (the third: past the warm-ups), for the plain, softcap 30 and ALiBi
    # rows of lab/options-bench.cu's second block (run alone with OPTIONS_BENCH_ONLY).
    m=gpu__time_duration.sum,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active
    m=$m,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
    m=$m,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active
    m=$m,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active
    m=$m,sm__issue_active.avg.pct_of_peak_sustained_active,sm__inst_executed.sum
    m=$m,sm__inst_executed_pipe_xu.sum,launch__registers_per_thread
    # NCU_STALLS=1: also each report (.ncu-rep) and its source page as CSV, cuda,sass (a row an
    # instruction under its source line, with its warp-state samples: where the warps wait). The
    # WarpStateStats section alone prints only the cycles between issues, not their reasons.
    sections=""
    [ "${NCU_STALLS:-0}" = 1 ] && sections="--section WarpStateStats --section SourceCounters"
    for only in ${NCU_CASES:-plain softcap alibi}; do
        for k in forward backward; do
            rep=(); [ -n "$sections" ] && rep=(-f -o "$out/ncu-$only-$k")
            OPTIONS_BENCH_ONLY=$only timeout 120 ncu --clock-control none \
                -k "regex:flash_${k}_hopper_kernel" -s 2 -c 1 --metrics "$m" $sections \
                "${rep[@]}" \
                ./options_bench >"$out/ncu-$only-$k.txt" 2>&1
            echo "== ncu $only $k: exit $?"
            if [ -n "$sections" ]; then
                r="$out/ncu-$only-$k"
                ncu --import "$r.ncu-rep" --page details >>"$r.txt" 2>&1
                ncu --import "$r.ncu-rep" --page source --csv --print-source cuda,sass \
                    >"$r.source.csv" 2>/dev/null
            fi
            grep -E "flash_${k}|gpu__|sm__|launch__|[Ss]tall|Warp Cycles" "$out/ncu-$only-$k.txt" |
                sed 's/  */ /g' | cut -c1-110
        done
    done
fi
if [ "${SUITE:-0}" = 1 ]; then
    t0=$SECONDS; ./test_flash >"$out/default.log" 2>&1; rc=$?
    echo "default suite: exit $rc in $((SECONDS - t0)) s: $(tail -n 1 "$out/default.log")"
    grep -E "FAILED|failed" -A3 "$out/default.log" | head -30
fi
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)"
echo "trees: ${names[*]}"
for round in $(seq 1 "${ROUNDS:-2}"); do  # each case: ms forward and backward, tree after tree
    files=(); for n in "${names[@]}"; do files+=("$out/$n-$round.csv"); done
    paste -d, "${files[@]}" | awk -F, -v r="$round" -v n="${#names[@]}" '
        $1 ~ /case/ {next}
        NF == 8 * n {printf "r%s %-13s %-7s fwd", r, $1, $2;
            for (k = 0; k < n; k++) printf " %s", $(8 * k + 5);
            printf "  bwd"; for (k = 0; k < n; k++) printf " %s", $(8 * k + 6); print ""}
        NF == 6 * n {printf "r%s %-20s us", r, $1;
            for (k = 0; k < n; k++) printf " %s", $(6 * k + 5); print ""}'
done
