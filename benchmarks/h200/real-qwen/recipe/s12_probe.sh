# Session 12, no weights: (1) why imports take 11-14 s there (bytecode written or not, and a second process with a
# writable bytecode folder); (2) the quantized drafts' fused kernels (rewritten int4 layout) in bench_engine beside
# bf16, the issue-18 bars, and token trees' forwards (issue 19's bars); (3) the CUDA tests of token trees on the graph
# backend (and, with QUANT_TESTS=1, of int8 / int4 weights), with every failure named.
source "$(dirname "$0")/env.sh"
rm -rf results
[ -z "$SKIP_IMPORTS" ] && {
python3 - <<'PY'
import importlib.util, os, sys
for name in ("torch", "transformers"):
    origin = os.path.dirname(importlib.util.find_spec(name).origin)
    pyc = os.path.join(origin, "__pycache__")
    print(name, origin, "pycache:", os.path.isdir(pyc) and len(os.listdir(pyc)), "writable:", os.access(origin, os.W_OK))
print("dont_write_bytecode", sys.flags.dont_write_bytecode, "PYTHONDONTWRITEBYTECODE", os.environ.get("PYTHONDONTWRITEBYTECODE"),
      "prefix", sys.pycache_prefix)
PY
I="import time; t=time.time(); import torch, transformers.models.qwen2.modeling_qwen2, transformers.models.llama.modeling_llama; print(f'{time.time()-t:.2f}')"
for i in 1 2; do echo "default $i: $(python3 -c "$I")"; done
for i in 1 2 3; do echo "prefix $i: $(PYTHONPYCACHEPREFIX=/tmp/pyc python3 -c "$I")"; done
echo "spec import: $(python3 -c "import time; t=time.time(); import spec.models.pairs, spec.loop; print(f'{time.time()-t:.2f}')")"
PYTHONPYCACHEPREFIX=/tmp/pyc python3 -X importtime -c "import spec.models.pairs, spec.loop" 2> $OUT/importtime.txt; sort -t'|' -k2 -n $OUT/importtime.txt | tail -12
nproc; grep "model name" /proc/cpuinfo | head -1
} 2>&1 | tee $OUT/imports.log
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_graph_trees.py -rf --tb=short > $OUT/tree_tests.log 2>&1; tail -25 $OUT/tree_tests.log
timeout 200 python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4 \
  --ns 1,2,5,16 --tree-nodes 16,32,64 --parts speed --no-hf > $OUT/bench.log 2>&1; echo "bench rc=$?"; grep -v "it/s\]" $OUT/bench.log | tail -22
python3 -c "import json,glob; d=json.load(open(sorted(glob.glob('results/bench_engine-2*.json'))[-1])); print({k: v for k, v in d.items() if 'tree' in k or 'draft_step' in k or k.startswith('c_')})"
[ -n "$QUANT_TESTS" ] && timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_quant.py tests/test_kernels.py tests/test_graph.py \
  -k "(cuda or quantized or fused or split) and not interpreter" -rf --tb=line > $OUT/tests.log 2>&1; grep -E "^(FAILED|ERROR)|passed|failed|^/|Error" $OUT/tests.log | tail -25
pack s12_probe
