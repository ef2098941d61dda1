# Session 34, on whichever card comes (carry .whl): the w4a8 draft (int4 codes x 8-bit inputs in its one-token
# products) -- its CUDA tests, the step in one bench_engine run beside int8 and int4 (issue 18's bars), then
# each 1B product alone beside int4's.
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"; echo "$GPU" > $OUT/gpu.txt
timeout ${T0:-150} python3 -m pytest -n 4 -q -p no:cacheprovider -rfEs --tb=short tests/test_kernels.py \
  tests/test_quant.py -k "w4a8 and gpu or keeps_greedy_output" > $OUT/tests-a8.log 2>&1
echo "tests rc=$?"; tail -n 4 $OUT/tests-a8.log
timeout ${T2:-200} python3 -m spec.bench_engine --pair llama-random --device cuda \
  --backends graph --draft-quants int8,int4,w4a8 --ns 1,2,4,5 --parts speed --no-hf > $OUT/bench.log 2>&1
echo "bench rc=$?"; grep -E "^bar|draft_step_ms|c_graph" $OUT/bench.log
cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench_engine.json
timeout ${T1:-150} python3 benchmarks/h200/packed_gemv.py --schemes int4,w4a8 --no-libraries --no-count \
  --json $OUT/packed_gemv.json > $OUT/packed_gemv.log 2>&1; echo "products rc=$?"; grep -v "^wrote" $OUT/packed_gemv.log | tail -n 20
