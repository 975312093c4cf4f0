#!/usr/bin/env bash
# lab/gpu-ncu-decode-vs-cudnn.sh OUT: chapter 4's split kernel and SDPA's cuDNN decode kernel under
# Nsight Compute (lab/chapter4.md, part 10), one launch of each, clocks not locked:
#  1. raw metrics of both at batch 32 x 32k and batch 1 x 128k keys (ours-B-N.csv, cudnn-B-N.csv);
#  2. with SOURCE=1 instead: cuDNN's kernel at batch 1 x 128k with its SASS and each instruction's
#     samples (cudnn-sass.csv), and the kernels of one SDPA cuDNN forward + backward at d = 256,
#     N = 4096 with their times (cudnn-bwd-d256-kernels.csv), then the backward's SASS
#     (cudnn-bwd-d256-sass.csv).
# About a minute on an H200 with flash_decode_bench built; everything in OUT/ncu-decode.tgz.
set -uo pipefail
out=${1:?usage: lab/gpu-ncu-decode-vs-cudnn.sh OUT} && mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
if [ "${SOURCE:-0}" = 1 ]; then
    ncu --clock-control none --section SourceCounters -k regex:cudnn -s 2 -c 1 -f -o "$out/sass" \
        python3 lab/ncu-cudnn-decode-driver.py 1 131072 >"$out/sass.log" 2>&1 || tail -3 "$out/sass.log"
    ncu --import "$out/sass.ncu-rep" --page source --print-source sass --csv \
        >"$out/cudnn-sass.csv" 2>&1
    ncu --clock-control none --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size \
        --csv python3 lab/ncu-cudnn-driver.py 256 4096 0 >"$out/cudnn-bwd-d256-kernels.csv" 2>&1
    ncu --clock-control none --section SourceCounters -k regex:bprop -s 1 -c 1 -f \
        -o "$out/bwd" python3 lab/ncu-cudnn-driver.py 256 4096 0 >"$out/bwd.log" 2>&1
    ncu --import "$out/bwd.ncu-rep" --page source --print-source sass --csv \
        >"$out/cudnn-bwd-d256-sass.csv" 2>&1
    rm -f "$out"/*.ncu-rep
else
    make -j"$(nproc)" flash_decode_bench >"$out/build.log" 2>&1 || { tail "$out/build.log"; exit 1; }
    M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
    M=$M,lts__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum
    M=$M,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__block_size
    M=$M,launch__registers_per_thread,launch__shared_mem_per_block_dynamic
    for bn in "32 32768" "1 131072"; do
        set -- $bn
        ncu --clock-control none --metrics "$M" -k regex:split_kernel -s 2 -c 1 --csv --page raw \
            ./flash_decode_bench --batch "$1" --kv-len "$2" >"$out/ours-$1-$2.csv" 2>&1
        ncu --clock-control none --metrics "$M" -k regex:cudnn -s 2 -c 1 --csv --page raw \
            python3 lab/ncu-cudnn-decode-driver.py "$1" "$2" >"$out/cudnn-$1-$2.csv" 2>&1
    done
fi
tar czf "$out.tgz" -C "$out" . && rm -rf "${out:?}"/* && mv "$out.tgz" "$out/ncu-decode.tgz"
ls -la "$out"
