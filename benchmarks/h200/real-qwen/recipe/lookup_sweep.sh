source "$(dirname "$0")/env.sh"
rm -rf results
python3 -m spec.lookup --pair qwen-coder --device cuda --backend graph --limit 3 --max-new-tokens 128 --quiet 2>&1 | tail -6
python3 -m spec.sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 4 --max-new-tokens 128 --k 1,2,3,4,6,8 --reps 1 --methods draft,auto --temperature 0 --quiet 2>&1 | tail -16
python3 -m spec.verify_cost --pair qwen-coder --device cuda --backend graph --quiet 2>&1 | tail -12
pack lookup_sweep
