# Session 21, a fresh machine (carry .whl, .old/s21): the CUDA test files over 14 workers with this session's
# kernels (K/V loaded before the PDL wait; gemv_few's tiles per product), then the one-token steps' profile.
source "$(dirname "$0")/env.sh"
rm -rf results; mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
timeout -s INT ${TEST_S:-300} python3 -m pytest -n 14 -v -p no:cacheprovider -rfE --tb=short tests/test_kernels.py \
  tests/test_graph.py tests/test_graph_trees.py tests/test_quant.py -k "not real" > $OUT/tests_cuda.log 2>&1
echo "tests rc=$?"; grep -E "FAILED|passed|failed" $OUT/tests_cuda.log | tail -12
timeout 120 python3 benchmarks/h200/step_profile.py --pair llama-random --device cuda --quants none,int8,int4 \
  --json $OUT/step_profile.json > $OUT/step_profile.log 2>&1; echo "profile rc=$?"
grep -v Warn $OUT/step_profile.log | grep -E "step|copy|attention"
