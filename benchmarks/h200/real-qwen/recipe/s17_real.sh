# Session 17, real pair, after s12_chunk.sh x 28 and s12_setup.sh: token trees on the GPU with the default draft
# (int8 in the graph backend's kernels), which no session had run: the tree calculator's predictions against
# measured runs of the chain at K = 4, the best chain, the best tree, the widest tree, EAGLE-2's dynamic tree and
# the tree policy (issue 19's bars: tokens per target forward with <= 16 nodes >= 1.3x the chain's at K = 4,
# predictions within 10 %). Under 600 s; packed as it ends.
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 400 python3 -m spec.tree_sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 4 \
  --max-new-tokens 128 > $OUT/tree_sweep.log 2>&1
echo "tree_sweep rc=$?"; grep -v "it/s\]" $OUT/tree_sweep.log | tail -30
pack s17_real
