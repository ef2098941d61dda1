"""Where a forward's time goes: the graph backend's fused kernels for n tokens (the one-token step and the fused
verify kernels), each kernel's device time summed per kernel name over the forward.

    PYTHONPATH=. python benchmarks/h200/step_profile.py --pair llama-random --device cuda --no-pdl
    PYTHONPATH=. python benchmarks/h200/step_profile.py --pair llama-random --device cuda --graphs

Without graphs and with PDL off (--no-pdl) each kernel's time is its own work. With --graphs the forwards
are CUDA-graph replays as in decoding, and with PDL on a kernel's time includes its wait for the one before: the
difference between the two profiles shows where kernels wait.
"""

import argparse
import collections
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from spec.cli import add_model_args, load_from_args
from spec.models.graph import GraphModel

parser = argparse.ArgumentParser()
add_model_args(parser)
parser.add_argument("--context", type=int, default=512)
parser.add_argument("--ns", default="1,2,9")
parser.add_argument("--graphs", action="store_true", help="profile CUDA-graph replays (as decoding runs them)")
parser.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
parser.add_argument("--json")
args = parser.parse_args()
args.backend = "eager"
pair = load_from_args(args)
out = {}
for role in ("target", "draft"):
    m = getattr(pair, role)
    graph = GraphModel(m.model, m.vocab, role, max_length=args.context + 64, graphs=args.graphs, fused_step=True,
                        pdl=not args.no_pdl)
    context = torch.randint(0, m.vocab, (args.context - 1,), generator=torch.Generator().manual_seed(0)).cuda()
    for n in [int(x) for x in args.ns.split(",")]:
        ids = torch.randint(0, m.vocab, (n,), generator=torch.Generator().manual_seed(n)).cuda()
        graph.reset()
        graph.forward(context, keep=1)
        for _ in range(3):
            graph.forward(ids)
            graph.rollback(len(context))
        torch.cuda.synchronize()
        reps = 5
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                graph.forward(ids)
                graph.rollback(len(context))
            torch.cuda.synchronize()
        per = collections.Counter()
        count = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                name = e.name[:60]
                per[name] += e.device_time / reps
                count[name] += 1 / reps
        total = sum(per.values())
        print(f"{role} n={n}: kernels {total / 1e3:.3f} ms")
        for name, us in per.most_common(12):
            print(f"   {us:9.1f} us  x{count[name]:5.1f}  {name}")
        out[f"{role} n={n}"] = {"total_us": total, "kernels": dict(per.most_common())}
    del graph
if args.json:
    json.dump({"command": " ".join(sys.argv), "profile": out}, open(args.json, "w"), indent=1)
