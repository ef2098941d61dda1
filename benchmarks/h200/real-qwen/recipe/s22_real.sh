# Session 22, after s12_chunk.sh x 31: reassemble, check both SHA-256, convert (setup.sh, first call only), then token
# trees and chains on the real pair with the int4 draft, its products of 3 tokens or more through PyTorch's int4
# kernel (tinygemm; LT=0: never, as before this session), 6 code prompts x 128 tokens. Under 600 s; packed as it ends.
G=/root/.cache/spark-spec/gguf
[ -f $G/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf ] || bash "$(dirname "$0")/setup.sh" 2>&1 | grep -v "it/s\]" | tail -8
source "$(dirname "$0")/env.sh"
rm -rf results
LT=${LT:-3}
SPARK_SPEC_LIBRARY_TOKENS=$LT timeout 480 python3 -m spec.tree_sweep --pair qwen-coder --device cuda --backend graph \
  --prompts code --limit 6 --max-new-tokens 128 --draft-quant int4 > $OUT/tree_sweep-int4-library$LT.log 2>&1
echo "tree_sweep rc=$?"; grep -v "it/s\]" $OUT/tree_sweep-int4-library$LT.log | tail -32
pack s22_real_library$LT
