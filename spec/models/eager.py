"""The `eager` backend: a transformers model and its DynamicCache, behind the `Model` interface. Runs everywhere; on a
CPU its attention is spec/models/attention.py's."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from spec.models.attention import use_grouped_attention
from spec.models.quant import packed_bytes

ALIGNMENT = 64  # bytes: a cache line; what PyTorch's CPU allocator gives every tensor it makes


def align_weights(model) -> int:
    """Give each CPU parameter and buffer of `model` that does not start on a 64-byte boundary memory of its own,
    values and identity unchanged (tied weights stay tied); returns the bytes copied.

    transformers maps a safetensors checkpoint and leaves each weight where the file put it, and the quantized
    cache parses its file the same way: such weights start 16, 32 or 48 bytes past a cache line. PyTorch's CPU products
    read them more slowly: a one-token step of the embedded 1.5B target took 56.5 ms with its int4 weights as read
    from the cache and 32.9 ms once copied, 126.2 ms in bf16 against 109.1 (2-core AMD EPYC; benchmarks/cpu/aligned/).
    """
    copied = 0
    with torch.no_grad():
        for tensor in weights(model):
            if tensor.device.type == "cpu" and tensor.numel() and tensor.data_ptr() % ALIGNMENT:
                tensor.data = tensor.data.clone()
                copied += tensor.numel() * tensor.element_size()
    return copied


def weights(model) -> list[torch.Tensor]:
    """Every parameter and buffer of `model`, module by module (a tied weight once per module that holds it)."""
    return [t for m in model.modules() for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]]


def rollback_cache(cache, length: int) -> None:
    """Cut a transformers KV cache back to its first `length` positions.

    The only function that touches a transformers cache. transformers 5.24 rejects the positive `crop(length)` of
    older versions, while every version we meet accepts `crop(-n)` = "remove the last n"; StaticCache implements
    that by moving its write position, DynamicCache by slicing.
    """
    current = cache.get_seq_length()
    if length < 0 or length > current:
        raise ValueError(f"cannot roll a cache of {current} positions back to {length}")
    if length < current:
        cache.crop(length - current)


def select_cache(cache, start: int, slots: Sequence[int]) -> None:
    """Keep a transformers KV cache's first `start` positions followed by the positions `slots` (ascending, each
    >= start), moved to be contiguous; drop the rest. How a token tree's accepted path stays and its other branches
    go. Each layer's keys and values are [batch, heads, positions, head_dim] in every transformers 5 cache layer
    that simply appends (DynamicLayer); a sliding-window layer would need more, and is refused."""
    current = cache.get_seq_length()
    if any(not start <= s < current for s in slots) or list(slots) != sorted(set(slots)):
        raise ValueError(f"cannot keep slots {list(slots)} after {start} of a cache of {current} positions")
    index = torch.tensor(list(range(start)) + list(slots), dtype=torch.long)
    for layer in cache.layers:
        if type(layer).__name__ != "DynamicLayer":
            raise ValueError(f"token trees need a cache that only appends; this model's has {type(layer).__name__}")
        index = index.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)


class EagerModel:
    """A causal LM plus its own KV cache (`spec.models.base.Model`).

    `forward(ids)` appends `ids` to the cached text and returns fp32 logits `[len(ids), vocab]` (or the last `keep`
    rows), cut to the vocabulary shared with the other model of the pair. `rollback(length)` forgets everything
    after the first `length` positions. `length` is the number of cached positions.
    """

    quantized: dict | None = None  # int8 / int4 weights: what make_model did (spec/models/pairs.py), else None
    backend = "eager"  # the --backend that names it

    def __init__(self, model, vocab: int | None = None, name: str = "model"):
        self.model = model.eval()
        align_weights(self.model)  # CPU products read weights at a cache line's start faster (see there)
        self.grouped_attention = use_grouped_attention(self.model)  # on a CPU (spec/models/attention.py)
        self.name = name
        self.vocab = vocab or model.config.get_text_config().vocab_size
        self.device = model.device
        self.cache = None
        self.length = 0
        # transformers 5.2x renamed the cache argument `past_key_values` -> `cache`; take whichever this one has.
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @property
    def max_length(self) -> int:
        return self.model.config.get_text_config().max_position_embeddings

    @torch.inference_mode()
    def forward(self, ids: Sequence[int] | torch.Tensor, keep: int | None = None,
                tree=None) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(1, -1)
        n = ids.shape[1]
        if n == 0:
            raise ValueError("forward needs at least one new token")
        if self.length + n > self.max_length:
            raise ValueError(f"{self.name}: {self.length + n} positions exceed the context of {self.max_length}")
        extra = {}
        if tree is not None:
            if tree.visible.shape != (n, self.length + n):
                raise ValueError(f"{self.name}: a tree layout of {tuple(tree.visible.shape)} for {n} new tokens on "
                                 f"{self.length} cached ones")
            # A 4-D additive mask goes to the attention as it is (0 = attend); the positions follow the tree depth.
            dtype = self.model.dtype
            mask = torch.zeros(tree.visible.shape, dtype=dtype, device=self.device)
            mask = mask.masked_fill(~tree.visible.to(self.device), torch.finfo(dtype).min)
            extra = {"attention_mask": mask[None, None], "position_ids": tree.positions.to(self.device)[None]}
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=keep or n, **{self._cache_arg: self.cache},
                         **extra)
        self.cache = out[self._cache_arg]
        self.length += n
        return out.logits[0, :, : self.vocab].float()

    def prepare(self, tokens: int, context: int, tree_tokens: int = 0) -> None:
        """Nothing to prepare: the eager backend has no shapes to capture."""

    def keep(self, start: int, slots: Sequence[int] = ()) -> None:
        """Keep the first `start` cached positions and then those at `slots` (a token tree's accepted path)."""
        if list(slots) == list(range(start, start + len(slots))):  # a chain's path: a plain rollback
            self.rollback(start + len(slots))
            return
        select_cache(self.cache, start, slots)
        self.length = start + len(slots)

    def rollback(self, length: int) -> None:
        if length == 0:
            self.cache, self.length = None, 0
            return
        rollback_cache(self.cache, length)
        self.length = length

    def reset(self) -> None:
        self.rollback(0)

    def weight_bytes(self) -> int:
        """Bytes one decode step must read: every parameter once (tied embeddings counted once), and the buffers
        of quantized layers (their packed weights and scales)."""
        return packed_bytes(self.model)
