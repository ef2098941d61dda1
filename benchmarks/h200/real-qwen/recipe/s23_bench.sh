# Session 23, on an H200: issue 18's and 19's bars as the code stands (the engine bench with both packed drafts,
# 2-16-token forwards, trees of 16 / 32 / 64 nodes and each draft's frontier of 8).
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
timeout 400 python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4 \
  --ns 1,2,3,4,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf > $OUT/bench_engine.log 2>&1
echo "bench rc=$?"; grep -E "bar |frontier|tok/s|tree" $OUT/bench_engine.log | tail -30
cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench_engine-session23.json
