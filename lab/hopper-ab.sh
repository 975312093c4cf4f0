#!/usr/bin/env bash
# lab/hopper-ab.sh NAME=SOURCE [NAME=SOURCE ...]: builds ./hopper_ab (lab/hopper-ab.cu) with one
# variant of chapter 3 per argument, SOURCE a version of flash_hopper.cu (e.g. from
# `git show COMMIT:flash_hopper.cu > old.cu`), compiled for sm_90a with its exported names
# suffixed by NAME so that all of them link into one binary. Run from the repository root after
# `make build/checks.o ARCH=sm_90`. Extra nvcc flags for every variant: HOPPER_AB_FLAGS.
# AB_KIND=fp8: the same for versions of flash_hopper_fp8.cu, into ./fp8_ab (lab/fp8-ab.cu).
# AB_KIND=bwd: versions of flash_hopper_backward.cu, into ./power_states_ab (lab/power-states-ab.cu
# built with -DAB_BACKWARD; also needs `make build/backward_passes.o`). With AB_DRIVER=lab/X-Y.cu,
# that driver instead, into ./X_Y (e.g. lab/fp8-accuracy.cu, either kind).
set -euo pipefail
cd "$(dirname "$0")/.."
extra=() dflags=()
if [ "${AB_KIND:-fp16}" = fp8 ]; then
    call=flash_forward_fp8_hopper driver=${AB_DRIVER:-lab/fp8-ab.cu}
    names=(flash_forward_fp8_hopper flash_forward_fp8_kernel transpose_v flash_fp8_bc
           fp8_vt_blocks centre_v)  # (each variant's own: they differ with its tile)
elif [ "${AB_KIND:-fp16}" = bwd ]; then
    call=flash_backward_fp16_hopper driver=${AB_DRIVER:-lab/power-states-ab.cu}
    names=(flash_backward_fp16_hopper flash_backward_bf16_hopper flash_backward_hopper_launch
           flash_backward_hopper_kernel bwd_split bwd_Bc bwd_dq_cols bwd_dq_chunks bwd_stages
           bwd_hopper_shared_bytes)
    extra=(build/backward_passes.o) dflags=(-DAB_BACKWARD)
else
    call=flash_forward_fp16_hopper driver=${AB_DRIVER:-lab/hopper-ab.cu}
    names=(flash_forward_fp16_hopper flash_forward_bf16_hopper flash_forward_hopper_launch
           flash_forward_hopper_kernel hopper_consumers hopper_Br hopper_Bc hopper_stages
           producer_regs consumer_regs registers_fit)
fi
out=$(basename "${driver%.cu}" | tr - _)
objs=() pids=()
{
    for arg in "$@"; do echo "DECL(${arg%%=*})"; done
    printf '#define VARIANT_LIST'
    sep=' '
    for arg in "$@"; do
        n=${arg%%=*}
        printf '%s{"%s", %s_%s}' "$sep" "$n" "$call" "$n"
        sep=', '
    done
    echo
} > lab/hopper-ab-variants.h
for arg in "$@"; do
    n=${arg%%=*} src=${arg#*=}
    defs=()
    for s in "${names[@]}"; do defs+=("-D$s=${s}_$n"); done
    nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I. -Ilib "${defs[@]}" \
        ${HOPPER_AB_FLAGS:-} -c "$src" -o "hopper_ab_$n.o" &  # the variants compile at once
    pids+=($!)
    objs+=("hopper_ab_$n.o")
done
for pid in "${pids[@]}"; do wait "$pid"; done  # (set -e: a variant that fails to compile stops it)
nvcc -O3 -std=c++17 -arch=sm_90 -I. -Ilib -Ilab "${dflags[@]}" "$driver" "${objs[@]}" \
    "${extra[@]}" build/checks.o -o "$out"
rm -f lab/hopper-ab-variants.h
