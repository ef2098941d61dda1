"""Where a one-token step's time goes, product by product, in each weight format of the draft: what stands between
a step and its byte floor (issue 18 asks it of the int4 step). With `--tokens N`, the same for a forward of N tokens
(a verify, a tree's frontier, a draft's catch-up).

    PYTHONPATH=. python benchmarks/h200/step_profile.py --pair llama-random --device cuda \
        --quants none,int8,int4 --json results/step_profile.json
    PYTHONPATH=. python benchmarks/h200/step_profile.py --pair llama-random --device cuda --roles draft \
        --quants none,int8 --tokens 8 --json results/step_profile-8.json

For each model (the target in its own dtype, the draft in each of `--quants`) over a `--context`-token cache:

- **own time**: the step's kernels launched one by one, without a graph and without PDL, under the profiler: each
  kernel's time is its own work, from its first program's start to its last's end. Summed per product (q/k/v with
  RMSNorm and rotary, attention, o, gate/up, down, the head; the rest is the embedding's row and the position's
  fill), beside the bytes each reads, the rate that makes, the time those bytes take at the copy rate, and what
  the profiler reports of registers a thread and occupancy;
- **the step**: the same forward as decoding runs it, over the same cache (`bench_engine.step_ms`: a CUDA graph with
  PDL, each kernel loading its first weights while the one before it finishes);
- **the launch floor**: a graph of as many kernels that do nothing (each waits for the one before it, loads one
  word and stores it), launched with the step's own grids and block sizes and PDL: what the chain of launches costs
  with no bytes to read. The step cannot beat the larger of its byte floor and this; what is left above both is
  the kernels' own latency (a product's first load, its reductions, its tail).

The profile of session 4 (bf16 only, before PDL and the one-pass attention) is benchmarks/h200/step_profile.json.
Session 21's runs timed the step at position 0 over a 256-slot span instead (`GraphModel.replay_ms`): 1-3 % below
the step at 512 tokens.
"""

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from spec.bench_engine import step_ms
from spec.cli import add_model_args, load_from_args
from spec.harness import copy_bandwidth
from spec.io import table
from spec.models.base import sync_time
from spec.models.graph import GraphModel, no_collection

PRODUCTS = ("qkv", "attention", "o", "gate_up", "down", "head", "other")


@functools.cache
def nothing():
    """The floor chain's kernel (Triton is imported here: only GPU machines have it): wait for the kernel before, as
    the step's kernels wait, then one word loaded and stored a program."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        i = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
        tl.store(x_ptr + i, tl.load(x_ptr + i) + 1)

    return kernel


def nbytes(w) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes()


def product_bytes(graph: GraphModel, context: int) -> dict[str, int]:
    """Bytes a one-token step reads per product: its weights (codes, scales, offsets), attention its K/V."""
    out = collections.Counter()
    for w_qkv, w_o, w_gu, w_down in graph.step_weights:
        out["qkv"] += nbytes(w_qkv)
        out["o"] += nbytes(w_o)
        out["gate_up"] += nbytes(w_gu)
        out["down"] += nbytes(w_down)
    out["head"] = nbytes(graph.head_weight)
    out["attention"] = 2 * graph.k_all[:, :, :context].numel() * graph.k_all.element_size()
    return dict(out)


def label(names: list[str], layers: int) -> list[str]:
    """Each kernel of consecutive forwards (in launch order) by product. Each product has one kernel that reads its
    weights, four a layer (q/k/v, o, gate/up, down) and then the head's: ours (`qkv_rope`, `qkv_rows`, `gemv`,
    `gemv_few`, `gemv_rows`), PyTorch's int4 kernel (tinygemm) or cuBLAS's (`kernels.LIBRARY_PLAIN`; its split-K
    reduction goes with it). The library's input kernel goes with the product after it, its epilogue and the rotary
    kernel of a forward of several tokens with the product before it."""
    def product(i: int) -> str:  # the i-th product of consecutive forwards
        i %= 4 * layers + 1
        return "head" if i == 4 * layers else ("qkv", "o", "gate_up", "down")[i % 4]

    out, products, after = [], 0, None
    for name in names:
        lower = name.lower()
        if "attention" in lower:
            out.append("attention")
            after = None
        elif "splitk" in lower and after:  # cuBLAS's reduction of a split product
            out.append(after)
        elif (name.startswith(("qkv_rope", "qkv_rows", "gemv")) or "tinygemm" in lower or "int4pack" in lower
              or "gemm" in lower or "nvjet" in lower):
            after = product(products)
            out.append(after)
            products += 1
        elif name.startswith("library_input"):
            out.append(product(products))
        elif name.startswith(("library_output", "rope_rows")) and after:
            out.append(after)
        else:
            out.append("other")
    return out


def own_kernels(graph: GraphModel, reps: int, tokens: int = 1) -> list[dict]:
    """The kernels of a forward of `tokens` tokens, no graph, no PDL, in launch order: one forward's worth (the
    median over `reps` forwards of each kernel's time), with its grid, block and what the profiler says of it."""
    ids = torch.arange(1, tokens + 1, device=graph.device)
    span = graph._span(graph.length + tokens)
    pdl, graph.pdl = graph.pdl, False

    def step():
        graph.pos.fill_(graph.length)
        graph._logits(ids, span)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    graph.pdl = pdl
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if len(kernels) % reps:
        raise RuntimeError(f"{len(kernels)} kernels in {reps} forwards")
    per = len(kernels) // reps
    out = []
    for i, e in enumerate(kernels[:per]):
        a = e.get("args", {})
        out.append({"name": e["name"][:60], "us": statistics.median(kernels[r * per + i]["dur"] for r in range(reps)),
                    "grid": a.get("grid"), "block": a.get("block"), "registers": a.get("registers per thread"),
                    "occupancy": a.get("est. achieved occupancy %")})
    return out


def floor_ms(kernels: list[dict], device, replays: int = 50) -> float:
    """Milliseconds a graph of do-nothing PDL kernels with the step's grids and blocks takes, median of 3."""
    cells = max(g[0] * g[1] for g in (k["grid"] or [1, 1, 1] for k in kernels))
    buf = torch.zeros(cells, dtype=torch.int32, device=device)

    def chain():
        for k in kernels:
            grid = tuple((k["grid"] or [1, 1, 1])[:2])
            warps = max(1, (k["block"] or [128])[0] // 32)
            nothing()[grid](buf, PDL=True, num_warps=warps, launch_pdl=True)

    chain()  # compile, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with no_collection(), torch.cuda.graph(graph):
        chain()
    graph.replay()
    times = []
    for _ in range(3):
        start = sync_time(device)
        for _ in range(replays):
            graph.replay()
        times.append((sync_time(device) - start) / replays * 1e3)
    return statistics.median(times)


def profile_model(model, vocab, name, quant, context, reps, rate, tokens: int = 1) -> dict:
    graph = GraphModel(model, vocab, name, max_length=context + 64, quant=quant)
    ctx = torch.randint(0, graph.vocab, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    graph.forward(ctx, keep=1)
    kernels = own_kernels(graph, reps, tokens)
    layers = len(graph.layers)
    per = collections.defaultdict(lambda: {"kernels": 0, "own_us": 0.0, "registers": set(), "occupancy": []})
    for k, product in zip(kernels, label([k["name"] for k in kernels], layers), strict=True):
        p = per[product]
        p["kernels"] += 1
        p["own_us"] += k["us"]
        if k["registers"] is not None:
            p["registers"].add(k["registers"])
        if k["occupancy"] is not None:
            p["occupancy"].append(k["occupancy"])
    sizes = product_bytes(graph, context)
    rows = {}
    for product in PRODUCTS:
        if product not in per:
            continue
        p, size = per[product], sizes.get(product, 0)
        rows[product] = {"kernels": p["kernels"], "own_us": round(p["own_us"], 2), "bytes": size,
                         "tb_per_s": round(size / p["own_us"] / 1e6, 3) if size else None,
                         "byte_floor_us": round(size / rate * 1e6, 2),
                         "registers": sorted(p["registers"]),
                         "occupancy_pct": round(statistics.mean(p["occupancy"]), 1) if p["occupancy"] else None}
    step = step_ms(graph, torch.tensor(ctx, device=graph.device), tokens, 50, graph.vocab)
    floor = floor_ms(kernels, graph.device)
    total_bytes = sum(sizes.values())
    out = {"model": name, "quant": quant, "layers": layers, "context": context, "tokens": tokens,
           "step_ms": round(step, 4),
           "own_sum_ms": round(sum(k["us"] for k in kernels) / 1e3, 4), "kernels": len(kernels),
           "launch_floor_ms": round(floor, 4), "bytes": total_bytes,
           "byte_floor_ms": round(total_bytes / rate * 1e3, 4), "products": rows, "launches": kernels}
    del graph
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, auto_draft=False)
    parser.add_argument("--context", type=int, default=512, help="tokens in the cache (default 512)")
    parser.add_argument("--quants", default="none,int8,int4", help="the draft's weight formats (the target: none)")
    parser.add_argument("--roles", default="draft,target")
    parser.add_argument("--reps", type=int, default=5, help="profiled forwards (each kernel's median is kept)")
    parser.add_argument("--tokens", type=int, default=1, help="tokens a forward (default 1: the decode step)")
    parser.add_argument("--json", default="results/step_profile.json")
    args = parser.parse_args()
    args.backend, args.draft_quant = "eager", "none"  # the wrappers' own models; the formats are packed here
    pair = load_from_args(args)
    rate = copy_bandwidth(pair.target.device)
    print(f"copy rate {rate / 1e12:.2f} TB/s ({torch.cuda.get_device_name()})")
    runs = []
    for role in args.roles.split(","):
        m = getattr(pair, role)
        for quant in args.quants.split(",") if role == "draft" else ["none"]:
            r = profile_model(m.model, m.vocab, role, quant, args.context, args.reps, rate, args.tokens)
            runs.append(r)
            print(f"\n{role} {quant}, {args.tokens} token(s): forward {r['step_ms']:.3f} ms (graph, PDL); kernels "
                  f"alone {r['own_sum_ms']:.3f} "
                  f"ms ({r['kernels']}); launch floor {r['launch_floor_ms']:.3f} ms; byte floor "
                  f"{r['byte_floor_ms']:.3f} ms ({r['bytes'] / 1e9:.3f} GB)")
            print(table([{"product": p, **v, "MB": v["bytes"] / 1e6, "registers": str(v["registers"])}
                         for p, v in r["products"].items()],
                        [("product", "s"), ("kernels", "d"), ("own_us", ".1f"), ("MB", ".1f"), ("tb_per_s", ".2f"),
                         ("byte_floor_us", ".1f"), ("registers", "s"), ("occupancy_pct", ".1f")]))
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:  # after every model: nothing measured is lost to a later failure
                json.dump({"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                           "copy_tb_per_s": round(rate / 1e12, 3), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
