# Session 26, first call (carry .whl). A verify's attention in one kernel (`kernels.PART_ROWS`, off by default): on an
# H100 the 8B's 16-token verify spent 10.1 µs a layer in attention (partial sums 6.0, their combine 4.1) for 0.7 µs
# of bytes, whatever the chunk size (chunk64/128 changed the forward by < 0.5 %), so not bytes but the chain of two
# kernels. 1. The forwards of the bars, the rule against the new path at 16 and 64 rows a program, alternated in one
# process; 2. the CUDA tests of the attention, the fused kernels and the graphed trees (session 25's changes never ran
# on a GPU), then the attention's and the trees' again with the new path on.
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
timeout ${VLIMIT:-200} python3 benchmarks/h200/step_variants.py --pair llama-random --device cuda --ns ${NS:-1,2,8,16} \
  --tree-nodes ${TREES:-16,32,64} --variants ${VARIANTS:-fused+pdl,parts16+pdl,parts64+pdl,fused+pdl} \
  --json $OUT/variants-parts.json > $OUT/variants-parts.log 2>&1; echo "variants rc=$?"
grep -v -i warn $OUT/variants-parts.log | grep -E " ms$|^[a-z0-9+#]+: c "
PYTEST="python3 -m pytest -n 8 -q -p no:cacheprovider -rfE --tb=short"
timeout ${T1:-130} $PYTEST tests/test_kernels.py tests/test_graph_trees.py -k "not interpreter" > $OUT/tests-cuda.log 2>&1
echo "tests rc=$?"; tail -n 4 $OUT/tests-cuda.log
SPARK_SPEC_PART_ROWS=16 timeout ${T2:-100} $PYTEST tests/test_kernels.py tests/test_graph_trees.py \
  -k "split_attention or fused_step_matches or cuda_tree or cuda_graph_trees" > $OUT/tests-cuda-parts.log 2>&1
echo "tests parts rc=$?"; tail -n 4 $OUT/tests-cuda-parts.log
