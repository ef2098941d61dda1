"""transformers' attention implementations side by side on the CPU, one process: forwards of a few tokens on cached
texts of several lengths, through `sdpa` (PyTorch's fused kernel, transformers' default) and `eager` (its plain
matmul-softmax-matmul), switched in turn on the same loaded model.

    python benchmarks/cpu/attention.py --pair qwen-coder --quant int4 --contexts 40,250,1200 --tokens 1,4

A measurement for a decision not yet taken: the eager backend runs every forward through `sdpa`. Rows go to
results/attention-<time>.jsonl as they come.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spec.harness import forward_times  # noqa: E402
from spec.io import Results, table  # noqa: E402
from spec.models.eager import EagerModel  # noqa: E402
from spec.models.pairs import PAIRS, load_model, resolve_pair  # noqa: E402
from spec.models.quant import quantize_model  # noqa: E402

IMPLEMENTATIONS = ("sdpa", "eager")
COLUMNS = [("role", ""), ("context", ""), ("tokens", ""), ("sdpa_ms", ".2f"), ("eager_ms", ".2f"), ("ratio", ".2f")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--pair", default="qwen-coder", help="model pair (default qwen-coder)")
    parser.add_argument("--roles", default="draft,target", help="which models (default draft,target)")
    parser.add_argument("--quant", default="int4", choices=["none", "int8", "int4"],
                        help="weight format of both (default int4, the CPU's fastest)")
    parser.add_argument("--contexts", default="40,250,1200", help="cached tokens (default 40,250,1200)")
    parser.add_argument("--tokens", default="1,4", help="tokens per forward (default 1,4)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both implementations in turn (default 2)")
    parser.add_argument("--trials", type=int, default=6, help="forwards per implementation and round (default 6)")
    args = parser.parse_args(argv)
    results = Results("attention")
    name, _ = resolve_pair(args.pair)
    for role in args.roles.split(","):
        loaded = load_model(getattr(PAIRS[name], role), torch.device("cpu"), torch.bfloat16, role=role)
        if args.quant != "none":
            quantize_model(loaded.model, args.quant, what=role)
        model = EagerModel(loaded.model)
        for context in map(int, args.contexts.split(",")):
            cached = list(range(1000, 1000 + context))
            for n in map(int, args.tokens.split(",")):
                times = {impl: [] for impl in IMPLEMENTATIONS}
                for _ in range(args.rounds):
                    for impl in IMPLEMENTATIONS:
                        loaded.model.set_attn_implementation(impl)
                        times[impl] += forward_times(model, cached, [5] * n, trials=args.trials)
                ms = {impl: statistics.median(t) * 1e3 for impl, t in times.items()}
                row = results.add({"role": role, "quant": args.quant, "context": context, "tokens": n,
                                   "sdpa_ms": ms["sdpa"], "eager_ms": ms["eager"], "ratio": ms["sdpa"] / ms["eager"]})
                print(table([row], COLUMNS), flush=True)
        loaded.model.set_attn_implementation("sdpa")
    print(table(results.rows(), COLUMNS))
    print(f"wrote {results.finish({'pair': name, 'threads': torch.get_num_threads(), 'rounds': args.rounds})}")


if __name__ == "__main__":
    main()
