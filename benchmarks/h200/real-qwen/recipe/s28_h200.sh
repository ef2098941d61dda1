# Session 28, on an H200 if one comes (carry .whl): issues 18 and 19's bars under today's defaults (one bench_engine
# run), then the 8B's 16- and 32-token tiles tuned on this card (kept only where the whole captured forward gains
# >= 0.5 %) and the bars again with what was kept. Each step saves its files under $OUT as it ends. On an H100: the
# CUDA tests of the kernels and graphed trees under today's defaults (the rotary in the q/k/v product now on).
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
if [[ "$GPU" != *H200* ]]; then  # on an H100 (s28_first.sh's bench stands): the CUDA tests under today's defaults
  timeout ${T1:-180} python3 -m pytest -n 8 -q -p no:cacheprovider -rfE --tb=short tests/test_kernels.py \
    tests/test_graph_trees.py -k "not interpreter" > $OUT/tests-cuda.log 2>&1; echo "tests rc=$?"; tail -n 4 $OUT/tests-cuda.log
  exit 0
fi
timeout ${T:-170} python3 -m spec.bench_engine --pair llama-random --device cuda \
  --backends graph --draft-quants int8,int4 --ns 1,2,3,4,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf \
  > $OUT/bench.log 2>&1
echo "bench rc=$?"; grep -E "^bar" $OUT/bench.log
cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench_engine.json
python3 -c "import json; d = json.load(open('$OUT/bench_engine.json')); print({k: round(v, 3) for k, v in d.items() if k.startswith('tree_') and not isinstance(v, dict)})"
[ "${TLIMIT:-250}" = 0 ] && exit 0  # (short of device time: the bars as they stand)
timeout ${TLIMIT:-250} python3 -m spec.tune_kernels --pair llama-random --device cuda --roles target --tokens ${TOKENS:-16,32} \
  > $OUT/tune_target_16_32.log 2>&1; echo "tune rc=$?"
grep -i "kept\|whole\|forward" $OUT/tune_target_16_32.log | grep -v "it/s\]\|s/it\]" | tail -8
cp ~/.cache/spark-spec/kernels/*.json $OUT/ 2>/dev/null; cp "$(ls -t results/tune_kernels-*.json | head -1)" $OUT/ 2>/dev/null
[ "${T2:-120}" = 0 ] && exit 0  # (short of device time: the tuner's own whole-forward times stand for the bench)
timeout ${T2:-120} python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph \
  --ns 1,8,16 --tree-nodes 16,32,64 --parts speed --no-hf > $OUT/bench_tuned.log 2>&1; echo "bench rc=$?"
cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench_engine-tuned.json
python3 -c "import json; d = json.load(open('$OUT/bench_engine-tuned.json')); print({k: round(v, 3) for k, v in d.items() if k.startswith('tree_') and not isinstance(v, dict)})"
