"""Greedy identity on the real embedded pair (Qwen2.5-Coder 1.5B target, 0.5B draft, bf16 on CPU).

The tiny pair proves the logic; this proves it where the numbers are real bf16 activations of trained models, whose
verify forward over K + 1 tokens and one-token steps take different matmul shapes."""

import pytest
import torch

from spec.drafters import make_drafter
from spec.io import load_prompts
from spec.loop import generate
from spec.models import chat_ids

pytestmark = pytest.mark.real
N = 48


@pytest.fixture(scope="module")
def cases(real):
    prompts = [p["prompt"] for p in load_prompts("code")[:2]] + [load_prompts("rename")[0]["prompt"]]
    out = []
    for text in prompts:
        ids = chat_ids(real.tokenizer, text)
        with torch.inference_mode():
            ref = real.target.model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False,
                                             eos_token_id=sorted(real.eos), pad_token_id=real.tokenizer.pad_token_id)
        out.append((ids, ref[0, len(ids):].tolist()))
    return out


def test_plain_decoding_equals_transformers_generate(real, cases):
    for ids, ref in cases[:2]:
        assert generate(real.target, make_drafter("none", real), ids, N, k=0, eos=real.eos).tokens == ref


def test_draft_model_speculation_is_identical(real, cases):
    for ids, ref in cases[:2]:
        result = generate(real.target, make_drafter("draft", real), ids, N, k=4, eos=real.eos)
        assert result.tokens == ref
        assert 0 < result.accepted < result.drafted


def test_prompt_lookup_is_identical_and_finds_the_copied_text(real, cases):
    ids, ref = cases[2]
    result = generate(real.target, make_drafter("lookup", real), ids, N, k=8, eos=real.eos)
    assert result.tokens == ref
    assert result.tokens_per_round > 2  # a rename copies its input: lookup must be finding it
