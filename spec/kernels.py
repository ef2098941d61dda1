"""Split-KV attention for decode steps and verify passes (Triton, CUDA, half precision).

A decode step attends a handful of new tokens to the whole cached text. A general attention kernel (SDPA's flash
or cuDNN backends) parallelises over heads and query blocks: at batch 1 with 8 K/V heads that is 8 thread blocks,
each streaming its head's entire cache, on a GPU with 132 multiprocessors. On an H200 that cost 19 µs per 8B layer
at a 512-token context, ~12% of a decode step, for 2 MB of K/V. Splitting the keys instead (flash-decoding) puts
every multiprocessor to work:

- `_partial`: one program per (K/V head, chunk of CHUNK cached positions) computes, for all query rows of that
  head (query heads sharing the K/V head folded in as rows), the chunk's softmax numerator `o`, its row maxima `m`
  and sums `l` in fp32; chunks past the last position any row may see load nothing;
- `_combine`: one program per (head, row) rescales the chunks to a common maximum and normalises.

`decode_attention` is a `torch.library` custom op (opaque to torch.compile, capturable in a CUDA graph). The causal
rule is by position: row r (token r % n) sees cache positions <= pos + r % n, so stale entries after the text are
never read. Its rounding differs from SDPA's and between a 1-token step and a K+1-token verify (measured on the
8B architecture: up to 0.14 in a logit, against 0.28 between the graph and eager backends), so in bf16 speculative
and plain greedy decoding may part at a near-tie, as the issue's exactness rule allows; in fp32 the kernel is not
used. The import of Triton is deferred to first use; nothing here runs without CUDA.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import torch

MAX_ROWS = 128  # query rows (query heads per K/V head x new tokens) one program holds; more go to SDPA


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


def _chunk(span: int) -> int:
    """Cached positions per program: 32 up to a 1024-token span (>= 16 programs per head), at most 128 beyond."""
    return min(128, max(32, _pow2(span // 32)))


def masked_sdpa(q, k_cache, v_cache, pos, span: int, n_tokens: int, scale: float) -> torch.Tensor:
    """The same attention by PyTorch's SDPA, same arguments and causal rule: for fp32 and CPUs, and for prefills,
    whose rows one program cannot hold."""
    rows_n = q.shape[1]
    seen = pos + torch.arange(rows_n, device=q.device) % n_tokens
    allowed = torch.arange(span, device=q.device)[None, :] <= seen[:, None]
    return torch.nn.functional.scaled_dot_product_attention(
        q[None], k_cache[None, :, :span], v_cache[None, :, :span], attn_mask=allowed[None, None], scale=scale)[0]


# Programmatic dependent launch: each kernel of a step starts loading its weights while the one before it finishes
# (Hopper and later; SPARK_SPEC_PDL=0 turns it off). It changes no result, only when kernels start.
PDL = os.environ.get("SPARK_SPEC_PDL", "1") != "0"


@functools.cache
def _pdl(device: torch.device) -> bool:
    return PDL and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _triton():
    from spec import triton_kernels

    return triton_kernels


@torch.library.custom_op("spark_spec::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, span: int,
                     n_tokens: int, scale: float) -> torch.Tensor:
    """Attention of q [kv_heads, rows, D] (row r is token r % n_tokens, at position pos + r % n_tokens) over the
    first `span` positions of the caches [kv_heads, capacity, D]; returns [kv_heads, rows, D] in q's dtype."""
    heads, rows_n, dim = q.shape
    if rows_n > MAX_ROWS:
        return masked_sdpa(q, k_cache, v_cache, pos, span, n_tokens, scale)
    q = q.contiguous()
    # One tile height for every step and verify up to 64 rows (16 tokens at 4 query heads per K/V head); the cost
    # of the padding rows is below the timing noise (H200, 8B step: 4.68 ms with 16-row tiles in one run, 4.70 ms with 64 in another).
    rows = 64 if rows_n <= 64 else MAX_ROWS
    chunk = _chunk(span)
    splits = -(-span // chunk)
    o = torch.empty((heads, splits, rows, dim), dtype=torch.float32, device=q.device)
    m = torch.empty((heads, splits, rows), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    out = torch.empty_like(q)
    tk = _triton()
    pdl = _pdl(q.device)
    tk.attention_partial[(heads, splits)](q, k_cache, v_cache, pos, o, m, l, rows_n, n_tokens, scale, q.stride(0),
                                          k_cache.stride(0), splits, D=dim, ROWS=rows, CHUNK=chunk, PDL=pdl,
                                          PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                                          num_warps=4, num_stages=2, launch_pdl=pdl)
    tk.attention_combine[(heads, rows_n)](o, m, l, out, rows_n, splits, D=dim, ROWS=rows,
                                          SPLITS=max(16, _pow2(splits)), PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


@decode_attention.register_fake
def _(q, k_cache, v_cache, pos, span, n_tokens, scale):
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
# output rows and streams them over K in `BLOCK_K` columns, summing in fp32; no program writes what another reads.

ADD, SILU_MUL, LOGITS = 0, 1, 2

# Tuned (rows per program, columns per iteration, warps) per GPU and product, keyed (kind, N, K) with kind one of
# qkv (N = half a head), add, silu_mul, logits. `python -m spec.tune_kernels` measures them on the GPU at hand and
# writes <cache>/kernels/<GPU name>.json, which is read first; below is what it found on an H200.
TUNED: dict[str, dict[tuple[str, int, int], tuple[int, int, int]]] = {
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
    },
}


@functools.cache
def _tuned(device_name: str) -> dict[tuple[str, int, int], tuple[int, int, int]]:
    table = dict(TUNED.get(device_name, {}))
    path = tuned_path(device_name)
    if path.is_file():
        for row in json.loads(path.read_text())["configs"]:
            table[(row["kind"], row["n"], row["k"])] = (row["bn"], row["block_k"], row["warps"])
    return table


def tuned_path(device_name: str) -> Path:
    from spec.common import cache_root

    return cache_root() / "kernels" / (re.sub(r"[^A-Za-z0-9._-]+", "_", device_name) + ".json")


def gemv_config(kind: str, n: int, k: int, device: torch.device | None = None) -> tuple[int, int, int]:
    """(rows per program, columns per iteration, warps) for a one-token product of n rows and k columns: the tuned
    entry for this GPU if there is one, else enough programs to give each multiprocessor a few."""
    if device is not None and device.type == "cuda":
        tuned = _tuned(torch.cuda.get_device_name(device)).get((kind, n, k))
        if tuned:
            return tuned
    if kind == "qkv":
        return min(8, _pow2(n)), 256, 4
    return min(32, max(4, _pow2(n // 512))), 512, 4


def qkv_rope(h, norm_weight, eps: float, w_qkv, b_qkv, cos, sin, pos, q_out, k_cache, v_cache,
             heads: int, kv_heads: int, config: tuple[int, int, int] | None = None) -> None:
    """RMSNorm(h) [K] times the fused q/k/v weight [(heads + 2 kv_heads) * D, K] (+ bias), rotary embedding at
    position `pos` on q and k; q into q_out [heads * D], k and v into the caches [kv_heads, capacity, D] at pos."""
    dim = k_cache.shape[-1]
    k = h.shape[-1]
    pdl = _pdl(h.device)
    bh, block_k, warps = config or gemv_config("qkv", dim // 2, k, h.device)
    _triton().qkv_rope[(heads + 2 * kv_heads, dim // 2 // bh)](
        h, norm_weight, eps, w_qkv, w_qkv if b_qkv is None else b_qkv, cos, sin, pos, q_out, k_cache, v_cache, k,
        k_cache.stride(0), HEADS=heads, KV=kv_heads, D=dim, HAS_BIAS=b_qkv is not None, BH=bh, BLOCK_K=block_k,
        PDL=pdl, num_warps=warps, launch_pdl=pdl)


def gemv(x, weight, out, epilogue: int, norm_weight=None, eps: float = 0.0,
         config: tuple[int, int, int] | None = None) -> None:
    """One-token product x [K] . weight.T with an epilogue into `out`: ADD (out [N] += y), SILU_MUL (the weight holds
    gate then up, N rows each: out [N] = SiLU(gate) * up) or LOGITS (out [N] fp32 = y). With `norm_weight`, x is
    RMS-normalised first."""
    n = weight.shape[0] // (2 if epilogue == SILU_MUL else 1)
    k = weight.shape[1]
    kind = {ADD: "add", SILU_MUL: "silu_mul", LOGITS: "logits"}[epilogue]
    bn, block_k, warps = config or gemv_config(kind, n, k, x.device)
    pdl = _pdl(x.device)
    _triton().gemv[(-(-n // bn),)](x, x if norm_weight is None else norm_weight, eps, weight, out, n, k,
                                   NORM=norm_weight is not None, EPILOGUE=epilogue, BN=bn, BLOCK_K=block_k, PDL=pdl,
                                   num_warps=warps, launch_pdl=pdl)
