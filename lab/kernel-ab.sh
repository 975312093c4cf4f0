#!/usr/bin/env bash
# lab/kernel-ab.sh OUT FILE NEW: a version NEW of one of chapter 3's fp16 kernels (FILE:
# flash_hopper.cu, the forward, or flash_hopper_backward.cu) against the tree's FILE ("main"), in
# one device call:
#  1. the whole suite built with NEW in FILE's place;
#  2. plain attention at d = ${AB_DIMS:-128} (lab/power-states-ab.cu: like power states, the two
#     versions in turns, one round a head dim; for the backward it also counts the elements of dQ,
#     dK, dV whose bits differ between the versions);
#  3. issue 45's softcap against plain (lab/power-states.cu --options 1 two), each version's binary
#     in turn, ROUNDS (default 3) rounds, softcap over plain printed a binary, round and state.
# NEW_FLAGS: nvcc flags for NEW (e.g. -DKNOB=2; the A/B driver passes them to main's object too,
# where a knob main lacks changes nothing). Every log in OUT/kernel-ab.tgz (the only file left
# in OUT); the short tables last. About 5 minutes on an H200 from a clean build.
set -uo pipefail
out=${1:?usage: lab/kernel-ab.sh OUT FILE NEW} file=${2:?FILE} new=${3:?NEW}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
t0=$SECONDS
obj=build/${file%.cu}.o
objs="build/flash.o build/flash_fp16.o build/backward_passes.o build/flash_decode.o build/checks.o"
objs="$objs build/dispatch.o build/flash_hopper.o build/flash_hopper_backward.o"
objs="$objs build/flash_hopper_fp8.o"
# NEW's object as the Makefile builds FILE's, beside the tree's build; the A/B driver's versions.
nvcc ${CPPFLAGS:-} -I. -Ilib -Itests -Ibench -O3 -std=c++17 -lineinfo -Xcompiler -Wall,-Wextra \
    -gencode=arch=compute_90a,code=sm_90a ${NEW_FLAGS:-} -c "$new" -o build-new.o \
    >"$out/build-new.log" 2>&1 &
new_pid=$!
kind=fwd
[ "$file" = flash_hopper_backward.cu ] && kind=bwd
make -j"$(nproc)" test_flash $objs >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
AB_KIND=$kind AB_DRIVER=lab/power-states-ab.cu HOPPER_AB_FLAGS="${NEW_FLAGS:-}" \
    lab/hopper-ab.sh main="$file" new="$new" >>"$out/build.log" 2>&1 &
ab_pid=$!
wait $new_pid || { tail -20 "$out/build-new.log"; exit 1; }
objs_new=${objs/$obj/build-new.o}
nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/power-states.cu $objs -o power_states_main \
    >>"$out/build.log" 2>&1 &&
    nvcc -O3 -std=c++17 -arch=native -I. -Ilib lab/power-states.cu $objs_new -o power_states_new \
        >>"$out/build.log" 2>&1 &&
    nvcc -O3 -std=c++17 -arch=native $(ls build/test_*.o | grep -v test_docs) build/spin.o \
        build/reference.o $objs_new -o test_flash_new >>"$out/build.log" 2>&1 ||
    { tail -20 "$out/build.log"; exit 1; }
wait $ab_pid || { tail -20 "$out/build.log"; exit 1; }
echo "built in $((SECONDS - t0)) s"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader |
    tee "$out/gpu.txt"
./test_flash_new >"$out/suite-new.txt" 2>&1
echo "suite (new): $(grep -E 'test cases|All tests' "$out/suite-new.txt" | tail -1) at $((SECONDS - t0)) s"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader -lms 20 \
    >"$out/smi.csv" 2>&1 &
smi=$!
for d in ${AB_DIMS:-128}; do ./power_states_ab 1 $d >"$out/ab$d.txt" 2>&1 || tail -5 "$out/ab$d.txt"; done
echo "plain A/B at $((SECONDS - t0)) s"
for r in $(seq "${ROUNDS:-3}"); do
    for v in main new; do
        ./power_states_$v --options 1 two >"$out/opt-$v$r.txt" 2>&1 || tail -5 "$out/opt-$v$r.txt"
    done
done
kill $smi
echo "options A/B at $((SECONDS - t0)) s"
for d in ${AB_DIMS:-128}; do
    grep '^# bits' "$out/ab$d.txt"
    python3 lab/power-states-table.py --ratio new/main "$out/smi.csv" "$out/ab$d.txt" \
        >"$out/table$d.txt" 2>&1
done
# Softcap over plain, each binary, round and state: TFLOP/s of the forward, the backward and
# forward + backward (3.5 / (1 / fwd + 2.5 / bwd), as lab/power-states-table.py counts them).
python3 - "$out" "${ROUNDS:-3}" >"$out/softcap.txt" <<'PY'
import sys
out, rounds = sys.argv[1], int(sys.argv[2])
print("softcap / plain   state  fwd    bwd    f+b   (plain fwd, bwd TFLOP/s)")
for r in range(1, rounds + 1):
    for v in ("main", "new"):
        tf = {}
        for line in open(f"{out}/opt-{v}{r}.txt"):
            f = line.split()
            if len(f) > 15 and f[0][:-1] in ("plain", "softcap"):
                tf[f[0][:-1], f[1], "cold"], tf[f[0][:-1], f[1], "hot"] = float(f[10]), float(f[15])
        for st in ("cold", "hot"):
            try:
                fb = {w: 3.5 / (1 / tf[w, "fwd", st] + 2.5 / tf[w, "bwd", st])
                      for w in ("plain", "softcap")}
                print(f"{v:5} round {r}   {st:5} "
                      f"{tf['softcap', 'fwd', st] / tf['plain', 'fwd', st]:.3f}  "
                      f"{tf['softcap', 'bwd', st] / tf['plain', 'bwd', st]:.3f}  "
                      f"{fb['softcap'] / fb['plain']:.3f}  "
                      f"({tf['plain', 'fwd', st]:.1f}, {tf['plain', 'bwd', st]:.1f})")
            except KeyError as e:
                print(v, r, st, "missing", e)
PY
(cd "$out" && tar czf kernel-ab.tgz gpu.txt build*.log suite-new.txt smi.csv ab*.txt opt-*.txt \
    table*.txt softcap.txt)
for d in ${AB_DIMS:-128}; do echo "d = $d (new / main, plain $kind)"; cat "$out/table$d.txt"; done
cat "$out/softcap.txt"
# Only the archive stays in OUT: the device returns a few files a call, and two runs' loose logs
# (OUT1, OUT2 of one call) would crowd out the second archive.
(cd "$out" && find . -maxdepth 1 -type f ! -name kernel-ab.tgz -delete)
