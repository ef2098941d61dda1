# Session 22, on the machine that holds the real pair: the real pair with an int4 target and an int4 draft (verifies of
# 3+ tokens through tinygemm, plain decoding through the fused kernels: identity up to bf16 near-ties), then the CUDA
# test files over 14 workers.
source "$(dirname "$0")/env.sh"
rm -rf results; mkdir -p results
timeout 150 python3 -m spec.spec_greedy --pair qwen-coder --device cuda --backend graph --target-quant int4 \
  --draft-quant int4 --prompts code --limit 6 --max-new-tokens 128 --k 4 > $OUT/spec_greedy-int4-int4.log 2>&1
echo "spec_greedy rc=$?"; grep -v "it/s\]" $OUT/spec_greedy-int4-int4.log | tail -14
pack s22_greedy_int4
timeout -s INT 330 python3 -m pytest -n 14 -q -p no:cacheprovider -rfE --tb=short tests/test_kernels.py \
  tests/test_graph.py tests/test_graph_trees.py tests/test_quant.py -k "not real" > $OUT/tests_cuda.log 2>&1
echo "tests rc=$?"; grep -E "FAILED|passed|failed" $OUT/tests_cuda.log | tail -12
