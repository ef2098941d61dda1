"""The eager backend's attention on a CPU (spec/models/attention.py): what it computes, and that models run it."""

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from spec.models import EagerModel
from spec.models.attention import CHUNK, NAME, grouped_attention, grouped_reason
from spec.models.graph import unsupported_reason
from spec.tree import layout


def reference(query, key, value, mask, scaling):
    """Attention in float64, each query head reading its K/V head repeated as transformers' repeat_kv does."""
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    scores = query.double() @ k.transpose(-1, -2) * scaling + mask.double()
    return (scores.softmax(-1) @ v).transpose(1, 2)  # [b, n, heads, D]


def tiled(module, query, key, value, mask, scaling):
    """The classic mistake: query head h reads K/V head h mod kv_heads (repeat, not repeat_interleave)."""
    groups = query.shape[1] // key.shape[1]
    return grouped_attention(module, query, key.repeat(1, groups, 1, 1), value.repeat(1, groups, 1, 1), mask,
                             scaling)


def case(n: int, cached: int, dtype, tree: bool):
    """Random GQA inputs (6 query heads over 2 K/V heads) and an additive mask: causal, or a random ancestor mask
    over the n new tokens (each sees itself and a random subset of the earlier new ones)."""
    g = torch.Generator().manual_seed(n * 1000 + cached)
    query = torch.randn(1, 6, n, 16, generator=g).to(dtype)
    key, value = (torch.randn(1, 2, cached, 16, generator=g).to(dtype) for _ in range(2))
    visible = torch.ones(n, cached, dtype=torch.bool).tril(cached - n)
    if tree:
        new = torch.rand(n, n, generator=g) < 0.5
        visible[:, cached - n:] = (new.tril(-1) | torch.eye(n, dtype=torch.bool))
    mask = torch.zeros(n, cached, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[None, None]
    return query, key, value, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,cached,tree", [(1, 1, False), (1, 150, False), (5, 150, True), (CHUNK + 6, 200, False),
                                           (CHUNK + 6, 200, True)])
def test_grouped_attention_is_attention_in_float64_within_one_rounding(dtype, n, cached, tree):
    query, key, value, mask = case(n, cached, dtype, tree)
    got, weights = grouped_attention(None, query, key, value, mask, scaling=0.25)
    want = reference(query, key, value, mask, 0.25)
    assert weights is None and got.dtype == dtype and got.shape == want.shape
    # Scores, softmax and the value sums run in fp32 (relative error a few 2^-24 over 16-200 terms); the output is
    # rounded once to the dtype: half an ulp, at most 2^-8 of |output| in bf16 (8 significant bits). Each |output| <=
    # max |value| (a convex mix), which bounds the fp32 part.
    bound = (2.0**-8 if dtype == torch.bfloat16 else 0.0) * want.abs() + 1e-5 * value.abs().max().double()
    assert ((got.double() - want).abs() <= bound).all()


def test_the_same_check_catches_query_heads_on_the_wrong_kv_head():
    query, key, value, mask = case(5, 150, torch.float32, tree=True)
    want = reference(query, key, value, mask, 0.25)
    assert (tiled(None, query, key, value, mask, 0.25)[0].double() - want).abs().max() > 0.05


def test_a_batch_and_masks_that_broadcast_or_are_bool_read_as_transformers_eager_reads_them():
    """Two sequences (the second padded on the left); the same mask given per sequence, once for both (batch 1),
    for every query at once ([.., 1, cached]) and as bool (True attends, as PyTorch's sdpa reads it)."""
    g = torch.Generator().manual_seed(7)
    n, cached = CHUNK + 5, 90
    query = torch.randn(2, 6, n, 16, generator=g)
    key, value = (torch.randn(2, 2, cached, 16, generator=g) for _ in range(2))
    visible = torch.ones(2, 1, n, cached, dtype=torch.bool)
    visible[1, :, :, :7] = False  # left padding of the second sequence
    additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    want = reference(query, key, value, additive, 0.25)
    for mask in (additive, visible, additive[:, :, :1]):  # the last: one row for every query
        assert (grouped_attention(None, query, key, value, mask, scaling=0.25)[0].double() - want).abs().max() < 1e-5
    shared = additive[1:]  # batch 1: the second sequence's mask for both
    want = reference(query, key, value, shared.expand(2, -1, -1, -1), 0.25)
    assert (grouped_attention(None, query, key, value, shared, scaling=0.25)[0].double() - want).abs().max() < 1e-5


def test_grouped_attention_takes_a_mask_per_query_head():
    query, key, value, mask = case(CHUNK + 3, 100, torch.float32, tree=True)
    per_head = mask.expand(1, 6, -1, -1).clone()
    per_head[:, 1, :, :50] = torch.finfo(torch.float32).min  # head 1 (kv head 0) sees none of the first 50
    got, _ = grouped_attention(None, query, key, value, per_head, scaling=0.25)
    assert (got.double() - reference(query, key, value, per_head, 0.25)).abs().max() < 1e-5


def qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def test_an_eager_model_on_a_cpu_runs_it_and_agrees_with_sdpa_in_fp32(tiny):
    model = qwen2()
    sdpa = EagerModel(copy.deepcopy(model))
    sdpa.model.set_attn_implementation("sdpa")
    ours = EagerModel(model)
    assert ours.grouped_attention and model.config._attn_implementation == NAME
    assert tiny.target.model.config._attn_implementation == NAME  # the tiny pair's Llama models too
    prompt = list(range(20, 90))  # longer than a chunk
    for m in (ours, sdpa):
        m.reset()
    for step in (prompt, [5], [7, 8, 9], [11, 12, 13, 14]):  # the last a tree: a 4-D mask through the attention
        tree = layout((-1, 0, 0, 1), 0, 4, ours.length) if len(step) == 4 else None
        a, b = ours.forward(step, tree=tree), sdpa.forward(step, tree=tree)
        assert (a - b).abs().max() < 1e-4


def test_other_devices_and_architectures_keep_their_own_attention():
    from transformers import MistralConfig, MistralForCausalLM

    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=16,
                         max_window_layers=1)
    sliding = Qwen2ForCausalLM(config).eval()
    assert "sliding_attention" in sliding.config.layer_types and "sliding" in grouped_reason(sliding)
    assert not EagerModel(sliding).grouped_attention and sliding.config._attn_implementation != NAME
    assert "sliding" in unsupported_reason(sliding)  # the graph backend's static cache: the same check
    mistral = MistralForCausalLM(MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=96,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    assert "mistral" in grouped_reason(mistral)
    assert "meta" in grouped_reason(qwen2().to("meta"))
