# Session 23, a fresh machine: the int8 1B's forwards of 3-16 tokens took 1.39-1.98 ms on an H200 against bf16's
# 1.13-1.25 (bench_engine-session23.json), though they read half the bytes: no session has tuned its 2-16-token
# tensor-core tiles (add_rows@int8, ...). The tuner at 9 tokens (kept only if the whole forward gets faster), then the
# engine bench with what it kept, with 2-4 tokens on gemv_few (the default) and on the tensor cores.
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
timeout 240 python3 -m spec.tune_kernels --pair llama-random --device cuda --roles draft --draft-quant int8 \
  --tokens 9 > $OUT/tune_int8_9.log 2>&1; echo "tune rc=$?"
grep -v "it/s\]\|s/it\]" $OUT/tune_int8_9.log | grep -v "^\s*$" | tail -8
cp ~/.cache/spark-spec/kernels/*.json $OUT/ 2>/dev/null; cp results/tune_kernels-*.json $OUT/ 2>/dev/null
for few in 4 0; do
  SPARK_SPEC_FEW_TOKENS=$few timeout 150 python3 -m spec.bench_engine --pair llama-random --device cuda \
    --backends graph --draft-quants int8 --ns 1,2,3,4,5,8,16 --tree-nodes 16 --parts speed --no-hf \
    > $OUT/bench_int8_few$few.log 2>&1; echo "bench few=$few rc=$?"
  cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench_engine-int8-few$few.json
  grep -E "draft_int8|draft  |frontier" $OUT/bench_int8_few$few.log | grep -v "it/s" | tail -4
done
