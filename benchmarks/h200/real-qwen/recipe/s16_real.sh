# Session 16, real pair, after s12_chunk.sh x 28 and s12_setup.sh (which also times the Qwen pair's start): the draft
# format the command line now picks by itself (`--draft-quant auto`: int8 in the graph backend's kernels in bf16)
# against the bf16 draft. (1) spec_greedy on code, the default and --draft-quant none, with transformers' plain and
# assisted generate beside them (issue 17's >= 1.2x ours-vs-plain and >= 5x ours-vs-assisted bars); (2) the K sweep
# with the default draft (measured vs predicted at the best K, adaptive K); (3) the server's start and first request.
# Under 600 s; each part packed as it ends.
source "$(dirname "$0")/env.sh"
rm -rf results
G="python3 -m spec.spec_greedy --pair qwen-coder --device cuda --backend graph --prompts code --limit 6 --max-new-tokens 128 --k 4"
for q in auto none; do
  timeout 110 $G --draft-quant $q --compare-hf > $OUT/greedy_$q.log 2>&1
  echo "greedy $q rc=$?"; grep -v "it/s\]" $OUT/greedy_$q.log | grep -E "ALL|speculative output|transformers|draft" | tail -4
done
pack s16_greedy
timeout 130 python3 -m spec.sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 4 \
  --max-new-tokens 128 --k 2,4,6,8 --methods draft,auto --reps 1 --temperature 0 > $OUT/sweep.log 2>&1
echo "sweep rc=$?"; grep -v "it/s\]" $OUT/sweep.log | tail -12
pack s16_sweep
timeout 150 python3 -m spec.start_time --pair qwen-coder --device cuda --backend graph --server > $OUT/start.log 2>&1
echo "start rc=$?"; grep -v "it/s\]" $OUT/start.log | tail -8
pack s16_real
