"""The speedup formula and `python -m spec.calc`, pinned to the lesson's numbers."""

import random

import pytest

from spec import calc, tree
from spec.drafters import ModelDrafter, NoDrafter
from spec.loop import generate
from spec.tree_sweep import ranks_of


@pytest.mark.parametrize("alpha, c, best, gain", [
    (0.7, 0.05, 6, 2.35),
    (0.7, 0.10, 4, 1.98),
    (0.7, 0.25, 2, 1.46),
])
def test_the_lessons_best_k(alpha, c, best, gain):
    k, x = calc.best_k(alpha, c, max_k=16)
    assert k == best
    assert x == pytest.approx(gain, abs=0.005)  # the lesson quotes 2 decimals: +- half a unit in the last place


def test_alpha_half_tops_out_near_1_6x_even_with_nearly_free_drafts():
    k, x = calc.best_k(0.5, 0.05, max_k=16)
    assert 1.55 < x < 1.65 and k == 3  # "near 1.6x", 2 figures: +- half a unit in the last place
    assert max(calc.speedup(0.5, k, 0.0) for k in range(1, 33)) < 2  # the ceiling 1 / (1 - alpha)


def test_low_alpha_with_costly_drafts_loses_and_k_0_wins():
    assert all(calc.speedup(0.2, k, 0.5) < 1 for k in range(1, 17))
    assert calc.best_k(0.2, 0.5, max_k=16) == (0, 1.0)


def test_the_formula_is_leviathans():
    alpha, k, c = 0.8, 3, 0.2
    # float64, the same formula in a few operations (error ~1e-15): approx's default rel 1e-6 is ample
    assert calc.speedup(alpha, k, c) == pytest.approx((1 - alpha ** (k + 1)) / ((1 - alpha) * (1 + k * c)))
    assert calc.expected_tokens(1.0, 5) == 6.0
    assert calc.expected_tokens(0.0, 5) == 1.0
    assert calc.speedup(0.9, 0, 0.3, verify=2.0) == 1.0  # K = 0 is plain decoding, whatever v


def test_a_costlier_verify_lowers_the_speedup_and_the_best_k():
    flat = calc.best_k(0.8, 0.05, 16)
    steep = calc.best_k(0.8, 0.05, 16, verify={k: 1 + 0.1 * k for k in range(1, 17)})
    assert steep[1] < flat[1] and steep[0] < flat[0]
    # float64, a few operations (0.05 x 4 + 1.5 rounds ~1e-16): approx's default rel 1e-6 is ample
    assert calc.speedup(0.8, 4, 0.05, verify=1.5) == pytest.approx(calc.expected_tokens(0.8, 4) / 1.7)


def test_best_k_over_a_list_and_missing_verify_factors():
    assert calc.best_k(0.7, 0.1, 8, ks=[1, 2, 8])[0] == 2
    with pytest.raises(ValueError, match="K = 3"):
        calc.speedup(0.7, 3, 0.1, verify={1: 1.0})
    with pytest.raises(ValueError, match="alpha"):
        calc.expected_tokens(1.2, 3)


def test_cli_prints_a_table_and_the_best_k(capsys):
    calc.main(["--alpha", "0.7", "--c", "0.1", "--max-k", "8"])
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "best K = 4 (1.98x)"
    assert len(out) == 2 + 9 + 1  # header, rule, K = 0..8, best


def test_cli_verify_factor_and_bad_input(capsys):
    calc.main(["--alpha", "0.7", "--c", "0.1", "--verify-factor", "1.3"])
    assert capsys.readouterr().out.splitlines()[-1].startswith("best K = 5 (")
    with pytest.raises(SystemExit):
        calc.main(["--alpha", "1.5", "--c", "0.1"])
    assert "--alpha must be in [0, 1]" in capsys.readouterr().err


def _rounds(agree: list[bool], k: int) -> list[tuple[int, int]]:
    """The rounds greedy speculation with K drafts takes over a text where the draft agrees at `agree`."""
    out, start = [], 0
    while start < len(agree):
        drafted = min(k, len(agree) - start - 1)
        accepted = next((j for j in range(drafted) if not agree[start + j]), drafted)
        out.append((drafted, accepted))
        start += accepted + 1
    return out


def test_agreement_is_read_off_a_runs_rounds():
    # 2 kept then a fix; 4 kept then the bonus (unobserved); the last round drafts nothing
    assert calc.agreement([(4, 2), (4, 4), (0, 0)]) == [True, True, False, True, True, True, True, None, None]
    assert calc.merge_agreement([[True, None, None], [None, False]]) == [True, False, None]


def test_replaying_a_texts_agreements_gives_every_ks_rounds_exactly():
    """Runs at several Ks of one greedy text, merged, predict each K's own rounds exactly (a round never reads the
    bonus position it leaves unobserved), and other Ks' too; on clustered agreements the independent-alpha formula
    is off, the replay is not."""
    rng = random.Random(5)
    agree, easy = [], True
    for _ in range(3000):  # stretches of easy text (agree 99%) and hard text (agree 20%)
        easy = easy if rng.random() < 0.97 else not easy
        agree.append(rng.random() < (0.99 if easy else 0.2))
    runs = {k: _rounds(agree, k) for k in (1, 2, 4, 8)}
    merged = calc.merge_agreement([calc.agreement(r, len(agree)) for r in runs.values()])
    alpha = sum(agree) / len(agree)
    for k, rounds in runs.items():
        assert calc.replayed_rounds(merged, k, alpha) == len(rounds)  # exact: the same positions decide
    for k in (3, 6):
        unknown = [i for i, a in enumerate(merged) if a is None]
        exact = len(_rounds(agree, k))
        # unobserved positions are filled at alpha: each can move the count by at most one round
        assert abs(calc.replayed_rounds(merged, k, alpha) - exact) <= len(unknown)
    tpr = calc.replayed_tokens_per_round([[(len(agree), runs[8])]], 8, alpha)
    assert tpr == pytest.approx(len(agree) / len(runs[8]))
    assert abs(tpr - calc.expected_tokens(alpha, 8)) > 0.25  # what the formula misses on clustered text (0.30)


def test_replaying_independent_agreements_matches_the_formula():
    rng = random.Random(1)
    agree = [rng.random() < 0.7 for _ in range(200_000)]
    rounds = calc.replayed_rounds(agree, 4, 0.7)
    # ~72k rounds, tokens per round sd ~1.3: the mean within 0.03 is 6 standard errors
    assert len(agree) / rounds == pytest.approx(calc.expected_tokens(0.7, 4), abs=0.03)


# ---- token trees -------------------------------------------------------------------------------------------------


def test_a_chain_is_the_tree_calculators_special_case():
    for alpha in (0.0, 0.5, 0.9):
        for k in range(1, 7):
            assert calc.tree_tokens((1,) * k, [alpha, 0.1, 0.05]) == pytest.approx(calc.expected_tokens(alpha, k))
    draft = {1: 0.1}
    verify = {n: 1 + 0.02 * (n - 1) for n in range(1, 20)}
    assert calc.tree_round_cost((1, 1, 1, 1), draft, verify) == pytest.approx(calc.round_cost(4, 0.1, verify[5]))


def test_a_full_round_costs_the_next_one_a_draft_forward_of_two_tokens():
    draft = {1: 0.1, 2: 0.16}
    verify = {n: 1 + 0.02 * (n - 1) for n in range(1, 20)}
    plain = calc.tree_round_cost((2, 1), draft, verify)
    assert plain == pytest.approx(0.1 + 0.16 + verify[5])  # (2, 1): 2 + 2 nodes and the true token verified
    assert calc.tree_round_cost((2, 1), draft, verify, full=0.5) == pytest.approx(plain + 0.5 * 0.06)
    assert calc.tree_reach_by_depth((2, 1), lambda d, b: 0.8 if b == 2 else 0.5) == pytest.approx([0.8, 0.4])


def test_tree_tokens_sums_the_path_acceptance_of_every_node():
    a = [0.6, 0.2, 0.1]
    # shape (2, 1): 2 depth-1 nodes (0.6 + 0.2) and their children (each 0.6 more): 1 + 0.8 + 0.8 * 0.6
    assert calc.tree_tokens((2, 1), a) == pytest.approx(1 + 0.8 + 0.48)
    assert calc.tree_tokens((3, 2), a) == pytest.approx(1 + 0.9 + 0.9 * 0.8)


def test_replaying_ranks_walks_rounds_as_a_greedy_tree_would():
    ranks = [0, 0, 1, 0, 3, 0, 0, 0]
    # (2, 1): [0, 0] + bonus; [0 (rank 0 < 2), 3 (not < 1)] -> 1 + fix; [0, 0] + bonus -> 3 rounds for 8 tokens,
    # the first and the last full (every depth accepted)
    assert calc.replayed_tree_tokens(ranks, (2, 1)) == (8, 3, 2)
    # K = 1: [0] + 1 (the rank-1 token is emitted as the fix: the target's own), [0] + 3, [0] + 0, and the last
    assert calc.replayed_tree_tokens(ranks, (1,)) == (8, 5, 3)
    # Over [1, 0, 0, 2, 0] the chain (1, 1) rejects the first token; the tree (3, 1) keeps it and the next
    assert calc.replayed_tree_tokens([1, 0, 0, 2, 0], (1, 1)) == (5, 3, 1)
    assert calc.replayed_tree_tokens([1, 0, 0, 2, 0], (3, 1)) == (5, 2, 1)
    # the last token is always the round's own (fix or bonus): a round never reaches past it
    assert calc.replayed_tree_tokens([0, 0, 0], (1, 1, 1, 1)) == (3, 1, 0)


def test_tree_shapes_are_non_increasing_and_within_budget():
    shapes = calc.tree_shapes(16, 8)
    assert (1,) * 8 in shapes and (2, 1, 1, 1, 1, 1, 1, 1) in shapes and (4, 3) in shapes
    assert all(list(s) == sorted(s, reverse=True) and tree.nodes_of(s) <= 16 and len(s) <= 8 for s in shapes)
    assert (1, 2) not in shapes and (4, 4) not in shapes  # widening, and 4 + 16 nodes


@pytest.mark.parametrize("shape", [(2, 1, 1), (3, 2, 1), (1, 1, 1, 1)])
def test_the_replay_predicts_a_greedy_tree_runs_tokens_per_forward_exactly(tiny, shape):
    """fp32: the ranks from one draft forward over plain decoding's text replay every round of the real loop."""
    prompt = list(b"def fibonacci(n):\n    ")
    plain = generate(tiny.target, NoDrafter(), prompt, 40, k=0).tokens
    run = generate(tiny.target, ModelDrafter(tiny.draft, shape), prompt, 40, k=len(shape))
    assert run.tokens == plain
    full = sum(r.accepted == len(shape) for r in run.rounds)
    assert calc.replayed_tree_tokens(ranks_of(tiny, prompt, plain), shape) == (40, len(run.rounds), full)
    # a full round makes the next round's first draft forward read two tokens (the catch-up), any other round one
    assert all(b.forwards[0] == 1 + (a.accepted == len(shape)) for a, b in zip(run.rounds, run.rounds[1:])
               if b.forwards) and full > 0
