"""DELIBERATELY WRONG: the Break-It variants of the pieces an exact speculative decoder depends on.

Nothing here is ever used to generate text. Each variant is one small, plausible mistake, kept out of the product
path (the loop, rules, drafters, models and server never import this module) so that the code users run stays
exactly the correct code; only `spec.dist_test`, the tests and the docs' figures use it.
`python -m spec.dist_test --break NAME` must catch each of them; the power of each test is in docs/exactness.md.

- `resample-p`  (a rule): on rejection, sample the fix from p instead of the residual max(0, p - q).
- `softmax-q`   (a drafter): draft the argmax, but hand the rule q = softmax(logits) — not the distribution the
  draft was chosen from (that was one-hot at the argmax).
- `no-rollback` (a target): rollback moves `length` but leaves the rejected drafts' KV entries in the cache, so the
  next round attends to text that was never accepted.
- `committed-penalty` (the token counts): penalties at every position of a round count only the committed text,
  not the drafts before that position, so the target's rows after the first are penalised as if d_1 .. d_{i-1}
  had not been written.
- (trees) `naive_tree_accept`: keep a node's first child with min(1, p/q), else draw from p; and
  `DrawScoredDrafter`: a dynamic tree that scores a sampled child by q of the token drawn (EAGLE-2's score) rather
  than by its slot, so the children it keeps no longer follow q. tests/test_tree.py catches both.
"""

from __future__ import annotations

import torch

from spec.drafters import ModelDrafter
from spec.models import EagerModel
from spec.tree import Draft, children
from spec.warps import Decoding, Sampling, TokenCounts

BUGS = {
    "resample-p": "on rejection the rule samples the fix from p instead of the residual max(0, p - q)",
    "softmax-q": "the draft picks its argmax but reports q = softmax(logits) instead of one-hot",
    "no-rollback": "the target's rollback moves its length but keeps the rejected drafts' KV entries",
    "committed-penalty": "penalties count the committed text only, not the drafts before each position",
}


# ---- resample-p: a wrong rule --------------------------------------------------------------------------------


def resample_from_p(
    p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`spec.rules.accept_or_fix` with one mistake: the token after the accepted prefix always comes from p.

    p: [B, K+1, V]   q: [B, K, V] or None (one-hot)   drafts: [B, K]   ->   n_accepted [B], next_token [B]

    The keep test is the true one. A rejected position then emits x with probability
    min(p(x), q(x)) + (1 - alpha) * p(x)   (alpha = sum_y min(p(y), q(y))),
    which is p only when alpha = 1: the fix may redraw the very token just rejected, so tokens the draft
    over-proposes (q > p) come out too often. `resample_from_p_law` computes this law.
    """
    batch, k = drafts.shape
    p_d = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # [B, K]
    q_d = torch.ones_like(p_d) if q is None else q.gather(-1, drafts[..., None]).squeeze(-1)
    keep = torch.rand(batch, k, generator=generator, device=p.device) * q_d < p_d
    n_accepted = keep.long().cumprod(-1).sum(-1)  # [B]
    chosen = p[torch.arange(batch, device=p.device), n_accepted]  # [B, V]: the bug — p, not the residual
    return n_accepted, torch.multinomial(chosen, 1, generator=generator).squeeze(1)


def resample_from_p_law(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What one position emits under `resample_from_p`: min(p, q) + (1 - alpha) p.   p, q: [V] -> [V]"""
    both = torch.minimum(p, q)
    return both + (1 - both.sum()) * p


# ---- softmax-q: a wrong drafter ------------------------------------------------------------------------------


class SoftmaxQDrafter(ModelDrafter):
    """A draft model that drafts greedily (argmax) but reports the softmax of its warped logits as q.

    The rule's guarantee needs q to be the law the draft was drawn from; an argmax draw has a one-hot law. With the
    wrong q the rule keeps the argmax d with probability min(1, p(d)/q(d)) and otherwise draws from
    max(0, p - q): `softmax_q_law` gives the result, which is not p. Greedy decoding never reads q, so there the
    drafter is just the normal one.
    """

    def propose(self, seq, k, decoding, generator, shape=None):
        if decoding.deterministic:
            return super().propose(seq, k, decoding, generator, shape)
        drafts, dists = [], []
        new = torch.as_tensor(seq[self.model.length :], dtype=torch.long, device=self.model.device)
        for i in range(k):
            logits = self.model.forward(new, keep=1)  # [1, V]
            token = logits[0].argmax(-1, keepdim=True)  # the bug: the draw is not from the q reported below
            dists.append(decoding.probs(logits, drafts, start=i)[0])
            drafts.append(token)
            new = token
        if not drafts:
            return Draft.empty(self.model.device)
        return Draft(torch.cat(drafts), torch.stack(dists))


def softmax_q_law(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What one position emits when the draft is argmax(q) but the rule is told q.   p, q: [V] -> [V]"""
    d = int(q.argmax())
    keep = min(1.0, float(p[d] / q[d]))
    residual = (p - q).clamp_min(0.0)
    law = torch.zeros_like(p)
    if keep < 1:
        law = (1 - keep) * residual / residual.sum()
    law[d] += keep
    return law


# ---- no-rollback: a wrong cache ------------------------------------------------------------------------------


class StaleCacheModel(EagerModel):
    """A `EagerModel` whose rollback only moves `length`: the KV entries of rejected drafts stay in the cache.

    The next forward appends after those stale entries, so the model reads text that was never accepted, at
    positions shifted by the number of stale tokens. A round after one where every draft was accepted has nothing
    stale, which is why greedy identity survives round one and breaks at the first round after a rejection.
    `reset()` (rollback to 0) still clears the cache, so each generation starts clean, as in a real server.
    """

    @classmethod
    def wrap(cls, model: EagerModel) -> StaleCacheModel:
        """The same weights with a fresh, stale-prone cache."""
        return cls(model.model, model.vocab, name=f"{model.name} (no rollback)")

    def rollback(self, length: int) -> None:
        if length == 0:
            super().rollback(0)
        elif length > self.length:
            raise ValueError(f"cannot roll {self.length} positions back to {length}")
        else:
            self.length = length  # the bug: the cache keeps everything after `length`


# ---- committed-penalty: wrong token counts -------------------------------------------------------------------


class CommittedOnlyCounts(TokenCounts):
    """`spec.warps.TokenCounts` with one mistake: every row of a round gets the committed text's counts, as if the
    drafts before it were not there. Invisible in greedy text at position 1 and in any round that drafts one
    token; visible to a chi-square at positions 2 and later, whenever a penalty is on."""

    def rows(self, path, start: int = 0, n: int = 1):
        counts = self.output.expand(n, -1)  # the bug: path[:start + i] is not counted
        return counts, self.in_prompt | (counts > 0)


def committed_penalty_decoding(sampling: Sampling, prompt: list[int], vocab: int, device) -> Decoding:
    """A `Decoding` whose counts are `CommittedOnlyCounts`: pass it to `spec.loop.generate(..., decoding=)`."""
    return Decoding(sampling, CommittedOnlyCounts(prompt, vocab, device))


# ---- naive-tree: a wrong tree rule ---------------------------------------------------------------------------


def naive_tree_accept(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor, parents: tuple[int, ...],
                      generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """The tempting tree rule: keep a node's first child with min(1, p/q), as on a chain; if it is rejected, draw y
    from p itself and descend if y is one of the other children, else emit y. Same arguments as
    `spec.rules.tree_accept`.

    It is wrong because the draw after a rejection comes from p, not from the residual max(0, p - q): the first
    child is emitted with probability min(p, q) + (1 - alpha) p of its mass, more than p wherever q > 0 and the
    first try can fail. tests/test_tree.py shows a chi-square catching it."""
    kids = children(parents)
    ids = tokens.tolist()
    path, node = [], -1
    while True:
        row = p[node + 1]
        options = kids[node]
        if not options:
            return path, int(torch.multinomial(row[None], 1, generator=generator))
        first = options[0]
        q_x = 1.0 if q is None else float(q[first][ids[first]])
        if float(torch.rand((), generator=generator, device=p.device)) * q_x < float(row[ids[first]]):
            path.append(first)
            node = first
            continue
        y = int(torch.multinomial(row[None], 1, generator=generator))
        child = next((c for c in options[1:] if ids[c] == y), None)
        if child is None:
            return path, y
        path.append(child)
        node = child


class DrawScoredDrafter(ModelDrafter):
    """A dynamic-tree drafter that, under sampling, scores each drawn child by q(x) of the token drawn, as EAGLE-2
    scores its candidates. Which draws survive the node budget then depends on their own values (likely ones stay,
    unlikely ones go), while the rule is still told they are plain draws without replacement: the text's law moves
    away from p. The correct drafter scores the j-th draw by the j-th largest probability (spec/drafters.py)."""

    @staticmethod
    def _children(row, path, depth, branching, decoding, generator, scored=False, q=None, available=None):
        picked, q, slots = ModelDrafter._children(row, path, depth, branching, decoding, generator, scored, q,
                                                  available)
        if scored and q is not None:
            slots = q[picked]
        return picked, q, slots
