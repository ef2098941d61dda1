"""Models from the Hugging Face hub (or its local cache), local folders and single GGUF files."""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

from huggingface_hub import try_to_load_from_cache
from transformers import AutoModelForCausalLM, AutoTokenizer

from spec.models.base import ModelError

# The files that define a tokenizer's vocabulary (its chat template aside). A model loaded only for its vocabulary (a
# same-family draft) gets the tokenizer already read from byte-identical files instead of reading them again.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "tokenizer.model")
_by_vocabulary: dict[str, object] = {}  # vocabulary fingerprint -> a tokenizer read from such files, this process


def vocabulary_fingerprint(folder: str) -> str | None:
    """SHA-256 over a local folder's vocabulary files (names and bytes); None for a hub id or a folder without
    tokenizer.json."""
    path = Path(folder)
    if not (path / "tokenizer.json").is_file():
        return None
    digest = hashlib.sha256()
    for name in VOCABULARY_FILES:
        if (path / name).is_file():
            digest.update(name.encode() + b"\0" + (path / name).read_bytes() + b"\0")
    return digest.hexdigest()


def load_tokenizer(folder: str, vocabulary_only: bool = False, **kwargs):
    """The folder's tokenizer. With `vocabulary_only` (the caller uses its vocabulary, never its chat template), a
    tokenizer read earlier from byte-identical vocabulary files is returned instead: a same-family pair's draft
    ships the target's tokenizer.json (the Qwen2.5 one, 151,936 tokens, takes 1-1.5 s to read on a CPU core).
    Tokenizers are never modified after loading here, so sharing one is safe."""
    key = None if kwargs else vocabulary_fingerprint(folder)
    if vocabulary_only and key in _by_vocabulary:
        return _by_vocabulary[key]
    tok = AutoTokenizer.from_pretrained(folder, **kwargs)
    if key is not None:
        _by_vocabulary.setdefault(key, tok)
    return tok


def from_pretrained(folder: str, device, dtype, vocabulary_only: bool = False, **kwargs):
    """(model, tokenizer) from a folder or hub id; `gguf_file=` names a GGUF file inside the folder;
    `vocabulary_only`: see `load_tokenizer`."""
    tok = load_tokenizer(folder, vocabulary_only, **kwargs)
    model_kwargs = dict(kwargs)
    if "gguf_file" in kwargs:
        model_kwargs.update(dequantize_gguf())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **model_kwargs).to(device)
    return model, tok


def dequantize_gguf() -> dict:
    """Ask for plain dense weights from a GGUF file.

    transformers >= 5.2x can keep GGUF blocks packed behind hub-downloaded kernels; we want the same plain model on
    every version and machine (offline, and the same kernels our other pairs use), so we ask to de-quantise."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}  # older versions always de-quantise
    if "dequantize" not in inspect.signature(GgufConfig).parameters:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def from_gguf_file(path: Path, device, dtype):
    """(model, tokenizer) from one .gguf file, de-quantised on load; a damaged file is a clear error."""
    if not path.is_file():
        raise ModelError(f"no GGUF file at {path}")
    try:
        return from_pretrained(str(path.parent), device, dtype, gguf_file=path.name)
    except Exception as err:  # the GGUF reader raises many kinds of errors on a damaged file
        raise ModelError(f"could not read GGUF file {path} (truncated or not a GGUF model?): {err}") from err


def from_hub(repo: str, device, dtype):
    """(model, tokenizer) from the hub or its local cache; a gated or missing repo is a clear error."""
    try:
        return from_pretrained(repo, device, dtype)
    except OSError as err:
        text = str(err)
        hint = ""
        if "gated" in text.lower() or "401" in text or "403" in text or repo.startswith("meta-llama/"):
            hint = (
                f" {repo} is gated: accept its license at https://huggingface.co/{repo}, then run "
                "`hf auth login` (or set HF_TOKEN) and try again."
            )
        raise ModelError(
            f"could not load {repo!r} from the Hugging Face hub or its local cache.{hint} "
            "Offline, pass a local folder or .gguf path instead, or use --pair qwen-coder. Cause: "
            f"{text.splitlines()[0] if text else type(err).__name__}"
        ) from err


def hub_cached(repo: str) -> bool:
    """True if `repo`'s config and weights are already in the local Hugging Face cache (no network)."""
    for weights in ("model.safetensors", "model.safetensors.index.json"):
        if isinstance(try_to_load_from_cache(repo, "config.json"), str) and isinstance(
            try_to_load_from_cache(repo, weights), str
        ):
            return True
    return False
