# Session 14, no weights: what session 13's calls could not finish. (1) The CUDA tests of token trees and of the
# quantized kernels (the rewritten int4 multi-token product), each interrupted (not killed) at its limit so pytest
# prints its summary; (2) bench_engine on llama-random as in s13_probe.sh, with fp8 (tree forwards of 16/17/32/64 nodes,
# int8/int4 drafts); (3) the 8B plain decode now that the loop waits for the prefill (the "regression" was the
# chunked 512-token prefill counted in the first round). About 9 minutes with the start. The first process writes the
# bytecode cache.
source "$(dirname "$0")/env.sh"
rm -rf results
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider tests/test_graph_trees.py -rfE --tb=short > $OUT/tree_tests.log 2>&1
tail -12 $OUT/tree_tests.log
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py::test_quantized_fused_step_matches_the_weights_it_stands_for \
  tests/test_quant.py::test_cuda_graph_draft_quant_keeps_greedy_output tests/test_kernels.py::test_fused_step_matches_layer_stack \
  -rfE --tb=line > $OUT/quant_tests.log 2>&1; grep -E "^(FAILED|ERROR)|passed|failed|^E " $OUT/quant_tests.log | tail -12
timeout 200 python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4,fp8 \
  --ns 1,2,5,8,16 --tree-nodes 16,17,32,64 --parts speed --no-hf > $OUT/bench.log 2>&1; echo "bench rc=$?"
grep -v "it/s\]" $OUT/bench.log | tail -14
pack s14_probe
