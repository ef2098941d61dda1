"""ms per one-token step of the graph backend's variants on one pair, side by side in one process:
the fused kernels with and without programmatic dependent launch, and the layer stack (not compiled), each for
forwards of 1, 5 and 8 tokens.

    PYTHONPATH=. python benchmarks/h200/step_variants.py --pair llama-random --device cuda
"""

import argparse
import json
import sys

import torch

from spec import kernels
from spec.bench_engine import step_ms
from spec.cli import add_model_args, load_from_args
from spec.graph import GraphModel

parser = argparse.ArgumentParser()
add_model_args(parser)
parser.add_argument("--context", type=int, default=512)
parser.add_argument("--reps", type=int, default=50)
parser.add_argument("--json")
args = parser.parse_args()
args.backend = "eager"
pair = load_from_args(args)
context = torch.randint(0, pair.target.vocab, (args.context - 1,), generator=torch.Generator().manual_seed(0))
context = context.to(pair.device)
rows = {}
for variant in ("fused+pdl", "fused", "stack"):
    kernels.PDL = variant == "fused+pdl"
    kernels._pdl.cache_clear()
    for role in ("target", "draft"):
        m = getattr(pair, role)
        graph = GraphModel(m.model, m.vocab, role, max_length=args.context + 64, fused_step=variant != "stack")
        for n in (1, 5, 8):
            rows[f"{role} {variant} n={n}"] = ms = step_ms(graph, context, n, args.reps, m.vocab)
            print(f"{role:6s} {variant:10s} n={n} {ms:.3f} ms", flush=True)
        del graph
for variant in ("fused+pdl", "fused", "stack"):
    one = rows[f"target {variant} n=1"]
    print(f"{variant}: c {rows[f'draft {variant} n=1'] / one:.3f}, verify 8/1 {rows[f'target {variant} n=8'] / one:.3f}")
if args.json:
    json.dump({"command": " ".join(sys.argv), "ms": rows}, open(args.json, "w"), indent=1)
