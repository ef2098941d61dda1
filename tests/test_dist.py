"""t5's statistics: binning, chi-square and power, the rule on toy rows, and the whole loop on the tiny pair.

Every chi-square test runs with a fixed seed: the correct code must pass and every Break-It variant must fail, at
sample sizes where the power against each bug is at least 0.99 (asserted next to the verdict).
"""

import numpy as np
import pytest
import torch

from spec import dist_test as dt
from spec.chisquare import sequence_law
from spec.deliberately_wrong import BUGS, resample_from_p_law, softmax_q_law
from spec.models import load_pair
from spec.warps import Sampling, TokenCounts, warp

RULE_N = 20_000  # rounds per rule test here (the CLI uses 10^5)
LOOP_N = 400  # generations per loop test here (the CLI uses 2000)
LOOP_SAMPLING = Sampling(1.5)  # flatter than the CLI's 1.0: the softmax-q bug shows more, so 400 runs suffice
SEED = 0


@pytest.fixture(scope="module")
def tiny():
    return load_pair("tiny", device="cpu")


def toy() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(dt.TOY_P, dtype=torch.float64), torch.tensor(dt.TOY_Q, dtype=torch.float64)


def test_toy_vectors_are_as_the_issue_asks():
    p, q = toy()
    # float64 sums of 6 literals: error <= 6 eps64 = 7e-16, far inside approx's default rel 1e-6; a typo'd digit is 1e-2
    assert p.sum() == pytest.approx(1) and q.sum() == pytest.approx(1) and len(p) == 6
    assert float(torch.minimum(p, q).sum()) == pytest.approx(0.7)
    assert (q > p).any() and (q < p).any()  # over- and under-proposed tokens
    assert int((q == q.max()).sum()) == 1  # a unique argmax for the softmax-q bug


def test_merge_bins_pools_small_categories():
    bins = dt.merge_bins(np.array([0.5, 0.3, 0.15, 0.04, 0.01]), 100)  # expected 50, 30, 15, 4, 1
    assert bins.tolist() == [0, 1, 2, 3, 3]
    # A pooled bin that is itself too small joins the smallest own bin.
    bins = dt.merge_bins(np.array([0.6, 0.36, 0.04]), 100)  # expected 60, 36, 4
    assert bins.tolist() == [0, 1, 1]
    # Categories only the draft can propose (p = 0) must not form a bin expecting nothing (0/0 in the statistic).
    bins = dt.merge_bins(np.array([0.5, 0.5, 0.0]), 100)
    assert bins.tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="too few"):
        dt.merge_bins(np.array([0.5, 0.5]), 6)


def test_chi_square_and_power_on_known_counts():
    probs = np.array([0.5, 0.5])
    bins = np.array([0, 1])
    chi2, df, p_value = dt.chi_square(np.array([0] * 60 + [1] * 40), probs, bins)
    # chi2 = (10^2 + 10^2) / 50 exactly in float64; 0.0455 is chi2.sf(4, 1) = 0.0455003 to 3 figures: +- half a unit
    assert (chi2, df) == (pytest.approx(4.0), 1) and p_value == pytest.approx(0.0455, abs=5e-5)
    # No difference: the test rejects exactly at its level; a large difference: almost surely.
    # float64 special functions (~1e-13 rel) and the noncentrality floor 1e-12 (moves it ~6e-12 rel): rel 1e-9 ample
    assert dt.power(probs, probs, bins, 1000) == pytest.approx(dt.LEVEL, rel=1e-9)
    assert dt.power(probs, np.array([0.6, 0.4]), bins, 1000) > 0.99
    assert dt.power(probs, np.array([0.51, 0.49]), bins, 1000) < 0.1


def test_bug_laws_by_hand():
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    q = torch.tensor([1.0, 0.0], dtype=torch.float64)
    # Exact float64 formulas of a few operations (error ~1e-16): approx's default rel 1e-6 is ample.
    # resample-p: keep token 0 half the time; otherwise redraw from p, which gives 0 again half the time.
    assert resample_from_p_law(p, q).tolist() == pytest.approx([0.75, 0.25])
    # softmax-q: the argmax 0 is kept with p/q = 0.5, the residual max(0, p - q) is all on token 1.
    assert softmax_q_law(p, q).tolist() == pytest.approx([0.5, 0.5])
    q = torch.tensor([0.2, 0.8], dtype=torch.float64)  # argmax 1, kept with 0.5/0.8; residual all on 0
    assert softmax_q_law(p, q).tolist() == pytest.approx([0.375, 0.625])


def test_rule_on_toy_rows_correct_passes_every_bug_fails():
    p, q = toy()
    checks = dt.rule_checks("toy", p, q, list(BUGS), RULE_N, SEED)
    by = {(c.case, c.variant): c for c in checks}
    assert by[("toy", "correct")].verdict == "pass"
    assert by[("toy, one-hot q", "correct")].verdict == "pass"
    assert by[("toy", "resample-p")].verdict == "FAIL"
    assert by[("toy, vs min(p,q)+(1-a)p", "resample-p")].verdict == "pass"  # the bug's law is the docstring's
    assert by[("toy", "softmax-q")].verdict == "FAIL"
    assert all(c.ok for c in checks)
    assert all(c.power >= dt.POWER_GOAL for c in checks if c.expect == "fail")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rule_checks_take_rows_on_the_gpu():
    # The real rows come from models on the GPU; the seeded generator is a CPU one (it once crashed here).
    p, q = toy()
    on_cpu = dt.rule_checks("toy", p, q, ["resample-p"], 2000, SEED)
    on_gpu = dt.rule_checks("toy", p.cuda(), q.cuda(), ["resample-p"], 2000, SEED)
    assert [c.chi2 for c in on_gpu] == [c.chi2 for c in on_cpu]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_whole_loop_checks_run_on_the_gpu():
    # `dist_test --device cuda` once crashed here: a CPU generator handed to the loop sampling on the GPU.
    on_gpu = load_pair("tiny", device="cuda")
    checks = dt.loop_checks(on_gpu, [], 200, SEED, Sampling(1.0))
    assert [c.variant for c in checks] == ["correct"] and checks[0].n == 200 and checks[0].ok


def test_rule_on_rows_of_the_tiny_pair(tiny):
    """Rows of two different models (259 tokens): the same verdicts as on the toy rows."""
    ids = tiny.tokenizer(dt.LOOP_PROMPT).input_ids
    sampling = Sampling(1.0)
    tiny.target.reset()
    tiny.draft.reset()
    p = warp(tiny.target.forward(ids)[-1], sampling)
    q = warp(tiny.draft.forward(ids)[-1], sampling)
    tiny.target.reset()
    tiny.draft.reset()
    checks = dt.rule_checks("tiny rows", p, q, list(BUGS), RULE_N, SEED)
    assert all(c.ok for c in checks), [c.row() for c in checks]
    assert all(c.power >= dt.POWER_GOAL for c in checks if c.expect == "fail")


def test_sequence_law_is_a_partition_matching_the_target(tiny):
    sampling = Sampling(1.0)
    prompt = tiny.tokenizer(dt.LOOP_PROMPT).input_ids
    nodes, probs = dt.sequence_law(tiny.target, prompt, 2, sampling, 1000)
    # float64: own masses telescope back to 1 over ~10^2 nodes, error ~1e-14: approx's default rel 1e-6 is ample
    assert nodes[0] == () and probs.sum() == pytest.approx(1.0)
    assert all(len(node) <= 2 for node in nodes) and len(set(nodes)) == len(nodes)
    # The mass of every first token equals the target's own next-token probability.
    tiny.target.reset()
    first = warp(tiny.target.forward(prompt)[-1], sampling).double().numpy()
    tiny.target.reset()
    for node in nodes:
        if len(node) == 1:
            below = sum(pr for other, pr in zip(nodes, probs) if other[:1] == node)
            # float32 logits of two chunkings, prob. bound |dz| <= 2 eps32 S sum_i sqrt(n_i) (S = max sum|W h| = 50, 20
            # reductions on the path, sum sqrt(n_i) = 127 + 4 sqrt(T) = 142 at T = 14) = 8.5e-4; softmax: rel 2|dz|
            assert below == pytest.approx(first[node[0]], rel=2e-3)
    cats = dt.categorize([[nodes[-1][0], nodes[-1][1], 7], [258, 258, 258]], nodes, 3)
    assert cats.tolist() == [len(nodes) - 1, 0]  # a listed prefix, and the root's "anything else"


def test_whole_loop_correct_passes_every_loop_bug_fails(tiny):
    checks = dt.loop_checks(tiny, list(BUGS), LOOP_N, SEED, LOOP_SAMPLING)
    by = {c.variant: c for c in checks}
    assert set(by) == {"correct", "softmax-q", "no-rollback"}
    assert by["correct"].verdict == "pass"
    assert by["softmax-q"].verdict == "FAIL" and by["no-rollback"].verdict == "FAIL"
    # Power against each bug, from an independent pilot (seed + 1) at the same n.
    assert by["softmax-q"].power >= dt.POWER_GOAL and by["no-rollback"].power >= dt.POWER_GOAL


def test_every_warp_through_the_loop_and_the_committed_penalty_bug(tiny):
    """Each warp passes through the whole loop (penalties strong enough to matter at positions 2-3 of a round); the
    penalty that ignores the drafted path is caught far past 1e-6 (the issue's bar), with its power from a pilot."""
    checks = dt.warp_checks(tiny, list(dt.WARPS), 300, SEED, bug=True)
    correct = [c for c in checks if c.variant == "correct"]
    assert len(correct) == len(dt.WARPS) and all(c.verdict == "pass" for c in correct), [c.row() for c in correct]
    (bug,) = [c for c in checks if c.variant == "committed-penalty"]
    assert bug.p_value < 1e-6 and bug.power >= dt.POWER_GOAL


def test_the_exact_law_counts_each_prefix(tiny):
    """sequence_law under a penalty: a child's probability is its parent's times the target's conditional warped
    with the parent's tokens counted. Checked by hand at depth 2 under the first token whose own repetition the
    penalty moves most, where the same product without the count is far off."""
    sampling = Sampling(1.0, frequency_penalty=2.0)
    prompt = tiny.tokenizer(dt.LOOP_PROMPT).input_ids
    nodes, probs = sequence_law(tiny.target, prompt, 2, sampling, 1000)
    mass = dict(zip(nodes, probs))
    counts = TokenCounts(prompt, tiny.target.vocab, "cpu")
    tiny.target.reset()
    p1 = warp(tiny.target.forward(prompt)[-1:], sampling, *counts.rows(torch.tensor([]), 0, 1))[0].double()
    length = tiny.target.length

    def conditional(first: tuple, counted: bool) -> torch.Tensor:
        tiny.target.rollback(length)
        row = counts.rows(torch.tensor(first if counted else ()), len(first) if counted else 0, 1)
        return warp(tiny.target.forward(list(first))[-1:], sampling, *row)[0].double()

    def worst(first: tuple, counted: bool) -> float:
        p2 = conditional(first, counted)
        return max(abs(mass[c] / float(p1[first[0]] * p2[c[1]]) - 1) for c in nodes if len(c) == 2 and c[:1] == first)

    firsts = [n for n in nodes if len(n) == 1 and any(len(c) == 2 and c[:1] == n for c in nodes)]
    first = max(firsts, key=lambda f: worst(f, counted=False))
    # Computed through forwards of other shapes: fp32 logits within 1e-3 (test_graph's bound for the tiny pair),
    # so each probability within 2e-3 relative, the product of two within 4e-3.
    assert worst(first, counted=True) <= 4e-3
    assert worst(first, counted=False) > 0.04  # without the count it would be off by ten times that
    tiny.target.reset()


@pytest.mark.real
def test_rule_on_real_qwen_rows(real):
    # top-p 0.95 as in the CLI: it keeps the rows' support small enough for 10^5 draws in seconds.
    p, q, _ = dt.real_rows(real, Sampling(1.0, top_p=0.95), dt.REAL_PROMPT)
    checks = dt.rule_checks("real rows", p, q, list(BUGS), RULE_N, SEED)
    assert all(c.ok for c in checks), [c.row() for c in checks]
    assert all(c.power >= dt.POWER_GOAL for c in checks if c.expect == "fail")
