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
3 + 6 + 6 = 15 nodes, 3 deep. (1,) * K is the chain.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import NamedTuple

import torch

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


def nodes_of(shape: Sequence[int]) -> int:
    """Nodes of a static shape: (3, 2, 1) -> 3 + 6 + 6 = 15."""
    total, width = 0, 1
    for b in shape:
        width *= b
        total += width
    return total


def widths(shape: Sequence[int]) -> list[int]:
    """Nodes at each depth: (3, 2, 1) -> [3, 6, 6]."""
    out, width = [], 1
    for b in shape:
        width *= b
        out.append(width)
    return out


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
    replacement), or None for a deterministic drafter. `parents` is the tree, None for a chain."""

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    parents: tuple[int, ...] | None = None

    @classmethod
    def empty(cls, device) -> Draft:
        return cls(torch.empty(0, dtype=torch.long, device=device))

    @property
    def chain(self) -> bool:
        return self.parents is None or is_chain(self.parents)


class Layout(NamedTuple):
    """Where the tokens of one forward sit in the tree: RoPE `positions` [n] and `visible` [n, start + first + n]
    (bool: which cache slots each attends)."""

    positions: torch.Tensor
    visible: torch.Tensor


def layout(parents: Sequence[int], first: int, count: int, start: int, device=None) -> Layout:
    """The layout of nodes first .. first+count-1 of a tree whose node i sits at cache slot start + i (nodes before
    `first` are cached already). Each sees slots [0, start) (the true text), its ancestors and itself."""
    depth = depths(parents)
    visible = torch.zeros(count, start + first + count, dtype=torch.bool)
    visible[:, :start] = True
    for row, node in enumerate(range(first, first + count)):
        visible[row, [start + a for a in ancestry(parents, node)]] = True
    positions = torch.tensor([start - 1 + depth[node] for node in range(first, first + count)], dtype=torch.long)
    return Layout(positions.to(device), visible.to(device))


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
