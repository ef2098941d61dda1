"""The `graph` backend: a static KV cache and CUDA graphs behind the `Model` interface.

On a fast GPU an eager decode step is mostly launch and Python overhead (21–36 ms per eager 8B step measured on
an H200, against a 3.75 ms memory roofline; docs/gpu.md). `GraphModel` removes that overhead:

- the KV cache is one tensor per layer and per K/V, allocated once for `max_length` positions; the cached text
  is `length` positions long and `rollback(length)` only moves that number (stale entries after it are masked out
  and overwritten by the next forward);
- a forward over n <= `MAX_GRAPH_TOKENS` tokens replays a CUDA graph captured lazily for (n, span), where span is
  the cache prefix attention reads (`SPAN_STEP` granularity), so attention costs grow with the text, not with
  `max_length`; with the fused kernels, longer forwards (the prompt) replay a 16-token chunk's graph per chunk, and
  a token tree's forward of up to 64 tokens is one pass;
- the layer stack is optionally `torch.compile`d (fused norms, rope and activations) with the token count and span
  as dynamic sizes: two compilations per model (n = 1 and n >= 2), not one per shape; by default only in half
  precision where the fused kernels cannot run;
- nothing in `forward` waits for the device: ids go in by asynchronous copies, the position by a fill kernel;
- token trees run on the same path: their nodes fill consecutive slots, the split-KV kernel reads a 64-bit ancestor
  mask per token, the rotary tables' slot rows hold the nodes' depth rows, a graph is captured per node count, and
  `keep` moves the accepted path's keys and values to consecutive slots (docs/trees.md).

On a CPU (no graphs, nothing compiled; `--backend auto` picks it there for Llama/Qwen2) the same static cache runs
the layer stack below, with the eager backend's CPU attention (spec/models/attention.py) over the cached text, and
with int8 / int4 weights the eager backend's packed layers (spec/models/quant.py's `QuantLinear`, PyTorch's CPU
kernels, their cache), q/k/v and gate/up each joined into one product. Packed, its logits equal the eager backend's
bit for bit; unpacked, its joined bf16 / fp32 products may round differently. Less runs around the products
(docs/quantization.md, "The graph backend on a CPU").

The layer stack is a compact re-statement of the transformers Llama/Qwen2 decoder that runs on the transformers
model's own modules and weights: norms, activation, embedding, head and rotary tables are the model's; q/k/v and
gate/up projections are fused into one matrix each, and the model's own parameters are re-pointed at slices of the
fused matrix, so no weight is stored twice and the transformers model keeps working unchanged.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from spec.models import kernels
from spec.models.attention import additive_mask, cached_attention, use_grouped_attention
from spec.models.base import ModelError, parameter_bytes, sliding_window, sync_time
from spec.models.eager import align_weights
from spec.models.quant import (
    PACKED_AS,
    W4A8,
    PackedWeight,
    QuantLinear,
    fuse_packed,
    library_layout_error,
    pack_for_kernels,
    packed_bytes,
    quant_error,
    quantize_model,
    with_library_layout,
)

MAX_GRAPH_TOKENS = 64  # forwards up to this many tokens are graphed; chains stay far below, a tree's verify may not
MAX_TREE_TOKENS = MAX_GRAPH_TOKENS + 1  # a tree forward: up to 64 nodes and the token they grow from
SPAN_STEP = 256  # attention reads the cache in multiples of this many positions
DEFAULT_MAX_LENGTH = 4096  # the static cache's size when the caller names none
SUPPORTED = ("llama", "qwen2")
RECOMPILE_LIMIT = 64  # compiled variants of the layer stack per process: two per GraphModel
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # position-independent tables; dynamic ones need the text


@contextlib.contextmanager
def no_collection():
    """No garbage collection inside: a model dropped earlier whose graphs sit in a reference cycle must not be freed
    during another model's capture (freeing a graph is not allowed while a stream captures, and invalidates the
    capture: seen on an H100 in session 22, benchmarks/h200/step_variants.py). torch.cuda.graph no longer collects
    before a capture (torch.compiler.config.force_cudagraph_gc), so the collector may run at any allocation."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def unsupported_reason(model) -> str | None:
    """Why the fast path cannot run this transformers model, or None if it can."""
    config = model.config.get_text_config()
    if config.model_type not in SUPPORTED:
        return f"architecture {config.model_type!r} is not one of {', '.join(SUPPORTED)}"
    if sliding_window(config):
        return "sliding-window attention is not implemented in the static cache"
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") not in ROPE_TYPES:
        return f"rope type {getattr(rotary, 'rope_type', None)!r} depends on the text length"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "tensor-parallel checkpoints (pretraining_tp > 1) are not supported"
    return None


def _fuse(linears: Sequence[torch.nn.Linear | QuantLinear]) -> tuple[torch.Tensor | QuantLinear, torch.Tensor | None]:
    """One [sum(out), in] weight (and bias) for several Linear layers on the same input; the layers' own
    parameters become row slices of it, so the memory is not doubled and the layers still work. Packed CPU layers
    (`QuantLinear`, a model on a CPU with int8 / int4 weights) become one such layer (its bias inside), or stay a
    `Side` of products where their codes cannot be joined (`quant.fuse_packed`)."""
    if all(isinstance(lin, QuantLinear) for lin in linears):
        return fuse_packed(list(linears)) or Side(linears), None
    weight = torch.cat([lin.weight.data for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = torch.cat([b.data for b in biases]) if all(b is not None for b in biases) else None
    if bias is None and any(b is not None for b in biases):
        raise ModelError("cannot fuse projections where only some have a bias")
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = weight[start : start + rows]
        if bias is not None:
            lin.bias.data = bias[start : start + rows]
        start += rows
    return weight, bias


class Side(torch.nn.Module):
    """Several layers on one input, their outputs side by side: what `_fuse` gives where weights cannot be joined."""

    def __init__(self, layers: Sequence[torch.nn.Module]):
        super().__init__()
        self.parts = torch.nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], -1)


def _product(x: torch.Tensor, weight: torch.Tensor | torch.nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    """x times a fused matrix: a weight tensor (and bias), or a module that holds both (packed CPU weights)."""
    return weight(x) if isinstance(weight, torch.nn.Module) else F.linear(x, weight, bias)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def fused_step_reason(model) -> str | None:
    """Why the fused one-token step (spec/kernels.py) cannot run this model's layers, or None if it can."""
    config = model.config.get_text_config()
    layer = model.model.layers[0]
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not SiLU"
    if layer.self_attn.o_proj.bias is not None or any(
            getattr(layer.mlp, name).bias is not None for name in ("gate_proj", "up_proj", "down_proj")):
        return "the output or MLP projections have biases"
    norms = {type(module).__name__ for module in (layer.input_layernorm, model.model.norm)}
    if not norms <= {"LlamaRMSNorm", "Qwen2RMSNorm"}:
        return f"norm {sorted(norms)} is not Llama's RMSNorm"
    if not kernels.suits_head_dim(layer.self_attn.head_dim):
        return f"head size {layer.self_attn.head_dim} is not a power of two >= 16"
    return None


def packed_weights_reason(model) -> str | None:
    """Why a `GraphModel` with its default settings cannot run this model's weights packed (int8 / int4 / fp8 in
    its fused kernels), or None if it can."""
    if not kernels.available():
        return "Triton or a CUDA device is missing"
    return fused_step_reason(model)


def stepwise_limit(ms: dict[int, float]) -> int:
    """From milliseconds per forward by token count (1 included): the most tokens n for which n one-token steps
    cost less than one n-token forward, at every count up to n; 0 when two steps already cost more than one forward
    of two."""
    limit = 0
    for n in sorted(k for k in ms if k > 1):
        if n * ms[1] >= ms[n]:
            break
        limit = n
    return limit


class GraphModel:
    """A Llama/Qwen2 transformers model over a static KV cache, with CUDA graphs per token count.

    The `Model` interface: `forward(ids, keep=None) -> fp32 logits [keep or n, vocab]`, `rollback`,
    `reset`, `length`, `max_length`, `vocab`, `device`, `weight_bytes()`. `graphs=False` runs the same static-cache
    code without graphs (the CPU path the tests check against the eager backend).
    """

    quantized: dict | None = None  # int8 / int4 weights: what was done to them (scheme, seconds, cache), else None
    backend = "graph"  # the --backend that names it

    def __init__(self, model, vocab: int | None = None, name: str = "model", max_length: int | None = None,
                 graphs: bool = True, compile: bool | None = None, split_attention: bool | None = None,
                 fused_step: bool | None = None, fused_tokens: int | None = None, pdl: bool = True,
                 quant: str = "none"):
        reason = unsupported_reason(model)
        if reason:
            raise ModelError(f"{name}: the graph backend cannot run this model: {reason}")
        if reason := quant_error(name, quant, model.device):
            raise ModelError(reason)
        self.model = model.eval()
        self.name = name
        config = model.config.get_text_config()
        self.vocab = vocab or config.vocab_size
        self.device = model.device
        # On a CPU nothing is captured, so the cache can grow (`forward` calls `_allocate` again): there it reaches
        # the model's whole context unless told otherwise, and starts at DEFAULT_MAX_LENGTH positions. On CUDA it is
        # allocated once, whole.
        cpu = self.device.type == "cpu"
        self.max_length = min(max_length or (config.max_position_embeddings if cpu else DEFAULT_MAX_LENGTH),
                              config.max_position_embeddings)
        if self.max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}")
        self.graphs = graphs and self.device.type == "cuda"
        if graphs and not self.graphs:
            raise ModelError(f"{name}: CUDA graphs need a CUDA device (this model is on {self.device})")
        self.length = 0
        # int8 / int4 weights on a CPU: the eager backend's packed layers (PyTorch's CPU kernels, `quantize_model`,
        # whose cache they come from), q/k/v and gate/up each joined into one; `quantized` says what was done.
        # (A model whose layers are packed already, by an eager backend's load, is taken as it is.) Unless the fused
        # kernels are asked for by name (`fused_step=True`: on a CPU only in Triton's interpreter, the tests' way to
        # run them there), which read the weights packed their own way.
        self.cpu_packed = cpu and not fused_step and (quant != "none" or any(isinstance(m, QuantLinear)
                                                                              for m in model.modules()))
        if quant != "none" and self.cpu_packed:
            self.quantized = quantize_model(model, quant, name)
        if cpu:  # as the eager backend does: transformers' generate on this model runs the same attention, and the
            use_grouped_attention(model)  # products read weights at a cache line's start faster
            align_weights(model)

        attn0 = model.model.layers[0].self_attn
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attn0.head_dim
        self.scaling = attn0.scaling
        self.intermediate = config.intermediate_size
        dtype = model.model.embed_tokens.weight.dtype
        with torch.no_grad():
            self.layers = []
            for layer in model.model.layers:
                a, m = layer.self_attn, layer.mlp
                qkv = _fuse([a.q_proj, a.k_proj, a.v_proj])
                gate_up = _fuse([m.gate_proj, m.up_proj])
                self.layers.append((layer.input_layernorm, qkv, a.o_proj, layer.post_attention_layernorm, gate_up,
                                    m.act_fn, m.down_proj))
            self.k_all = self.v_all = None
            self._allocate(min(self.max_length, DEFAULT_MAX_LENGTH) if cpu else self.max_length)
            self.pos = torch.zeros((), dtype=torch.long, device=self.device)  # the write position, on the device
            # A token tree's forward (see `forward`): the kernels read a token's rotary row at its cache slot, so a
            # tree's tokens get tables whose slot rows hold their depths' rows; `tree` = [base, 64-bit ancestor
            # mask per token] (kernels.tree_visible) and `tree_positions` [n], filled before each tree forward.
            self.tree = torch.zeros(1 + MAX_TREE_TOKENS, dtype=torch.long, device=self.device)
            self.tree_positions = torch.zeros(MAX_TREE_TOKENS, dtype=torch.long, device=self.device)
        # span -> a tensor of that length: attention reads cache positions < span, and a tensor's size (not an int)
        # lets torch.compile treat the span as a dynamic size.
        self.spans: dict[int, torch.Tensor] = {}
        # Split-KV attention (spec/kernels.py) on CUDA in half precision, or in any precision with int8 / int4
        # weights (which only the fused kernels read), unless told otherwise; SDPA elsewhere.
        if split_attention is None:
            split_attention = (self.device.type == "cuda" and (dtype in (torch.bfloat16, torch.float16)
                                                               or quant != "none")
                               and kernels.available() and kernels.suits_head_dim(self.head_dim))
        self.split_attention = split_attention
        # The one-token step (draft steps, plain decoding) and forwards of up to `fused_tokens` tokens (verifies,
        # a draft's catch-up; at most kernels.MAX_FUSED_TOKENS, the default) as five fused kernels a layer
        # (spec/kernels.py) wherever the split kernel runs and the layers are the plain Llama/Qwen2 ones. Longer
        # forwards (prefills) run through the same kernels in chunks of `fused_tokens`; `fused_tokens=1` sends
        # verifies and prefills to the layer stack below (measured beside the default by `--backends graph-stack`
        # in spec.bench_engine).
        if fused_step is None:
            fused_step = split_attention and fused_step_reason(model) is None
        elif fused_step and fused_step_reason(model):
            raise ModelError(f"{name}: the fused step cannot run this model: {fused_step_reason(model)}")
        self.fused_step = fused_step
        if fused_tokens is None:
            fused_tokens = kernels.MAX_FUSED_TOKENS if fused_step else 0
        if not 0 <= fused_tokens <= kernels.MAX_FUSED_TOKENS or (fused_tokens and not fused_step):
            raise ValueError(f"fused_tokens must be 0-{kernels.MAX_FUSED_TOKENS} (and 0 without the fused step), "
                             f"got {fused_tokens}")
        self.fused_tokens = fused_tokens
        # int8 / int4 weights (spec/models/quant.py) run in the fused kernels only: every forward must go through
        # them, prompts included (in chunks), so the layer stack never runs.
        if quant != "none" and fused_tokens < 2 and not self.cpu_packed:
            why = fused_step_reason(model) or ("the split-KV attention is off" if not split_attention else
                                               f"fused_tokens={fused_tokens} sends prompts to the layer stack")
            raise ModelError(f"{name}: {quant} weights on the graph backend run in its fused kernels, which cannot "
                             f"take this model here: {why} (CUDA, half precision, Llama/Qwen2 layers); the eager "
                             "backend runs them")
        self.quant = quant
        # The weights the fused step reads: the fused matrices and the head, as they are or packed.
        def pack(w: torch.Tensor) -> torch.Tensor | PackedWeight:
            """A weight as the fused kernels read it; int4 in bf16 also in PyTorch's own int4 layout, for products of
            kernels.LIBRARY_TOKENS tokens or more (twice the int4 weights' memory, read once a product either way)."""
            if quant == "none":
                return w
            packed = pack_for_kernels(w, PACKED_AS.get(quant, quant))
            return packed if library_layout_error(packed, dtype) else with_library_layout(packed)

        with torch.no_grad():
            start = time.perf_counter()
            if not self.cpu_packed:  # (the packed CPU layers are the model's own)
                self.step_weights = [(pack(w_qkv), pack(o.weight), pack(w_gu), pack(d.weight))
                                     for _, (w_qkv, _), o, _, (w_gu, _), _, d in self.layers]
                self.head_weight = pack(model.lm_head.weight)
            if quant != "none" and not self.cpu_packed:  # (else `quantize_model` said what it did, above)
                self.quantized = {"scheme": quant, "seconds": time.perf_counter() - start,
                                  "cache": "packed on the GPU for the fused kernels"}
        # Prompts go through the fused kernels in chunks of this many tokens (0: through the layer stack).
        self.prefill_chunk = fused_tokens if fused_tokens > 1 else 0
        # w4a8 (a draft's): the one-token products take their inputs rounded to 8 bits (kernels.gemv's `a8`).
        self.a8 = quant == W4A8
        # Programmatic dependent launch for the Triton kernels, where the GPU has it (Hopper and later).
        self.pdl = pdl and kernels.pdl_supported(self.device)
        # The layer stack is compiled only where it runs the decode path (no fused step) in half precision: with the
        # fused kernels it sees only prefills, for which compiling costs far more start-up (40-130 s per model) than
        # it saves; in float32 (the exactness runs, where speed does not matter) the real Qwen pair's compiles and
        # recompiles had not finished in 8 minutes on an H200, and graphs alone remove the launch overhead.
        if compile is None:
            compile = not self.fused_tokens and self.device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
        self.body = torch.compile(self._body, fullgraph=True) if compile else self._body
        self.compiled = compile
        # Forwards captured as CUDA graphs: up to MAX_GRAPH_TOKENS tokens, except that an uncompiled stack beside the
        # fused kernels runs only prefills, whose lengths vary from prompt to prompt: a graph each would not pay.
        self.graph_tokens = self.fused_tokens if self.fused_tokens and not compile else MAX_GRAPH_TOKENS
        self._graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.prepared = 0  # forwards of up to this many tokens were captured by `prepare` (0: capture on demand)
        # Packed weights: forwards of 2..stepwise tokens run as one-token steps, where `prepare` measured that
        # cheaper (the int4 / int8 multi-token products cost 3-7 one-token steps on an H200; docs/quantization.md).
        self.stepwise = 0

    def _allocate(self, positions: int) -> None:
        """The static cache and the rotary tables for `positions`, rounded up to SPAN_STEP (the last span may
        overhang max_length), keeping what the cache holds: a CPU's cache grows as the text does."""
        capacity = -(-positions // SPAN_STEP) * SPAN_STEP
        dtype = self.model.model.embed_tokens.weight.dtype
        # One tensor for every layer's keys (and one for values), seen layer by layer: compacting a token tree's
        # accepted path (`keep`) is then one gather and one copy each, not two a layer.
        shape = (len(self.layers), self.kv_heads, capacity, self.head_dim)
        held = (self.k_all, self.v_all)
        self.k_all = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_all = torch.zeros(shape, dtype=dtype, device=self.device)
        if held[0] is not None:
            self.k_all[:, :, : held[0].shape[2]] = held[0]
            self.v_all[:, :, : held[1].shape[2]] = held[1]
        self.k_cache, self.v_cache = list(self.k_all.unbind(0)), list(self.v_all.unbind(0))
        # The model's own rotary module gives the cos/sin rows for every position; its values are elementwise in the
        # position, so a table is bit-identical to computing them per step (and a longer table's rows to a shorter's).
        rows = torch.arange(capacity, device=self.device)[None]
        cos, sin = self.model.model.rotary_emb(torch.zeros((), dtype=dtype, device=self.device), rows)
        self.cos, self.sin = cos[0], sin[0]  # [capacity, head_dim]
        self.cos_tree, self.sin_tree = self.cos.clone(), self.sin.clone()  # a tree's rows (`_step`)

    # ---- the layer stack -----------------------------------------------------------------------------------

    def _body(self, ids: torch.Tensor, pos: torch.Tensor, span: torch.Tensor, tree: bool = False) -> torch.Tensor:
        """Run `ids` [n] in cache slots pos..pos+n-1 (at those positions, or with `tree` at `tree_positions` under
        the `tree` mask), writing their K/V into the cache; return the final-normed hidden states [n, hidden].
        Attention reads cache positions < B = len(span) (B >= pos + n)."""
        n = ids.shape[0]
        b = span.shape[0]
        groups = self.heads // self.kv_heads
        q_pos = pos + torch.arange(n, device=ids.device)  # [n]: the cache slots
        # (on a CPU nothing is captured, so the slots can be a slice: a cheaper write than by index)
        slots = slice(int(pos), int(pos) + n) if ids.device.type == "cpu" else q_pos
        rope = self.tree_positions[:n] if tree else q_pos
        mask = self.tree[: n + 1] if tree else None
        cos, sin = self.cos[rope][:, None], self.sin[rope][:, None]  # [n, 1, D]
        cpu_attention = self.device.type == "cpu" and not self.split_attention
        if cpu_attention:  # what each token sees of the cached text, once for every layer
            end = slots.stop
            visible = (None if mask is None and n == 1 else kernels.tree_visible(mask, n, n, end) if tree else
                       span[:end][None] <= q_pos[:, None])
            cpu_mask = additive_mask(visible)
        # Query heads that share a K/V head are folded into extra query rows ([kv, groups * n, D]), so attention
        # reads each cached K/V once instead of repeating it per query head. Row g*n + i is token i.
        h = self.model.model.embed_tokens(ids)  # [n, hidden]
        for i, (norm1, (w_qkv, b_qkv), o_proj, norm2, (w_gu, b_gu), act, down) in enumerate(self.layers):
            x = norm1(h)
            qkv = _product(x, w_qkv, b_qkv)
            q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                                 self.kv_heads * self.head_dim], dim=-1)
            q = q.view(n, self.heads, self.head_dim)
            k = k.view(n, self.kv_heads, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.k_cache[i][:, slots] = k.transpose(0, 1)
            self.v_cache[i][:, slots] = v.view(n, self.kv_heads, self.head_dim).transpose(0, 1)
            q = q.view(n, self.kv_heads, groups, self.head_dim).permute(1, 2, 0, 3).reshape(
                self.kv_heads, groups * n, self.head_dim)
            if self.split_attention:
                out = kernels.decode_attention(q, self.k_cache[i], self.v_cache[i], pos, b, n, self.scaling, self.pdl,
                                               mask)
            elif cpu_attention:  # the eager backend's CPU attention, over the cached text only
                out = cached_attention(q, self.k_cache[i][:, :end], self.v_cache[i][:, :end], n, cpu_mask,
                                       self.scaling)
            else:
                out = kernels.masked_sdpa(q, self.k_cache[i], self.v_cache[i], pos, b, n, self.scaling, mask)
            # out: [kv, groups*n, D]
            out = out.view(self.kv_heads, groups, n, self.head_dim).permute(2, 0, 1, 3).reshape(n, -1)
            h = h + o_proj(out)
            x = norm2(h)
            gate, up = _product(x, w_gu, b_gu).split(self.intermediate, dim=-1)
            h = h + down(act(gate) * up)
        return self.model.model.norm(h)

    def _step(self, ids: torch.Tensor, span: int, tree: bool = False) -> torch.Tensor:
        """The fused forward of n <= kernels.MAX_FUSED_TOKENS tokens (spec/kernels.py): ids [n] -> fp32 logits
        [n, vocab]. Same caches and the same rounding of every intermediate as `_body` + `_head`, except each
        product's RMSNorm input (its scale is applied after the sum); the order of summation inside the products
        differs, and products that run a library's kernel (`kernels.library_gemv`: int4 weights, and the model's own
        at kernels.LIBRARY_PLAIN's token counts) round their sums to the model's dtype first. With `tree`, the
        tokens sit at `tree_positions` under the `tree` mask."""
        n = ids.shape[0]
        cos, sin, mask = self.cos, self.sin, None
        if tree:  # the slots' rows of the rotary tables become the tree positions' rows
            slots = self.pos + torch.arange(n, device=ids.device)
            self.cos_tree.index_copy_(0, slots, self.cos[self.tree_positions[:n]])
            self.sin_tree.index_copy_(0, slots, self.sin[self.tree_positions[:n]])
            cos, sin, mask = self.cos_tree, self.sin_tree, self.tree[: n + 1]
        # The residual stream [n, hidden], updated in place. A kernel launched without PDL, first of the forward: the
        # attention reads the cache slots of earlier forwards before its PDL wait (kernels.decode_attention).
        h = self.model.model.embed_tokens(ids)
        q = torch.empty((self.heads, n, self.head_dim), dtype=h.dtype, device=h.device)  # head-major
        act = torch.empty((n, self.intermediate), dtype=h.dtype, device=h.device)
        head = self.head_weight
        logits = torch.empty((n, head.shape[0]), dtype=torch.float32, device=h.device)  # every row, as eager
        # Query heads that share a K/V head are the attention's extra rows, as in `_body`: [kv, groups * n, D].
        q_rows = q.view(self.kv_heads, self.heads // self.kv_heads * n, self.head_dim)
        norm = self.model.model.norm
        # Each normed product's norm and weight, in order: the next one's go to the ADD before it, whose epilogue
        # may make that product's input (`kernels.gemv`'s norm_next; library products only, else None).
        normed_products = [(layer[0], weights[0]) for layer, weights in zip(self.layers, self.step_weights)]
        normed_products.append((norm, head))
        normed = None
        for i, ((norm1, (_, b_qkv), _, norm2, _, _, _), (w_qkv, w_o, w_gu, w_down)) in enumerate(
                zip(self.layers, self.step_weights, strict=True)):
            kernels.qkv_rope(h, norm1.weight, norm1.variance_epsilon, w_qkv, b_qkv, cos, sin, self.pos, q,
                             self.k_cache[i], self.v_cache[i], self.heads, self.kv_heads, pdl=self.pdl, normed=normed,
                             a8=self.a8)
            out = kernels.decode_attention(q_rows, self.k_cache[i], self.v_cache[i], self.pos, span, n, self.scaling,
                                           self.pdl, mask)
            normed = kernels.gemv(out, w_o, h, kernels.ADD, head_major=self.head_dim, pdl=self.pdl,
                                  norm_next=(norm2.weight, norm2.variance_epsilon, w_gu), a8=self.a8)
            kernels.gemv(h, w_gu, act, kernels.SILU_MUL, norm2.weight, norm2.variance_epsilon, pdl=self.pdl,
                         normed=normed, a8=self.a8)
            next_norm, next_weight = normed_products[i + 1]
            normed = kernels.gemv(act, w_down, h, kernels.ADD, pdl=self.pdl,
                                  norm_next=(next_norm.weight, next_norm.variance_epsilon, next_weight), a8=self.a8)
        kernels.gemv(h, head, logits, kernels.LOGITS, norm.weight, norm.variance_epsilon, pdl=self.pdl,
                     normed=normed, a8=self.a8)
        return logits[:, : self.vocab]

    def _logits(self, ids: torch.Tensor, span: torch.Tensor, keep: int | None = None, tree: bool = False
                ) -> torch.Tensor:
        """fp32 logits of the last `keep` (default all) positions of `ids`: the fused kernels for up to
        `fused_tokens` tokens (a tree's, up to kernels.MAX_KERNEL_TOKENS: one pass over the weights for all its
        nodes), else the layer stack (whose head then runs on those positions only)."""
        n = ids.shape[0]
        first = n - (keep or n)
        if n <= self.fused_tokens or (tree and self.fused_step and n <= kernels.MAX_KERNEL_TOKENS):
            return self._step(ids, span.shape[0], tree)[first:]
        return self._head(self._run_body(ids, span, tree)[first:])

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> fp32 logits [n, vocab], rounded like the eager backend (head in the model's dtype)."""
        return self.model.lm_head(hidden)[:, : self.vocab].float()

    def _span(self, end: int) -> torch.Tensor:
        span = min(-(-end // SPAN_STEP) * SPAN_STEP, self.k_cache[0].shape[1])
        if span not in self.spans:
            self.spans[span] = torch.arange(span, device=self.device)
            if self.compiled:
                torch._dynamo.maybe_mark_dynamic(self.spans[span], 0)  # a kernel may still need it fixed
        return self.spans[span]

    def _run_body(self, ids: torch.Tensor, span: torch.Tensor, tree: bool = False) -> torch.Tensor:
        if not self.compiled:
            return self.body(ids, self.pos, span, tree)
        if ids.shape[0] > 1:
            # One compilation for the n >= 2 (n = 1, a draft step, gets its own, specialised one). Not
            # `mark_dynamic(min=2, max=capacity)`: a range is a promise, and the compiled fp32 stack of the real
            # 1.5B broke it (dynamo found a guard `1536 * n < 5242880` inside it and raised instead of recompiling).
            torch._dynamo.maybe_mark_dynamic(ids, 0)
        # Compiled code is cached per code object and guarded on `self`: every GraphModel in the process adds two
        # entries to `_body`'s cache, past dynamo's default limit of 8 after four models. The raised limit holds
        # only while this model compiles.
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return self.body(ids, self.pos, span, tree)

    def _graph(self, n: int, span: torch.Tensor, tree: bool = False
               ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        """The graph for n tokens over `span`, captured on first use (after warm-up runs on a side stream, which
        write the same cache positions the real replay is about to write, so they change nothing). One run is enough
        for the fused kernels: it compiles or loads each kernel and allocates what they allocate on first use, and a
        second only cost warm-start time (captures are Python-bound: 25,392 launches in the Qwen pair's prepare). A
        compiled layer stack gets two, so that no guard re-checked on a second call can recompile during capture."""
        key = (n, span.shape[0], tree)
        if key not in self._graphs:
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2 if self.compiled else 1):
                    self._logits(ids, span, tree=tree)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with no_collection(), torch.cuda.graph(graph, pool=self._pool):
                logits = self._logits(ids, span, tree=tree)
            self._graphs[key] = (graph, ids, logits)
        return self._graphs[key]

    # ---- the Model interface ---------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, ids: Sequence[int] | torch.Tensor, keep: int | None = None, tree=None) -> torch.Tensor:
        """Append `ids` [n] to the cached text; fp32 logits of the last `keep` (default all n) positions. `tree`: a
        token tree's layout (spec/tree.py's Layout: RoPE positions [n], visible slots [n, length + n]); the tokens
        still fill slots length..length+n-1, and every slot they may not see must lie in the last 64 (a tree of up
        to 64 nodes, with what precedes them visible to all)."""
        if not isinstance(ids, torch.Tensor):
            # non_blocking from pageable memory is staged at once and never waits for the device.
            ids = torch.tensor(list(ids), dtype=torch.long).to(self.device, non_blocking=True)
        ids = ids.to(device=self.device, dtype=torch.long).view(-1)
        n = ids.shape[0]
        keep = keep or n
        if n == 0:
            raise ValueError("forward needs at least one new token")
        if self.length + n > self.max_length:
            raise ValueError(f"{self.name}: {self.length + n} positions exceed the static cache of "
                             f"{self.max_length} (pass a larger max_length)")
        if self.length + n > self.k_all.shape[2]:  # a CPU's cache, grown (CUDA's holds max_length from the start)
            self._allocate(min(max(self.length + n, 2 * self.k_all.shape[2]), self.max_length))
        if tree is None and 1 < n <= self.stepwise:  # the same tokens, one step each: measured cheaper
            return torch.cat([self.forward(ids[i : i + 1]) for i in range(n)])[n - keep :]
        span = self._span(self.length + n)
        self.pos.fill_(self.length)
        rows = None if tree is None else self._load_tree(tree, n)
        # After `prepare`, only the forwards it captured replay graphs: a prompt's length would cost a capture.
        # A tree's graphs (one per node count, up to 64 tokens in one pass) are captured by `prepare(tree_tokens=)`
        # or on first use.
        if self.graphs and n <= (MAX_GRAPH_TOKENS if rows else self.prepared or self.graph_tokens):
            graph, static_ids, logits = self._graph(n, span, tree=rows is not None)
            static_ids.copy_(ids)
            graph.replay()
            out = logits[n - keep :].clone()  # the next replay overwrites `logits`
        elif self.prefill_chunk:
            return self._prefill(ids, keep, rows)
        else:
            out = self._logits(ids, span, keep, tree=rows is not None)
        self.length += n
        return out

    def _load_tree(self, layout, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A token tree's layout into the buffers the kernels read: `self.tree` = [base, a bit per slot of the last
        64 for each token], `self.tree_positions`; returns (bits [n], positions [n]) for forwards in chunks."""
        if layout.shape != (n, self.length + n):
            raise ModelError(f"{self.name}: a tree layout of {layout.shape} does not fit {n} tokens after "
                             f"{self.length} cached ones")
        if n > MAX_TREE_TOKENS:
            raise ModelError(f"{self.name}: a tree forward takes at most {MAX_TREE_TOKENS} tokens (64 nodes and the "
                             f"token they grow from), got {n}")
        if layout.window is None:
            raise ModelError(f"{self.name}: a tree's hidden slots must lie in the last {kernels.TREE_WINDOW} slots "
                             "of the text")
        # the mask made on the host with the layout (kernels.tree_mask): one copy, no kernels to compute it
        window, positions = layout.window.to(self.device), layout.positions.to(self.device)
        self.tree[: n + 1].copy_(window)
        self.tree_positions[:n].copy_(positions)
        return window[1:], positions

    def _load_chain_tree(self, n: int) -> None:
        """A chain of n tokens from slot 0 into the tree buffers (token i sees slots 0..i, at position i): what tree
        forwards read while they are captured or timed with no real tree at hand."""
        self.tree[: n + 1].copy_(torch.tensor(kernels.tree_mask([range(i + 1) for i in range(n)], 0, n)))
        self.tree_positions[:n].copy_(torch.arange(n))

    def _prefill(self, ids: torch.Tensor, keep: int, tree: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        """A forward longer than the prepared graphs (a prompt, or a tree of more than `prefill_chunk` nodes: `tree`
        = its (bits, positions), each chunk's moved to the front of the buffers; the mask is over slots, so a later
        chunk sees the earlier chunks' nodes it descends from), as chunks of `prefill_chunk` tokens through the
        fused kernels: each chunk replays the graph of a full chunk (the last one padded: the padding's cache
        entries lie after the text, so they are masked out and overwritten like any stale entry), or runs
        without a graph where the padding would overrun the cache. On an H200 a 64-token prompt of the 1.5B Qwen
        took 70-100 ms through the uncompiled layer stack and 41 ms as eager chunks (each kernel launch waits on
        Python); a 16-token forward's graph replayed in 1.73 ms there (verify_cost), so ~7 ms for the four chunks."""
        first = ids.shape[0] - keep  # the first position whose logits are returned
        out = []
        for start in range(0, ids.shape[0], self.prefill_chunk):
            chunk = ids[start : start + self.prefill_chunk]
            n = chunk.shape[0]
            self.pos.fill_(self.length)
            if tree is not None and start:
                self.tree[1 : n + 1].copy_(tree[0][start : start + n])
                self.tree_positions[:n].copy_(tree[1][start : start + n])
            padded = self.length + self.prefill_chunk
            if self.graphs and padded <= self.k_cache[0].shape[1]:
                graph, static_ids, logits = self._graph(self.prefill_chunk, self._span(padded), tree=tree is not None)
                static_ids[:n].copy_(chunk)  # the rest keeps earlier (valid) ids: the padding
                graph.replay()
                logits = logits[:n]
            else:
                logits = self._step(chunk, self._span(self.length + n).shape[0], tree=tree is not None)
            if start + n > first:
                out.append(logits[max(0, first - start) :].clone())  # the next replay overwrites `logits`
            self.length += n
        return torch.cat(out)

    @torch.no_grad()  # as forward: the captures write the caches, which torch refuses with grad on (fp32 eager stack)
    def prepare(self, tokens: int, context: int, tree_tokens: int = 0) -> None:
        """Capture now the graphs of forwards of 1..`tokens` new tokens, and of a prompt's chunk, at every span a
        text of up to `context` positions reaches, so that no capture happens while a generation is timed or
        served; with `tree_tokens`, also those of token trees' forwards of 1..`tree_tokens` tokens (at most 64: a
        verify of N nodes reads N + 1, a draft's depth its frontier), which are otherwise captured on first use,
        mid-generation. Leaves the cache reset (the captures write scratch entries at position 0)."""
        if not self.graphs:
            return
        top = min(context, self.max_length)
        shapes = []
        for end in range(SPAN_STEP, top + SPAN_STEP, SPAN_STEP):
            span = self._span(min(end, top))
            sizes = range(1, min(tokens, self.graph_tokens, span.shape[0]) + 1)
            if self.prefill_chunk and self.prefill_chunk <= span.shape[0]:  # a prompt's chunks
                sizes = sorted({*sizes, self.prefill_chunk})
            shapes += [(n, span, False) for n in sizes]
            shapes += [(n, span, True) for n in range(1, min(tree_tokens, MAX_GRAPH_TOKENS, span.shape[0]) + 1)]
        if tree_tokens:  # the warm-up runs read the tree buffers
            self._load_chain_tree(min(tree_tokens, MAX_GRAPH_TOKENS))
        if self.fused_tokens and not self.compiled:
            # The captures' kernel variants (~40 a model, a few per product shape and per span), compiled all at
            # once on a thread pool instead of one after another as the captures reach them: the cold start's
            # largest cost (llama-random's cold prepare on an H200: 31.6 s before, 13.9-14.4 s with it).
            with kernels.compiling_ahead() as ahead:
                for n, span, tree in shapes if ahead else ():
                    self.pos.fill_(0)
                    self._logits(torch.zeros(n, dtype=torch.long, device=self.device), span, tree=tree)
        for n, span, tree in shapes:
            self.pos.fill_(0)
            self._graph(n, span, tree)
        self.prepared = max(self.prepared, min(tokens, self.graph_tokens))
        if self.quant != "none" and self.prepared > 1:
            span = self._span(min(SPAN_STEP, top))
            self.stepwise = stepwise_limit({n: self._replay_ms(n, span) for n in range(1, self.prepared + 1)})
        self.reset()

    def replay_ms(self, n: int, tree: bool = False, reps: int = 20) -> float:
        """Milliseconds a forward of n tokens (a token tree's, as a chain-shaped tree, with `tree`) takes over the
        first span: the median of three timings of `reps` replays of its graph, captured now if it was not. Writes
        scratch at position 0 and leaves the cache reset; for benchmarks and the kernel tuner (CUDA graphs only)."""
        if not self.graphs:
            raise ModelError(f"{self.name}: timing a forward's replay needs CUDA graphs")
        if tree:  # the warm-up and the replays read the tree buffers
            self._load_chain_tree(n)
        span = self._span(min(SPAN_STEP, self.max_length))
        ms = statistics.median(self._replay_ms(n, span, reps, tree) for _ in range(3))
        self.reset()
        return ms

    def _replay_ms(self, n: int, span: torch.Tensor, reps: int = 10, tree: bool = False) -> float:
        """Milliseconds per replay of the captured n-token graph over `span` (writes scratch at position 0)."""
        graph = self._graph(n, span, tree)[0]
        self.pos.fill_(0)
        graph.replay()
        start = sync_time(self.device)
        for _ in range(reps):
            graph.replay()
        return (sync_time(self.device) - start) / reps * 1e3

    def rollback(self, length: int) -> None:
        if length < 0 or length > self.length:
            raise ValueError(f"cannot roll a cache of {self.length} positions back to {length}")
        self.length = length

    def keep(self, start: int, slots: Sequence[int] = ()) -> None:
        """Keep the first `start` cached positions and then those at `slots` (a token tree's accepted path, in
        order): their keys and values move to start, start + 1, ..; the rest is forgotten. A chain's path is a
        plain rollback."""
        slots = list(slots)
        if slots != list(range(start, start + len(slots))):
            if start + len(slots) > self.length or any(not start <= s < self.length for s in slots):
                raise ValueError(f"cannot keep slots {slots} after {start} of {self.length} cached positions")
            index = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
            for cache in (self.k_all, self.v_all):  # gathered first, so a slot moved onto is read before written
                cache[:, :, start : start + len(slots)] = cache[:, :, index]
        self.rollback(start + len(slots))

    def reset(self) -> None:
        self.length = 0

    def weight_bytes(self) -> int:
        """Bytes one decode step must read: every parameter once (tied embeddings counted once); with int8 / int4
        weights, the packed matrices and head in place of theirs (the model's own copies stay, unread)."""
        if self.cpu_packed:  # the packed layers' buffers; the joined ones are slices of theirs
            return packed_bytes(self.model)
        total = parameter_bytes(self.model)
        if self.quant == "none":
            return total
        # The fused matrices are the projections' own parameters, sliced; a tied head is still the embedding.
        replaced = [w for _, (w_qkv, _), o, _, (w_gu, _), _, d in self.layers
                    for w in (w_qkv, o.weight, w_gu, d.weight)]
        head = self.model.lm_head.weight
        if head.data_ptr() != self.model.model.embed_tokens.weight.data_ptr():
            replaced.append(head)
        packed = sum(w.nbytes() for layer in self.step_weights for w in layer) + self.head_weight.nbytes()
        return total - sum(w.numel() * w.element_size() for w in replaced) + packed
