source "$(dirname "$0")/env.sh"
rm -rf results
# The bar's runs: graph backend, code and short prompts, transformers' plain and assisted generate beside ours
for set in code short; do
  python3 -m spec.spec_greedy --pair qwen-coder --device cuda --backend graph --prompts $set --limit 6 --max-new-tokens 128 --k 4 --compare-hf --quiet 2>&1 | grep -v "^answer\|^$" | tail -14
done
pack greedy
