#!/usr/bin/env bash
# The shared backward passes (lib/ordered_add.cuh, flash_backward_passes) and the shorter default
# test run, on an H100 / H200. Two parts, each well under 10 minutes; logs under $OUT (or lab/out).
# Run from the repository root:
#   bash lab/gpu-tidy.sh tests    build; ./test_flash --durations yes (the default run: every test
#                                 of both backwards, chapter 3's through chapter 2's passes now);
#                                 a short backward timing beside lab/data/hopper-backward-h200.csv
#                                 (about 4 minutes)
#   bash lab/gpu-tidy.sh stress   make stress (the shapes moved out of the default run; about 3
#                                 minutes after the first part's build)
# Then, as every test source changed: lab/exercises/run.sh (every exercise's log; CPPFLAGS as below).
set -u
OUT=${OUT:-lab/out}
mkdir -p "$OUT"
part=${1:-tests}
summary=()
step() { summary+=("$1: $2"); echo "== $1: $2"; }
# The slowest test cases of a --durations log ("1.234 s: name"), and the cases' sum by tag group.
slowest() {
    grep -E '^[0-9]+\.[0-9]+ s: ' "$1" | sort -rn | head -n "$2"
    grep -E '^[0-9]+\.[0-9]+ s: ' "$1" | awk '
        { t = $1; n++; all += t }
        /[Dd]ecode/ { d += t } /GQA|MQA/ { g += t } /backward/ { b += t }
        END { printf "sum %.1f s over %d cases; names with decode %.1f s, GQA/MQA %.1f s, backward %.1f s\n", all, n, d, g, b }'
}

timeout 400 make -j16 test_flash flash_bench CPPFLAGS=-I.deps/include >"$OUT/build.log" 2>&1
step build "exit $? ($(grep -c 'C7519.*backward' "$OUT/build.log") injected-fence warnings in the backward)"

if [ "$part" = tests ]; then
    start=$SECONDS
    timeout 420 ./test_flash --durations yes >"$OUT/test-default.log" 2>&1
    step "default run" "exit $?, wall $((SECONDS - start)) s -- $(grep -E '^(All tests passed|test cases:)' "$OUT/test-default.log" | tail -1)"
    grep -B2 -A12 -E 'FAILED|DEADLINE' "$OUT/test-default.log" | head -60
    slowest "$OUT/test-default.log" 25 >"$OUT/slowest-default.txt"

    # The backward after the change beside the H200's row of lab/data/hopper-backward-h200.csv
    # (FA2 protocol at N = 4096: batch 4, 2048 / d heads): chapter 3 (the public call here) and
    # chapter 2 (--chapter2), fp16, d = 64 and 128, causal and not.
    for d in 64 128; do
        for c in 0 1; do
            for ch in "" --chapter2; do
                timeout 60 ./flash_bench --dtype fp16 --dim $d --heads $((2048 / d)) --batch 4 \
                    --seq 4096 --causal $c --no-standard --repeat 10 $ch \
                    >"$OUT/bench-d$d-c$c${ch:+-ch2}.log" 2>&1
                echo "d=$d causal=$c ${ch:-chapter 3}: $(grep ' bwd |' "$OUT/bench-d$d-c$c${ch:+-ch2}.log" | head -1)"
            done
        done
    done >"$OUT/bench-summary.txt"
    step timing "$(wc -l <"$OUT/bench-summary.txt") runs"
else
    start=$SECONDS
    timeout 540 ./test_flash "[stress]" --durations yes >"$OUT/test-stress.log" 2>&1
    step "make stress" "exit $?, wall $((SECONDS - start)) s -- $(grep -E '^(All tests passed|test cases:)' "$OUT/test-stress.log" | tail -1)"
    grep -B2 -A12 -E 'FAILED|DEADLINE' "$OUT/test-stress.log" | head -60
    slowest "$OUT/test-stress.log" 15 >"$OUT/slowest-stress.txt"
fi

echo; echo "=== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $part)"
printf '%s\n' "${summary[@]}"
if [ "$part" = tests ]; then
    echo "--- slowest test cases of the default run"; cat "$OUT/slowest-default.txt"
    echo "--- backward, fp16 (ms, TFLOP/s); lab/data/hopper-backward-h200.csv has N = 4096's rows"
    cat "$OUT/bench-summary.txt"
    grep -E '^(64|128),' lab/data/hopper-backward-h200.csv | grep -E ',4096,' | head -8
else
    echo "--- slowest stress cases"; cat "$OUT/slowest-stress.txt"
fi
