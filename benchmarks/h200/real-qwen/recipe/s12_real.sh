# Session 12, real pair, after s12_setup.sh, each under its own timeout, each packed as it ends: (1) chain against
# token trees on the graph backend (issue 19: tokens per target forward, speed against plain, identity, the
# calculator's prediction); (2) the draft formats side by side on the graph backend (issue 18: alpha-hat per format,
# speed against plain in the same load); (3) fp32 identity on the graph backend (issue 17).
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 200 python3 -m spec.tree_sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 3 \
  --max-new-tokens 128 --quiet > $OUT/trees.log 2>&1; echo "trees rc=$?"; grep -v "it/s\]" $OUT/trees.log | tail -16
pack s12_trees
timeout 180 python3 benchmarks/cpu/draft_quant.py --pair qwen-coder --device cuda --backend graph --prompts code,short \
  --limit 3 --max-new-tokens 128 > $OUT/quant.log 2>&1; echo "quant rc=$?"; grep -v "it/s\]" $OUT/quant.log | tail -10
pack s12_quant
timeout 150 python3 -m spec.spec_greedy --pair qwen-coder --device cuda --backend graph --dtype float32 --prompts code \
  --limit 2 --max-new-tokens 64 --k 4 --quiet > $OUT/fp32.log 2>&1; echo "fp32 rc=$?"; grep -v "^answer\|^$\|it/s\]" $OUT/fp32.log | tail -8
pack s12_real
