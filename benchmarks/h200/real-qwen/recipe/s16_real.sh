# Session 16, real pair, after s12_chunk.sh x 28 and s12_setup.sh: the draft format the command line now picks by
# itself (`--draft-quant auto`: int8 in the graph backend's kernels in bf16) against the bf16 draft, in one call.
# (1) spec_greedy on code and short, the default (auto) and --draft-quant none, with transformers' plain and
# assisted generate beside them (issue 17's >= 1.2x ours-vs-plain and >= 5x ours-vs-assisted bars);
# (2) the K sweep with the auto draft (measured vs predicted at the best K, adaptive K);
# (3) trees with the auto draft; (4) the Qwen pair's start with the server, warm (the <= 15 s bar).
# About 6 minutes; each part packed as it ends.
source "$(dirname "$0")/env.sh"
rm -rf results
G="python3 -m spec.spec_greedy --pair qwen-coder --device cuda --backend graph --limit 6 --max-new-tokens 128 --k 4"
for q in auto none; do for p in code short; do
  timeout 100 $G --prompts $p --draft-quant $q --compare-hf > $OUT/greedy_${q}_$p.log 2>&1
  echo "greedy $q $p rc=$?"; grep -v "it/s\]" $OUT/greedy_${q}_$p.log | tail -3
done; done
pack s16_greedy
timeout 120 python3 -m spec.sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 4 \
  --max-new-tokens 128 --k 2,4,6,8 --methods draft,auto --reps 1 --temperature 0 > $OUT/sweep.log 2>&1
echo "sweep rc=$?"; grep -v "it/s\]" $OUT/sweep.log | tail -10
pack s16_sweep
timeout 150 python3 -m spec.tree_sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 3 \
  --max-new-tokens 128 --max-nodes 15 --trees "2,1;dynamic:15:4;auto:15" --quiet > $OUT/trees.log 2>&1
echo "trees rc=$?"; grep -v "it/s\]" $OUT/trees.log | tail -12
pack s16_trees
timeout 150 python3 -m spec.start_time --pair qwen-coder --device cuda --backend graph --server > $OUT/start.log 2>&1
echo "start rc=$?"; grep -v "it/s\]" $OUT/start.log | tail -8
pack s16_real
