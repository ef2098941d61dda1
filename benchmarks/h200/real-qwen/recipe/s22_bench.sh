# Session 22, first call of a machine (carry .whl): the engine bench with both packed drafts, their 2-16-token
# forwards (int4's from 3 tokens through tinygemm) and the tree bars, each draft's frontier of 8 nodes.
source "$(dirname "$0")/env.sh"
mkdir -p results
timeout 300 python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4 \
  --ns 1,2,3,4,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf > $OUT/bench_engine.log 2>&1
echo "bench rc=$?"; grep -E "bar |frontier|tok/s" $OUT/bench_engine.log | tail -20
cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench_engine-session22.json
