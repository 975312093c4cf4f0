#!/usr/bin/env python3
# lab/sass-counts.py [--seq] CUBIN [PATTERN]: static instruction counts of each kernel in a cubin,
# by opcode, without cuobjdump or nvdisasm (this machine has neither); with --seq, the order of
# the instructions that shape a softmax's schedule (MUFU, FMNMX, SHFL, HGMMA, the wgmma fences
# and waits, branches and barriers), runs of one collapsed to "name xN". Build the cubin as the
# Makefile builds the object, e.g. for chapter 3's forward:
#   nvcc -O3 -std=c++17 -I. -Ilib -gencode=arch=compute_90a,code=sm_90a -cubin flash_hopper.cu \
#       -o /tmp/h.cubin && lab/sass-counts.py /tmp/h.cubin 'ModelPolicyILb1ELb0.*Li128|Li128.*ModelPolicyILb1ELb0'
# A Hopper instruction is 16 bytes; bits 0-11 of its first 8 name the opcode, and for MUFU bits
# 10-13 of the second 8 name the function. The table below was read off `cuobjdump -sass` of the
# chapter 3 forward on an H200 (lab/chapter5.md, part 7): there the local cubin of the softcap
# forward had the same 3,376 instruction words as the device's. Opcodes not in the table print as
# op_0xNNN. Static counts: a loop's body once, each copy the compiler makes of it once more.
import re
import struct
import sys
from collections import Counter

OPCODES = {  # bits 0-11 of the first word -> the mnemonic's first part
    "ATOMG": [0x9a8], "BAR": [0x51d, 0xb1d], "BRA": [0x947], "BSSY": [0x945], "BSYNC": [0x941],
    "CALL": [0x944], "CS2R": [0x805], "ELECT": [0x82f], "ENDCOLLECTIVE": [0x91b],
    "EXIT": [0x94d], "F2FP": [0x23e], "F2I": [0x305], "FADD": [0x221, 0x421], "FENCE": [0x3c6],
    "FFMA": [0x223, 0x423, 0x823, 0xc23], "FMNMX": [0x209, 0x809], "FMUL": [0x220, 0x820, 0xc20],
    "FSEL": [0x208, 0x808], "FSETP": [0x20b, 0x80b], "HGMMA": [0x9f0, 0xdf0],
    "I2F": [0x306, 0xd06], "I2FP": [0x245], "IABS": [0x213], "IADD3": [0x210, 0x810, 0xc10],
    "IMAD": [0x224, 0x225, 0x227, 0x424, 0x824, 0x825, 0x827, 0xc24, 0xc25, 0xe24],
    "ISETP": [0x20c, 0x80c, 0xc0c], "LDC": [0xb82], "LDG": [0x981], "LDS": [0x984],
    "LEA": [0x211, 0x811, 0xc11], "LOP3": [0x212, 0x812, 0xc12], "MOV": [0x802],
    "MUFU": [0x308], "NOP": [0x918], "PLOP3": [0x81c], "R2UR": [0x2ca], "RET": [0x950],
    "S2R": [0x919], "S2UR": [0x9c3], "SEL": [0x207, 0x807], "SHF": [0x219, 0x819],
    "SHFL": [0x389, 0x589, 0xf89], "STG": [0x986], "STS": [0x388],
    "SYNCS": [0x5a7, 0x5b2, 0x9a7], "UIADD3": [0x290, 0x890],
    "UIMAD": [0x2a4, 0x2a5, 0x8a4, 0x8a5], "UISETP": [0x28c, 0x88c], "ULDC": [0xab9],
    "ULEA": [0x291, 0x891], "ULOP3": [0x292, 0x892], "UMOV": [0x882, 0xc82], "USEL": [0x287],
    "USETMAXREG": [0x9c8], "USHF": [0x899], "UTMALDG": [0x5b4], "VIADD": [0x836, 0xc36],
    "VIADDMNMX": [0x846], "VIMNMX": [0x248, 0xc48], "VOTEU": [0x886], "WARPGROUP": [0x9c5],
    "WARPSYNC": [0x348, 0x948],
}
NAME = {code: name for name, codes in OPCODES.items() for code in codes}
MUFU = {2: "MUFU.EX2", 4: "MUFU.RCP", 9: "MUFU.TANH"}  # bits 10-13 of the second word
SEQ = {"MUFU.EX2", "MUFU.TANH", "MUFU.RCP", "FMNMX", "SHFL", "HGMMA", "WARPGROUP.ARRIVE",
       "BRA", "BSSY", "BSYNC", "WARPSYNC", "BAR", "SYNCS", "EXIT"}
SHOWN = ["MUFU.EX2", "MUFU.TANH", "MUFU.RCP", "FMNMX", "FSEL", "FFMA", "FMUL", "FADD", "SHFL",
         "HGMMA", "WARPGROUP", "BSSY", "WARPSYNC", "BRA"]


def text_sections(path):
    """The .text.<kernel> sections of an ELF cubin: {kernel: bytes}."""
    b = open(path, "rb").read()
    if b[:4] != b"\x7fELF" or b[4] != 2:
        sys.exit(f"{path}: not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3a)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]
    strtab = hdrs[shstrndx][4]
    out = {}
    for h in hdrs:
        end = b.index(b"\0", strtab + h[0])
        name = b[strtab + h[0]:end].decode()
        if name.startswith(".text."):
            out[name[6:]] = b[h[4]:h[4] + h[5]]
    return out


def names(code):
    """Each instruction's name: the opcode's, MUFU's function, WARPGROUP's ARRIVE or DEPBAR.LE n."""
    for i in range(0, len(code), 16):
        w0, w1 = struct.unpack_from("<QQ", code, i)
        name = NAME.get(w0 & 0xfff, f"op_{w0 & 0xfff:#05x}")
        if name == "MUFU":
            name = MUFU.get((w1 >> 10) & 0xf, "MUFU.other")
        elif name == "WARPGROUP":  # bit 47 of the first word: a wait (DEPBAR), else ARRIVE
            name = f"WARPGROUP.DEPBAR.LE{(w1 >> 8) & 7}" if (w0 >> 47) & 1 else "WARPGROUP.ARRIVE"
        yield name


def counts(code):
    c = Counter()
    for name in names(code):
        c["WARPGROUP" if name.startswith("WARPGROUP") else name] += 1
        c["all"] += 1
    return c


def sequence(code):
    """The instructions in SEQ, in order, each run of one name as "name xN", with the index of the
    run's first instruction."""
    out, last, n, at = [], None, 0, 0
    for i, name in enumerate(names(code)):
        if name not in SEQ and not name.startswith("WARPGROUP.DEPBAR"):
            continue
        if name == last:
            n += 1
            continue
        if last:
            out.append(f"{at:5d} {last}" + (f" x{n}" if n > 1 else ""))
        last, n, at = name, 1, i
    if last:
        out.append(f"{at:5d} {last}" + (f" x{n}" if n > 1 else ""))
    return out


def main():
    args = [a for a in sys.argv[1:] if a != "--seq"]
    if not args:
        sys.exit("usage: lab/sass-counts.py [--seq] CUBIN [PATTERN]")
    pattern = re.compile(args[1] if len(args) > 1 else ".")
    for kernel, code in sorted(text_sections(args[0]).items()):
        if not pattern.search(kernel):
            continue
        if "--seq" in sys.argv:
            print(kernel + "\n" + "\n".join(sequence(code)))
            continue
        c = counts(code)
        unknown = sum(n for k, n in c.items() if k.startswith("op_"))
        print(f"{kernel}\n  all {c['all']}, " + ", ".join(f"{k} {c[k]}" for k in SHOWN) +
              (f", not in the table {unknown}" if unknown else ""))


if __name__ == "__main__":
    main()
