# Session 20, after s12_chunk.sh x 28, one call per draft format (DQ=int4, then DQ=int8): reassemble, check both
# SHA-256, convert (setup.sh, first call only), then token trees on the real pair with that draft format, the 2-4-token
# draft forwards (catch-up, tree frontiers) on the CUDA cores (gemv_few), 6 code prompts x 128 tokens: the tree
# calculator in its final form (session 19's host fit) against measured runs. Under 600 s; packed as it ends.
G=/root/.cache/spark-spec/gguf
[ -f $G/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf ] || bash "$(dirname "$0")/setup.sh" 2>&1 | grep -v "it/s\]" | tail -8
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 480 python3 -m spec.tree_sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 6 \
  --max-new-tokens 128 --draft-quant ${DQ:-int4} > $OUT/tree_sweep-$DQ.log 2>&1
echo "tree_sweep rc=$?"; grep -v "it/s\]" $OUT/tree_sweep-$DQ.log | tail -32
pack s20_real_$DQ
