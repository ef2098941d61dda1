source "$(dirname "$0")/env.sh"
rm -rf results
python3 -X importtime -c "import spec.models.pairs, spec.loop, spec.start_time" 2> $OUT/importtime.txt; tail -1 $OUT/importtime.txt
python3 -m spec.start_time --pair qwen-coder --device cuda --backend graph --server 2>&1 | tail -12
pack start
