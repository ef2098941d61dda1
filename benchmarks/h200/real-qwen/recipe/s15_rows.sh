# Session 15, no weights (carry .whl): the tree verifies with more than 128 attention rows a head (64 nodes x the
# 8B's 4 query heads a K/V head) in the split-KV kernel's row blocks, against the same code sending them to SDPA
# (MAX_ROW_BLOCKS = 1, a copy in baseline_s15/, not committed), one call, baseline first. About 4 minutes.
source "$(dirname "$0")/env.sh"
rm -rf results
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
B="python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --ns 1,2,5,8,16 \
  --tree-nodes 16,17,32,48,64 --parts speed --no-hf"
# (python -m puts the working folder first on the path, so the baseline runs from its own folder: run as first
# written, with PYTHONPATH, both runs measured the new code; the baseline was re-run this way in the next call)
(cd baseline_s15 && timeout 150 $B > $OUT/bench_sdpa.log 2>&1); echo "sdpa rc=$?"
timeout 150 $B > $OUT/bench_blocks.log 2>&1; echo "blocks rc=$?"
for f in sdpa blocks; do python3 - $(ls -t results/bench_engine-2*.json | grep -v jsonl) <<'PY'
import json, sys
for f in sys.argv[1:]:
    d = json.load(open(f))
    print(f, d["command"][-60:], round(d["graph_plain_tok_s"], 1), {k[18:]: round(v, 3) for k, v in d.items() if k.startswith("tree_") and k != "tree_ms"})
PY
break; done
pack s15_rows
