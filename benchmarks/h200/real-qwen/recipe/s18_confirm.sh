# Session 18, first call (no weights; carry .whl). Session 17's last kernel changes (one last_to_finish protocol for
# the one-pass attention and the split products) have not run on a GPU: (1) the split graph-replay test and the
# attention tests first; (2) bench_engine with the input splits as they stand (tiles wider than 16 tokens and packed
# weights) and with SPARK_SPEC_SPLIT_INPUTS=0, back to back, each packed as it ends (issue 19's tree-verify bars and
# issue 18's draft steps, on the card the bars name); (3) the 1B's products alone in bf16 / int8 / int4
# (benchmarks/h200/packed_gemv.py). About 5 minutes with the start.
source "$(dirname "$0")/env.sh"
rm -rf results; mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
PT="python3 -m pytest -q -p no:cacheprovider -rfE --tb=short"
timeout -s INT 100 $PT tests/test_kernels.py -k "bitwise_stable or split_attention" > $OUT/tests_first.log 2>&1
echo "tests_first rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|^E " $OUT/tests_first.log | tail -6
B="python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4 \
  --ns 1,2,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf"
for v in 1 0; do
  SPARK_SPEC_SPLIT_INPUTS=$v timeout 120 $B > $OUT/bench_split$v.log 2>&1; echo "split=$v rc=$?"
  python3 -c "import json,glob; d=json.load(open(sorted(glob.glob('results/bench_engine-*.json'))[-1])); print({k: round(v, 3) for k, v in d.items() if isinstance(v, float) and any(s in k for s in ('tree', 'int', 'verify', 'tok_s', 'step'))})"
  mkdir -p r$v; mv results/* r$v/; tar czf $OUT/s18_confirm_split$v.tgz r$v
done
mkdir -p results
timeout 100 python3 benchmarks/h200/packed_gemv.py --no-count --json $OUT/packed_gemv.json > $OUT/packed_gemv.log 2>&1
echo "packed_gemv rc=$?"; cut -c1-150 $OUT/packed_gemv.log | tail -13
