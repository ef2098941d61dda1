# Session 21, after s21_tests.sh on the same machine: bench_engine with the kernels before this session
# (.old/s21: K/V loaded after the PDL wait, session 20's gemv_few tiles) and after, back to back.
source "$(dirname "$0")/env.sh"
B="python3 -m spec.bench_engine --pair llama-random --device cuda --backends graph --draft-quants int8,int4 \
  --ns 1,2,4 --parts speed --no-hf"
show() { python3 -c "import json,glob; d=json.load(open(sorted(glob.glob('results/bench_engine-*.json'))[-1])); print({k: round(v, 4) for k, v in d.items() if isinstance(v, float) and any(s in k for s in ('int', 'tok_s', 'step', 'c_graph'))}); print({k: v for k, v in d['steps_ms'].items()} if isinstance(d.get('steps_ms'), dict) else '')"; }
mkdir -p /tmp/new && cp spec/models/kernels.py spec/models/triton_kernels.py /tmp/new/
for v in old new; do
  rm -rf results; mkdir -p results
  if [ $v = old ]; then cp .old/s21/*.py spec/models/; else cp /tmp/new/*.py spec/models/; fi
  timeout 170 $B > $OUT/bench_$v.log 2>&1; echo "$v rc=$?"; show
  cp results/bench_engine-*Z.json $OUT/bench_engine-$v.json 2>/dev/null
done
