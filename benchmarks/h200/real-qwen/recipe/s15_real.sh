# Session 15, real pair, after s12_chunk.sh x 28 (55 MiB chunks) and s12_setup.sh (which also times the Qwen pair's
# start): (1) the K sweep with session 14's adaptive K (a round priced c K + 1 + s K + a^K l, its two-token lead l
# apart; it ran 1.05x there against 1.42x at K = 6); (2) trees on the graph backend after session 14's removal of the tree round's
# waits (non-blocking layouts, masks made on the host, dynamic trees reading back once a depth), with the tree
# policy's rounds now recorded. Each packed as it ends. About 3 minutes.
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 90 python3 -m spec.sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 4 \
  --max-new-tokens 128 --k 4,6 --methods draft,auto --reps 1 --temperature 0 > $OUT/sweep.log 2>&1; echo "sweep rc=$?"
grep -v "it/s\]" $OUT/sweep.log | tail -8
pack s15_sweep
timeout 200 python3 -m spec.tree_sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 3 \
  --max-new-tokens 128 --max-nodes 15 --trees "2,1;dynamic:15:4;auto:15" --quiet > $OUT/trees.log 2>&1
echo "trees rc=$?"; grep -v "it/s\]" $OUT/trees.log | tail -12
pack s15_real
