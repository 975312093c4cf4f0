#!/usr/bin/env bash
# lab/uncited-data.sh: the files in lab/data/ and lab/patches/ that no document or script cites,
# one a line, as make check's [data] test (tests/test_docs.cpp) finds them: a citation is the
# file's path from the root written out (lab/data/ or lab/patches/ and the name), in a document at the
# root (*.md, *.cu, *.cpp, *.h, Makefile) or in any file under lab/ (but lab/data/ and
# lab/patches/), bench/, .ci/ or pytorch/ (folders named .* or __pycache__ left out).
#   lab/uncited-data.sh              list them
#   lab/uncited-data.sh | xargs git rm    remove them (git keeps them in its history)
set -euo pipefail
cd "$(dirname "$0")/.."
cited=$(
    {
        find . -maxdepth 1 -type f \( -name '*.md' -o -name '*.cu' -o -name '*.cpp' -o -name '*.h' \
            -o -name Makefile \) -print0
        find lab bench .ci pytorch \( -type d \( -path '*/.*' -o -name __pycache__ \) -prune \) -o \
            \( -type f -not -path 'lab/data/*' -not -path 'lab/patches/*' -print0 \)
    } | xargs -0 grep -ohE 'lab/(data|patches)/[A-Za-z0-9_.+-]*[A-Za-z0-9_+-]' | LC_ALL=C sort -u
)
for f in lab/data/* lab/patches/*; do
    [ -f "$f" ] || continue
    grep -qxF "$f" <<<"$cited" || echo "$f"
done
