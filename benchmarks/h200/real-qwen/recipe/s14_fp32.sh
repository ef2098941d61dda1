# Session 14, real pair, if device time is left after s14_real.sh: fp32 identity on the graph backend (issue 17;
# its first try spent its 150 s converting the fp32 copy).
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 240 python3 -m spec.spec_greedy --pair qwen-coder --device cuda --backend graph --dtype float32 --prompts code \
  --limit 2 --max-new-tokens 64 --k 4 --quiet > $OUT/fp32.log 2>&1; echo "fp32 rc=$?"; grep -v "^answer\|^$\|it/s\]" $OUT/fp32.log | tail -8
pack s14_real
