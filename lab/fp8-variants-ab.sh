#!/usr/bin/env bash
# lab/fp8-variants-ab.sh OUT [NAME=SOURCE ...]: the fp8 forward's prepared variants
# (lab/chapter3.md, "Next" of the fp8 part) timed against flash_hopper_fp8.cu as it is, in one
# process (lab/fp8-ab.cu through lab/hopper-ab.sh), on a GPU with sm_90a:
#   base   the file as it is
#   e8, e4, e2 one exponential of P~ in 8, 4 or 2 on the FMA pipe (exp2_at of lib/log2_units.h,
#          put in place of the loop's exp2_ftz by sed; lab/chapter3.md, "2^x on the FMA pipe in
#          the fp8 forward")
#   tree   lab/patches/fp8-tree-reductions.patch: a row's max and sum in four chains
#   skip   lab/patches/fp8-rescale-skip.patch: O's rescale skipped when no max of the warp moved
# and each NAME=SOURCE after OUT, one more version of flash_hopper_fp8.cu (e.g. another tree's),
# copied to the scratch folder first so that it is built against this tree's headers.
# tree and skip are made from their patches' hunks for flash_hopper_fp8.cu in a scratch folder;
# the tree is not changed. A variant whose patch no longer applies to the file (both today: the
# kernel has changed around them) is skipped with a line saying so.
# With SOURCES_ONLY=1 it writes the variants' sources to OUT and stops (no GPU needed: to read
# them, or compile them with lab/ptxas-spills.sh).
# Needs build/checks.o (made here if missing: CPPFLAGS as for make). ROUNDS (default 3). Logs
# under OUT; the table last (TFLOP/s; max|dO| against base).
set -euo pipefail
out=${1:?usage: lab/fp8-variants-ab.sh OUT}
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# hunks PATCH FILE...: PATCH's diffs of those files only (its '#' header and other files dropped)
hunks() {
    local patch=$1; shift
    awk -v want=" $* " '/^diff --git /{keep = index(want, " " substr($3, 3) " ") > 0} keep' \
        "lab/patches/$patch"
}
# variant NAME PATCH [DEFINE]: flash_hopper_fp8.cu with PATCH's hunks, as $tmp/NAME.cu, named in
# $tmp/list; skipped, with a line saying so, where the hunks no longer apply to the file (the
# kernel has moved on since the patch was made).
variant() {
    local name=$1 patch=$2 define=${3:-}
    mkdir -p "$tmp/$name"
    cp flash_hopper_fp8.cu "$tmp/$name/"
    if ! hunks "$patch" flash_hopper_fp8.cu | patch -s -p1 -d "$tmp/$name" >/dev/null 2>&1; then
        echo "$name: lab/patches/$patch no longer applies to flash_hopper_fp8.cu (skipped)"
        return 0
    fi
    # what the patch adds to lib/log2_units.h, after the file's last include
    hunks "$patch" lib/log2_units.h | sed -n 's/^+\([^+]\|$\)/\1/p' >"$tmp/$name/helpers.h"
    awk -v h="$tmp/$name/helpers.h" '{print} /^#include "mask_policy.cuh"/ {
        while ((getline line < h) > 0) print line }' "$tmp/$name/flash_hopper_fp8.cu" \
        >"$tmp/$name.cu"
    [ -z "$define" ] || sed -i "1i #define $define" "$tmp/$name.cu"
    echo "$name=$tmp/$name.cu" >>"$tmp/list"
}
# exp_every NAME EVERY: the file with every EVERY-th exponential of P~ on the FMA pipe
exp_every() {
    sed "s/p\[e\] = exp2_ftz(fmaf(s, scale, offset\[a % 2\]));/p[e] = exp2_at<$2>(fmaf(s, scale, offset[a % 2]), 4 * a + e);/" \
        flash_hopper_fp8.cu >"$tmp/$1.cu"
    if cmp -s flash_hopper_fp8.cu "$tmp/$1.cu"; then
        echo "$1: the loop's exp2_ftz line was not found (skipped)"
    else
        echo "$1=$tmp/$1.cu" >>"$tmp/list"
    fi
}
exp_every e8 8
exp_every e4 4
exp_every e2 2
variant tree fp8-tree-reductions.patch
variant skip fp8-rescale-skip.patch
extra=()
[ -f "$tmp/list" ] && mapfile -t extra <"$tmp/list"
for arg in "${@:2}"; do
    n=${arg%%=*}
    cp "${arg#*=}" "$tmp/x-$n.cu" && extra+=("$n=$tmp/x-$n.cu")
done
[ "${SOURCES_ONLY:-0}" = 1 ] && { cp "$tmp"/*.cu "$out"/; exit 0; }
[ -f build/checks.o ] || make build/checks.o ARCH=sm_90 >"$out/checks-build.log" 2>&1
t0=$SECONDS
AB_KIND=fp8 lab/hopper-ab.sh base=flash_hopper_fp8.cu "${extra[@]}" >"$out/build.log" 2>&1 ||
    { tail -n 30 "$out/build.log"; exit 1; }
echo "built $((1 + ${#extra[@]})) variants in $((SECONDS - t0)) s"
./fp8_ab "${ROUNDS:-3}" | tee "$out/fp8-variants.txt"
