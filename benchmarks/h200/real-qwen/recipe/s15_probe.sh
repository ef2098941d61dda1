# Session 15, no weights (carry .whl): (1) bench_engine on llama-random as in s14_probe.sh, to see what session 14's
# CPU-side changes give on a GPU (tree masks made on the host, non-blocking layouts: the frontier of 8 was 1.613 draft
# steps, its 8-token forward alone 1.40); (2) the CUDA tests of trees and of quantized drafts that no session has run
# to their end on an H200, each under SIGINT so pytest prints its summary. About 9 minutes with the start.
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 200 python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4,fp8 \
  --ns 1,2,5,8,16 --tree-nodes 16,17,32,64 --parts speed --no-hf > $OUT/bench.log 2>&1; echo "bench rc=$?"
grep -v "it/s\]" $OUT/bench.log | tail -16
pack s15_probe
timeout -s INT 150 python3 -m pytest -p no:cacheprovider -v -rfE --tb=short tests/test_graph_trees.py -k cuda \
  > $OUT/tree_tests.log 2>&1; grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/tree_tests.log | tail -8
timeout -s INT 150 python3 -m pytest -p no:cacheprovider -v -rfE --tb=short \
  tests/test_quant.py::test_cuda_graph_draft_quant_keeps_greedy_output > $OUT/quant_tests.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/quant_tests.log | tail -8
