"""Split-KV attention for decode steps and verify passes (Triton, CUDA, half precision).

A decode step attends a handful of new tokens to the whole cached text. A general attention kernel (SDPA's flash
or cuDNN backends) parallelises over heads and query blocks: at batch 1 with 8 K/V heads that is 8 thread blocks,
each streaming its head's entire cache, on a GPU with 132 multiprocessors. On an H200 that cost 19 µs per 8B layer
at a 512-token context, ~12% of a decode step, for 2 MB of K/V. Splitting the keys instead (flash-decoding) puts
every multiprocessor to work:

- `attention_partial`: one program per (K/V head, chunk of CHUNK cached positions) computes, for all query rows of
  that head (query heads sharing the K/V head folded in as rows; past MAX_ROWS, a program per block of them), the
  chunk's softmax numerator `o`, its row maxima `m` and sums `l` in fp32; chunks past the last position any row may
  see load nothing, and a row that sees no key of a chunk stores no `o` there (the combine reads none);
- the combine rescales the chunks to a common maximum and normalises. For a few rows (a one-token step's) the
  head's last program to finish does it, in the same kernel (it learns it is last from a counter per head); a
  verify's rows, and any with many partial sums, get a second kernel, `attention_combine`, a program per (head, row)
  (`ONE_PASS_ELEMENTS` says where, from what it measured);
- `attention_parts`, for a verify of 17-64 rows a head (`PART_RANGE`): one kernel. A program takes PART_ROWS of a
  head's rows over a run of consecutive chunks, a running softmax over them, and the last of a row block's programs
  to finish combines the runs: the two kernels' chain, not their bytes, was what a 5-16-token verify paid.

`decode_attention` is a `torch.library` custom op (opaque to torch.compile, capturable in a CUDA graph). The causal
rule is by position: row r (token r % n) sees cache positions <= pos + r % n, so stale entries after the text are
never read. Its rounding differs from SDPA's and between a 1-token step and a K+1-token verify (measured on the
8B architecture: up to 0.14 in a logit, against 0.28 between the graph and eager backends), so in bf16 speculative
and plain greedy decoding may part at a near-tie (docs/exactness.md says when that is allowed); in fp32 the kernel
is not used. The import of Triton is deferred to first use; nothing here runs without CUDA.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from spec.models.base import cache_root
from spec.models.quant import GROUP, KERNEL_FORMATS, PACKED_AS, W4A8, PackedWeight, int4_library_mm

MAX_ROWS = 128  # query rows (query heads per K/V head x new tokens) one program holds; more are split over programs
MAX_ROW_BLOCKS = 4  # ... up to this many a head and chunk (a 64-node tree of 4-6 query heads a K/V head); more: SDPA


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def available() -> bool:
    """Triton and a CUDA device are both present."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def suits_head_dim(dim: int) -> bool:
    """The kernel's tiles need a power-of-two head size of at least 16 (tensor-core operands)."""
    return dim >= 16 and dim & (dim - 1) == 0


def _chunk(span: int, rows_n: int = 1) -> int:
    """Cached positions per program: 32 up to a 1024-token span (>= 16 programs per head), at most 128 beyond; at
    least 64 where a head's query rows fill more than one program (a tree of more than 32 nodes of the 8B): on an
    H100 (session 25, benchmarks/h100/session25/) 64 cut the 8B's 64-node verify from 7.05 to 6.83 ms and cost its
    32-node one (one program's 128 rows) 6.36 -> 6.47, its 16-token one 5.94 -> 5.95."""
    return min(128, max(64 if rows_n > MAX_ROWS else 32, _pow2(span // 32)))


TREE_WINDOW = 64  # slots a tree forward's mask bits cover: the last 64 of the text, one bit each in an int64


def tree_mask(seen: Sequence[Sequence[int]], start: int, end: int) -> list[int] | None:
    """The tree mask the kernels read (`tree_visible`), made on the host: [base, bits of each token], base = the
    first of the last TREE_WINDOW slots before `end`; token i sees every slot before `start` (the true text) and the
    slots in seen[i] (>= start: its ancestors and itself). None where a token hides a slot before base, which the
    mask cannot express. Bit j stands for slot base + j; bit 63 is the int64 sign bit."""
    base = max(0, end - TREE_WINDOW)
    text = (1 << (start - base)) - 1 if start > base else 0  # the true text's slots in the window: all seen
    out = [base]
    for slots in seen:
        if base > start and set(range(start, base)) - set(slots):
            return None
        bits = text | sum(1 << (slot - base) for slot in slots if slot >= base)
        out.append(bits - (1 << 64) if bits >= 1 << 63 else bits)
    return out


def tree_visible(tree: torch.Tensor, rows_n: int, n_tokens: int, span: int) -> torch.Tensor:
    """[rows, span] bool from a tree mask `tree` = [base, bits of token 0, .., bits of token n-1] (int64): row r
    (token r % n_tokens) sees every slot before base and the slots base + j whose bit j is set, j < 64."""
    keys = torch.arange(span, device=tree.device)
    rel = keys - tree[0]
    window = (rel >= 0) & (rel < TREE_WINDOW)
    bits = tree[1:][torch.arange(rows_n, device=tree.device) % n_tokens]  # [rows]
    marked = ((bits[:, None] >> rel.clamp(0, 63)[None, :]) & 1) != 0
    return (rel < 0)[None, :] | (window[None, :] & marked)


def masked_sdpa(q, k_cache, v_cache, pos, span: int, n_tokens: int, scale: float,
                tree: torch.Tensor | None = None) -> torch.Tensor:
    """The same attention by PyTorch's SDPA, same arguments and masks (causal, or a token tree's): for fp32 and
    CPUs, and for prefills, whose rows one program cannot hold."""
    rows_n = q.shape[1]
    seen = pos + torch.arange(rows_n, device=q.device) % n_tokens
    allowed = torch.arange(span, device=q.device)[None, :] <= (pos + n_tokens - 1)
    if tree is None:
        allowed = allowed & (torch.arange(span, device=q.device)[None, :] <= seen[:, None])
    else:
        allowed = allowed & tree_visible(tree, rows_n, n_tokens, span)
    return torch.nn.functional.scaled_dot_product_attention(
        q[None], k_cache[None, :, :span], v_cache[None, :, :span], attn_mask=allowed[None, None], scale=scale)[0]


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: each kernel of a step starts loading its weights while the one before it
    finishes (Hopper and later). It changes no result, only when kernels start; the wrappers below take `pdl`."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _triton():
    from spec.models import triton_kernels  # imports Triton, which CPU-only machines lack

    return triton_kernels


_AHEAD: contextvars.ContextVar[bool] = contextvars.ContextVar("spark_spec_compiling_ahead", default=False)


def _run(kernel, grid, *args, **options) -> None:
    """Launch a Triton kernel; inside `compiling_ahead`, only start compiling the variant these arguments need."""
    if _AHEAD.get():
        kernel.warmup(*args, grid=grid, **options)
    else:
        kernel[grid](*args, **options)


@contextlib.contextmanager
def compiling_ahead(workers: int | None = None, ignore_errors: bool = False):
    """A dry run: inside the block the wrappers below launch nothing (their outputs stay unwritten) and each
    kernel variant they would launch compiles on a pool of `workers` threads, all at once (Triton's
    AsyncCompileMode); leaving the block waits for the compilations. Run once over every shape a model will launch,
    it turns a cold start's compilations, one after another, into one parallel batch (Triton's compiler releases
    the GIL in its passes and runs ptxas as a subprocess). Yields False, and changes nothing, where Triton lacks
    AsyncCompileMode (before 3.4) or is missing. With `ignore_errors`, a variant that fails to compile is left for
    its launch to report (the kernel tuner's candidates); otherwise the failure is raised when the block ends."""
    try:
        import triton

        mode = triton.AsyncCompileMode
    except (ImportError, AttributeError):
        yield False
        return
    with ThreadPoolExecutor(workers or min(16, os.cpu_count() or 1)) as pool, mode(pool, ignore_errors=ignore_errors):
        token = _AHEAD.set(True)
        try:
            yield True
        finally:
            _AHEAD.reset(token)


# The most partial sums (rows x chunks x head size) the one-pass combine takes: its last program reads them alone,
# while the second kernel spreads them over a program per row. It pays where the rows are few (a one-token step, a
# short catch-up): on an H200 at a 512-token span it saves about 20 µs of a 1B step (4096 sums a head) and costs
# 20-30 µs of an 8B step (8192), benchmarks/h200/step_variants-onepass.json. 16384 keeps both models on it, the
# configuration benchmarks/h200/bench_engine-bf16.json measured; ptxas reports no spills there (sm_90, 153 registers
# for 8 rows of 128).
ONE_PASS_ELEMENTS = 16384


@functools.cache
def _counters(device: torch.device, size: int) -> torch.Tensor:
    """Arrival counters for kernels whose last program to finish does the rest (`triton_kernels.last_to_finish`:
    the one-pass attention, a head each; a split product, a row block each): zero between launches (the last
    program resets its own). Allocated once, outside any graph capture (a graph's warm-up runs first), and shared by
    every call on the device: the kernels run on one stream, and each waits for the one before it (PDL's wait
    included) before it touches the counters, so two launches never overlap."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("run the fused kernels once before capturing a CUDA graph (their counters are "
                           "allocated on first use)")
    return torch.zeros(size, dtype=torch.int32, device=device)


@torch.library.custom_op("spark_spec::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, span: int,
                     n_tokens: int, scale: float, pdl: bool = False, tree: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [kv_heads, rows, D] (row r is token r % n_tokens, in cache slot pos + r % n_tokens) over the
    first `span` positions of the caches [kv_heads, capacity, D]; returns [kv_heads, rows, D] in q's dtype. Causal,
    or with `tree` ([base, a 64-bit mask per token], int64; `tree_visible`) each token sees the slots before base
    and, from base on, its marked ancestors and itself.

    With `pdl`, the slots before `pos` are read before the kernel waits for the one launched before it, so they must
    be written before the forward starts: a forward begins with a kernel launched without PDL (graph.py: the
    embedding's row, after `pos.fill_`), which starts once all work before it has finished; only slots pos.. may be
    written within the forward (by the q/k/v kernel or an index_put before this one)."""
    heads, rows_n, dim = q.shape
    if rows_n > MAX_ROWS * MAX_ROW_BLOCKS:  # (a prompt through the layer stack)
        return masked_sdpa(q, k_cache, v_cache, pos, span, n_tokens, scale, tree)
    q = q.contiguous()
    blocks = -(-rows_n // MAX_ROWS)  # programs a (head, chunk): a 64-node tree of the 8B's 256 rows takes two
    rows = max(16, _pow2(rows_n)) if blocks == 1 else MAX_ROWS  # the tile's height: at least a tensor core's 16
    chunk = _chunk(span, rows_n)
    splits = -(-span // chunk)
    width = max(16, _pow2(splits))
    # A few rows (a one-token step's query heads) are combined by each head's last program to finish, in the
    # same kernel; more (a verify's) by a second kernel, a program per row.
    one_pass = _pow2(rows_n) if blocks == 1 and _pow2(rows_n) * width * dim <= ONE_PASS_ELEMENTS else 0
    if PART_ROWS and not one_pass and PART_RANGE[0] <= rows_n <= PART_RANGE[1]:
        return _attention_in_parts(q, k_cache, v_cache, pos, span, n_tokens, scale, pdl, tree)
    o = torch.empty((heads, splits, rows * blocks, dim), dtype=torch.float32, device=q.device)
    m = torch.empty((heads, splits, rows * blocks), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    out = torch.empty_like(q)
    tk = _triton()
    _run(tk.attention_partial, (heads, splits, blocks), q, k_cache, v_cache, pos, pos if tree is None else tree, o, m,
         l, out, _counters(q.device, heads), rows_n, n_tokens, scale, q.stride(0), k_cache.stride(0), splits, D=dim,
         ROWS=rows, CHUNK=chunk, SPLITS=width, ONE_PASS=one_pass, PDL=pdl, PRECISION=_precision(q),
         TREE=tree is not None, RSTRIDE=rows * blocks, num_warps=4, num_stages=2, launch_pdl=pdl)
    if not one_pass:
        _run(tk.attention_combine, (heads, rows_n), o, m, l, out, rows_n, splits, D=dim, ROWS=rows * blocks,
             SPLITS=width, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


# A verify's attention in one kernel (`_attention_in_parts`) for PART_RANGE query rows a K/V head where the one-pass
# combine does not take them, PART_ROWS of them a program (0: never; SPARK_SPEC_PART_ROWS, read when this module is
# imported, sets it). On an H100 (session 26, benchmarks/h100/session26/, alternated in one process) 16 rows a program
# took the 8B's 8 / 16-token forwards from 6.00 / 6.13 ms to 5.91 / 6.09 and a 16-node tree's from 6.17 to 6.12, the
# 1B's 8 / 16-token forwards from 1.30 / 1.36 to 1.27 / 1.34 and a frontier of 8 nodes from 1.315 to 1.284; but the
# 8B's 32 / 64-node trees (128 / 256 rows) from 6.51 / 7.06 to 6.62 / 7.10, and 64 rows a program lost everywhere.
# Forwards of 2-4 tokens of the 8B (8-16 rows) were not measured and keep the two kernels.
PART_ROWS = int(os.environ.get("SPARK_SPEC_PART_ROWS", "16"))
if PART_ROWS and (PART_ROWS < 16 or PART_ROWS & (PART_ROWS - 1)):
    raise ValueError(f"SPARK_SPEC_PART_ROWS={PART_ROWS}: 0 (off) or a power of two of at least 16 (a tile's rows)")
PART_RANGE = (17, 64)
PART_CHUNK = 32  # cached positions a step of its running softmax takes


def part_layout(rows_n: int, rows: int, dim: int, heads: int, chunks: int, device: torch.device) -> tuple[int, int]:
    """How `_attention_in_parts` deals a head's text out: (parts, combine rows). Enough parts that the programs (heads
    x row blocks x parts) fill the multiprocessors, as many as the chunks, and few enough that the last program's
    combine holds at most ONE_PASS_ELEMENTS partial sums at a time (its rows, in steps of up to 16, x the parts x the
    head size)."""
    blocks = -(-rows_n // rows)
    combine_rows = min(16, _pow2(rows_n))  # (rows, a power of two of at least 16, is a multiple of it)
    most = 1 << max(0, (ONE_PASS_ELEMENTS // (combine_rows * dim)).bit_length() - 1)
    sms = _multiprocessors(device) or 132  # (no GPU: Triton's interpreter; an H100's / H200's count)
    return max(1, min(sms // (heads * blocks), most, chunks)), combine_rows


def _attention_in_parts(q, k_cache, v_cache, pos, span, n_tokens, scale, pdl, tree):
    """A verify's attention in one kernel (`triton_kernels.attention_parts`): a program per (K/V head, part of the
    text, PART_ROWS query rows) runs a softmax over its part's chunks, one after another, and the block's last
    program to finish combines the parts."""
    heads, rows_n, dim = q.shape
    rows = max(16, min(PART_ROWS, _pow2(rows_n)))
    blocks = -(-rows_n // rows)
    parts, combine_rows = part_layout(rows_n, rows, dim, heads, -(-span // PART_CHUNK), q.device)
    o = torch.empty((heads, parts, rows * blocks, dim), dtype=torch.float32, device=q.device)
    m = torch.empty((heads, parts, rows * blocks), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    out = torch.empty_like(q)
    _run(_triton().attention_parts, (heads, parts, blocks), q, k_cache, v_cache, pos, pos if tree is None else tree,
         o, m, l, out, _counters(q.device, heads * blocks), rows_n, n_tokens, scale, q.stride(0), k_cache.stride(0),
         parts, span, D=dim, ROWS=rows, CHUNK=PART_CHUNK, SPLITS=_pow2(parts), RB=combine_rows, PDL=pdl,
         PRECISION=_precision(q), TREE=tree is not None, RSTRIDE=rows * blocks, num_warps=4, num_stages=2,
         launch_pdl=pdl)
    return out


@decode_attention.register_fake
def _(q, k_cache, v_cache, pos, span, n_tokens, scale, pdl=False, tree=None):
    return torch.empty_like(q)


# ---- The fused one-token step ----------------------------------------------------------------------------------
#
# A decode step of one token is a chain of matrix-vector products. Run as cuBLAS calls with torch.compile's fused
# kernels between them it costs about ten kernels per layer, and on an H200 each kernel boundary costs a few
# microseconds of a 1B step's ~60 per layer. These kernels fold the small work into the products themselves:
#
#   qkv_rope:      RMSNorm -> q/k/v product (+ bias) -> rotary embedding -> q out, k and v into the cache
#   gemv(ADD):     o or down product, added into the residual stream in place
#   gemv(SILU_MUL): RMSNorm -> gate and up products -> SiLU(gate) * up
#   gemv(LOGITS):  final RMSNorm -> head product -> fp32 logits
#
# so a layer is five kernels with the split-KV attention's two. Intermediates are rounded to the model's dtype
# where the transformers model rounds them (each product, each rotary term, SiLU, the residual add); the one
# difference is RMSNorm, whose scale is summed in the same pass as the product and applied after it (so no
# kernel waits on a separate reduction), and the order of summation inside the products. Each program owns `BN`
# output rows and streams them over K in `BLOCK_K` columns, summing in fp32; no program writes what another reads
# (but a split product's partial sums, added by its row block's last program: `input_splits`).
#
# The same wrappers take 2-64 tokens ([M, K] inputs) for a fused verify (up to 16; a token tree's, up to 64):
# tensor-core products with the tokens padded to 16, 32 or 64 columns (gemv_rows), q/k/v as a product into fp32 and
# a rotary kernel a head (rope_rows). Their tiles add a software-pipelining depth and are tuned apart (kinds
# "<kind>_rows", at 9 tokens; past 16 tokens "<kind>_rows32" and "_rows64", or WIDE_TILES). Over packed weights,
# 2-MAX_FEW_TOKENS tokens instead run the one-token kernel's loop for each token over each tile it loads (gemv_few,
# "<kind>_few@<format>", else `few_tile`).

ADD, SILU_MUL, LOGITS, RAW = 0, 1, 2, 3
MAX_FUSED_TOKENS = 16  # tokens a verify or a prompt's chunk takes at once: the width of one tensor-core tile
# Up to this many tokens (a draft's catch-up, a small tree's frontier), products over packed weights run on the CUDA
# cores (`gemv_few`, `few_tile`): 2.4x / 3.5x faster than the tensor cores for the 1B's int8 / int4 2-token forward
# on an H100, 1.3x / 1.8x at 4, slower past 4 (benchmarks/h100/session20/). SPARK_SPEC_FEW_TOKENS=0, read when this
# module is imported, sends them to the tensor-core kernel instead (how a benchmark measures what it gives).
MAX_FEW_TOKENS = 0 if os.environ.get("SPARK_SPEC_FEW_TOKENS") == "0" else 4


def few_tokens(tokens: int, quant: str) -> bool:
    """Whether a product of `tokens` tokens over weights in `quant` runs `gemv_few`: 2-MAX_FEW_TOKENS, packed."""
    return 1 < tokens <= MAX_FEW_TOKENS and quant != "none"


MAX_KERNEL_TOKENS = 64  # the most one fused forward takes (a token tree's verify): tiles of 16, 32 or 64 tokens

# From this many tokens on, a product over int4 weights that carry PyTorch's own layout (`PackedWeight.library`,
# added by GraphModel on CUDA in bf16) runs PyTorch's int4 kernel, tinygemm: a tensor-core kernel whose time hardly
# grows with the tokens, between two small kernels of ours for the input (RMSNorm, the attention's head-major
# output) and the epilogue (`library_gemv`). Timed alone against ours on an H100 (benchmarks/h100/session22/), the
# 1B's products at 1 / 2 / 4 tokens: gate/up 14.5 / 14.9 / 17.6 µs (ours 14.5 / 18.2 / 26.3), down 11.1 / 11.1 /
# 11.6 (ours 9.5 / 14.4 / 33.1), head 97 / 98 / 113 (ours 74 / 131 / 213): ours for one token, the library's for
# more. SPARK_SPEC_LIBRARY_TOKENS, read when this module is imported, moves the threshold (0: never; at least 2:
# one-token products are always ours).
LIBRARY_TOKENS = max(2, int(os.environ.get("SPARK_SPEC_LIBRARY_TOKENS") or 3) or MAX_KERNEL_TOKENS + 1)
# Between two library products the layer needs no launch of its own for the input: the epilogue that adds o's (or
# down's) product into the residual stream holds the token's whole row and writes the next product's RMS-normed
# input beside it (`gemv`'s `norm_next`), and rope_rows reads the q/k/v product in x's dtype as the library wrote
# it. Three launches a layer fewer: 9 around the attention where there were 12. SPARK_SPEC_LIBRARY_FUSED=0, read
# when this module is imported, launches them apart again (how a benchmark measures what it gives).
LIBRARY_FUSED = os.environ.get("SPARK_SPEC_LIBRARY_FUSED") != "0"


def token_range(text: str | None, default: tuple[int, int] | None) -> tuple[int, int] | None:
    """An environment setting's token counts: "lo-hi" as (lo, hi), 2 <= lo <= hi <= MAX_KERNEL_TOKENS ("9": 9-9),
    "0" as None (never), unset as `default`."""
    if not text:
        return default
    if text == "0":
        return None
    lo, _, hi = text.partition("-")
    try:
        tokens = int(lo), int(hi or lo)
    except ValueError:
        tokens = (0, 0)
    if not 2 <= tokens[0] <= tokens[1] <= MAX_KERNEL_TOKENS:
        raise ValueError(f"token counts {text!r}: want lo-hi with 2 <= lo <= hi <= {MAX_KERNEL_TOKENS}, or 0")
    return tokens


# Products of 33-64 tokens (a token tree's verify of more than 32 nodes) over the model's own weights run cuBLAS, with
# our input and epilogue kernels around it (`library_gemv`, torch.mm in tinygemm's place; its bf16 output is
# rounded before a q/k/v bias is added, and in fp32 it is full fp32 unless the process allows TF32). On an H100 the 8B's
# 64-node verify took 1.343 one-token steps against 1.460 with our 64-token tiles; at 2-32 tokens cuBLAS lost (32
# nodes 1.248 against 1.216, 16 tokens 1.200 against 1.125): the input gather, the epilogue and, between two
# library products, none of the launches the tiles fold in cost more than it saved (session 24,
# benchmarks/h100/session24/). LIBRARY_PLAIN = (lo, hi) tokens, or None; SPARK_SPEC_LIBRARY_PLAIN ("lo-hi", "0":
# never), read when this module is imported, moves it.
LIBRARY_PLAIN = token_range(os.environ.get("SPARK_SPEC_LIBRARY_PLAIN"), (33, MAX_KERNEL_TOKENS))


@contextlib.contextmanager
def plain_library(tokens: tuple[int, int] | None):
    """Inside the block, products over the model's own weights run cuBLAS for `tokens` = (lo, hi) tokens (None:
    never): how the tuner times our tiles at every width. Launches only: a captured graph keeps what it ran."""
    global LIBRARY_PLAIN
    saved, LIBRARY_PLAIN = LIBRARY_PLAIN, tokens
    try:
        yield
    finally:
        LIBRARY_PLAIN = saved


def library_product(weight: torch.Tensor | PackedWeight, tokens: int) -> bool:
    """Whether a product of `tokens` tokens over `weight` runs a library's kernel (`library_gemv`): PyTorch's int4
    kernel for int4 weights that carry its layout, cuBLAS for the model's own weights where LIBRARY_PLAIN says."""
    if isinstance(weight, PackedWeight):
        return weight.library is not None and tokens >= LIBRARY_TOKENS
    return LIBRARY_PLAIN is not None and LIBRARY_PLAIN[0] <= tokens <= LIBRARY_PLAIN[1]


# Tuned (rows per program, columns per iteration, warps) per GPU and product, keyed (kind, N, K) with kind one of
# qkv (N = half a head), add, silu_mul, logits (+ "_rows" for 2-16 tokens, "_rows32" / "_rows64" past 16, "@int4" /
# "@int8" / "@fp8" for packed weights: `tuned_kind`). `python -m spec.tune_kernels` measures them on the GPU at hand
# and writes <cache>/kernels/<GPU name>.json, which is read first; below is what it found on an H200 and an H100.
# SPARK_SPEC_KERNEL_TABLE=0 ignores both (the rules alone: how a benchmark measures what tuning gave); it is read
# once a process and GPU (`_tuned` is cached), so set it before the process starts.
TUNED: dict[str, dict[tuple[str, int, int], tuple[int, ...]]] = {
    "NVIDIA H200": {  # Llama-3.1-8B and Llama-3.2-1B (benchmarks/h200/tune_kernels.json)
        ("qkv", 64, 4096): (2, 512, 4),
        ("add", 4096, 4096): (8, 512, 8),
        ("silu_mul", 14336, 4096): (8, 128, 4),
        ("add", 4096, 14336): (8, 512, 8),
        ("logits", 128256, 4096): (16, 256, 4),
        ("qkv", 32, 2048): (2, 512, 4),
        ("add", 2048, 2048): (8, 1024, 8),
        ("silu_mul", 8192, 2048): (8, 128, 4),
        ("add", 2048, 8192): (8, 1024, 8),
        ("logits", 128256, 2048): (16, 128, 4),
        # 2-16 tokens (tuned at 9), 8B: (rows, columns, warps, pipeline stages)
        ("qkv_rows", 64, 4096): (64, 256, 4, 4),
        ("add_rows", 4096, 4096): (64, 128, 4, 6),
        ("silu_mul_rows", 14336, 4096): (128, 64, 4, 4),
        ("add_rows", 4096, 14336): (32, 256, 2, 6),
        ("logits_rows", 128256, 4096): (128, 128, 8, 3),
        # 17-32 tokens (a tree's verify), 8B, tuned at 32 (session 16, benchmarks/h200/session16/): the whole
        # 32-token forward 5.59 ms against 6.04 with the wide rule, the tuner's keep check
        ("qkv_rows32", 64, 4096): (64, 128, 8, 4),
        ("add_rows32", 4096, 4096): (64, 128, 4, 4),
        ("silu_mul_rows32", 14336, 4096): (64, 64, 4, 4),
        ("add_rows32", 4096, 14336): (64, 128, 4, 4),
        ("logits_rows32", 128256, 4096): (64, 64, 4, 4),
        # 33-64 tokens (a tree's verify of up to 64 nodes), 8B, tuned at 64 (session 23, benchmarks/h200/session23/):
        # the whole 64-token forward 5.48 ms against 6.34 with the wide rule (the tuner's keep check); bench_engine's
        # 64-node verify 1.495 one-token steps against 1.670. (On an H100 the same tuning lost end to end, session 15.)
        # A packed 8B target's 33-64-token products fall back to these too (`gemv_config`): not measured.
        ("qkv_rows64", 64, 4096): (64, 64, 4, 4),
        ("add_rows64", 4096, 4096): (64, 128, 4, 4),
        ("silu_mul_rows64", 14336, 4096): (64, 64, 4, 4),
        ("add_rows64", 4096, 14336): (64, 128, 4, 4),
        ("logits_rows64", 128256, 4096): (64, 64, 4, 3),
        # Llama-3.2-1B's one-token products over int4 / int8 codes (session 21, benchmarks/h200/session21/), all
        # five of each kept by the tuner's whole-forward check: the int4 forward 0.592 -> 0.539 ms, int8 0.697 ->
        # 0.603; the step in bench_engine, the same call, int4 0.601 -> 0.558, int8 0.717 -> 0.620. (q/k/v: 16 rows
        # of 2048 a program where the rule gave 2, 96 programs where it gave 768.)
        ("qkv@int4", 32, 2048): (16, 2048, 8),
        ("add@int4", 2048, 2048): (8, 2048, 4),
        ("silu_mul@int4", 8192, 2048): (16, 1024, 4),
        ("add@int4", 2048, 8192): (8, 4096, 8),
        ("logits@int4", 128256, 2048): (16, 1024, 4),
        ("qkv@int8", 32, 2048): (4, 512, 4),
        ("add@int8", 2048, 2048): (4, 1024, 4),
        ("silu_mul@int8", 8192, 2048): (16, 128, 4),
        ("add@int8", 2048, 8192): (4, 2048, 4),
        ("logits@int8", 128256, 2048): (8, 512, 4),
    },
    "NVIDIA H100 80GB HBM3": {  # session 15: what won end to end (benchmarks/h100/session15/README.md)
        # Llama-3.1-8B, a tree's verify of 17-32 tokens (1.303 one-token steps at 32 against the wide rule's 1.314)
        ("qkv_rows32", 64, 4096): (64, 128, 8, 4),
        ("add_rows32", 4096, 4096): (64, 128, 4, 4),
        ("silu_mul_rows32", 14336, 4096): (64, 128, 8, 2),
        ("add_rows32", 4096, 14336): (64, 128, 4, 4),
        ("logits_rows32", 128256, 4096): (64, 128, 8, 3),
        # Llama-3.2-1B and Qwen2.5-Coder-0.5B, one token with int8 weights (1B: 0.736 ms a step against the rule's
        # 0.777). The tuner's winners at 64 tokens, for the 1B's 2-16 tokens and for int4 lost end to end (9.76 ms
        # against the wide rule's 9.25, 1.36 against 1.26 one-token steps at 16 tokens, 0.804 ms against 0.775;
        # int4 again in session 18: 0.851 against 0.732): left out.
        # Llama-3.2-1B's int8 tiles tuned again in session 18, kept by the tuner's whole-forward check (0.695 ->
        # 0.652 ms; the step in bench_engine 0.714 -> 0.674, benchmarks/h100/session18/)
        ("qkv@int8", 32, 2048): (4, 512, 4),
        ("add@int8", 2048, 2048): (4, 1024, 4),
        ("silu_mul@int8", 8192, 2048): (32, 256, 4),
        ("add@int8", 2048, 8192): (4, 2048, 4),
        ("logits@int8", 128256, 2048): (16, 1024, 4),
        ("qkv@int8", 32, 896): (2, 1024, 4),
        ("add@int8", 896, 896): (2, 1024, 4),
        ("silu_mul@int8", 4864, 896): (8, 256, 4),
        ("add@int8", 896, 4864): (4, 1024, 8),
        ("logits@int8", 151936, 896): (32, 128, 4),
        # Llama-3.2-1B's o and down at 2-4 tokens over int8 codes (gemv_few), twice the one-token tile's rows: o
        # 5.45 / 7.00 µs at 2 / 4 tokens against 6.10 / 7.84, down 11.49 / 14.49 against 11.46 / 18.05 (session 21,
        # benchmarks/h100/session21/, timed alone, not checked in a whole forward)
        ("add_few@int8", 2048, 2048): (8, 1024, 4),
        ("add_few@int8", 2048, 8192): (8, 2048, 4),
        # Llama-3.2-1B's int8 tensor-core tiles (5-16 tokens), tuned at 9 and kept by the tuner's whole-forward check
        # (session 23, benchmarks/h100/session23/): its forwards of 5 / 8 / 16 tokens 1.87 / 1.85 / 1.76 ms -> 1.72 /
        # 1.68 / 1.62, a frontier of 8 nodes 2.83 -> 2.64 draft steps (bf16's forwards: 1.27-1.37 ms)
        ("qkv_rows@int8", 32, 2048): (32, 64, 4, 3),
        ("add_rows@int8", 2048, 2048): (16, 256, 4, 4),
        ("silu_mul_rows@int8", 8192, 2048): (32, 128, 2, 3),
        ("add_rows@int8", 2048, 8192): (64, 128, 4, 4),
        ("logits_rows@int8", 128256, 2048): (64, 128, 2, 3),
    },
}


@functools.cache
def _tuned(device_name: str) -> dict[tuple[str, int, int], tuple[int, ...]]:
    if os.environ.get("SPARK_SPEC_KERNEL_TABLE") == "0":
        return {}
    table = dict(TUNED.get(device_name, {}))
    path = tuned_path(device_name)
    if path.is_file():
        table.update(tuned_entry(row) for row in json.loads(path.read_text())["configs"])
    return table


def tuned_entry(row: dict) -> tuple[tuple[str, int, int], tuple[int, ...]]:
    """A tuned row (kind, n, k, bn, block_k, warps and, past one token, stages) as the table holds it."""
    return (row["kind"], row["n"], row["k"]), tuple(row[key] for key in ("bn", "block_k", "warps", "stages")
                                                    if key in row)


_TRIAL: dict[tuple[str, int, int], tuple[int, ...]] = {}  # tiles on trial (`trying`), looked up before the table


@contextlib.contextmanager
def trying(entries: dict[tuple[str, int, int], tuple[int, ...]]):
    """Inside the block, these tuned entries ((tuned kind, N, K) -> tiles) stand before the GPU's table: how the
    tuner times a whole forward with the tiles it found before it keeps them. Launches only: a captured graph
    keeps the tiles it was captured with."""
    saved = dict(_TRIAL)
    _TRIAL.update(entries)
    try:
        yield
    finally:
        _TRIAL.clear()
        _TRIAL.update(saved)


def tuned_path(device_name: str) -> Path:
    return cache_root() / "kernels" / (re.sub(r"[^A-Za-z0-9._-]+", "_", device_name) + ".json")


# Tiles for shapes the table lacks: the 8B's tuned ones. A tile's weights sit in registers (rows x columns x products
# per program), so a rule that grew the rows with N spilled: 32 x 512 x 2 for the 1.5B Qwen's gate/up took 16 ms a
# step against 1.6 for two tokens. The 2-16-token q/k/v product spans every head's rows: the tuned 8B tile (32 rows
# took 47 µs, not 17).
DEFAULT_TILES: dict[str, tuple[int, ...]] = {
    "silu_mul": (8, 128, 4), "add": (8, 512, 8), "logits": (16, 256, 4),
    "silu_mul_rows": (128, 64, 4, 4), "logits_rows": (128, 64, 4, 4), "qkv_rows": (64, 256, 4, 4),
    "add_rows": (32, 256, 2, 6), "raw_rows": (32, 256, 2, 6),
}


def tile_tokens(tokens: int) -> int:
    """The token width of the 2-64-token kernels' tiles: 16 (a tensor core's smallest) up to 16 tokens, else the next
    power of two."""
    if tokens > MAX_KERNEL_TOKENS:
        raise ValueError(f"the fused kernels take at most {MAX_KERNEL_TOKENS} tokens at once, got {tokens}")
    return max(MAX_FUSED_TOKENS, _pow2(tokens))


# Tiles for a tree's 17-64 tokens where the table has none: what every product of the 8B chose on an H100 at 32 and
# 64 tokens (session 15): 64 rows by 128 columns. A rule that kept the 2-16-token tile's accumulator size instead
# (rows shrunk to 16 at 64 tokens) took twice as long: 12.5 ms of products per 64-token forward against 6.6.
WIDE_TILES = {"silu_mul": (64, 128, 4, 2), "logits": (64, 128, 4, 3)}
WIDE_TILE = (64, 128, 4, 4)


def tuned_kind(kind: str, tokens: int = 1, quant: str = "none") -> str:
    """The tuned table's name for a product's tiles: the kind, "_rows" for 2-64 tokens with the tile's token width
    past 16 ("add_rows64": a tree's verify), but "_few" for 2-MAX_FEW_TOKENS tokens over packed weights (`gemv_few`),
    and "@" the weight format when packed ("add@int4")."""
    if few_tokens(tokens, quant):
        kind += "_few"
    elif tokens > 1:
        kind += "_rows"
        if tile_tokens(tokens) > MAX_FUSED_TOKENS:
            kind += str(tile_tokens(tokens))
    return kind + ("" if quant == "none" else "@" + quant)


def gemv_config(kind: str, n: int, k: int, device: torch.device | None = None,
                tokens: int = 1, quant: str = "none") -> tuple[int, ...]:
    """The tiles to launch a product of n rows and k columns over `tokens` tokens with weights in `quant` with. One
    token, and 2-MAX_FEW_TOKENS over packed weights (`gemv_few`): (rows per program, columns per iteration, warps);
    other 2-64-token products: the same and the software-pipelining depth. The tuned entry for this GPU, this token
    width and this format if there is one (`tuned_kind`); else a rule: the plain weights' entry for this width (or a
    default per kind: past 16 tokens the wide tile), whose one-token tile is widened for packed weights to the bf16
    tile's bytes (`packed_columns`), but for the head, which keeps bf16's tile at least PACKED_HEAD_COLUMNS wide;
    int4's one-token gate/up and head take INT4_TILE; a `gemv_few` product its kind's one-token tile, as `few_tile`
    adapts it."""
    table = _tuned(torch.cuda.get_device_name(device)) if device is not None and device.type == "cuda" else {}
    if _TRIAL:
        table = {**table, **_TRIAL}
    exact = table.get((tuned_kind(kind, tokens, quant), n, k))
    if exact:
        return exact
    if quant in PACKED_AS:  # w4a8: its own tuned tiles where there are, else its weights' format's
        return gemv_config(kind, n, k, device, tokens, PACKED_AS[quant])
    if few_tokens(tokens, quant):  # RAW (a product asked for without the q/k/v wrapper's tile) as an ADD's rows
        kind = "add" if kind == "raw" else kind
        return few_tile(gemv_config(kind, n, k, device, 1, quant), tokens, quant, kind)
    config = table.get((tuned_kind(kind, tokens), n, k))  # the plain weights' entry
    if tokens > MAX_FUSED_TOKENS:
        if kind not in ("qkv", "add", "silu_mul", "logits", "raw"):
            raise ValueError(f"no tiles for a {kind!r} product")
        return config or WIDE_TILES.get(kind, WIDE_TILE)
    if config is None and kind == "qkv" and tokens == 1:
        config = (min(8, _pow2(n)), 256, 4)
    elif config is None:
        config = DEFAULT_TILES.get(tuned_kind(kind, tokens))
        if config is None:
            raise ValueError(f"no tiles for a {kind!r} product")
    if tokens > 1:
        return config
    if quant == "int4" and kind in ("silu_mul", "logits"):  # the int4 word kernel's own tile (INT4_TILE)
        return (INT4_TILE[0], min(INT4_TILE[1], max(256, _pow2(k))), INT4_TILE[2])
    if kind == "logits":  # a packed head: at least PACKED_HEAD_COLUMNS, else the bf16 tile
        return config if quant == "none" else (config[0], max(config[1], PACKED_HEAD_COLUMNS), *config[2:])
    return (config[0], packed_columns(config[1], k, KERNEL_FORMATS[quant]), *config[2:])


def few_tile(one_token: tuple[int, ...], tokens: int, quant: str, kind: str) -> tuple[int, ...]:
    """A 2-MAX_FEW_TOKENS-token product's tile over packed weights (`gemv_few`): the one-token tile of its `kind`,
    each token with its own running sums in that tile's layouts, but
    - int4's gate/up (silu_mul) with half its columns (at least a group): compiled for sm_90
      (benchmarks/kernel_mix.py), the 1B's gate/up in INT4_TILE's full width spilled at 2 tokens (200 bytes a
      thread); halved it does not, and took 18.6 µs at 2 tokens against 23.6 (H100, session 21). int4's o, down and
      head keep the whole tile: halved like gate/up (session 20's rule) they took 7.4 / 21.3 µs at 2 tokens against
      6.2 / 14.4 (o, down; the head even), 15.0 / 47.5 against 13.2 / 33.2 at 4;
    - int8's and fp8's head (logits; fp8 shares int8's arithmetic, not timed) with half its columns, but at least
      PACKED_HEAD_COLUMNS: on an H100 the 1B's
      int8 head in (16, 1024, 4) took 161.6 / 309.6 µs at 2 / 4 tokens, in (16, 512, 4) 132.6 / 224.7 (each token's
      sums of a 1024-column tile are 32 registers a thread more); on an H200, whose int8 head was 256 columns wide,
      halved to 128 the 1B's 4-token forward took 1.50-1.53 ms against 1.47 at 256 (at 2 tokens 0.92 against 0.94).
    q/k/v's 2-4-token product (`qkv_rope` passes its one-token tile, kind "qkv") keeps that tile whole, as it is a
    product of few rows like o; not timed alone: the H200's 1B forwards of 2 tokens took 0.90 ms with its tuned
    tiles, 4 tokens 1.70 (int4) with the rule's. (The H200's tuned int4 tile, (16, 2048, 8), compiles for sm_90 to
    255 registers and at 4 tokens 16 bytes of stack; halved, 174 and none: to be timed.)
    Timed alone on an H100 (`benchmarks/h200/packed_gemv.py --tokens 1,2,4`, benchmarks/h100/session21/); the H200's
    forwards in benchmarks/h200/session21/."""
    if not few_tokens(tokens, quant):
        raise ValueError(f"gemv_few takes 2-{MAX_FEW_TOKENS} tokens over packed weights, not {tokens} over {quant}")
    bn, block_k, warps = one_token[:3]
    if quant == "int4" and kind == "silu_mul":
        block_k = max(GROUP, block_k // 2)
    elif quant != "int4" and kind == "logits":
        block_k = max(PACKED_HEAD_COLUMNS, block_k // 2)
    return bn, block_k, warps


# A packed head's one-token tile (int8, fp8; int4 since session 19 takes INT4_TILE) is bf16's, at least 256 columns
# wide. bf16's tile is what the head's 128k-151k rows want (widened to its bytes, the 1B's int4 head in the byte
# kernel took 149 µs on an H100 against 102 in bf16's 256 columns), but the H200's tuned bf16 tile is 128 columns,
# where the byte kernel's int4 head issued 16.8 instructions a weight against 8.9 at 256 (benchmarks/kernel_mix.py)
# and took 184 µs against 103 on an H100, the whole int4 step 0.840 ms against 0.766 (benchmarks/h100/session18/).
# int8's head: not measured on an H200.
PACKED_HEAD_COLUMNS = 256

# The int4 one-token products read their codes as int32 words, one instruction a code to a float
# (triton_kernels.int4_word_sums); their inputs are loaded once for each word column a thread holds and shared by
# the rows it holds, so a tile that gives a thread several rows issues fewer instructions a weight: 16 rows by 1024
# columns (128 words) over 4 warps is 4 rows a thread, 4.0-4.9 of a thread's instructions a weight on sm_90, where
# bf16's tiles widened to their bytes (8 rows, 512-4096 columns, one row a thread) take 6-10
# (benchmarks/kernel_mix.py). Fewer instructions paid where the product is big enough to stream at the memory's
# rate: on an H100 (session 19, benchmarks/h100/session19/) the 1B's head took 72 us in this tile against 103 in
# the byte kernel's tile (99 in its best), gate/up 14.0 against 14.4; o and down, 2048 rows, are latency-bound and
# took 4.9 and 12.3 us here against 4.6 and 9.1 in bf16's tiles widened as the H200 widens them ((8, 2048, 8),
# (8, 4096, 8)), which they keep (the H100's rule widens down's to (8, 2048, 8): timed only within the step).
INT4_TILE = (16, 1024, 4)


def _launch(kernel, grid, config: tuple[int, ...], pdl: bool, *args, **constexprs) -> None:
    """Launch with a config's warps (and pipelining depth, for the 2-16-token kernels) and PDL where it runs."""
    stages = {"num_stages": config[3]} if len(config) > 3 else {}
    _run(kernel, grid, *args, **constexprs, PDL=pdl, num_warps=config[2], launch_pdl=pdl, **stages)


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _scheme(weight: torch.Tensor | PackedWeight) -> str:
    return "none" if isinstance(weight, torch.Tensor) else weight.scheme


def weight_operands(weight: torch.Tensor | PackedWeight) -> tuple[tuple, dict]:
    """A product's weight as the kernels take it: (codes, scales, offsets) pointers and the QUANT and G constants.
    A plain tensor (the model's dtype) passes itself for the pointers it does not use."""
    if isinstance(weight, torch.Tensor):
        return (weight, weight, weight), {"QUANT": 0, "G": GROUP}
    zeros = weight.scales if weight.zeros is None else weight.zeros
    return (weight.codes, weight.scales, zeros), {"QUANT": KERNEL_FORMATS[weight.scheme], "G": weight.group}


def packed_columns(block_k: int, k: int, quant: int) -> int:
    """A one-token tile's columns for packed weights: the tuned bf16 tile's bytes, not its columns (int8 twice the
    inputs, int4 four times), up to the product's width. Fewer bytes a tile would mean more iterations, each with
    the same latency, for a product that is latency-bound already (int8 in bf16's tiles: 0.73 ms for the 1B step
    against bf16's 0.80 on an H200). Not for the head, whose 128k-151k rows keep every multiprocessor busy
    anyway: widened, its int4 product took 149 µs on an H100 against 102 in bf16's tile (1B; 0.5B 106 against 64)."""
    return min(block_k * {0: 1, 1: 2, 2: 4}[quant], max(block_k, _pow2(k)))


# Whether a 2-64-token q/k/v product in the tensor-core kernels does its rotary embedding in its own epilogue
# (`qkv_rows`, one kernel) rather than in `rope_rows` after it (two kernels and the product's fp32 rows between them).
# The two give the same numbers bit for bit: on an H100 the CUDA test first found them apart by the compiler's FMAs
# (session 27), since taken out (`triton_kernels.product_rn`), and then passed (session 28, benchmarks/h100/session28/).
# On an H100 it took the 8B's 8 / 16-token verifies from 5.73 / 5.90 ms to 5.68 / 5.86 and left the 1B's as they
# were (session 27, alternated in one process). SPARK_SPEC_ROPE_IN_PRODUCT=0 turns it off (how a benchmark measures
# what it gives).
ROPE_IN_PRODUCT = os.environ.get("SPARK_SPEC_ROPE_IN_PRODUCT", "1") == "1"


def qkv_rope(h, norm_weight, eps: float, w_qkv, b_qkv, cos, sin, pos, q_out, k_cache, v_cache,
             heads: int, kv_heads: int, config: tuple[int, ...] | None = None, pdl: bool = False,
             normed: torch.Tensor | None = None, a8: bool = False) -> None:
    """RMSNorm(h) [M, K] (or [K]: one token) times the fused q/k/v weight [(heads + 2 kv_heads) * D, K] (+ bias;
    a tensor or a PackedWeight), rotary embedding of token m at position pos + m on q and k; q into q_out,
    head-major [heads, M, D], k and v into the caches [kv_heads, capacity, D] at pos + m. M <= MAX_KERNEL_TOKENS.
    `normed`: RMSNorm(h) already made (`gemv`'s `norm_next`), taken instead of h. `a8`: as `gemv`'s."""
    dim = k_cache.shape[-1]
    tokens, k = (1, h.shape[0]) if h.dim() == 1 else h.shape
    operands, quant = weight_operands(w_qkv)
    a8 = a8_inputs(a8, quant, tokens)
    config = config or gemv_config("qkv", dim // 2, k, h.device, tokens, W4A8 if a8 else _scheme(w_qkv))
    bias = operands[0] if b_qkv is None else b_qkv
    if tokens == 1:
        if dim // 2 % config[0]:
            raise ValueError(f"head size {dim}: {config[0]} rows a program do not tile half a head")
        _launch(_triton().qkv_rope, (heads + 2 * kv_heads, dim // 2 // config[0]), config, pdl, h, norm_weight, eps,
                *operands, bias, cos, sin, pos, q_out, k_cache, v_cache, k, k_cache.stride(0), HEADS=heads,
                KV=kv_heads, D=dim, HAS_BIAS=b_qkv is not None, BH=config[0],
                BLOCK_K=config[1], **quant, A8=a8)
        return
    # 2-64 tokens: the product (its rows spread over every multiprocessor) into fp32, then one program a head for
    # the bias, rounding and rotary embedding. (A product of 6144 rows in programs that own whole heads' rotary
    # pairs has too few programs to keep an H200's memory busy: 30 µs for the 8B's q/k/v, against 16 for cuBLAS;
    # this split takes 16.7 at 9 tokens, benchmarks/h200/tune_kernels-qkv-rows.json.) The library's product is
    # read as it wrote it, in x's dtype. With ROPE_IN_PRODUCT the tensor-core product does the rotary embedding
    # itself (`qkv_rows`: its programs hold rotary pairs, as many programs as rows / tile), the same arithmetic.
    x, norm_weight = (h, norm_weight) if normed is None else (normed, None)
    rows = w_qkv.shape[0]
    if library_product(w_qkv, tokens) and LIBRARY_FUSED:
        y = library_mm(x, w_qkv, norm_weight, eps, pdl=pdl)
    elif ROPE_IN_PRODUCT and not library_product(w_qkv, tokens) and not few_tokens(tokens, _scheme(w_qkv)):
        config, grid, scratch, span, tiles = rows_layout(x, w_qkv, rows, k, tokens, config, RAW)
        _launch(_triton().qkv_rows, grid, config, pdl, x, x if norm_weight is None else norm_weight, eps,
                *operands, bias, cos, sin, pos, q_out, k_cache, v_cache, *scratch, tokens, rows, k, span,
                k_cache.stride(0), HEADS=heads, KV=kv_heads, D=dim, HAS_BIAS=b_qkv is not None,
                NORM=norm_weight is not None, **tiles, **quant)
        return
    else:
        y = torch.empty((tokens, rows), dtype=torch.float32, device=h.device)
        gemv(x, w_qkv, y, RAW, norm_weight, eps, config, pdl=pdl)
    _launch(_triton().rope_rows, (heads + 2 * kv_heads,), (0, 0, 4), pdl, y, bias, cos, sin, pos, q_out, k_cache,
            v_cache, tokens, k_cache.stride(0), y.shape[1], HEADS=heads, KV=kv_heads, D=dim,
            HAS_BIAS=b_qkv is not None, MP=tile_tokens(tokens))


def gemv(x, weight, out, epilogue: int, norm_weight=None, eps: float = 0.0,
         config: tuple[int, ...] | None = None, head_major: int = 0, pdl: bool = False,
         normed: torch.Tensor | None = None, norm_next: tuple | None = None, a8: bool = False
         ) -> torch.Tensor | None:
    """The product x . weight.T of M tokens x [M, K] (or [K]: one token; weight [N, K], a tensor in the model's
    dtype or a PackedWeight, int8 / int4 codes de-quantised in registers) with an epilogue into `out` [M, N]: ADD
    (out += y), SILU_MUL (the weight holds gate then up, N rows each: out = SiLU(gate) * up), LOGITS (out fp32 =
    y, rounded to the model's dtype) or RAW (2-64 tokens: out fp32 = y, unrounded, for rope_rows). With
    `norm_weight`, x is RMS-normalised first. `head_major` = D reads x as [K // D, M, D] (the attention's output)
    instead of [M, K]. M <= MAX_KERNEL_TOKENS: one token in `gemv` (or `gemv_stream`: STREAM), 2-MAX_FEW_TOKENS
    over packed weights in `gemv_few`, the rest in the tensor-core `gemv_rows`; from LIBRARY_TOKENS tokens on,
    int4 weights that carry PyTorch's layout in its int4 kernel, and the model's own weights at LIBRARY_PLAIN's
    token counts in cuBLAS (`library_gemv`).

    Between library products (LIBRARY_FUSED): `norm_next` = (norm weight, eps, the next product's weight) on an ADD
    asks for the next product's input, RMSNorm(out) [M, N], made by this epilogue; it is returned when both
    products run the library's kernel (else None, and the next product norms its own input). The next product takes
    it as `normed`, in place of x and its norm.

    `a8` (a draft's `w4a8`): a one-token product over int4 codes multiplies them by its inputs rounded to 8 bits a
    group (`triton_kernels.int4_word_sums_a8`); other products ignore it."""
    n = weight.shape[0] // (2 if epilogue == SILU_MUL else 1)
    k = weight.shape[1]
    tokens = x.numel() // k
    if normed is not None:
        x, norm_weight = normed, None
    if library_product(weight, tokens):
        fuse = (LIBRARY_FUSED and epilogue == ADD and norm_next is not None
                and library_product(norm_next[2], tokens))
        return library_gemv(x, weight, out, epilogue, norm_weight, eps, head_major, pdl,
                            norm_next[:2] if fuse else None)
    kind = {ADD: "add", SILU_MUL: "silu_mul", LOGITS: "logits", RAW: "raw"}[epilogue]
    operands, quant = weight_operands(weight)
    a8 = a8_inputs(a8, quant, tokens)
    config = config or gemv_config(kind, n, k, x.device, tokens, W4A8 if a8 else _scheme(weight))
    args = (x, x if norm_weight is None else norm_weight, eps, *operands, out)
    constexprs = dict(NORM=norm_weight is not None, EPILOGUE=epilogue, BN=config[0], BLOCK_K=config[1], **quant)
    grid = (-(-n // config[0]),)
    if tokens == 1:
        programs = stream_programs(grid[0], x.device)
        kernel = _triton().gemv_stream if STREAM > 0 else _triton().gemv
        _launch(kernel, (programs,), config, pdl, *args, n, k, **constexprs, A8=a8)
    elif few_tokens(tokens, _scheme(weight)):
        _launch(_triton().gemv_few, grid, config, pdl, *args, tokens, n, k, **constexprs, XD=head_major,
                MT=_pow2(tokens))
    else:
        config, grid, scratch, span, tiles = rows_layout(x, weight, n, k, tokens, config, epilogue)
        constexprs.update(tiles)
        _launch(_triton().gemv_rows, grid, config, pdl, *args, *scratch, tokens, n, k, span, **constexprs,
                XD=head_major)


def a8_inputs(a8: bool, quant: dict, tokens: int) -> bool:
    """Whether a product takes its inputs rounded to 8 bits (A8, and w4a8's tiles): asked for, one token, over int4
    codes."""
    return a8 and tokens == 1 and quant["QUANT"] == 2


# One-token products in fewer programs than row blocks: with STREAM > 0, `triton_kernels.gemv_stream` in STREAM
# programs a multiprocessor, each taking every STREAM x multiprocessors-th block and loading its tiles one after
# another without a pause between blocks (where that is more programs than blocks, each takes one: what
# gemv_stream's loop costs by itself); STREAM 0 (the default): `triton_kernels.gemv`, every row block its own
# program. The same bits either way.
# SPARK_SPEC_STREAM, read when this module is imported, sets it.
STREAM = int(os.environ.get("SPARK_SPEC_STREAM", "0"))


def stream_programs(blocks: int, device: torch.device) -> int:
    """Programs of a one-token product of `blocks` row blocks: STREAM a multiprocessor (Triton's interpreter counts
    as one), at most one a block; all `blocks` with STREAM 0."""
    if STREAM <= 0:
        return blocks
    return min(blocks, STREAM * max(1, _multiprocessors(device)))


def rows_layout(x, weight, n: int, k: int, tokens: int, config: tuple[int, ...], epilogue: int):
    """How a product of n rows over `tokens` (2-64) tokens runs in the tensor-core kernels (`gemv_rows`,
    `qkv_rows`): its config (pipeline buffers fit in shared memory), grid (row blocks, input splits), the split
    sums' scratch (partial sums and counters; x where unsplit: not read), the inputs a split takes, and the tile's
    constexprs."""
    mp = tile_tokens(tokens)
    quant = weight_operands(weight)[1]
    config = fit_shared_memory(config, x.element_size(), 2 if epilogue == SILU_MUL else 1, mp)
    # int4 tiles: whole groups (a product's inner size, half the tile, at least 16), at most 128 inputs (the
    # de-quantised halves sit in registers beside the codes)
    block_k = min(max(config[1], quant["G"]), 128) if quant["QUANT"] == 2 else config[1]
    blocks = -(-n // config[0])
    tiles = -(-k // block_k)
    split = split_eligible(mp, _scheme(weight), blocks, x.device)
    splits = input_splits(blocks, tiles, x.device) if split else 1
    if splits > 1:
        parts = torch.empty(blocks * splits * (2 * config[0] + 1) * mp, dtype=torch.float32, device=x.device)
        scratch = (parts, _counters(x.device, _multiprocessors(x.device)))  # blocks < multiprocessors (input_splits)
    else:
        scratch = (x, x)
    span = -(-tiles // splits) * block_k  # inputs a split: whole tiles
    return config, (blocks, splits), scratch, span, dict(BN=config[0], BLOCK_K=block_k, MP=mp,
                                                         PRECISION=_precision(x), SPLITS=splits)



def library_mm(x, weight: torch.Tensor | PackedWeight, norm_weight=None, eps: float = 0.0, head_major: int = 0,
               pdl: bool = False) -> torch.Tensor:
    """The product of M >= 2 tokens x [M, K] through PyTorch's int4 kernel over `weight.library` (rows padded to
    INT4_ROWS), or cuBLAS over the model's own weights: [M, rows] in x's dtype, its inputs made by
    `library_inputs`."""
    inputs = library_inputs(x, weight.shape[1], norm_weight, eps, head_major, pdl)
    if not isinstance(weight, PackedWeight):
        return torch.mm(inputs, weight.t())
    codes, scales_and_zeros = weight.library
    return int4_library_mm(inputs, codes, weight.group, scales_and_zeros)


def library_inputs(x, k: int, norm_weight=None, eps: float = 0.0, head_major: int = 0,
                   pdl: bool = False) -> torch.Tensor:
    """The library's inputs [M, K] from x: x itself where it is so already; else with `norm_weight` RMS-normalised,
    rounded to x's dtype once, and head-major ones gathered, by `library_input`."""
    tokens = x.numel() // k
    if norm_weight is None and not head_major:
        return x.view(tokens, k)
    inputs = torch.empty((tokens, k), dtype=x.dtype, device=x.device)
    _run(_triton().library_input, (tokens,), x, x if norm_weight is None else norm_weight, inputs, eps, tokens, k,
         NORM=norm_weight is not None, XD=head_major, BLOCK=_pow2(k), PDL=pdl, num_warps=_row_warps(k),
         launch_pdl=pdl)
    return inputs


def _row_warps(k: int) -> int:
    """Warps of a program that holds a token's whole row of k (`library_input`, `library_output`'s NORM_NEXT: the
    same, so that their RMSNorms sum in the same order)."""
    return 4 if k <= 4096 else 8


def library_gemv(x, weight: torch.Tensor | PackedWeight, out, epilogue: int, norm_weight=None, eps: float = 0.0,
                 head_major: int = 0, pdl: bool = False, norm_next: tuple | None = None) -> torch.Tensor | None:
    """`gemv` of M >= 2 tokens through a library's kernel (`library_mm`: PyTorch's int4 kernel, or cuBLAS over the
    model's own weights), then `gemv`'s epilogue into `out` by `library_output`. The product's sums are rounded to
    x's dtype before the epilogue (RAW's too; and a bias is added after that rounding, not before), and int4 weights
    are de-quantised by the library (in bf16 on CUDA): not bit for bit the fused kernels' numbers, so a verify
    through the library and the one-token step round apart by more (bf16 near-ties, docs/quantization.md). With
    `norm_next` = (norm weight, eps), an ADD also returns the next product's input: the new out, RMS-normed and
    rounded as `library_input` would make it."""
    tokens = x.numel() // weight.shape[1]
    n = weight.shape[0] // (2 if epilogue == SILU_MUL else 1)
    y = library_mm(x, weight, norm_weight, eps, head_major, pdl)
    normed = None
    if norm_next is not None:
        if epilogue != ADD:
            raise ValueError("only an ADD epilogue holds the residual row the next product's norm needs")
        normed = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
        block, warps = _pow2(n), _row_warps(n)
    else:
        block, warps = 1024, 4
    next_norm_weight, next_eps = norm_next or (out, 0.0)  # (not read without NORM_NEXT)
    _run(_triton().library_output, (-(-n // block), tokens), y, out, next_norm_weight,
         out if normed is None else normed, next_eps, n, y.shape[1], EPILOGUE=epilogue, BLOCK=block,
         NORM_NEXT=normed is not None, PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return normed


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


# Which 2-16-token products over the model's own weights split their inputs: "small" ones, with at most half as many
# row blocks as the GPU has multiprocessors (every product of the 1B but its head: 48-64 blocks on an H100's 132;
# of the 8B only o, 64 blocks), "all" (as `input_splits` decides) or "none". On an H100 (session 24,
# benchmarks/h100/session24/) "small" took the 1B's frontier of 8 nodes from 1.248 to 1.222 draft steps (its
# 2 / 8 / 16-token forwards 1.230 / 1.283 / 1.368 -> 1.191 / 1.261 / 1.329 ms) and changed none of the 8B's
# forwards by more than 0.4 %; "all" also split the 8B's q/k/v (96 blocks, 4 ways) and lost 3 % of its 2-16-token
# verifies (the round trip session 17 saw). SPARK_SPEC_SPLIT_PLAIN, read when this module is imported, picks another.
SPLIT_PLAIN = os.environ.get("SPARK_SPEC_SPLIT_PLAIN", "small")
SPLIT_RULES = ("none", "small", "all")
if SPLIT_PLAIN not in SPLIT_RULES:
    raise ValueError(f"SPARK_SPEC_SPLIT_PLAIN={SPLIT_PLAIN!r}: one of {', '.join(SPLIT_RULES)}")


def split_eligible(width: int, scheme: str, blocks: int, device: torch.device) -> bool:
    """Whether a 2-64-token product may split its inputs (`input_splits` says how many ways): tiles wider than 16
    tokens and int8 / int4 weights, where it measured faster; the model's own weights as SPLIT_PLAIN says; fp8's
    2-16-token products never (not measured). `width`: the tile's tokens (`tile_tokens`)."""
    if width > MAX_FUSED_TOKENS or scheme in ("int8", "int4"):
        return True
    if scheme != "none":
        return False
    return SPLIT_PLAIN == "all" or (SPLIT_PLAIN == "small" and 2 * blocks <= _multiprocessors(device))


def input_splits(blocks: int, tiles: int, device: torch.device) -> int:
    """How many programs share each row block of a 2-64-token product, each summing a part of its `tiles` input
    tiles (1: none). A product of few rows has fewer row blocks than the GPU has multiprocessors (the 8B's o and down
    products at a tree's 32 tokens: 64 blocks of 64 rows on an H200's 132): the rest idle, and each busy one streams
    at ~34 GB/s, 2.2 TB/s in all (benchmarks/h200/session16/tuned-table-32.json). Split s ways, a block's
    programs fill ceil(blocks s / SMs) waves of 1 / s the work; the split with the fewest such waves wins, each split
    beyond the first charged 5 % for its partial sums' round trip (at most 4; every split keeps a tile).
    SPARK_SPEC_SPLIT_INPUTS=0 turns splitting off (how a benchmark measures what it gives).

    `gemv` splits only tiles wider than 16 tokens and int8 / int4 weights (fp8's were not measured). The counters
    are shared by every product on a device: launches must run one after another, on one stream, as a model's
    forward does. Measured on an H100 (bench_engine, session 17,
    benchmarks/h100/session17/): the 8B's tree verify of 32 / 64 nodes took 1.191 / 1.407 one-token steps split
    against 1.288 / 1.469 unsplit, and the 1B's 2-16-token forwards with int4 / int8 weights 3.5-3.9 / 1.9-2.1 ms
    against 5.5-5.9 / 2.3-3.0; but the 8B's 2-16-token verify, tiled for 16 tokens and done in ~6 ms, lost to
    the round trip: 8 tokens 1.116 steps against 1.089, 16 tree nodes 1.153 against 1.122."""
    sms = _multiprocessors(device)
    if not sms or blocks >= sms or os.environ.get("SPARK_SPEC_SPLIT_INPUTS") == "0":
        return 1
    best = min(range(1, 5), key=lambda s: (-(-blocks * s // sms) / s + 0.05 * (s - 1), s))
    best = min(best, tiles)
    return -(-tiles // -(-tiles // best))  # no split without a tile


SHARED_MEMORY = 180 * 1024  # what the 2-64-token kernels' pipeline buffers may take (an H100/H200 has 227 KB)


def fit_shared_memory(config: tuple[int, ...], element_size: int, weights: int,
                      mp: int = MAX_FUSED_TOKENS) -> tuple[int, ...]:
    """A 2-64-token config whose pipeline buffers -- stages x (weight tiles + the tokens' input tile of `mp`
    tokens) -- fit in SHARED_MEMORY: fewer stages (down to 2), then fewer columns. Tiles tuned for bf16 hold twice
    the bytes in fp32 (seen on an H200: 267 KB asked for, 227 KB there)."""
    bn, block_k, warps, stages = config

    def size(block_k: int, stages: int) -> int:
        return stages * (weights * bn + mp) * block_k * element_size

    while stages > 2 and size(block_k, stages) > SHARED_MEMORY:
        stages -= 1
    while block_k > 16 and size(block_k, stages) > SHARED_MEMORY:
        block_k //= 2
    return bn, block_k, warps, stages
