# Session 25, last call (carry .whl; not run: the device time ran out): the attention's changes on a GPU -- chunks
# past the text store and read no partial sums; 64 cached positions a program where a head's rows fill more than
# one -- first the CUDA tests of the attention, the fused kernels and the graphed trees, then the 8B's wide verifies
# with the rule against 32 for all; on an H200, then issue 18's and 19's bars under today's defaults.
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
timeout 110 python3 -m pytest -n 8 -q -p no:cacheprovider -rfE --tb=short tests/test_kernels.py tests/test_graph_trees.py \
  -k "cuda or gpu" > $OUT/tests-cuda.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/tests-cuda.log
timeout ${VLIMIT:-90} python3 benchmarks/h200/step_variants.py --pair llama-random --device cuda --ns 16 \
  --tree-nodes 32,64 --variants fused+pdl,chunk32+pdl,fused+pdl --json $OUT/variants-rule.json \
  > $OUT/variants-rule.log 2>&1; echo "variants rc=$?"; grep -v -i warn $OUT/variants-rule.log | grep " ms$"
if [[ "$GPU" == *H200* ]]; then
  timeout 170 python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph \
    --draft-quants int8,int4 --ns 1,2,3,4,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf > $OUT/bench.log 2>&1
  echo "bench rc=$?"; grep -E "^bar" $OUT/bench.log
  cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench_engine.json
fi
