#!/usr/bin/env bash
# lab/decode-ab.sh OUT VARIANT...: chapter 4's plain decode (flash_decode_bench, batch 1, 8, 32 x
# 8k and 32k keys) with flash_decode.cu replaced by each VARIANT in turn (a file; a variant of
# another tree takes that tree's includes: DIR/flash_decode.cu is compiled with -IDIR -IDIR/lib),
# two rounds, the variants in turns within each. The rest of the library is this tree's, built
# once (make flash_decode_bench); each variant is one object and one link, compiled in parallel.
# DECODE_ARGS: the bench's shapes instead (e.g. "--batch 32 --kv-len 4096,8192"). A VARIANT may
# end in @FLAGS, nvcc flags for that object alone (e.g. flash_decode.cu@-DFLASH_DECODE_STAGES=3).
# BENCH=kvcache: lab/kvcache-bench.cu (the K/V cache's cases) instead of flash_decode_bench. Logs
# under OUT; the bench's table for each round and variant last.
#   lab/decode-ab.sh $OUT/ab .ab-base/flash_decode.cu flash_decode.cu
set -uo pipefail
out=${1:?usage: lab/decode-ab.sh OUT VARIANT...}
shift
cd "$(dirname "$0")/.." || exit 1
export PATH="$PATH:/usr/local/cuda/bin"
mkdir -p "$out"
make -j16 flash_decode_bench >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
objs=$(make -s -p -n flash_decode_bench 2>/dev/null | awk -F' *= *' '/^LIB_OBJS :?=/ {print $2; exit}')
i=0
main=build/decode.o
if [ "${BENCH:-decode}" = kvcache ]; then
    main=$out/kvcache-bench.o
    nvcc -O3 -std=c++17 -arch=native -I. -Ilib -c lab/kvcache-bench.cu -o "$main" \
        >"$out/kvcache-bench.log" 2>&1 &
fi
for v in "$@"; do
    file=${v%%@*} flags=""; [ "$file" = "$v" ] || flags=${v#*@}
    dir=$(dirname "$file")
    nvcc -O3 -std=c++17 -arch=native -lineinfo $flags -I"$dir" -I"$dir/lib" -I. -Ilib \
        -c "$file" -o "$out/v$i.o" >"$out/v$i.log" 2>&1 &
    i=$((i + 1))
done
wait
i=0
for v in "$@"; do
    lib=$(echo "$objs" | sed "s#build/flash_decode.o#$out/v$i.o#")
    nvcc -O3 -std=c++17 -arch=native "$main" $lib -o "$out/bench$i" >>"$out/v$i.log" 2>&1 ||
        { echo "variant $v: build FAILED"; tail -20 "$out/v$i.log"; }
    i=$((i + 1))
done
for round in 1 2; do
    i=0
    for v in "$@"; do
        echo "== round $round, $v"
        if [ "${BENCH:-decode}" = kvcache ]; then
            [ -x "$out/bench$i" ] && timeout 120 "$out/bench$i"
        else
            [ -x "$out/bench$i" ] &&
                timeout 60 "$out/bench$i" ${DECODE_ARGS:---kv-len 8192,32768 --batch 1,8,32} |
                grep -A 99 time_us
        fi
        i=$((i + 1))
    done
done | tee "$out/decode-ab.txt"
