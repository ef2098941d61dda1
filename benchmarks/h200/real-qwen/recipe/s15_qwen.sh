# Session 15, real pair on the warm machine after s15_real.sh: tune the Qwen pair's own tiles (verify/frontier
# 2-16 tokens for both models, the 0.5B's int4/int8 one-token step), then the sweep, trees and draft formats again.
source "$(dirname "$0")/env.sh"
rm -rf results
T="python3 -m spec.tune_kernels --pair qwen-coder --device cuda"
timeout 120 $T --tokens 9 > $OUT/tune_qwen_rows.log 2>&1; echo "rows rc=$?"
timeout 60 $T --roles draft --draft-quant int4 > $OUT/tune_qwen_int4.log 2>&1; echo "int4 rc=$?"
timeout 60 $T --roles draft --draft-quant int8 > $OUT/tune_qwen_int8.log 2>&1; echo "int8 rc=$?"
for f in $OUT/tune_qwen*.log; do echo "== $f"; grep -v "it/s\]\|s/it\]" $f | grep "products per\|error\|Error" | tail -3; done
cp ~/.cache/spark-spec/kernels/*.json $OUT/ 2>/dev/null
pack s15_qwen_tune
timeout 90 python3 -m spec.sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 4 \
  --max-new-tokens 128 --k 4,6 --methods draft,auto --reps 1 --temperature 0 > $OUT/sweep2.log 2>&1; echo "sweep rc=$?"
grep -v "it/s\]" $OUT/sweep2.log | grep -A12 "^ *method\|best K\|auto:" | tail -10
timeout 120 python3 -m spec.tree_sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 3 \
  --max-new-tokens 128 --max-nodes 15 --trees "2,1;dynamic:15:4;auto:15" --quiet > $OUT/trees2.log 2>&1
echo "trees rc=$?"; grep -v "it/s\]" $OUT/trees2.log | tail -10
pack s15_qwen_real
timeout 150 python3 benchmarks/cpu/draft_quant.py --pair qwen-coder --device cuda --backend graph --prompts code,short \
  --quants none,int8,int4,fp8 --limit 3 --max-new-tokens 128 > $OUT/draft_quant.log 2>&1; echo "dq rc=$?"
grep -v "it/s\]" $OUT/draft_quant.log | tail -14
pack s15_qwen_quant
