# Before the weights move: the CUDA tests of the graph backend (tiny and random models) and llama-random's start
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_graph.py tests/test_dist.py \
  -k "split_attention or fused_step_matches or compiles_nothing or cuda_greedy or chunks or rows_on_the_gpu" 2>&1 | tail -15
python3 -m spec.start_time --pair llama-random --device cuda --backend graph 2>&1 | tail -8
pack check
