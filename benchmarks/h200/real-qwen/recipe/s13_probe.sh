# Session 13, no weights, after session 12's recipe ran on an H100: (1) bench_engine on llama-random: tree forwards
# of 16, 17 (a 16-node tree and its root), 32 and 64 nodes in one fused pass (tiles of 32 / 64 tokens), int8 / int4
# drafts with the rewritten int4 multi-token product, verify(8) timed; (2) the CUDA tests of token trees (fp32 on
# the fused path now, 40 and 64 nodes in one pass); (3) the quantized kernels' CUDA tests, interrupted (not killed)
# at their limit so the summary prints; (4) imports with bytecode written, as a pip install has it (the image sets
# PYTHONDONTWRITEBYTECODE=1, and its torch has no .pyc; with IMPORTS=1). Each part leaves its log in $OUT as it ends.
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 200 python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4 \
  --ns 1,2,5,8,16 --tree-nodes 16,17,32,64 --parts speed --no-hf > $OUT/bench.log 2>&1; echo "bench rc=$?"
grep -v "it/s\]" $OUT/bench.log | tail -14
python3 -c "import json,glob; d=json.load(open(sorted(glob.glob('results/bench_engine-2*.json'))[-1])); print({k: v for k, v in d.items() if 'tree' in k or 'verify' in k or k.startswith(('c_', 'draft_step')) or 'tok_s' in k}); print(d['steps_ms'])"
pack s13_bench
timeout -s INT 80 python3 -m pytest -q -p no:cacheprovider tests/test_graph_trees.py -rfE --tb=short > $OUT/tree_tests.log 2>&1; tail -12 $OUT/tree_tests.log
timeout -s INT 70 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py::test_quantized_fused_step_matches_the_weights_it_stands_for \
  tests/test_kernels.py::test_fused_step_matches_layer_stack tests/test_quant.py::test_cuda_graph_draft_quant_keeps_greedy_output \
  tests/test_kernels.py::test_split_attention_matches_reference -rfE --tb=line > $OUT/quant_tests.log 2>&1; grep -E "^(FAILED|ERROR)|passed|failed|^E " $OUT/quant_tests.log | tail -12
[ -n "$IMPORTS" ] && for i in 1 2; do echo "bytecode $i: $(env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pyc \
  python3 -c "import time; t=time.time(); import torch, transformers.models.qwen2.modeling_qwen2; print(f'{time.time()-t:.2f}')")"; done
