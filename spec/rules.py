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
