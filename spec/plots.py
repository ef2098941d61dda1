"""The tasks' plots (PNG beside each task's JSON). The docs' explanatory figures are spec/figures.py's."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)


def verify_cost(result: dict, path) -> None:
    """ms per forward vs new tokens (log2 axis), with the memory roofline and the cost of n separate steps."""
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


def sweep(summary_rows: list[dict], costs: dict, c: float, path: Path, title: str) -> None:
    """Speedup vs K (measured with the per-repetition range, predicted curves) and the verify factor vs K;
    `c` is the draft step the predictions used."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    left.axhline(1.0, color="grey", lw=1, label="plain decoding")
    draft = [r for r in summary_rows if r["method"] == "draft"]
    ks = [r["k"] for r in draft]
    left.plot(ks, [r["predicted_x"] for r in draft], "--", color="tab:blue", label="predicted, v = 1")
    left.plot(ks, [r["predicted_x_v"] for r in draft], ":", color="tab:blue", label="predicted, measured v(K)")
    if draft and "x" in draft[0]:
        x = [r["x"] for r in draft]
        err = [[v - r["x_lo"] for v, r in zip(x, draft)], [r["x_hi"] - v for v, r in zip(x, draft)]]
        left.errorbar(ks, x, yerr=err, fmt="o-", color="tab:blue", capsize=3, label="measured, draft model")
    lookup = [r for r in summary_rows if r["method"] == "lookup"]
    if lookup:
        left.plot([r["k"] for r in lookup], [r["x"] for r in lookup], "s-", color="tab:green",
                  label="measured, prompt lookup")
    for method, style in (("auto", "-."), ("hf-assisted", (0, (1, 3)))):
        for r in summary_rows:
            if r["method"] == method:
                key = "x" if method == "auto" else "x_e2e"
                left.axhline(r[key], ls=style, color="tab:red" if method == "auto" else "tab:purple",
                             label=f"{method} ({r[key]:.2f}x{', end to end' if key == 'x_e2e' else ''})")
    left.set(xlabel="K (drafts per round)", ylabel="speedup over plain decoding", title=title, xticks=ks)
    left.legend(fontsize=7, loc="best")
    verify = costs["verify_factor"]
    right.plot(list(verify), list(verify.values()), "o-", color="tab:orange", label="v(K) = verify K+1 tokens / 1")
    right.plot(list(verify), [k * c + v for k, v in verify.items()], "s--", color="tab:brown",
               label="round: K c + v(K)")
    right.axhline(1.0, color="grey", lw=1)
    right.set(xlabel="K", ylabel="cost in target steps", title=f"costs (c = {c:.3f} per draft step)",
              xticks=list(verify))
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench_engine(data: dict, path) -> None:
    """ms per forward vs new tokens per backend and model, with each model's memory roofline."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for backend, models in data["steps_ms"].items():
        for role, rows in models.items():
            ns = sorted(int(n) for n in rows)
            ax.plot(ns, [rows[str(n)] for n in ns], marker="o", label=f"{role} {backend}")
    for role, ms in data["roofline_ms"].items():
        ax.axhline(ms, linestyle="--", linewidth=1, color="gray")
        ax.text(1, ms, f" {role} roofline", va="bottom", fontsize=8, color="gray")
    ax.set(xscale="log", yscale="log", xlabel="new tokens per forward", ylabel="ms per forward",
           title=f"{data['device_name']}, {data['dtype']}, context {data['context']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def tree_sweep(result: dict, path: Path) -> None:
    """Measured against predicted, per shape run: tokens per target forward (left) and decode speedup (right)."""
    rows = result["measured"]
    names = [r["shape"] for r in rows]
    x = range(len(rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((left, "tokens_per_forward", "tokens per target forward"),
                           (right, "speedup", "decode speedup over plain")):
        ax.bar([i - 0.2 for i in x], [r[key] for r in rows], 0.4, label="measured")
        ax.bar([i + 0.2 for i in x], [r[f"predicted_{key}"] for r in rows], 0.4, label="predicted", alpha=0.6)
        ax.set_xticks(list(x), names, rotation=20, fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    right.axhline(1.0, color="grey", lw=1)
    left.set_xlabel("shape (branching per depth; 1,1,1,1 is the chain at K = 4)")
    fig.suptitle(f"chain vs token trees: {result['pair']} on {result['device']} ({result['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
