# Session 20, second machine, after s12_chunk.sh x 28 (the first carrying .whl too): gemv_few's second version (each
# token's sums in the one-token kernel's layouts; int4 inputs read four at a time). (1) the CUDA tests of the fused
# kernels over int4 / int8 codes (1-17-token forwards against the layer stack; int4 products of 1, 3 and 8 tokens
# against float64), (2) bench_engine with gemv_few, then with SPARK_SPEC_FEW_TOKENS=0 (the tensor-core kernel),
# back to back on one card. About 7 minutes.
source "$(dirname "$0")/env.sh"
rm -rf results; mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
PT="python3 -m pytest -q -p no:cacheprovider -rfE --tb=short"
timeout -s INT 130 $PT tests/test_kernels.py -k "int4_products_over_several_tiles_on_a_gpu or (quantized_fused_step_matches and (int4 or int8))" > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|^E " $OUT/tests.log | tail -8
B="python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4 \
  --ns 1,2,4,8,16 --tree-nodes 16 --parts speed --no-hf"
show() { python3 -c "import json,glob; d=json.load(open(sorted(glob.glob('results/bench_engine-*.json'))[-1])); print({k: round(v, 3) for k, v in d.items() if isinstance(v, float) and any(s in k for s in ('tree', 'int', 'tok_s', 'step'))}); print({r: {n: round(v, 3) for n, v in x.items()} for r, x in d['steps_ms']['graph'].items()})"; }
for v in few tc; do
  [ $v = tc ] && export SPARK_SPEC_FEW_TOKENS=0
  timeout 140 $B > $OUT/bench_$v.log 2>&1; echo "$v rc=$?"; show
  mkdir -p r_$v; mv results/* r_$v/; tar czf $OUT/s20_bench2_$v.tgz r_$v
done
