"""The lesson's "one place that knows about models", as the task layout names it: a facade over `spec.models`.

    from spec.common import load_pair, chat_ids, sync_time

`spec.models` holds the code: the `Model` interface and its backends, loading by source, the presets and
`load_pair`. This module only re-exports what the lesson's steps use.
"""

from spec.models import (
    PAIRS,
    EagerModel,
    Model,
    ModelError,
    Pair,
    chat_ids,
    load_pair,
    pick_device,
    pick_dtype,
    rollback_cache,
    sync_time,
)

__all__ = ["PAIRS", "EagerModel", "Model", "ModelError", "Pair", "chat_ids", "load_pair", "pick_device",
           "pick_dtype", "rollback_cache", "sync_time"]
