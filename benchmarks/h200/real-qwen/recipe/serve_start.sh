# The second call after the chunks: the server scored by bench.py, then the start times (fresh processes).
d="$(dirname "$0")"
for part in serve start; do
  echo "=== $part"; bash "$d/$part.sh" 2>&1 | tail -30
done
