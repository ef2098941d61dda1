# Session 15, no weights (carry .whl): bench_engine on llama-random twice in one call, the kernel rules alone
# (SPARK_SPEC_KERNEL_TABLE=0) and then with the tuned tiles -- on an H200 tuned here first (the tree widths and the
# 1B's int4 / int8 step), on an H100 the shipped table (session 15's tuning). About 4 (H100) or 7 (H200) minutes.
source "$(dirname "$0")/env.sh"
rm -rf results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
B="python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4,fp8 \
  --ns 1,2,5,8,16 --tree-nodes 16,17,32,64 --parts speed --no-hf"
SPARK_SPEC_KERNEL_TABLE=0 timeout 150 $B > $OUT/bench_rules.log 2>&1; echo "rules rc=$?"
grep -v "it/s\]" $OUT/bench_rules.log | tail -14 | head -9
pack s15_ab_rules
case "$GPU" in *H200*)
  T="python3 -m spec.tune_kernels --pair llama-random --device cuda"
  timeout 150 $T --roles target --tokens 64,32 > $OUT/tune_target_tree.log 2>&1; echo "tune tree rc=$?"
  timeout 60 $T --roles draft --draft-quant int4 > $OUT/tune_draft_int4.log 2>&1; echo "tune int4 rc=$?"
  timeout 60 $T --roles draft --draft-quant int8 > $OUT/tune_draft_int8.log 2>&1; echo "tune int8 rc=$?"
  cp ~/.cache/spark-spec/kernels/*.json $OUT/ 2>/dev/null;;
esac
timeout 150 $B > $OUT/bench_table.log 2>&1; echo "table rc=$?"
grep -v "it/s\]" $OUT/bench_table.log | tail -14 | head -9
pack s15_ab
