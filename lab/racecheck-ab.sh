#!/usr/bin/env bash
# lab/racecheck-ab.sh OUT FILE NEW [RUNS] [FILTER]: compute-sanitizer on the tree's test_flash and on
# one built with NEW in place of FILE (a chapter 3 kernel file, e.g. flash_hopper.cu), RUNS times
# each (default 5) in turns, so that a tool's hang that comes and goes (lab/chapter3.md, "the idle
# warpgroups of a last Q tile") can be told apart from one the change brings. FILTER: the test cases
# (default the Hopper forward's sanitizer shapes); TOOLS (default racecheck; synccheck, memcheck).
# Each run under the tests' deadline (FLASH_TEST_DEADLINE_SCALE, default 2: 20 s a call, where a
# passing run of the default cases takes about 4 s in all under racecheck on an H200) and
# `timeout` LIMIT seconds (default 45). One line a run; the logs in OUT/racecheck-ab.tgz. About
# 3 minutes from a clean build, 2 more for each run of both that hangs.
set -uo pipefail
out=${1:?usage: lab/racecheck-ab.sh OUT FILE NEW [RUNS] [FILTER]} file=${2:?FILE} new=${3:?NEW}
runs=${4:-5} filter=${5:-Small shapes for the sanitizer: the Hopper forward*}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin" FLASH_TEST_DEADLINE_SCALE=${FLASH_TEST_DEADLINE_SCALE:-2}
t0=$SECONDS
obj=build/${file%.cu}.o
nvcc ${CPPFLAGS:-} -I. -Ilib -Itests -Ibench -O3 -std=c++17 -lineinfo -Xcompiler -Wall,-Wextra \
    -gencode=arch=compute_90a,code=sm_90a -c "$new" -o build-new.o >"$out/build-new.log" 2>&1 &
new_pid=$!
make -j"$(nproc)" test_flash >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
wait $new_pid || { tail -20 "$out/build-new.log"; exit 1; }
libs=$(ls build/flash.o build/flash_fp16.o build/flash_decode.o build/checks.o build/dispatch.o \
    build/backward_passes.o build/flash_hopper.o build/flash_hopper_backward.o \
    build/flash_hopper_fp8.o | sed "s|^$obj\$|build-new.o|")
nvcc -O3 -std=c++17 -arch=native $(ls build/test_*.o | grep -v test_docs) build/spin.o \
    build/reference.o $libs -o test_flash_new >>"$out/build.log" 2>&1 ||
    { tail -20 "$out/build.log"; exit 1; }
echo "built in $((SECONDS - t0)) s"
for tool in ${TOOLS:-racecheck}; do
    for r in $(seq "$runs"); do
        for v in main new; do
            bin=./test_flash; [ $v = new ] && bin=./test_flash_new
            log="$out/$tool-$v$r.txt" s=$SECONDS
            timeout -k 5 "${LIMIT:-45}" compute-sanitizer --tool "$tool" "$bin" "$filter" >"$log" 2>&1
            rc=$?
            printf '%-9s %-4s run %d: rc %3d, %3d s | %s | %s\n' "$tool" "$v" "$r" "$rc" \
                $((SECONDS - s)) "$(grep -E 'All tests|^test cases' "$log" | tail -1)" \
                "$(grep -oE 'on shape \([^)]*\)' "$log" | tail -1)"
        done
    done
done | tee "$out/summary.txt"
(cd "$out" && tar czf racecheck-ab.tgz ./*.txt ./*.log)
