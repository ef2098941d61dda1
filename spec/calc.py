"""The speedup model of speculative decoding (Leviathan et al., 2023), and `python -m spec.calc` to print it.

Units are target steps: one plain decoding step of the target costs 1. With K drafts per round,

- each draft step costs c (c = one draft step / one target step),
- verifying K + 1 tokens in one target forward costs v(K) (the verify factor; the paper assumes v = 1),
- if each draft is accepted independently with probability alpha, a round emits
  E[tokens] = 1 + alpha + ... + alpha^K = (1 - alpha^(K+1)) / (1 - alpha) tokens,

so the predicted speedup over plain decoding is E[tokens] / (K c + v(K)), which is the paper's
(1 - alpha^(K+1)) / ((1 - alpha)(1 + K c)) when v = 1. K = 0 is plain decoding: exactly 1x.

Example: alpha 0.7, c 0.1 -> K = 4 emits 2.77 tokens per round at a cost of 1.4 steps: 1.98x.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Mapping
from typing import NamedTuple

from spec.io import table

Verify = float | Mapping[int, float]  # one factor for every K >= 1, or one per K


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one round emits on average: K + 1 when alpha = 1 (every draft accepted, plus the bonus)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"K must be >= 0, got {k}")
    if alpha == 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def verify_factor(verify: Verify, k: int) -> float:
    """v(K) from one factor or a per-K mapping; v(0) = 1 by definition (a K = 0 round is a plain step)."""
    if k == 0:
        return 1.0
    if isinstance(verify, Mapping):
        if k not in verify:
            raise ValueError(f"no verify factor measured for K = {k}")
        return verify[k]
    return verify


def round_cost(k: int, c: float, verify: Verify = 1.0) -> float:
    """Cost of one round in target steps: K draft steps and one verify of K + 1 tokens."""
    return k * c + verify_factor(verify, k)


def speedup(alpha: float, k: int, c: float, verify: Verify = 1.0) -> float:
    """Predicted speedup over plain decoding of K drafts per round (1.0 at K = 0)."""
    return expected_tokens(alpha, k) / round_cost(k, c, verify)


# ---- Greedy: tokens per round from where the draft disagrees ------------------------------------------------
#
# Under greedy decoding acceptance is not a coin flip: whether the draft's guess for a position equals the target's
# token depends only on the text before it (a draft proposes position j of a round only if it got every earlier
# one right, so its context is the true text). One run therefore reveals, position by position, where the draft
# agrees, and replaying those positions with another K gives that K's rounds exactly: the formula's independent
# alpha is the special case of agreements scattered at random, while real text clusters them (boilerplate accepts
# whole runs, hard stretches reject early).


def agreement(rounds, length: int | None = None) -> list[bool | None]:
    """Per position of a greedy generation, whether the draft agreed with the target there, from one run's rounds
    [(drafted, accepted), ...]: a round shows `accepted` agreements, then a disagreement if it rejected one; its
    last token (the fix, or the bonus after a full acceptance, which no draft proposed) is None when unobserved."""
    out: list[bool | None] = []
    for drafted, accepted in rounds:
        out += [True] * accepted + [False if accepted < drafted else None]
    return out[:length] if length is not None else out


def merge_agreement(runs: list[list[bool | None]]) -> list[bool | None]:
    """Several runs' views of one text (other Ks observe other positions): each position's observed value."""
    merged: list[bool | None] = [None] * max(map(len, runs), default=0)
    for run in runs:
        for i, seen in enumerate(run):
            if merged[i] is None:
                merged[i] = seen
    return merged


def replayed_rounds(agree: list[bool | None], k: int, alpha: float, fills: int = 32, seed: int = 0) -> float:
    """Rounds K drafts a round would take over the text of `agree` (its length in tokens): each round accepts the
    run of agreements from its start, at most K (and no more than the tokens left), and emits one token more.
    Unobserved positions are filled by draws at `alpha`, averaged over `fills` seeded fillings (exact if none)."""
    rng = random.Random(seed)
    unknown = [i for i, a in enumerate(agree) if a is None]
    total = 0
    for _ in range(fills if unknown else 1):
        filled = [rng.random() < alpha if a is None else a for a in agree]
        start, rounds = 0, 0
        while start < len(filled):
            run = 0
            while run < k and start + run < len(filled) - 1 and filled[start + run]:
                run += 1
            start, rounds = start + run + 1, rounds + 1
        total += rounds
    return total / (fills if unknown else 1)


def replayed_tokens_per_round(texts, k: int, alpha: float) -> float:
    """Tokens per round at K over several texts, each given as its runs [(tokens, rounds), ...] (other Ks' runs of
    the same greedy text, which observe other positions): agreements merged, then replayed with K drafts a round."""
    tokens = rounds = 0
    for runs in texts:
        length = max(n for n, _ in runs)
        agree = merge_agreement([agreement(counts, length) for _, counts in runs])
        tokens, rounds = tokens + length, rounds + replayed_rounds(agree, k, alpha)
    return tokens / rounds if rounds else float("nan")


def best_k(alpha: float, c: float, max_k: int, verify: Verify = 1.0, ks=None) -> tuple[int, float]:
    """The K in 0..max_k (or in `ks`, plus 0) with the highest predicted speedup; ties go to the smaller K."""
    candidates = sorted({0, *(ks if ks is not None else range(1, max_k + 1))})
    best = (0, 1.0)
    for k in candidates:
        s = speedup(alpha, k, c, verify)
        if s > best[1]:
            best = (k, s)
    return best


# ---- Token trees (spec/tree.py) --------------------------------------------------------------------------------
#
# A tree of static shape (b_1, .., b_D) emits 1 + (its accepted depth) tokens a round. Its expected accepted depth
# is the sum over nodes of each node's path-acceptance probability. Under greedy decoding with top-b children the
# node reached at depth d is accepted when the target's token there is among the draft's top b_d: if the draft's
# rank of the target's token is r with probability a_r, independently at each position, a depth-d node of rank path
# (r_1, .., r_d) is accepted with probability a_{r_1} .. a_{r_d}, and summing over a depth's nodes gives
# A(b_1) .. A(b_d) with A(b) = a_0 + .. + a_{b-1}. A chain is b = 1: A(1) = alpha, the formula above. As with the
# chain, real text clusters its agreements, so `replayed_tree_tokens` replays measured ranks instead.


def tree_tokens(shape, rank_probs) -> float:
    """Expected tokens per round of a static tree with independent ranks: 1 + sum_d prod_{i <= d} A(b_i).
    rank_probs[r]: probability that the target's token is the draft's r-th choice (0 = its argmax)."""
    total, reach = 1.0, 1.0
    for b in shape:
        reach *= sum(rank_probs[:b])
        total += reach
    return total


def tree_reach_by_depth(shape, leave) -> list[float]:
    """The probability that a round of a static tree accepts through depth d, for d = 1 .. len(shape), when a node at
    depth d - 1 (the root is depth 0) offering its b top children is left by one of them with probability
    leave(d, b), independently of the other depths: prod_{i <= d} leave(i, b_i)."""
    out, reach = [], 1.0
    for depth, b in enumerate(shape, 1):
        reach *= leave(depth, b)
        out.append(reach)
    return out


def tree_tokens_by_depth(shape, leave) -> float:
    """Expected tokens per round of a static tree (see `tree_reach_by_depth`): 1 + sum_d prod_{i <= d} leave(i, b_i).
    `tree_tokens` is the case leave(d, b) = a_0 + .. + a_{b-1}."""
    return 1.0 + sum(tree_reach_by_depth(shape, leave))


class Replay(NamedTuple):
    """What a static tree does over a greedy text: tokens, rounds, and the rounds that accepted every depth (the
    draft never fed their deepest node, so the next round's first draft forward reads two tokens: the catch-up)."""
    tokens: int
    rounds: int
    full: int


def replayed_tree_tokens(ranks: list[int], shape) -> Replay:
    """What a static tree would do over a greedy text whose token j has rank ranks[j] among the draft's choices
    after the true text before it: each round descends while the rank at depth d is below b_d, and emits one
    token more (the fix, or the bonus)."""
    start = rounds = full = 0
    while start < len(ranks):
        depth = 0
        while depth < len(shape) and start + depth < len(ranks) - 1 and ranks[start + depth] < shape[depth]:
            depth += 1
        start, rounds, full = start + depth + 1, rounds + 1, full + (depth == len(shape))
    return Replay(len(ranks), rounds, full)


def tree_round_cost(shape, draft_cost: Mapping[int, float], verify: Mapping[int, float], full: float = 0.0) -> float:
    """One round of a static tree in target steps: D draft forwards (the first over the new true token, then one
    over each depth's nodes but the last) and one target forward over the nodes plus the true token. `full`: the
    share of rounds that accept every depth; the round after each feeds the draft two tokens in its first forward
    (the deepest node, never fed, and the bonus), which costs draft_cost[2] - draft_cost[1] more.
    draft_cost[w]: a draft forward of w tokens; verify[n]: a target forward of n tokens (verify[1] = 1)."""
    widths, width = [], 1
    for b in shape:
        width *= b
        widths.append(width)
    catch_up = full * (draft_cost[2] - draft_cost[1]) if full else 0.0
    return draft_cost[1] + catch_up + sum(draft_cost[w] for w in widths[:-1]) + verify[sum(widths) + 1]


def tree_shapes(max_nodes: int, max_depth: int, max_branch: int = 4) -> list[tuple[int, ...]]:
    """Every static shape with non-increasing branching (wider near the root, where acceptance is likeliest),
    b <= max_branch, depth <= max_depth and at most max_nodes nodes; chains included."""
    out = []

    def grow(shape, nodes, width):
        if shape:
            out.append(shape)
        if len(shape) == max_depth:
            return
        for b in range(1, min(max_branch, shape[-1] if shape else max_branch) + 1):
            if nodes + width * b <= max_nodes:
                grow((*shape, b), nodes + width * b, width * b)

    grow((), 0, 1)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m spec.calc",
        description="Predicted speedup of speculative decoding for each K: E[tokens per round] / (K c + v), "
        "with E[tokens per round] = (1 - alpha^(K+1)) / (1 - alpha) (Leviathan et al., 2023).",
    )
    parser.add_argument("--alpha", type=float, required=True,
                        help="probability that the target accepts a draft token (0..1); "
                             "python -m spec.sweep measures it")
    parser.add_argument("--c", type=float, required=True,
                        help="cost of one draft step divided by one target step (e.g. 0.1)")
    parser.add_argument("--verify-factor", type=float, default=1.0,
                        help="cost of verifying K+1 tokens in one target forward, in target steps (default 1)")
    parser.add_argument("--max-k", type=int, default=16, help="largest K to tabulate (default 16)")
    args = parser.parse_args(argv)
    if not 0 <= args.alpha <= 1:
        parser.error(f"--alpha must be in [0, 1], got {args.alpha}")
    if args.c < 0:
        parser.error(f"--c must be >= 0, got {args.c}")
    if args.verify_factor <= 0:
        parser.error(f"--verify-factor must be > 0, got {args.verify_factor}")
    if args.max_k < 1:
        parser.error(f"--max-k must be >= 1, got {args.max_k}")
    rows = [
        {"K": k, "tokens/round": expected_tokens(args.alpha, k),
         "cost (steps)": round_cost(k, args.c, args.verify_factor),
         "speedup": speedup(args.alpha, k, args.c, args.verify_factor)}
        for k in range(args.max_k + 1)
    ]
    print(table(rows, [("K", "d"), ("tokens/round", ".3f"), ("cost (steps)", ".3f"), ("speedup", ".3f")]))
    k, s = best_k(args.alpha, args.c, args.max_k, args.verify_factor)
    print(f"best K = {k} ({s:.2f}x)" + ("  (speculation does not pay: decode plainly)" if k == 0 else ""))


if __name__ == "__main__":
    main()
