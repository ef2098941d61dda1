# Session 23, on an H200 after s23_bench.sh: no session has tuned the 8B's 33-64-token tiles (a 64-node tree's
# verify) or the 1B's 2-16-token tiles (a frontier of 8) on this card. The tuner keeps only what makes its whole
# forward faster; then the engine bench again with what it kept.
source "$(dirname "$0")/env.sh"
mkdir -p results
T="python3 -m spec.tune_kernels --pair llama-random --device cuda"
timeout 220 $T --roles target --tokens 64 > $OUT/tune_target_64.log 2>&1; echo "tune 64 rc=$?"
timeout 120 $T --roles draft --tokens 8 > $OUT/tune_draft_8.log 2>&1; echo "tune draft 8 rc=$?"
for f in $OUT/tune_*.log; do echo "== $f"; grep -v "it/s\]\|s/it\]" $f | grep -v "^\s*$" | tail -6; done
cp ~/.cache/spark-spec/kernels/*.json $OUT/ 2>/dev/null; cp results/tune_kernels-*.json $OUT/ 2>/dev/null
timeout 240 python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph \
  --ns 1,8 --tree-nodes 16,32,64 --parts speed --no-hf > $OUT/bench_tuned.log 2>&1; echo "bench rc=$?"
grep -E "bar |frontier|tree" $OUT/bench_tuned.log | tail -20
cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench_engine-tuned.json
