"""A draft model from another family: its own tokenizer, its own (possibly larger) vocabulary.

Speculation compares draft and target token by token, so a foreign draft has to be translated both ways:

- in: the true text (target ids) is decoded and re-encoded with the draft's tokenizer; the draft's cache keeps the
  longest prefix it shares with that re-encoding, and is fed the rest;
- out: each draft id is mapped to the target id with exactly the same bytes. A draft token with no such twin (a
  merge the target's vocabulary lacks, a special token of the other family) ends the proposal there, so an id the
  target has never heard of — e.g. one beyond its vocabulary, the crash this module exists to prevent — never
  reaches it;
- q: the draft's distribution is folded onto the target vocabulary (the mass of draft ids with the same twin
  added up) and renormalised over mappable ids. That is exactly the law of the proposed target id given that the
  proposal went on, which is what the rule needs for the output to stay exactly the target's.

Correctness therefore holds whatever the draft proposes; only acceptance (and speed) suffers, which is the point
of the Break-It experiment.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import replace

import torch

from spec.models import Model
from spec.rules import sample
from spec.tree import Draft
from spec.warps import warp

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_table() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table, as used by byte-level BPE vocabularies (Qwen, Llama 3)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {ch: b for b, ch in chars.items()}


def is_byte_level(tokenizer) -> bool:
    """True when the tokenizer's decoder is byte-level BPE (vocabulary entries spell bytes as characters)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return False
    # The decoder's own JSON (what pickling uses); the whole tokenizer's JSON would serialise the vocabulary too.
    config = json.loads(decoder.__getstate__())
    parts = config.get("decoders", [config])
    return any(part.get("type") == "ByteLevel" for part in parts)


def token_keys(tokenizer, size: int) -> list[bytes | tuple | None]:
    """What each id [0, size) stands for: its bytes, ("special", text) for special tokens, None if unknown.

    Byte-level vocabularies spell bytes as printable characters; SentencePiece vocabularies (Gemma, Llama 2) use
    "▁" for a space and "<0xNN>" for a raw byte; added tokens that are not special (Gemma's "\n", "\n\n", ...)
    are their text. Two tokens of different families with the same key mean the same text.
    """
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    added = {int(i): token for i, token in tokenizer.added_tokens_decoder.items()}
    special = set(tokenizer.all_special_ids) | {i for i, token in added.items() if token.special}
    table = byte_level_table() if is_byte_level(tokenizer) else None
    keys: list[bytes | tuple | None] = []
    for i, piece in enumerate(pieces):
        if piece is None:
            keys.append(None)
        elif i in special:
            keys.append(("special", piece))
        elif i in added:
            keys.append(added[i].content.encode())
        elif table is not None:
            keys.append(bytes(table[c] for c in piece) if all(c in table for c in piece) else None)
        elif match := _BYTE_PIECE.fullmatch(piece):
            keys.append(bytes([int(match.group(1), 16)]))
        else:
            keys.append(piece.replace("▁", " ").encode())
    return keys


def token_map(draft_tokenizer, target_tokenizer, draft_vocab: int, target_vocab: int) -> torch.Tensor:
    """For each draft id [draft_vocab] the target id with the same key (the lowest, if several), or -1."""
    twins: dict = {}
    for i, key in enumerate(token_keys(target_tokenizer, target_vocab)):
        if key is not None and key != b"":
            twins.setdefault(key, i)
    return torch.tensor([twins.get(key, -1) for key in token_keys(draft_tokenizer, draft_vocab)], dtype=torch.long)


def reencode(seq: Sequence[int], target_tokenizer, draft_tokenizer) -> list[int]:
    """The true text [target ids] re-encoded as draft ids (with the draft tokenizer's own BOS, if it adds one)."""
    text = target_tokenizer.decode(list(seq), skip_special_tokens=False)
    return draft_tokenizer(text).input_ids


class RemappedDrafter:
    """A drafter around a draft model of another family (see the module docstring for the translation)."""

    def __init__(self, draft: Model, draft_tokenizer, target_tokenizer, target_vocab: int):
        self.model = draft
        self.draft_tokenizer = draft_tokenizer
        self.target_tokenizer = target_tokenizer
        self.target_vocab = target_vocab
        self.to_target = token_map(draft_tokenizer, target_tokenizer, draft.vocab, target_vocab).to(draft.device)
        mappable = self.to_target >= 0  # [draft vocab]
        if not bool(mappable.any()):
            raise ValueError("no token of the draft's vocabulary has the same bytes as a token of the target's")
        self.coverage = float(mappable.float().mean())  # share of the draft's vocabulary with a twin in the target's
        self._from = mappable.nonzero().squeeze(1)  # draft ids that have a twin
        self._to = self.to_target[self._from]  # ... and their twins
        self.cached: list[int] = []  # the draft ids in the draft model's cache

    def express(self, seq: Sequence[int]) -> list[int]:
        return reencode(seq, self.target_tokenizer, self.draft_tokenizer)

    def _catch_up(self, ids: list[int]) -> list[int]:
        """Roll the draft cache back to what it shares with `ids` (keeping at least one id to feed); return the
        ids still to feed."""
        common = 0
        for a, b in zip(self.cached, ids):
            if a != b:
                break
            common += 1
        common = max(0, min(common, len(ids) - 1))
        self.model.rollback(common)
        self.cached = ids[:common]
        return ids[common:]

    def prefill(self, ids: Sequence[int]) -> None:
        encoded = self.express(ids) if len(ids) else []
        if encoded:
            self.model.forward(encoded, keep=1)
        self.cached = encoded

    def propose(self, seq, k, decoding, generator, shape=None):
        if shape is not None:
            raise ValueError("token trees need a draft of the target's own tokenizer (this one is remapped)")
        # Penalties and logit_bias are defined over the target's ids: the draft warps its own rows without them
        # (the rule stays exact for any q; only acceptance pays). In coupled mode the target's argmax decides, so a
        # greedy proposal is as exact as any.
        sampling = replace(decoding.sampling, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                           logit_bias=(), temperature=0.0 if decoding.deterministic else decoding.sampling.temperature)
        drafts, dists = [], []
        new = self._catch_up(self.express(seq)) if k > 0 else []
        for _ in range(k):
            logits = self.model.forward(new, keep=1)[-1]  # [draft vocab]
            self.cached += list(new)
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                q_draft = warp(logits, sampling)
                token = int(sample(q_draft, generator))
            twin = int(self.to_target[token])
            if twin < 0:
                break  # no target id says the same thing: propose what we have
            drafts.append(twin)
            if not sampling.greedy:
                folded = torch.zeros(self.target_vocab, device=q_draft.device)
                folded.index_add_(0, self._to, q_draft[self._from])
                dists.append(folded / folded.sum())
            new = [token]
        ids = torch.tensor(drafts, dtype=torch.long, device=self.model.device)
        return Draft(ids, torch.stack(dists) if dists else None)

    def rollback(self, length, path=()):
        # `propose` re-syncs with the true text itself; only a new request (length 0) empties the cache.
        if length == 0:
            self.model.reset()
            self.cached = []
