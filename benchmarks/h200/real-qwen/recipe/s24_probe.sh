# Session 24, first call (carry .whl): the 2-64-token products over the models' own weights three ways,
# alternating in one process: as they run (`fused`), split over their inputs wherever row blocks leave
# multiprocessors idle (`splitall`: kernels.SPLIT_PLAIN), and through cuBLAS with our input and epilogue kernels
# around it (`cublas2-64`: kernels.LIBRARY_PLAIN), 8B and 1B in bf16: forwards of 1 / 2 / 8 / 16 tokens, the 8B's
# tree verify of 16 / 32 / 64 nodes, the 1B's frontier of 8. Then, in what time is left, the stronger fused-library
# test on a GPU.
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
timeout 420 python3 benchmarks/h200/step_variants.py --pair llama-random --device cuda --ns 1,2,8,16 \
  --tree-nodes 16,32,64 \
  --variants fused+pdl,splitall+pdl,cublas2-64+pdl,fused+pdl,splitall+pdl,cublas2-64+pdl \
  --json $OUT/variants.json > $OUT/variants.log 2>&1; echo "variants rc=$?"
grep -v -i warn $OUT/variants.log | tail -7
timeout 90 python3 -m pytest -n 8 -q -p no:cacheprovider -rfE --tb=short tests/test_kernels.py \
  -k "library_products_fused or split_products" > $OUT/tests.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/tests.log
