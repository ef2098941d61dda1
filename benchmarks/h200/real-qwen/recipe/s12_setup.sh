# Session 12, after the 26 chunks: reassemble, check both SHA-256, convert (check_pair), then the Qwen pair's start,
# cold and warm, in fresh processes.

bash "$(dirname "$0")/setup.sh" 2>&1 | grep -v "it/s\]" | tail -12
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 150 python3 -m spec.start_time --pair qwen-coder --device cuda --backend graph > $OUT/start_qwen.log 2>&1; tail -6 $OUT/start_qwen.log
pack s12_setup
