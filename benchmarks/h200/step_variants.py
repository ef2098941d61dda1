"""ms per forward of the graph backend's variants on one pair, side by side in one process: the fused kernels for 1-16
tokens with and without programmatic dependent launch ("fused", the default), the same with the attention's combine
always a second kernel ("twopass"), the fused one-token step with verifies on the layer stack ("fused1"), and the
layer stack alone (not compiled), each for forwards of 1, 2, 5, 8, 9 and 16 tokens; "chunk<N>" runs the fused kernels
with the split-KV attention reading N cached positions a program (the rule, `kernels._chunk`: 32 up to a 1024-token
span, 64 past one program's rows), so fewer programs a head and fewer partial sums for its last program to combine;
"apart" runs the fused kernels with the launches between int4 library products not fused (`kernels.LIBRARY_FUSED`
off: every product norms its own input, the q/k/v product's output is copied to fp32 first); "split<rule>" runs the
fused kernels with 2-16-token products over the model's own weights split over their inputs by that rule
(`kernels.SPLIT_PLAIN`: none, small, all); "cublas<lo>-<hi>" runs the products of lo-hi tokens over the model's own
weights through cuBLAS ("cublas0": none of them; `kernels.LIBRARY_PLAIN`); "smem<KB>" caps the 2-64-token products'
pipeline buffers at KB kilobytes (`kernels.SHARED_MEMORY`: fewer stages, then fewer columns), so that more than one
program fits on a multiprocessor and the next kernel's programs can start beside this one's (PDL); "parts<R>" runs
the attention of forwards whose rows the one-pass combine does not take in one kernel, R query rows a program, each
over a run of chunks with the block's last program combining (`kernels.PART_ROWS`, 16 by default for 17-64 rows;
"parts0": always the two kernels, partial sums and a combine); "rope" / "ropeapart" the 2-64-token q/k/v product with
its rotary embedding in its epilogue, or in a kernel after it (`kernels.ROPE_IN_PRODUCT`); "stream<N>" the one-token
products in `gemv_stream`, N programs a multiprocessor, each taking row block after row block (`kernels.STREAM`;
"stream0": `gemv`, the default; "stream1000": `gemv_stream` with as many programs as blocks). `--tree-nodes`
adds the target's verify of that many tree nodes and the draft's frontier of 8 (`bench_engine.tree_ms`). The draft
runs in `--draft-quant`'s format (none, int8, int4, fp8).

    PYTHONPATH=. python benchmarks/h200/step_variants.py --pair llama-random --device cuda
    PYTHONPATH=. python benchmarks/h200/step_variants.py --pair llama-random --device cuda --ns 1 \
        --variants fused+pdl,chunk64+pdl,chunk128+pdl --draft-quant int4 --context 512
    PYTHONPATH=. python benchmarks/h200/step_variants.py --pair llama-random --device cuda --ns 1,2,3,4,5,8,16 \
        --variants fused+pdl,apart+pdl,fused+pdl,apart+pdl --draft-quant int4
"""

import argparse
import gc
import json
import sys

import torch

from spec.bench_engine import step_ms, tree_ms
from spec.cli import add_model_args, load_from_args
from spec.models import kernels
from spec.models.graph import GraphModel

parser = argparse.ArgumentParser()
add_model_args(parser, auto_draft=False)
parser.add_argument("--context", type=int, default=512)
parser.add_argument("--reps", type=int, default=50)
parser.add_argument("--ns", default="1,2,5,8,9,16")
parser.add_argument("--variants", default="fused+pdl,fused,twopass+pdl,fused1+pdl,stack")
parser.add_argument("--tree-nodes", default="", help="also the target's verify of these many tree nodes and the "
                    "draft's forward over a frontier of 8 (bench_engine.tree_ms), e.g. 16,32,64")
parser.add_argument("--json")
args = parser.parse_args()
args.backend, quant, args.draft_quant = "eager", args.draft_quant, "none"  # the draft is packed here
pair = load_from_args(args)
context = torch.randint(0, pair.target.vocab, (args.context - 1,), generator=torch.Generator().manual_seed(0))
context = context.to(pair.device)
ns = [int(n) for n in args.ns.split(",")]
variants = args.variants.split(",")
one_pass, chunk, library_fused = kernels.ONE_PASS_ELEMENTS, kernels._chunk, kernels.LIBRARY_FUSED
split_plain, library_plain, shared_memory = kernels.SPLIT_PLAIN, kernels.LIBRARY_PLAIN, kernels.SHARED_MEMORY
part_rows, rope_in_product, stream = kernels.PART_ROWS, kernels.ROPE_IN_PRODUCT, kernels.STREAM
# A variant named twice (the rule first and last, to see the drift) is labelled by its turn: fused+pdl, fused+pdl#2.
labels = [v if not variants[:i].count(v) else f"{v}#{variants[:i].count(v) + 1}" for i, v in enumerate(variants)]
rows = {}
for variant, label in zip(variants, labels, strict=True):
    kernels.ONE_PASS_ELEMENTS = 0 if variant.startswith("twopass") else one_pass
    kernels._chunk = (lambda span, rows_n=1, n=int(variant[5:].split("+")[0]): n) if variant.startswith("chunk") \
        else chunk
    kernels.LIBRARY_FUSED = library_fused and not variant.startswith("apart")
    kernels.SPLIT_PLAIN = variant[5:].split("+")[0] if variant.startswith("split") else split_plain
    kernels.SHARED_MEMORY = (int(variant[4:].split("+")[0]) * 1024 if variant.startswith("smem")
                             else shared_memory)
    kernels.LIBRARY_PLAIN = (kernels.token_range(variant[6:].split("+")[0], None) if variant.startswith("cublas")
                             else library_plain)
    kernels.PART_ROWS = int(variant[5:].split("+")[0]) if variant.startswith("parts") else part_rows
    kernels.ROPE_IN_PRODUCT = {"rope": True, "ropeapart": False}.get(variant.split("+")[0], rope_in_product)
    kernels.STREAM = int(variant[6:].split("+")[0]) if variant.startswith("stream") else stream
    for role in ("target", "draft"):
        m = getattr(pair, role)
        if role == "draft" and quant != "none" and variant.startswith(("stack", "fused1")):
            print(f"draft  {variant:10s} skipped: {quant} weights run in the fused kernels only", flush=True)
            continue
        graph = GraphModel(m.model, m.vocab, role, max_length=args.context + 64, fused_step=variant != "stack",
                           fused_tokens=None if variant == "stack" else 1 if variant.startswith("fused1") else 16,
                           pdl=variant.endswith("+pdl"), quant=quant if role == "draft" else "none")
        for n in ns:
            rows[f"{role} {label} n={n}"] = ms = step_ms(graph, context, n, args.reps, m.vocab)
            print(f"{role:6s} {label:10s} n={n:2d} {ms:.3f} ms", flush=True)
        nodes = [int(t) for t in args.tree_nodes.split(",") if t] if role == "target" else [8] * bool(args.tree_nodes)
        for t in nodes:
            rows[f"{role} {label} tree={t}"] = ms = tree_ms(graph, context, t, args.reps, m.vocab,
                                                            cached=4 if role == "draft" else 0)
            print(f"{role:6s} {label:10s} tree={t:2d} {ms:.3f} ms", flush=True)
        # The model sits in reference cycles: free its graphs and memory before the next is built (a collection
        # inside the next model's capture invalidated it on an H100 in session 22; GraphModel now holds it off).
        del graph
        gc.collect()
for variant in labels:
    one = rows[f"target {variant} n=1"]
    ratios = ", ".join(f"verify {n}/1 {rows[f'target {variant} n={n}'] / one:.3f}" for n in ns if n > 1)
    ratios += "".join(f", tree {key.split('=')[1]}/1 {ms / one:.3f}" for key, ms in rows.items()
                      if key.startswith(f"target {variant} tree="))
    if f"draft {variant} tree=8" in rows and f"draft {variant} n=1" in rows:
        ratios += f", frontier 8 {rows[f'draft {variant} tree=8'] / rows[f'draft {variant} n=1']:.3f}"
    c = f"c {rows[f'draft {variant} n=1'] / one:.3f}, " if f"draft {variant} n=1" in rows else ""
    print(f"{variant}: {c}{ratios}")
if args.json:
    json.dump({"command": " ".join(sys.argv), "ms": rows}, open(args.json, "w"), indent=1)
