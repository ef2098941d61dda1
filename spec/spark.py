"""A DGX Spark projection from a GPU measurement: what each draft format would give on a 273 GB/s machine.

    python -m spec.spark benchmarks/h200/quant/bench_engine-quant.json          # a bench_engine JSON (--draft-quants)
    python -m spec.spark results/bench_engine-latest.json --bandwidth 273 --alphas 0.6,0.7,0.8

A PROJECTION, not a measurement: no Spark was run. Each step is split into the time its weight bytes take at the
measured copy bandwidth and the rest, the per-step overhead (launch latency, synchronisation, arithmetic that does
not hide behind the loads):

    step_spark = bytes / bandwidth_spark + (step_measured - bytes / bandwidth_measured)

where bytes are those a step reads (an embedding table is read one row a token, unless it is the head too), so the
overhead is carried over unchanged, per model and per draft format (a quantized draft keeps the overhead its
own kernels showed, not bf16's). A verify of n tokens adds to the target's projected step what it added on the
measured GPU (verify(n) - step, carried over in milliseconds; the Spark's slower arithmetic would make that extra
larger, but it stays small against the 8B's ~59 ms of bytes there). From these: c, the verify factor per K, and the
formula's best K and speedup (spec/calc.py) at each alpha. Writes results/spark-<time>.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spec.calc import best_k
from spec.io import Results, table
from spec.models.base import read_bytes  # the bytes a step reads, from bench_engine's weight_bytes
from spec.models.synthetic import RANDOM_ARCHS, RANDOM_VOCAB

SPARK_GB_S = 273.0  # DGX Spark: LPDDR5X unified memory, NVIDIA's datasheet figure


def project_ms(measured_ms: float, weight_bytes: float, measured_gb_s: float, target_gb_s: float) -> float:
    """One forward's time at `target_gb_s`: its bytes at the new bandwidth plus the overhead it showed at the old.

    >>> round(project_ms(4.13, 16.06e9, 4280.0, 273.0), 2)  # the 8B step: 3.75 ms of bytes + 0.38 ms overhead
    59.21
    """
    overhead = measured_ms - weight_bytes / measured_gb_s / 1e6
    return weight_bytes / target_gb_s / 1e6 + overhead


def known_embedding(bench: dict) -> dict:
    """The embedding tables of a llama-random record that predates bench_engine's `embedding` key: its two
    architectures are fixed (spec/models/synthetic.py). Nothing for other pairs."""
    if bench.get("pair") != "llama-random":
        return {}
    size = {"bfloat16": 2, "float16": 2, "float32": 4}[bench.get("dtype", "bfloat16")]
    return {role: {"bytes": RANDOM_VOCAB * RANDOM_ARCHS[arch]["hidden_size"] * size,
                   "tied": RANDOM_ARCHS[arch]["tie_word_embeddings"]}
            for role, arch in (("target", "llama-3.1-8b"), ("draft", "llama-3.2-1b"))}


def project(bench: dict, bandwidth: float, alphas: list[float], max_k: int = 16) -> list[dict]:
    """One row per (draft format, alpha) from a bench_engine JSON: projected steps, c, best K and its speedup."""
    measured = bench["bandwidth_gb_s"]
    weights = bench["weight_bytes"]
    embedding = bench.get("embedding") or known_embedding(bench)
    steps = bench["steps_ms"]["graph"]
    target_ms = {int(n): ms for n, ms in steps["target"].items()}
    target = project_ms(target_ms[1], read_bytes(weights["target"], embedding.get("target"), False), measured,
                        bandwidth)
    verify = {k: (target + target_ms[k + 1] - target_ms[1]) / target for k in range(1, max_k + 1)
              if k + 1 in target_ms}
    formats = ["bf16"] + [key.removeprefix("draft_step_ms_") for key in bench if key.startswith("draft_step_ms_")]
    rows = []
    for fmt in formats:
        step = float(steps["draft"]["1"]) if fmt == "bf16" else bench[f"draft_step_ms_{fmt}"]
        size = read_bytes(weights["draft" if fmt == "bf16" else f"draft_{fmt}"], embedding.get("draft"),
                          fmt != "bf16")
        draft = project_ms(step, size, measured, bandwidth)
        c = draft / target
        for alpha in alphas:
            k, x = best_k(alpha, c, max_k, verify, ks=sorted(verify))
            rows.append({"draft": fmt, "read_gb": size / 1e9, "measured_draft_ms": step, "draft_ms": draft,
                         "target_ms": target, "c": c, "alpha": alpha, "best_k": k, "speedup": x,
                         "tok_s": 1e3 / target * x})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m spec.spark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench", type=Path, help="a bench_engine JSON (graph backend; --draft-quants adds formats)")
    parser.add_argument("--bandwidth", type=float, default=SPARK_GB_S,
                        help=f"the machine's memory bandwidth in GB/s (default {SPARK_GB_S:g}, a DGX Spark)")
    parser.add_argument("--alphas", default="0.7,0.8", help="acceptance rates to project at (default 0.7,0.8)")
    parser.add_argument("--max-k", type=int, default=16, help="largest K considered (default 16; only Ks whose "
                                                              "K + 1 verify was measured)")
    args = parser.parse_args(argv)
    if not args.bench.is_file():
        parser.error(f"no such file: {args.bench}")
    if args.bandwidth <= 0:
        parser.error(f"--bandwidth must be > 0, got {args.bandwidth}")
    alphas = [float(a) for a in args.alphas.split(",")]
    if not all(0 <= a < 1 for a in alphas):
        parser.error(f"--alphas must lie in [0, 1), got {args.alphas}")
    bench = json.loads(args.bench.read_text())
    if "graph" not in bench.get("steps_ms", {}):
        parser.error(f"{args.bench} has no graph-backend steps: run spec.bench_engine with --backends graph")
    rows = project(bench, args.bandwidth, alphas, args.max_k)
    print(f"PROJECTION for {args.bandwidth:g} GB/s from {bench.get('device_name', '?')} measurements "
          f"({bench.get('pair')}, {bench.get('dtype')}, copy {bench['bandwidth_gb_s']:.0f} GB/s): bytes scaled, "
          "per-step overhead carried over")
    print(table(rows, [("draft", "s"), ("read_gb", ".2f"), ("measured_draft_ms", ".3f"), ("draft_ms", ".2f"),
                       ("target_ms", ".1f"), ("c", ".3f"), ("alpha", ".2f"), ("best_k", "d"), ("speedup", ".2f"),
                       ("tok_s", ".1f")]))
    results = Results("spark")
    for row in rows:
        results.add(row)
    path = results.finish({"task": "spark", "projection": True, "bandwidth_gb_s": args.bandwidth,
                           "source": str(args.bench), "source_device": bench.get("device_name")})
    print(f"saved {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
