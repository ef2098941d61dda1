"""The rules on hand-built vectors: exact outcomes where the rule is deterministic, exact probabilities where not."""

import pytest
import torch

from spec.rules import accept_or_fix, greedy_rule
from spec.warps import Sampling, warp


def logits_with_argmax(rows: list[int], vocab: int = 10) -> torch.Tensor:
    out = torch.zeros(1, len(rows), vocab)
    for i, best in enumerate(rows):
        out[0, i, best] = 5.0
    return out


@pytest.mark.parametrize(
    "best, drafts, kept, nxt",
    [
        ([7, 3, 9], [7, 4], 1, 3),  # first draft kept, second fixed to the argmax
        ([7, 3, 9], [7, 3], 2, 9),  # all kept: bonus from the last row
        ([7, 3, 9], [1, 3], 0, 7),  # a later match after a mismatch does not count
        ([7], [], 0, 7),  # K = 0 is one plain greedy step
    ],
)
def test_greedy_rule(best, drafts, kept, nxt):
    n, token = greedy_rule(logits_with_argmax(best), torch.tensor([drafts], dtype=torch.long))
    assert (n.item(), token.item()) == (kept, nxt)


def probs(*rows):
    return torch.tensor([rows], dtype=torch.float32)


def test_equal_p_and_q_always_keeps_everything():
    p = probs([0.2, 0.3, 0.5], [0.6, 0.4, 0.0], [0.1, 0.1, 0.8])
    drafts = torch.tensor([[2, 1]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n, _ = accept_or_fix(p, p[:, :2], drafts, gen)
        assert n.item() == 2


def test_draft_the_target_never_proposes_is_always_rejected_and_fixed_elsewhere():
    p = probs([0.0, 0.5, 0.5], [0.3, 0.3, 0.4])
    q = probs([1.0, 0.0, 0.0])
    gen = torch.Generator().manual_seed(0)
    fixes = set()
    for _ in range(200):
        n, token = accept_or_fix(p, q, torch.tensor([[0]]), gen)
        assert n.item() == 0
        fixes.add(token.item())
    assert fixes == {1, 2}


def test_residual_is_p_minus_q_normalised():
    # p = (.5, .5, 0), q = (1, 0, 0), draft 0: kept with probability 1/2, otherwise the fix is always token 1.
    p = probs([0.5, 0.5, 0.0], [1.0, 0.0, 0.0]).expand(20000, -1, -1)
    q = probs([1.0, 0.0, 0.0]).expand(20000, -1, -1)
    n, token = accept_or_fix(p, q, torch.zeros(20000, 1, dtype=torch.long), torch.Generator().manual_seed(1))
    assert abs(n.float().mean().item() - 0.5) < 0.018  # 5 s.e. (false failure 6e-7): 5 sqrt(0.25 / 20000)
    assert (token[n == 0] == 1).all()
    assert (token[n == 1] == 0).all()  # bonus row is one-hot at 0


def test_one_hot_draft_keeps_with_probability_p_of_d_and_never_refixes_d():
    p = probs([0.3, 0.7, 0.0], [0.0, 0.0, 1.0]).expand(20000, -1, -1)
    n, token = accept_or_fix(p, None, torch.ones(20000, 1, dtype=torch.long), torch.Generator().manual_seed(2))
    assert abs(n.float().mean().item() - 0.7) < 0.017  # 5 s.e. (false failure 6e-7): 5 sqrt(0.21 / 20000)
    assert (token[n == 0] == 0).all()  # p with the draft removed leaves only token 0
    assert (token[n == 1] == 2).all()


def test_seeded_rule_is_reproducible_and_seed_dependent():
    p = torch.softmax(torch.randn(64, 4, 50, generator=torch.Generator().manual_seed(0)), -1)
    q = torch.softmax(torch.randn(64, 3, 50, generator=torch.Generator().manual_seed(1)), -1)
    d = torch.randint(0, 50, (64, 3), generator=torch.Generator().manual_seed(2))
    a = accept_or_fix(p, q, d, torch.Generator().manual_seed(7))
    b = accept_or_fix(p, q, d, torch.Generator().manual_seed(7))
    c = accept_or_fix(p, q, d, torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not (torch.equal(a[0], c[0]) and torch.equal(a[1], c[1]))


def test_warp_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert torch.equal(warp(logits, Sampling(0.5)), torch.softmax(logits / 0.5, -1))  # the same two ops: bit-identical
    top2 = warp(logits, Sampling(1.0, top_k=2))
    # float32 softmax of 2 live values (the 2 masked add exact zeros), other kernel widths: exp <= 1 ulp, 2-term sum,
    # divide: <= 4 eps32 each side, 8 eps32 = 5e-7 relative
    assert (top2[0, 2:] == 0).all() and torch.allclose(top2[0, :2], torch.softmax(logits[0, :2], -1), rtol=1e-6, atol=0)
    # softmax(logits) = (.61, .22, .14, .03): top_p 0.8 keeps the first two (mass .83), 0.5 keeps only the first.
    assert (warp(logits, Sampling(1.0, top_p=0.8))[0] > 0).tolist() == [True, True, False, False]
    assert warp(logits, Sampling(1.0, top_p=0.5))[0].tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(temperature=float("nan")), dict(top_k=-1),
                                    dict(temperature=1, top_p=0), dict(temperature=1, top_p=1.5)])
def test_sampling_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        Sampling(**kwargs)
