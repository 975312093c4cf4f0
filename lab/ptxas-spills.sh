#!/usr/bin/env bash
# lab/ptxas-spills.sh FILE ARCH [PATTERN]: the registers and spills ptxas gives each kernel of FILE
# (a .cu of the tree) for ARCH (sm_80, sm_90, sm_90a), one line a kernel, without a GPU: nvcc
# writes the PTX once, then ptxas compiles the kernels whose mangled names contain PATTERN (grep
# -E; default: every kernel) one at a time. What lab/chapter5.md's spill counts come from, e.g.
#   lab/ptxas-spills.sh flash_fp16.cu sm_90 'forward_fp16_kernel.*Li64ELi128'
# Run from anywhere; about a minute for flash_fp16.cu on two cores.
set -euo pipefail
file=${1:?usage: lab/ptxas-spills.sh FILE ARCH [PATTERN]} arch=${2:?ARCH, e.g. sm_90} pat=${3:-.}
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
ptx=$(mktemp --suffix .ptx)
trap 'rm -f "$ptx"' EXIT
nvcc -I. -Ilib -O3 -std=c++17 -arch="$arch" -ptx "$file" -o "$ptx"
grep -oE '^(\.visible )?\.entry [A-Za-z0-9_]+' "$ptx" | awk '{print $NF}' | grep -E -- "$pat" |
    while read -r k; do
        info=$(ptxas -arch="$arch" -v -e "$k" "$ptx" -o /dev/null 2>&1 |
            grep -oE '[0-9]+ bytes spill stores|[0-9]+ bytes spill loads|Used [0-9]+ registers' |
            paste -sd, -)
        printf '%s: %s\n' "$k" "$info"
    done
