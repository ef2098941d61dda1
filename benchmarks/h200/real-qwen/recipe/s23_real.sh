# Session 23, after s12_chunk.sh x 31: reassemble, check both SHA-256, convert (setup.sh, first call only), then the
# int4 draft's trees and chain on the real pair with the launches between library products fused (FUSED=0: apart,
# as in session 22), 6 code prompts x 128 tokens. Under 600 s.
G=/root/.cache/spark-spec/gguf
[ -f $G/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf ] || bash "$(dirname "$0")/setup.sh" 2>&1 | grep -v "it/s\]" | tail -8
source "$(dirname "$0")/env.sh"
rm -rf results
F=${FUSED:-1}
SPARK_SPEC_LIBRARY_FUSED=$F timeout 480 python3 -m spec.tree_sweep --pair qwen-coder --device cuda --backend graph \
  --prompts code --limit 6 --max-new-tokens 128 --draft-quant int4 > $OUT/tree_sweep-int4-fused$F.log 2>&1
echo "tree_sweep rc=$?"; grep -v "it/s\]" $OUT/tree_sweep-int4-fused$F.log | tail -32
pack s23_real_fused$F
