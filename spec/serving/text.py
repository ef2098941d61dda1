"""Token ids -> text deltas, for streaming and for stop strings."""

from __future__ import annotations

from spec.remap import byte_level_table, is_byte_level


class TextStream:
    """Turns generated token ids, one at a time, into text deltas.

    A delta never ends inside a UTF-8 character (a decoded window that ends in U+FFFD waits for the next token), and
    never contains text that a stop string may still claim: the longest tail that is a prefix of a stop string is
    held back until it is ruled out. When a stop string appears, the text before it is the last delta.
    Decoding works on a sliding window (the previous delta's tokens as context, then the new ones), not the whole text.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.ids: list[int] = []
        self.prefix = self.read = 0  # window: ids[prefix:read] were decoded last time, ids[read:] are new
        self.text = ""  # all decoded text
        self.sent = 0  # characters of self.text already released

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _advance(self, final: bool) -> None:
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)

    def push(self, token: int) -> tuple[str, bool]:
        """Add one token; return (new text to release, whether a stop string was reached)."""
        self.ids.append(token)
        self._advance(final=False)
        return self._release(final=False)

    def finish(self) -> tuple[str, bool]:
        """Generation ended: release everything left (an incomplete character decodes as U+FFFD)."""
        self._advance(final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> tuple[str, bool]:
        # A stop string cannot start before `sent`: any such start would have been a held-back prefix.
        hits = [at for at in (self.text.find(s, self.sent) for s in self.stops) if at >= 0]
        if hits:
            delta = self.text[self.sent : min(hits)]
            self.sent = len(self.text)
            return delta, True
        keep = len(self.text)
        if not final:
            hold = max((n for s in self.stops for n in range(1, len(s)) if self.text.endswith(s[:n])), default=0)
            keep = max(self.sent, keep - hold)
        delta, self.sent = self.text[self.sent : keep], keep
        return delta, False


class TokenSpeller:
    """Token ids as OpenAI's logprobs spell them: (text, UTF-8 bytes). A byte-level token may hold part of a
    character; its text then shows U+FFFD and its bytes are exact."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.table = byte_level_table() if is_byte_level(tokenizer) else None
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        if token not in self.cache:
            text = self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if self.table is not None and piece is not None and all(c in self.table for c in piece):
                raw = bytes(self.table[c] for c in piece)
            else:
                raw = text.encode()
            self.cache[token] = (text, list(raw))
        return self.cache[token]
