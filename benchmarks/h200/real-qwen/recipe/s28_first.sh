# Session 28's first call (carry .whl): every CUDA test of the kernels and the graphed trees (the fixed bit-for-bit
# test of the rotary embedding in the q/k/v product among them), then one bench_engine run for issues 18 and 19's
# bars: with the rotary in the product (ROPE_IN_PRODUCT) when its test passed, under today's default otherwise.
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
timeout ${T1:-200} python3 -m pytest -n 8 -q -p no:cacheprovider -rfE --tb=short tests/test_kernels.py \
  tests/test_graph_trees.py -k "not interpreter" > $OUT/tests-cuda.log 2>&1; echo "tests rc=$?"; tail -n 8 $OUT/tests-cuda.log
if grep -q "FAILED.*rope_in_the_qkv" $OUT/tests-cuda.log; then ROPE=0; else ROPE=${ROPE:-1}; fi; echo "ROPE=$ROPE"
SPARK_SPEC_ROPE_IN_PRODUCT=$ROPE timeout ${T:-300} python3 -m spec.bench_engine --pair llama-random --device cuda \
  --backends graph --draft-quants int8,int4 --ns 1,2,3,4,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf \
  > $OUT/bench-rope$ROPE.log 2>&1
echo "bench rc=$?"; grep -E "^bar|ratio|frontier|step" $OUT/bench-rope$ROPE.log | head -30
cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench_engine-rope$ROPE.json
