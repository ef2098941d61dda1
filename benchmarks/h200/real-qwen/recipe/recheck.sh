# The two runs that crashed in the first session, re-run after their fixes: the CUDA tests that reproduce them (no
# real weights needed), and token trees on the GPU's eager backend (tiny pair) with the graph backend's refusal.
source "$(dirname "$0")/env.sh"
rm -rf results
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_graph.py tests/test_dist.py tests/test_tree.py \
  -k "fp32_stack or whole_loop_checks_run_on_the_gpu or rows_on_the_gpu or greedy_trees or tree_forward" 2>&1 | tail -6
python3 -m spec.spec_greedy --pair tiny --device cuda --backend eager --tree 3,2,1 --limit 2 --max-new-tokens 32 --quiet 2>&1 | tail -2
python3 -m spec.spec_greedy --pair tiny --device cuda --backend graph --tree 3,2,1 --limit 1 --quiet 2>&1 | tail -1
pack recheck
