# Session 10, after setup: the Qwen pair's start, cold and warm, in-process and served; then a warm child under
# cProfile (default caches, warm after the first of the two) to see where a warm start goes.
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 240 python3 -m spec.start_time --pair qwen-coder --device cuda --backend graph --server > $OUT/start_qwen.log 2>&1; tail -8 $OUT/start_qwen.log
for i in 1 2; do
  timeout 120 python3 -m cProfile -o $OUT/warm$i.prof -m spec.start_time --pair qwen-coder --device cuda --backend graph --child --quiet --launched-at $(date +%s.%N) 2>&1 | tail -1
done
python3 -c "import pstats; pstats.Stats('$OUT/warm2.prof').sort_stats('cumulative').print_stats(45)" > $OUT/warm2.txt 2>&1; grep -E "cumtime|spec/|triton|load|capture" $OUT/warm2.txt | head -45
pack s10_start
