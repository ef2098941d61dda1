# Session 18, after s12_chunk.sh x 28, one call: reassemble, check both SHA-256, convert (setup.sh), then token trees
# on the real pair on the GPU with the default draft format (int8 in the graph backend's kernels), which no session
# had run: the tree calculator's predictions against measured runs of the chain at K = 4, the best chain, the best
# tree, the widest tree, EAGLE-2's dynamic tree and the tree policy. Under 600 s; each part packed as it ends.
bash "$(dirname "$0")/setup.sh" 2>&1 | grep -v "it/s\]" | tail -8
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 400 python3 -m spec.tree_sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 3 \
  --max-new-tokens 128 > $OUT/tree_sweep.log 2>&1
echo "tree_sweep rc=$?"; grep -v "it/s\]" $OUT/tree_sweep.log | tail -30
pack s18_real
