# Session 28's second call (carry .whl), on the machine s28_first.sh warmed: the 8B's 16- and 32-token tiles tuned on
# this card (the H200's 2-16-token ones date from session 5, before PDL and split inputs), kept only where the whole
# captured forward gains >= 0.5 %; then the bars again with what was kept. ROPE as s28_first.sh chose it.
source "$(dirname "$0")/env.sh"
mkdir -p results
export SPARK_SPEC_ROPE_IN_PRODUCT=${ROPE:-1}
timeout ${TLIMIT:-300} python3 -m spec.tune_kernels --pair llama-random --device cuda --roles target --tokens 16,32 \
  > $OUT/tune_target_16_32.log 2>&1; echo "tune rc=$?"
grep -v "it/s\]\|s/it\]" $OUT/tune_target_16_32.log | grep -v "^\s*$" | tail -16
cp ~/.cache/spark-spec/kernels/*.json $OUT/ 2>/dev/null; cp "$(ls -t results/tune_kernels-*.json | head -1)" $OUT/ 2>/dev/null
timeout ${T:-200} python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph \
  --ns 1,8,16 --tree-nodes 16,32,64 --parts speed --no-hf > $OUT/bench_tuned.log 2>&1; echo "bench rc=$?"
grep -E "^bar" $OUT/bench_tuned.log
cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench_engine-tuned.json
