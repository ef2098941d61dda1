# For the next GPU call (session 33 had no device time left for it): the graph backend past its default 4,096-position
# cache, before the server's --max-model-len may size it: the split-KV attention over spans up to 131,072 and a graphed
# model over an 8,200-token prompt (tests/test_kernels.py, written in session 33, not yet run on a GPU).
source "$(dirname "$0")/env.sh"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
timeout ${T1:-240} python3 -m pytest -n 4 -q -p no:cacheprovider -rfEs --tb=short tests/test_kernels.py \
  -k "long_texts or past_its_default or test_split_attention_in_the_graph_backend" > $OUT/tests-long.log 2>&1
echo "tests rc=$?"; tail -n 12 $OUT/tests-long.log
