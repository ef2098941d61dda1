# The next session's first call (carry .whl; unrun in session 26): every CUDA test of the kernels and the graphed
# trees (session 26's ran out of time: `-k "cuda or gpu"` had also missed the attention's own tests), the 8B's wide
# verifies with the rule against 32 positions a program, and the bars on any GPU (on an H100 they set today's
# defaults against benchmarks/h100/session25/bench_engine-base, taken under session 23's rules).
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
timeout ${T1:-220} python3 -m pytest -n 8 -q -p no:cacheprovider -rfE --tb=short tests/test_kernels.py \
tests/test_graph_trees.py -k "not interpreter" > $OUT/tests-cuda.log 2>&1; echo "tests rc=$?"; tail -n 4 $OUT/tests-cuda.log
timeout ${VLIMIT:-90} python3 benchmarks/h200/step_variants.py --pair llama-random --device cuda --ns 16 \
--tree-nodes 32,64 --variants fused+pdl,chunk32+pdl,fused+pdl --json $OUT/variants-rule.json \
> $OUT/variants-rule.log 2>&1; echo "variants rc=$?"; grep -v -i warn $OUT/variants-rule.log | grep " ms$"
# on any GPU: on an H100 it sets today's defaults against session 25's base run
timeout 170 python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph \
  --draft-quants int8,int4 --ns 1,2,3,4,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf > $OUT/bench.log 2>&1
echo "bench rc=$?"; grep -E "^bar" $OUT/bench.log
cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench_engine.json
