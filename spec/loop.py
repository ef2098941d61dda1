"""The speculative decoding loop: the one generator every task, the server and the benchmarks drive.

One round:
  1. the drafter proposes k tokens d_1..d_k (and the q rows they were sampled from, or None);
  2. the target scores the tokens it has not cached plus the drafts in one forward: K + 1 rows of logits;
  3. a pure rule (greedy or sampling) accepts n of the drafts and gives the fix or bonus token;
  4. the text grows by n + 1 tokens and both caches roll back to the true text less its last token, which the
     next round feeds first.
With k = 0 (or a drafter that finds nothing) a round is exactly one step of plain decoding. The server makes a
generation's first round such a step (`first_alone`), so that its first token streams as soon as plain decoding's.

A drafter may propose a token tree instead of a chain (spec/tree.py): the same round, with the target's forward
over all nodes under a tree layout, the tree rules (`tree_greedy`, `tree_accept`) choosing the accepted path, and
the caches keeping that path (`Model.keep`). A chain takes the batched chain rules, with one device-to-host sync.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from spec import tree
from spec.drafters import Drafter
from spec.models import Model, sync_time
from spec.rules import accept_or_fix, greedy_rule, tree_accept, tree_greedy
from spec.warps import Decoding, Sampling


@dataclass
class Round:
    """What one round produced. `tokens` are the emitted ids (accepted drafts, then the fix or bonus), already cut
    at EOS or at max_new_tokens; `accepted` counts drafts the rule accepted before that cut."""

    tokens: list[int]
    drafted: int
    accepted: int
    draft_s: float
    verify_s: float
    total_s: float
    prefill_s: float = 0.0  # only on the first round: the prompt's forward through target and drafter (through
    # the target only with speculate's first_alone, whose drafter reads the prompt after that round, timed nowhere)
    finish: str | None = None  # "stop" (EOS), "length" (max_new_tokens), or None while generation goes on
    # With `logprobs=N`: per emitted token, (its log-probability, the N most likely (id, log-probability)) under the
    # target's raw distribution at that position (its logits before any warp).
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # What the rule saw at each node it visited, root first: (slot of the child it descended into, or `offered`
    # when none; offered = the node's children), spec.tree.visits. A chain of K that kept n: [(0, 1)] * n + [(1, 1)].
    slots: list[tuple[int, int]] = field(default_factory=list)
    forwards: tuple[int, ...] = ()  # tokens each draft forward read (a draft model's; empty for other drafters)
    verified: int = 0  # tokens the target's forward read: the uncached true text and every node


class KPolicy(Protocol):
    """Chooses the number of drafts for the next round, and learns from the round it produced. A tree policy
    (spec.policy.TreePolicy) answers a tree shape instead of K: the drafter drafts that shape (cut to the tokens
    left), and K is its depth."""

    def next_k(self) -> int | tuple[int, ...]: ...

    def observe(self, rnd: Round) -> None: ...

    def reads_prompt(self, prompt_tokens: int) -> bool:
        """Whether the drafter should read the prompt now, at prefill (else its first proposal catches up)."""
        ...


class FixedK:
    def __init__(self, k: int):
        if k < 0:
            raise ValueError(f"K must be >= 0, got {k}")
        self.k = k

    def next_k(self) -> int:
        return self.k

    def observe(self, rnd: Round) -> None:
        pass

    def reads_prompt(self, prompt_tokens: int) -> bool:
        return self.k > 0  # K = 0 never drafts: reading the prompt would be wasted work


def speculate(
    target: Model,
    drafter: Drafter,
    prompt: Sequence[int],
    max_new_tokens: int,
    k: int | KPolicy = 4,
    sampling: Sampling = Sampling(),
    generator: torch.Generator | None = None,
    eos: Iterable[int] = (),
    timing: bool = True,
    seed: int | None = None,
    logprobs: int | None = None,
    decoding: Decoding | None = None,
    first_alone: bool = False,
) -> Iterator[Round]:
    """Generate up to `max_new_tokens` tokens after `prompt`, one `Round` at a time.

    The target's output distribution is preserved exactly: greedy runs equal plain greedy decoding token for token,
    sampled runs follow the target's (warped) distribution. Generation stops after the first EOS id (which is
    emitted) or at exactly `max_new_tokens`. The caches of `target` and `drafter` are reset first, so the same
    objects can serve one request after another. `timing=False` skips the device syncs that per-phase times need
    (the prefill is still waited for once, so decode times never include it).
    `seed` keys the coupled mode's noise (`Sampling(coupled=True)`); `logprobs=N` reports each emitted token's
    log-probability and the N most likely under the target's raw distribution. `decoding` replaces the state built
    from `sampling` and `seed` (how the token counts and noise are kept).

    `first_alone` (the server's way): the first round is a plain step (K = 0) and the drafter reads the prompt only
    after it, so the first token is out after the target's prefill and one step, as in plain decoding, not after
    the draft's prefill and a whole round (whose time then counts in no round). The policy does not choose that
    round but sees it, as any K = 0 round: it marks a new generation (`prefill_s`), times a target step, and
    leaves the drafter one token behind, which the next round's first draft forward reads with the one it always
    reads. Greedy and coupled output are unchanged; sampled output keeps the target's law, though a seed then gives
    another text; a generation takes about one target step longer (its first token came alone).
    """
    policy = FixedK(k) if isinstance(k, int) else k
    prompt = list(prompt)
    if not prompt:
        raise ValueError("the prompt is empty: speculation needs at least one token to continue from")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(prompt) + max_new_tokens > target.max_length:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's context of "
            f"{target.max_length} tokens"
        )
    stop_ids = frozenset(eos)
    device = target.device
    decoding = decoding or Decoding.start(sampling, prompt, target.vocab, device, seed)

    def clock() -> float:
        return sync_time(device) if timing else time.perf_counter()

    # Prefill: both models see the prompt less its last token, which the first round feeds with the drafts.
    # Synchronised even with timing=False (one wait per generation): else the prompt's forward, still running on the
    # device, would be paid by the first round's sync and counted as decode time (on an H200 the 8B's 512-token
    # prefill in 16-token chunks is 0.15 s, a quarter of a 128-token decode).
    target.reset()
    drafter.rollback(0)
    start = sync_time(device)
    read_prompt = len(prompt) > 1 and policy.reads_prompt(len(prompt) - 1)
    if len(prompt) > 1:
        target.forward(prompt[:-1], keep=1)
        if read_prompt and not first_alone:
            drafter.prefill(prompt[:-1])
    prefill_s = sync_time(device) - start
    alone = first_alone  # this round is the first, and comes alone

    seq = prompt
    emitted = 0
    last = None  # the last emitted token as the rule left it on the device (saves a host-to-device copy)
    while True:
        t0 = clock()
        want = 0 if alone else policy.next_k()  # K, or a tree policy's shape (its depth is K)
        shape = want if isinstance(want, tuple) else None
        k_now = max(0, min(len(shape) if shape else want, max_new_tokens - emitted - 1))
        # tokens [n], q [n, V] | None, tree | None
        draft = drafter.propose(seq, k_now, decoding, generator, shape[:k_now] if shape and k_now else None)
        drafts = draft.tokens
        t1 = clock()
        if last is not None and target.length == len(seq) - 1:
            uncached = last
        else:  # a host tensor copied without blocking: the CPU must not wait for the draft's kernels to finish
            uncached = torch.tensor(seq[target.length :], dtype=torch.long).to(device, non_blocking=True)
        fed = torch.cat([uncached, drafts]) if len(drafts) else uncached
        layout = None if draft.chain else tree.layout(tree.with_prefix(draft.parents, len(uncached)), 0, len(fed),
                                                      target.length, device)
        logits = target.forward(fed, keep=len(drafts) + 1, tree=layout)  # [n+1, V]
        if draft.chain:
            if decoding.deterministic:  # greedy, or coupled: the target's own argmax decides, whatever was drafted
                n_accepted, nxt = greedy_rule(decoding.scores(logits, drafts)[None], drafts[None])
            else:
                p = decoding.probs(logits, drafts)  # [k'+1, V]: row i warped along drafts[:i]
                n_accepted, nxt = accept_or_fix(p[None], None if draft.q is None else draft.q[None], drafts[None],
                                                generator)
            n, fix, *draft_ids = torch.cat([n_accepted, nxt, drafts]).tolist()  # the round's one device -> host sync
            path = list(range(n))
            last = nxt
        else:  # a token tree: the same round, its rule walks the accepted path
            if decoding.deterministic:
                path, fix = tree_greedy(decoding.tree_rows(logits, drafts, draft.parents, scores=True), drafts,
                                        draft.parents)
            else:
                path, fix = tree_accept(decoding.tree_rows(logits, drafts, draft.parents), draft.q, drafts,
                                        draft.parents, generator)
            draft_ids = drafts.tolist()
            last = None
        t2 = clock()

        new, finish = cut([draft_ids[i] for i in path] + [fix], stop_ids, max_new_tokens - emitted)
        start = len(seq)  # the target cached the whole text before this round's drafts
        seq = seq + new
        emitted += len(new)
        decoding.advance(new)
        if finish is None:
            target.keep(start, [start + i for i in path])
            drafter.rollback(len(seq) - 1, path)
        rows = [0] + [1 + i for i in path]  # the rows that chose the emitted tokens (for a chain, 0 .. n)
        reported = None if logprobs is None else token_logprobs(logits[rows][: len(new)], new, logprobs)
        slots = tree.visits(tree.chain(len(draft_ids)) if draft.chain else draft.parents, path)
        rnd = Round(new, len(draft_ids), len(path), t1 - t0, t2 - t1, clock() - t0, prefill_s, finish, reported,
                    slots, draft.forwards, len(fed))
        prefill_s = 0.0
        policy.observe(rnd)
        yield rnd
        if finish:
            return
        if alone and read_prompt:  # the first token is out: now the drafter reads the prompt
            drafter.prefill(prompt[:-1])
        alone = False


def cut(tokens: list[int], stop_ids: frozenset[int], room: int) -> tuple[list[int], str | None]:
    """A round's tokens as emitted: up to and including the first EOS ("stop"), at most `room` ("length")."""
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1], "stop"
    if len(tokens) >= room:
        return tokens[:room], "length"
    return tokens, None


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Each token's log-probability under the raw distribution of its row, and the `top` most likely.
    logits: [n, V] (row i predicts tokens[i])."""
    log_p = logits.float().log_softmax(-1)
    chosen = log_p.gather(1, torch.tensor(tokens, device=log_p.device)[:, None]).squeeze(1).tolist()
    best = log_p.topk(top, dim=-1) if top else None
    tops = [list(zip(i, v)) for i, v in zip(best.indices.tolist(), best.values.tolist())] if top else [[]] * len(tokens)
    return list(zip(chosen, tops))


@dataclass
class Result:
    """A whole generation, drained from `speculate`."""

    tokens: list[int]
    rounds: list[Round] = field(default_factory=list)

    @property
    def finish(self) -> str | None:
        return self.rounds[-1].finish if self.rounds else None

    @property
    def drafted(self) -> int:
        return sum(r.drafted for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def alpha(self) -> float:
        """Acceptance rate alpha-hat: drafts accepted / drafts proposed (NaN when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_round(self) -> float:
        return len(self.tokens) / len(self.rounds) if self.rounds else float("nan")

    @property
    def prefill_s(self) -> float:
        return self.rounds[0].prefill_s if self.rounds else 0.0

    @property
    def decode_s(self) -> float:
        return sum(r.total_s for r in self.rounds)

    @property
    def tok_s(self) -> float:
        """Decode throughput: generated tokens / time in rounds (prefill excluded)."""
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else float("nan")

    def summary(self) -> dict:
        return {
            "tokens": len(self.tokens), "rounds": len(self.rounds), "drafted": self.drafted, "accepted": self.accepted,
            "alpha": self.alpha, "tokens_per_round": self.tokens_per_round, "prefill_s": self.prefill_s,
            "decode_s": self.decode_s, "tok_s": self.tok_s, "finish": self.finish,
            "draft_s": sum(r.draft_s for r in self.rounds), "verify_s": sum(r.verify_s for r in self.rounds),
        }


def generate(*args, **kwargs) -> Result:
    """Run `speculate` to the end and collect its rounds."""
    result = Result([])
    for rnd in speculate(*args, **kwargs):
        result.tokens.extend(rnd.tokens)
        result.rounds.append(rnd)
    return result
