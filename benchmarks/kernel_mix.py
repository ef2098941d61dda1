"""What a fused one-token product asks of the GPU per weight: its Triton kernel compiled for an H100/H200 (sm_90) on
any machine with Triton -- no GPU needed -- and the machine code of its main loop counted, instruction by
instruction, per weight it reads.

    python benchmarks/kernel_mix.py                       # the 1B's products, bf16 / int8 / int4, the H200's tiles
    python benchmarks/kernel_mix.py --json results/kernel_mix.json
    python benchmarks/kernel_mix.py --schemes int8,int4 --tokens 2,4   # gemv_few: 2-4 tokens over packed weights

Why: a product streams its weights once, so it runs at the memory's speed only while the multiprocessors issue its
instructions faster than the bytes arrive. An H200 issues about 1.0e12 warp-instructions a second (132
multiprocessors x 4 schedulers x ~1.9 GHz), 3.2e13 of a thread's, and reads 4.8e12 bytes: a loop that spends more
than ~13 of a thread's instructions a weight in bf16 (2 bytes), ~6.7 in int8 (1 byte) or ~4.2 in int4 (0.625 byte
with its scales) cannot keep up with its bytes even at perfect issue. The counts are static and a thread's (one
pass of the loop body, divided by the weights one thread reads per pass).

Needs Triton (it ships with torch on Linux; on a CPU-only machine: pip install triton). Its bundled cuobjdump
disassembles the cubin.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec.models import kernels  # noqa: E402

PRODUCTS = {  # Llama-3.2-1B, one token: (kind, epilogue, output rows, inputs)
    "o": ("add", kernels.ADD, 2048, 2048),
    "gate_up": ("silu_mul", kernels.SILU_MUL, 8192, 2048),
    "down": ("add", kernels.ADD, 2048, 8192),
    "head": ("logits", kernels.LOGITS, 128256, 2048),
}
CODES = {"none": "*bf16", "int8": "*i8", "int4": "*u8", "w4a8": "*u8"}


def loop_body(sass: str) -> collections.Counter:
    """Opcodes (without modifiers) of the longest backward branch's body: the product's loop over its inputs."""
    lines = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", line)
        if m:
            lines.append((int(m.group(1), 16), m.group(2), m.group(3)))
    best = collections.Counter()
    for addr, op, rest in lines:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            body = collections.Counter(o.split(".")[0] for a, o, _ in lines if int(target.group(1), 16) <= a <= addr)
            if sum(body.values()) > sum(best.values()):
                best = body
    return best


def product_tiles(scheme: str, product: str, device_name: str, tokens: int = 1) -> tuple[int, ...]:
    """The tiles the wrappers launch this product with on that GPU (its tuned table, else the rules)."""
    kind, _, n, k = PRODUCTS[product]
    with kernels.trying(kernels.TUNED.get(device_name, {})):
        return kernels.gemv_config(kind, n, k, None, tokens, scheme)


def compile_product(scheme: str, product: str, config: tuple[int, ...], tokens: int = 1) -> dict:
    """The kernel of this product in these tiles, compiled for sm_90, and its loop's instructions: the one-token
    kernel, or for 2 or 4 tokens over packed weights `gemv_few` (its token count padded: `tokens` is 2 or 4)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from spec.models import triton_kernels

    _, epilogue, n, k = PRODUCTS[product]
    bn, block_k, warps = config[:3]
    quant = {"none": 0, "int8": 1, "int4": 2, "w4a8": 2}[scheme]
    fn = triton_kernels.gemv if tokens == 1 else triton_kernels.gemv_few
    signature = {"x_ptr": "*bf16", "nw_ptr": "*bf16", "eps": "fp32", "w_ptr": CODES[scheme], "s_ptr": "*bf16",
                 "z_ptr": "*bf16", "out_ptr": "*fp32" if epilogue == kernels.LOGITS else "*bf16",
                 **({} if tokens == 1 else {"M": "i32"}), "N": "i32", "K": "i32"}
    constants = dict(NORM=epilogue != kernels.ADD, EPILOGUE=epilogue, BN=bn, BLOCK_K=block_k, PDL=True, QUANT=quant,
                     G=kernels.GROUP, **({"A8": scheme == "w4a8"} if tokens == 1 else {"XD": 0, "MT": tokens}))
    signature.update({name: "constexpr" for name in constants})
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if name.endswith("_ptr") or name in ("N", "K")}  # as Triton specialises them at launch
    compiled = triton.compile(ASTSource(fn, signature, constants, aligned), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "kernel.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(tool), "-sass", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([str(tool), "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    body = loop_body(sass)
    rows = bn * (2 if epilogue == kernels.SILU_MUL else 1)
    per_pass = rows * block_k / (32 * warps)  # weights one thread reads per pass of the loop
    registers = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return {"scheme": scheme, "product": product, "config": list(config), "tokens": tokens,
            "stack": int(stack.group(1)) if stack else None, "loop_instructions": sum(body.values()),
            "weights_per_thread": per_pass, "per_weight": sum(body.values()) / per_pass if body else None,
            "registers": int(registers.group(1)) if registers else None, "opcodes": dict(body.most_common())}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", default="none,int8,int4", help="weight formats (default: %(default)s)")
    parser.add_argument("--products", default=",".join(PRODUCTS), help="of %(default)s")
    parser.add_argument("--device-name", default="NVIDIA H200", help="whose tuned tiles (else the rules)")
    parser.add_argument("--tokens", default="1", help="1 (the one-token kernel) and/or 2, 4 (gemv_few, packed "
                        "schemes only; int4 also in the one-token tile it halves, to show why): default %(default)s")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        parser.exit(1, "needs Triton: pip install triton (no GPU needed)\n")
    out = []
    token_counts = [int(t) for t in args.tokens.split(",")]
    if any(t not in (1, 2, 4) for t in token_counts):
        parser.error(f"--tokens takes 1, 2 and 4, got {args.tokens!r}")
    for scheme in args.schemes.split(","):
        for product in args.products.split(","):
            if product not in PRODUCTS:
                parser.error(f"unknown product {product!r}: one of {', '.join(PRODUCTS)}")
            for tokens in token_counts:
                if tokens > 1 and scheme == "none":
                    continue  # bf16's few-token products are the tensor cores' (gemv_rows)
                tiles = [product_tiles(scheme, product, args.device_name, tokens)]
                if tokens > 1 and scheme == "int4":
                    tiles.append(product_tiles(scheme, product, args.device_name))  # the one-token tile, unhalved
                for config in dict.fromkeys(tiles):
                    row = compile_product(scheme, product, config, tokens)
                    row["chosen"] = config == tiles[0]
                    out.append(row)
                    top = ", ".join(f"{op} {count}" for op, count in list(row["opcodes"].items())[:8])
                    per_weight = f"{row['per_weight']:.2f}" if row["per_weight"] else "no loop"
                    label = str(tuple(config)) + ("" if row["chosen"] else "*")
                    print(f"{scheme:5} {product:8} x{tokens} tiles {label:17} {row['loop_instructions']:5} "
                          f"instructions / {row['weights_per_thread']:5.0f} weights = {per_weight:>7} a weight "
                          f"(regs {row['registers']}, stack {row['stack']}): {top}", flush=True)
    import triton

    result = {"target": "sm_90", "device_name": args.device_name, "triton": triton.__version__, "rows": out}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print("wrote", args.json)
    return result


if __name__ == "__main__":
    main()
