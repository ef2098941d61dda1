# Session 15, no weights, right after s15_tune.sh on the same warm machine (its tuned tiles in the kernel file):
# (1) bench_engine on llama-random as in s14_probe.sh: tree verifies, the frontier of 8, int8/int4/fp8 draft steps
# (session 14: 1.142/1.822/1.707/3.923 steps for 16/17/32/64 nodes, frontier 1.613 draft steps, int4 0.880 ms);
# (2) the CUDA tests of trees and of quantized drafts that no session has run to their end on an H200, each under
# SIGINT so pytest prints its summary. About 8 minutes.
source "$(dirname "$0")/env.sh"
rm -rf results
ls ~/.cache/spark-spec/kernels/
timeout 220 python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4,fp8 \
  --ns 1,2,5,8,16 --tree-nodes 16,17,32,64 --parts speed --no-hf > $OUT/bench.log 2>&1; echo "bench rc=$?"
grep -v "it/s\]" $OUT/bench.log | tail -16
pack s15_probe
timeout -s INT 150 python3 -m pytest -p no:cacheprovider -v -rfE --tb=short tests/test_graph_trees.py -k cuda \
  > $OUT/tree_tests.log 2>&1; grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/tree_tests.log | tail -8
timeout -s INT 150 python3 -m pytest -p no:cacheprovider -v -rfE --tb=short \
  tests/test_quant.py::test_cuda_graph_draft_quant_keeps_greedy_output > $OUT/quant_tests.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/quant_tests.log | tail -8
