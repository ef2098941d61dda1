"""What every model backend provides, and the few facts about devices that all of them share.

`Model` is the interface the loop, the drafters and the tasks are typed against. Two backends implement it:
`spec.models.eager.EagerModel` (transformers' forward over a DynamicCache; runs everywhere) and
`spec.models.graph.GraphModel` (a static KV cache, with CUDA graphs on a GPU; Llama/Qwen2). The loop cannot tell
them apart.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch


class ModelError(RuntimeError):
    """A model could not be found, verified or loaded; the message says what to do."""


@runtime_checkable
class Model(Protocol):
    """A causal LM with its own KV cache, seen as a few calls.

    - `forward(ids, keep=None, tree=None)`: append ids [n] to the cached text; fp32 logits [keep or n, vocab] of the
      last positions, cut to the vocabulary shared with the other model of the pair. With `tree` (a
      `spec.tree.Layout`) the new tokens are token-tree nodes: their positions and what each attends come from it;
    - `rollback(length)`: forget everything after the first `length` cached positions; `reset()` = rollback(0);
    - `keep(start, slots)`: keep the first `start` positions followed by those at `slots`, moved to be contiguous
      (a token tree's accepted path); `keep(n)` = rollback(n);
    - `length`: cached positions; `max_length`: the most positions the cache can hold;
    - `vocab`: logit columns returned; `device`: where the logits live;
    - `weight_bytes()`: bytes one decode step reads (every parameter once);
    - `prepare(tokens, context)`: get ready for forwards of up to `tokens` new tokens on texts of up to `context`
      positions (the graph backend captures its CUDA graphs), so that none of that happens mid-generation.
    """

    name: str
    backend: str  # "eager" or "graph": the --backend that names it
    vocab: int
    device: torch.device
    length: int

    @property
    def max_length(self) -> int: ...

    def forward(self, ids: Sequence[int] | torch.Tensor, keep: int | None = None, tree=None) -> torch.Tensor: ...

    def rollback(self, length: int) -> None: ...

    def keep(self, start: int, slots: Sequence[int] = ()) -> None: ...

    def reset(self) -> None: ...

    def weight_bytes(self) -> int: ...

    def prepare(self, tokens: int, context: int, tree_tokens: int = 0) -> None: ...


def parameter_bytes(model) -> int:
    """Bytes of a torch module's parameters, tied ones once: what a decode step reads of an unquantized model (with
    its embedding table whole, the roofline's convention since the issues first set one; `read_bytes` leaves it out)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def embedding_bytes(model) -> dict:
    """A transformers model's input embedding table: its bytes, and whether the output head is that same tensor
    (tied; a head replaced by packed layers is not)."""
    table, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    return {"bytes": table.numel() * table.element_size(),
            "tied": weight is not None and table.data_ptr() == weight.data_ptr()}


def read_bytes(counted: float, embedding: dict | None, packed_head: bool) -> float:
    """The bytes one decode step reads, from `counted` bytes that hold the embedding table whole (`parameter_bytes`,
    a wrapper's `weight_bytes()`, a benchmark's `weight_bytes`): less the table (`embedding_bytes`), which a step
    looks up one row of (a few KB, left out), unless it is also the head and read whole (tied, and the head not a
    packed copy that `counted` holds beside it: `packed_head`). `embedding` None (an older benchmark's JSON): as
    counted."""
    if embedding is None or (embedding["tied"] and not packed_head):
        return counted
    return counted - embedding["bytes"]


def sliding_window(config) -> bool:
    """Whether a transformers text config has sliding-window attention layers (which neither the graph backend's
    static cache nor the eager backend's CPU attention implements)."""
    return bool(getattr(config, "use_sliding_window", False)) or "sliding_attention" in (
        getattr(config, "layer_types", None) or ())


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def pick_device(requested: str | None = None) -> torch.device:
    """cuda > mps > cpu, unless `requested` names one; asking for an absent accelerator is an error."""
    if requested:
        device = torch.device(requested)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ModelError("--device cuda was requested but torch sees no CUDA device on this machine")
        if device.type == "mps" and not torch.backends.mps.is_available():
            raise ModelError("--device mps was requested but MPS is not available on this machine")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(device: torch.device, requested: str | None = None) -> torch.dtype:
    """bf16 everywhere by default: on GPUs it is the native format, and on a 2-core CPU plain greedy decoding of
    the packaged Qwen target ran 2.5x faster in bf16 than in fp32 (5.06 vs 2.06 tok/s). MPS gets fp16."""
    if requested:
        if requested not in DTYPES:
            raise ModelError(f"unknown dtype {requested!r}; choose one of {', '.join(DTYPES)}")
        return DTYPES[requested]
    return torch.float16 if device.type == "mps" else torch.bfloat16


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def sync_time(device: torch.device | str | None = None) -> float:
    """A timestamp taken after the device has finished all queued work (perf_counter seconds)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device is not None and device.type == "mps":
        torch.mps.synchronize()
    return time.perf_counter()


def cache_root() -> Path:
    """Where assembled GGUF files, converted checkpoints and kernel tunings live: the platform's user cache folder
    (`$XDG_CACHE_HOME/spark-spec`, by default `~/.cache/spark-spec`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "spark-spec"
