"""t2: what does it cost the target to score n new tokens at once?

Speculation is worth it because a decode step is memory-bound: reading every weight once costs the same whether
the forward scores 1 token or 8. This task measures it: on top of a cached context of ~512 tokens, the median time
of a target forward over n = 1, 2, 4, ... 64 new tokens (rolling the cache back after each trial), next to the
memory roofline (weight bytes / memory bandwidth), plus one draft step for the cost ratio c.

    python -m spec.verify_cost --pair qwen-coder --trials 5
    python -m spec.verify_cost --pair llama-random --device cuda
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from spec import log, plots
from spec.cli import add_model_args, load_from_args
from spec.harness import copy_bandwidth, forward_times
from spec.io import Results, table
from spec.models import dtype_name

DEFAULT_NS = (1, 2, 4, 8, 16, 32, 64)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m spec.verify_cost", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--context", type=int, default=512, help="cached context length in tokens (default 512)")
    parser.add_argument("--ns", default=",".join(map(str, DEFAULT_NS)),
                        help="new-token counts to time, comma-separated (default 1,2,4,8,16,32,64)")
    parser.add_argument("--trials", type=int, default=10, help="timed trials per n; the median is reported")
    parser.add_argument("--bandwidth", type=float,
                        help="memory bandwidth in GB/s for the roofline (default: measured with a 1 GiB copy; "
                             "a DGX Spark is 273)")
    parser.add_argument("--no-draft", action="store_true", help="skip the draft model (no cost ratio c)")
    args = parser.parse_args(argv)
    try:
        ns = sorted({int(x) for x in args.ns.split(",")})
    except ValueError:
        parser.error(f"--ns must be comma-separated integers, got {args.ns!r}")
    if ns[0] < 1 or args.trials < 1 or args.context < 1:
        parser.error("--ns values, --trials and --context must be >= 1")

    pair = load_from_args(args, with_draft=not args.no_draft)
    target = pair.target
    if args.context + max(ns) > target.max_length:
        parser.error(f"--context + max n exceeds the target's context of {target.max_length}")
    gen = torch.Generator().manual_seed(0)
    # Random ids: the cost of a forward does not depend on which tokens it reads.
    ids = torch.randint(0, target.vocab, (args.context + max(ns),), generator=gen).tolist()
    context, fresh = ids[: args.context], ids[args.context :]

    bandwidth = args.bandwidth * 1e9 if args.bandwidth else copy_bandwidth(target.device)
    weight_bytes = target.weight_bytes()
    roofline_ms = weight_bytes / bandwidth * 1e3
    results, rows = Results("verify_cost"), []
    with log.bar(total=len(ns), desc="verify cost") as bar:
        for n in ns:
            times = forward_times(target, context, fresh[:n], args.trials)
            ms = statistics.median(times) * 1e3
            rows.append(results.add({
                "n": n, "ms": ms, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3,
                "trials_ms": [t * 1e3 for t in times], "ms_per_token": ms / n, "roofline_ms": roofline_ms,
                "ratio_to_1": ms / rows[0]["ms"] if rows and rows[0]["n"] == 1 else 1.0 if n == 1 else math.nan,
            }))
            bar.update()

    draft = None
    if pair.draft is not None:
        step = statistics.median(forward_times(pair.draft, context, fresh[:1], args.trials)) * 1e3
        target_step = next((r["ms"] for r in rows if r["n"] == 1), None)
        draft = {"step_ms": step, "c": step / target_step if target_step else None,
                 "weight_bytes": pair.draft.weight_bytes(), "roofline_ms": pair.draft.weight_bytes() / bandwidth * 1e3}

    print(f"target {args.target or pair.name}: {weight_bytes / 1e9:.2f} GB of weights, bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s ({'given' if args.bandwidth else 'measured'}), "
          f"roofline {roofline_ms:.2f} ms/step, device {pair.device}, dtype {dtype_name(pair.dtype)}, "
          f"context {args.context}")
    print(table(rows, [("n", "d"), ("ms", ".2f"), ("ratio_to_1", ".2f"), ("ms_per_token", ".2f"),
                       ("min_ms", ".2f"), ("max_ms", ".2f"), ("roofline_ms", ".2f")]))
    if draft:
        print(f"draft step {draft['step_ms']:.2f} ms -> c = {draft['c']:.3f} (draft roofline "
              f"{draft['roofline_ms']:.2f} ms, c_roofline = {draft['weight_bytes'] / weight_bytes:.3f})")
    result = {
        "task": "verify_cost", "pair": pair.name, "target": args.target or pair.name, "device": str(pair.device),
        "dtype": dtype_name(pair.dtype), **pair.setup_fields(), "context": args.context, "trials": args.trials,
        "bandwidth_gb_s": bandwidth / 1e9, "bandwidth_source": "given" if args.bandwidth else "measured",
        "weight_bytes": weight_bytes, "roofline_ms": roofline_ms, "draft": draft,
    }
    path = results.finish(result)
    result["rows"] = rows
    plots.verify_cost(result, path.with_suffix(".png"))
    print(f"saved {path} and {path.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
