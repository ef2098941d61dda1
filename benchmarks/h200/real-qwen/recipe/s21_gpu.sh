# Session 21, the first call of a fresh machine (carry .whl, which now holds pytest-xdist and execnet): the whole
# test suite over 14 workers (session 20's two calls ran out of time compiling the CUDA tests one after another),
# then where the 1B's and the 8B's one-token steps spend their time, per product, in bf16 / int8 / int4
# (benchmarks/h200/step_profile.py: own time, the graphed step, the launch floor, the byte floor).
source "$(dirname "$0")/env.sh"
rm -rf results; mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
timeout -s INT ${TEST_S:-330} python3 -m pytest -n 14 -q -p no:cacheprovider -rfEs --tb=short --continue-on-collection-errors --ignore=tests/test_server_robustness.py tests/ > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests.log | tail -30
grep -E "^SKIPPED" $OUT/tests.log | cut -c1-160 | sort | uniq -c | sort -rn | head -12
timeout 200 python3 benchmarks/h200/step_profile.py --pair llama-random --device cuda --quants none,int8,int4 \
  --json $OUT/step_profile.json > $OUT/step_profile.log 2>&1; echo "profile rc=$?"
cut -c1-140 $OUT/step_profile.log | grep -v Warning | tail -70
