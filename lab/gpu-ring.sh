#!/usr/bin/env bash
# lab/gpu-ring.sh: ring attention (context parallelism over NCCL, pytorch/ring_attention.py) on
# one host with 2 GPUs, in one run from the repository root: builds the PyTorch op, runs
# pytorch/test_ring.py (CPU checks of the schedule, the one-GPU test that the kernels accept an O
# and L they did not produce, the 2-GPU cases against one GPU and float64), the example model
# on 2 GPUs against one GPU (torchrun), and lab/cp-bench.py (ours on 2 GPUs vs 1 GPU vs PyTorch's
# context_parallel over SDPA, flash and cuDNN; N = 64k and 128k, fp16 and bf16, causal, d = 128).
# Every step is bounded by `timeout` (470 s in all at worst; about 4-6 minutes expected: the
# build 1.5-2.5, the tests 0.5-1, the example 0.5, the bench 1.5-2); logs under $OUT (or
# lab/gpu-ring-out/); the last lines printed are a compact summary and the bench's table.
#   OUT=/some/dir bash lab/gpu-ring.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-lab/gpu-ring-out}
mkdir -p "$OUT"
export MAX_JOBS=${MAX_JOBS:-32}   # torch.utils.cpp_extension's ninja: the machine's cores
status=()
step() {   # step NAME SECONDS COMMAND...: runs it under timeout, its output in $OUT/NAME.log
    local name=$1 secs=$2
    shift 2
    local t0=$SECONDS
    timeout --kill-after=10 "$secs" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local what="ok"
    [ $rc -eq 124 ] && what="TIMED OUT after ${secs}s"
    [ $rc -ne 0 ] && [ $rc -ne 124 ] && what="FAILED (exit $rc)"
    status+=("$(printf '%-10s %-22s %4ds  (%s)' "$name" "$what" $((SECONDS - t0)) \
        "$OUT/$name.log")")
    return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
echo "GPUs: $(tr '\n' ';' < "$OUT/gpu.txt")"
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
'GPUs', torch.cuda.device_count(), 'NCCL', torch.distributed.is_nccl_available())" \
    > "$OUT/torch.txt" 2>&1
cat "$OUT/torch.txt"

echo "building the PyTorch op (python3 pytorch/flash_torch.py) ..."
step build 150 python3 pytorch/flash_torch.py
build_rc=$?
if [ $build_rc -eq 0 ]; then
    echo "pytest pytorch/test_ring.py ..."
    step pytest 120 python3 -m pytest pytorch/test_ring.py -q
    echo "example: torchrun --nproc-per-node 2 pytorch/example_ring.py ..."
    step example 60 torchrun --nproc-per-node 2 pytorch/example_ring.py --steps 100
    echo "bench: torchrun --nproc-per-node 2 lab/cp-bench.py ..."
    step bench 140 torchrun --nproc-per-node 2 lab/cp-bench.py --csv "$OUT/cp-bench.csv"
fi

echo
echo "== summary (logs in $OUT) =="
for line in "${status[@]}"; do echo "$line"; done
[ $build_rc -ne 0 ] && tail -20 "$OUT/build.log"
if [ -f "$OUT/pytest.log" ]; then
    echo "-- pytest: failures, skips, the count --"
    grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/pytest.log" | cut -c1-300 | head -12
    tail -1 "$OUT/pytest.log"
fi
if [ -f "$OUT/example.log" ]; then
    echo "-- example: the loss each 10 steps, the gaps --"
    grep -E "^(device|step| +[0-9]+ |largest)" "$OUT/example.log" | head -16
    grep -E "Error|error" "$OUT/example.log" | head -3
fi
if [ -f "$OUT/bench.log" ]; then
    echo "-- bench --"
    grep -vE "^(W|I)[0-9]{4}|^\*+|OMP_NUM_THREADS|^ *warnings.warn|Warning" "$OUT/bench.log" | tail -16
fi
