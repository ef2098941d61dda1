# After setup: fp32 identity on the graph backend (it crashed the first time), adaptive K in the sweep (0.92x the
# first time: a captured first draft step switched it off), and chain vs token trees on real text (eager backend).
source "$(dirname "$0")/env.sh"
rm -rf results
python3 -m spec.spec_greedy --pair qwen-coder --device cuda --backend graph --dtype float32 --prompts code --limit 2 --max-new-tokens 64 --k 4 --quiet 2>&1 | grep -v "^answer\|^$" | tail -6
python3 -m spec.sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 4 --max-new-tokens 128 --k 4,6 --reps 1 --methods draft,auto --temperature 0 --quiet 2>&1 | tail -12
python3 -m spec.tree_sweep --pair qwen-coder --device cuda --backend eager --prompts code --limit 3 --max-new-tokens 64 --trees "3,2,1;2,2,1,1" --quiet 2>&1 | tail -24
pack rerun
