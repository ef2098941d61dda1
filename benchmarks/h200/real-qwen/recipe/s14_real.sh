# Session 14, real pair, after s12_chunk.sh x 26 and s12_setup.sh: (1) chain against trees on the graph backend
# with tree forwards in one pass and prepared ahead (issue 19); (2) the draft formats with small forwards stepwise
# (issue 18); (3) adaptive K beside fixed K (issue 17, the policy's probes). Each packed as it ends.
# Trees of at most 15 nodes: with the root a verify of 16 tokens, one 16-token tile (17 costs a 32-token tile).
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 200 python3 -m spec.tree_sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 3 \
  --max-new-tokens 128 --max-nodes 15 --quiet > $OUT/trees.log 2>&1; echo "trees rc=$?"; grep -v "it/s\]" $OUT/trees.log | tail -16
pack s14_trees
timeout 180 python3 benchmarks/cpu/draft_quant.py --pair qwen-coder --device cuda --backend graph --prompts code,short --quants none,int8,int4,fp8 \
  --limit 3 --max-new-tokens 128 > $OUT/quant.log 2>&1; echo "quant rc=$?"; grep -v "it/s\]" $OUT/quant.log | tail -10
pack s14_quant
timeout 60 python3 -m spec.sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 4 \
  --max-new-tokens 128 --k 4,6 --methods draft,auto --reps 1 --temperature 0 > $OUT/sweep.log 2>&1; echo "sweep rc=$?"
grep -v "it/s\]" $OUT/sweep.log | tail -8
pack s14_real
