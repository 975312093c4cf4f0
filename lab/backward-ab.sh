#!/usr/bin/env bash
# lab/backward-ab.sh OUT BASE: this tree's chapter 3 backward (flash_hopper_backward.cu) against
# BASE, another version of that file (e.g. `git show HEAD~1:flash_hopper_backward.cu > .ab/b.cu`),
# in one device call: the tree's whole suite first, then both versions in like power states
# (lab/power-states.cu's protocol, in turns), twice over:
#  1. plain attention, fp16, d = 64, 128 and 256 (lab/power-states-ab.cu -DAB_BACKWARD, which also
#     counts the elements of dQ, dK, dV where the two versions' bits differ);
#  2. issue 45's softcap against plain (lab/power-states.cu --options 1 two), each version's
#     binary in turn, ROUNDS (default 3) rounds.
# Every log in OUT/backward-ab.tgz; the short tables last. About 7 minutes on an H200.
set -uo pipefail
out=${1:?usage: lab/backward-ab.sh OUT BASE} base=${2:?BASE: a version of flash_hopper_backward.cu}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
t0=$SECONDS
objs="build/flash.o build/flash_fp16.o build/backward_passes.o build/flash_decode.o build/checks.o"
objs="$objs build/dispatch.o build/flash_hopper.o build/flash_hopper_fp8.o"
# BASE's object as the Makefile builds the tree's, alongside the tree's build.
nvcc ${CPPFLAGS:-} -I. -Ilib -Itests -Ibench -O3 -std=c++17 -lineinfo -Xcompiler -Wall,-Wextra \
    -gencode=arch=compute_90a,code=sm_90a -c "$base" -o build-base-backward.o \
    >"$out/build-base.log" 2>&1 &
base_pid=$!
make -j"$(nproc)" test_flash $objs build/flash_hopper_backward.o >"$out/build.log" 2>&1 ||
    { tail -20 "$out/build.log"; exit 1; }
wait $base_pid || { tail -20 "$out/build-base.log"; exit 1; }
for v in new base; do
    o=build/flash_hopper_backward.o
    [ $v = base ] && o=build-base-backward.o
    nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/power-states.cu $objs $o \
        -o "power_states_$v" >>"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
done
AB_KIND=bwd AB_DRIVER=lab/power-states-ab.cu lab/hopper-ab.sh main="$base" \
    new=flash_hopper_backward.cu >>"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
echo "built in $((SECONDS - t0)) s"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader |
    tee "$out/gpu.txt"
./test_flash >"$out/suite.txt" 2>&1
echo "suite: $(grep -E 'test cases|All tests' "$out/suite.txt" | tail -1) at $((SECONDS - t0)) s"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader -lms 20 \
    >"$out/smi.csv" 2>&1 &
smi=$!
for d in 128 64 256; do ./power_states_ab 1 $d >"$out/ab$d.txt" 2>&1 || tail -5 "$out/ab$d.txt"; done
echo "plain A/B at $((SECONDS - t0)) s"
for r in $(seq "${ROUNDS:-3}"); do
    for v in base new; do
        ./power_states_$v --options 1 two >"$out/opt-$v$r.txt" 2>&1 || tail -5 "$out/opt-$v$r.txt"
    done
done
kill $smi
echo "options A/B at $((SECONDS - t0)) s"
for d in 128 64 256; do
    grep '^# bits' "$out/ab$d.txt"
    python3 lab/power-states-table.py --ratio new/main "$out/smi.csv" "$out/ab$d.txt" \
        >"$out/table$d.txt" 2>&1
done
(cd "$out" && tar czf backward-ab.tgz gpu.txt build*.log suite.txt smi.csv ab*.txt opt-*.txt table*.txt)
for d in 128 64 256; do echo "d = $d (new / main, plain backward)"; cat "$out/table$d.txt"; done
# Softcap over plain, each binary, round and state: TFLOP/s of the forward, the backward and
# forward + backward (3.5 / (1 / fwd + 2.5 / bwd), as lab/power-states-table.py counts them).
python3 - "$out" "${ROUNDS:-3}" <<'PY'
import sys
out, rounds = sys.argv[1], int(sys.argv[2])
print("softcap / plain   state  fwd    bwd    f+b   (plain bwd TFLOP/s)")
for r in range(1, rounds + 1):
    for v in ("base", "new"):
        tf = {}
        for line in open(f"{out}/opt-{v}{r}.txt"):
            f = line.split()
            if len(f) > 15 and f[0][:-1] in ("plain", "softcap"):
                tf[f[0][:-1], f[1], "cold"], tf[f[0][:-1], f[1], "hot"] = float(f[10]), float(f[15])
        for st in ("cold", "hot"):
            try:
                fb = {w: 3.5 / (1 / tf[w, "fwd", st] + 2.5 / tf[w, "bwd", st]) for w in ("plain", "softcap")}
                print(f"{v:5} round {r}   {st:5} {tf['softcap', 'fwd', st] / tf['plain', 'fwd', st]:.3f}  "
                      f"{tf['softcap', 'bwd', st] / tf['plain', 'bwd', st]:.3f}  "
                      f"{fb['softcap'] / fb['plain']:.3f}  ({tf['plain', 'bwd', st]:.1f})")
            except KeyError as e:
                print(v, r, st, "missing", e)
PY
