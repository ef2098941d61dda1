"""The figures of docs/explained.md, drawn by the project's own code.

    python -m spec.figures                      # writes docs/figures/{rule,speedup_vs_k,roofline}.png
    python -m spec.figures --out /tmp/figures --samples 100000

- rule.png: the accept/fix rule on the six-token example of `spec.dist_test` (alpha = 0.7). The accepted part
  min(p, q) plus the residual max(0, p - q) stack up to p; 10,000 rounds of `spec.rules.accept_or_fix` land on p,
  and 10,000 rounds of spec/deliberately_wrong.py's "resample from p" bug land on min(p, q) + (1 - alpha) p instead.
- speedup_vs_k.png: `spec.calc`'s predicted speedup against K for a few (alpha, c) pairs, the best K marked.
- roofline.png: why verifying K + 1 tokens costs about one step. One Llama 3.1 8B forward over n tokens in bf16
  reads 16.06 GB of weights and does 2 FLOP per parameter per token (n FLOP per byte), so its time is
  max(bytes / bandwidth, FLOPs / peak): flat until n reaches the ridge point peak / bandwidth. Drawn for a DGX Spark
  and an H200, with measurements made on an H200 next to the line. The curve you measure yourself is
  drawn by `python -m spec.verify_cost` (results/verify_cost-<time>.png).

The numbers behind each figure go to results/figures-<time>.json.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spec import calc, log
from spec.deliberately_wrong import resample_from_p_law
from spec.dist_test import TOY_P, TOY_Q, chi_square, first_tokens, merge_bins
from spec.io import save_json, table

DEFAULT_OUT = Path("docs/figures")

# (alpha, c, where such numbers come from) for the speedup figure.
SPEEDUP_CASES = [
    (0.9, 0.05, "a strong, nearly free draft"),
    (0.8, 0.1, "the paper's regime"),
    (0.8, 0.26, "8B + 1B on an H200, compiled (c measured)"),
    (0.89, 0.43, "Qwen 1.5B + 0.5B on a CPU (alpha, c measured)"),
    (0.5, 0.45, "a weak draft that is not cheap"),
]
MAX_K = 12

# Llama 3.1 8B in bf16: 8.03 B parameters, 2 bytes each; one forward does ~2 FLOP per parameter per token.
LLAMA_8B_PARAMS = 8.03e9
LLAMA_8B_BYTES = 2 * LLAMA_8B_PARAMS


@dataclass(frozen=True)
class Machine:
    name: str
    bandwidth: float  # bytes/s
    peak: float  # bf16 dense FLOP/s
    source: str

    @property
    def ridge(self) -> float:
        """FLOP per byte above which a forward is compute-bound; for the 8B in bf16 also the token count n."""
        return self.peak / self.bandwidth

    @property
    def step_ms(self) -> float:
        """The memory floor of one decode step: every weight read once."""
        return LLAMA_8B_BYTES / self.bandwidth * 1e3

    def forward_ms(self, n: np.ndarray) -> np.ndarray:
        """Roofline time of one 8B forward over n tokens [..] -> ms [..]: weights read once, 2 FLOP/param/token."""
        return np.maximum(self.step_ms, 2 * LLAMA_8B_PARAMS * n / self.peak * 1e3)


MACHINES = [
    # GB10 datasheet: 273 GB/s; its 1 PFLOP/s is FP4 with sparsity. bf16 dense is taken as 1/8 of that: the ridge
    # moves with this guess, the memory-bound floor (what decoding sees) does not.
    Machine("DGX Spark", 273e9, 125e12, "273 GB/s datasheet, ~125 TFLOP/s bf16 assumed"),
    # H200 SXM: 4.28 TB/s measured there with a device-to-device copy, 989 TFLOP/s bf16 dense datasheet.
    Machine("H200", 4.28e12, 989e12, "4.28 TB/s measured copy, 989 TFLOP/s bf16 datasheet"),
]
# Measured on the H200: HF forward + StaticCache + CUDA graph, with and without torch.compile.
H200_MEASURED = {"graph + compile": {1: 5.90, 8: 6.51}, "graph, no compile": {1: 8.88, 8: 10.62}}


# ---- the rule ------------------------------------------------------------------------------------------------


def rule_numbers(samples: int, seed: int) -> dict:
    """The six-token example: p, q, the accepted part, the residual, and the first-token frequencies [6] of `samples`
    one-draft rounds under the correct rule (spec.rules.accept_or_fix) and under the resample-from-p bug
    (spec.deliberately_wrong.resample_from_p), drawn as spec.dist_test draws them, each with its chi-square p-value
    against p.
    The bug's predicted law min(p, q) + (1 - alpha) p is there too."""
    p = torch.tensor(TOY_P, dtype=torch.float64)
    q = torch.tensor(TOY_Q, dtype=torch.float64)
    bins = merge_bins(p.numpy(), samples)
    out = {"p": p.tolist(), "q": q.tolist(), "accepted": torch.minimum(p, q).tolist(),
           "residual": (p - q).clamp_min(0).tolist(), "alpha": float(torch.minimum(p, q).sum()),
           "bug_law": resample_from_p_law(p, q).tolist(), "samples": samples}
    for variant in ("correct", "resample-p"):
        draws = first_tokens(p.float(), q.float(), variant, samples, torch.Generator().manual_seed(seed))
        out[variant] = {"freq": (np.bincount(draws, minlength=len(TOY_P)) / samples).tolist(),
                        "p_value": chi_square(draws, p.numpy(), bins)[2]}
    return out


def draw_rule(numbers: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    tokens = np.arange(len(numbers["p"]))
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4), sharey=True)
    ax = axes[0]
    ax.bar(tokens - 0.2, numbers["q"], 0.4, color="#9ecae1", label="q (draft)")
    ax.bar(tokens + 0.2, numbers["accepted"], 0.4, color="#31a354", label="accepted: min(p, q)")
    ax.bar(tokens + 0.2, numbers["residual"], 0.4, bottom=numbers["accepted"], color="#fd8d3c",
           label="fix: max(0, p - q)")
    ax.scatter(tokens + 0.2, numbers["p"], marker="_", s=300, color="black", zorder=3, label="p (target)")
    ax.set_title(f"one draft position, alpha = sum min(p, q) = {numbers['alpha']:.2f}", fontsize=9)
    ax.set_ylabel("probability")
    ax.legend(fontsize=7, loc="upper right")
    for ax, variant, title in ((axes[1], "correct", "the rule"), (axes[2], "resample-p", "bug: fix resampled from p")):
        found = numbers[variant]
        ax.bar(tokens, found["freq"], 0.6, color="#bdbdbd", label=f"{numbers['samples']:,} samples")
        ax.scatter(tokens, numbers["p"], marker="_", s=300, color="black", zorder=3, label="p (target)")
        if variant == "resample-p":
            ax.scatter(tokens, numbers["bug_law"], marker="x", color="#e6550d", zorder=3,
                       label="min(p, q) + (1 - alpha) p")
        ax.set_title(f"{title}: chi-square p-value {found['p_value']:.2g}", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    for ax in axes:
        ax.set_xticks(tokens)
        ax.set_xlabel("token")
        ax.grid(axis="y", alpha=0.3)
    _save(fig, path)


# ---- the speedup model ---------------------------------------------------------------------------------------


def speedup_numbers() -> list[dict]:
    """For each (alpha, c) of SPEEDUP_CASES: the predicted speedup at K = 0..MAX_K and the best K."""
    rows = []
    for alpha, c, about in SPEEDUP_CASES:
        k, x = calc.best_k(alpha, c, MAX_K)
        rows.append({"alpha": alpha, "c": c, "about": about, "best_k": k, "best_x": x,
                     "speedup": [calc.speedup(alpha, k, c) for k in range(MAX_K + 1)]})
    return rows


def draw_speedup(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    ks = np.arange(MAX_K + 1)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for row in rows:
        line, = ax.plot(ks, row["speedup"], "o-", ms=3,
                        label=f"alpha {row['alpha']}, c {row['c']}: {row['about']}")
        ax.plot(row["best_k"], row["best_x"], "*", ms=13, color=line.get_color())
    ax.axhline(1, color="gray", ls=":", label="plain decoding (K = 0)")
    ax.set_xlabel("draft tokens per round (K)")
    ax.set_ylabel("predicted speedup (v = 1)")
    ax.set_title("speedup = (1 - alpha^(K+1)) / ((1 - alpha)(1 + K c)); * = best K", fontsize=9)
    ax.set_xticks(ks)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    _save(fig, path)


# ---- the roofline --------------------------------------------------------------------------------------------


def roofline_numbers() -> list[dict]:
    """Per machine: the memory floor of one 8B step (ms), its decode ceiling (tok/s) and its ridge point."""
    return [{"machine": m.name, "bandwidth_gb_s": m.bandwidth / 1e9, "peak_tflop_s": m.peak / 1e12,
             "step_ms": m.step_ms, "tok_s": 1e3 / m.step_ms,
             "ridge_flop_per_byte": m.ridge, "source": m.source} for m in MACHINES]


def draw_roofline(path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    intensity = np.logspace(-0.5, 3.5, 200)  # FLOP per byte
    n = np.logspace(0, 11, 200, base=2)  # tokens per forward
    for machine, color in zip(MACHINES, ("#3182bd", "#e6550d")):
        left.plot(intensity, np.minimum(machine.peak, machine.bandwidth * intensity) / 1e12, color=color,
                  label=f"{machine.name}: ridge {machine.ridge:.0f} FLOP/byte")
        right.plot(n, machine.forward_ms(n), color=color,
                   label=f"{machine.name}: {machine.step_ms:.2f} ms floor (≤ {1e3 / machine.step_ms:.1f} tok/s)")
        right.axvline(machine.ridge, color=color, ls=":", lw=1)
    for tokens, label in ((1, "decode step (n = 1)"), (5, "verify K + 1 = 5")):
        left.axvline(tokens, color="gray", ls="--", lw=1)
        left.annotate(label, (tokens, 0.5), rotation=90, fontsize=7, ha="right", va="bottom")
    left.set(xscale="log", yscale="log", xlabel="FLOP per byte read (8B in bf16: = n tokens)",
             ylabel="attainable TFLOP/s")
    left.set_title("roofline: min(peak, bandwidth x intensity)", fontsize=9)
    for (label, points), marker in zip(H200_MEASURED.items(), ("o", "s")):
        right.plot(list(points), list(points.values()), marker, color="#e6550d", mfc="none",
                   label=f"H200 measured, {label}")
    right.set(yscale="log", xlabel="tokens scored in one forward (n)", ylabel="ms per forward")
    right.set_xscale("log", base=2)
    right.set_title("Llama 3.1 8B bf16: max(16.06 GB / bandwidth, 2 x 8.03 G x n / peak)", fontsize=9)
    for ax in (left, right):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
    _save(fig, path)


# ---- the task ------------------------------------------------------------------------------------------------


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m spec.figures", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder for the PNGs (default {DEFAULT_OUT})")
    parser.add_argument("--samples", type=int, default=10_000,
                        help="rounds of the rule drawn in each histogram (default 10000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the rule's samples (default 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.samples < 1000:
        parser.error("--samples must be at least 1000: fewer cannot show a histogram landing on p")
    log.QUIET = args.quiet
    import matplotlib

    matplotlib.use("Agg")
    args.out.mkdir(parents=True, exist_ok=True)

    rule = rule_numbers(args.samples, args.seed)
    draw_rule(rule, args.out / "rule.png")
    speedups = speedup_numbers()
    draw_speedup(speedups, args.out / "speedup_vs_k.png")
    roofline = roofline_numbers()
    draw_roofline(args.out / "roofline.png")

    print(f"the rule on six tokens, alpha {rule['alpha']:.2f}, {args.samples:,} samples each: chi-square p-value "
          f"{rule['correct']['p_value']:.3g} (correct) vs {rule['resample-p']['p_value']:.3g} (resample from p)")
    print(table(speedups, [("alpha", ".2f"), ("c", ".2f"), ("best_k", "d"), ("best_x", ".2f"), ("about", "s")]))
    print(table(roofline, [("machine", "s"), ("bandwidth_gb_s", ".0f"), ("step_ms", ".2f"), ("tok_s", ".1f"),
                           ("peak_tflop_s", ".0f"), ("ridge_flop_per_byte", ".0f")]))
    written = [args.out / name for name in ("rule.png", "speedup_vs_k.png", "roofline.png")]
    result = {"task": "figures", "args": vars(args), "rule": rule, "speedup": speedups, "roofline": roofline,
              "files": [str(p) for p in written]}
    path = save_json("figures", result)
    print("wrote " + ", ".join(str(p) for p in written) + f"; numbers in {path}")
    return result


if __name__ == "__main__":
    main()
