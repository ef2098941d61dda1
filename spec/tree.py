"""Token trees: several drafted continuations checked in one target forward.

A round's drafts form a tree. Its nodes are numbered in breadth-first order (every parent before its children, the
nodes of one depth together) and described by `parents`: parents[i] is the node whose child node i is, or -1 when
node i continues the text itself (the root is the last true token, which the round feeds first). A chain of K
drafts is the tree (-1, 0, 1, ..., K - 2). Siblings carry distinct tokens.

A model reads a tree in one forward over a region of its cache: node i sits at cache slot `start + i` (the slots
after the true text), its RoPE position is the text's next position plus its depth less one, and it attends to the
true text, its ancestors and itself (`layout`). After the round only the nodes on the accepted path are kept; the
models move their entries to contiguous slots (`Model.keep`). This module is pure bookkeeping: no model, no
randomness.

A static shape gives the branching per depth: (3, 2, 1) gives the root 3 children, each of them 2, each of those 1:
3 + 6 + 6 = 15 nodes, 3 deep. (1,) * K is the chain. A `Dynamic` tree (EAGLE-2's) is grown from the draft's
probabilities under a node budget instead (spec/drafters.py), and `Auto` lets a policy choose a static shape each
round from measurements (spec/policy.py, `TreePolicy`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from spec.models.kernels import tree_mask

MAX_NODES = 64  # the most nodes a tree may have (the verify forward scores nodes + 1 rows)


class TreeError(ValueError, argparse.ArgumentTypeError):
    """A bad tree shape. A ValueError for library callers; argparse prints it when `parse_shape` is a `type`."""


def parse_shape(text: str) -> tuple[int, ...]:
    """"3,2,1" -> (3, 2, 1): the branching at each depth. "chain" or "1" -> (1,) (a chain; its length is K)."""
    text = text.strip().lower()
    if text == "chain":
        return (1,)
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise TreeError(f"a tree shape is whole numbers >= 1 separated by commas (branching per depth), got {text!r}")
    shape = tuple(int(p) for p in parts)
    if nodes_of(shape) > MAX_NODES:
        raise TreeError(f"the shape {text!r} has {nodes_of(shape)} nodes; at most {MAX_NODES} fit one verify forward")
    return shape


@dataclass(frozen=True)
class Dynamic:
    """A dynamic tree: at most `budget` nodes and K deep, the nodes of the highest path score (the product of the
    draft's probabilities along the path); each draft forward expands at most `width` nodes, each offering at most
    `width` children. `ModelDrafter` says how it is grown and why the rules stay exact for it."""

    budget: int
    width: int


@dataclass(frozen=True)
class Auto:
    """A static shape of at most `max_nodes` nodes chosen each round by `spec.policy.TreePolicy`."""

    max_nodes: int = 16


# Not tuples, so that `isinstance(setting, tuple)` means a static shape.
DEFAULT_WIDTH = 4  # a dynamic tree's width when not given: a draft forward over 4 nodes costs about one over 1


def parse_tree(text: str) -> tuple[int, ...] | Dynamic | Auto:
    """A --tree setting: "3,2,1" (a static shape, `parse_shape`); "dynamic:16" (a dynamic tree of at most 16 nodes,
    width min(4, 16)) or "dynamic:16:2" (width 2); "auto" (a policy picks a static shape of at most 16 nodes each
    round) or "auto:32" (at most 32)."""
    text = text.strip().lower()
    kind, _, rest = text.partition(":")
    if kind == "dynamic":
        parts = rest.split(":") if rest else []
        if not 1 <= len(parts) <= 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise TreeError(f"a dynamic tree is 'dynamic:BUDGET' or 'dynamic:BUDGET:WIDTH' (whole numbers >= 1), "
                            f"got {text!r}")
        budget = int(parts[0])
        if budget > MAX_NODES:
            raise TreeError(f"a dynamic tree of {budget} nodes: at most {MAX_NODES} fit one verify forward")
        return Dynamic(budget, int(parts[1]) if len(parts) == 2 else min(DEFAULT_WIDTH, budget))
    if kind == "auto":
        if rest and not (rest.isdigit() and 1 <= int(rest) <= MAX_NODES):
            raise TreeError(f"'auto:N' needs a whole number N in 1..{MAX_NODES} (the most nodes), got {text!r}")
        return Auto(int(rest) if rest else Auto().max_nodes)
    return parse_shape(text)


def describe(spec) -> str:
    """How a tree setting prints: "3,2,1", "dynamic:16:4", "auto:16"."""
    if isinstance(spec, Dynamic):
        return f"dynamic:{spec.budget}:{spec.width}"
    if isinstance(spec, Auto):
        return f"auto:{spec.max_nodes}"
    return ",".join(map(str, spec))


def nodes_of(shape: Sequence[int]) -> int:
    """Nodes of a static shape: (3, 2, 1) -> 3 + 6 + 6 = 15."""
    total, width = 0, 1
    for b in shape:
        width *= b
        total += width
    return total


def most_nodes(setting) -> int:
    """The most nodes a round of this setting drafts: a static shape's nodes, a dynamic tree's budget, the tree
    policy's `max_nodes`; 0 for chains (None). What the graph backend prepares tree forwards for."""
    if setting is None:
        return 0
    if isinstance(setting, tuple):
        return nodes_of(setting)
    return getattr(setting, "budget", None) or getattr(setting, "max_nodes", 0)


def widths(shape: Sequence[int]) -> list[int]:
    """Nodes at each depth: (3, 2, 1) -> [3, 6, 6]."""
    out, width = [], 1
    for b in shape:
        width *= b
        out.append(width)
    return out


def branches(shape: Sequence[int]) -> bool:
    """Whether a static shape has a node of two or more children: a tree, not a chain (K = len(shape))."""
    return any(b > 1 for b in shape)


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def chain(n: int) -> tuple[int, ...]:
    return tuple(range(-1, n - 1))


def children(parents: Sequence[int]) -> dict[int, list[int]]:
    """node (-1 = the root) -> its children, in node order (the order they were drawn)."""
    kids: dict[int, list[int]] = {-1: []}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
        kids.setdefault(i, [])
    return kids


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node: 1 for a child of the root."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def visits(parents: Sequence[int], path: Sequence[int]) -> list[tuple[int, int]]:
    """What the rule saw at each node it visited (the root, then each accepted node): (slot, offered), where
    offered is the number of the node's children and slot the position (0 = drafted first) of the child the rule
    descended into, or offered when it left by none. A leaf reached (no children) adds nothing: nothing was offered.

    Example: parents (-1, -1, 0, 0), path [1] -> [(1, 2)]: the root's second child, a leaf; path [0] ->
    [(0, 2), (2, 2)]: the root's first child, then neither of that node's 2 children."""
    kids = children(parents)
    out, node = [], -1
    for child in path:
        out.append((kids[node].index(child), len(kids[node])))
        node = child
    if kids[node]:
        out.append((len(kids[node]), len(kids[node])))
    return out


def ancestry(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node`, inclusive ([] for the root, -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def with_prefix(parents: Sequence[int], prefix: int) -> tuple[int, ...]:
    """The tree as seen with `prefix` true tokens fed before it in the same forward (the target's uncached text):
    a chain of `prefix` nodes whose last is the tree's root."""
    return chain(prefix) + tuple(prefix - 1 if p < 0 else prefix + p for p in parents)


class Draft(NamedTuple):
    """One round's proposal. `tokens` [n] (int64, on the target's device). `q` [n, V]: row i is the distribution
    node i was drawn from (siblings share their parent's row and were drawn from it in node order, without
    replacement), or None for a deterministic drafter. `parents` is the tree, None for a chain. `forwards`: how many
    tokens each draft forward read (the catch-up first, then each fed depth), for policies that time them."""

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    parents: tuple[int, ...] | None = None
    forwards: tuple[int, ...] = ()  # tokens each of the drafter's forwards read this round (a draft model's)

    @classmethod
    def empty(cls, device) -> Draft:
        return cls(torch.empty(0, dtype=torch.long, device=device))

    @property
    def chain(self) -> bool:
        return self.parents is None or is_chain(self.parents)


class Layout:
    """Where the tokens of one forward sit in the tree: nodes first .. first+count-1 of a tree whose node i sits at
    cache slot start + i (nodes before `first` are cached already); each sees slots [0, start) (the true text), its
    ancestors and itself.

    - `positions` [count]: each token's RoPE position (start - 1 + its depth);
    - `window` [1 + count] (int64): the mask as the graph backend's kernels read it, made on the host
      (`window_bits`): the first slot of the last TREE_WINDOW (64), then for each token a bit per slot from there
      (slot base + j is bit j; bit 63 is the sign bit); None where a token hides a slot before that window;
    - `visible` [count, start + first + count] (bool): the same mask as a matrix, for the eager backend's attention
      mask; built when first read (about 130 µs of Python for 17 tokens, which the graph backend never needs);
    - `shape`: visible's shape, without building it.

    Device tensors are copied without blocking, like the loop's token ids: a blocking copy to a GPU first waits
    for everything queued there, and a tree round builds a layout for each draft depth and for the verify, so the
    CPU stopped running ahead of the GPU that many times a round (the graph backend's tree rounds on an H200 cost
    about 1 ms more than their forwards, session 14). From pageable memory the copy is staged at once and waits for
    nothing."""

    def __init__(self, parents: Sequence[int], first: int, count: int, start: int, device=None):
        self.parents, self.first, self.count, self.start, self.device = tuple(parents), first, count, start, device
        depth = depths(parents)
        positions = [start - 1 + depth[node] for node in range(first, first + count)]
        self.positions = torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True)
        bits = window_bits(parents, first, count, start)
        self.window = None if bits is None else torch.tensor(bits, dtype=torch.long).to(device, non_blocking=True)
        self.shape = (count, start + first + count)
        self._visible = None

    @property
    def visible(self) -> torch.Tensor:
        if self._visible is None:
            visible = torch.zeros(self.shape, dtype=torch.bool)
            visible[:, : self.start] = True
            for row, node in enumerate(range(self.first, self.first + self.count)):
                visible[row, [self.start + a for a in ancestry(self.parents, node)]] = True
            self._visible = visible.to(self.device, non_blocking=True)
        return self._visible


def layout(parents: Sequence[int], first: int, count: int, start: int, device=None) -> Layout:
    """The `Layout` of nodes first .. first+count-1 of a tree whose node i sits at cache slot start + i."""
    return Layout(parents, first, count, start, device)


def window_bits(parents: Sequence[int], first: int, count: int, start: int) -> list[int] | None:
    """`Layout.window` of nodes first .. first+count-1 (as `Layout` places them), made on the host
    (spec.models.kernels.tree_mask): the graph backend loads a tree's mask with one copy."""
    seen = [[start + a for a in ancestry(parents, node)] for node in range(first, first + count)]
    return tree_mask(seen, start, start + first + count)


def from_paths(paths: Sequence[Sequence[int]]) -> tuple[list[int], tuple[int, ...]]:
    """The trie of several token sequences, numbered breadth-first: (tokens, parents). Shared prefixes become one
    branch; siblings are distinct and keep the order in which `paths` first reach them.

    Example: [[5, 6], [5, 7], [8]] -> tokens [5, 8, 6, 7], parents (-1, -1, 0, 0)."""
    trie: dict[tuple[int, ...], None] = {}  # every prefix, in first-seen order
    for path in paths:
        for end in range(1, len(path) + 1):
            trie.setdefault(tuple(path[:end]), None)
    ordered = sorted(trie, key=len)  # stable: breadth-first, first-seen order within a depth
    index = {prefix: i for i, prefix in enumerate(ordered)}
    tokens = [prefix[-1] for prefix in ordered]
    parents = tuple(index[prefix[:-1]] if len(prefix) > 1 else -1 for prefix in ordered)
    return tokens, parents
