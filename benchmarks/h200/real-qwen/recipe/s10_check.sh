# Session 10, before the weights move: the fp32 graph tests (the stack graphed, not compiled, by default; compiled
# when asked), plain and speculative identity on the GPU, and llama-random's start, cold and warm, in-process and
# served; then a profile of a warm start (the Triton cache is warm from the start_time run's own folder).
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_graph.py -k "fp32_stack or cuda_greedy" > $OUT/tests.log 2>&1; tail -4 $OUT/tests.log
timeout 200 python3 -m spec.start_time --pair llama-random --device cuda --backend graph --server > $OUT/start_llama.log 2>&1; tail -8 $OUT/start_llama.log
pack s10_check
