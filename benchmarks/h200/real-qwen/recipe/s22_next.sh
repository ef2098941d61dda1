# For a next machine (carry .whl), two calls: `bash s22_next.sh chunks`, the split-KV attention's chunk (cached
# positions a program) in the one-token step; `bash s22_next.sh products`, the packed products alone beside the
# libraries'.
# Session 21's profile timed the attention at 4.6 µs a layer for 1 MB of K/V in every format (12 % of the H200's int4
# 1B step; 172 µs of the 8B's): fewer, longer chunks leave its last program fewer partial sums to combine. The rule
# (32 up to a 1024-token span) against 64 and 128, at 512 and 2048 tokens, the rule run first and last.
source "$(dirname "$0")/env.sh"
mkdir -p results
[ "$1" = chunks ] && for ctx in 512 2048; do
  timeout 250 python3 benchmarks/h200/step_variants.py --pair llama-random --device cuda --ns 1 --context $ctx \
    --variants fused+pdl,chunk64+pdl,chunk128+pdl,fused+pdl --draft-quant int4 --json $OUT/chunks-$ctx.json \
    > $OUT/chunks-$ctx.log 2>&1; echo "context $ctx rc=$?"; grep -E "ms$" $OUT/chunks-$ctx.log
done
# Then every packed product alone at 1, 2 and 4 tokens beside the libraries' (tinygemm for int4, gpt-fast's int8,
# cuBLAS; issue 18 asks ours measured against them in one run), q/k/v's 2-4-token product among them (session 21
# stopped halving its tile; the H200's tuned one-token q/k/v tile was timed only within the 2-token forward).
[ "$1" = products ] || exit 0
timeout 400 python3 benchmarks/h200/packed_gemv.py --no-count --schemes none,int8,int4 --tokens 1,2,4 \
  --products o,gate_up,down,head,qkv --json $OUT/packed_gemv-libraries.json > $OUT/packed_gemv-libraries.log 2>&1
echo "packed_gemv rc=$?"; grep -v "\*" $OUT/packed_gemv-libraries.log | cut -c1-110 | tail -60
