# Session 15, no weights (carry .whl), first call: tune the tiles no session has tuned, on llama-random's 8B/1B shapes,
# into the GPU's kernel file (<cache>/kernels/<GPU>.json, kept while the machine stays warm; s15_probe.sh, the next
# call, measures with it): the 8B's tree verifies (tiles 64 and 32 tokens wide), the 1B's 2-16-token forwards (a
# tree's frontier, a draft's catch-up: they ran on the 8B's tiles), and the 1B's one-token step with int4 and int8
# weights (they ran on bf16's tiles, widened). About 7 minutes with the start.
source "$(dirname "$0")/env.sh"
rm -rf results
T="python3 -m spec.tune_kernels --pair llama-random --device cuda"
timeout 200 $T --roles target --tokens 64,32 > $OUT/tune_target_tree.log 2>&1; echo "target tree rc=$?"
timeout 100 $T --roles draft --tokens 9 > $OUT/tune_draft_rows.log 2>&1; echo "draft rows rc=$?"
timeout 80 $T --roles draft --draft-quant int4 > $OUT/tune_draft_int4.log 2>&1; echo "draft int4 rc=$?"
timeout 80 $T --roles draft --draft-quant int8 > $OUT/tune_draft_int8.log 2>&1; echo "draft int8 rc=$?"
for f in $OUT/tune_*.log; do echo "== $f"; grep -v "it/s\]\|s/it\]" $f | grep -v "^\s*$" | tail -9; done
cp ~/.cache/spark-spec/kernels/*.json $OUT/ 2>/dev/null
pack s15_tune
