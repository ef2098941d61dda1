source "$(dirname "$0")/env.sh"
rm -rf results
# The eager backend beside the graph one, and fp32 identity on a subset (graph backend: the fast path itself)
python3 -m spec.spec_greedy --pair qwen-coder --device cuda --backend eager --prompts code --limit 3 --max-new-tokens 128 --k 4 --quiet 2>&1 | grep -v "^answer\|^$" | tail -9
python3 -m spec.spec_greedy --pair qwen-coder --device cuda --backend graph --dtype float32 --prompts code --limit 2 --max-new-tokens 64 --k 4 --quiet 2>&1 | grep -v "^answer\|^$" | tail -8
pack greedy_more
