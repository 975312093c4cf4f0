#!/usr/bin/env python3
# lab/ncu-stalls.py SOURCE.csv [N]: where the warps wait, from Nsight Compute's source page
# (`ncu --import R.ncu-rep --page source --csv --print-source cuda,sass`, as lab/options-ab.sh
# writes it with NCU_STALLS=1): the warp-state samples by reason over the kernel, then the N
# source lines (default 20) with the most samples, each with its three largest reasons. A sample
# is a warp seen in one state at one instruction; "selected" is a warp issuing, the rest wait.
import collections
import csv
import sys


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    header, source, lines = None, "", []
    for row in csv.reader(open(path)):
        if len(row) == 2 and row[0] == "File Path":
            source = row[1].split("/")[-1]
        elif row and row[0] == "Line No":
            header = row
        elif header and len(row) == len(header) and row[0] not in ("", "-"):
            lines.append((source, row))  # a source line (its SASS rows have no line number)
    if header is None:
        sys.exit(f"{path}: no source page (a 'Line No' header) found")
    reasons = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
    total, per_line = collections.Counter(), []
    for source, row in lines:
        counts = {header[i][6:]: int(row[i]) for i in reasons if row[i].isdigit()}
        total.update(counts)
        per_line.append((sum(counts.values()), source, row[0], row[1].strip(), counts))
    n = sum(total.values())
    print(f"{path}: {n} samples")
    for reason, count in total.most_common(12):
        print(f"  {reason:20s} {count:8d} {100 * count / n:5.1f}%")
    per_line.sort(key=lambda x: -x[0])
    for count, source, line, text, counts in per_line[:top]:
        most = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda x: -x[1])[:3])
        print(f"{count:7d} {100 * count / n:5.1f}%  {source}:{line}  {text[:60]}  [{most}]")


if __name__ == "__main__":
    main()
