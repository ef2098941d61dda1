# After setup: adaptive K in the sweep (0.92x the first time: a captured first draft step switched it off), and
# chain vs token trees on real text (eager backend). Each task's output goes to $OUT as it runs (a pipe through
# tail would hold it back until the end), each under its own timeout.
# Left out: the fp32 run on the graph backend (spec_greedy --backend graph --dtype float32) did not finish its
# warm-up within 8 minutes in session 9.
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 250 python3 -m spec.sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 4 --max-new-tokens 128 --k 4,6 --reps 1 --methods draft,auto --temperature 0 --quiet > $OUT/sweep.log 2>&1; tail -14 $OUT/sweep.log
timeout 200 python3 -m spec.tree_sweep --pair qwen-coder --device cuda --backend eager --prompts code --limit 3 --max-new-tokens 64 --trees "3,2,1;2,2,1,1" --quiet > $OUT/tree_sweep.log 2>&1; tail -22 $OUT/tree_sweep.log
pack rerun
