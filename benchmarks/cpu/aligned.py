"""Weights at a cache line's start against weights where their file put them, one process, on the CPU.

    python benchmarks/cpu/aligned.py --pair qwen-coder --roles target,draft --formats none,int8,int4 --tokens 1,2,4,5

transformers maps a safetensors checkpoint and leaves each weight at its offset in the file, and the quantized cache
parses its file the same way, so a weight starts 16, 32 or 48 bytes past a 64-byte cache line. `EagerModel` copies
such weights into memory of their own (`spec.models.eager.align_weights`; `copy_s` is what that took). For each
model and format this loads the model once, keeps both copies of every moved tensor, and times forwards of 1, 2, 4
and 5 tokens on 100 cached ones with the two copies swapped in turn, round after round, so both sides see the same
machine. Rows go to results/aligned-<time>.jsonl as they come. The int4/int8 rows need the quantized cache already
written (any earlier run with that format); a freshly quantized model's weights are aligned already, and `cache`
says which it was.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spec.harness import forward_times  # noqa: E402
from spec.io import Results, table  # noqa: E402
from spec.models.eager import ALIGNMENT, EagerModel, weights  # noqa: E402
from spec.models.pairs import PAIRS, load_model, resolve_pair  # noqa: E402
from spec.models.quant import quantize_model  # noqa: E402

COLUMNS = [("role", ""), ("format", ""), ("tokens", ""), ("moved_gb", ".2f"), ("copy_s", ".2f"),
           ("as_loaded_ms", ".1f"), ("aligned_ms", ".1f"), ("ratio", ".2f")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--pair", default="qwen-coder", help="model pair (default qwen-coder)")
    parser.add_argument("--roles", default="target,draft", help="which of its models (default target,draft)")
    parser.add_argument("--formats", default="none,int8,int4", help="weight formats (default none,int8,int4)")
    parser.add_argument("--tokens", default="1,2,4,5", help="tokens per forward (default 1,2,4,5)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of both copies in turn (default 5)")
    parser.add_argument("--trials", type=int, default=4, help="forwards per copy and round (default 4)")
    args = parser.parse_args(argv)
    results = Results("aligned")
    name, _ = resolve_pair(args.pair)
    context = list(range(1000, 1100))
    for role in args.roles.split(","):
        for scheme in args.formats.split(","):
            loaded = load_model(getattr(PAIRS[name], role), torch.device("cpu"), torch.bfloat16, role=role)
            done = quantize_model(loaded.model, scheme, what=role) if scheme != "none" else {}
            before = {id(t): (t, t.data) for t in weights(loaded.model)}
            start = time.perf_counter()
            model = EagerModel(loaded.model)  # moves the weights that start off a cache line
            copy_s = time.perf_counter() - start
            moved = [(t, data, t.data) for t, data in before.values() if t.data.data_ptr() != data.data_ptr()]
            assert all(new.data_ptr() % ALIGNMENT == 0 for _, _, new in moved)
            gb = sum(new.numel() * new.element_size() for _, _, new in moved) / 1e9
            for n in map(int, args.tokens.split(",")):
                new = [5] * n
                times = {"as_loaded": [], "aligned": []}
                forward_times(model, context, new, trials=1, warmup=1)
                for _ in range(args.rounds):
                    for side, pick in (("as_loaded", 1), ("aligned", 2)):
                        for entry in moved:
                            entry[0].data = entry[pick]
                        times[side] += forward_times(model, context, new, trials=args.trials)
                ms = {side: statistics.median(t) * 1e3 for side, t in times.items()}
                row = results.add({"role": role, "format": scheme, "tokens": n, "moved_gb": gb, "copy_s": copy_s,
                                   "as_loaded_ms": ms["as_loaded"], "aligned_ms": ms["aligned"],
                                   "ratio": ms["as_loaded"] / ms["aligned"], "cache": done.get("cache", "")})
                print(table([row], COLUMNS), flush=True)
            del model, loaded, before, moved
    print(table(results.rows(), COLUMNS))
    path = results.finish({"pair": name, "threads": torch.get_num_threads(), "rounds": args.rounds,
                           "trials": args.trials, "context": len(context)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
