"""The speedup formula and `python -m spec.calc`, pinned to the lesson's numbers."""

import pytest

from spec import calc


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
