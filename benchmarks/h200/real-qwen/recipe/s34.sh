# Session 34, on whichever card comes (carry .whl), one call of at most 400 s: first the CUDA tests of the graph
# backend past its 4,096-position cache (s33_long.sh's, never run on a GPU), then the w4a8 draft (s34_a8.sh: its
# CUDA tests, the step beside int8 and int4 in one bench_engine run, each 1B product alone), each under its own limit.
source "$(dirname "$0")/env.sh"
T1=${TL:-100} bash "$(dirname "$0")/s33_long.sh"
T0=${TA:-80} T2=${TB:-150} T1=${TP:-60} bash "$(dirname "$0")/s34_a8.sh"
