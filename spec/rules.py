"""The accept/reject rules of speculative decoding, as pure tensor functions.

Names follow Leviathan et al. (2023) and Chen et al. (2023): `p` is the target's next-token distribution, `q` the
draft's, `d` the drafted tokens. In one round the draft proposed K tokens; the target scored K + 1 positions:

- an **accepted** token is a draft token the rule keeps;
- the **fix** token replaces the first rejected draft token (sampled from the residual max(0, p - q), normalised);
- the **bonus** token follows when all K drafts are accepted (sampled from p at position K + 1).

Every round therefore emits n_accepted + 1 tokens. Nothing here touches a model; randomness comes only from the
`torch.Generator` passed in. Every function takes a leading batch dimension B so that tests can draw 10^5
independent rounds in one call; the decoding loop uses B = 1.
"""

from __future__ import annotations

import torch

from spec.tree import children


def greedy_rule(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep drafts while each equals the target's argmax; then emit the argmax (the fix, or the bonus).

    target_logits: [B, K+1, V]   drafts: [B, K] (int64)   ->   n_accepted [B], next_token [B]

    Example: argmax rows (7, 3, 9), drafts (7, 4) -> n_accepted 1, next 3. Drafts (7, 3) -> n_accepted 2, next 9
    (the bonus).
    """
    best = target_logits.argmax(-1)  # [B, K+1]
    if drafts.shape[1] == 0:  # plain decoding: nothing to compare
        return torch.zeros_like(best[:, 0]), best[:, 0]
    agree = best[:, : drafts.shape[1]] == drafts  # [B, K]
    n_accepted = agree.long().cumprod(-1).sum(-1)  # length of the agreeing prefix
    return n_accepted, best.gather(1, n_accepted[:, None]).squeeze(1)


def accept_or_fix(
    p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stochastic rule: keep d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample the
    fix from max(0, p_i - q_i) normalised; if all K are accepted, sample the bonus from p_{K+1}.

    p: [B, K+1, V] target probabilities   q: [B, K, V] draft probabilities, or None for a one-hot drafter
    drafts: [B, K] (int64)                ->   n_accepted [B], next_token [B]

    q must be the distribution the draft tokens were really sampled from. With q = None (prompt lookup, any
    deterministic drafter) q is one-hot at d_i: keep with probability p_i(d_i), and the residual is p_i with d_i
    removed. Why the output is exactly p: P(emit x) = min(p(x), q(x)) + (1 - sum_y min(p(y), q(y))) *
    max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y)) = min(p, q) + max(0, p - q) = p(x), since both sums equal 1 - alpha.
    """
    batch, k = drafts.shape
    p_next = p[:, :k]  # [B, K, V]
    p_d = p_next.gather(-1, drafts[..., None]).squeeze(-1)  # [B, K]
    if q is None:
        q_d = torch.ones_like(p_d)
        residual = p_next.scatter(-1, drafts[..., None], 0.0)
    else:
        q_d = q.gather(-1, drafts[..., None]).squeeze(-1)
        residual = (p_next - q).clamp_min(0.0)
    u = torch.rand(batch, k, generator=generator, device=p.device)
    keep = u * q_d < p_d  # probability min(1, p/q)
    n_accepted = keep.long().cumprod(-1).sum(-1)  # [B]
    rows = torch.cat([residual, p[:, k:]], dim=1)  # [B, K+1, V]: residual at each rejection point, then p for bonus
    chosen = rows[torch.arange(batch, device=p.device), n_accepted]  # [B, V]
    # A rejection implies p(d) < q(d), so some other token has p > q and the residual has mass; only rounding can
    # empty it, and then the residual's direction is p itself.
    empty = chosen.sum(-1, keepdim=True) <= 0
    chosen = torch.where(empty, p[torch.arange(batch, device=p.device), n_accepted], chosen)
    return n_accepted, torch.multinomial(chosen, 1, generator=generator).squeeze(1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probs [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


# ---- Token trees (spec/tree.py): several children per node -------------------------------------------------
#
# p / scores rows: row 0 is the target's distribution at the root (after the true text), row 1 + i at node i (after
# the text and node i's path). Tokens [n] and parents (spec.tree) describe the tree; these rules return the accepted
# path (node indices, root's child first) and the next token. They loop over the path on the host: a tree is at
# most 64 nodes, and the loop keeps the batched chain rules above for chains.


def tree_greedy(scores: torch.Tensor, tokens: torch.Tensor, parents: tuple[int, ...]) -> tuple[list[int], int]:
    """Descend while the target's argmax at the node is one of its children; emit the argmax at the first node
    where it is not (the fix), or at the leaf reached (the bonus).

    scores: [n+1, V]   tokens: [n]   ->   (path, next_token)

    Why this is plain greedy decoding: the row of an accepted node saw exactly the text up to it (the tree mask
    hides every other branch), so each emitted token is the target's argmax after the true text before it. On a
    chain it is `greedy_rule`.
    """
    best, ids = scores.argmax(-1).tolist(), tokens.tolist()  # the round's one device -> host sync
    kids = children(parents)
    path, node = [], -1
    while True:
        child = next((c for c in kids[node] if ids[c] == best[node + 1]), None)
        if child is None:
            return path, best[node + 1]
        path.append(child)
        node = child


def tree_accept(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor, parents: tuple[int, ...],
                generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Recursive rejection over each node's children (SpecInfer's multi-step speculative sampling, with the
    without-replacement proposals of recursive speculative decoding).

    p: [n+1, V] target probabilities   q: [n, V] (row i: the distribution node i was drawn from) or None
    tokens: [n]   ->   (path, next_token)

    How children must have been drawn: at each node, in node order x_1, x_2, ..., x_m, x_j from
    q_j = q with x_1 .. x_{j-1} removed, renormalised (sampling without replacement; one child is a plain draw from
    q), where q is the draft's distribution at that node (row i of `q` for each child i); or, with q None, chosen
    deterministically (top-b, prompt lookup): q_j is one-hot at x_j.

    The rule at a node: r_1 = p; for j = 1 .. m keep x_j with probability min(1, r_j(x_j) / q_j(x_j)) and descend
    into it; else r_{j+1} = max(0, r_j - q_j) normalised. If no child is kept, emit a token drawn from r_{m+1}; at a
    leaf (no children), from p.

    Why the emitted token has law p: given everything drawn before trial j, x_j ~ q_j, and by induction from
    j = m + 1 down, what trial j + 1 onward emits has law r_{j+1}, which depends on that history only, not on x_j.
    So P(emit y) = min(q_j(y), r_j(y)) + (1 - sum_x min(q_j(x), r_j(x))) * r_{j+1}(y) = r_j(y), the identity of
    `accept_or_fix` (both sums equal 1 - alpha), and at j = 1 it is p. Nothing a node emits depends on how its
    children's own children were drawn: they were drawn from the draft at the child, independently of this node's
    coins. So the next node sees the same situation with its own target row, and by the chain rule the text has
    the target's law. Duplicates never occur: siblings are distinct, and a rejected x_j has r_{j+1}(x_j) = 0.

    Acceptance: with deterministic children a node is left by a child with probability sum_j p(x_j), exactly the
    simple exact rule "draw y from p, descend if y is a child"; with one sampled child it is sum min(p, q) >=
    sum p q, the simple rule's; for several sampled children tests/test_tree.py compares the two exactly.

    On a chain this is `accept_or_fix`, draw for draw: one uniform per node (drawn together, as there), the same
    comparisons, and the same multinomial over the same unnormalised residual.
    """
    n = len(parents)
    u = torch.rand(1, n, generator=generator, device=p.device)[0]
    ids = tokens.tolist()
    kids = children(parents)
    path, node = [], -1
    while True:
        r = p[node + 1]
        tried: list[int] = []
        kept = None
        for c in kids[node]:
            x = ids[c]
            if q is None:
                q_c = None
            else:
                q_c = q[c]
                if tried:  # drawn without the siblings before it
                    q_c = q_c.index_fill(0, torch.tensor(tried, device=q_c.device), 0.0)
                    q_c = q_c / q_c.sum()
            if tried:
                mass = r.sum()
                r = r / mass if mass > 0 else p[node + 1].index_fill(0, torch.tensor(tried, device=r.device), 0.0)
            # in the tensors' own precision, as accept_or_fix compares
            if bool((u[c] if q_c is None else u[c] * q_c[x]) < r[x]):
                kept = c
                break
            r = r.index_fill(0, torch.tensor([x], device=r.device), 0.0) if q_c is None else (r - q_c).clamp_min(0.0)
            tried.append(x)
        if kept is None:
            if r.sum() <= 0:  # only rounding can empty the residual: its direction is then p itself
                r = p[node + 1]
            return path, int(torch.multinomial(r[None], 1, generator=generator))
        path.append(kept)
        node = kept

