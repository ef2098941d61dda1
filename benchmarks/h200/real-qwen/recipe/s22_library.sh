# Session 22, one call (carry .whl): PyTorch's int4 kernel (tinygemm) for the int4 draft's products of several tokens
# (kernels.LIBRARY_TOKENS). First the CUDA tests that touch it, then the 1B's forwards of 1-16 tokens with the
# library from 3 tokens (the default), never (0) and from 2, the order reversed at the end.
source "$(dirname "$0")/env.sh"
mkdir -p results
timeout 200 python3 -m pytest -n 8 -q tests/test_kernels.py tests/test_graph.py -k "library or quantized or int4" \
  > $OUT/tests.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/tests.log
for lt in 3 0 2 3b; do
  SPARK_SPEC_LIBRARY_TOKENS=${lt%b} timeout 150 python3 -m spec.bench_engine --pair llama-random --device cuda \
    --backends graph --draft-quants int4 --ns 1,2,3,4,5,8,16 --parts speed --no-hf \
    > $OUT/library-$lt.log 2>&1; echo "library from $lt rc=$?"
  cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/library-$lt.json
  python3 - $OUT/library-$lt.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
s = d["steps_ms"]["graph"]
print(" ".join(f"{n}:{v:.3f}" for n, v in s["draft_int4"].items()), "| spec int4", round(d["graph_spec_k4_int4"]["tok_s"], 1),
      "plain", round(d["graph_plain_tok_s"], 1))
PY
done
