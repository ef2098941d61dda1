"""t5: chi-square proof that speculative sampling emits exactly the target's distribution — and that the proof bites.

    python -m spec.dist_test                       # (a), (b) and (d) with every Break-It variant
    python -m spec.dist_test --break no-rollback   # the correct code and one bug
    python -m spec.dist_test --no-real             # skip loading the real pair

(a) The rule alone (`spec.rules.accept_or_fix`, one drafted position, 10^5 vectorised rounds by default) on
    six-token toy vectors with alpha = sum min(p, q) = 0.7 — the draft over-proposes tokens 2 and 3 and
    under-proposes 0 and 1 — and on real p, q rows of the pair at the prefix where the two models disagree most.
    The first emitted token must follow p. Real rows and the loop are warped by the sampling flags (default
    temperature 1, top-p 0.95).
(b) The whole loop (`spec.loop.generate`, K = 2, several rounds with rejections and rollbacks) on the tiny pair:
    the joint law of the first three emitted tokens against the target's exact sequence probabilities,
    P(x1) P(x2 | x1) P(x3 | x1, x2), each a warped conditional of the target alone.
(c) Break-It (spec/deliberately_wrong.py), each of which must be caught:
    resample-p  — on rejection the fix is drawn from p, not from the residual. One position then emits
                  min(p, q) + (1 - alpha) p   (alpha = sum_y min(p(y), q(y)));
                  the tool checks that law too (its own chi-square must pass: the bug is understood, not just seen).
                  A rule bug is tested on the rule: the loop calls spec.rules itself, and nothing here patches it.
    softmax-q   — an argmax draft reported with q = softmax(logits); caught in (a) and in the loop (b).
    no-rollback — rejected drafts stay in the target's KV cache; caught in the loop (b), and greedy identity with
                  plain decoding breaks in the first round after a rejection (printed under the table).
    committed-penalty — penalties count the committed text only, not the drafts before each position of a round;
                  caught in (d) under frequency penalty 2.
(d) Every warp of the pipeline (spec/warps.py: presence, frequency and repetition penalties, logit_bias, min_p, and
    all of them with temperature, top-k and top-p) through the whole loop, as (b): the law of the first three tokens
    against the target's exact law under the same warp, its penalties counting each prefix.

Binning: categories whose expected count is below 5 are pooled (`merge_bins`). A test passes when its p-value is at
least 0.001. Power — the chance a test at this sample size and binning rejects a bug's law — comes from the
noncentral chi-square with noncentrality n * sum_b (r_b - p_b)^2 / p_b: exact for the rule-level bugs, whose laws
are known in closed form, and estimated from an independent seeded pilot run for the loop-level bugs. The design,
sample sizes and results are in docs/exactness.md.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from spec import log
from spec.chisquare import (
    LEVEL,
    POWER_GOAL,
    Check,
    categorize,
    chi_square,
    merge_bins,
    pilot_power,
    power,
    sequence_law,
)
from spec.cli import add_model_args, load_from_args
from spec.deliberately_wrong import (
    BUGS,
    SoftmaxQDrafter,
    StaleCacheModel,
    committed_penalty_decoding,
    resample_from_p,
    resample_from_p_law,
    softmax_q_law,
)
from spec.drafters import ModelDrafter, NoDrafter
from spec.io import Results, table
from spec.loop import generate
from spec.models import Model, ModelError, chat_ids, load_pair
from spec.rules import accept_or_fix
from spec.warps import Decoding, Sampling, warp

# Six tokens, alpha = 0.7. The draft over-proposes tokens 2 and 3 (q > p), under-proposes 0 and 1, matches 4 and 5;
# no ties in q, so the softmax-q bug's argmax draft is well defined (token 2).
TOY_P = (0.30, 0.25, 0.20, 0.10, 0.10, 0.05)
TOY_Q = (0.10, 0.15, 0.32, 0.28, 0.10, 0.05)

REAL_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."
LOOP_PROMPT = "def add(a, b):"


# ---- (a) the rule alone ----------------------------------------------------------------------------------------

RULES: dict[str, Callable] = {"correct": accept_or_fix, "resample-p": resample_from_p, "softmax-q": accept_or_fix}


def first_tokens(
    p: torch.Tensor, q: torch.Tensor | None, variant: str, n: int, generator: torch.Generator
) -> np.ndarray:
    """The first emitted token of n independent one-draft rounds [n] under one variant.   p, q: [V]

    The draft is sampled from q (argmax of q for softmax-q; q None means a one-hot drafter whose draft is the
    argmax of p, as prompt lookup would propose). Rounds run in chunks of about 2^25 probabilities, so that real
    rows (V ~ 150k) fit in memory and toy rows run in one go.
    """
    rule = RULES[variant]
    vocab = p.shape[-1]
    chunk = max(1, (1 << 25) // vocab)
    out = []
    with log.bar(total=n, desc=f"rule {variant}", unit="draw") as bar:
        for start in range(0, n, chunk):
            b = min(chunk, n - start)
            if q is None:
                drafts = p.argmax().repeat(b)
            elif variant == "softmax-q":
                drafts = q.argmax().repeat(b)
            else:
                drafts = torch.multinomial(q, b, replacement=True, generator=generator)
            rows_p = p.expand(b, 2, vocab)  # position 1 and the bonus position: the same row suffices here
            rows_q = None if q is None else q.expand(b, 1, vocab)
            n_accepted, nxt = rule(rows_p, rows_q, drafts[:, None], generator)
            out.append(torch.where(n_accepted > 0, drafts, nxt))
            bar.update(b)
    return torch.cat(out).cpu().numpy()


def rule_checks(case: str, p: torch.Tensor, q: torch.Tensor, variants: Sequence[str], n: int, seed: int) -> list[Check]:
    """(a) and the rule half of (c) on one pair of rows p, q [V]: the correct rule with sampled and with one-hot
    drafts, then each rule-level bug — and resample-p against the law its docstring predicts. Category ids in the
    draws are positions in the support of p and q, not token ids."""
    # Columns where p = q = 0 can be drawn by no variant (nor proposed); dropping them changes no law, and turns
    # a top-p-warped real row of ~150k columns into a few hundred, so 10^5 rounds take seconds, not an hour.
    # The rule then runs on the CPU, where the seeded generator lives (a CUDA row would need a CUDA generator).
    support = (p > 0) | (q > 0)
    p, q = p[support].cpu(), q[support].cpu()
    p32, q32 = p.float(), q.float()
    probs = p.double().numpy()
    checks = []

    def run(part, label, variant, draws, law=None, against=probs, expect="pass"):
        bins = merge_bins(against, n)
        chi2, df, pv = chi_square(draws, against, bins)
        pw = None if law is None else power(against, law, bins, n)
        checks.append(Check(part, label, variant, n, df + 1, chi2, df, pv, expect, pw))

    def draw(variant, one_hot=False):
        return first_tokens(p32, None if one_hot else q32, variant, n, torch.Generator().manual_seed(seed))

    run("a", case, "correct", draw("correct"))
    run("a", f"{case}, one-hot q", "correct", draw("correct", one_hot=True))
    if "resample-p" in variants:
        law = resample_from_p_law(p.double(), q.double()).cpu().numpy()
        draws = draw("resample-p")
        run("c", case, "resample-p", draws, law=law, expect="fail")
        run("c", f"{case}, vs min(p,q)+(1-a)p", "resample-p", draws, against=law)
    if "softmax-q" in variants:
        law = softmax_q_law(p.double(), q.double()).cpu().numpy()
        run("c", case, "softmax-q", draw("softmax-q"), law=law, expect="fail")
    return checks


def real_rows(pair, sampling: Sampling, prompt: str, positions: int = 16) -> tuple[torch.Tensor, torch.Tensor, int]:
    """p and q rows [V] of the pair at the prefix where they disagree most (lowest alpha) among the first
    `positions` tokens of the target's greedy answer to `prompt`; also returns that position."""
    ids = chat_ids(pair.tokenizer, prompt)
    result = generate(pair.target, NoDrafter(pair.device), ids, positions, k=0, timing=False)
    text = ids + result.tokens
    pair.target.reset()
    pair.draft.reset()
    start = len(ids) - 1  # the row predicting the first answer token
    p = warp(pair.target.forward(text[:-1])[start:], sampling)  # [positions, V]
    q = warp(pair.draft.forward(text[:-1])[start:], sampling)
    pair.target.reset()
    pair.draft.reset()
    alpha = torch.minimum(p, q).sum(-1)
    at = int(alpha.argmin())
    return p[at], q[at], at


# ---- (b) the whole loop ----------------------------------------------------------------------------------------


def loop_outputs(target: Model, drafter, prompt, depth: int, k: int, sampling: Sampling, n: int, seed: int,
                 desc: str, decoding: Callable[[], Decoding] | None = None) -> list[list[int]]:
    """The first `depth` tokens of n seeded generations through the real loop (one generator for all n);
    `decoding` makes each generation's token-counting state (default: the loop's own). The generator lives where
    the models do: the loop samples on their device."""
    generator = torch.Generator(device=target.device).manual_seed(seed)
    outputs = []
    for _ in log.bar(iterable=range(n), desc=desc, unit="run"):
        outputs.append(generate(target, drafter, prompt, depth, k=k, sampling=sampling, generator=generator,
                                timing=False, decoding=decoding() if decoding else None).tokens)
    return outputs


def loop_variant(pair, variant: str):
    """The (target, drafter) of one variant over the tiny pair's weights."""
    if variant == "softmax-q":
        return pair.target, SoftmaxQDrafter(pair.draft)
    if variant == "no-rollback":
        return StaleCacheModel.wrap(pair.target), ModelDrafter(pair.draft)
    return pair.target, ModelDrafter(pair.draft)


@contextmanager
def one_thread():
    """Run torch on one intra-op thread for a while. The tiny pair's 64-wide layers gain nothing from threads, and
    on a busy 2-core machine the hand-offs made each generation ~10x slower (650 vs 57 ms measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@one_thread()
def loop_checks(pair, variants: Sequence[str], n: int, seed: int, sampling: Sampling, depth: int = 3,
                k: int = 2) -> list[Check]:
    """(b)/(c): the loop's first `depth` tokens against the exact law, for the correct code and each loop-level
    bug; a bug's power is estimated from an independent pilot of n runs (seed + 1)."""
    prompt = pair.tokenizer(LOOP_PROMPT).input_ids
    nodes, probs = sequence_law(pair.target, prompt, depth, sampling, n)
    bins = merge_bins(probs, n)
    checks = []
    for variant in ["correct", *[v for v in variants if v in ("softmax-q", "no-rollback")]]:
        target, drafter = loop_variant(pair, variant)
        cats = categorize(loop_outputs(target, drafter, prompt, depth, k, sampling, n, seed, f"loop {variant}"),
                          nodes, depth)
        chi2, df, pv = chi_square(cats, probs, bins)
        pw = None
        if variant != "correct":
            extra = loop_outputs(target, drafter, prompt, depth, k, sampling, n, seed + 1, f"pilot {variant}")
            pw = pilot_power(categorize(extra, nodes, depth), probs, bins, n)
        correct = variant == "correct"
        checks.append(Check("b" if correct else "c", f"tiny loop, first {depth} tokens, K={k}", variant, n, df + 1,
                            chi2, df, pv, "pass" if correct else "fail", pw))
    return checks


# (d) Every warp of the pipeline through the whole loop, each strong enough to matter at positions 2 and 3 of the
# first round (K = 2), where the penalties must count the drafts before them. The tiny tokenizer's ids are bytes.
WARPS = {
    "presence 2": Sampling(1.0, presence_penalty=2.0),
    "frequency 2": Sampling(1.0, frequency_penalty=2.0),
    "repetition 1.5": Sampling(1.0, repetition_penalty=1.5),
    "logit_bias": Sampling(1.0, logit_bias=((ord("e"), 4.0), (ord(" "), -3.0), (ord("("), 100.0 / 30))),
    "min_p 0.1": Sampling(1.0, min_p=0.1),
    "all at once": Sampling(0.8, top_k=40, top_p=0.9, min_p=0.02, presence_penalty=1.0, frequency_penalty=0.5,
                            repetition_penalty=1.2, logit_bias=((ord("e"), 2.0),)),
}
PENALTY_BUG_WARP = "frequency 2"  # the committed-penalty bug is run under this one


@one_thread()
def warp_checks(pair, names: Sequence[str], n: int, seed: int, bug: bool, depth: int = 3, k: int = 2) -> list[Check]:
    """(d): the loop's first `depth` tokens under each warp against the exact law of the target warped alike (its
    penalties counting each prefix); with `bug`, the committed-penalty variant too, its power from a pilot."""
    prompt = pair.tokenizer(LOOP_PROMPT).input_ids
    checks = []
    for name in names:
        sampling = WARPS[name]
        nodes, probs = sequence_law(pair.target, prompt, depth, sampling, n)
        bins = merge_bins(probs, n)
        wrong = functools.partial(committed_penalty_decoding, sampling, prompt, pair.target.vocab, pair.target.device)
        for variant, decoding in [("correct", None), *([("committed-penalty", wrong)] if bug and name ==
                                                       PENALTY_BUG_WARP else [])]:
            runs = [categorize(loop_outputs(pair.target, ModelDrafter(pair.draft), prompt, depth, k, sampling, n,
                                            seed + pilot, f"{'pilot' if pilot else variant} {name}", decoding),
                               nodes, depth) for pilot in range(1 if decoding is None else 2)]
            chi2, df, pv = chi_square(runs[0], probs, bins)
            pw = None if decoding is None else pilot_power(runs[1], probs, bins, n)
            checks.append(Check("d" if decoding is None else "c", f"tiny loop, {name}, first {depth}, K={k}",
                                variant, n, df + 1, chi2, df, pv, "pass" if decoding is None else "fail", pw))
    return checks


@one_thread()
def greedy_identity_break(pair, max_new_tokens: int = 24, k: int = 4) -> dict:
    """Greedy decoding through a no-rollback target vs plain greedy decoding on the tiny pair: the round in which
    they first differ (None if never), and the round of the first rejection."""
    prompt = pair.tokenizer(LOOP_PROMPT).input_ids
    plain = generate(pair.target, ModelDrafter(pair.draft), prompt, max_new_tokens, k=0, timing=False).tokens
    broken = generate(StaleCacheModel.wrap(pair.target), ModelDrafter(pair.draft), prompt, max_new_tokens, k=k,
                      timing=False)
    first_reject = first_diverge = None
    done = 0
    for number, rnd in enumerate(broken.rounds, 1):
        if first_reject is None and rnd.accepted < rnd.drafted:
            first_reject = number
        if first_diverge is None and rnd.tokens != plain[done : done + len(rnd.tokens)]:
            first_diverge = number
        done += len(rnd.tokens)
    return {"first_rejection_round": first_reject, "first_divergence_round": first_diverge,
            "identical": broken.tokens == plain}


# ---- the task --------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m spec.dist_test",
        description="Chi-square tests that speculative sampling reproduces the target's distribution exactly "
        "(the rule alone, on toy and real rows; the whole loop on the tiny pair), and that each deliberately wrong "
        "Break-It variant is caught. A test passes when p >= 0.001; 'power' is the probability of catching the "
        "bug at this sample size.",
    )
    parser.add_argument("--break", dest="bugs", default="all", choices=["all", "none", *BUGS],
                        help="which Break-It variants to run next to the correct code (default all). "
                        + "; ".join(f"{k}: {v}" for k, v in BUGS.items()))
    parser.add_argument("--n", type=int, default=100_000, help="rounds per rule test (a) (default 100000)")
    parser.add_argument("--loop-n", type=int, default=2000, help="generations per loop test (b) (default 2000)")
    parser.add_argument("--warps", default="all", choices=["all", "none", *WARPS],
                        help="warps to run through the whole loop in part (d) (default all)")
    parser.add_argument("--warp-n", type=int, default=500, help="generations per warp test (d) (default 500)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every test (pilots use seed + 1)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k warp, 0 = off")
    parser.add_argument("--top-p", type=float, default=0.95,
                        help="top-p warp, 1 = off (default 0.95: a common setting, and it keeps the real rows' support "
                        "small enough for 10^5 rounds in seconds; with 1 the full vocabulary makes them take an hour)")
    parser.add_argument("--no-real", action="store_true", help="skip the real-row test (no pair is loaded)")
    parser.add_argument("--prompt", default=REAL_PROMPT, help="prompt whose answer gives the real rows")
    add_model_args(parser)
    args = parser.parse_args(argv)
    if args.n < 100 or args.loop_n < 100 or args.warp_n < 100:
        parser.error("--n, --loop-n and --warp-n must be at least 100")
    if args.temperature <= 0:
        parser.error("--temperature must be > 0: these are tests of sampling (greedy identity is t3's job)")
    try:
        args.sampling = Sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as err:
        parser.error(str(err))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    log.QUIET = args.quiet
    variants = list(BUGS) if args.bugs == "all" else [] if args.bugs == "none" else [args.bugs]
    checks: list[Check] = []
    extra: dict = {}
    results = Results("dist_test")

    def done(new: list[Check]) -> list[Check]:
        """Checks go to disk as each part finishes: a cut run keeps the parts it finished."""
        for check in new:
            results.add(check.row())
        return new

    toy_p, toy_q = torch.tensor(TOY_P, dtype=torch.float64), torch.tensor(TOY_Q, dtype=torch.float64)
    checks += done(rule_checks("toy, alpha 0.7", toy_p, toy_q, variants, args.n, args.seed))

    if not args.no_real:
        pair = load_from_args(args)
        if pair.draft_tokenizer is not None:
            sys.exit("error: the real-row test needs a same-family draft (drop --allow-other-family)")
        p, q, at = real_rows(pair, args.sampling, args.prompt)
        alpha = float(torch.minimum(p, q).sum())
        extra["real_rows"] = {"pair": pair.name, "answer_position": at, "alpha": alpha, "vocab": p.shape[-1],
                              **pair.setup_fields()}
        draft = "" if pair.draft_quant == "none" else f", {pair.draft_quant} draft"  # q is that draft's
        checks += done(rule_checks(f"{pair.name} rows{draft}, alpha {alpha:.2f}", p, q, variants, args.n, args.seed))
        del pair

    try:
        tiny = load_pair("tiny", device=args.device)
    except ModelError as err:
        sys.exit(f"error: {err}")
    checks += done(loop_checks(tiny, variants, args.loop_n, args.seed, args.sampling))
    if "no-rollback" in variants:
        extra["no_rollback_greedy"] = greedy_identity_break(tiny)
    warps = list(WARPS) if args.warps == "all" else [] if args.warps == "none" else [args.warps]
    checks += done(warp_checks(tiny, warps, args.warp_n, args.seed, "committed-penalty" in variants))

    rows = [c.row() for c in checks]
    print(table(rows, [("part", ""), ("case", ""), ("variant", ""), ("n", "d"), ("bins", "d"), ("chi2", ".1f"),
                       ("df", "d"), ("p_value", ".3g"), ("verdict", ""), ("expect", ""), ("power", ".4f"),
                       ("as_expected", "")]))
    if "no_rollback_greedy" in extra:
        g = extra["no_rollback_greedy"]
        print(f"\nno-rollback, greedy on tiny: first rejection in round {g['first_rejection_round']}, output first "
              f"differs from plain decoding in round {g['first_divergence_round']}")
    weak = [c for c in checks if c.power is not None and c.power < POWER_GOAL]
    if weak:
        print(f"\nwarning: power below {POWER_GOAL} for " + ", ".join(f"{c.case}/{c.variant}" for c in weak))
    path = results.finish({"args": {k: v for k, v in vars(args).items() if k != "sampling"}, "level": LEVEL,
                           **extra}, key="checks")
    ok = all(c.ok for c in checks)
    print(f"\n{'all verdicts as expected' if ok else 'SOME VERDICTS UNEXPECTED'}; saved {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
