"""The eager backend's attention on a CPU: the query heads that share a K/V head multiply its cache together, and
the scores and their softmax stay in fp32.

transformers runs attention through `sdpa` by default, PyTorch's fused kernel. On a CPU its one-token forward grows
with the cached text far faster than the work does: on this project's 2-core CPU the 1.5B int4 target's step on
1,200 cached tokens took 64.4 ms through `sdpa` and 39.5 ms through this function, the 0.5B int4 draft's 31.8
against 18.7; on 40 cached tokens 30.9 / 31.2 and 17.5 / 16.3 (`python benchmarks/cpu/attention.py`,
`benchmarks/cpu/attention/`). A one-token step is where decoding spends its time, and the draft's step is the
draft's cost c.

What it computes, for each K/V head: the queries of its `groups` query heads as one [groups * n, D] matrix
(transformers' `eager` repeats the keys and values per query head instead), scores = q k^T * scaling + mask, in fp32
(the bf16 inputs cast, so no score is rounded to bf16 as `eager` rounds them), softmax in fp32, times the values in
fp32, the output rounded once to the model's dtype. Queries go in chunks of CHUNK: a prompt's scores then take
[kv_heads, groups * CHUNK, cached] floats, not [heads, n, cached]. A whole prompt of 1,000 tokens costs 2-7 % more
than through `sdpa` (the same run: 8.29 against 8.17 s, the draft's 2.56 against 2.39; in a run not kept, chunks of
128 or 256 queries were no faster and one chunk of 1,000 slower still).

Every forward of a model runs this one function, one token or many, so a verify and a step differ only where the
products' own summation order does (as they do through `sdpa`). It is the model's attention implementation, set on its
config, so transformers' own `generate` on the same model runs it too: plain decoding checked against `generate`
compares the same arithmetic. Only plain Llama/Qwen2 attention takes it (no sliding windows); others keep their own.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from spec.models.base import sliding_window

NAME = "spark_spec_grouped"
CHUNK = 64  # query tokens per product: a step and a verify are one chunk
ARCHITECTURES = ("llama", "qwen2")


def grouped_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [b, heads, n, D], key/value [b, kv_heads, cached, D], a mask
    [b or 1, 1 or heads, n or 1, >= cached] or None -> ([b, n, heads, D] in query's dtype, None). The mask is added to
    the scores (transformers' eager masks, and ours for token trees); a bool one, as PyTorch's sdpa reads it, keeps
    the positions that are True."""
    if dropout:
        raise ValueError("the grouped attention runs inference only (dropout 0)")
    b, heads, n, d = query.shape
    kv_heads, cached = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scaling = d ** -0.5 if scaling is None else scaling
    keys_t, values = key.float().transpose(-1, -2), value.float()  # [b, kv, D, cached], [b, kv, cached, D]
    mask = None
    if attention_mask is not None:  # [b or 1, 1 or heads, n or 1, cached], additive (a bool mask: True attends) ->
        mask = attention_mask[..., :cached]  # [b or 1, kv_heads or 1, groups or 1, n or 1, cached]
        mask = additive_mask(mask) if mask.dtype == torch.bool else mask
        mask = mask[:, :, None] if mask.shape[1] == 1 else mask.reshape(mask.shape[0], kv_heads, groups,
                                                                         *mask.shape[2:])
    # Head h = j * groups + i reads K/V head j (transformers' repeat_kv): [b, kv_heads, groups, n, D].
    out = attend_chunks(query.reshape(b, kv_heads, groups, n, d), keys_t, values, scaling, mask)
    return out.view(b, heads, n, d).transpose(1, 2).contiguous(), None


def attend_chunks(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, scaling: float,
                  mask: torch.Tensor | None) -> torch.Tensor:
    """Both backends' attention: q [..., kv_heads, groups, n, D], keys_t [..., kv_heads, D, cached] and values [...,
    kv_heads, cached, D] in fp32, an additive mask that broadcasts to [..., kv_heads, groups, n or 1, cached] or None
    -> [..., kv_heads, groups, n, D] in q's dtype. The queries go CHUNK tokens at a time, each chunk's group rows
    (g * m + t) as one matrix against the cache (`attend`)."""
    *lead, kv_heads, groups, n, d = q.shape
    if n <= CHUNK:  # a step, a verify, a tree: one chunk
        return attend(q.reshape(*lead, kv_heads, groups * n, d).float(), keys_t, values, scaling, mask,
                      groups).to(q.dtype).view(q.shape)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        chunk = q[..., start:start + m, :].reshape(*lead, kv_heads, groups * m, d).float()
        rows = None if mask is None else mask[..., start:start + m, :] if mask.shape[-2] > 1 else mask
        out[..., start:start + m, :] = attend(chunk, keys_t, values, scaling, rows, groups).view(
            *lead, kv_heads, groups, m, d)
    return out


def attend(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, scaling: float,
           mask: torch.Tensor | None = None, groups: int = 1) -> torch.Tensor:
    """The arithmetic, for one chunk of queries, in fp32: q [..., kv_heads, groups * m, D], keys_t [..., kv_heads, D,
    cached], values [..., kv_heads, cached, D], an additive mask that broadcasts to [..., kv_heads, groups, m,
    cached] or None -> [..., kv_heads, groups * m, D]."""
    scores = torch.matmul(q, keys_t) * scaling
    if mask is not None:
        shape = scores.shape
        scores = (scores.view(*shape[:-2], groups, shape[-2] // groups, shape[-1]) + mask).view(shape)
    return torch.matmul(torch.softmax(scores, dim=-1), values)


def additive_mask(visible: torch.Tensor | None) -> torch.Tensor | None:
    """A bool mask (True: attend) as the fp32 one added to the scores: 0 where visible, -inf elsewhere."""
    if visible is None:
        return None
    return torch.zeros(visible.shape, device=visible.device).masked_fill(~visible, float("-inf"))


def cached_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n: int,
                     mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """The same attention for the graph backend's static cache on a CPU: q [kv_heads, groups * n, D] (row g * n + t:
    token t's query for the group's head g), keys / values [kv_heads, cached, D], `mask` [n, cached] added to the
    scores (`additive_mask`; None: every token sees every cached position) -> [kv_heads, groups * n, D] in q's
    dtype, by `attend_chunks` as the eager backend's."""
    kv_heads, rows, d = q.shape
    out = attend_chunks(q.view(kv_heads, rows // n, n, d), keys.float().transpose(-1, -2), values.float(), scaling,
                        mask)
    return out.view(kv_heads, rows, d)


AttentionInterface.register(NAME, grouped_attention)
AttentionMaskInterface.register(NAME, eager_mask)  # an additive float mask, every forward (none skipped)


def grouped_reason(model) -> str | None:
    """Why `model` keeps its own attention on this device, or None if the grouped attention suits it."""
    config = model.config.get_text_config()
    if model.device.type != "cpu":
        return f"on {model.device.type} the eager backend keeps transformers' default"
    if config.model_type not in ARCHITECTURES:
        return f"architecture {config.model_type!r} is not one of {', '.join(ARCHITECTURES)}"
    if sliding_window(config):
        return "sliding-window attention"
    return None


def use_grouped_attention(model) -> bool:
    """Give `model` the grouped attention where it suits (`grouped_reason`); return whether it now runs it."""
    if grouped_reason(model) is not None:
        return False
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
    return True
