# For a next machine (carry .whl): the split-KV attention's chunk (cached positions a program) in the one-token step, then q/k/v's 2-4-token packed product.
# Session 21's profile timed the attention at 4.6 µs a layer for 1 MB of K/V in every format (12 % of the H200's int4
# 1B step; 172 µs of the 8B's): fewer, longer chunks leave its last program fewer partial sums to combine. The rule
# (32 up to a 1024-token span) against 64 and 128, at 512 and 2048 tokens, the rule run first and last.
source "$(dirname "$0")/env.sh"
mkdir -p results
for ctx in 512 2048; do
  timeout 250 python3 benchmarks/h200/step_variants.py --pair llama-random --device cuda --ns 1 --context $ctx \
    --variants fused+pdl,chunk64+pdl,chunk128+pdl,fused+pdl --draft-quant int4 --json $OUT/chunks-$ctx.json \
    > $OUT/chunks-$ctx.log 2>&1; echo "context $ctx rc=$?"; grep -E "ms$" $OUT/chunks-$ctx.log
done
# Then q/k/v's 2-4-token product over packed codes in the tile the q/k/v wrapper passes (session 21 stopped halving
# it with o and down; the H200's tuned one-token q/k/v tile was timed only within the 2-token forward).
timeout 120 python3 benchmarks/h200/packed_gemv.py --no-count --schemes int8,int4 --products qkv --tokens 2,4 \
  --json $OUT/packed_gemv-qkv.json > $OUT/packed_gemv-qkv.log 2>&1; echo "qkv rc=$?"; tail -14 $OUT/packed_gemv-qkv.log
