"""How a next token is chosen from logits: one pipeline, applied identically to the target's rows and the draft's.

The order is vLLM's:

1. logit_bias (token id -> added to its logit);
2. penalties: repetition (a token already in the prompt or the output has its logit divided by r if positive,
   multiplied by r if not), frequency (minus f x its count in the output), presence (minus p if it is in the output);
3. greedy decoding takes the argmax here; sampling goes on:
4. temperature, 5. min_p (drop tokens whose probability is below min_p x the most likely one's), 6. top_k, 7. top_p.

Speculation reproduces whatever distribution p it is given, provided q is warped the same way *at each position*:
the penalties at draft position i count the tokens of the text so far plus the drafts d_1 .. d_{i-1} before it,
not the text alone (`TokenCounts.rows`). `Decoding` carries what a warp needs beyond the logits: the counts, the
output position, and for the coupled mode its noise.

Coupled mode (Gumbel-max coupling): the token at output position t is argmax_x(log p_t(x) + g_t(x)), with g_t
standard Gumbel noise drawn from a generator keyed by (seed, t) alone. That is an exact draw from p_t, and since the
draft proposes argmax(log q_t + g_t) with the same g_t and the target keeps its own argmax, the text is the same
with speculation or without, for any drafter and any K.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields

import torch

from spec.tree import ancestry

PENALTY_RANGE = 2.0  # OpenAI's bounds for presence and frequency penalties
BIAS_RANGE = 100.0  # and for logit_bias values


@dataclass(frozen=True)
class Sampling:
    """How a next token is chosen. temperature 0 is greedy (argmax of the biased, penalised logits); top_k 0,
    top_p 1, min_p 0, penalties 0 (repetition 1) and no logit_bias are off. `coupled` draws each position's
    randomness from (seed, position) alone (see the module docstring)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    coupled: bool = False

    def __post_init__(self):
        if not (self.temperature >= 0 and self.temperature != float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_RANGE <= getattr(self, name) <= PENALTY_RANGE:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (0 < self.repetition_penalty < float("inf")):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if token < 0 or not -BIAS_RANGE <= bias <= BIAS_RANGE:
                raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {token}: {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        """The settings that differ from the defaults, e.g. "temperature=0.7 top_p=0.9 coupled"."""
        changed = [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) != f.default]
        return " ".join(name if value is True else f"{name}={value}" for name, value in changed) or "greedy"

    @property
    def penalised(self) -> bool:
        """Whether the logits are adjusted before choosing: a bias or a penalty is on."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 or \
            self.repetition_penalty != 1


def adjust(logits: torch.Tensor, sampling: Sampling, counts: torch.Tensor | None = None,
           seen: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 1-2: logit_bias, then the penalties.   logits [R, V] (fp32), counts [R, V] (the output's token counts
    for each row's position), seen [R, V] bool (in the prompt or the output) -> [R, V]. Without bias or penalties the
    logits come back unchanged."""
    if not sampling.penalised:
        return logits
    logits = logits.float()
    if sampling.logit_bias:
        top = max(t for t, _ in sampling.logit_bias)
        if top >= logits.shape[-1]:
            raise ValueError(f"logit_bias names token {top}, outside the vocabulary of {logits.shape[-1]}")
        ids, bias = _bias_tensors(sampling.logit_bias, logits.device)
        logits = logits.index_add(-1, ids, bias.expand(*logits.shape[:-1], -1))
    if counts is None or seen is None:
        if sampling.presence_penalty or sampling.frequency_penalty or sampling.repetition_penalty != 1:
            raise ValueError("penalties need the token counts of the text (a TokenCounts)")
        return logits
    if sampling.repetition_penalty != 1:
        r = sampling.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if sampling.frequency_penalty:
        logits = logits - sampling.frequency_penalty * counts
    if sampling.presence_penalty:
        logits = logits - sampling.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


@functools.lru_cache(maxsize=64)
def _bias_tensors(logit_bias: tuple[tuple[int, float], ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, biases) on the device, made once per request's bias rather than at every row of every round."""
    ids = torch.tensor([t for t, _ in logit_bias], dtype=torch.long, device=device)
    return ids, torch.tensor([b for _, b in logit_bias], dtype=torch.float32, device=device)


def warp(logits: torch.Tensor, sampling: Sampling, counts: torch.Tensor | None = None,
         seen: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [..., V] -> probabilities [..., V] (fp32) through the whole pipeline (steps 1, 2, 4-7).

    top-p keeps the smallest set of most likely tokens whose mass reaches top_p; min_p and top-k never drop the most
    likely token."""
    if sampling.greedy:
        raise ValueError("greedy decoding has no distribution to warp; take the argmax of `adjust`")
    logits = adjust(logits, sampling, counts, seen).float() / sampling.temperature
    if sampling.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < sampling.min_p * probs.amax(-1, keepdim=True), float("-inf"))
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


class TokenCounts:
    """The text so far, as the penalties see it: which tokens the prompt holds, and how often each token occurs in
    the output. `rows(path, start, n)` gives the counts at n consecutive positions along a drafted path."""

    def __init__(self, prompt: list[int], vocab: int, device: torch.device | str):
        self.vocab = vocab
        self.device = torch.device(device)
        self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=self.device)
        ids = torch.tensor([t for t in prompt if 0 <= t < vocab], dtype=torch.long, device=self.device)
        self.in_prompt[ids] = True
        self.output = torch.zeros(vocab, dtype=torch.float32, device=self.device)

    def add(self, tokens: list[int] | torch.Tensor) -> None:
        """Tokens the output gained (a round's emitted tokens)."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).view(-1)
        self.output.index_add_(0, ids, torch.ones(len(ids), device=self.device))

    def rows(self, path: torch.Tensor, start: int = 0, n: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts [n, V], seen [n, V]) at positions start .. start+n-1 after the text: row i also counts
        path[:start + i], the drafts before it."""
        if isinstance(path, list):
            path = torch.cat(path) if path else torch.empty(0, dtype=torch.long, device=self.device)
        path = path.to(device=self.device, dtype=torch.long).view(-1)[: start + n - 1]
        before = torch.zeros(start + n, self.vocab, device=self.device)
        if len(path):
            before[1 : len(path) + 1] = torch.nn.functional.one_hot(path, self.vocab).float().cumsum(0)
        counts = self.output + before[start : start + n]  # [n, V]
        return counts, self.in_prompt | (counts > 0)


def _position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for output position `position` of a coupled generation seeded with `seed`."""
    mixed = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    mixed ^= mixed >> 31
    return mixed & (2**63 - 1)


@dataclass
class GumbelNoise:
    """Standard Gumbel noise g_t [V] for each output position t, from (seed, t) alone: the same for the draft and
    the target, with speculation or without. Drawn on the CPU in float64 (so identical on every device), cached
    for the positions in use."""

    seed: int
    vocab: int
    device: torch.device
    cache: dict[int, torch.Tensor] = field(default_factory=dict)

    def rows(self, start: int, n: int) -> torch.Tensor:
        """[n, V] fp32 on the device: positions start .. start+n-1."""
        for position in range(start, start + n):
            if position not in self.cache:
                u = torch.rand(self.vocab, generator=torch.Generator().manual_seed(_position_seed(self.seed, position)),
                               dtype=torch.float64).clamp_min(1e-300)
                self.cache[position] = (-torch.log(-torch.log(u))).float().to(self.device)
        for old in [p for p in self.cache if p < start - 64]:  # positions long accepted: never asked again
            del self.cache[old]
        return torch.stack([self.cache[p] for p in range(start, start + n)])


@dataclass
class Decoding:
    """What choosing a token needs beyond the logits: the sampling settings, the text's token counts (when a
    penalty is on), the coupled mode's noise, and `emitted`, the output position of the next token."""

    sampling: Sampling
    counts: TokenCounts | None = None
    noise: GumbelNoise | None = None
    emitted: int = 0

    @classmethod
    def start(cls, sampling: Sampling, prompt: list[int], vocab: int, device, seed: int | None = None) -> Decoding:
        counts = TokenCounts(prompt, vocab, device) if sampling.penalised else None
        if sampling.coupled and not sampling.greedy:
            if seed is None:
                raise ValueError("coupled sampling needs a seed: its randomness is keyed by (seed, position)")
            return cls(sampling, counts, GumbelNoise(seed, vocab, torch.device(device)))
        return cls(sampling, counts)

    def _counts(self, path, start: int, n: int):
        return self.counts.rows(path, start, n) if self.counts is not None else (None, None)

    def probs(self, logits: torch.Tensor, path: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Warped probabilities [R, V] of rows at positions start .. start+R-1 along `path` (row i follows
        path[:start + i])."""
        return warp(logits, self.sampling, *self._counts(path, start, logits.shape[0]))

    def scores(self, logits: torch.Tensor, path: torch.Tensor, start: int = 0) -> torch.Tensor:
        """What the argmax is taken over [R, V]: the biased, penalised logits (greedy), or log p + g_t (coupled)."""
        if self.sampling.greedy:
            return adjust(logits.float(), self.sampling, *self._counts(path, start, logits.shape[0]))
        log_p = self.probs(logits, path, start).log()
        return log_p + self.noise.rows(self.emitted + start, logits.shape[0])

    def tree_rows(self, logits: torch.Tensor, tokens: torch.Tensor, parents: tuple[int, ...],
                  scores: bool = False) -> torch.Tensor:
        """The rows of a token tree's verify forward [n+1, V] as `scores` (or, by default, `probs`): row 0 at the
        root, row 1 + i after node i's path, each along its own path (spec/tree.py)."""
        choose = self.scores if scores else self.probs
        if self.counts is None and self.noise is None:  # no row depends on its path
            return choose(logits, tokens[:0])
        rows = []
        for row in range(len(parents) + 1):
            path = tokens[ancestry(parents, row - 1)]
            rows.append(choose(logits[row : row + 1], path, start=len(path)))
        return torch.cat(rows)

    @property
    def deterministic(self) -> bool:
        """The token is an argmax (greedy or coupled), so drafts carry no q and the rule is argmax matching."""
        return self.sampling.greedy or self.noise is not None

    def advance(self, tokens: list[int]) -> None:
        """The output gained `tokens`."""
        if self.counts is not None and tokens:
            self.counts.add(tokens)
        self.emitted += len(tokens)
