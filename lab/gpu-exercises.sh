#!/usr/bin/env bash
# lab/gpu-exercises.sh OUT [ID ...]: one device call's exercises: exercises/run.sh for the IDs
# (default: --stale, those whose log is not current), then every log it wrote in one archive,
# OUT/exercise-logs.tgz, with its summary in OUT/exercises.txt. The device returns a limited
# number of files, and its next call's copy of the working tree puts this checkout's logs back:
# fetch the logs from the archive (tar xzf OUT/exercise-logs.tgz at the repository's root) before
# anything else. Catch2 from CPPFLAGS (e.g. CPPFLAGS=-I.deps/include), as for make. On a fresh
# H200 all 29 ran in one call, 432 s with their builds (LIMIT=550; 2026-12-01); where a call
# has less left, give the 1.x and 2.x one call and the rest another.
set -uo pipefail
out=${1:?usage: lab/gpu-exercises.sh OUT [ID ...]}
shift
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$out"
ids=("$@")
# A clean build: exercises/run.sh reuses a build it finds when its objects are newer than the
# sources, but the device keeps build/ from an earlier call while the copy of this tree it gets
# has this checkout's older mtimes, so objects built from an earlier call's edits (a probe patch
# applied, then reverted) would look current. KEEP_BUILD=1 keeps it.
[ "${KEEP_BUILD:-0}" = 1 ] || rm -rf build test_flash
[ ${#ids[@]} -gt 0 ] || ids=($(exercises/run.sh --stale --list))
[ ${#ids[@]} -gt 0 ] || { echo "every exercise log is current" | tee "$out/exercises.txt"; exit 0; }
# Under LIMIT seconds (default 500), so that the logs written by then are archived even when the
# device call's own limit (or its time left) is near: a call cut off returns nothing.
timeout -k 5 "${LIMIT:-500}" exercises/run.sh "${ids[@]}" >"$out/exercises.txt" 2>&1
rc=$?
logs=(); for id in "${ids[@]}"; do [ -f "exercises/$id.log" ] && logs+=("exercises/$id.log"); done
tar czf "$out/exercise-logs.tgz" "${logs[@]}"
tail -n $((2 * ${#ids[@]} + 2)) "$out/exercises.txt"
exit $rc
