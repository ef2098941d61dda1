"""Random-weight models built from config: the tiny pair of the fast tests, and the exact Llama 3.1 8B / 3.2 1B
architectures for cost studies without a download."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spec.models.base import ModelError

TINY_VOCAB = 259  # byte_tokenizer(): 256 bytes + 3 specials


def build_tiny(which: str, device, dtype):
    """Small Llama models with fixed seeds. The draft is the target with Gaussian noise on every weight, tuned so
    that greedy acceptance is high but not total: both the accept and the reject paths run in every test."""
    if which not in ("target", "draft"):
        raise ModelError(f"unknown tiny model {which!r}; use tiny:target or tiny:draft")
    config = LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=256, eos_token_id=257, pad_token_id=258, initializer_range=0.1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Sharper next-token distributions than the default init, like a trained model's.
        model.lm_head.weight.mul_(8.0)
        if which == "draft":
            noise = torch.Generator().manual_seed(99)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=noise) * 0.05 * p.std())
    return model.to(device=device, dtype=dtype)


RANDOM_VOCAB = 128256  # Llama 3's vocabulary
LLAMA_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
RANDOM_ARCHS = {
    # The published configs of meta-llama/Llama-3.1-8B-Instruct and Llama-3.2-1B-Instruct.
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, tie_word_embeddings=False,
                         rope_scaling={**LLAMA_ROPE, "factor": 8.0}),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_scaling=LLAMA_ROPE),
}


def build_random(arch: str, device, dtype):
    """A Llama architecture with random weights, allocated directly on `device` (no download, no CPU copy)."""
    if arch not in RANDOM_ARCHS:
        raise ModelError(f"unknown random architecture {arch!r}; known: {', '.join(RANDOM_ARCHS)}")
    config = LlamaConfig(vocab_size=RANDOM_VOCAB, max_position_embeddings=131072, rms_norm_eps=1e-5,
                         rope_theta=500000.0, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
                         **RANDOM_ARCHS[arch])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model


