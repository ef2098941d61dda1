"""Tokenizers: chat templating, the pair's compatibility check, end-of-answer ids, and the byte tokenizer of the
random-weight models."""

from __future__ import annotations

from spec.models.base import ModelError


def chat_ids(tokenizer, conversation: str | list[dict], system: str | None = None) -> list[int]:
    """Token ids of a conversation under the model's chat template, ready for the answer.

    `conversation` is one user turn (a string) or a list of {"role", "content"} messages. Models without a
    template get the plain text of the messages (with the tokenizer's own special tokens). The template's own rules
    (say, on the order of roles) raise whatever the template raises."""
    if isinstance(conversation, str):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": conversation}]
    else:
        messages = list(conversation)
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(rendered, add_special_tokens=False).input_ids
    return tokenizer("\n".join(m["content"] for m in messages)).input_ids


class TokenizerMismatch(ModelError):
    pass


def shared_vocab(target_tok, draft_tok, target_rows: int, draft_rows: int, allow_other_family: bool = False) -> int:
    """Check the two tokenizers map the same strings to the same ids; return how many logit columns to keep.

    Compared by vocabulary, not `config.vocab_size`: same-family models often pad their embedding matrices to
    different sizes (Qwen2.5-7B has 152,064 rows, 0.5B 151,936). Logits of both are cut to the tokenizer's length
    so that no padding row can ever be drafted or sampled.
    """
    if target_tok is not draft_tok and target_tok.get_vocab() != draft_tok.get_vocab():
        if not allow_other_family:
            raise TokenizerMismatch(
                f"the draft's tokenizer ({len(draft_tok)} tokens) differs from the target's ({len(target_tok)}): "
                "speculation needs the same vocabulary. Pick a draft of the same family, or pass "
                "--allow-other-family for the remapped-draft experiment."
            )
        return min(len(target_tok), target_rows)
    return min(len(target_tok), target_rows, draft_rows)


def eos_ids(model, tokenizer) -> set[int]:
    """Every id that ends an answer: the generation config's EOS list plus the tokenizer's EOS."""
    ids = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens + 3 specials) with a chat template, built offline.

    Used by the random-weight models, which have no tokenizer of their own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    specials = ["<|bos|>", "<|eos|>", "<|pad|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
    )
    return fast
