# Session 26, on an H200 (carry .whl): where the bars' forwards spend their time on this card, kernel by kernel
# (step_profile; only H100 profiles exist since session 21): the 8B's 16-token verify, the 1B's 8-token frontier,
# and the 1B's one-token step in int8 and int4.
source "$(dirname "$0")/env.sh"
mkdir -p results
prof() {  # $1 role, $2 tokens, $3 quant, $4 tag
  timeout ${PLIMIT:-60} python3 benchmarks/h200/step_profile.py --pair llama-random --device cuda --roles $1 \
    --quants $3 --tokens $2 --json $OUT/profile-$4-$2.json > /tmp/profile-$4-$2.log 2>&1
  echo "profile $4 $2 rc=$?"; grep -v -i warn /tmp/profile-$4-$2.log | tail -12
}
prof target 16 none 8b; prof draft 8 none 1b; prof draft 1 int8,int4 1b-quant
