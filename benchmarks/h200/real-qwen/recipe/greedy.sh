source "$(dirname "$0")/env.sh"
rm -rf results
# The bar's run (code, with transformers beside ours), then the short set (its transformers rows: session 6's file)
python3 -m spec.spec_greedy --pair qwen-coder --device cuda --backend graph --prompts code --limit 6 --max-new-tokens 128 --k 4 --compare-hf --quiet 2>&1 | grep -v "^answer\|^$" | tail -14
python3 -m spec.spec_greedy --pair qwen-coder --device cuda --backend graph --prompts short --limit 6 --max-new-tokens 128 --k 4 --quiet 2>&1 | grep -v "^answer\|^$" | tail -14
pack greedy
