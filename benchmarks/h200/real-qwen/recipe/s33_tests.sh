# Session 33, second call: the CUDA tests only (s33.sh's run of six whole files reached its limit at 62 %, every
# test so far passing): test_kernels.py and test_graph_trees.py whole, and the CUDA-marked tests of the other files
# (benchmarks/h100/session33/cuda_tests.txt, listed from the tests' own skipif markers).
source "$(dirname "$0")/env.sh"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
timeout ${T1:-330} python3 -m pytest -n 8 -q -p no:cacheprovider -rfE --tb=short tests/test_kernels.py \
  tests/test_graph_trees.py $(cat benchmarks/h100/session33/cuda_tests.txt) -k "not interpreter" \
  > $OUT/tests-cuda-2.log 2>&1; echo "tests rc=$?"; tail -n 8 $OUT/tests-cuda-2.log
