# plot.gp: the FlashAttention-2 protocol's results (bench.csv, written by flash_bench) as a PNG.
#
# make bench && make plot
# (by hand: gnuplot -e "csv='bench.csv'; out='bench.png'" bench/plot.gp)
#
# Panels, left to right (a panel whose dtype has no rows in the file is left out):
# - fp32 forward time against sequence length, flash against standard attention, for each
#   head_dim with and without the causal mask (chapter 1: both on the CUDA cores);
# - the same for fp16 and for bf16 (chapter 2: flash and cuBLAS on the tensor cores), each its
#   own panel, on the same time axis, so that the panels compare at a glance, with the backward
#   time beside the forward (same colours, triangles, thinner lines; drawn when the file has
#   that type's backward times);
# - the extra device memory each method needs (beyond its inputs and outputs) against sequence
#   length, fp32 and the 16-bit standard forward (fp16's; bf16's, byte for byte the same, where
#   the file has no fp16 rows); where the standard method ran out of memory, the size it asked
#   for is drawn as an open square: that is the memory wall.
# Both axes are log scale: the protocol doubles seq_len each row, and memory spans from megabytes
# to tens of gigabytes. Rows a method did not run (OOM, --no-standard, --no-backward) hold "nan"
# and are left out. Needs gnuplot >= 5.4 (set datafile columnheaders).

if (!exists("csv")) csv = 'bench.csv'
if (!exists("out")) out = 'bench.png'

set datafile separator comma
# The first line names the columns, so the columns below are picked by name, not position.
set datafile columnheaders

# A method's time is "nan" on rows where it did not run: compared as text, because
# gnuplot's NaN != NaN is itself NaN, not true.
did_not_run(name) = strcol(name) eq "nan" || strcol(name) eq ""

# Rows of each dtype, its rows with a backward time, and the time range over what the time panels
# draw (every forward, the 16-bit backwards), which they share.
dtypes = "fp32 fp16 bf16"
array nrows[words(dtypes)]
array bwd_rows[words(dtypes)]
do for [i = 1:words(dtypes)] {
    stats csv using (strcol("dtype") eq word(dtypes, i)) nooutput
    nrows[i] = STATS_sum
    stats csv using (strcol("dtype") eq word(dtypes, i) && !did_not_run("flash_bwd_ms")) nooutput
    bwd_rows[i] = STATS_sum
}
stats csv using "flash_fwd_ms" nooutput
tmin = STATS_min
tmax = STATS_max
stats csv using "std_fwd_ms" nooutput
tmin = STATS_min < tmin ? STATS_min : tmin
tmax = STATS_max > tmax ? STATS_max : tmax
# The 16-bit backward times; other rows give their flash forward time, already in the range, so
# that stats always has points (it stops the script on a column without any).
bwd_or_fwd(name) = (strcol("dtype") ne "fp32" && !did_not_run(name)) ? column(name) \
                   : column("flash_fwd_ms")
do for [name in "flash_bwd_ms std_bwd_ms"] {
    stats csv using (bwd_or_fwd(name)) nooutput
    tmin = STATS_min < tmin ? STATS_min : tmin
    tmax = STATS_max > tmax ? STATS_max : tmax
}
panels = 1
do for [i = 1:words(dtypes)] { panels = panels + (nrows[i] > 0) }
# The memory panel's 16-bit rows: fp16's (nrows[2]), or bf16's (the same bytes) where it has none.
half = nrows[2] > 0 ? "fp16" : "bf16"

# pngcairo draws smoother lines; plain png (libgd) is the fallback where cairo is missing.
if (strstrt(GPVAL_TERMINALS, "pngcairo") > 0) {
    set terminal pngcairo size 800 * panels, 650 enhanced font "sans,11"
} else {
    set terminal png size 800 * panels, 650 font "sans,11"
}
set output out

# A value of column `name` for the rows of one dtype and head_dim (and one causal setting when
# causal >= 0), NaN (skipped) elsewhere, so each series draws only its own rows.
mine(t, d) = strcol("dtype") eq t && column("dim") == d
pick(t, name, d, c) = (mine(t, d) && (c < 0 || column("causal") == c)) ? column(name) : NaN
# The standard method's requested workspace, on rows where it did not run (its time is "nan").
wall(t, name, time, d) = (mine(t, d) && column("causal") == 0 && did_not_run(time)) \
                         ? column(name) : NaN
# flash's forward takes no extra memory: a 0 cannot sit on a log axis, so it is drawn at `floor`.
floor = 0.1
lifted(t, name, d) = (mine(t, d) && column("causal") == 0) ? \
                     (column(name) < floor ? floor : column(name)) : NaN

# Line styles: colour by method and head_dim, solid without the mask, dashed with it; backward
# times in the same colours, thinner, with triangles.
LP = 'with linespoints lw 2'
LB = 'with linespoints lw 1 ps 1.2'
SQ = 'with points ps 2.5 pt 4'
blue = '#1f77b4'; green = '#2ca02c'; red = '#d62728'; orange = '#ff7f0e'
cyan = '#17becf'; purple = '#9467bd'; brown = '#8c564b'

set multiplot layout 1, panels title "FlashAttention vs standard attention " . \
    "(batch x seq = 16384, hidden 2048; at 32768: batch 1)"

set logscale xy 2
set logscale y 10
set xtics (512, 1024, 2048, 4096, 8192, 16384, 32768)
set xrange [400:40000]
set grid xtics ytics mytics
set xlabel "sequence length"
set key box opaque font ",9"

# The time panel of dtype t: forward, and in fp16 and bf16 (where the file has them) backward as
# well. The forward series are one macro, so that a panel with the backward adds to it, not
# repeats it.
set key bottom right
set ylabel "ms"
set yrange [tmin / 1.5 : tmax * 1.5]
FWD = 'csv using "seq":(pick(t, "flash_fwd_ms", 64, 0))  @LP pt 7 lc rgb blue   dt 1 ' . \
          'title "flash fwd, d 64", ' . \
      'csv using "seq":(pick(t, "flash_fwd_ms", 64, 1))  @LP pt 7 lc rgb blue   dt 2 ' . \
          'title "flash fwd, d 64, causal", ' . \
      'csv using "seq":(pick(t, "flash_fwd_ms", 128, 0)) @LP pt 5 lc rgb green  dt 1 ' . \
          'title "flash fwd, d 128", ' . \
      'csv using "seq":(pick(t, "flash_fwd_ms", 128, 1)) @LP pt 5 lc rgb green  dt 2 ' . \
          'title "flash fwd, d 128, causal", ' . \
      'csv using "seq":(pick(t, "std_fwd_ms", 64, 0))    @LP pt 6 lc rgb red    dt 1 ' . \
          'title "standard fwd, d 64", ' . \
      'csv using "seq":(pick(t, "std_fwd_ms", 64, 1))    @LP pt 6 lc rgb red    dt 2 ' . \
          'title "standard fwd, d 64, causal", ' . \
      'csv using "seq":(pick(t, "std_fwd_ms", 128, 0))   @LP pt 4 lc rgb orange dt 1 ' . \
          'title "standard fwd, d 128", ' . \
      'csv using "seq":(pick(t, "std_fwd_ms", 128, 1))   @LP pt 4 lc rgb orange dt 2 ' . \
          'title "standard fwd, d 128, causal"'
BWD = 'csv using "seq":(pick(t, "flash_bwd_ms", 64, 0))  @LB pt 9  lc rgb blue   dt 1 ' . \
          'title "flash bwd, d 64", ' . \
      'csv using "seq":(pick(t, "flash_bwd_ms", 64, 1))  @LB pt 9  lc rgb blue   dt 2 ' . \
          'title "flash bwd, d 64, causal", ' . \
      'csv using "seq":(pick(t, "flash_bwd_ms", 128, 0)) @LB pt 11 lc rgb green  dt 1 ' . \
          'title "flash bwd, d 128", ' . \
      'csv using "seq":(pick(t, "flash_bwd_ms", 128, 1)) @LB pt 11 lc rgb green  dt 2 ' . \
          'title "flash bwd, d 128, causal", ' . \
      'csv using "seq":(pick(t, "std_bwd_ms", 64, 0))    @LB pt 8  lc rgb red    dt 1 ' . \
          'title "standard bwd, d 64", ' . \
      'csv using "seq":(pick(t, "std_bwd_ms", 64, 1))    @LB pt 8  lc rgb red    dt 2 ' . \
          'title "standard bwd, d 64, causal", ' . \
      'csv using "seq":(pick(t, "std_bwd_ms", 128, 0))   @LB pt 10 lc rgb orange dt 1 ' . \
          'title "standard bwd, d 128", ' . \
      'csv using "seq":(pick(t, "std_bwd_ms", 128, 1))   @LB pt 10 lc rgb orange dt 2 ' . \
          'title "standard bwd, d 128, causal"'
do for [i = 1:words(dtypes)] {
    t = word(dtypes, i)
    if (nrows[i] > 0) {
        if (t ne "fp32" && bwd_rows[i] > 0) {
            # Two columns of keys, forward on the left, backward on the right, top left: at the
            # bottom right they would cover flash's forward at short lengths.
            set title sprintf("%s forward and backward time (median)", t)
            set key top left maxrows 8
            plot @FWD, @BWD
        } else {
            set title sprintf("%s forward time (median)", t)
            set key bottom right maxrows auto
            plot @FWD
        }
    }
}
set key maxrows auto

# Memory does not depend on the mask (standard attention stores every score either way), so
# only the causal = 0 rows are drawn. flash's 16-bit forward, like its fp32 one, takes none. Of
# the 16-bit rows only the standard forward (scores at half the bytes) is drawn, to keep the panel
# readable: its backward repeats fp32's pattern (flash: a scratch buffer; standard: P and dP at
# half the bytes), and the CSV has it; bf16's bytes are fp16's.
set title sprintf("extra device memory (flash forward: 0 MiB, drawn at %g)", floor)
set ylabel "MiB"
# Top left, above where the lines start: the band between flash's and standard's lines, where
# the key sat before fp16, now holds fp16's standard forward. Headroom above the largest wall.
set yrange [0.05:1e7]
set key top left
plot csv using "seq":(lifted("fp32", "flash_fwd_extra_mib", 64))   @LP pt 7 lc rgb blue   dt 1 \
         title "flash fwd, d 64", \
     csv using "seq":(pick("fp32", "flash_bwd_extra_mib", 64, 0))  @LP pt 7 lc rgb cyan   dt 1 \
         title "flash bwd, d 64", \
     csv using "seq":(lifted("fp32", "flash_fwd_extra_mib", 128))  @LP pt 5 lc rgb blue   dt 2 \
         title "flash fwd, d 128", \
     csv using "seq":(pick("fp32", "flash_bwd_extra_mib", 128, 0)) @LP pt 5 lc rgb cyan   dt 2 \
         title "flash bwd, d 128", \
     csv using "seq":(pick("fp32", "std_fwd_extra_mib", 64, 0))    @LP pt 7 lc rgb red    dt 1 \
         title "standard fwd, d 64", \
     csv using "seq":(pick("fp32", "std_bwd_extra_mib", 64, 0))    @LP pt 7 lc rgb purple dt 1 \
         title "standard bwd, d 64", \
     csv using "seq":(pick("fp32", "std_fwd_extra_mib", 128, 0))   @LP pt 5 lc rgb red    dt 2 \
         title "standard fwd, d 128", \
     csv using "seq":(pick("fp32", "std_bwd_extra_mib", 128, 0))   @LP pt 5 lc rgb purple dt 2 \
         title "standard bwd, d 128", \
     csv using "seq":(pick(half, "std_fwd_extra_mib", 64, 0))      @LP pt 7 lc rgb brown  dt 1 \
         title "standard fwd ".half.", d 64", \
     csv using "seq":(pick(half, "std_fwd_extra_mib", 128, 0))     @LP pt 5 lc rgb brown  dt 2 \
         title "standard fwd ".half.", d 128", \
     csv using "seq":(wall("fp32", "std_fwd_needs_mib", "std_fwd_ms", 64))  @SQ lc rgb red \
         title "standard fwd: OOM, needed", \
     csv using "seq":(wall("fp32", "std_bwd_needs_mib", "std_bwd_ms", 64))  @SQ lc rgb purple \
         title "standard bwd: OOM, needed", \
     csv using "seq":(wall("fp32", "std_fwd_needs_mib", "std_fwd_ms", 128)) @SQ lc rgb red \
         notitle, \
     csv using "seq":(wall("fp32", "std_bwd_needs_mib", "std_bwd_ms", 128)) @SQ lc rgb purple \
         notitle, \
     csv using "seq":(wall(half, "std_fwd_needs_mib", "std_fwd_ms", 64))    @SQ lc rgb brown \
         title "standard fwd ".half.": OOM, needed", \
     csv using "seq":(wall(half, "std_fwd_needs_mib", "std_fwd_ms", 128))   @SQ lc rgb brown \
         notitle

unset multiplot
set output
