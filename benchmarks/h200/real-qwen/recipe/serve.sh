source "$(dirname "$0")/env.sh"
rm -rf results
for method in draft none; do
  python3 server_spec.py --pair qwen-coder --device cuda --backend graph --method $method --k 4 --port 8000 --quiet & server=$!
  python3 -c "import httpx,time
for _ in range(600):
    try:
        if httpx.get('http://127.0.0.1:8000/health').status_code == 200: break
    except httpx.HTTPError: pass
    time.sleep(0.5)"
  python3 bench.py --base-url http://127.0.0.1:8000/v1 --prompts code --concurrency 1,4 --n 16 --max-tokens 128 --ignore-eos --quiet --hardware "1x H200" --change "H200 graph backend, real Qwen pair, method $method" 2>&1 | tail -6
  kill $server; wait $server
done
cp SCOREBOARD.md $OUT/
pack serve
