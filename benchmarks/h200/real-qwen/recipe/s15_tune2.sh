# The int4 / int8 tunings of s15_tune.sh again (its tuner loaded the draft quantized before packing it: fixed), then
# s15_probe.sh's bench_engine, on the same warm machine.
source "$(dirname "$0")/env.sh"
rm -rf results
T="python3 -m spec.tune_kernels --pair llama-random --device cuda"
timeout 80 $T --roles draft --draft-quant int4 > $OUT/tune_draft_int4.log 2>&1; echo "draft int4 rc=$?"
timeout 80 $T --roles draft --draft-quant int8 > $OUT/tune_draft_int8.log 2>&1; echo "draft int8 rc=$?"
for f in $OUT/tune_*.log; do echo "== $f"; grep -v "it/s\]\|s/it\]" $f | grep -v "^\s*$" | tail -9; done
cp ~/.cache/spark-spec/kernels/*.json $OUT/ 2>/dev/null
pack s15_tune2
timeout 220 python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4,fp8 \
  --ns 1,2,5,8,16 --tree-nodes 16,17,32,64 --parts speed --no-hf > $OUT/bench.log 2>&1; echo "bench rc=$?"
grep -v "it/s\]" $OUT/bench.log | tail -16
pack s15_probe
