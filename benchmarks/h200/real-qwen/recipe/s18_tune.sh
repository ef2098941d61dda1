# Session 18, second call, on the same warm machine: no session has tuned the 1B's packed one-token tiles on an H200
# (its table holds bf16's; packed weights take the rule: bf16's tile widened to its bytes, the head's only to 256
# columns).
# The tuner for the draft in int4 and int8, each kept only if the whole step gets faster, then bench_engine with
# what it kept. About 4 minutes.
source "$(dirname "$0")/env.sh"
rm -rf results; mkdir -p results
T="python3 -m spec.tune_kernels --pair llama-random --device cuda --roles draft"
timeout 100 $T --draft-quant int4 > $OUT/tune_int4.log 2>&1; echo "tune int4 rc=$?"
timeout 100 $T --draft-quant int8 > $OUT/tune_int8.log 2>&1; echo "tune int8 rc=$?"
for f in $OUT/tune_*.log; do echo "== $f"; grep -v "it/s\]\|s/it\]" $f | grep -v "^\s*$" | tail -8; done
cp ~/.cache/spark-spec/kernels/*.json $OUT/ 2>/dev/null; cp results/tune_kernels-*.json $OUT/ 2>/dev/null
timeout 120 python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4 \
  --ns 1,2,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf > $OUT/bench_tuned.log 2>&1; echo "bench rc=$?"
python3 -c "import json,glob; d=json.load(open(sorted(glob.glob('results/bench_engine-*.json'))[-1])); print({k: round(v, 3) for k, v in d.items() if isinstance(v, float) and any(s in k for s in ('tree', 'int', 'verify', 'tok_s', 'step'))})"
pack s18_tune
