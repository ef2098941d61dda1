# Session 33, on whichever card comes (carry .whl): issue 19's bars and issue 18's steps in one bench_engine run
# (the bars name an H200; on an H100 the ratios are that card's), then every CUDA test, which had not run since
# session 32 changed the graph backend's cache (written by slices, allocated by `_allocate`) and its `quantized`.
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"; echo "$GPU" > $OUT/gpu.txt
timeout ${T:-170} python3 -m spec.bench_engine --pair llama-random --device cuda \
  --backends graph --draft-quants int8,int4 --ns 1,2,3,4,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf \
  > $OUT/bench.log 2>&1
echo "bench rc=$?"; grep -E "^bar" $OUT/bench.log
cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench_engine.json
timeout ${T1:-330} python3 -m pytest -n 8 -q -p no:cacheprovider -rfE --tb=short tests/test_kernels.py \
  tests/test_graph_trees.py tests/test_graph.py tests/test_quant.py tests/test_common.py tests/test_dist.py \
  -k "not interpreter" > $OUT/tests-cuda.log 2>&1; echo "tests rc=$?"; tail -n 6 $OUT/tests-cuda.log
