# plot.gp: the FlashAttention-2 protocol's results (bench.csv, written by flash_bench) as a PNG.
#
# make bench && make plot
# (by hand: gnuplot -e "csv='bench.csv'; out='bench.png'" plot.gp)
#
# Left: forward time against sequence length, flash against standard attention, for each head_dim
# with and without the causal mask. Right: the extra device memory each method needs (beyond its
# inputs and outputs) against sequence length; where the standard method ran out of memory, the
# size it asked for is drawn as an open square: that is the memory wall. Both axes are log scale:
# the protocol doubles seq_len each row, and memory spans from megabytes to tens of gigabytes.
# Rows a method did not run (OOM, --no-standard, --no-backward) hold "nan" and are left out.

if (!exists("csv")) csv = 'bench.csv'
if (!exists("out")) out = 'bench.png'

# pngcairo draws smoother lines; plain png (libgd) is the fallback where cairo is missing.
if (strstrt(GPVAL_TERMINALS, "pngcairo") > 0) {
    set terminal pngcairo size 1600,650 enhanced font "sans,11"
} else {
    set terminal png size 1600,650 font "sans,11"
}
set output out

set datafile separator comma
# The first line names the columns, so the columns below are picked by name, not position.
set key autotitle columnhead

# A value of column `name` for the rows of one head_dim (and one causal setting when causal >= 0),
# NaN (skipped) elsewhere, so each series draws only its own rows.
pick(name, d, c) = (column("dim") == d && (c < 0 || column("causal") == c)) ? column(name) : NaN
# The standard method's requested workspace, on rows where it did not run (its time is "nan";
# compared as text, because gnuplot's NaN != NaN is itself NaN, not true).
did_not_run(name) = strcol(name) eq "nan" || strcol(name) eq ""
wall(name, time, d) = (column("dim") == d && column("causal") == 0 && did_not_run(time)) \
                      ? column(name) : NaN
# flash's forward takes no extra memory: a 0 cannot sit on a log axis, so it is drawn at `floor`.
floor = 0.1
lifted(name, d) = (column("dim") == d && column("causal") == 0) ? \
                  (column(name) < floor ? floor : column(name)) : NaN

set multiplot layout 1, 2 title "FlashAttention vs standard attention, fp32 (batch x seq = 16384, hidden 2048; at 32768: batch 1)"

set logscale xy 2
set logscale y 10
set xtics (512, 1024, 2048, 4096, 8192, 16384, 32768)
set xrange [400:40000]
set grid xtics ytics mytics
set xlabel "sequence length"
set key box opaque font ",9"

set title "forward time (median)"
set key bottom right
set ylabel "ms"
plot csv using "seq":(pick("flash_fwd_ms", 64, 0))    with linespoints lw 2 pt 7  lc rgb "#1f77b4" dt 1 title "flash, d 64", \
     csv using "seq":(pick("flash_fwd_ms", 64, 1))    with linespoints lw 2 pt 7  lc rgb "#1f77b4" dt 2 title "flash, d 64, causal", \
     csv using "seq":(pick("flash_fwd_ms", 128, 0))   with linespoints lw 2 pt 5  lc rgb "#2ca02c" dt 1 title "flash, d 128", \
     csv using "seq":(pick("flash_fwd_ms", 128, 1))   with linespoints lw 2 pt 5  lc rgb "#2ca02c" dt 2 title "flash, d 128, causal", \
     csv using "seq":(pick("std_fwd_ms", 64, 0))      with linespoints lw 2 pt 6  lc rgb "#d62728" dt 1 title "standard, d 64", \
     csv using "seq":(pick("std_fwd_ms", 64, 1))      with linespoints lw 2 pt 6  lc rgb "#d62728" dt 2 title "standard, d 64, causal", \
     csv using "seq":(pick("std_fwd_ms", 128, 0))     with linespoints lw 2 pt 4  lc rgb "#ff7f0e" dt 1 title "standard, d 128", \
     csv using "seq":(pick("std_fwd_ms", 128, 1))     with linespoints lw 2 pt 4  lc rgb "#ff7f0e" dt 2 title "standard, d 128, causal"

# Memory does not depend on the mask (standard attention stores every score either way), so
# only the causal = 0 rows are drawn.
set title sprintf("extra device memory (flash forward: 0 MiB, drawn at %g)", floor)
set ylabel "MiB"
set yrange [0.05:*]
set key at graph 0.99, graph 0.5 right center  # the band between flash's and standard's lines
plot csv using "seq":(lifted("flash_fwd_extra_mib", 64))     with linespoints lw 2 pt 7  lc rgb "#1f77b4" dt 1 title "flash fwd, d 64", \
     csv using "seq":(pick("flash_bwd_extra_mib", 64, 0))    with linespoints lw 2 pt 7  lc rgb "#17becf" dt 1 title "flash bwd, d 64", \
     csv using "seq":(lifted("flash_fwd_extra_mib", 128))    with linespoints lw 2 pt 5  lc rgb "#1f77b4" dt 2 title "flash fwd, d 128", \
     csv using "seq":(pick("flash_bwd_extra_mib", 128, 0))   with linespoints lw 2 pt 5  lc rgb "#17becf" dt 2 title "flash bwd, d 128", \
     csv using "seq":(pick("std_fwd_extra_mib", 64, 0))      with linespoints lw 2 pt 7  lc rgb "#d62728" dt 1 title "standard fwd, d 64", \
     csv using "seq":(pick("std_bwd_extra_mib", 64, 0))      with linespoints lw 2 pt 7  lc rgb "#9467bd" dt 1 title "standard bwd, d 64", \
     csv using "seq":(pick("std_fwd_extra_mib", 128, 0))     with linespoints lw 2 pt 5  lc rgb "#d62728" dt 2 title "standard fwd, d 128", \
     csv using "seq":(pick("std_bwd_extra_mib", 128, 0))     with linespoints lw 2 pt 5  lc rgb "#9467bd" dt 2 title "standard bwd, d 128", \
     csv using "seq":(wall("std_fwd_needs_mib", "std_fwd_ms", 64))  with points ps 2.5 pt 4 lc rgb "#d62728" title "standard fwd: OOM, needed", \
     csv using "seq":(wall("std_bwd_needs_mib", "std_bwd_ms", 64))  with points ps 2.5 pt 4 lc rgb "#9467bd" title "standard bwd: OOM, needed", \
     csv using "seq":(wall("std_fwd_needs_mib", "std_fwd_ms", 128)) with points ps 2.5 pt 4 lc rgb "#d62728" notitle, \
     csv using "seq":(wall("std_bwd_needs_mib", "std_bwd_ms", 128)) with points ps 2.5 pt 4 lc rgb "#9467bd" notitle

unset multiplot
set output
