# Written in session 23 for the next machine (carry .whl), not yet run: the stronger fused-library test on a GPU
# (every norm its own weights, a down product the library cannot take), then where an 8-token forward of the 1B
# spends its time per product in bf16 / int8 / int4 (int8's took 1.68 ms on an H100 against bf16's 1.29, though its
# products alone summed to 0.87 ms at 9 tokens in the tuner), and the one-token step beside it.
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
timeout 150 python3 -m pytest -n 8 -q -p no:cacheprovider -rfE --tb=short tests/test_kernels.py \
  -k "library or quantized_fused_step or step_profile" > $OUT/tests.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/tests.log
for n in 8 1; do
  timeout 200 python3 benchmarks/h200/step_profile.py --pair llama-random --device cuda --roles draft \
    --quants none,int8,int4 --tokens $n --json $OUT/step_profile-1b-$n.json > $OUT/step_profile-$n.log 2>&1
  echo "profile $n rc=$?"; cut -c1-140 $OUT/step_profile-$n.log | grep -v Warning | tail -36
done
