# Session 27's first call (carry .whl): the q/k/v product with its rotary embedding in its epilogue
# (`kernels.ROPE_IN_PRODUCT`, variant "rope") against the rule, alternated in one process; then every CUDA test of
# the kernels and the graphed trees (sessions 24-27's kernels: never all run on a GPU).
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
timeout ${VLIMIT:-200} python3 benchmarks/h200/step_variants.py --pair llama-random --device cuda --ns ${NS:-1,2,8,16} \
  --tree-nodes 16,32,64 --variants fused+pdl,rope+pdl,fused+pdl,rope+pdl --json $OUT/variants-rope.json \
  > $OUT/variants-rope.log 2>&1; echo "variants rc=$?"; grep -v -i warn $OUT/variants-rope.log | grep -E " ms$|frontier|verify"
timeout ${T1:-220} python3 -m pytest -n 8 -q -p no:cacheprovider -rfE --tb=short tests/test_kernels.py \
  tests/test_graph_trees.py -k "not interpreter" > $OUT/tests-cuda.log 2>&1; echo "tests rc=$?"; tail -n 6 $OUT/tests-cuda.log
