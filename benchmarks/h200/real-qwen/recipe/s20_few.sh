# Session 20, first call (carry .whl): the 2-8-token products over packed weights on the CUDA cores (gemv_few).
# (1) the CUDA tests of the fused kernels over packed codes (1-17-token forwards against the layer stack, the int4
# products of 1, 3 and 8 tokens against float64), (2) bench_engine with gemv_few, then with SPARK_SPEC_FEW_TOKENS=0
# (the tensor-core kernel, as before), back to back on one card: the 1B's 1-16-token draft forwards with int8 / int4
# codes, the tree draft frontier of 8, (3) the 1B's products alone at 2, 4 and 8 tokens in the chosen tile and
# four others (packed_gemv.py --tokens). About 9 minutes.
source "$(dirname "$0")/env.sh"
rm -rf results; mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
PT="python3 -m pytest -q -p no:cacheprovider -rfE --tb=short"
timeout -s INT 170 $PT tests/test_kernels.py -k "quantized_fused_step_matches or int4_products_over_several_tiles_on_a_gpu or split_products_replayed" > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|^E " $OUT/tests.log | tail -8
B="python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4 \
  --ns 1,2,4,8,16 --tree-nodes 16 --parts speed --no-hf"
show() { python3 -c "import json,glob; d=json.load(open(sorted(glob.glob('results/bench_engine-*.json'))[-1])); print({k: round(v, 3) for k, v in d.items() if isinstance(v, float) and any(s in k for s in ('tree', 'int', 'tok_s', 'step'))}); print({r: {n: round(v, 3) for n, v in x.items()} for r, x in d['steps_ms']['graph'].items()})"; }
for v in few tc; do
  [ $v = tc ] && export SPARK_SPEC_FEW_TOKENS=0
  timeout 150 $B > $OUT/bench_$v.log 2>&1; echo "$v rc=$?"; show
  mkdir -p r_$v; mv results/* r_$v/; tar czf $OUT/s20_bench_$v.tgz r_$v
done
unset SPARK_SPEC_FEW_TOKENS
timeout 110 python3 benchmarks/h200/packed_gemv.py --no-count --schemes int4,int8 --tokens 2,4,8 \
  --json $OUT/packed_gemv_few.json > $OUT/packed_gemv_few.log 2>&1; echo "packed_gemv rc=$?"
cut -c1-100 $OUT/packed_gemv_few.log | tail -70
