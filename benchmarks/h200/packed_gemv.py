"""Where a packed one-token draft step spends its time: each of the 1B's products (o, gate/up, down, head) as the
graph backend launches it, in bf16, int8 and int4, timed alone (a CUDA graph of 20 launches over copies of the
weights that do not fit in L2, no PDL), with the
bytes it reads, the rate that makes, and the instructions its loop issues per weight (benchmarks/kernel_mix.py).
A few other tiles are timed beside the chosen ones (`ALTERNATES`). Random weights and codes: the time does not
depend on their values.

    PYTHONPATH=. python benchmarks/h200/packed_gemv.py --json results/packed_gemv.json

Issue 18 asks what stands between the int4 step and its byte floor; this answers it per product. Beside ours, the
libraries' products of the same shapes (`library_products`: tinygemm for int4, gpt-fast's int8, cuBLAS), which issue
18 asks ours to be measured against in the same run.
"""

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_mix import PRODUCTS, compile_product  # noqa: E402

from spec.models import kernels  # noqa: E402
from spec.models.graph import no_collection  # noqa: E402
from spec.models.quant import GROUP, PackedWeight, QuantLinear  # noqa: E402

# Tiles timed beside the ones the wrappers choose. A packed head in bf16's H200 tile (128 columns) issued 16.8
# instructions a weight in its loop against 8.9 at 256 (kernel_mix.py); the H100 measured 102 us at (16, 256, 4)
# against 174 at (16, 128, 4) (benchmarks/h100/session15/tune_kernels-1b-int4.json): PACKED_HEAD_COLUMNS. int4's
# word kernel (session 19) takes kernels.INT4_TILE: beside it, more rows a thread, and the tiles it had before.
ALTERNATES = {("int4", "head"): [(32, 1024, 4), (16, 256, 4)], ("int8", "head"): [(16, 128, 4)],
              ("int4", "gate_up"): [(32, 512, 4), (8, 512, 4)], ("int4", "down"): [(32, 1024, 4), (8, 4096, 8)],
              ("int4", "o"): [(32, 1024, 4), (8, 2048, 8)],
              # w4a8 (int4 codes x 8-bit inputs, a draft's): fewer registers and instructions a weight than int4's
              # word kernel, so more rows a thread may pay
              ("w4a8", "o"): [(16, 1024, 4), (16, 2048, 8), (32, 1024, 4)],
              ("w4a8", "gate_up"): [(32, 1024, 4), (8, 1024, 4), (16, 2048, 8)],
              ("w4a8", "down"): [(16, 1024, 4), (16, 2048, 4), (32, 1024, 4)],
              ("w4a8", "head"): [(32, 1024, 4), (32, 512, 4), (16, 2048, 8)]}


# q/k/v's 2-4-token product over packed weights: a RAW product of all 3072 rows into fp32 (its rotary embedding is a
# second kernel), in the tile the q/k/v wrapper passes (`kernels.gemv_config("qkv", head size / 2, ...)`). Its
# one-token product is another kernel (`qkv_rope`), not timed here.
QKV = ("qkv", kernels.RAW, 3072, 2048)
QKV_HALF_HEAD = 32


def weight(scheme: str, rows: int, k: int, device) -> torch.Tensor | PackedWeight:
    g = torch.Generator(device=device).manual_seed(0)
    if scheme == "none":
        return torch.randn(rows, k, generator=g, device=device, dtype=torch.bfloat16) * 0.02
    scales = torch.rand(rows, k // GROUP if scheme == "int4" else 1, generator=g, device=device) * 1e-3
    if scheme == "int8":
        codes = torch.randint(-127, 128, (rows, k), generator=g, device=device, dtype=torch.int8)
        return PackedWeight("int8", (rows, k), codes, scales[:, 0].to(torch.bfloat16).contiguous())
    codes = torch.randint(0, 256, (rows, k // 2), generator=g, device=device, dtype=torch.uint8)
    return PackedWeight("int4", (rows, k), codes, scales.to(torch.bfloat16), (scales * 0.1).to(torch.bfloat16))


L2_CLEAR = 160 * 2**20  # bytes of distinct weights a timing cycles through: over an H100's / H200's 50 MB L2


def nbytes(w) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes()


def copy_of(w):
    if isinstance(w, torch.Tensor):
        return w.clone()
    return PackedWeight(w.scheme, w.shape, w.codes.clone(), w.scales.clone(),
                        None if w.zeros is None else w.zeros.clone(), w.group)


def library_products(scheme: str, rows: int, k: int, copies: int, device) -> dict[str, list]:
    """The same product as the libraries compute it, one layer per weight copy, by name: for int4 PyTorch's tinygemm
    (`aten._weight_int4pack_mm`, the CUDA kernel gpt-fast's and torchao's int4 weight-only layers call), for int8
    gpt-fast's `WeightOnlyInt8Linear` arithmetic (codes cast to bf16, cuBLAS, rows scaled: what the eager backend
    runs) and PyTorch's `aten._weight_int8pack_mm` where this build has it for CUDA, for bf16 cuBLAS. Each is the
    product alone: our kernels also apply RMSNorm, SiLU(gate) * up or the residual add in the same pass."""
    linears = []
    for _ in range(copies):
        linear = torch.nn.Linear(k, rows, bias=False, device=device, dtype=torch.bfloat16)
        torch.nn.init.normal_(linear.weight, std=0.02)
        linears.append(linear)
    if scheme == "none":
        return {"cuBLAS (F.linear)": linears}
    if scheme == "int4":
        return {"tinygemm": [QuantLinear(linear, "int4") for linear in linears]}
    if scheme != "int8":
        return {}
    layers = [QuantLinear(linear, "int8") for linear in linears]
    out = {"gpt-fast int8 (cast, cuBLAS, scale)": layers}
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    try:
        torch.ops.aten._weight_int8pack_mm(x, layers[0].codes, layers[0].scales)
        out["aten._weight_int8pack_mm"] = [
            lambda x, codes=layer.codes, scales=layer.scales: torch.ops.aten._weight_int8pack_mm(x, codes, scales)
            for layer in layers]
    except (RuntimeError, NotImplementedError) as e:  # not in every build for CUDA
        print(f"aten._weight_int8pack_mm on CUDA: {type(e).__name__}: {str(e)[:80]}", flush=True)
    return out


def time_us(launches, repeats: int = 20, trials: int = 10) -> float:
    """Median time of one launch, from a CUDA graph of `repeats` launches (cycling through `launches`, each over
    its own copy of the weights, so they stream from memory, not from L2) replayed `trials` times."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for launch in launches:
            launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with no_collection(), torch.cuda.graph(graph):
        for i in range(repeats):
            launches[i % len(launches)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / repeats)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", default="none,int8,int4", help="of none, int8, int4 and w4a8 (int4 codes "
                        "times 8-bit inputs, one token only; default %(default)s)")
    parser.add_argument("--products", default=",".join(PRODUCTS), help=f"of {', '.join(PRODUCTS)} and qkv (2-4 "
                        "tokens over packed weights only)")
    parser.add_argument("--tokens", default="1", help="token counts, e.g. 1,2,4: packed weights' 2-4-token products "
                        "go through kernels.gemv_few, timed in the chosen tile and a few others (`few_alternates`); "
                        "the rest (bf16's, past 4 tokens) in the chosen tile only")
    parser.add_argument("--json", default="results/packed_gemv.json")
    parser.add_argument("--no-count", action="store_true", help="time only (kernel_mix's counts are the same anywhere)")
    parser.add_argument("--no-libraries", action="store_true", help="do not time the libraries' products beside ours "
                        "(tinygemm for int4, gpt-fast's int8, cuBLAS for bf16: `library_products`)")
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for scheme in args.schemes.split(","):
        packed = "int4" if scheme == "w4a8" else scheme  # w4a8's weights are int4's
        for name in args.products.split(","):
            kind, epilogue, n, k = QKV if name == "qkv" else PRODUCTS[name]
            copies = [weight(packed, n * (2 if epilogue == kernels.SILU_MUL else 1), k, device)]
            size = nbytes(copies[0])
            copies += [copy_of(copies[0]) for _ in range(min(19, -(-L2_CLEAR // size) - 1))]
            norm = None if epilogue == kernels.ADD else torch.ones(k, device=device, dtype=torch.bfloat16)
            for tokens in map(int, args.tokens.split(",")):
                if name == "qkv" and not kernels.few_tokens(tokens, packed) or scheme == "w4a8" and tokens > 1:
                    continue
                x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16).squeeze(0)
                dtype = torch.float32 if epilogue in (kernels.LOGITS, kernels.RAW) else torch.bfloat16
                out = torch.zeros(tokens, n, device=device, dtype=dtype).squeeze(0)
                chosen = tuple(kernels.gemv_config(kind, QKV_HALF_HEAD if name == "qkv" else n, k, device, tokens,
                                                   scheme))
                alternates = ALTERNATES.get((scheme, name), []) if tokens == 1 else \
                    few_alternates(chosen, tokens) if kernels.few_tokens(tokens, scheme) else []
                configs = list(dict.fromkeys([chosen, *alternates]))
                with kernels.compiling_ahead(ignore_errors=True):  # every variant compiles at once
                    for config in configs:
                        kernels.gemv(x, copies[0], out, epilogue, norm, 1e-5, config, a8=scheme == "w4a8")
                for config in configs:
                    rows.append(time_product(args, scheme, name, n, k, tokens, config, chosen, copies, x, out,
                                             epilogue, norm, size))
                if not args.no_libraries and scheme != "w4a8":
                    rows += time_libraries(scheme, name, n * (2 if epilogue == kernels.SILU_MUL else 1), k, tokens,
                                           len(copies), x, size, device)
    with open(args.json, "w") as f:
        json.dump({"device_name": torch.cuda.get_device_name(device), "command": "benchmarks/h200/packed_gemv.py",
                   "rows": rows}, f, indent=1)
    print("wrote", args.json)


def few_alternates(chosen: tuple[int, ...], tokens: int) -> list[tuple[int, ...]]:
    """Tiles timed beside a 2-4-token packed product's chosen one (`gemv_few`'s): twice and half its columns, twice
    its rows, half its rows with twice the columns."""
    bn, block_k, warps = chosen[:3]
    return [(bn, block_k * 2, warps), (bn, max(32, block_k // 2), warps), (bn * 2, block_k, warps),
            (max(2, bn // 2), block_k * 2, warps)]


def time_libraries(scheme, name, rows, k, tokens, copies, x, size, device) -> list[dict]:
    """Each library's product of this shape and format, timed as ours are (`library_products`); `size` is our
    packed weight's bytes, the rate's numerator for every one (the libraries' layouts differ a little)."""
    out = []
    inputs = x.view(tokens, k)
    for library, layers in library_products(scheme, rows, k, copies, device).items():
        try:
            us = time_us([functools.partial(layer, inputs) for layer in layers])
        except Exception as e:  # a shape or format the library cannot take
            print(f"{scheme:5} {name:8} x{tokens} {library}: {type(e).__name__}: {str(e)[:80]}", flush=True)
            out.append({"scheme": scheme, "product": name, "tokens": tokens, "library": library, "error": str(e)[:300]})
            continue
        print(f"{scheme:5} {name:8} x{tokens} {library:37} {us:8.2f} us {size / us / 1e6:5.2f} TB/s", flush=True)
        out.append({"scheme": scheme, "product": name, "n": rows, "k": k, "tokens": tokens, "library": library,
                    "us": us, "bytes": size, "tb_s": size / us / 1e6})
    return out


def time_product(args, scheme, name, n, k, tokens, config, chosen, copies, x, out, epilogue, norm, size) -> dict:
    try:
        us = time_us([functools.partial(kernels.gemv, x, c, out, epilogue, norm, 1e-5, config, a8=scheme == "w4a8")
                      for c in copies])
    except Exception as e:  # a tile that does not compile or fit
        print(f"{scheme:5} {name:8} x{tokens} {config}: {type(e).__name__}: {str(e)[:80]}", flush=True)
        return {"scheme": scheme, "product": name, "tokens": tokens, "config": list(config), "error": str(e)[:300]}
    loop = {"per_weight": None, "registers": None}
    if not args.no_count and tokens == 1:
        try:
            loop = compile_product(scheme, name, config)
        except Exception as e:  # no disassembler: the times still stand
            loop["error"] = str(e)
    row = {"scheme": scheme, "product": name, "n": n, "k": k, "tokens": tokens, "config": list(config),
           "alternate": config != chosen, "us": us, "bytes": size, "tb_s": size / us / 1e6,
           "loop_per_weight": loop["per_weight"], "registers": loop["registers"]}
    per_weight = f"{loop['per_weight']:.2f}" if loop["per_weight"] else "?"
    print(f"{scheme:5} {name:8} x{tokens} {str(config) + ('*' if row['alternate'] else ''):17} "
          f"{us:8.2f} us {size / 1e6:7.2f} MB {row['tb_s']:5.2f} TB/s  {per_weight:>6} instr/weight "
          f"regs {loop['registers']}", flush=True)
    return row


if __name__ == "__main__":
    main()
