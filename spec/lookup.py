"""t7: prompt lookup — speculation with no second model.

The drafter looks for the most recent earlier occurrence of the text's last n tokens (n = 3, 2, 1) in the prompt and
the output so far, and proposes the K tokens that followed it. It costs nothing to draft, so it pays whenever the
answer copies its input: renaming a variable through a function, editing code, quoting a document. On free-form chat
it rarely finds anything and speculation quietly becomes plain decoding. This task runs greedy prompt lookup on a
chat set and on the rename set, checks token-for-token identity with plain greedy decoding, and compares the two.

    python -m spec.lookup --limit 3 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import sys

from spec.cli import add_model_args, add_run_args, load_from_args, resolve_tree
from spec.harness import Setup, k_label, print_rows, run_set
from spec.io import Results, load_prompts, table


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m spec.lookup", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser, draft=False)
    parser.add_argument("--sets", default="short,rename",
                        help="prompt sets to compare, comma-separated (default short,rename)")
    add_run_args(parser, prompts=None, limit=3, max_new_tokens=128, k=8)
    parser.add_argument("--compare-hf", action="store_true",
                        help="also time transformers' generate with prompt_lookup_num_tokens=K")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    resolve_tree(parser, args, "lookup")
    sets = {name: load_prompts(name)[: args.limit or None] for name in args.sets.split(",")}
    pair = load_from_args(args, with_draft=False)
    setup = Setup(method="lookup", k=args.k, max_new_tokens=args.max_new_tokens, compare_hf=args.compare_hf,
                  tree=args.tree)
    results, by_set, totals = Results("lookup"), {}, []
    for name, prompts in sets.items():
        rows, total = run_set(pair, prompts, setup, desc=name, results=results, tag={"set": name})
        by_set[name] = {"rows": rows, "total": total}
        totals.append({**total, "id": name})
        print(f"\n{name}:")
        print_rows(rows, total, args.compare_hf)
    print(f"\n{pair.name}: greedy prompt lookup, K = {k_label(args.k)}, "
          f"up to {args.max_new_tokens} tokens per prompt")
    print(table(totals, [("id", "s"), ("tokens", "d"), ("identical", "s"), ("alpha", ".2f"),
                         ("tokens_per_round", ".2f"), ("plain_tok_s", ".2f"), ("spec_tok_s", ".2f"),
                         ("speedup", ".2f")]))
    result = {"task": "lookup", "pair": pair.name, "device": str(pair.device), **pair.setup_fields(),
              "args": {**vars(args), "k": k_label(args.k)}, "totals": {t["id"]: t for t in totals}}
    print(f"saved {results.finish(result)}")  # each row names its set
    if not all(t["identical"] for t in totals):
        sys.exit(1)
    return {**result, "sets": by_set}


if __name__ == "__main__":
    main()
