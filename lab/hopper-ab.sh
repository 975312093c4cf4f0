#!/usr/bin/env bash
# lab/hopper-ab.sh NAME=SOURCE [NAME=SOURCE ...]: builds ./hopper_ab (lab/hopper-ab.cu) with one
# variant of chapter 3 per argument, SOURCE a version of flash_hopper.cu (e.g. from
# `git show COMMIT:flash_hopper.cu > old.cu`), compiled for sm_90a with its exported names
# suffixed by NAME so that all of them link into one binary. Run from the repository root after
# `make build/checks.o ARCH=sm_90`. Extra nvcc flags for every variant: HOPPER_AB_FLAGS.
set -euo pipefail
cd "$(dirname "$0")/.."
objs=() pids=()
{
    for arg in "$@"; do echo "DECL(${arg%%=*})"; done
    printf '#define VARIANT_LIST'
    sep=' '
    for arg in "$@"; do
        n=${arg%%=*}
        printf '%s{"%s", flash_forward_fp16_hopper_%s}' "$sep" "$n" "$n"
        sep=', '
    done
    echo
} > lab/hopper-ab-variants.h
for arg in "$@"; do
    n=${arg%%=*} src=${arg#*=}
    names=(flash_forward_fp16_hopper flash_forward_bf16_hopper flash_forward_hopper_launch
           flash_forward_hopper_kernel hopper_consumers hopper_Br hopper_Bc hopper_stages producer_regs
           consumer_regs registers_fit)
    defs=()
    for s in "${names[@]}"; do defs+=("-D$s=${s}_$n"); done
    nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I. -Ilib "${defs[@]}" \
        ${HOPPER_AB_FLAGS:-} -c "$src" -o "hopper_ab_$n.o" &  # the variants compile at once
    pids+=($!)
    objs+=("hopper_ab_$n.o")
done
for pid in "${pids[@]}"; do wait "$pid"; done  # (set -e: a variant that fails to compile stops it)
nvcc -O3 -std=c++17 -arch=sm_90 -I. -Ilib -Ilab lab/hopper-ab.cu "${objs[@]}" build/checks.o -o hopper_ab
rm -f lab/hopper-ab-variants.h
