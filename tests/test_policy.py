"""Adaptive K on synthetic rounds (known alpha, c, verify slope), K parsing, and the policy inside the real loop."""

import argparse
import statistics
from collections import Counter

import pytest
import torch

from spec import calc
from spec.loop import Round
from spec.policy import AdaptiveK, KSpecError, parse_k

STEP = 0.01  # seconds per target step in the synthetic world


def simulate(policy, alpha, c, slope=0.0, rounds=600, seed=0, catch_up=0.0, slow=lambda i, k: 1.0):
    """Drive `policy` with rounds whose drafts are kept independently with probability `alpha` (a function of the
    round number, or a number) and whose times follow the cost model exactly. `catch_up` is the draft time, in target
    steps, per token the drafter skipped during K = 0 rounds (on a CPU, reading one more token in a batched draft
    forward). `slow(i, k)` multiplies round i's times (a stall, or a slower machine). Returns (speedup over plain
    decoding, chosen Ks)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = seconds = 0.0
    lag, chosen = 0, []
    for i in range(rounds):
        a = alpha(i) if callable(alpha) else alpha
        k = policy.next_k()
        chosen.append(k)
        kept = 0
        while kept < k and torch.rand((), generator=gen).item() < a:
            kept += 1
        factor = slow(i, k)
        draft_s = (k * c + (catch_up * lag if k else 0.0)) * STEP * factor
        total_s = draft_s + (1 + slope * k) * STEP * factor
        lag = 0 if k else lag + 1
        policy.observe(Round([0] * (kept + 1), k, kept, draft_s, total_s - draft_s, total_s))
        tokens += kept + 1
        seconds += total_s
    return tokens * STEP / seconds, chosen


@pytest.mark.parametrize("alpha, c, slope", [(0.7, 0.1, 0.0), (0.7, 0.25, 0.0), (0.9, 0.05, 0.02), (0.8, 0.3, 0.1)])
def test_converges_to_the_formulas_best_k(alpha, c, slope):
    best, gain = calc.best_k(alpha, c, 8, {k: 1 + slope * k for k in range(1, 9)})
    speedup, chosen = simulate(AdaptiveK(max_k=8), alpha, c, slope)
    settled = Counter(chosen[100:])
    assert abs(settled.most_common(1)[0][0] - best) <= 1
    assert settled[best] >= 0.3 * len(chosen[100:])
    # The policy may cost 5%; tokens/round over 600 rounds has relative s.e. sd / (E sqrt(600)) <= 0.023 (alpha 0.7,
    # K 4: 1.56 / 2.77 / 24.5); 5 s.e. (false failure 3e-7) below 0.95: 0.835
    assert speedup >= 0.835 * gain


@pytest.mark.parametrize("alpha, c, catch_up", [
    (0.0, 0.05, 0.0), (0.0, 0.4, 0.02), (0.0, 1.0, 0.03), (0.0, 3.0, 0.03), (0.2, 0.4, 0.02), (0.3, 1.0, 0.03),
])
@pytest.mark.parametrize("rounds", [100, 600])
def test_a_useless_draft_turns_speculation_off_and_costs_under_5_percent(alpha, c, catch_up, rounds):
    assert calc.best_k(alpha, c, 8, 1.05)[0] == 0  # the formula agrees: nothing beats plain decoding
    speedup, chosen = simulate(AdaptiveK(max_k=8), alpha, c, slope=0.05, rounds=rounds, catch_up=catch_up)
    assert speedup >= 0.95  # the bar (under 5%), not a noise bound: alpha <= 0.3 leaves only rare K = 1 probes
    assert max(chosen[20:]) <= 1  # off, but for K = 1 probes


def test_probes_turn_speculation_back_on_when_the_draft_gets_good():
    policy = AdaptiveK(max_k=8)
    _, chosen = simulate(policy, lambda i: 0.0 if i < 300 else 0.9, c=0.1, rounds=600)
    assert chosen[200:300].count(0) >= 75
    assert Counter(chosen[400:]).most_common(1)[0][0] >= 4


def test_probe_cost_sets_the_spacing_while_off():
    cheap, expensive = AdaptiveK(), AdaptiveK()
    _, a = simulate(cheap, 0.0, c=0.3, rounds=400)
    _, b = simulate(expensive, 0.0, c=3.0, rounds=400)
    assert a[100:].count(1) > b[100:].count(1) >= 1


def test_a_first_draft_step_that_paid_for_a_capture_is_timed_again():
    # The real Qwen pair's sweep on an H200: the first draft step captured a CUDA graph (about 100 target steps), c
    # looked far above 1, speculation went off and no probe was affordable again: 0.92x of plain decoding.
    alpha, c = 0.8, 0.1
    best, gain = calc.best_k(alpha, c, 8, 1.0)
    first_draft = []

    def capture(i, k):
        if k and not first_draft:
            first_draft.append(i)
            return 100.0 / (c * k + 1)  # that round took 100 target steps
        return 1.0

    speedup, chosen = simulate(AdaptiveK(max_k=8), alpha, c, slow=capture)
    assert abs(Counter(chosen[100:]).most_common(1)[0][0] - best) <= 1
    # as in test_converges_to_the_formulas_best_k (5 s.e. below the policy's 5 %: 0.835), times the 600 rounds' share
    # of the time: they take about 600 x 1.4 = 840 steps and the captured round 100 more (0.89)
    assert speedup >= 0.835 * 0.89 * gain


def test_a_one_off_stall_mid_run_teaches_no_timing():
    alpha, c = 0.8, 0.1
    steady, stalled = AdaptiveK(max_k=8), AdaptiveK(max_k=8)
    simulate(steady, alpha, c, rounds=300)
    simulate(stalled, alpha, c, rounds=300, slow=lambda i, k: 50.0 if i == 250 else 1.0)
    assert stalled.estimates()[1:] == pytest.approx(steady.estimates()[1:])  # c and s as if it never happened
    assert stalled.estimates()[1] == pytest.approx(c)  # timings follow the model exactly: c is exact


def test_a_lasting_slowdown_is_learned_after_a_few_rounds():
    # Everything 6x slower from round 300 on (the machine changed): not a stall once STALL_RUN rounds in a row were.
    policy = AdaptiveK(max_k=8)
    speedup, chosen = simulate(policy, 0.8, 0.1, rounds=600, slow=lambda i, k: 6.0 if i >= 300 else 1.0)
    # the old times decay by (31/32) per draft round: under 1 % of weight left after the ~150 rounds that draft
    assert policy.draft_step.value == pytest.approx(6 * 0.1 * STEP, rel=0.01)
    assert Counter(chosen[400:]).most_common(1)[0][0] >= 3


def test_a_snapshot_reports_the_estimates_and_their_choice():
    policy = AdaptiveK(max_k=8)
    assert policy.snapshot()["c"] is None and policy.snapshot()["k"] is None  # nothing timed yet
    simulate(policy, 0.8, 0.1, rounds=200)
    snap = policy.snapshot()
    alpha, c, s = policy.estimates()
    assert (snap["alpha"], snap["c"], snap["s"]) == (alpha, c, s)
    assert snap["target_step_s"] == pytest.approx(STEP) and snap["draft_step_s"] == pytest.approx(0.1 * STEP)
    assert (snap["k"], snap["predicted_x"]) == policy.choice() and snap["k"] > 0


def test_the_policy_is_deterministic():
    assert simulate(AdaptiveK(), 0.7, 0.1)[1] == simulate(AdaptiveK(), 0.7, 0.1)[1]


def test_the_first_rounds_time_a_draft_step_then_a_target_step():
    policy = AdaptiveK()
    assert policy.estimates() is None
    assert policy.next_k() == 1
    policy.observe(Round([1, 2], 1, 1, 0.002, 0.01, 0.012))
    assert policy.next_k() == 0
    policy.observe(Round([3], 0, 0, 0.0, 0.01, 0.01))
    alpha, c, s = policy.estimates()
    # float64 ratios and averages of a few timings (~1e-16): approx's defaults (rel 1e-6, abs 1e-12 at 0) are ample
    assert c == pytest.approx(0.2)
    decay = 1 - 1 / 32
    assert alpha == pytest.approx((1 * decay + 1) / (2 * decay + 1))  # the prior (1 of 2), decayed once, + 1 of 1
    assert s == pytest.approx(0.0)


def test_timings_after_skipped_text_go_to_catch_up_except_in_a_new_generation():
    policy = AdaptiveK()
    for _ in range(2):  # draft step 2 ms, timed twice (of the first two, only the faster counts)
        policy.observe(Round([1, 2], 1, 1, 0.002, 0.01, 0.012))
    for _ in range(10):
        policy.observe(Round([3], 0, 0, 0.0, 0.01, 0.01))  # target step 10 ms; the drafter skips 10 tokens
    policy.observe(Round([4], 1, 0, 0.012, 0.01, 0.022))  # 10 ms more than a draft step: catching up
    # float64 averages of a few timings (~1e-16): approx's default rel 1e-6 is ample
    assert policy.catch_up.value == pytest.approx(0.1)  # target steps per skipped token
    assert policy.draft_step.value == pytest.approx(0.002)
    for _ in range(10):
        policy.observe(Round([3], 0, 0, 0.0, 0.01, 0.01))
    policy.observe(Round([4], 1, 0, 0.004, 0.01, 0.014, prefill_s=0.05))  # a new prompt, read in the prefill
    assert policy.draft_step.value > 0.002 and policy.catch_up.value == pytest.approx(0.1)


@pytest.mark.parametrize("text, want", [("0", 0), ("4", 4), (" 12 ", 12)])
def test_parse_k_numbers(text, want):
    assert parse_k(text) == want


def test_parse_k_auto_gives_a_factory_of_fresh_policies():
    make = parse_k("auto")
    first, second = make(), make()
    assert isinstance(first, AdaptiveK) and first is not second and first.max_k == 8
    assert parse_k("AUTO:5")().max_k == 5


@pytest.mark.parametrize("text", ["-1", "four", "auto:0", "auto:x", "2.5", ""])
def test_parse_k_rejects_bad_values_with_a_message(text):
    with pytest.raises(ValueError, match="K|auto"):
        parse_k(text)


def test_parse_k_errors_read_well_in_argparse(capsys):
    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("--k", type=parse_k)
    with pytest.raises(SystemExit):
        parser.parse_args(["--k", "lots"])
    assert "K must be a whole number >= 0, 'auto' or 'auto:N'" in capsys.readouterr().err
    assert KSpecError.__mro__.index(ValueError) > 0


def test_adaptive_k_in_the_loop_keeps_greedy_output_exact(tiny_pair):
    from spec.drafters import make_drafter
    from spec.loop import generate

    prompt = tiny_pair.tokenizer("def add(a, b):").input_ids
    plain = generate(tiny_pair.target, make_drafter("none", tiny_pair), prompt, 40, k=0)
    policy = AdaptiveK(max_k=4)
    adaptive = generate(tiny_pair.target, make_drafter("draft", tiny_pair), prompt, 40, k=policy)
    assert adaptive.tokens == plain.tokens
    assert policy.estimates() is not None
    assert {r.drafted for r in adaptive.rounds} & {1, 2, 3, 4}


@pytest.fixture(scope="module")
def tiny_pair():
    from spec.models import load_pair

    return load_pair("tiny")


def test_probes_stop_when_catching_up_costs_more_than_the_budget():
    # Each skipped token costs the drafter 0.1 target steps to read back: no spacing keeps probes under 2%.
    speedup, chosen = simulate(AdaptiveK(), 0.0, c=0.4, catch_up=0.1, rounds=1500)
    assert chosen[400:].count(1) == 0
    assert speedup >= 0.95


def test_while_off_the_drafter_skips_the_prompt_and_the_probe_pays_for_it():
    """A policy that has turned speculation off tells the loop not to prefill the draft (a useless draft then costs
    nothing per request); the prompt it skipped counts as text to catch up on at the next probe."""
    policy = AdaptiveK()
    assert policy.reads_prompt(40)  # no estimates yet: read it, so the first rounds can time a draft step
    simulate(policy, 0.0, c=1.0, rounds=100)
    assert policy.choice()[0] == 0
    assert not policy.reads_prompt(40)
    policy.observe(Round([3], 0, 0, 0.0, 0.01, 0.01, prefill_s=0.05))  # the new generation's first (plain) round
    assert policy._lag == 41  # 40 unread prompt tokens and the round's token
    good = AdaptiveK()
    simulate(good, 0.9, c=0.05, rounds=100)
    assert good.reads_prompt(40)


def test_a_policy_that_is_off_keeps_greedy_output_exact_without_reading_the_prompt(tiny_pair):
    from spec.drafters import make_drafter
    from spec.loop import generate, speculate

    prompt = tiny_pair.tokenizer("def add(a, b):").input_ids
    plain = generate(tiny_pair.target, make_drafter("none", tiny_pair), prompt, 30, k=0)
    policy = AdaptiveK(max_k=4, prior_alpha=0.0)
    simulate(policy, 0.0, c=1.0, rounds=100)  # learned: this draft is useless
    drafter = make_drafter("draft", tiny_pair)
    drafter.model.reset()
    rounds = []
    for rnd in speculate(tiny_pair.target, drafter, prompt, 30, k=policy):
        if not rounds:
            assert drafter.model.length == 0  # the prompt was not prefilled into the draft
        rounds.append(rnd)
    assert [t for r in rounds for t in r.tokens] == plain.tokens


def generations(policy, plan, c, slope, catch_up, prompt=63, seed=0):
    """Drive `policy` through whole generations, as a server's requests: (alpha, tokens) each, a new prompt of
    `prompt` tokens before each (skipped by the drafter when the policy says so, then caught up on by its next
    draft forward at `catch_up` target steps a token, like any text skipped during K = 0 rounds). Returns each
    generation's speedup over plain decoding."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for alpha, n in plan:
        lag = 0 if policy.reads_prompt(prompt) else prompt
        emitted, seconds, first = 0, 0.0, True
        while emitted < n:
            k = min(policy.next_k(), n - emitted - 1)
            kept = 0
            while kept < k and torch.rand((), generator=gen).item() < alpha:
                kept += 1
            draft_s = (k * c + (catch_up * lag if k else 0.0)) * STEP
            total_s = draft_s + (1 + slope * k) * STEP
            lag = 0 if k else lag + 1
            policy.observe(Round([0] * (kept + 1), k, kept, draft_s, total_s - draft_s, total_s,
                                 prefill_s=0.01 if first else 0.0))
            emitted, seconds, first = emitted + kept + 1, seconds + total_s, False
        out.append(emitted * STEP / seconds)
    return out


def test_a_few_early_rejections_do_not_keep_a_good_draft_off_for_generations():
    """The H100's real-pair sweep (benchmarks/h100/): a warm-up on a prompt's opening taught alpha 0.34, speculation
    went off, and since the drafter's catch-up (0.036 target steps a skipped token) outran the probes' 2 % credit,
    three of four 128-token generations ran plain though alpha was 0.92. Off is decided on alpha plus a standard
    error, so a thin estimate keeps speculating and learns. Over 10 seeds, the two generations after the warm-up:
    1.02x plain with the mean alone (OPTIMISM = 0), 1.14x with it; the bound 1.08 sits between."""
    plan = [(0.3, 8)] + [(0.9, 128)] * 2
    first_two = [statistics.mean(generations(AdaptiveK(max_k=6), plan, c=0.47, slope=0.04, catch_up=0.036,
                                             seed=seed)[1:]) for seed in range(10)]
    assert statistics.mean(first_two) >= 1.08


def test_a_useless_draft_still_costs_little_over_many_generations():
    plan = [(0.1, 8)] + [(0.1, 128)] * 5 + [(0.1, 16)] * 10
    speedups = generations(AdaptiveK(max_k=6), plan, c=0.47, slope=0.04, catch_up=0.036)
    assert statistics.mean(speedups[1:]) >= 0.95


def rounds_priced_like_the_h200(policy, alpha, rounds=600, seed=0):
    """Drive `policy` in the cost world of the real Qwen pair's adaptive-K rounds on an H200 (session 14,
    benchmarks/h200/real-qwen/sweep-session14.json), in target steps: a draft step 0.38, a draft phase 0.13 once a
    round, 0.16 more when the round's first draft forward reads two tokens (the last round kept all its drafts, the
    drafter saw neither its last draft nor the bonus), verifying 0.10 once and 0.04 a draft beyond the target step,
    0.2 a token the drafter skipped during K = 0 rounds. Rounds report their draft forwards as ModelDrafter does.
    Returns (speedup over plain decoding, chosen Ks)."""
    draft_step, draft_once, lead, verify_once, verify_slope, catch_up = 0.38, 0.13, 0.16, 0.10, 0.04, 0.2
    gen = torch.Generator().manual_seed(seed)
    tokens = seconds = 0.0
    lag, kept_all, chosen = 0, False, []
    for _ in range(rounds):
        k = policy.next_k()
        chosen.append(k)
        kept = 0
        while kept < k and torch.rand((), generator=gen).item() < alpha:
            kept += 1
        draft_s, forwards = 0.0, ()
        if k:
            lead_now = lead if kept_all and not lag else 0.0
            draft_s = (draft_once + draft_step * k + lead_now + catch_up * lag) * STEP
            forwards = (1 + lag + kept_all,) + (1,) * (k - 1)
        total_s = draft_s + (1 + (verify_once + verify_slope * k if k else 0.0)) * STEP
        policy.observe(Round([0] * (kept + 1), k, kept, draft_s, total_s - draft_s, total_s, forwards=forwards))
        kept_all, lag = k > 0 and kept == k, 0 if k else lag + 1
        tokens += kept + 1
        seconds += total_s
    return tokens * STEP / seconds, chosen


def test_a_rounds_fixed_costs_and_its_two_token_lead_are_priced_apart_from_its_drafts():
    """On the H200 the policy settled on K = 1-2 at 1.05x while K = 4 ran 1.30x and K = 6 1.42x: it priced a draft
    step at what the round's drafting cost per draft, and at K = 1 nearly every round leads with two tokens. In that
    cost world (alpha 0.91, i.i.d.) the formula's best K is 5 at 1.40x; over 10 seeds the lead mixed into c settles
    on K = 3 and runs 1.26x (s.e. 0.011), the lead priced apart on K = 4 at 1.33x (s.e. 0.007). The bound 1.30 sits
    3 s.e. or more from either. (Fitting the round's fixed costs apart too ran 1.35x here, but locked K at 1 after a
    machine sped up in a review's simulation: left out.)"""
    def truth(k):
        return calc.expected_tokens(0.91, k) / (0.13 + 0.38 * k + 0.91 ** k * 0.16 + 1.10 + 0.04 * k) if k else 1.0

    best = max(range(9), key=truth)
    runs = [rounds_priced_like_the_h200(AdaptiveK(max_k=8), 0.91, seed=seed) for seed in range(10)]
    settled = Counter(k for _, chosen in runs for k in chosen[100:])
    assert best == 5 and abs(max((k for k in settled if k), key=settled.get) - best) <= 1
    assert statistics.mean(speedup for speedup, _ in runs) >= 1.30
