# Session 19, last call (carry .whl and .old): the int4 word kernel with o and down back in bf16's widened tile
# (INT4_TILE for gate/up and the head only), against the byte kernel, back to back on one card. About 6 minutes.
source "$(dirname "$0")/env.sh"
rm -rf results; mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
B="python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4 \
  --ns 1,2,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf"
show() { python3 -c "import json,glob; d=json.load(open(sorted(glob.glob('results/bench_engine-*.json'))[-1])); print({k: round(v, 3) for k, v in d.items() if isinstance(v, float) and any(s in k for s in ('int', 'step', 'tok_s'))})"; }
cp spec/models/triton_kernels.py spec/models/kernels.py /tmp/
for v in words bytes; do
  [ $v = bytes ] && cp .old/triton_kernels.py .old/kernels.py spec/models/
  timeout 150 $B > $OUT/bench_$v.log 2>&1; echo "$v rc=$?"; show
  mkdir -p r_$v; mv results/* r_$v/; tar czf $OUT/s19c_bench_$v.tgz r_$v
done
cp /tmp/triton_kernels.py /tmp/kernels.py spec/models/
