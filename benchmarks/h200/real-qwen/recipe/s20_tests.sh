# For the next machine (carry .whl): every CUDA test of the fused kernels in a call of its own (session 20's two
# calls ran out of time compiling after 3 passed each): the quantized fused walks, the int4 products of 1-4 tokens,
# the int8 / fp8 few-token products, the split products. Then the 1B's packed products alone at 2 and 4 tokens in
# gemv_few's tile and others (the int4 tile unhalved among them: the sm_90 counts favour it for o, down and the head).
source "$(dirname "$0")/env.sh"
rm -rf results; mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
timeout -s INT 420 python3 -m pytest -v -p no:cacheprovider -rfE --tb=short tests/test_kernels.py > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/tests.log | tail -40
timeout 150 python3 benchmarks/h200/packed_gemv.py --no-count --schemes int8,int4 --tokens 2,4 \
  --json $OUT/packed_gemv_few.json > $OUT/packed_gemv_few.log 2>&1; echo "packed_gemv rc=$?"
cut -c1-100 $OUT/packed_gemv_few.log | tail -48
