"""How far a quantized target is from the target it was made from: the one place that measures it.

A quantized draft changes no answer (the acceptance rule keeps the target's distribution), but a quantized target
IS another model: every claim of exactness is then against the quantized target that is served, and what changed
must be measured. For each prompt the reference (unquantized) target writes its greedy continuation; both models
are then teacher-forced on that same text, and at every position that predicts a token of it we compare
p = the reference's next-token distribution and q = the quantized one's:

- greedy agreement: the share of positions where argmax q = argmax p;
- KL(p || q) = sum_v p(v) (log p(v) - log q(v)), in nats: the expected extra surprise of the quantized model on
  text the reference would write (p first, because the reference's text is what is being scored).

Positions: the forward of `prompt + text[:-1]` has one row per token; its last len(text) rows are the ones that
predict text[0] (from the prompt's last token) up to text[-1]. Both models see exactly the same ids.

    reference = reference_run(bf16_target, prompts, 32, eos)    # before quantizing it in place
    quantize_model(bf16_target.model, "int4", "--target-quant")
    report = compare(bf16_target, reference, "int4")            # {"agreement": 0.97, "kl_mean": 0.01, ...}
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec.models.base import Model


@dataclass
class Reference:
    """The reference target's greedy texts and its log-probabilities along them, kept to score another model."""

    prompts: list[list[int]]  # prompt ids
    texts: list[list[int]]  # the reference's greedy continuation of each (at least one token)
    logprobs: list[torch.Tensor]  # [len(text), vocab] fp32 log-softmax at the rows predicting each text token


def greedy_text(model: Model, ids: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """The model's greedy continuation of `ids`: plain decoding, one argmax a step (spec/models cannot import the
    loop; with K = 0 the loop is exactly this), stopping after an end-of-answer id."""
    model.reset()
    logits = model.forward(ids, keep=1)
    text = []
    while len(text) < max_new_tokens:
        text.append(int(logits[-1].argmax()))
        if text[-1] in eos or len(text) == max_new_tokens:
            break
        logits = model.forward(text[-1:])
    model.reset()
    return text


def teacher_forced(model: Model, ids: list[int], text: list[int]) -> torch.Tensor:
    """fp32 log-probabilities [len(text), vocab]: row j is the model's next-token distribution after
    ids + text[:j], the one that predicts text[j]."""
    model.reset()
    logits = model.forward(ids + text[:-1], keep=len(text))
    model.reset()
    return torch.log_softmax(logits.float(), -1)


def divergence(ref_logprobs: torch.Tensor, quant_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of two [n, vocab] log-probability tables: (argmax agrees [n] bool, KL(p || q) [n] nats), p the
    reference. A row where p(v) underflows to 0 contributes 0 for v (the limit of p log p)."""
    p = ref_logprobs.exp()
    terms = torch.where(p > 0, p * (ref_logprobs - quant_logprobs), torch.zeros_like(p))
    return ref_logprobs.argmax(-1) == quant_logprobs.argmax(-1), terms.sum(-1)


def reference_run(model: Model, prompts: list[list[int]], max_new_tokens: int, eos: set[int]) -> Reference:
    texts = [greedy_text(model, ids, max_new_tokens, eos) for ids in prompts]
    return Reference(prompts, texts, [teacher_forced(model, ids, text) for ids, text in zip(prompts, texts,
                                                                                            strict=True)])


def compare(model: Model, reference: Reference, scheme: str) -> dict:
    """The quantized `model` against `reference` over all its prompts: agreement and KL pooled over every
    position (not a mean of per-prompt means), with each prompt's own numbers and its KL at every position."""
    agree, kl, per_prompt = [], [], []
    for ids, text, ref in zip(reference.prompts, reference.texts, reference.logprobs, strict=True):
        a, d = divergence(ref, teacher_forced(model, ids, text))
        agree.append(a)
        kl.append(d)
        per_prompt.append({"positions": len(text), "agreement": a.float().mean().item(), "kl_mean": d.mean().item(),
                           "kl": d.tolist()})
    agree, kl = torch.cat(agree), torch.cat(kl)
    return {"format": scheme, "prompts": len(reference.prompts), "positions": agree.numel(),
            "agreement": agree.float().mean().item(), "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "per_prompt": per_prompt}


def describe(report: dict, dtype: str) -> str:
    """One line for logs and tables."""
    return (f"{report['format']} target vs the {dtype} one: greedy agreement {report['agreement']:.1%}, mean "
            f"KL(p_{dtype} || p_{report['format']}) {report['kl_mean']:.4f} nats over {report['positions']} "
            f"positions of {report['prompts']} prompts (teacher-forced on the {dtype} text)")
