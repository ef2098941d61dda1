# Session 17, after s17_probe.sh (an H100 came): input splits now only for tiles wider than 16 tokens and for packed
# weights, where the probe measured them faster. One bench_engine run with the rule as it stands, and one with
# SPARK_SPEC_SPLIT_INPUTS=0, back to back on the same card, each packed as it ends. About 4 minutes with the start.
source "$(dirname "$0")/env.sh"
rm -rf results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
B="python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4 \
  --ns 1,2,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf"
for v in 1 0; do
  SPARK_SPEC_SPLIT_INPUTS=$v timeout 150 $B > $OUT/bench_split$v.log 2>&1; echo "split=$v rc=$?"
  grep -v "it/s\]" $OUT/bench_split$v.log | grep -E "graph  |step_ms|verify|tok_s"
  python3 -c "import json,glob; d=json.load(open(sorted(glob.glob('results/bench_engine-*.json'))[-1])); print({k: round(v, 3) for k, v in d.items() if 'tree' in k and isinstance(v, float)})"
  mkdir -p r$v; mv results/* r$v/; tar czf $OUT/s17_confirm_split$v.tgz r$v
done
