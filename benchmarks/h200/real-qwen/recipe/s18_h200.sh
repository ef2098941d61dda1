# Session 18, for an H200 (no weights; carry .whl): what s18_confirm.sh measured on an H100, on the card the bars
# name. bench_engine with the input splits as they stand and with SPARK_SPEC_SPLIT_INPUTS=0 (issue 19's tree-verify
# bars), then once more with the packed heads in bf16's 128-column tile (the H200's rule before PACKED_HEAD_COLUMNS,
# through a kernel table in the cache), each packed as it ends; then the 1B's products alone. About 7 minutes with
# the start. On an H100 the splits off are left out (s18_confirm.sh measured them).
source "$(dirname "$0")/env.sh"
rm -rf results; mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
# ONLY_H200=1: nothing on another card, and no products alone (little device time left; an H100 measured them)
if [ -n "${ONLY_H200:-}" ]; then case "$GPU" in *H200*) ;; *) echo "not an H200: nothing to do"; exit 0;; esac; fi
B="python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4 \
  --ns 1,2,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf"
show() { python3 -c "import json,glob; d=json.load(open(sorted(glob.glob('results/bench_engine-*.json'))[-1])); print({k: round(v, 3) for k, v in d.items() if isinstance(v, float) and any(s in k for s in ('tree', 'int', 'verify', 'tok_s', 'step'))})"; }
VS="1 0"; case "$GPU" in *H100*) VS="1";; esac  # an H100: the baseline only (s18_confirm.sh measured both)
for v in $VS; do
  SPARK_SPEC_SPLIT_INPUTS=$v timeout 120 $B > $OUT/bench_split$v.log 2>&1; echo "split=$v rc=$?"; show
  mkdir -p r$v; mv results/* r$v/; tar czf $OUT/s18_h200_split$v.tgz r$v
done
mkdir -p ~/.cache/spark-spec/kernels results
python3 -c "
import json, torch, pathlib
from spec.models import kernels
rows = [{'kind': 'logits@' + q, 'n': 128256, 'k': 2048, 'bn': 16, 'block_k': 128, 'warps': 4} for q in ('int8', 'int4')]
path = kernels.tuned_path(torch.cuda.get_device_name(0)); path.parent.mkdir(parents=True, exist_ok=True); path.write_text(json.dumps({'configs': rows})); print(path)"
timeout 120 $B > $OUT/bench_head128.log 2>&1; echo "head128 rc=$?"; show
python3 -c "import torch; from spec.models import kernels; kernels.tuned_path(torch.cuda.get_device_name(0)).unlink()"
mkdir -p r2; mv results/* r2/; tar czf $OUT/s18_h200_head128.tgz r2
mkdir -p results
[ -n "${ONLY_H200:-}" ] && exit 0
timeout 100 python3 benchmarks/h200/packed_gemv.py --no-count --json $OUT/packed_gemv.json > $OUT/packed_gemv.log 2>&1
echo "packed_gemv rc=$?"; cut -c1-120 $OUT/packed_gemv.log | tail -20
