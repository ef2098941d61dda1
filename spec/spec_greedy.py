"""t3: greedy speculative decoding, checked token for token against plain greedy decoding.

For each prompt: plain greedy decoding of the target (our loop with K = 0), then speculation (the draft model
proposes K tokens per round, the target keeps the longest prefix that matches its own argmax and adds one token).
The two outputs must be identical; the table shows acceptance alpha-hat (accepted / drafted), tokens per round, tok/s of
both and the speedup. `--compare-hf` adds transformers' own generate, plain and assisted (`assistant_model=`), timed
the same way in the same run.

In float32 the outputs are identical token for token. In bf16 a 1-token step and a K+1-token verify round
differently, so where the target's top two logits are closer than that rounding the two runs may pick different
tokens; every divergence is reported with the top-2 gap and the measured rounding difference at that point
(`near-tie` when the gap is the smaller). Exits with status 1 if any output differs other than at a near-tie.

    python -m spec.spec_greedy                      # the embedded default pair, 3 code prompts x 64 tokens
    python -m spec.spec_greedy --pair qwen-coder --limit 6 --k 4 --compare-hf
"""

from __future__ import annotations

import argparse
import sys

from spec import tree
from spec.cli import add_model_args, add_run_args, load_from_args, resolve_tree
from spec.harness import Setup, k_label, print_rows, run_set
from spec.io import Results, load_prompts
from spec.models import dtype_name
from spec.models.quant_report import describe


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m spec.spec_greedy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    add_run_args(parser, prompts="code", limit=3, max_new_tokens=64)
    parser.add_argument("--method", default="draft", choices=["draft", "lookup"],
                        help="draft model (default) or prompt lookup")
    parser.add_argument("--compare-hf", action="store_true",
                        help="also time transformers' generate, plain and assisted, on the same prompts")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    resolve_tree(parser, args, args.method)
    prompts = load_prompts(args.prompts)[: args.limit or None]
    pair = load_from_args(args, with_draft=args.method == "draft" or args.compare_hf, report_prompts=prompts,
                          report_tokens=args.max_new_tokens)
    setup = Setup(method=args.method, k=args.k, max_new_tokens=args.max_new_tokens, compare_hf=args.compare_hf,
                  tree=args.tree)
    results = Results("spec_greedy")
    rows, total = run_set(pair, prompts, setup, desc="greedy", results=results)
    dtype = dtype_name(pair.dtype)

    print(f"\n{pair.name}: greedy, method {args.method}, K = {k_label(args.k)}"
          + (f", tree {tree.describe(args.tree)}" if args.tree else "") + f", {len(prompts)} prompts x up to "
          f"{args.max_new_tokens} tokens, {pair.device} {dtype}"
          + (f", {pair.draft_quant} draft" if pair.draft_quant != "none" else "")
          + (f", {pair.target_quant} TARGET (a changed model)" if pair.target_quant != "none" else ""))
    print_rows(rows, total, args.compare_hf)
    print(f"\nanswer to {rows[0]['id']}:\n{rows[0]['text']}\n")
    for row in rows:
        if "divergence" in row:
            d = row["divergence"]
            print(f"{row['id']}: first differs at token {d['first_divergence']} ({d['plain_token']} plain, "
                  f"{d['spec_token']} speculative); top-2 logit gap there {d['top2_gap']:.4f}, logit difference "
                  f"between 1-token and K+1-token forwards reaching it {d['shape_error']:.4f}: "
                  f"{'a near-tie (rounding)' if d['near_tie'] else 'NOT a near-tie: a bug'}")
    bug = total["divergences"] > total["near_ties"]
    plain = "plain greedy decoding" + (f" of the {pair.target_quant} target" if pair.target_quant != "none" else "")
    if total["identical"]:
        verdict = f"IDENTICAL to {plain}"
    elif not bug:
        verdict = (f"identical to {plain} except at {total['near_ties']} {dtype} near-tie(s), "
                   "where the target's top two logits are closer than its own rounding between shapes (run with "
                   "--dtype float32 for token-for-token identity)")
    else:
        verdict = f"DIFFERENT from {plain}"
    print(f"speculative output is {verdict} on {len(rows)} prompts; alpha-hat {total['alpha']:.2f}, "
          f"{total['tokens_per_round']:.2f} tokens/round, {total['spec_tok_s']:.2f} vs {total['plain_tok_s']:.2f} "
          f"tok/s plain = {total['speedup']:.2f}x")
    if pair.target_report:
        print(f"the served target is another model: {describe(pair.target_report, dtype)}")
    if args.compare_hf:
        print(f"transformers: plain {total['hf_plain_tok_s']:.2f} tok/s, assisted {total['hf_assisted_tok_s']:.2f} "
              f"tok/s; ours vs assisted {total['ours_vs_hf_assisted']:.2f}x")
    result = {"task": "spec_greedy", "pair": pair.name, "device": str(pair.device), **pair.setup_fields(),
              "dtype": dtype, "args": {**vars(args), "k": k_label(args.k),
                                                   "tree": args.tree and tree.describe(args.tree)},
              "total": total}
    print(f"saved {results.finish(result)}")
    if bug:
        sys.exit(1)
    return {**result, "rows": rows}


if __name__ == "__main__":
    main()
