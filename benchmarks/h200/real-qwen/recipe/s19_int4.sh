# Session 19, first call (no weights; carry .whl and .old, the kernels as they were before the int4 word kernel):
# (1) the CUDA tests of the fused kernels (the word kernel's inline LOP3 has run only in Triton's interpreter's
# stand-in), (2) bench_engine with the int4 word kernel, then with .old's kernels swapped in, back to back on one
# card: the 1B's int4 / int8 steps (issue 18's bars) and the tree verify (issue 19's). About 6 minutes.
source "$(dirname "$0")/env.sh"
rm -rf results; mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
PT="python3 -m pytest -q -p no:cacheprovider -rfE --tb=short"
timeout -s INT 150 $PT tests/test_kernels.py -k "quantized_fused_step_matches and int4" > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|^E " $OUT/tests.log | tail -8
B="python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4 \
  --ns 1,2,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf"
show() { python3 -c "import json,glob; d=json.load(open(sorted(glob.glob('results/bench_engine-*.json'))[-1])); print({k: round(v, 3) for k, v in d.items() if isinstance(v, float) and any(s in k for s in ('tree', 'int', 'verify', 'tok_s', 'step'))})"; }
cp spec/models/triton_kernels.py spec/models/kernels.py /tmp/
for v in words bytes; do
  [ $v = bytes ] && cp .old/triton_kernels.py .old/kernels.py spec/models/
  timeout 150 $B > $OUT/bench_$v.log 2>&1; echo "$v rc=$?"; show
  mkdir -p r_$v; mv results/* r_$v/; tar czf $OUT/s19_bench_$v.tgz r_$v
done
cp /tmp/triton_kernels.py /tmp/kernels.py spec/models/
# the 1B's int4 products alone, the word kernel in its tile and the alternates (packed_gemv.py)
timeout 90 python3 benchmarks/h200/packed_gemv.py --no-count --schemes int4 --json $OUT/packed_gemv_words.json \
  > $OUT/packed_gemv_words.log 2>&1; echo "packed_gemv rc=$?"; cut -c1-130 $OUT/packed_gemv_words.log | tail -12
