#!/usr/bin/env bash
# Does a kernel file still compile to the same machine code? Builds FILE.cu to a cubin as the
# Makefile's flags do (sm_90a for flash_hopper*.cu, sm_90 otherwise; ARCH overrides) and compares
# the bytes of every .text.<kernel> section with the same section of BASELINE.cubin, one line a
# kernel: "same", "different", or "only in" one of the two. Symbol tables and line info are left
# out: they change with names and comments, the instructions must not. A kernel in an anonymous
# namespace has a hash of its file in its name (_GLOBAL__N__<hash>_...); the hash is left out too.
#   lab/same-machine-code.sh flash_hopper.cu old/flash_hopper.cubin   (run from the repo root)
# FILE may be a .cubin already built. Exit status 0 when every kernel is the same.
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: $0 FILE.cu|FILE.cubin BASELINE.cubin [ARCH]" >&2; exit 2; fi
src=$1 base=$2
case $src in
*.cubin) new=$src ;;
*)
    case $(basename "$src") in flash_hopper*.cu) default=90a ;; *) default=90 ;; esac
    arch=${3:-$default}
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    new=$tmp/new.cubin
    nvcc -O3 -std=c++17 -I. -Ilib -gencode=arch=compute_$arch,code=sm_$arch -cubin "$src" -o "$new"
    ;;
esac
python3 - "$new" "$base" <<'PY'
import re, struct, sys

def text_sections(path):  # name -> bytes of each .text.* section of a 64-bit little-endian ELF
    data = open(path, 'rb').read()
    if data[:4] != b'\x7fELF' or data[4] != 2:
        sys.exit(f'{path}: not a 64-bit ELF file')
    shoff, = struct.unpack_from('<Q', data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from('<HHH', data, 0x3A)
    heads = [struct.unpack_from('<IIQQQQIIQQ', data, shoff + k * shentsize) for k in range(shnum)]
    names_at = heads[shstrndx][4]
    out = {}
    for name_off, kind, _, _, off, size, *_ in heads:
        name = data[names_at + name_off:data.index(b'\0', names_at + name_off)].decode()
        if name.startswith('.text.'):
            kernel = re.sub(r'_GLOBAL__N__[0-9a-f]+_', '_GLOBAL__N__', name[len('.text.'):])
            out[kernel] = data[off:off + size] if kind != 8 else b''  # 8: NOBITS
    return out

new, base = text_sections(sys.argv[1]), text_sections(sys.argv[2])
differ = 0
for kernel in sorted(set(new) | set(base)):
    if kernel not in base: verdict = 'only in the new build'
    elif kernel not in new: verdict = 'only in the baseline'
    else: verdict = 'same' if new[kernel] == base[kernel] else 'different'
    differ += verdict != 'same'
    print(f'{verdict:10} {kernel}')
if not new and not base: sys.exit('no .text sections in either file')
sys.exit(1 if differ else 0)
PY
