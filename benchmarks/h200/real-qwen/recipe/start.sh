source "$(dirname "$0")/env.sh"
rm -rf results
python3 -m spec.start_time --pair qwen-coder --device cuda --backend graph --server 2>&1 | tail -12
python3 -m spec.start_time --pair llama-random --device cuda --backend graph 2>&1 | tail -8
pack start
