# Session 27: issue 18's and 19's bars, one bench_engine run under today's defaults (env ROPE=1: with the rotary
# embedding in the q/k/v product's epilogue).
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
SPARK_SPEC_ROPE_IN_PRODUCT=${ROPE:-0} timeout ${T:-250} python3 -m spec.bench_engine --pair llama-random --device cuda \
  --backends graph --draft-quants int8,int4 --ns 1,2,3,4,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf \
  > $OUT/bench-rope${ROPE:-0}.log 2>&1
echo "bench rc=$?"; grep -E "^bar|ratio|frontier|step" $OUT/bench-rope${ROPE:-0}.log | head -30
cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench_engine-rope${ROPE:-0}.json
