# sourced by every GPU call: the carried wheels, the repo on the path, unbuffered output
if [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.done || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# The image sets PYTHONDONTWRITEBYTECODE=1 and its packages ship no bytecode, so every process re-compiled torch's and
# transformers' sources (15 s of import). A user's pip install writes bytecode; here it is written once to /tmp/pyc.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pyc
mkdir -p $OUT
pack() { tar czf $OUT/$1.tgz results "${@:2}" 2>/dev/null; ls -la $OUT; }
