#!/usr/bin/env bash
# lab/gpu-issue45.sh OUT: every performance floor of issue 45 (chapter 5) on this tree, in one
# device call (about 7 minutes on an H200, an estimate), so that they are read from one run:
#   options  lab/power-states.cu --options ROUNDS (default 5): softcap, ALiBi and a scale against
#            plain, the window against dense causal, cold and hot (floors: 0.90 each);
#   varlen   lab/varlen-bench.cu: 64k packed tokens against dense N = 4096 (0.90) and padded (2x);
#   strides  lab/layout-bench.py: the client's shape on a fused projection's views (no copy
#            kernel, at most SDPA's flash backend's time);
#   masks    lab/mask-bench.py: the window against FlexAttention and SDPA with a boolean mask.
# The PyTorch op builds (pytorch/flash_torch.py, cached in pytorch/.torch_build) while make
# builds the library. Logs in OUT/issue45-logs.tgz; the options' table last: per case and state,
# the pairs' range and median, and the run's summed TFLOP/s over the base's. Catch2 is not
# needed. The tests are not run: run `make test` first where the kernels changed.
set -uo pipefail
out=${1:?usage: lab/gpu-issue45.sh OUT}
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
mkdir -p "$out"
rows=()
objs="build/flash.o build/flash_fp16.o build/backward_passes.o build/flash_decode.o"
objs="$objs build/checks.o build/dispatch.o build/flash_hopper.o build/flash_hopper_backward.o"
objs="$objs build/flash_hopper_fp8.o"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader >"$out/gpu.txt"
(python3 pytorch/flash_torch.py >"$out/torch-build.log" 2>&1) &
torch=$!
t0=$SECONDS
make -j"$(nproc)" $objs >"$out/build.log" 2>&1 &&
    nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/power-states.cu $objs -o power_states \
        >>"$out/build.log" 2>&1 &&
    nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/varlen-bench.cu $objs -o varlen_bench \
        >>"$out/build.log" 2>&1
rc=$?
wait $torch
rows+=("build|$((SECONDS - t0)) s|exit $rc, the PyTorch op's build: exit $?")
[ $rc = 0 ] || { tail -n 20 "$out/build.log"; exit 1; }

t0=$SECONDS; ./power_states --options "${ROUNDS:-5}" >"$out/options.txt" 2>&1; rc=$?
rows+=("options (power states)|$((SECONDS - t0)) s|exit $rc")
t0=$SECONDS; ./varlen_bench >"$out/varlen-bench.csv" 2>&1; rc=$?
rows+=("varlen bench|$((SECONDS - t0)) s|exit $rc")
t0=$SECONDS
timeout 200 python3 lab/layout-bench.py --csv "$out/layout-bench.csv" >"$out/layout-bench.txt" 2>&1
rows+=("layout bench|$((SECONDS - t0)) s|exit $?")
t0=$SECONDS
timeout 300 python3 lab/mask-bench.py --csv "$out/mask-bench.csv" >"$out/mask-bench.txt" 2>&1
rows+=("mask bench|$((SECONDS - t0)) s|exit $?")

echo "== $(head -n 1 "$out/gpu.txt")"
printf '%s\n' "${rows[@]}"
echo "== varlen (lab/varlen-bench.cu)"; cat "$out/varlen-bench.csv"
echo "== strides (lab/layout-bench.py)"; tail -n 12 "$out/layout-bench.txt"
echo "== masks (lab/mask-bench.py)"; tail -n 14 "$out/mask-bench.txt"
# The options: each line "case1 pass d D N N causal C cold ms TFLOP/s ... hot ms TFLOP/s ...";
# f+b is both passes' flops over both passes' time (the backward 2.5 times the forward's flops).
echo "== options, f+b over the base in the same round and state: pairs min-max (median), sum"
grep -v '^#' "$out/options.txt" | awk '
NF >= 16 && ($2 == "fwd" || $2 == "bwd") {
    r = substr($1, length($1)); c = substr($1, 1, length($1) - 1)
    t["cold", c, $2, r] = $11; t["hot", c, $2, r] = $16; if (r > R) R = r }
function fb(s, c, r) { return 3.5 / (1 / t[s, c, "fwd", r] + 2.5 / t[s, c, "bwd", r]) }
END {
    split("softcap alibi scale window", cs, " ")
    for (ci = 1; ci <= 4; ci++) for (si = 1; si <= 2; si++) {
        c = cs[ci]; s = si == 1 ? "cold" : "hot"; b = c == "window" ? "dense" : "plain"
        n = 0; sum = 0; bsum = 0
        for (r = 1; r <= R; r++) {
            x[++n] = fb(s, c, r) / fb(s, b, r); sum += fb(s, c, r); bsum += fb(s, b, r)
        }
        for (i = 1; i <= n; i++)
            for (j = i + 1; j <= n; j++) if (x[j] < x[i]) { y = x[i]; x[i] = x[j]; x[j] = y }
        printf "%-8s %-4s %.3f-%.3f (%.3f), sum %.3f\n", c, s, x[1], x[n],
               (x[int((n + 1) / 2)] + x[int(n / 2) + 1]) / 2, sum / bsum
    }
}'
# One archive: the device returns a few files a call.
(cd "$out" && tar czf issue45-logs.tgz --remove-files gpu.txt torch-build.log build.log \
    options.txt varlen-bench.csv layout-bench.* mask-bench.* 2>/dev/null)
