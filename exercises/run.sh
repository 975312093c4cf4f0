#!/usr/bin/env bash
# exercises/run.sh [ID ... | --stale]: runs the breakage exercises of NOTES.md on this machine's
# GPU and writes each one's log, exercises/ID.log, which NOTES.md quotes and `make check` checks.
# Run from anywhere in the tree, on a machine with an NVIDIA GPU (compute-sanitizer for the
# exercises whose command uses it). With no ID, every exercises/*.patch; with --stale, those whose
# log is not current with its sources (below; --stale --list: only name them). Environment:
# CPPFLAGS (where Catch2 is, as for make: e.g. CPPFLAGS=-I.deps/include), ARCH, JOBS.
#
# An exercise is ID.patch: '#' lines (the header), then a diff that `git apply` takes:
#   # exercise ID: TITLE
#   # command: COMMAND            run from the root of the patched copy, e.g. ./test_flash "[hopper]"
#   # timeout: SECONDS            (optional; default 240)
#   # edit: ...                   the edit in words, so that it can be made again by hand
# The tree is copied once and built (test_flash); each patch gets its own copy of that build, so
# that only the files it edits are compiled again, all copies at once. Then the commands run one
# after another (the GPU to itself), each under `timeout` as a last resort: the test binary's own
# deadline is what should stop a hang. Each log: a header of '# ' lines; the table of every test
# case the command selected, one '| ' line each: PASS or FAIL, the test case, its first failure
# (the test binary writes it where FLASH_TEST_TABLE says); then the command's output (its first
# 300 and last 60 lines, saying how many were cut between).
#
# The sources sha1 in the header is what tells `make check` that a log is still current. It is
# the sha1 of the output of `sha1sum FILE...` (one line "HASH  PATH" per file, paths relative to
# the root, sorted bytewise) over: the patch, the files it edits (as they are before it), and the
# tests (test_flash.cpp, tests/*.cpp and tests/*.h but tests/test_docs.cpp). tests/test_docs.cpp
# recomputes it the same way.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root=$PWD
export PATH="$PATH:/usr/local/cuda/bin"
[ -f /usr/include/catch2/catch.hpp ] || export CPPFLAGS="${CPPFLAGS:--I.deps/include}"
jobs=${JOBS:-$(nproc)}
head_lines=300 tail_lines=60

# sources ID: the files the log of exercise ID depends on, one a line, sorted.
sources() {
    {
        echo "exercises/$1.patch"
        sed -n 's|^diff --git a/\([^ ]*\) b/.*|\1|p' "exercises/$1.patch"
        echo test_flash.cpp
        ls tests/*.cpp tests/*.h | grep -vx tests/test_docs.cpp
    } | LC_ALL=C sort -u
}
# sources_sha1 ID: the sha1 that exercise ID's log header must carry to be current.
sources_sha1() { sources "$1" | while read -r f; do sha1sum "$f"; done | sha1sum | cut -c1-40; }
# header_field ID NAME: the value of the patch header's "# NAME: " line.
header_field() { sed -n "s/^# $2: //p" "exercises/$1.patch" | head -n 1; }

all=($(ls exercises/*.patch | sed 's|.*/||; s|\.patch$||' | sort -t. -k1,1n -k2,2n))
if [ "${1:-}" = --stale ]; then
    ids=()
    for id in "${all[@]}"; do
        grep -qx "# sources sha1: $(sources_sha1 "$id")" "exercises/$id.log" 2>/dev/null ||
            ids+=("$id")
    done
    [ "${2:-}" = --list ] && { echo "${ids[*]}"; exit 0; }
    [ ${#ids[@]} -gt 0 ] || { echo "every exercise log is current"; exit 0; }
elif [ $# -gt 0 ]; then ids=("$@")
else ids=("${all[@]}"); fi
for id in "${ids[@]}"; do
    [ -f "exercises/$id.patch" ] || { echo "no exercises/$id.patch" >&2; exit 2; }
done

work=$(mktemp -d "${TMPDIR:-/tmp}/exercises.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
t0=$SECONDS
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
[ -n "$gpu" ] || gpu="none found (nvidia-smi failed)"

# The tree as it is (tracked files and untracked ones git does not ignore), built once.
echo "== building the tree in $work/base"
mkdir -p "$work/base"
git ls-files -z -co --exclude-standard | while IFS= read -r -d '' f; do
    case "$f" in lab/data/*|exercises/*.log) continue ;; esac
    [ -f "$f" ] && cp -p --parents "$f" "$work/base"/
done
[ -d .deps ] && cp -a .deps "$work/base"/
# A build already made here is reused: its objects, newer than the sources (cp -p), are current.
[ -d build ] && cp -a build "$work/base"/ && { [ -f test_flash ] && cp -p test_flash "$work/base"/; }
(cd "$work/base" && make -j"$jobs" test_flash ${ARCH:+ARCH=$ARCH}) >"$work/base.log" 2>&1 ||
    { tail -n 30 "$work/base.log"; echo "the unpatched tree does not build" >&2; exit 1; }

# One copy per exercise, patched, all built at once (each compiles only what its patch edits).
echo "== building ${#ids[@]} patched copies"
for id in "${ids[@]}"; do
    cp -a "$work/base" "$work/$id"
    if ! (cd "$work/$id" && git apply "$root/exercises/$id.patch") >"$work/$id.build" 2>&1; then
        echo "does not apply" >>"$work/$id.build"
        continue
    fi
    (cd "$work/$id" && make -j"$jobs" test_flash ${ARCH:+ARCH=$ARCH} && touch "$work/$id.built") \
        >>"$work/$id.build" 2>&1 &
done
wait

# The commands, one after another.
failed=()
for id in "${ids[@]}"; do
    cmd=$(header_field "$id" command)
    limit=$(header_field "$id" timeout)
    limit=${limit:-240}
    if [ ! -f "$work/$id.built" ]; then
        echo "== $id: not built (no log written):"; tail -n 20 "$work/$id.build"
        failed+=("$id")
        continue
    fi
    echo "== $id: $cmd"
    start=$SECONDS
    rm -f "$work/$id.table"
    (cd "$work/$id" && FLASH_TEST_TABLE="$work/$id.table" timeout -k 10 "$limit" bash -c "$cmd") \
        >"$work/$id.out" 2>&1
    rc=$?
    secs=$((SECONDS - start))
    total=$(wc -l <"$work/$id.out")
    sum=$(sources_sha1 "$id")
    {
        echo "# exercise $id: $(sed -n 's/^# exercise [^:]*: //p' "exercises/$id.patch" | head -n 1)"
        echo "# patch: exercises/$id.patch"
        echo "# command: $cmd"
        echo "# gpu: $gpu"
        echo "# exit status: $rc after $secs s (time limit $limit s; 124 or 137: the limit ended it)"
        echo "# sources sha1: $sum"
        sources "$id" | while read -r f; do echo "# source: $(sha1sum "$f")"; done
        echo "# table: every test case the command selected: PASS or FAIL | test case | first failure"
        [ -f "$work/$id.table" ] && sed 's/^/| /' "$work/$id.table"
        if [ "$total" -le $((head_lines + tail_lines)) ]; then
            cat "$work/$id.out"
        else
            head -n "$head_lines" "$work/$id.out"
            echo "[... $((total - head_lines - tail_lines)) of $total lines cut here ...]"
            tail -n "$tail_lines" "$work/$id.out"
        fi
    } >"exercises/$id.log"
    summary=$(grep -E '^(test cases:|All tests passed)' "$work/$id.out" | tail -n 1)
    echo "   exit $rc, $secs s: ${summary:-no Catch2 summary}"
done
echo "== $((SECONDS - t0)) s on $gpu; logs in exercises/"
[ ${#failed[@]} = 0 ] || { echo "not run (did not apply or build): ${failed[*]}" >&2; exit 1; }
