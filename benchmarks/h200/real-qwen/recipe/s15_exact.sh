# Session 15, real pair, warm machine: fp32 identity of token trees on the graph backend (a static 2,2,2 tree and a
# dynamic one), then the CUDA tests of trees and quantized drafts, each under SIGINT so pytest prints its summary.
source "$(dirname "$0")/env.sh"
rm -rf results
for tree in 2,2,2 dynamic:15:4; do
  timeout 120 python3 -m spec.spec_greedy --pair qwen-coder --device cuda --backend graph --dtype float32 --prompts code \
    --limit 2 --max-new-tokens 64 --tree $tree > $OUT/fp32_tree_${tree%%:*}.log 2>&1; echo "fp32 tree $tree rc=$?"
  grep -v "it/s\]" $OUT/fp32_tree_${tree%%:*}.log | grep -i "identical\|diverg\|error" | tail -4
done
pack s15_exact
timeout -s INT 140 python3 -m pytest -p no:cacheprovider -v -rfE --tb=short tests/test_graph_trees.py -k cuda \
  > $OUT/tree_tests.log 2>&1; grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/tree_tests.log | tail -8
timeout -s INT 140 python3 -m pytest -p no:cacheprovider -v -rfE --tb=short \
  tests/test_quant.py::test_cuda_graph_draft_quant_keeps_greedy_output > $OUT/quant_tests.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/quant_tests.log | tail -8
