"""t4: speculative sampling (the whole warp pipeline), same distribution as plain sampling.

Each draft token d is accepted with probability min(1, p(d) / q(d)); at the first rejection the fix token is drawn from
max(0, p - q) normalised; if all K are accepted a bonus token is drawn from p. Target and draft logits go through the
same warps first (spec/warps.py: logit_bias, presence / frequency / repetition penalties counted along each drafted
path, temperature, min_p, top-k, top-p). The outputs differ from plain sampling token by token (the random draws are
consumed differently) but follow the same distribution: `python -m spec.dist_test` proves that. Seeded runs are
reproducible: each prompt runs twice with the same seed and must give the same tokens.

With --coupled every position's randomness comes from (seed, position) alone, shared by draft and target
(Gumbel-max coupling): the text is then the same with speculation or without, seed by seed. The task checks that
for --seeds seeds per prompt and reports what the coupling costs in acceptance against the standard rule, both run
on the same prompts and seeds.

    python -m spec.spec_sample --temperature 0.7 --top-p 0.9 --seed 1
    python -m spec.spec_sample --temperature 0.7 --top-p 0.9 --presence-penalty 0.5 --coupled --seeds 5
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from spec import tree
from spec.cli import add_model_args, add_run_args, load_from_args, resolve_tree
from spec.harness import Setup, k_label, print_rows, ratio, run_loop, run_set
from spec.io import Results, load_prompts, table
from spec.models import chat_ids, dtype_name
from spec.warps import Sampling


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m spec.spec_sample", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    add_run_args(parser, prompts="short", limit=3, max_new_tokens=64)
    g = parser.add_argument_group("sampling (spec/warps.py applies them in this order: bias, penalties, temperature, "
                                  "min_p, top-k, top-p)")
    g.add_argument("--temperature", type=float, default=1.0, help="> 0 (default 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default 1.0 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top one (default 0 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="-2..2, on tokens of the output (default 0)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="-2..2, x each token's count (default 0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0, on tokens of the prompt and the output (default 1 = off)")
    g.add_argument("--seed", type=int, default=0, help="seed of the torch.Generator (default 0)")
    g.add_argument("--coupled", action="store_true",
                   help="coupled sampling: randomness keyed by (seed, position), the same text with or without "
                        "speculation; compared with the standard rule on the same prompts and seeds")
    g.add_argument("--seeds", type=int, default=1, help="with --coupled: seeds per prompt, from --seed (default 1)")
    parser.add_argument("--method", default="draft", choices=["draft", "lookup"], help="drafter (default draft)")
    parser.add_argument("--compare-hf", action="store_true", help="also time transformers' sampling generate")
    args = parser.parse_args(argv)
    if args.temperature <= 0:
        parser.error("--temperature must be > 0 (use spec.spec_greedy for greedy decoding)")
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    resolve_tree(parser, args, args.method)
    try:
        args.sampling = Sampling(args.temperature, args.top_k, args.top_p, min_p=args.min_p,
                                 presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                                 repetition_penalty=args.repetition_penalty)
    except ValueError as err:
        parser.error(str(err))
    return args


def coupled_runs(pair, prompts: list[dict], setup: Setup, seeds: range, results: Results) -> dict:
    """For each seed: coupled speculation against coupled plain decoding (must be identical), and the standard
    rule on the same prompts and seed. Totals of both: identity, alpha-hat, tokens per round."""
    coupled = replace(setup, sampling=replace(setup.sampling, coupled=True))
    per_seed, sums = [], {"coupled": [0, 0, 0, 0], "standard": [0, 0, 0, 0]}  # accepted, drafted, tokens, rounds
    for seed in seeds:
        row = {"seed": seed}
        for name, variant in (("coupled", coupled), ("standard", setup)):
            rows, total = run_set(pair, prompts, replace(variant, seed=seed), desc=f"{name} seed {seed}",
                                  results=results, tag={"seed": seed, "rule": name})
            for i, key in enumerate(("accepted", "drafted", "tokens", "rounds")):
                sums[name][i] += sum(r["spec"][key] for r in rows)
            row[f"alpha_{name}"] = total["alpha"]
            if name == "coupled":
                row["identical"] = total["identical"]
        per_seed.append(row)
    out = {"seeds": per_seed, "identical": all(r["identical"] for r in per_seed)}
    for name, (accepted, drafted, tokens, rounds) in sums.items():
        out[f"alpha_{name}"] = ratio(accepted, drafted)
        out[f"tokens_per_round_{name}"] = ratio(tokens, rounds)
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    prompts = load_prompts(args.prompts)[: args.limit or None]
    pair = load_from_args(args, with_draft=args.method == "draft" or args.compare_hf)
    sampling = args.sampling
    setup = Setup(method=args.method, k=args.k, max_new_tokens=args.max_new_tokens, sampling=sampling,
                  seed=args.seed, compare_hf=args.compare_hf, tree=args.tree)
    results = Results("spec_sample")
    args.sampling = sampling.describe()  # for the JSON's args
    args.tree = args.tree and tree.describe(args.tree)
    if args.coupled:
        report = coupled_runs(pair, prompts, setup, range(args.seed, args.seed + args.seeds), results)
        print(f"\n{pair.name}: coupled vs standard rule, {sampling.describe()}, method {args.method}, "
              f"K = {k_label(args.k)}, {len(prompts)} prompts x {args.seeds} seeds, {pair.device} "
              f"{dtype_name(pair.dtype)}")
        print(table(report["seeds"], [("seed", "d"), ("identical", "s"), ("alpha_coupled", ".3f"),
                                      ("alpha_standard", ".3f")]))
        print(f"coupled text {'IDENTICAL' if report['identical'] else 'DIFFERENT'} with and without speculation "
              f"on every prompt and seed; alpha-hat {report['alpha_coupled']:.3f} coupled vs "
              f"{report['alpha_standard']:.3f} standard ({report['tokens_per_round_coupled']:.2f} vs "
              f"{report['tokens_per_round_standard']:.2f} tokens/round)")
        result = {"task": "spec_sample", "mode": "coupled", "pair": pair.name, "device": str(pair.device),
                  **pair.setup_fields(),
                  "args": {**vars(args), "k": k_label(args.k)}, **report}
        print(f"saved {results.finish(result)}")
        if not report["identical"]:
            sys.exit(1)
        return result
    rows, total = run_set(pair, prompts, setup, desc="sample", results=results)

    # Reproducibility: the same seed must give the same tokens. Not with adaptive K: its choices follow timings.
    reproducible = None
    if isinstance(args.k, int):
        ids = chat_ids(pair.tokenizer, prompts[0]["prompt"])
        again = run_loop(pair, args.method, args.k, ids, args.max_new_tokens, sampling, args.seed, setup.tree)
        reproducible = again.tokens == rows[0]["spec_tokens"]
    print(f"\n{pair.name}: sampling {sampling.describe()}, seed={args.seed}, method {args.method}, "
          f"K = {k_label(args.k)}, {pair.device} {dtype_name(pair.dtype)}")
    print_rows(rows, total, args.compare_hf)
    print(f"\nsample answer to {rows[0]['id']}:\n{rows[0]['text']}\n")
    print(f"alpha-hat {total['alpha']:.2f}, {total['tokens_per_round']:.2f} tokens/round, speedup "
          f"{total['speedup']:.2f}x; same seed, same tokens: "
          f"{ {True: 'yes', False: 'NO', None: 'not checked (adaptive K)'}[reproducible] }")
    result = {"task": "spec_sample", "pair": pair.name, "device": str(pair.device), **pair.setup_fields(),
              "args": {**vars(args), "k": k_label(args.k)}, "reproducible": reproducible, "total": total}
    print(f"saved {results.finish(result)}")
    if reproducible is False:
        sys.exit(1)
    return {**result, "rows": rows}


if __name__ == "__main__":
    main()
