"""Drafters: where the K guesses come from.

A drafter has three calls. `prefill(ids)` sees the prompt (less its last token) before the first round.
`propose(seq, k, decoding, generator)` returns up to k draft ids [k'] (int64, on the target's device) and the
distributions they were sampled from [k', V] — or None when the drafter is deterministic (one-hot q). `decoding`
(spec.warps.Decoding) is how the target chooses its tokens: a draft model warps its rows the same way, position
by position along its own drafts (penalties count them), and in coupled mode takes the same noise's argmax.
`rollback(length)` tells it that only the first `length` tokens of the text are true.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from spec.models import Model
from spec.remap import RemappedDrafter
from spec.rules import sample
from spec.warps import Decoding


class Drafter(Protocol):
    def prefill(self, ids: Sequence[int]) -> None: ...

    def propose(
        self, seq: Sequence[int], k: int, decoding: Decoding, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def rollback(self, length: int) -> None: ...


class NoDrafter:
    """Proposes nothing: every round is one plain decoding step of the target."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def prefill(self, ids):
        pass

    def propose(self, seq, k, decoding, generator):
        return torch.empty(0, dtype=torch.long, device=self.device), None

    def rollback(self, length):
        pass


class ModelDrafter:
    """A smaller model of the same tokenizer, with its own KV cache.

    Its cache holds a prefix of the true text. Each propose first feeds whatever the cache lacks — one token
    normally, two after a round in which every draft was accepted (it never saw its own last draft) — then drafts
    autoregressively, feeding each draft back. The last draft is not fed: nothing needs its successor.
    """

    def __init__(self, model: Model):
        self.model = model

    def prefill(self, ids):
        if len(ids):
            self.model.forward(ids, keep=1)

    def propose(self, seq, k, decoding, generator):
        drafts, dists = [], []
        new = torch.tensor(seq[self.model.length :], dtype=torch.long).to(self.model.device, non_blocking=True)
        for i in range(k):
            logits = self.model.forward(new, keep=1)  # [1, V]: position i of the round, after drafts[:i]
            if decoding.deterministic:
                token = decoding.scores(logits, drafts, start=i)[0].argmax(-1, keepdim=True)
            else:
                q = decoding.probs(logits, drafts, start=i)[0]
                token = sample(q, generator)
                dists.append(q)
            drafts.append(token.view(1))
            new = token.view(1)
        if not drafts:
            return torch.empty(0, dtype=torch.long, device=self.model.device), None
        return torch.cat(drafts), (torch.stack(dists) if dists else None)

    def rollback(self, length):
        self.model.rollback(min(self.model.length, length))


def lookup_draft(seq: Sequence[int], k: int, max_ngram: int = 3) -> list[int]:
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens (n = max_ngram down to 1) in the
    text so far (prompt and output) and propose the up-to-k tokens that followed it; [] if none.

    Example: seq = [5, 6, 7, 8, 5, 6], k = 2 -> the bigram (5, 6) occurred at 0, followed by [7, 8].
    """
    length = len(seq)
    if k <= 0 or length < 2:
        return []
    seq = list(seq)
    for n in range(min(max_ngram, length - 1), 0, -1):
        tail = seq[length - n :]
        last = tail[-1]
        # `end` indexes the last token of a candidate occurrence; scan from the most recent earlier one backwards.
        for end in range(length - 2, n - 2, -1):
            if seq[end] == last and seq[end - n + 1 : end + 1] == tail:
                follow = seq[end + 1 : end + 1 + k]
                if follow:
                    return follow
    return []


class LookupDrafter:
    """Prompt lookup as a drafter: no model, no state; q is one-hot."""

    def __init__(self, device: torch.device | str = "cpu", max_ngram: int = 3):
        self.device = torch.device(device)
        self.max_ngram = max_ngram

    def prefill(self, ids):
        pass

    def propose(self, seq, k, decoding, generator):
        return torch.tensor(lookup_draft(seq, k, self.max_ngram), dtype=torch.long, device=self.device), None

    def rollback(self, length):
        pass


def make_drafter(method: str, pair, max_ngram: int = 3) -> Drafter:
    """`draft` (the pair's draft model), `lookup` (prompt lookup) or `none` (plain decoding)."""
    if method == "draft":
        if pair.draft is None:
            raise ValueError("method 'draft' needs a pair loaded with its draft model")
        if pair.draft_tokenizer is not None:
            return RemappedDrafter(pair.draft, pair.draft_tokenizer, pair.tokenizer, pair.target.vocab)
        return ModelDrafter(pair.draft)
    if method == "lookup":
        return LookupDrafter(pair.target.device, max_ngram)
    if method == "none":
        return NoDrafter(pair.target.device)
    raise ValueError(f"unknown drafting method {method!r}; choose draft, lookup or none")
