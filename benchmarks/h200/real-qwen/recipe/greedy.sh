source "$(dirname "$0")/env.sh"
rm -rf results
for set in code short; do
  python3 -m spec.spec_greedy --pair qwen-coder --device cuda --backend graph --prompts $set --limit 6 --max-new-tokens 128 --k 4 --compare-hf --quiet 2>&1 | grep -v "^answer\|^$" | tail -14
done
python3 -m spec.spec_greedy --pair qwen-coder --device cuda --backend eager --prompts code --limit 6 --max-new-tokens 128 --k 4 --quiet 2>&1 | tail -3
python3 -m spec.spec_greedy --pair qwen-coder --device cuda --backend eager --dtype float32 --prompts code --limit 2 --max-new-tokens 64 --k 4 --quiet 2>&1 | tail -3
pack greedy
