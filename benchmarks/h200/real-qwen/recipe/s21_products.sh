# Session 21, second call: the 1B's packed products alone at 2 and 4 tokens (gemv_few's tile beside the int4 tile
# unhalved, which the sm_90 counts favour for o, down and the head) and at one token (int4's alternates).
source "$(dirname "$0")/env.sh"
mkdir -p results
timeout 200 python3 benchmarks/h200/packed_gemv.py --no-count --schemes int8,int4 --tokens 1,2,4 \
  --json $OUT/packed_gemv_few.json > $OUT/packed_gemv_few.log 2>&1; echo "packed_gemv rc=$?"
cut -c1-120 $OUT/packed_gemv_few.log | tail -60
