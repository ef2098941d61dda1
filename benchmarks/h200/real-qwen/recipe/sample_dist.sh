source "$(dirname "$0")/env.sh"
rm -rf results
python3 -m spec.spec_sample --pair qwen-coder --device cuda --backend graph --temperature 0.7 --limit 4 --max-new-tokens 128 --quiet 2>&1 | grep -v "^sample answer" | tail -9
python3 -m spec.dist_test --pair qwen-coder --device cuda --backend graph --break none --warps none --quiet 2>&1 | tail -22
pack sample_dist
