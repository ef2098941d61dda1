# Session 19, after s19_real.sh on the same machine: the same sweep with the bf16 draft (a draft forward costs more,
# so the calculator's ranking is tested at a second cost point).
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 500 python3 -m spec.tree_sweep --pair qwen-coder --device cuda --backend graph --prompts code --limit 6 \
  --max-new-tokens 128 --draft-quant none > $OUT/tree_sweep_bf16.log 2>&1
echo "tree_sweep rc=$?"; grep -v "it/s\]" $OUT/tree_sweep_bf16.log | tail -32
pack s19_real_bf16
