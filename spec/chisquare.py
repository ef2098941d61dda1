"""Chi-square tests with stated power, and the target's exact law of its first tokens.

The design: categories whose expected count is below MIN_EXPECTED are pooled (`merge_bins`); a test passes when its
p-value is at least LEVEL. Power -- the chance a test at this sample size and binning rejects a wrong law -- comes
from the noncentral chi-square with noncentrality n * sum_b (r_b - p_b)^2 / p_b (`power`, exact for a law known in
closed form; `pilot_power`, estimated from an independent pilot sample). docs/exactness.md has the design, sample
sizes and results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from scipy import stats

from spec.models import Model
from spec.warps import Sampling, TokenCounts, warp

LEVEL = 1e-3  # significance: a correct run is wrongly failed once in a thousand
MIN_EXPECTED = 5  # bins with a smaller expected count are pooled
POWER_GOAL = 0.99



def merge_bins(probs: np.ndarray, n: int) -> np.ndarray:
    """Bin of each category [C] (int): categories expecting >= MIN_EXPECTED of n draws keep their own bin, the rest
    share one pooled bin, which joins the smallest own bin if it is itself too small."""
    probs = np.asarray(probs, dtype=np.float64)
    big = np.flatnonzero(probs * n >= MIN_EXPECTED)
    if len(big) < 2:
        raise ValueError(f"{n} draws are too few: fewer than two categories expect {MIN_EXPECTED} or more")
    bins = np.full(len(probs), len(big), dtype=np.int64)  # everything starts in the pooled bin
    bins[big] = np.arange(len(big))
    pooled = bins == len(big)
    # A pooled bin expecting too little (or nothing: tokens only q can propose) joins the smallest own bin, where
    # any draw a bug makes of it still shows.
    if pooled.any() and probs[pooled].sum() * n < MIN_EXPECTED:
        bins[pooled] = int(np.argmin(probs[big]))
    return bins


@dataclass
class Check:
    """One chi-square test and its verdict."""

    part: str  # a / b / c
    case: str
    variant: str  # "correct" or a Break-It name
    n: int
    bins: int
    chi2: float
    df: int
    p_value: float
    expect: str  # "pass" or "fail"
    power: float | None = None  # P(reject | the bug's law) at this n and binning; None for the correct code

    @property
    def verdict(self) -> str:
        return "pass" if self.p_value >= LEVEL else "FAIL"

    @property
    def ok(self) -> bool:
        return self.verdict.lower() == self.expect

    def row(self) -> dict:
        return {**asdict(self), "verdict": self.verdict, "as_expected": "yes" if self.ok else "NO"}


def chi_square(categories: np.ndarray, probs: np.ndarray, bins: np.ndarray) -> tuple[float, int, float]:
    """Pearson chi-square of observed categories [n] (ints) against probs [C] under a binning [C] -> (chi2, df, p)."""
    n = len(categories)
    n_bins = int(bins.max()) + 1
    observed = np.bincount(bins[categories], minlength=n_bins)
    expected = np.bincount(bins, weights=np.asarray(probs, dtype=np.float64), minlength=n_bins)
    expected = expected / expected.sum() * n  # float rounding must not show up as a discrepancy
    result = stats.chisquare(observed, expected)
    return float(result.statistic), n_bins - 1, float(result.pvalue)


def power(probs: np.ndarray, law: np.ndarray, bins: np.ndarray, n: int) -> float:
    """P(the test rejects at LEVEL) when n draws really follow `law` [C] instead of `probs` [C] (noncentral chi2)."""
    n_bins = int(bins.max()) + 1
    p_b = np.bincount(bins, weights=np.asarray(probs, dtype=np.float64), minlength=n_bins)
    r_b = np.bincount(bins, weights=np.asarray(law, dtype=np.float64), minlength=n_bins)
    p_b, r_b = p_b / p_b.sum(), r_b / r_b.sum()
    return noncentral_power(n * float(((r_b - p_b) ** 2 / p_b).sum()), n_bins - 1)


def noncentral_power(noncentrality: float, df: int) -> float:
    critical = stats.chi2.isf(LEVEL, df)
    return float(stats.ncx2.sf(critical, df, max(noncentrality, 1e-12)))


def pilot_power(pilot: np.ndarray, probs: np.ndarray, bins: np.ndarray, n: int) -> float:
    """Power at n against a bug whose law is only known through an independent pilot sample [m] of categories.

    The plug-in distance sum_b (r_b - p_b)^2 / p_b from m draws overstates the true one by about
    sum_b r_b (1 - r_b) / (m p_b); that bias is subtracted before scaling to n draws.
    """
    m = len(pilot)
    n_bins = int(bins.max()) + 1
    p_b = np.bincount(bins, weights=np.asarray(probs, dtype=np.float64), minlength=n_bins)
    p_b = p_b / p_b.sum()
    r_b = np.bincount(bins[pilot], minlength=n_bins) / m
    distance = ((r_b - p_b) ** 2 / p_b).sum() - (r_b * (1 - r_b) / (m * p_b)).sum()
    return noncentral_power(n * float(distance), n_bins - 1)


def sequence_law(target: Model, prompt: Sequence[int], depth: int, sampling: Sampling, n: int):
    """The target's exact law of the first `depth` tokens, as a tree cut where expected counts fall below
    MIN_EXPECTED of n draws.

    Returns (nodes, probs): nodes is a list of prefixes (tuples, the root () first), probs [len(nodes)] the
    probability of the event "the deepest listed prefix of the output is this node" — a partition of all outputs,
    so probs sum to 1. Each expanded node costs one target forward over its few tokens.
    """
    prompt = list(prompt)
    counts = TokenCounts(prompt, target.vocab, target.device) if sampling.penalised else None
    target.reset()
    if len(prompt) > 1:
        target.forward(prompt[:-1], keep=1)
    base = target.length
    mass = {(): 1.0}
    frontier = [()]
    for _ in range(depth):
        grown = []
        for prefix in frontier:
            logits = target.forward([prompt[-1], *prefix], keep=1)[-1]
            target.rollback(base)
            # The penalties at this node count its prefix: the output so far.
            row = counts.rows(torch.tensor(prefix, dtype=torch.long), len(prefix), 1) if counts else (None, None)
            cond = warp(logits[None], sampling, *row)[0].double().cpu().numpy()
            for token in np.flatnonzero(n * mass[prefix] * cond >= MIN_EXPECTED):
                child = (*prefix, int(token))
                mass[child] = mass[prefix] * float(cond[token])
                grown.append(child)
        frontier = grown
    target.reset()
    nodes = list(mass)
    own = dict(mass)
    for node in nodes[1:]:
        own[node[:-1]] -= mass[node]  # a parent's own event excludes its listed children
    return nodes, np.clip(np.array([own[node] for node in nodes]), 0.0, None)


def categorize(outputs: Sequence[Sequence[int]], nodes: list[tuple], depth: int) -> np.ndarray:
    """The node of each output [n]: its deepest prefix (up to `depth` tokens) that is a listed node."""
    index = {node: i for i, node in enumerate(nodes)}
    out = []
    for tokens in outputs:
        tokens = tuple(tokens[:depth])
        length = len(tokens)
        while tokens[:length] not in index:
            length -= 1
        out.append(index[tokens[:length]])
    return np.array(out, dtype=np.int64)
