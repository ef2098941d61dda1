# Session 14, real pair, after s12_chunk.sh x 26 and s12_setup.sh: (1) chain against trees on the graph backend
# with tree forwards in one pass and prepared ahead (issue 19); (2) the draft formats with small forwards stepwise
# (issue 18); (3) adaptive K beside fixed K (issue 17, the policy's probes); (4) fp32 identity on the graph backend
# (issue 17; its first try spent its 150 s converting the fp32 copy). Each packed as it ends.
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 200 python3 -m spec.tree_sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 3 \
  --max-new-tokens 128 --quiet > $OUT/trees.log 2>&1; echo "trees rc=$?"; grep -v "it/s\]" $OUT/trees.log | tail -16
pack s14_trees
timeout 180 python3 benchmarks/cpu/draft_quant.py --pair qwen-coder --device cuda --backend graph --prompts code,short --quants none,int8,int4,fp8 \
  --limit 3 --max-new-tokens 128 > $OUT/quant.log 2>&1; echo "quant rc=$?"; grep -v "it/s\]" $OUT/quant.log | tail -10
pack s14_quant
timeout 60 python3 -m spec.sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 4 \
  --max-new-tokens 128 --k 4,6 --methods draft,auto --reps 1 --temperature 0 > $OUT/sweep.log 2>&1; echo "sweep rc=$?"
grep -v "it/s\]" $OUT/sweep.log | tail -8
pack s14_sweep
timeout 240 python3 -m spec.spec_greedy --pair qwen-coder --device cuda --backend graph --dtype float32 --prompts code \
  --limit 2 --max-new-tokens 64 --k 4 --quiet > $OUT/fp32.log 2>&1; echo "fp32 rc=$?"; grep -v "^answer\|^$\|it/s\]" $OUT/fp32.log | tail -8
pack s14_real
