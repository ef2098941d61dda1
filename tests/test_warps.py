"""The warp pipeline on hand-built vectors, token counts along a drafted path, the coupled mode's identity across
drafters and K, and logprobs equal to plain decoding's."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from spec.drafters import LookupDrafter, ModelDrafter, NoDrafter
from spec.loop import generate
from spec.models import EagerModel
from spec.warps import Decoding, GumbelNoise, Sampling, TokenCounts, adjust, warp


def test_penalties_and_bias_follow_vllms_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    counts = torch.tensor([[2.0, 1.0, 0.0, 0.0]])  # token 0 twice in the output, token 1 once
    seen = torch.tensor([[True, True, False, True]])  # token 3 only in the prompt
    s = Sampling(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, logit_bias=((2, 1.5),))
    out = adjust(logits, s, counts, seen)
    # bias, then repetition (positive / r, negative * r, where seen), then frequency x count, then presence.
    expected = [2.0 / 2 - 0.25 * 2 - 0.5, -1.0 * 2 - 0.25 - 0.5, 0.5 + 1.5, 3.0 / 2]
    assert out[0].tolist() == pytest.approx(expected)  # a few float32 roundings of numbers ~1: rel 1e-6 ample
    assert torch.equal(adjust(logits, Sampling(), counts, seen), logits)  # nothing on: untouched


def test_min_p_top_k_top_p_and_temperature():
    logits = torch.tensor([[0.0, math.log(0.5), math.log(0.25), math.log(0.05)]])  # probs 1 : .5 : .25 : .05
    kept = warp(logits, Sampling(1.0, min_p=0.2))[0]
    assert kept[3] == 0 and kept[:3].sum() == pytest.approx(1.0) and kept[2] > 0  # 0.05 < 0.2 x 1 dropped only
    assert (warp(logits, Sampling(1.0, min_p=1.0))[0] == torch.tensor([1.0, 0, 0, 0])).all()  # never drops the top
    assert torch.equal(warp(logits, Sampling(0.5)), torch.softmax(logits / 0.5, -1))  # same two ops: bit-identical


def test_greedy_takes_the_argmax_after_bias_and_penalties():
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    decoding = Decoding.start(Sampling(logit_bias=((2, 10.0),)), [0], 3, "cpu")
    assert int(decoding.scores(logits, []).argmax()) == 2
    decoding = Decoding.start(Sampling(presence_penalty=2.0), [7], 3, "cpu")
    decoding.advance([0])
    assert int(decoding.scores(logits, []).argmax()) == 1  # 5 - 2 < 4


def test_sampling_refuses_what_it_cannot_honour():
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0.0),
                dict(min_p=1.5), dict(logit_bias=((1, 101.0),)), dict(logit_bias=((-1, 1.0),))):
        with pytest.raises(ValueError):
            Sampling(1.0, **bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        adjust(torch.zeros(1, 4), Sampling(logit_bias=((9, 1.0),)))
    with pytest.raises(ValueError, match="needs a seed"):
        Decoding.start(Sampling(1.0, coupled=True), [1], 4, "cpu")


def test_counts_along_a_drafted_path():
    counts = TokenCounts([3], vocab=5, device="cpu")
    counts.add([1, 1])
    rows, seen = counts.rows(torch.tensor([2, 1, 4]), start=0, n=4)  # after the text, then after each draft
    assert rows.tolist() == [[0, 2, 0, 0, 0], [0, 2, 1, 0, 0], [0, 3, 1, 0, 0], [0, 3, 1, 0, 1]]
    assert seen[0].tolist() == [False, True, False, True, False]  # the prompt's token 3, the output's token 1
    one, _ = counts.rows([torch.tensor([2]), torch.tensor([1])], start=2, n=1)  # a drafter's third position
    assert torch.equal(one, rows[2:3])


def test_gumbel_noise_is_keyed_by_seed_and_position_alone():
    cpu = torch.device("cpu")
    a, b = GumbelNoise(7, 50, cpu), GumbelNoise(7, 50, cpu)
    later = b.rows(4, 1)  # asked in another order, by another object: the same noise
    assert torch.equal(a.rows(3, 2), torch.cat([b.rows(3, 1), later]))
    assert not torch.equal(a.rows(3, 1), a.rows(4, 1))
    assert not torch.equal(a.rows(3, 1), GumbelNoise(8, 50, cpu).rows(3, 1))


def coupled_runs(tiny, prompt, seed: int, tokens: int = 12):
    sampling = Sampling(1.0, top_p=0.95, presence_penalty=0.5, coupled=True)
    configs = [("none", NoDrafter(), 0), ("lookup", LookupDrafter(), 4), *[("draft", ModelDrafter(tiny.draft), k)
                                                                          for k in (1, 4, 8)]]
    return {f"{name} K={k}": generate(tiny.target, drafter, prompt, tokens, k=k, sampling=sampling, seed=seed,
                                      timing=False) for name, drafter, k in configs}


def test_coupled_sampling_gives_the_same_text_with_or_without_speculation(tiny):
    """100 seeds: plain decoding, prompt lookup and the draft model at K = 1, 4, 8 write the same tokens."""
    prompt = tiny.tokenizer("def add(a, b):").input_ids
    accepted = drafted = 0
    for seed in range(100):
        runs = coupled_runs(tiny, prompt, seed)
        texts = {name: r.tokens for name, r in runs.items()}
        assert len({tuple(t) for t in texts.values()}) == 1, (seed, texts)
        accepted += runs["draft K=4"].accepted
        drafted += runs["draft K=4"].drafted
    assert 0 < accepted < drafted  # the draft is really drafting, and really rejected sometimes


def test_coupled_sampling_draws_from_p(tiny):
    """chi-square over 2000 seeds: the first coupled token follows the target's warped distribution."""
    prompt = tiny.tokenizer("def add(a, b):").input_ids
    sampling = Sampling(1.0, coupled=True)
    tiny.target.reset()
    p = warp(tiny.target.forward(prompt)[-1], sampling).double().numpy()
    tiny.target.reset()
    n = 2000
    first = [generate(tiny.target, ModelDrafter(tiny.draft), prompt, 1, k=4, sampling=sampling, seed=seed,
                      timing=False).tokens[0] for seed in range(n)]
    common = p * n >= 5  # pool the rare tokens
    observed = np.bincount(first, minlength=len(p))
    obs = np.append(observed[common], observed[~common].sum())
    exp = np.append(p[common], p[~common].sum()) * n
    assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3  # dist_test's LEVEL


def test_logprobs_equal_plain_decodings(tiny):
    """The logprobs of a speculative run are those of plain decoding on the same text, token and top-5 (fp32)."""
    prompt = tiny.tokenizer("def add(a, b):").input_ids
    plain = generate(tiny.target, NoDrafter(), prompt, 24, k=0, logprobs=5, timing=False)
    spec = generate(tiny.target, ModelDrafter(tiny.draft), prompt, 24, k=4, logprobs=5, timing=False)
    assert spec.tokens == plain.tokens and spec.accepted > 0
    a = [lp for r in plain.rounds for lp in r.logprobs]
    b = [lp for r in spec.rounds for lp in r.logprobs]
    assert len(a) == len(b) == 24
    for (lp_a, top_a), (lp_b, top_b) in zip(a, b):
        # fp32 logits of a 1-token step and a 5-token verify differ by <= 1e-3 (test_graph's bound for the tiny
        # pair); log_softmax moves each value by at most twice that.
        assert abs(lp_a - lp_b) <= 2e-3 and [t for t, _ in top_a] == [t for t, _ in top_b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(top_a, top_b)) <= 2e-3
    direct = EagerModel(tiny.target.model, tiny.target.vocab)
    rows = direct.forward(prompt + plain.tokens)[len(prompt) - 1 : -1].log_softmax(-1)
    assert [lp for lp, _ in a] == pytest.approx(rows.gather(1, torch.tensor(plain.tokens)[:, None])[:, 0].tolist(),
                                                abs=2e-3)
