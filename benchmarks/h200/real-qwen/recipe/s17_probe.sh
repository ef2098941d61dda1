# Session 17's first call (no weights; carry .whl and .wts/old, the kernels as they stood at 128af38). Two changes:
# packed codes become floats without the integer-to-float instruction (`exact_float`), and 2-64-token products of
# few row blocks split over their inputs (`input_splits`). (1) the CUDA kernel tests; (2) bench_engine as it stands;
# (3) the same with SPARK_SPEC_SPLIT_INPUTS=0 (what the splits give); (4) the same with the old kernel files (what
# exact_float gives the packed draft steps). About 9 minutes with the start; each part packed as it ends.
source "$(dirname "$0")/env.sh"
rm -rf results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_kernels.py -k "not interpreter" \
  tests/test_quant.py::test_cuda_graph_draft_quant_keeps_greedy_output > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|^E " $OUT/tests.log | tail -8
B="python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4 \
  --ns 1,2,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf"
timeout 150 $B > $OUT/bench_new.log 2>&1; echo "new rc=$?"
grep -v "it/s\]" $OUT/bench_new.log | tail -14 | head -9
pack s17_new
SPARK_SPEC_SPLIT_INPUTS=0 timeout 150 $B > $OUT/bench_nosplit.log 2>&1; echo "nosplit rc=$?"
grep -v "it/s\]" $OUT/bench_nosplit.log | tail -14 | head -9
pack s17_nosplit
cp .wts/old/triton_kernels.py .wts/old/kernels.py spec/models/
timeout 150 $B > $OUT/bench_old.log 2>&1; echo "old rc=$?"
grep -v "it/s\]" $OUT/bench_old.log | tail -14 | head -9
pack s17_old
