#!/usr/bin/env bash
# lab/gpu-ncu-vs-cudnn.sh OUT: chapter 3's fp16 forward and backward beside SDPA's cuDNN backend
# under Nsight Compute, one launch of each at FlashAttention-2's shape (d = 128, N = 16384 and
# d = 256, N = 4096, not causal), clocks locked to base by ncu (so both run at one clock): what
# each spends a FLOP in instructions by pipe, shared-memory wavefronts, registers, bytes
# (lab/ncu-compare.py). Issue 47's question: where the per-tile work differs from cuDNN's. About
# 4 minutes on an H200 with the build; the tables last, the reports in OUT/ncu-vs-cudnn.tgz.
set -uo pipefail
out=${1:?usage: lab/gpu-ncu-vs-cudnn.sh OUT} && mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
make -j"$(nproc)" flash_bench >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats
    --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy --section WarpStateStats"
# Counts beside the sections' percentages, those of them this ncu knows (a name it does not know
# would stop every profile).
want="smsp__inst_executed smsp__inst_executed_pipe_xu smsp__inst_executed_pipe_fma
    smsp__inst_executed_pipe_alu smsp__inst_executed_pipe_lsu smsp__inst_executed_pipe_uniform
    smsp__inst_executed_pipe_fmaheavy smsp__inst_executed_pipe_fp16 sm__cycles_elapsed
    l1tex__data_pipe_lsu_wavefronts_mem_shared smsp__sass_inst_executed_op_shared_ld
    smsp__sass_inst_executed_op_shared_st dram__bytes_read dram__bytes_write lts__t_bytes"
known=$(ncu --query-metrics 2>/dev/null | awk '{print $1}')
metrics=$(for m in $want; do grep -qx "$m" <<<"$known" && echo "$m.sum"; done | paste -sd, -)
echo "metrics: $metrics" >"$out/metrics.txt"
[ -n "$metrics" ] && SECTIONS="$SECTIONS --metrics $metrics"
# one NAME REGEX SKIP COMMAND...: one launch profiled, its raw metrics as CSV
one() {
    local name=$1 kernel=$2 skip=$3
    shift 3
    timeout 200 ncu $SECTIONS --target-processes all -k "regex:$kernel" -s "$skip" -c 1 -f \
        -o "$out/$name" "$@" >"$out/$name.run.log" 2>&1 || tail -3 "$out/$name.run.log"
    ncu --import "$out/$name.ncu-rep" --page raw --csv >"$out/$name.csv" 2>/dev/null
}
for dn in "128 16384" "256 4096"; do
    set -- $dn
    d=$1 n=$2 b=$((16384 / $2)) h=$((2048 / $1))
    # skip 12: flash_bench's tiny unlisted row first (11 calls), then a warm-up
    one "ours-fwd-d$d" flash_forward_hopper_kernel 12 ./flash_bench --dtype fp16 --dim "$d" \
        --heads "$h" --batch "$b" --seq "$n" --causal 0 --no-standard --repeat 10
    one "ours-bwd-d$d" flash_backward_hopper_kernel 12 ./flash_bench --dtype fp16 --dim "$d" \
        --heads "$h" --batch "$b" --seq "$n" --causal 0 --no-standard --repeat 10
    one "cudnn-fwd-d$d" "cudnn.*fprop" 2 python3 lab/ncu-cudnn-driver.py "$d" "$n" 0
    one "cudnn-bwd-d$d" "cudnn.*bprop" 1 python3 lab/ncu-cudnn-driver.py "$d" "$n" 0
done
for d in 128 256; do
    n=$((d == 128 ? 16384 : 4096))
    flop=$(python3 -c "print(4 * 16384 * 2048 * $n)")  # 4 batch heads N^2 d, batch N = 16384, heads d = 2048
    for p in fwd bwd; do
        f=$flop; [ $p = bwd ] && f=$(python3 -c "print(2.5 * $flop)")
        echo "== $p, d = $d, N = $n, not causal: A ours, B cuDNN"
        python3 lab/ncu-compare.py "$out/ours-$p-d$d.csv" "$out/cudnn-$p-d$d.csv" "$f"
    done
done | tee "$out/compare.txt"
(cd "$out" && tar czf ncu-vs-cudnn.tgz *.csv *.run.log compare.txt build.log metrics.txt && rm -f *.ncu-rep)
