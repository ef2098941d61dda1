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

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How a next token is chosen from logits. temperature 0 means greedy (argmax); top_k 0 and top_p 1 are off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (self.temperature >= 0 and self.temperature != float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Logits [..., V] -> probabilities [..., V] (fp32) after temperature, then top-k, then top-p.

    Applied identically to target and draft logits: speculation reproduces whatever p it is given, so p and q must
    be warped the same way. top-p keeps the smallest set of most likely tokens whose mass reaches top_p.
    """
    if sampling.greedy:
        raise ValueError("greedy decoding has no distribution to warp; use greedy_rule")
    logits = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= sampling.top_p  # never drops the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


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
