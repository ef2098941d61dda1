# Session 19, after s12_chunk.sh x 28, one call: reassemble, check both SHA-256, convert (setup.sh), then token trees
# on the real pair with the default draft format (int8), 6 code prompts x 128 tokens: the tree calculator's
# predictions, now with the draft's catch-up and the loop's host work (fitted to short calibration runs), against
# measured runs; each round's times are kept in the JSONL. Under 600 s; packed as it ends.
bash "$(dirname "$0")/setup.sh" 2>&1 | grep -v "it/s\]" | tail -8
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 420 python3 -m spec.tree_sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 6 \
  --max-new-tokens 128 > $OUT/tree_sweep.log 2>&1
echo "tree_sweep rc=$?"; grep -v "it/s\]" $OUT/tree_sweep.log | tail -32
pack s19_real
