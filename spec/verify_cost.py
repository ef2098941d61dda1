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
import statistics

import torch

from spec import log
from spec.cli import add_model_args, load_from_args, save_json, table
from spec.common import CachedModel, sync_time

DEFAULT_NS = (1, 2, 4, 8, 16, 32, 64)


def measure_bandwidth(device: torch.device, megabytes: int = 1024, trials: int = 5) -> float:
    """Device memory bandwidth in bytes/s from a large tensor copy (bytes read + bytes written)."""
    n = megabytes * (1 << 20) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(trials):
        start = sync_time(device)
        dst.copy_(src)
        times.append(sync_time(device) - start)
    return 2 * src.numel() * src.element_size() / min(times)


def time_forward(model: CachedModel, context: list[int], new: list[int], trials: int, warmup: int = 1) -> list[float]:
    """Seconds per forward of `new` on top of the cached `context`, rolled back after each trial."""
    model.reset()
    model.forward(context, keep=1)
    times = []
    for i in range(warmup + trials):
        start = sync_time(model.device)
        model.forward(new)
        elapsed = sync_time(model.device) - start
        model.rollback(len(context))
        if i >= warmup:
            times.append(elapsed)
    return times


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

    bandwidth = args.bandwidth * 1e9 if args.bandwidth else measure_bandwidth(target.device)
    weight_bytes = target.weight_bytes()
    roofline_ms = weight_bytes / bandwidth * 1e3
    rows = []
    with log.bar(total=len(ns), desc="verify cost") as bar:
        for n in ns:
            times = time_forward(target, context, fresh[:n], args.trials)
            rows.append({"n": n, "ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
                         "max_ms": max(times) * 1e3, "trials_ms": [t * 1e3 for t in times]})
            bar.update()
    for row in rows:
        row["ratio_to_1"] = row["ms"] / rows[0]["ms"] if rows[0]["n"] == 1 else float("nan")
        row["roofline_ms"] = roofline_ms
        row["ms_per_token"] = row["ms"] / row["n"]

    draft = None
    if pair.draft is not None:
        step = statistics.median(time_forward(pair.draft, context, fresh[:1], args.trials)) * 1e3
        target_step = next((r["ms"] for r in rows if r["n"] == 1), None)
        draft = {"step_ms": step, "c": step / target_step if target_step else None,
                 "weight_bytes": pair.draft.weight_bytes(), "roofline_ms": pair.draft.weight_bytes() / bandwidth * 1e3}

    print(f"target {args.target or pair.name}: {weight_bytes / 1e9:.2f} GB of weights, bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s ({'given' if args.bandwidth else 'measured'}), roofline {roofline_ms:.2f} ms/step, "
          f"device {pair.device}, dtype {str(pair.dtype).removeprefix('torch.')}, context {args.context}")
    print(table(rows, [("n", "d"), ("ms", ".2f"), ("ratio_to_1", ".2f"), ("ms_per_token", ".2f"),
                       ("min_ms", ".2f"), ("max_ms", ".2f"), ("roofline_ms", ".2f")]))
    if draft:
        print(f"draft step {draft['step_ms']:.2f} ms -> c = {draft['c']:.3f} (draft roofline "
              f"{draft['roofline_ms']:.2f} ms, c_roofline = {draft['weight_bytes'] / weight_bytes:.3f})")
    result = {
        "task": "verify_cost", "pair": pair.name, "target": args.target or pair.name, "device": str(pair.device),
        "dtype": str(pair.dtype).removeprefix("torch."), "context": args.context, "trials": args.trials,
        "bandwidth_gb_s": bandwidth / 1e9, "bandwidth_source": "given" if args.bandwidth else "measured",
        "weight_bytes": weight_bytes, "roofline_ms": roofline_ms, "rows": rows, "draft": draft,
    }
    path = save_json("verify_cost", result)
    plot(result, path.with_suffix(".png"))
    print(f"saved {path} and {path.with_suffix('.png')}")
    return result


def plot(result: dict, path) -> None:
    """ms per forward vs new tokens (log2 axis), with the memory roofline and the cost of n separate steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    ns = [r["n"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(ns, [r["ms"] for r in rows], "o-", label="measured (median)")
    ax.fill_between(ns, [r["min_ms"] for r in rows], [r["max_ms"] for r in rows], alpha=0.2, label="min-max")
    ax.plot(ns, [rows[0]["ms"] * n for n in ns], ":", color="gray", label="n separate 1-token steps")
    ax.axhline(result["roofline_ms"], color="red", ls="--",
               label=f"memory roofline ({result['bandwidth_gb_s']:.0f} GB/s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("new tokens scored in one forward (n)")
    ax.set_ylabel("ms per forward")
    ax.set_title(f"verify cost: {result['target']} on {result['device']} ({result['dtype']})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
