# After the 26 chunk calls, the parts named as arguments, in order, in one call (each under the 600 s a call may
# take, so that no gap between calls can hand the machine, and the weights, back). Each part packs its own results
# as it ends. The calls, back to back:
#   bash all.sh setup greedy                                  (~7 min)
#   bash all.sh greedy_more lookup_sweep sample_dist          (~7 min)
#   bash all.sh serve start                                   (~5 min)
d="$(dirname "$0")"
for part in "$@"; do
  echo "=== $part $(date +%T)"; bash "$d/$part.sh" 2>&1 | grep -v "it/s\]" | tail -40
done
echo "=== done $(date +%T)"
