# Session 19, second call, same machine (carry .whl and .old): the 1B's products alone with the int4 word kernel
# in its tile and alternates, then the kernels before it (benchmarks/h200/packed_gemv.py), then the tuner on the
# word kernel's tiles (kept only if the whole step gets faster) and bench_engine with what it kept. About 5 minutes.
source "$(dirname "$0")/env.sh"
rm -rf results; mkdir -p results
cp spec/models/triton_kernels.py spec/models/kernels.py /tmp/
for v in words bytes; do
  [ $v = bytes ] && cp .old/triton_kernels.py .old/kernels.py spec/models/
  timeout 100 python3 benchmarks/h200/packed_gemv.py --no-count --schemes int4,int8 --json $OUT/packed_gemv_$v.json \
    > $OUT/packed_gemv_$v.log 2>&1; echo "packed_gemv $v rc=$?"; cut -c1-130 $OUT/packed_gemv_$v.log | tail -14
done
cp /tmp/triton_kernels.py /tmp/kernels.py spec/models/
timeout 120 python3 -m spec.tune_kernels --pair llama-random --device cuda --roles draft --draft-quant int4 \
  > $OUT/tune_int4.log 2>&1; echo "tune int4 rc=$?"; grep -v "it/s\]\|s/it\]" $OUT/tune_int4.log | grep -v "^\s*$" | tail -10
cp ~/.cache/spark-spec/kernels/*.json $OUT/ 2>/dev/null; cp results/tune_kernels-*.json $OUT/ 2>/dev/null
timeout 120 python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int4 \
  --ns 1,2,5,8,16 --parts speed --no-hf > $OUT/bench_tuned.log 2>&1; echo "bench rc=$?"
python3 -c "import json,glob; d=json.load(open(sorted(glob.glob('results/bench_engine-*.json'))[-1])); print({k: round(v, 3) for k, v in d.items() if isinstance(v, float) and any(s in k for s in ('int', 'step'))})"
pack s19_int4b
