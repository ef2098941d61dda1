# Session 23, first call of a machine (carry .whl): the launches between int4 library products fused
# (kernels.LIBRARY_FUSED). The CUDA tests that touch them (the fused path against the apart one, bit for bit), then
# the 1B int4 draft's forwards of 1-16 tokens, fused and apart, twice each, alternating, in one process.
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
timeout 240 python3 -m pytest -n 8 -q -p no:cacheprovider -rfE --tb=short tests/test_kernels.py \
  -k "library or quantized_fused_step" > $OUT/tests.log 2>&1; echo "tests rc=$?"; tail -4 $OUT/tests.log
timeout 300 python3 benchmarks/h200/step_variants.py --pair llama-random --device cuda --draft-quant int4 \
  --ns 1,2,3,4,5,8,16 --variants fused+pdl,apart+pdl,fused+pdl,apart+pdl \
  --json $OUT/step_variants-library-fused.json > $OUT/step_variants.log 2>&1; echo "variants rc=$?"
grep -E "^draft|c [0-9]" $OUT/step_variants.log | tail -40
