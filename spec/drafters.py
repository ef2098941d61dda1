"""Drafters: where the K guesses come from.

A drafter has three calls. `prefill(ids)` sees the prompt (less its last token) before the first round.
`propose(seq, k, decoding, generator, shape=None)` returns a `Draft`: up to k draft ids in a chain, or a token tree
at most k deep (spec/tree.py), with the distributions they were sampled from, or None when the drafter is
deterministic (one-hot q); `shape`, a tree policy's choice for this round, replaces a draft model's own tree
(spec.policy.TreePolicy; other drafters take none). `decoding` (spec.warps.Decoding) is how the target chooses its
tokens: a draft model warps its rows the same way, position by position along each node's own path (penalties
count it), and in coupled mode takes the same noise's argmax. `rollback(length, path)` tells it that only the first
`length` tokens of the text are true; after a tree, `path` lists the nodes that were accepted (a drafter that
cached its tree keeps those).
"""

from __future__ import annotations

import itertools
import math
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

    def propose(self, seq: Sequence[int], k: int, decoding: Decoding, generator: torch.Generator | None,
                shape: tuple[int, ...] | None = None) -> Draft: ...

    def rollback(self, length: int, path: Sequence[int] = ()) -> None: ...




class NoDrafter:
    """Proposes nothing: every round is one plain decoding step of the target."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def prefill(self, ids):
        pass

    def propose(self, seq, k, decoding, generator, shape=None):
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

    `shape` is the branching per depth (spec/tree.py); None is a chain of k; a `tree.Dynamic` grows the tree from
    the draft's probabilities (below). Children are the top-b of the warped scores when decoding is deterministic
    (greedy, coupled), else b draws without replacement from q. A `shape` passed to `propose` (a tree policy's
    choice for the round) replaces the drafter's own.

    Dynamic trees (EAGLE-2's construction, `tree.Dynamic(budget, width)`). Every node offers its first `width`
    children as candidates, each scored by its path score: the product along its path of its slot's probability,
    the probability of the rank-j token at its parent for the parent's j-th child. Of each depth's new candidates
    the `width` best are fed and expanded in one forward, as long as a child of theirs could still enter the
    `budget` best; after at most K depths the tree is the `budget` best candidates overall, ties going to the
    shallower, then the earlier one. A child's score is at most its parent's (a probability is at most 1) and it is
    deeper, so the best nodes always include every ancestor of theirs: a tree, at most K deep.

    Why the rules stay exact. Greedy and coupled decoding verify by argmax matching (`tree_greedy`), which writes
    the target's text for any tree: there the slot probabilities are the draft's own (softmax of the scores), and
    the j-th child is the draft's rank-j token. Sampling (`tree_accept`) needs, at each node, that the children it
    is given are x_1, x_2, ... in draw order, with x_j ~ q less x_1 .. x_{j-1} given everything the rule has
    seen, and that whether there is a j-th child is decided without looking at x_j (its proof only uses that a
    node with no further child falls back to the same residual as one whose next try fails). So sampled children
    are the first draws of `width` without replacement, and a candidate's score uses its slot's probability (the
    j-th largest of q at its parent), never q(x_j): which candidates are kept then depends on the draft's
    distributions along the ancestors' values and on other branches, but not on the kept token's own value nor on
    anything the target computes. Since slot probabilities decrease with j, a node keeps a prefix of its draws.
    Scoring the sampled x_j by q(x_j), as EAGLE-2 does, would keep likely draws and drop unlikely ones: the
    children given to the rule would no longer follow q, and the output would not follow p.
    """

    def __init__(self, model: Model, shape: tuple[int, ...] | tree.Dynamic | None = None):
        self.model = model
        self.shape = shape
        self._start = None  # the cache slot of node 0 of the last tree, while it is cached
        self._slots: list[int | None] = []  # each node of the last tree: its slot after _start, None if not fed

    def prefill(self, ids):
        if len(ids):
            self.model.forward(ids, keep=1)

    def propose(self, seq, k, decoding, generator, shape=None):
        plan = shape if shape is not None else self.shape
        dynamic = isinstance(plan, tree.Dynamic)
        plan = (1,) * k if plan is None else plan if dynamic else plan[:k]
        depth_limit = k if dynamic else len(plan)
        self._start, self._slots = None, []
        if depth_limit == 0:
            return Draft.empty(self.model.device)
        new = torch.tensor(seq[self.model.length :], dtype=torch.long).to(self.model.device, non_blocking=True)
        rows, frontier = self.model.forward(new, keep=1), [-1]  # the root's row
        self._start, forwards = self.model.length, [len(new)]
        # Candidates, in the order they were made: token [1], parent candidate (-1 = the root), q row, log score.
        tokens, parents, dists, scores = [], [], [], []
        fed, fed_parents, slot_of = [], [], {}  # candidates in the draft's cache in slot order, their tree, slots
        for depth in range(depth_limit):
            made = []
            branching = min(plan.width, plan.budget) if dynamic else plan[depth]
            paths = [[tokens[a] for a in tree.ancestry(parents, node)] for node in frontier]
            qs, counts = [None] * len(frontier), [None] * len(frontier)
            if not decoding.deterministic:  # q of every node first (no randomness used), then one read of how many
                # tokens each can draw without replacement, not one read a node
                qs = [decoding.probs(row[None], path, start=depth)[0] for row, path in zip(rows, paths)]
                if branching > 1:
                    counts = torch.stack([(q > 0).sum() for q in qs]).tolist()
            expanded = [(node, *self._children(row, path, depth, branching, decoding, generator, dynamic, q, count))
                        for row, node, path, q, count in zip(rows, frontier, paths, qs, counts)]
            if dynamic:  # the whole depth's slot probabilities in one device -> host copy, not one per node
                flat = torch.cat([probs for *_, probs in expanded]).tolist()
                cuts = list(itertools.accumulate(len(probs) for *_, probs in expanded))
                expanded = [(node, picked, q, flat[end - len(picked) : end])
                            for (node, picked, q, _), end in zip(expanded, cuts)]
            for node, picked, q, slot_probs in expanded:
                base = scores[node] if node >= 0 else 0.0
                for j, token in enumerate(picked):
                    if dynamic and slot_probs[j] <= 0:
                        break  # a slot of probability 0 scores -inf: never among the best
                    tokens.append(token.view(1))
                    parents.append(node)
                    dists.append(q)
                    scores.append(base + math.log(slot_probs[j]) if dynamic else 0.0)
                    made.append(len(tokens) - 1)
            if depth == depth_limit - 1:
                break
            frontier = self._expand(made, parents, scores, plan) if dynamic else made
            if not frontier:
                break
            first = len(fed)
            for c in frontier:  # their parents are in the cache already (or are the root)
                fed_parents.append(slot_of[parents[c]] if parents[c] >= 0 else -1)
                slot_of[c] = len(fed)
                fed.append(c)
            layout = None if tree.is_chain(fed_parents) else tree.layout(fed_parents, first, len(frontier),
                                                                          self._start, self.model.device)
            rows = self.model.forward(torch.cat([tokens[c] for c in frontier]), keep=len(frontier), tree=layout)
            forwards.append(len(frontier))
        kept = sorted(_best(parents, scores, plan.budget), key=lambda c: (_depth(parents, c), c)) if dynamic \
            else list(range(len(tokens)))
        index = {c: i for i, c in enumerate(kept)}
        self._slots = [slot_of.get(c) for c in kept]
        out_parents = tuple(index[parents[c]] if parents[c] >= 0 else -1 for c in kept)
        q = None if decoding.deterministic else torch.stack([dists[c] for c in kept])
        return Draft(torch.cat([tokens[c] for c in kept]), q, None if tree.is_chain(out_parents) else out_parents,
                     tuple(forwards))

    @staticmethod
    def _expand(made: list[int], parents: list[int], scores: list[float], plan: tree.Dynamic) -> list[int]:
        """The candidates of the newest depth to feed: the `width` best of them whose children could still be among
        the `budget` best candidates (a child ranks below its parent, so a parent ranked budget - 1 or lower, counting
        from 0, is not worth its forward; later candidates only push it down)."""
        rank = {c: r for r, c in enumerate(_ranked(parents, scores))}
        worth = sorted((c for c in made if rank[c] + 1 < plan.budget), key=rank.__getitem__)
        return sorted(worth[: plan.width])

    @staticmethod
    def _children(row, path, depth, branching, decoding, generator, scored=False, q=None, available=None):
        """(children [b], q or None, slot probabilities [b] or None, on the device) of one node from its row of
        logits [V]. The slot probabilities (with `scored`) are the node's b largest probabilities, best first: what
        a dynamic tree scores its children by (see the class docstring for why not q of the drawn token). Sampling:
        `q`, the node's warped distribution, and `available`, how many tokens it gives a probability above 0, if the
        caller has them already (else they are computed here, the second with a device -> host read)."""
        if decoding.deterministic:
            scores = decoding.scores(row[None], path, start=depth)[0]
            picked = scores.argmax(-1, keepdim=True) if branching == 1 else scores.topk(branching).indices
            return picked, None, scores.softmax(-1)[picked] if scored else None
        q = decoding.probs(row[None], path, start=depth)[0] if q is None else q
        if branching == 1:
            picked = sample(q, generator).view(1)
        else:
            available = int((q > 0).sum()) if available is None else available
            picked = torch.multinomial(q, min(branching, available), replacement=False, generator=generator)
        return picked, q, q.topk(len(picked)).values if scored else None

    def rollback(self, length, path=()):
        if path and self._start is not None:  # keep the accepted nodes that are cached, drop the other branches
            cached = itertools.takewhile(lambda s: s is not None, (self._slots[i] for i in path))
            self.model.keep(self._start, [self._start + s for s in cached])
        self._start = None
        self.model.rollback(min(self.model.length, length))


def _depth(parents: list[int], node: int) -> int:
    return len(tree.ancestry(parents, node))


def _ranked(parents: list[int], scores: list[float]) -> list[int]:
    """Candidates best first: by path score, then the shallower, then the earlier. A child always ranks below its
    parent (a score no higher, a depth greater)."""
    return sorted(range(len(scores)), key=lambda c: (-scores[c], _depth(parents, c), c))


def _best(parents: list[int], scores: list[float], budget: int) -> list[int]:
    return _ranked(parents, scores)[:budget]


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

    def propose(self, seq, k, decoding, generator, shape=None):
        if shape is not None:
            raise ValueError("prompt lookup drafts its own trees (branches); it takes no tree shape per round")
        if self.branches == 1:
            return Draft(torch.tensor(lookup_draft(seq, k, self.max_ngram), dtype=torch.long, device=self.device))
        tokens, parents = tree.from_paths(lookup_continuations(seq, k, self.max_ngram, self.branches))
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self.device), None, parents)

    def rollback(self, length, path=()):
        pass


def make_drafter(method: str, pair, max_ngram: int = 3, shape: tuple[int, ...] | tree.Dynamic | None = None) -> Drafter:
    """`draft` (the pair's draft model), `lookup` (prompt lookup) or `none` (plain decoding). `shape` (branching per
    depth, spec/tree.py) drafts token trees: the draft model by that shape, prompt lookup with shape[0] branches;
    a `tree.Dynamic` tree is the draft model's only (prompt lookup has no probabilities to grow it by)."""
    if method == "draft":
        if pair.draft is None:
            raise ValueError("method 'draft' needs a pair loaded with its draft model")
        if pair.draft_tokenizer is not None:
            if shape is not None:
                raise ValueError("token trees need a draft of the target's own tokenizer (this one is remapped)")
            return RemappedDrafter(pair.draft, pair.draft_tokenizer, pair.tokenizer, pair.target.vocab)
        return ModelDrafter(pair.draft, shape)
    if method == "lookup":
        if isinstance(shape, tree.Dynamic):
            raise ValueError("a dynamic tree needs the draft model's probabilities: prompt lookup takes --tree B "
                             "(B earlier matches as branches)")
        return LookupDrafter(pair.target.device, max_ngram, shape[0] if shape else 1)
    if method == "none":
        return NoDrafter(pair.target.device)
    raise ValueError(f"unknown drafting method {method!r}; choose draft, lookup or none")
