# Session 16's first call (no weights; carry .whl): what session 15 built and could not measure on a GPU.
# (1) The tuner's whole-forward check (`keep_tuned`: a size's tiles are kept only if the whole captured forward is
# >= 0.5 % faster) on the 8B's 32-token verify, the one bar still missed on trees (32 nodes <= 1.25 steps);
# (2) bench_engine with the kernels' rules alone and then with the table as it stands (s15_ab.sh's pair of runs);
# About 8 minutes with the start; each part packed as it ends.
source "$(dirname "$0")/env.sh"
rm -rf results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
timeout 170 python3 -m spec.tune_kernels --pair llama-random --device cuda --roles target --tokens 32 \
  > $OUT/tune_target_32.log 2>&1; echo "tune 32 rc=$?"
grep -v "it/s\]\|s/it\]" $OUT/tune_target_32.log | grep -v "^\s*$" | tail -12
cp ~/.cache/spark-spec/kernels/*.json $OUT/ 2>/dev/null
pack s16_tune
B="python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4,fp8 \
  --ns 1,2,5,8,16 --tree-nodes 16,17,32,64 --parts speed --no-hf"
SPARK_SPEC_KERNEL_TABLE=0 timeout 150 $B > $OUT/bench_rules.log 2>&1; echo "rules rc=$?"
grep -v "it/s\]" $OUT/bench_rules.log | tail -14 | head -9
timeout 150 $B > $OUT/bench_table.log 2>&1; echo "table rc=$?"
grep -v "it/s\]" $OUT/bench_table.log | tail -14 | head -9
pack s16_probe
