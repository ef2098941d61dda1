# Session 25, first call (carry .whl):
# 1. issue 18's and 19's bars under today's defaults (session 24's rules: 2-16-token bf16 products split where row
#    blocks leave multiprocessors idle, cuBLAS for 33-64-token ones), never measured on an H200;
# 2. do the 2-64-token products' pipeline buffers (110-164 KB a program: one a multiprocessor) keep the next
#    kernel's programs from starting beside them (PDL)? Forwards with the buffers capped at 100 KB (two programs
#    fit) and 64 KB (three), and with 2-4-token bf16 products in gemv_few (few4), alternated in one process;
# 3. the bars under session 23's rules (SPARK_SPEC_SPLIT_PLAIN=none SPARK_SPEC_LIBRARY_PLAIN=0), same machine;
# 4. where the 8B's 16-token and the 1B's 8-token forwards spend their time, kernel by kernel (step_profile).
source "$(dirname "$0")/env.sh"
mkdir -p results
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
bench() {  # $1: tag
  timeout ${BLIMIT:-110} python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph \
    --draft-quants int8,int4 --ns 1,2,3,4,5,8,16 --tree-nodes 16,32,64 --parts speed --no-hf > $OUT/bench-$1.log 2>&1
  echo "bench $1 rc=$?"; grep -E "^bar|frontier" $OUT/bench-$1.log | tail -12
  cp "$(ls -t results/bench_engine-*.json | head -1)" $OUT/bench-$1.json
}
bench rules
timeout ${VLIMIT:-270} python3 benchmarks/h200/step_variants.py --pair llama-random --device cuda --ns 1,2,8,16 \
  --tree-nodes 16,32,64 --variants ${VARIANTS:-fused+pdl,smem100+pdl,few4+pdl,smem64+pdl,fused+pdl} \
  --json $OUT/variants.json > $OUT/variants.log 2>&1; echo "variants rc=$?"
grep -v -i warn $OUT/variants.log | grep " ms$"
SPARK_SPEC_SPLIT_PLAIN=none SPARK_SPEC_LIBRARY_PLAIN=0 bench base
prof() {  # $1 role, $2 tokens, $3 tag
  timeout ${PLIMIT:-60} python3 benchmarks/h200/step_profile.py --pair llama-random --device cuda --roles $1 \
    --quants none --tokens $2 --json $OUT/profile-$3-$2.json > /tmp/profile-$3-$2.log 2>&1
  echo "profile $3 $2 rc=$?"; grep -v -i warn /tmp/profile-$3-$2.log | tail -14
}
prof target 16 8b; prof draft 8 1b
