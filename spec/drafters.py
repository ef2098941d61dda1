"""Drafters: where the K guesses come from.

A drafter has three calls. `prefill(ids)` sees the prompt (less its last token) before the first round.
`propose(seq, k, decoding, generator)` returns a `Draft`: up to k draft ids in a chain, or a token tree at most k
deep (spec/tree.py), with the distributions they were sampled from, or None when the drafter is deterministic
(one-hot q). `decoding` (spec.warps.Decoding) is how the target chooses its tokens: a draft model warps its rows
the same way, position by position along each node's own path (penalties count it), and in coupled mode takes the
same noise's argmax. `rollback(length, path)` tells it that only the first `length` tokens of the text are true;
after a tree, `path` lists the nodes that were accepted (a drafter that cached its tree keeps those).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from spec import tree
from spec.models import Model
from spec.remap import RemappedDrafter
from spec.rules import sample
from spec.tree import Draft
from spec.warps import Decoding


class Drafter(Protocol):
    def prefill(self, ids: Sequence[int]) -> None: ...

    def propose(self, seq: Sequence[int], k: int, decoding: Decoding, generator: torch.Generator | None) -> Draft: ...

    def rollback(self, length: int, path: Sequence[int] = ()) -> None: ...




class NoDrafter:
    """Proposes nothing: every round is one plain decoding step of the target."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def prefill(self, ids):
        pass

    def propose(self, seq, k, decoding, generator):
        return Draft.empty(self.device)

    def rollback(self, length, path=()):
        pass


class ModelDrafter:
    """A smaller model of the same tokenizer, with its own KV cache.

    Its cache holds a prefix of the true text. Each propose first feeds whatever the cache lacks — one token
    normally, two after a round in which every draft was accepted (it never saw its own last draft) — then drafts
    depth by depth: the children of every node of the frontier come from that node's row, and the new frontier is
    fed in one forward (a tree layout over the cache; a chain needs none). The last depth is not fed: nothing needs
    its successors.

    `shape` is the branching per depth (spec/tree.py); None is a chain of k. Children are the top-b of the warped
    scores when decoding is deterministic (greedy, coupled), else b draws without replacement from q.
    """

    def __init__(self, model: Model, shape: tuple[int, ...] | None = None):
        self.model = model
        self.shape = shape
        self._start = None  # the cache slot of node 0 of the last tree, while it is cached
        self._fed = 0  # nodes of the last tree that are in the cache

    def prefill(self, ids):
        if len(ids):
            self.model.forward(ids, keep=1)

    def propose(self, seq, k, decoding, generator):
        shape = (1,) * k if self.shape is None else self.shape[:k]
        self._start = None
        if not shape:
            return Draft.empty(self.model.device)
        new = torch.tensor(seq[self.model.length :], dtype=torch.long).to(self.model.device, non_blocking=True)
        rows, frontier = self.model.forward(new, keep=1), [-1]  # the root's row
        self._start = self.model.length
        tokens, parents, dists = [], [], []
        for depth, branching in enumerate(shape):
            made = []
            for row, node in zip(rows, frontier):
                path = [tokens[a] for a in tree.ancestry(parents, node)]
                picked, q = self._children(row, path, depth, branching, decoding, generator)
                for token in picked:
                    tokens.append(token.view(1))
                    parents.append(node)
                    dists.append(q)
                    made.append(len(tokens) - 1)
            if depth == len(shape) - 1:
                break
            first, count = made[0], len(made)
            layout = None if tree.is_chain(parents) else tree.layout(parents, first, count, self._start,
                                                                       self.model.device)
            rows = self.model.forward(torch.cat(tokens[first:]), keep=count, tree=layout)
            frontier = made
        self._fed = len(tokens) - len(made)
        q = None if decoding.deterministic else torch.stack(dists)
        return Draft(torch.cat(tokens), q, None if self.shape is None else tuple(parents))

    @staticmethod
    def _children(row, path, depth, branching, decoding, generator):
        """(children [b], q or None) of one node from its row of logits [V]."""
        if decoding.deterministic:
            scores = decoding.scores(row[None], path, start=depth)[0]
            return (scores.argmax(-1, keepdim=True) if branching == 1 else scores.topk(branching).indices), None
        q = decoding.probs(row[None], path, start=depth)[0]
        if branching == 1:
            return sample(q, generator).view(1), q
        return torch.multinomial(q, min(branching, int((q > 0).sum())), replacement=False, generator=generator), q

    def rollback(self, length, path=()):
        if path and self._start is not None:  # keep the accepted nodes that are cached, drop the other branches
            self.model.keep(self._start, [self._start + i for i in path if i < self._fed])
        self._start = None
        self.model.rollback(min(self.model.length, length))


def lookup_draft(seq: Sequence[int], k: int, max_ngram: int = 3) -> list[int]:
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens (n = max_ngram down to 1) in the
    text so far (prompt and output) and propose the up-to-k tokens that followed it; [] if none.

    Example: seq = [5, 6, 7, 8, 5, 6], k = 2 -> the bigram (5, 6) occurred at 0, followed by [7, 8].
    """
    found = lookup_continuations(seq, k, max_ngram, 1)
    return found[0] if found else []


def lookup_continuations(seq: Sequence[int], k: int, max_ngram: int = 3, branches: int = 1) -> list[list[int]]:
    """Up to `branches` different continuations (of up to k tokens) that followed earlier occurrences of the text's
    last n tokens: the longest n first (max_ngram down to 1), the most recent occurrence first within one n.

    Example: seq = [5, 6, 7, 5, 6, 8, 5, 6], k = 1, branches = 2 -> [[8], [7]].
    """
    length = len(seq)
    if k <= 0 or length < 2:
        return []
    seq, found = list(seq), []
    for n in range(min(max_ngram, length - 1), 0, -1):
        tail = seq[length - n :]
        last = tail[-1]
        # `end` indexes the last token of a candidate occurrence; scan from the most recent earlier one backwards.
        for end in range(length - 2, n - 2, -1):
            if seq[end] == last and seq[end - n + 1 : end + 1] == tail:
                follow = seq[end + 1 : end + 1 + k]
                if follow and follow not in found:
                    found.append(follow)
                    if len(found) == branches:
                        return found
    return found


class LookupDrafter:
    """Prompt lookup as a drafter: no model, no state; q is one-hot. With `branches` > 1 it offers several earlier
    continuations as the branches of a tree (their trie)."""

    def __init__(self, device: torch.device | str = "cpu", max_ngram: int = 3, branches: int = 1):
        self.device = torch.device(device)
        self.max_ngram = max_ngram
        self.branches = branches

    def prefill(self, ids):
        pass

    def propose(self, seq, k, decoding, generator):
        if self.branches == 1:
            return Draft(torch.tensor(lookup_draft(seq, k, self.max_ngram), dtype=torch.long, device=self.device))
        tokens, parents = tree.from_paths(lookup_continuations(seq, k, self.max_ngram, self.branches))
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self.device), None, parents)

    def rollback(self, length, path=()):
        pass


def make_drafter(method: str, pair, max_ngram: int = 3, shape: tuple[int, ...] | None = None) -> Drafter:
    """`draft` (the pair's draft model), `lookup` (prompt lookup) or `none` (plain decoding). `shape` (branching per
    depth, spec/tree.py) drafts token trees: the draft model by that shape, prompt lookup with shape[0] branches."""
    if method == "draft":
        if pair.draft is None:
            raise ValueError("method 'draft' needs a pair loaded with its draft model")
        if pair.draft_tokenizer is not None:
            if shape is not None:
                raise ValueError("token trees need a draft of the target's own tokenizer (this one is remapped)")
            return RemappedDrafter(pair.draft, pair.draft_tokenizer, pair.tokenizer, pair.target.vocab)
        return ModelDrafter(pair.draft, shape)
    if method == "lookup":
        return LookupDrafter(pair.target.device, max_ngram, shape[0] if shape else 1)
    if method == "none":
        return NoDrafter(pair.target.device)
    raise ValueError(f"unknown drafting method {method!r}; choose draft, lookup or none")
