# Session 21, after s21_gpu.sh on a warm machine: its profile ran beside the interrupted test workers (copy rate
# 2.23 TB/s), so it runs again alone; then the CUDA test files over 14 workers, each test listed.
pkill -f "python3 -m pytest"; sleep 1; nvidia-smi --query-compute-apps=pid,used_memory --format=csv
source "$(dirname "$0")/env.sh"
timeout 150 python3 benchmarks/h200/step_profile.py --pair llama-random --device cuda --quants none,int8,int4 \
  --json $OUT/step_profile.json > $OUT/step_profile.log 2>&1; echo "profile rc=$?"
grep -v Warn $OUT/step_profile.log | grep -E "step|copy"
timeout -s INT ${TEST_S:-330} python3 -m pytest -n 14 -v -p no:cacheprovider -rfE --tb=short tests/test_kernels.py \
  tests/test_graph.py tests/test_graph_trees.py tests/test_quant.py -k "not real" > $OUT/tests_cuda.log 2>&1
echo "tests rc=$?"; grep -E "FAILED|passed|failed" $OUT/tests_cuda.log | tail -15
