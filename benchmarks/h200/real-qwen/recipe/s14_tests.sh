# Session 14, last call, no weights: the CUDA tests s14_probe.sh did not reach (its tree file spent its time on the
# CPU tests and one CUDA test; its quantized tests reached int8/int4 only): fp8 first, then the trees.
source "$(dirname "$0")/env.sh"
timeout -s INT 130 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
  "tests/test_kernels.py::test_quantized_fused_step_matches_the_weights_it_stands_for" -k "fp8 or draft_quant" \
  tests/test_quant.py::test_cuda_graph_draft_quant_keeps_greedy_output > $OUT/fp8_tests.log 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|^E " $OUT/fp8_tests.log | tail -8
timeout -s INT 110 python3 -m pytest -p no:cacheprovider -rfE --tb=short tests/test_graph_trees.py -k cuda -v \
  > $OUT/tree_cuda_tests.log 2>&1; grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/tree_cuda_tests.log | tail -10
