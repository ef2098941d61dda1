"""t4: speculative sampling (temperature / top-k / top-p), same distribution as plain sampling.

Each draft token d is accepted with probability min(1, p(d) / q(d)); at the first rejection the fix token is drawn from
max(0, p - q) normalised; if all K are accepted a bonus token is drawn from p. Target and draft logits are warped by the
same temperature / top-k / top-p first. The outputs differ from plain sampling token by token (the random draws are
consumed differently) but follow the same distribution: `python -m spec.dist_test` proves that. Seeded runs are
reproducible: each prompt runs twice with the same seed and must give the same tokens.

    python -m spec.spec_sample --temperature 0.7 --top-p 0.9 --seed 1
"""

from __future__ import annotations

import argparse
import sys

from spec.cli import add_model_args, add_run_args, load_from_args
from spec.harness import Setup, k_label, print_rows, run_loop, run_set
from spec.io import Results, load_prompts
from spec.models import chat_ids, dtype_name
from spec.rules import Sampling


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m spec.spec_sample", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    add_run_args(parser, prompts="short", limit=3, max_new_tokens=64)
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=1.0, help="> 0 (default 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default 1.0 = off)")
    g.add_argument("--seed", type=int, default=0, help="seed of the torch.Generator (default 0)")
    parser.add_argument("--method", default="draft", choices=["draft", "lookup"], help="drafter (default draft)")
    parser.add_argument("--compare-hf", action="store_true", help="also time transformers' sampling generate")
    args = parser.parse_args(argv)
    if args.temperature <= 0:
        parser.error("--temperature must be > 0 (use spec.spec_greedy for greedy decoding)")
    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as err:
        parser.error(str(err))
    prompts = load_prompts(args.prompts)[: args.limit or None]
    pair = load_from_args(args, with_draft=args.method == "draft" or args.compare_hf)
    setup = Setup(method=args.method, k=args.k, max_new_tokens=args.max_new_tokens, sampling=sampling,
                  seed=args.seed, compare_hf=args.compare_hf)
    results = Results("spec_sample")
    rows, total = run_set(pair, prompts, setup, desc="sample", results=results)

    # Reproducibility: the same seed must give the same tokens. Not with adaptive K: its choices follow timings.
    reproducible = None
    if isinstance(args.k, int):
        ids = chat_ids(pair.tokenizer, prompts[0]["prompt"])
        again = run_loop(pair, args.method, args.k, ids, args.max_new_tokens, sampling, args.seed)
        reproducible = again.tokens == rows[0]["spec_tokens"]
    print(f"\n{pair.name}: sampling T={args.temperature} top-k={args.top_k} top-p={args.top_p} seed={args.seed}, "
          f"method {args.method}, K = {k_label(args.k)}, {pair.device} {dtype_name(pair.dtype)}")
    print_rows(rows, total, args.compare_hf)
    print(f"\nsample answer to {rows[0]['id']}:\n{rows[0]['text']}\n")
    print(f"alpha-hat {total['alpha']:.2f}, {total['tokens_per_round']:.2f} tokens/round, speedup "
          f"{total['speedup']:.2f}x; same seed, same tokens: "
          f"{ {True: 'yes', False: 'NO', None: 'not checked (adaptive K)'}[reproducible] }")
    result = {"task": "spec_sample", "pair": pair.name, "device": str(pair.device),
              "args": {**vars(args), "k": k_label(args.k)},
              "reproducible": reproducible, "total": total}
    print(f"saved {results.finish(result)}")
    if reproducible is False:
        sys.exit(1)
    return {**result, "rows": rows}


if __name__ == "__main__":
    main()
