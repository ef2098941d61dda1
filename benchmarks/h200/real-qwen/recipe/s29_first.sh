# Session 29, the first call on whatever GPU comes (carry .whl). On an H200: issues 18 and 19's bars under today's
# defaults (one bench_engine run) first. On any card: the streamed one-token products (kernels.STREAM) checked bit
# for bit against a program a block (CUDA test), then timed against it in one process, alternating, for the 1B's
# int4 and int8 steps and the 8B's step (step_variants; stream<N> = N programs a multiprocessor,
# stream1000 = gemv_stream with a program a block). Each step saves its
# files under $OUT as it ends.
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
if [[ "$GPU" == *H200* && "${BARS:-1}" = 1 ]]; then
  timeout ${T:-160} python3 -m spec.bench_engine --pair llama-random --device cuda \
    --backends graph --draft-quants int8,int4 --ns 1,2,3,4,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf \
    > $OUT/bench.log 2>&1
  echo "bench rc=$?"; grep -E "^bar" $OUT/bench.log
  cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench_engine.json
fi
timeout ${T1:-120} python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels.py \
  -k "streamed_one_token_products_on_a_gpu" > $OUT/tests-stream.log 2>&1; echo "stream test rc=$?"
tail -n 3 $OUT/tests-stream.log
for quant in ${QUANTS:-int4 int8}; do
  timeout ${T2:-150} python3 benchmarks/h200/step_variants.py --pair llama-random --device cuda --ns 1 \
    --variants ${VARIANTS:-fused+pdl,stream1+pdl,stream2+pdl,stream4+pdl,stream1000+pdl,fused+pdl} --draft-quant $quant \
    --json $OUT/stream-$quant.json > $OUT/stream-$quant.log 2>&1; echo "variants $quant rc=$?"
  grep -E "^(target|draft)|: c " $OUT/stream-$quant.log | grep -v "it/s"
done
