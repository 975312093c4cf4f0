#!/usr/bin/env bash
# Chapter 3's backward on an H100 / H200: build, the backward tests (both chapters), a short timing
# beside PyTorch SDPA's flash and cuDNN backwards. About 4 minutes; logs under $OUT (or lab/out).
# Run from the repository root:  bash lab/gpu-hopper-backward.sh
set -u
OUT=${OUT:-lab/out}
mkdir -p "$OUT"
summary=()
step() { summary+=("$1: $2"); echo "== $1: $2"; }

# 1. Build (ptxas's report of the backward kernel kept: spills, injected fences).
timeout 300 make -j16 test_flash flash_bench CPPFLAGS=-I.deps/include >"$OUT/build.log" 2>&1
step build "exit $?"
timeout 120 nvcc -I. -Ilib -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v \
    -c flash_hopper_backward.cu -o /tmp/fhb.o >"$OUT/ptxas.log" 2>&1
step ptxas "$(grep -c 'C75' "$OUT/ptxas.log") injected-fence warnings; spills: $(grep -o '[0-9]* bytes spill stores' "$OUT/ptxas.log" | sort | uniq -c | tr '\n' ' ')"

# 2. Tests: the backward's (grids, sanitizer shapes, masking, determinism, poisoning, bad input),
# fp16 and bf16, chapter 2 and chapter 3 (Kernel::chapter2() and the public call).
timeout 150 ./test_flash "[backward]" >"$OUT/test-backward.log" 2>&1
step "test [backward]" "exit $? -- $(grep -E '^(All tests passed|test cases:)' "$OUT/test-backward.log" | tail -1)"
grep -B2 -A12 -E 'FAILED|with expansion' "$OUT/test-backward.log" | head -60

# 3. Timing: FA2 protocol (batch * N = 16384, heads = 2048 / d), fp16, the public backward (chapter
# 3 on this GPU), then SDPA's flash and cuDNN backwards.
timeout 150 ./flash_bench --protocol --dtype fp16 --no-standard --csv "$OUT/bench.csv" \
    >"$OUT/bench.log" 2>&1
step flash_bench "exit $?"
timeout 120 python3 lab/sdpa-reference.py --backward --backends flash,cudnn --dims 64,128,256 \
    --seqs 2048,4096,8192,16384 --csv "$OUT/sdpa.csv" >"$OUT/sdpa.log" 2>&1
step sdpa "exit $?"

echo; echo "=== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"
printf '%s\n' "${summary[@]}"
echo "--- ours (flash_bench --protocol, fp16; backward rows)"
grep -i backward "$OUT/bench.csv" 2>/dev/null | head -40 || tail -30 "$OUT/bench.log"
echo "--- SDPA backward"
cat "$OUT/sdpa.csv" 2>/dev/null | head -40 || tail -20 "$OUT/sdpa.log"
