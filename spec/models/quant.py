"""Weight-only quantization of the draft (`--draft-quant int8|int4`): fewer bytes a draft step, the same answers.

The acceptance rule keeps the output distribution exactly the target's for any draft distribution q, so a
quantized draft changes no answer; at most it lowers acceptance a little. Its worth is the draft's cost c: a
draft step reads every weight once, and an int4 weight is a quarter of a bf16 one.

Each `nn.Linear` of the decoder layers and the output head becomes a `QuantLinear` whose product is one of
PyTorch's own CPU kernels (no new kernel code here):

- int8: one symmetric scale per output row, `w ~ q * s`, q in [-127, 127] (`aten._weight_int8pack_mm`);
- int4: per group of `GROUP` inputs an asymmetric scale and offset in tinygemm's form, `w ~ (q - 8) * s + z`,
  q in [0, 15], packed two to a byte (`aten._weight_int4pack_mm_for_cpu`).

Scales are kept in the model's dtype (bf16 by default). Measured on this project's 2-core CPU, one
[1, 896] x [896, 4864] product (the 0.5B draft's gate/up; `benchmarks/cpu/draft_quant.py --products-only`): bf16
0.30 ms, int8 0.13 ms, int4 0.11 ms. torchao 0.18, installed for the comparison only, took 0.70 ms with its
`Int8WeightOnlyConfig`, and its int4 configs have no CPU kernel left (`IntxWeightOnlyConfig` int4 de-quantises
each call: 2.2 ms), which is why these wrappers call the ATen kernels directly.

The embedding keeps its bf16 rows (a step reads one).

On CUDA the same codes run in two places:

- the graph backend (the fast path): `PackedWeight` holds a fused matrix's codes in the layout its Triton kernels
  read (spec/models/triton_kernels.py de-quantises them in registers inside the fused step: int8 codes [N, K]
  and a scale per row applied to each row's sum; int4 two codes a byte, [N, K / 2], with a scale and an offset
  per group of GROUP inputs, [N, K / GROUP] each). `GraphModel(quant=...)` packs its fused matrices at start-up
  on the GPU (under a second for a 1B model), so nothing is cached for it. int4 in bf16 is kept a second time in
  PyTorch's own layout (`with_library_layout`): products of several tokens run tinygemm, which was faster there
  (spec/models/kernels.py, `LIBRARY_TOKENS`);
- the eager backend, for exactness runs and for models the graph backend cannot take: int4 through PyTorch's
  tinygemm kernel (`aten._weight_int4pack_mm`, bf16 only), int8 as gpt-fast's `WeightOnlyInt8Linear` does it (the
  codes cast to the activations' dtype, then scaled per row): correct, and no faster than bf16 there, where a
  step is launch-bound anyway.

fp8 (e4m3, one scale per output row, `w ~ q * s` with q an fp8 number of magnitude at most 448) runs where a GPU
reads fp8 (compute capability 8.9 and later: H100, H200, the DGX Spark's GB10): in the graph backend's kernels by the
int8 arithmetic (the codes cast to the model's dtype, which holds every e4m3 value exactly, each row's sum scaled
once), and in the eager backend as int8 does on CUDA. A CPU, or an older GPU, is refused with the reason.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from spec import log
from spec.models.base import ModelError, cache_root

QUANTS = ("none", "int8", "int4", "fp8")  # weight-only: what --target-quant takes
# w4a8, a draft's only: int4 weights whose one-token products multiply the codes by the inputs rounded to 8 bits a
# group (kernels.gemv's `a8`), in the graph backend's CUDA kernels. It changes the draft's products, so never a
# served target's; any draft keeps the answers exact.
W4A8 = "w4a8"
AUTO = "auto"
DRAFT_QUANTS = (AUTO, *QUANTS, W4A8)  # --draft-quant also takes auto (the default): `auto_quant` picks the format
GROUP = 32  # inputs per int4 scale and offset: Q4_K_M's block size, and the smallest the int4 kernel takes
INT4_ROWS = 16  # the int4 kernel packs output rows in multiples of 16; the head's rows are padded up to it


def quant_error(what: str, scheme: str, device: torch.device | str) -> str | None:
    """Why `scheme` cannot quantize `what` on `device`, or None if it can."""
    device = torch.device(device)
    if scheme == W4A8 and what.startswith("--target-quant"):
        return (f"{what}: w4a8 rounds a product's inputs to 8 bits, which would change the served answers further; "
                "it is a draft format only (--draft-quant w4a8); the target takes none, int8, int4 or fp8")
    if scheme == W4A8 and device.type != "cuda":
        return (f"{what}: w4a8 runs in the graph backend's CUDA kernels, not on a {device.type}; int4 is the "
                "same weights there, with the inputs as they are")
    if scheme not in (*QUANTS, W4A8):
        return f"unknown quantization {scheme!r}; choose {', '.join((*QUANTS, W4A8))}"
    if scheme == "fp8" and not fp8_device(device):
        return (f"{what}: fp8 weights run on a GPU that reads fp8 (compute capability 8.9 or later: H100, H200, DGX "
                f"Spark), not on this {device.type}" + (" GPU" if device.type == "cuda" else "") +
                "; int8 and int4 run everywhere")
    if scheme != "none" and device.type not in ("cpu", "cuda"):
        flag = what.split(":")[0] if what.startswith("--") else "--draft-quant / --target-quant"
        return f"{what}: {scheme} weights run on a CPU or a CUDA GPU, not on {device.type}; use {flag} none there"
    return None


def auto_quant(model, fused_kernels: bool) -> tuple[str, str]:
    """`--draft-quant auto` (the command line's default): the draft format that decoded fastest where this draft
    runs, and why, for the log. Any format changes no answer (the rule keeps the target's distribution for any
    draft), so the choice is speed alone, measured:

    - on a CPU, int4 (int8 where a layer's inputs do not split into groups of GROUP): the default
      `python -m spec.spec_greedy` (the real pair, 3 code prompts x 64 tokens, K = 4, bf16, 2 cores) ran 2.00x
      plain decoding with an int4 draft, 1.60x with int8 and 1.26x with the bf16 draft, in one session on one idle
      machine; in fp32, int4 1.33-1.36x against 0.95-0.98x (docs/quantization.md);
    - in the graph backend's fused kernels (`fused_kernels`: CUDA) in half precision, int8: the real pair's 0.5B
      draft on an H100 1.30x / 1.21x plain on code / short against bf16's 1.18x / 1.06x; on an H200 no better and
      no worse (1.18x / 1.12x against 1.19x / 1.06x in session 14, 1.22x against 1.24x on code in session 16: that
      0.5B is latency-bound there); the 1B draft's step 0.73-0.74 ms against 0.88-1.06 in bf16 (H200, H100). int4's
      de-quantising in registers costs a one-token product on a fast GPU more than its bytes save (0.76-0.78 ms;
      since session 19's word kernel 0.67, as int8); on the real pair with 2-4-token forwards on the CUDA cores
      (session 20, one H100, code, K = 4) int8 1.56x plain, int4 1.37x;
    - elsewhere (MPS; the eager backend on CUDA, whose steps are launch-bound, so fewer bytes buy nothing): none."""
    weight = next(model.parameters())
    if fused_kernels and weight.dtype in (torch.bfloat16, torch.float16):
        return "int8", "the fastest draft format measured in the graph backend's fused kernels"
    if fused_kernels:
        return "none", "int8 was measured faster in half precision; an fp32 draft (exactness runs) keeps its weights"
    device = weight.device
    if device.type != "cpu":
        return "none", f"packed weights buy a {device.type} eager step nothing"
    shapes = [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if all(pack_error(shape, "int4") is None for shape in shapes):
        return "int4", "the fastest draft format measured on a CPU"
    return "int8", f"int4 is the fastest on a CPU, but a layer's inputs do not split into groups of {GROUP}"


def inputs_in_8_bits(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """A w4a8 product's inputs as its kernel rounds them (`triton_kernels.int4_inputs_a8`), in PyTorch: x [..., K]
    in groups of `group` along K, each group's values times 127 / its largest magnitude, rounded to integers (fp32,
    ties to even): (the integers in [-127, 127] as fp32 [..., K / group, group], each group's step = largest
    magnitude / 127 [..., K / group, 1]). A group of zeros is integers 0 with step 0."""
    groups = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    top = groups.abs().amax(-1, keepdim=True)
    return torch.round(groups * torch.where(top > 0, 127.0 / top, 0.0)), top / 127


def fp8_device(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU whose kernels read fp8 (Triton's e4m3 needs compute capability 8.9+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def eager_quant_error(what: str, scheme: str, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why the eager backend's layers cannot run `scheme` on `device` in `dtype` (beyond `quant_error`)."""
    if scheme == W4A8:
        return (f"{what}: w4a8 runs in the graph backend's fused kernels (CUDA, Llama/Qwen2 layers), not in the "
                "eager backend's layers; int4 is the same weights there")
    if scheme == "int4" and torch.device(device).type == "cuda" and dtype != torch.bfloat16:
        return (f"{what}: int4 on the eager backend on CUDA runs PyTorch's tinygemm kernel, which takes bfloat16 only "
                f"(not {str(dtype).removeprefix('torch.')}); use --dtype bfloat16, int8, or the graph backend")
    return quant_error(what, scheme, device)


def _up(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`scale` (fp32) in `dtype`, rounded up, not to nearest: scaled by more than the rounding can take away (a
    relative 2 u, u = eps / 2 the unit roundoff), so |w| / s never exceeds the largest code."""
    return (scale * (1 + torch.finfo(dtype).eps)).to(dtype)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> codes [N, K] int8 and scales [N] in the weight's dtype, s >= max|w_row| / 127.
    Bound: |w - q s| <= s / 2 for every entry (rounding to the nearest code; the range is never clipped)."""
    w = weight.float()
    scale = _up(w.abs().amax(1).clamp(min=1e-12) / 127, weight.dtype)
    codes = torch.clamp(torch.round(w / scale.float()[:, None]), -127, 127).to(torch.int8)
    return codes, scale


FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> codes [N, K] float8_e4m3fn and scales [N] in the weight's dtype, s >= max|w_row| / 448.
    Bound: |w - q s| <= max(2^-4 |w|, 2^-10 s) for every entry: w / s lies in [-448, 448] (never clipped) and is
    rounded to the nearest e4m3 number, whose spacing is 2^-3 of its power of two among normal numbers (>= 2^-6) and
    2^-9 below them, so the error is half a spacing: at most 2^-4 |w / s| or 2^-10."""
    w = weight.float()
    scale = _up(w.abs().amax(1).clamp(min=1e-12) / FP8_MAX, weight.dtype)
    codes = (w / scale.float()[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


ROW_SCALED = {"int8": quantize_int8, "fp8": quantize_fp8}  # codes [N, K] and a scale per row: one arithmetic


INT4_STEPS = (0.0, -0.5, 0.5, -1.0, 1.0)  # quantize_int4's search: grids of 15 + d steps over a group's range
INT4_BLOCK = 1 << 24  # weights quantized at a time: bounds the search's fp32 temporaries (64 MB each)


def quantize_int4(weight: torch.Tensor, group: int = GROUP, search: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> codes [N, K] in 0..15 (int32) and scales_and_zeros [K / group, N, 2] in the weight's dtype, the
    kernel's layout; w ~ (q - 8) s + z per group.

    Min-max: s = (max - min) / 15, z = min + 8 s, both rounded to the dtype; nothing is clipped. With `search` (the
    default) each group also tries, for each d in INT4_STEPS, the codes of a grid of 15 + d steps over its range,
    then the least-squares line w ~ s q + m through those codes (m = z - 8 s), s and z rounded to the dtype and
    the codes re-rounded to the nearest under them; it keeps whichever candidate, min-max included, has the
    smallest squared error (llama.cpp's Q4_K search does the like). The search matters most where the weights came
    from a GGUF whose tensor was already 4-bit in blocks of 32 (Q4_K): it finds that grid again, where min-max
    lands between its points (the Qwen 0.5B's ffn_down: squared error 0.011 of min-max's; elsewhere 0.75-0.82).

    Bound: min-max's |w - ((q - 8) s + z)| <= s / 2 + u (|z| + 8 s), u the dtype's unit roundoff: s / 2 from
    rounding to a code, and the rest because the rounded z and s move the 16 codes' span [z - 8 s, z + 7 s] by at
    most u |z| + 8 u s past the group's [min, max], which clipping to 0..15 then costs. A searched group may clip
    its extremes, so entries have no such bound; its squared error (computed as `dequantize_int4` does) is at most
    min-max's, so each group's mean squared error stays within min-max's bound squared."""
    n, k = weight.shape
    codes = torch.empty(n, k, dtype=torch.int32, device=weight.device)
    scales = torch.empty(n, k // group, 2, dtype=weight.dtype, device=weight.device)
    block = max(1, INT4_BLOCK // k)  # rows at a time
    for rows in range(0, n, block):
        w = weight[rows : rows + block].float().view(-1, k // group, group)
        low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        span = (high - low).clamp(min=1e-12)
        best = _int4_fit(w, span / 15, low, weight.dtype)
        for step in INT4_STEPS if search else ():
            grid = torch.clamp(torch.round((w - low) * ((15 + step) / span)), 0, 15)
            scale, offset = _line(grid, w)
            fallback = scale <= 0  # one code for the whole group, or a falling line: keep min-max's numbers
            candidate = _int4_fit(w, torch.where(fallback, span / 15, scale), torch.where(fallback, low, offset),
                                  weight.dtype)
            better = candidate[0] < best[0]
            best = tuple(torch.where(better, new, old) for new, old in zip(candidate, best))
        _, q, scale, zero = best
        codes[rows : rows + block] = q.view(-1, k).to(torch.int32)
        scales[rows : rows + block] = torch.cat([scale, zero], -1)
    return codes, scales.transpose(0, 1).contiguous()


def _line(q: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Least squares w ~ s q + m over each group's last axis: (s, m), each [..., 1]; s = 0 where q is constant."""
    size = q.shape[-1]
    sq, sqq = q.sum(-1, keepdim=True), (q * q).sum(-1, keepdim=True)
    sw, sqw = w.sum(-1, keepdim=True), (q * w).sum(-1, keepdim=True)
    det = size * sqq - sq * sq
    scale = torch.where(det > 0, (size * sqw - sq * sw) / det.clamp(min=1e-30), torch.zeros_like(sq))
    return scale, (sw - scale * sq) / size


def _int4_fit(w: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dtype: torch.dtype):
    """The group's codes under s = `scale` and z = `low` + 8 s, both rounded to `dtype`: (squared error, codes,
    s, z), the codes as floats, s and z [..., 1] in `dtype`."""
    s = scale.to(dtype)
    z = (low + 8 * s.float()).to(dtype)
    q = torch.clamp(torch.round((w - z.float()) / s.float() + 8), 0, 15)
    error = ((q - 8) * s.float() + z.float() - w).square().sum(-1, keepdim=True)
    return error, q, s, z


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] row-scaled codes stand for (int8's integers or fp8's numbers, times each row's scale)."""
    return codes.float() * scales.float()[:, None]


def dequantize_int4(codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The fp32 weight [N, K] int4 codes (0..15, unpacked) and their scales and offsets stand for."""
    scale, zero = scales_and_zeros[..., 0].float().t(), scales_and_zeros[..., 1].float().t()  # [N, K / group]
    grouped = codes.float().view(codes.shape[0], -1, group)
    return ((grouped - 8) * scale[..., None] + zero[..., None]).view(codes.shape)


class QuantLinear(torch.nn.Module):
    """A bias-optional linear layer over int8 or int4 weights, computed by PyTorch's CPU kernels.

    `packed` = (codes, scales) as `pack` makes them (read back from the cache): used as they are, not re-quantized."""

    def __init__(self, linear: torch.nn.Linear, scheme: str, group: int = GROUP,
                 packed: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        weight = linear.weight.detach()
        self.scheme, self.group = scheme, group
        self.out_features, self.in_features = weight.shape
        self.rows = -(-self.out_features // INT4_ROWS) * INT4_ROWS if scheme == "int4" else self.out_features
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        codes, scales = packed if packed is not None else pack(weight, scheme, group)
        if scheme in ("int8", "int4") and not codes.is_cuda and scales.dtype == torch.float32:
            # PyTorch's CPU kernels for packed weights are fast in bf16 and slow in fp32 (one [1, 896] x [896, 4864]
            # product on this project's 2-core CPU: int8 0.14 ms in bf16 against 1.30 in fp32, int4 0.13 against
            # 3.58; the dense fp32 product 0.35): an fp32 model's packed layers multiply in bf16 on a CPU, their
            # scales rounded to bf16 (relative 2^-9, below either format's own error), the output back in fp32.
            # (int4's search compared its candidates at fp32 scales: after this rounding a searched group's error
            # may exceed what min-max's would have been, by the same 2^-9.)
            scales = scales.to(torch.bfloat16)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (each cast or slice only where it changes something: a decode step runs some 100 of these, and on a CPU
        # every no-op call costs microseconds)
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != self.scales.dtype:
            flat = flat.to(self.scales.dtype)
        flat = flat.contiguous()
        if self.scheme == "fp8" or self.scheme == "int8" and flat.is_cuda:  # cast, multiply, scale rows (gpt-fast's
            y = torch.nn.functional.linear(flat, self.codes.to(flat.dtype)) * self.scales  # WeightOnlyInt8Linear)
        elif self.scheme == "int8":
            y = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scales)
        else:
            y = int4_library_mm(flat, self.codes, self.group, self.scales)
            if self.rows != self.out_features:
                y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.scheme}" + (
            f", groups of {self.group}" if self.scheme == "int4" else "")


def fuse_packed(layers: list[QuantLinear]) -> QuantLinear | None:
    """One `QuantLinear` for several on the same input, their outputs side by side (the graph backend's q/k/v and
    gate/up on a CPU: one product instead of three or two), or None where their packed codes cannot be joined.

    Codes and scales are per output row, so the joined layer holds the same numbers and computes the same outputs.
    Joining int8 codes [N, K] and their scales [N], or int4 scales_and_zeros [K / group, rows, 2], is a concatenation.
    PyTorch's CPU int4 layout blocks the rows (by 64 on this project's AVX-512 CPU), so joining packed int4 codes
    equals packing the joined codes only where every layer but the last fills whole blocks and has no padding rows:
    `_int4_codes_join` checks exactly that on the installed torch, for these shapes. The layers' codes become row
    slices of the joined codes (no second copy); their scales stay their own (a quarter of int4 codes' bytes)."""
    first = layers[0]
    if any(layer.scheme != first.scheme or layer.group != first.group or layer.in_features != first.in_features
           or layer.codes.device != first.codes.device for layer in layers):
        return None
    biases = [layer.bias for layer in layers]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return None
    rows = [layer.rows for layer in layers]
    if first.scheme == "int4" and (any(layer.rows != layer.out_features for layer in layers[:-1]) or
                                   not _int4_codes_join(tuple(rows), first.in_features)):
        return None
    fused = QuantLinear.__new__(QuantLinear)
    torch.nn.Module.__init__(fused)
    fused.scheme, fused.group, fused.in_features = first.scheme, first.group, first.in_features
    fused.out_features = sum(layer.out_features for layer in layers)
    fused.rows = sum(rows)
    fused.bias = None if biases[0] is None else torch.nn.Parameter(torch.cat([b.detach() for b in biases]),
                                                                   requires_grad=False)
    fused.register_buffer("codes", torch.cat([layer.codes for layer in layers]))
    fused.register_buffer("scales", torch.cat([layer.scales for layer in layers], 1 if first.scheme == "int4" else 0))
    start = 0
    for layer in layers:
        size = layer.codes.shape[0]
        layer.codes = fused.codes[start : start + size]
        start += size
    return fused


@functools.cache
def _int4_codes_join(rows: tuple[int, ...], inputs: int) -> bool:
    """Whether PyTorch's CPU int4 packing of codes [sum(rows), inputs] equals its packings of the row blocks `rows`
    joined (tried on random codes: the layout is the installed torch's)."""
    codes = torch.randint(0, 16, (sum(rows), inputs), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    whole = int4_library_codes(codes)
    parts = torch.cat([int4_library_codes(part) for part in codes.split(list(rows))])
    return parts.shape == whole.shape and torch.equal(parts, whole)


def packed_bytes(model) -> int:
    """Bytes one decode step of `model` reads once its Linear layers may be `QuantLinear`s: every parameter once (tied
    embeddings counted once) and the quantized layers' buffers (their packed weights and scales)."""
    tensors = [*model.parameters(), *(b for m in model.modules() if isinstance(m, QuantLinear)
                                      for b in m.buffers(recurse=False))]
    return sum(t.numel() * t.element_size() for t in tensors)


def pack_error(shape: tuple[int, int], scheme: str, group: int = GROUP, cuda: bool = False) -> str | None:
    """Why a [N, K] weight cannot be packed in `scheme` (`cuda`: for the eager backend's CUDA kernel), or None."""
    if scheme not in ("int8", "int4", "fp8"):
        return f"the layers take int8, int4 or fp8, not {scheme!r}"
    if scheme == "int4" and shape[1] % group:
        return f"int4: a layer with {shape[1]} inputs does not split into groups of {group}"
    if scheme == "int4" and cuda and shape[1] % (TINYGEMM_INNER_K_TILES * 16):
        return (f"int4 on CUDA (tinygemm): a layer with {shape[1]} inputs is not a multiple of "
                f"{TINYGEMM_INNER_K_TILES * 16}; the graph backend's kernels take it")
    return None


def pack(weight: torch.Tensor, scheme: str, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] weight -> (codes, scales) in the layout the kernel reads: int8 codes [N, K] and scales [N]; int4
    codes packed by `_convert_weight_to_int4pack_for_cpu` (its layout is the installed torch's) with the rows
    padded up to a multiple of INT4_ROWS by zero rows, and scales_and_zeros [K / group, rows, 2]."""
    if reason := pack_error(tuple(weight.shape), scheme, group):
        raise ModelError(reason)
    if scheme in ROW_SCALED:
        return ROW_SCALED[scheme](weight)
    rows = -(-weight.shape[0] // INT4_ROWS) * INT4_ROWS
    padded = torch.cat([weight, weight.new_zeros(rows - weight.shape[0], weight.shape[1])])
    codes, scales = quantize_int4(padded, group)
    return int4_library_codes(codes), scales


def int4_library_codes(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] in 0..15 (int32 or uint8) -> the layout PyTorch's int4 kernel on their device reads: on
    CUDA tinygemm's (two codes a byte, high nibble first, tiled by the kernel's own rule), on a CPU its CPU
    kernel's."""
    if codes.is_cuda:
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(pairs, TINYGEMM_INNER_K_TILES)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


def int4_library_mm(x: torch.Tensor, codes: torch.Tensor, group: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] times int4 weights in `int4_library_codes`' layout: [M, rows] in x's dtype (bf16 on CUDA)."""
    if x.is_cuda:
        return torch.ops.aten._weight_int4pack_mm(x, codes, group, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, codes, group, scales_and_zeros)


TINYGEMM_INNER_K_TILES = 8  # gpt-fast's choice; K must then be a multiple of 8 x 16 = 128 (pack_error says so)


# ---- the graph backend's layout ---------------------------------------------------------------------------------

# The fused kernels' QUANT constant: fp8 shares int8's arithmetic (codes cast to the model's dtype, row scales after
# the sum); only the codes' dtype differs, and the kernels read it from the pointer.
KERNEL_FORMATS = {"none": 0, "int8": 1, "int4": 2, "fp8": 1}
PACKED_AS = {W4A8: "int4"}  # a format whose weights are packed as another's


@dataclass
class PackedWeight:
    """A [N, K] weight as the graph backend's fused kernels read it (the same codes `pack` makes, laid out for
    them). int8: `codes` [N, K] int8, `scales` [N]; int4: `codes` [N, K / 2] uint8, group by group: byte
    (group / 2) g + j holds the codes of inputs group g + j (low nibble) and group g + group / 2 + j (high nibble),
    so each half of a group is one contiguous run of inputs; `scales` and `zeros` [N, K / group]: w = (q - 8) s + z.

    `library`: int4 only, the same codes and scales again in the layout of PyTorch's own int4 kernel (tinygemm on
    CUDA: `int4_library_codes`, scales_and_zeros [K / group, rows, 2], rows padded to INT4_ROWS), where
    `with_library_layout` added it: products of LIBRARY_TOKENS tokens or more take it (spec/models/kernels.py)."""

    scheme: str
    shape: tuple[int, int]
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    group: int = GROUP
    library: tuple[torch.Tensor, torch.Tensor] | None = None

    def nbytes(self) -> int:
        """The bytes a product reads: one layout's (a product reads the library's copy instead, not besides)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [N, K] the codes stand for (the tests' reference)."""
        if self.scheme in ROW_SCALED:
            return dequantize_rows(self.codes, self.scales)
        grouped = self.int4_codes().view(self.shape[0], -1, self.group).float()  # [N, K / group, group]
        return ((grouped - 8) * self.scales.float()[..., None] + self.zeros.float()[..., None]).view(self.shape)

    def int4_codes(self) -> torch.Tensor:
        """int4: the codes [N, K] in 0..15 (uint8), inputs in order (each group's low nibbles, then its high ones)."""
        halves = self.codes.view(self.shape[0], -1, self.group // 2)  # [N, K / group, group / 2]
        return torch.cat([halves & 15, halves >> 4], -1).view(self.shape)


def library_layout_error(weight: PackedWeight, dtype: torch.dtype) -> str | None:
    """Why PyTorch's int4 kernel cannot take `weight` in a model of `dtype` (or None): int4 only, bf16 only
    (tinygemm takes nothing else; the CPU kernel is 27x slower in fp32, `QuantLinear`), and on CUDA inputs a
    multiple of tinygemm's tiles, 128."""
    if weight.scheme != "int4":
        return f"{weight.scheme}: PyTorch's int4 kernel takes int4 weights"
    if dtype != torch.bfloat16:
        return f"PyTorch's int4 kernel multiplies bfloat16 here, not {dtype}"
    return pack_error(weight.shape, "int4", weight.group, cuda=weight.codes.is_cuda)


def with_library_layout(weight: PackedWeight) -> PackedWeight:
    """`weight` (int4) with `library` filled: its codes unpacked to [N, K] and laid out again for PyTorch's int4
    kernel on their device, the rows padded to INT4_ROWS with zero codes and zero scales (weights 0, outputs
    dropped), the scales and offsets as scales_and_zeros. The same numbers: `test_quant` checks both products."""
    n, k = weight.shape
    codes = weight.int4_codes()  # uint8: a byte a code (an 8B head: 0.5 GB)
    rows = -(-n // INT4_ROWS) * INT4_ROWS
    codes = torch.cat([codes, codes.new_zeros(rows - n, k)])
    scales_and_zeros = torch.stack([weight.scales.t(), weight.zeros.t()], -1)  # [K / group, N, 2]
    scales_and_zeros = torch.cat([scales_and_zeros, scales_and_zeros.new_zeros(k // weight.group, rows - n, 2)], 1)
    library = (int4_library_codes(codes), scales_and_zeros.contiguous())
    return PackedWeight(weight.scheme, weight.shape, weight.codes, weight.scales, weight.zeros, weight.group, library)


def pack_for_kernels(weight: torch.Tensor, scheme: str, group: int = GROUP) -> PackedWeight:
    """[N, K] weight -> `PackedWeight` in `scheme`: the codes and scales of `ROW_SCALED` / `quantize_int4`
    (so the same weights get the same codes on every device), in the fused kernels' layout."""
    if reason := pack_error(tuple(weight.shape), scheme, group, cuda=False):
        raise ModelError(reason)
    n, k = weight.shape
    if scheme in ROW_SCALED:
        codes, scales = ROW_SCALED[scheme](weight)
        return PackedWeight(scheme, (n, k), codes.contiguous(), scales.contiguous())
    codes, scales_and_zeros = quantize_int4(weight, group)  # codes [N, K] in 0..15, [K / group, N, 2]
    halves = codes.view(n, k // group, 2, group // 2)
    pairs = (halves[:, :, 0] | halves[:, :, 1] << 4).to(torch.uint8).reshape(n, k // 2).contiguous()
    scale, zero = (scales_and_zeros[..., i].t().contiguous() for i in (0, 1))
    return PackedWeight("int4", (n, k), pairs, scale, zero, group)


# ---- the cache of packed weights ------------------------------------------------------------------------------
#
# Quantizing the 0.5B draft took 5.7 s at every load on this project's CPU. Its packed weights are kept in the user
# cache (as the de-quantised GGUF is, spec/models/packaged.py), one folder per source weights and format:
# `weights.safetensors` (every layer's codes and scales) and `manifest.json`, written last, holding the key the
# entry was built for and the SHA-256 of the weights file. An entry is used only if its key equals the one asked for
# and the file's hash matches; anything else (a stale key, a truncated or altered file, a missing layer) rebuilds it.

CACHE_FORMAT = 2  # bump whenever pack() would give other codes or scales for the same weights (2: the int4 search)


SAMPLE_BYTES = 4096  # of each weight's start and end, hashed beside a known source's name


def weights_digest(linears: list[tuple[str, torch.nn.Linear]], source: str | None = None) -> str:
    """SHA-256 naming the weights the layers would be packed from (names, shapes, dtypes, in order). Without a
    `source`, of every byte: the weights' identity whatever loaded them, 2.6 s for the 0.5B's 1.26 GB of bf16 on
    this project's 2-core CPU (one timing, idle machine), at every load. With one (`model.weights_source`, set by
    a loader that verified what it read, e.g. the packaged GGUF's SHA-256 and dtype), of the source's name and
    SAMPLE_BYTES at each end of every weight: 5 ms there, and still another key for weights changed at either end."""
    digest = hashlib.sha256()
    if source is not None:
        digest.update(f"source {source};".encode())
    for name, linear in linears:
        weight = linear.weight.detach().contiguous()
        digest.update(f"{name} {tuple(weight.shape)} {weight.dtype};".encode())
        raw = weight.view(-1).view(torch.uint8)
        if source is not None and raw.numel() > 2 * SAMPLE_BYTES:
            raw = torch.cat([raw[:SAMPLE_BYTES], raw[-SAMPLE_BYTES:]])
        digest.update(raw.numpy().data)
    return digest.hexdigest()


def cache_key(digest: str, scheme: str, group: int = GROUP) -> dict:
    """Everything that decides the packed bytes: the source weights, the format and its parameters, this code's
    packing (CACHE_FORMAT) and the torch whose `_convert_weight_to_int4pack_for_cpu` laid them out."""
    return {"weights_sha256": digest, "scheme": scheme, "group": group, "int4_rows": INT4_ROWS,
            "cache_format": CACHE_FORMAT, "torch": torch.__version__}


def cache_folder(key: dict) -> Path:
    """`<user cache>/quantized/<weights hash>-<format>`: one entry per source and format, so a stale one (another
    torch, another CACHE_FORMAT) is rebuilt in its place rather than piling up beside it."""
    return cache_root() / "quantized" / f"{key['weights_sha256'][:24]}-{key['scheme']}"


def read_cache(folder: Path, key: dict, names: list[str]) -> tuple[dict | None, str]:
    """(name -> (codes, scales)) from a valid entry, or (None, why it was not used)."""
    manifest = folder / "manifest.json"
    if not manifest.exists():
        return None, "no entry yet"
    try:
        stored = json.loads(manifest.read_text())
    except (OSError, ValueError) as err:
        return None, f"unreadable manifest ({err})"
    if not isinstance(stored, dict) or not isinstance(stored.get("key"), dict):
        return None, "unreadable manifest (not an entry's)"
    if stored["key"] != key:
        changed = sorted(k for k in key if stored["key"].get(k) != key[k])
        return None, f"stale entry ({', '.join(changed)} changed)"
    # Read once, then hashed and parsed from the same bytes: the tensors own their memory rather than mapping a
    # file that another process's rebuild could change under them (a mapped file rewritten in place is SIGBUS).
    try:
        raw = (folder / "weights.safetensors").read_bytes()
    except OSError as err:
        return None, f"unreadable weights file ({err})"
    if hashlib.sha256(raw).hexdigest() != stored.get("sha256"):
        return None, "corrupt entry (the weights file does not match its recorded SHA-256)"
    tensors = safetensors.torch.load(raw)
    if set(tensors) != {f"{name}.{part}" for name in names for part in ("codes", "scales")}:
        return None, "the entry's layers are not this model's"
    return {name: (tensors[f"{name}.codes"], tensors[f"{name}.scales"]) for name in names}, "cached"


def write_cache(folder: Path, key: dict, packed: dict) -> None:
    """Write an entry under a temporary name and rename it into place, so no reader sees half of one."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        tensors = {f"{name}.{part}": t.contiguous() for name, pair in packed.items()
                   for part, t in zip(("codes", "scales"), pair, strict=True)}
        raw = safetensors.torch.save(tensors)
        (tmp / "weights.safetensors").write_bytes(raw)
        sha = hashlib.sha256(raw).hexdigest()
        (tmp / "manifest.json").write_text(json.dumps({"key": key, "sha256": sha}, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process put an entry there meanwhile: keep theirs (verified when it is read)
            log.info(f"quantized cache: {folder.name} was written by another process meanwhile; keeping that one")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def quantize_model(model, scheme: str, what: str = "draft", cache: bool = True) -> dict:
    """Replace the decoder layers' and the head's Linear layers of a transformers causal LM in place; returns what
    it did: layers replaced, bytes of weights before and after, seconds, and whether the packed weights came from
    the cache (`cache=False`: neither read nor written). Every layer is checked before any is replaced."""
    reason = eager_quant_error(what, scheme, model.device, model.dtype)
    if reason:
        raise ModelError(reason)
    if scheme == "none":
        return {"scheme": "none"}
    start = time.perf_counter()
    cuda = model.device.type == "cuda"
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    for name, linear in linears:
        if reason := pack_error(tuple(linear.weight.shape), scheme, cuda=cuda):
            raise ModelError(f"{what}: layer {name}: {reason}")
    names = [name for name, _ in linears]
    packed, how = None, "not cached (quantized on the GPU, which takes well under a second)" if cuda else \
        "not cached (cache off)"
    cache = cache and not cuda
    if cache:
        key = cache_key(weights_digest(linears, getattr(model, "weights_source", None)), scheme)
        folder = cache_folder(key)
        packed, how = read_cache(folder, key, names)
    if packed is None:
        packed = {name: pack(linear.weight.detach(), scheme) for name, linear in linears}
        if cache:
            write_cache(folder, key, packed)
            how = f"quantized and cached ({how})"
    before = after = 0
    for name, linear in linears:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        quantized = QuantLinear(linear, scheme, packed=packed[name])
        before += linear.weight.numel() * linear.weight.element_size()
        after += sum(b.numel() * b.element_size() for b in quantized.buffers())
        setattr(parent, child, quantized)
    return {"scheme": scheme, "layers": len(linears), "weight_bytes_before": before, "weight_bytes_after": after,
            "seconds": time.perf_counter() - start, "cache": how}
