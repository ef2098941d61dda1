# Session 10: fp32 identity on the graph backend (the layer stack graphed, not compiled), then adaptive K in the
# sweep with each round's times and the policy's estimates in the rows.
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 300 python3 -m spec.spec_greedy --pair qwen-coder --device cuda --backend graph --dtype float32 --prompts code --limit 2 --max-new-tokens 64 --k 4 --quiet > $OUT/fp32.log 2>&1; tail -12 $OUT/fp32.log
pack s10_fp32
timeout 240 python3 -m spec.sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 4 --max-new-tokens 128 --k 4,6 --reps 1 --methods draft,auto --temperature 0 --quiet > $OUT/sweep.log 2>&1; tail -14 $OUT/sweep.log
pack s10_runs
