# Session 25, second call (carry .whl): at 16 tokens the 8B's attention took 10 µs a layer on an H100 (partial 6.0,
# combine 4.1; one token: 5.4), and its partial sums (fp32, a program's rows x head size) outweigh the 2 MB of keys
# and values three to one. Fewer, longer chunks (64, 128 cached positions a program against the rule's 32) write and
# combine fewer; alternated with the rule in one process. On an H200, first the bars under today's defaults.
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
if [[ "$GPU" == *H200* ]]; then
  timeout 170 python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph \
    --draft-quants int8,int4 --ns 1,2,3,4,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf > $OUT/bench-rules.log 2>&1
  echo "bench rc=$?"; grep -E "^bar" $OUT/bench-rules.log
  cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench-rules.json
  VARIANTS=${VARIANTS:-fused+pdl,chunk64+pdl,chunk128+pdl}  # what device time is left
fi
timeout ${VLIMIT:-300} python3 benchmarks/h200/step_variants.py --pair llama-random --device cuda --ns 1,2,8,16 \
  --tree-nodes 16,32,64 --variants ${VARIANTS:-fused+pdl,chunk64+pdl,chunk128+pdl,fused+pdl,chunk64+pdl} \
  --json $OUT/variants-chunk.json > $OUT/variants-chunk.log 2>&1; echo "variants rc=$?"
grep -v -i warn $OUT/variants-chunk.log | grep " ms$"
