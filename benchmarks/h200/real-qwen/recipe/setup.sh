set -x
source "$(dirname "$0")/env.sh"
G=/root/.cache/spark-spec/gguf; mkdir -p $G
cat /root/wts/c?? > /root/wts/all && ls -la /root/wts/all
head -c 1117320768 /root/wts/all > $G/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
tail -c +1117320769 /root/wts/all > $G/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
rm -f /root/wts/all /root/wts/c??
sha256sum $G/*
python3 -c "import torch, transformers, triton, fastapi, uvicorn, openai, gguf, prometheus_client; print(torch.__version__, transformers.__version__, triton.__version__, fastapi.__version__, prometheus_client.__file__)"
time python3 -m spec.check_pair --pair qwen-coder --device cuda --backend graph --max-new-tokens 24 2>&1 | tee $OUT/check_pair.log
pack setup
