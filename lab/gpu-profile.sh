#!/usr/bin/env bash
# lab/gpu-profile.sh: Nsight Compute on the two kernels whose speed is still short of its aim, for
# the "measure first" step before changing them (an H100 or H200; about 4 minutes):
#   - chapter 3's backward (flash_backward_hopper_kernel), fp16, d = 128, N = 8192, causal and not,
#     and d = 256, N = 4096: tensor-pipe use, shared memory, occupancy, where the warps stall,
#     line by line (-lineinfo is in the build);
#   - the decode at batch 1 (flash_decode_split_kernel and the combine), fp16, d = 128, 32 query
#     heads over 8 K/V heads, 8k and 32k keys: memory throughput, bytes in flight, stalls by line;
#     then, time only, the decode against the number of splits (NOTES section 21, exercise 4).
# Run from the repository root:  OUT=/some/dir bash lab/gpu-profile.sh   (logs under $OUT or lab/out)
# First run on an H200: lab/data/hopper-backward-ncu-h200.txt (the backward), lab/chapter4.md (the decode).
# Each ncu report is also kept as text: its details page (a few lines printed) and its source page (CSV:
# cuda,sass, a row an instruction under its source line, with the stall samples and shared-memory wavefronts; with
# cuda alone, the ncu of this device's image printed the source lines and no metrics).
set -u
OUT=${OUT:-lab/out}
mkdir -p "$OUT"
export PATH="$PATH:/usr/local/cuda/bin"
NCU="ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section Occupancy --section LaunchStats --section WarpStateStats --section SourceCounters"

timeout 300 make -j"$(nproc)" flash_bench flash_decode_bench CPPFLAGS=-I.deps/include \
    >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }

# profile NAME KERNEL_REGEX SKIP COUNT COMMAND...: one report, its details and its hottest lines.
profile() {
    local name=$1 kernel=$2 skip=$3 count=$4
    shift 4
    timeout 240 $NCU -k "regex:$kernel" -s "$skip" -c "$count" -f -o "$OUT/$name" "$@" \
        >"$OUT/$name.run.log" 2>&1
    echo "== $name: ncu exit $?"
    ncu --import "$OUT/$name.ncu-rep" --page details >"$OUT/$name.details.txt" 2>&1
    grep -E "Pipe|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|No Eligible|Tensor|Block Limit|Shared|Bank" \
        "$OUT/$name.details.txt" | head -40
    ncu --import "$OUT/$name.ncu-rep" --page source --csv --print-source cuda,sass \
        >"$OUT/$name.source.csv" 2>/dev/null
}

for c in 0 1; do  # skip 12: the demo's tiny unlisted row (11 calls) and a warm-up
    profile "bwd-d128-c$c" flash_backward_hopper_kernel 12 1 \
        ./flash_bench --dtype fp16 --dim 128 --heads 16 --batch 2 --seq 8192 --causal $c \
        --no-standard --repeat 10
done
# d = 256, where dQ's staging costs about half the time (lab/chapter3-backward.md, step 5): its
# shared memory (the Memory Workload Analysis section's shared-memory rows: use, wavefronts, bank
# conflicts) against d = 128's above.
profile "bwd-d256-c0" flash_backward_hopper_kernel 12 1 \
    ./flash_bench --dtype fp16 --dim 256 --heads 8 --batch 4 --seq 4096 --causal 0 \
    --no-standard --repeat 10
for n in 8192 32768; do
    profile "decode-b1-$n" "flash_decode_(split|combine)" 6 2 \
        ./flash_decode_bench --batch 1 --kv-len $n
done

echo "== decode, batch 1, time against splits (flash_decode_bench --splits)"
for n in 8192 32768; do
    for s in 8 16 32 64 128 256; do
        timeout 60 ./flash_decode_bench --batch 1 --kv-len $n --splits $s 2>&1 | tail -1
    done
done | tee "$OUT/decode-splits.txt"
cd "$OUT" && tar czf profile.tgz ./*.txt ./*.csv ./*.log ./*.ncu-rep 2>/dev/null
