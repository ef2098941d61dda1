# After the 26 chunk calls: setup and every run that needs no server, in one call (about 460 s of the 600 a call
# may take), so that no gap between calls can hand the machine, and the weights, back. Each part packs its own
# results as it ends; then serve.sh and start.sh in a second call.
d="$(dirname "$0")"
for part in setup greedy lookup_sweep sample_dist; do
  echo "=== $part"; bash "$d/$part.sh" 2>&1 | grep -v "it/s\]" | tail -40
done
