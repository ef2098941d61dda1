# Session 24, on an H200: issue 18's and 19's bars (the engine bench with both packed drafts, 2-16-token forwards,
# trees of 16 / 32 / 64 nodes and each draft's frontier of 8), under the rules the environment names
# (SPARK_SPEC_SPLIT_PLAIN, SPARK_SPEC_LIBRARY_PLAIN; typed into the call), saved as bench_engine-$TAG.json.
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $GPU; split ${SPARK_SPEC_SPLIT_PLAIN:-none}, library ${SPARK_SPEC_LIBRARY_PLAIN:-none}, tag $TAG"
timeout ${LIMIT:-400} python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph \
  --draft-quants int8,int4 --ns ${NS:-1,2,3,4,5,8,16} --tree-nodes 16,32,64 --parts speed --no-hf \
  > $OUT/bench_engine-$TAG.log 2>&1
echo "bench rc=$?"; grep -E "bar |frontier|tok/s|tree" $OUT/bench_engine-$TAG.log | tail -30
cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench_engine-$TAG.json
