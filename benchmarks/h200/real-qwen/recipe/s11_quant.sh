# Session 11 (issue 18), no weights needed (the interpreter tests are left out: Triton is installed there, and they
# take minutes of CPU that the timings would share): the CUDA tests of int8 / int4 weights (the eager layers on CUDA, the
# graph backend's fused kernels over packed codes against the weights they stand for, greedy identity with a
# quantized draft) and the kernels' regression tests; then bench_engine on llama-random with int8 and int4 drafts
# beside the bf16 one, in one run (the issue's bars: int4 step <= 0.40 ms and c <= 0.10, int8 <= 0.55 ms, the 8B
# plain decode >= 240 tok/s).
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 280 python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4 \
  --parts speed --no-hf > $OUT/bench.log 2>&1; echo "bench rc=$?"; grep -v "it/s\]" $OUT/bench.log | tail -30
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_quant.py tests/test_kernels.py tests/test_graph.py \
  -k "(cuda or quantized or fused or split) and not interpreter" -rf --tb=short > $OUT/tests.log 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests.log | tail -15
pack s11_quant
