# Session 26, second call on an H200 (carry .whl), after s26_first.sh: the 8B's 2-16-token tiles on this card were
# tuned at 9 tokens (session 5, before PDL and split inputs), its 17-32-token ones in session 16; a 16- and a 32-node
# tree's verify (bars 1.12 / 1.25 one-token steps) run those. The tuner keeps a forward size's tiles only where its
# whole captured forward is >= 0.5 % faster; then the bars again with what it kept (8-token verify included: the
# 2-16-token tiles serve it too).
source "$(dirname "$0")/env.sh"
mkdir -p results
T="python3 -m spec.tune_kernels --pair llama-random --device cuda"
timeout ${TLIMIT:-300} $T --roles target --tokens 16,32 > $OUT/tune_target_16_32.log 2>&1; echo "tune rc=$?"
grep -v "it/s\]\|s/it\]" $OUT/tune_target_16_32.log | grep -v "^\s*$" | tail -22
cp ~/.cache/spark-spec/kernels/*.json $OUT/ 2>/dev/null; cp results/tune_kernels-*.json $OUT/ 2>/dev/null
timeout 200 python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph \
  --ns 1,8,16 --tree-nodes 16,32,64 --parts speed --no-hf > $OUT/bench_tuned.log 2>&1; echo "bench rc=$?"
grep -E "^bar" $OUT/bench_tuned.log
cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench_engine-tuned.json
