"""Tune the fused one-token step's kernels (spec/kernels.py) for the GPU at hand.

Each product of a decode step -- q/k/v with RMSNorm and rotary embedding, o and down added into the residual,
gate/up with SiLU, the head -- is one Triton kernel whose speed depends on how many output rows a program owns
(BN), how many columns it reads per iteration (BLOCK_K) and its warps. This measures every sensible combination on
the model pair's own weights: a CUDA graph runs the kernel once per layer, each layer's distinct weights, so they
stream from memory as in a real step (not from L2), and the time per product is the replay time over the layers.
It checks each combination's output against the untuned default's, and times cuBLAS on the same weights beside it.

    python -m spec.tune_kernels --pair llama-random
    python -m spec.tune_kernels --pair qwen-coder
    python -m spec.tune_kernels --pair llama-random --tokens 9 --roles target   (the fused verify kernels)

With --tokens 2-16 it tunes the kernels of a fused forward of that many tokens (verifies, by default), whose
tiles are tensor-core products: rows per program, columns, warps and software-pipelining stages; with 17-32 or
33-64 those of a token tree's verify (tiles 32 or 64 tokens wide, tuned apart). With --draft-quant / --target-quant
it tunes that model's packed int8 / int4 / fp8 weights, whose tiles are tuned apart too:

    python -m spec.tune_kernels --pair llama-random --roles target --tokens 64,32
    python -m spec.tune_kernels --pair llama-random --roles draft --draft-quant int4

Every combination is compiled first, all at once on a pool of threads (`kernels.compiling_ahead`), then timed.

A product timed alone is not a step: on an H100 the winners for a 64-token verify, the 1B's 2-16-token forwards and
its int4 step each beat the rules product by product and lost end to end (9.76 ms against 9.25 a 64-token forward;
benchmarks/h100/session15/). So each forward size's tiles are then timed in the whole model's forward, captured as a
graph, against the table as it stands, and written only where they make it at least 0.5 % faster (the JSON keeps
both times and "kept"). `python -m spec.bench_engine` with and without SPARK_SPEC_KERNEL_TABLE=0 (the rules alone)
in one call shows what the file gives a decode.

Writes the winners to <cache>/kernels/<GPU name>.json, which the graph backend reads from then on, and the whole
sweep to results/tune_kernels-<time>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from spec import log
from spec.cli import add_model_args, load_from_args
from spec.harness import copy_bandwidth
from spec.io import save_json, table
from spec.models import dtype_name, kernels
from spec.models.graph import GraphModel, no_collection
from spec.models.quant import PackedWeight


def _time_graph(run, layers: int, replays: int = 20) -> float:
    """Microseconds per product: a CUDA graph of `run(i)` for every layer i, replayed, median of three batches."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(layers):
            run(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with no_collection(), torch.cuda.graph(graph):
        for i in range(layers):
            run(i)
    graph.replay()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays / layers)
    return statistics.median(times)


def candidates(kind: str, n: int, tokens: int = 1, quant: str = "none") -> list[tuple[int, ...]]:
    """Configurations worth timing: between 32 and 16384 programs, 1-16k weight elements per iteration (one
    token; packed weights up to 4x as many, their bytes a bf16 tile's); for 2-16 tokens, tensor-core tiles of 16-128
    rows by 64-256 columns, a warp per 16 or 32 rows, and 3-6 pipeline stages of at most 160 KB; for a tree's 17-64
    tokens, 16-64 rows by 64-128 columns, 2-4 stages, the tokens' input tile counted in the 160 KB. int4 tiles hold
    32-128 columns (whole groups) past one token. Packed weights' 2-MAX_FEW_TOKENS-token products (`gemv_few`) take
    one-token tiles."""
    weights = 2 if kind == "silu_mul" else 1
    if tokens > 1 and not kernels.few_tokens(tokens, quant):
        mp = kernels.tile_tokens(tokens)
        if mp > kernels.MAX_FUSED_TOKENS:  # a tree's: 16-64 rows by 64-128 columns (int4 from a group), 4 or 8 warps
            return [(bn, block_k, warps, stages) for bn in (16, 32, 64)
                    for block_k in ((32, 64, 128) if quant == "int4" else (64, 128)) for warps in (4, 8)
                    for stages in (2, 3, 4) if (kind == "qkv" or 32 <= -(-n // bn) <= 16384)
                    and stages * (weights * bn + mp) * block_k * 2 <= 160 * 1024]
        return [(bn, block_k, warps, stages) for bn in (16, 32, 64, 128)
                for block_k in ((32, 64, 128) if quant == "int4" else (64, 128, 256))
                for warps in sorted({max(1, bn * weights // 64), max(1, bn * weights // 32), 4}) for stages in (3, 4, 6)
                if (kind == "qkv" or 32 <= -(-n // bn) <= 16384) and bn * block_k <= 16384
                and stages * weights * bn * block_k * 2 <= 160 * 1024]
    packed = {"none": 1, "int8": 2, "fp8": 2, "int4": 4}[quant]
    out = []
    for bn in (2, 4, 8, 16, 32, 64):
        if kind == "qkv" and bn > n:
            continue
        programs = -(-n // bn)
        if kind != "qkv" and not 32 <= programs <= 16384:
            continue
        for block_k in (128, 256, 512, 1024, 2048, 4096)[:4 + packed // 2]:
            elems = bn * block_k * (2 if kind in ("qkv", "silu_mul") else 1)
            for warps in (4, 8):
                if 256 * warps <= elems <= 2048 * warps * packed:
                    out.append((bn, block_k, warps))
    return out


def ours(weight: torch.Tensor | PackedWeight) -> torch.Tensor | PackedWeight:
    """`weight` without PyTorch's int4 layout: its products run our kernels at every width."""
    return dataclasses.replace(weight, library=None) if isinstance(weight, PackedWeight) else weight


def products(model: GraphModel, tokens: int = 1) -> dict[str, dict]:
    """The products of a forward of `tokens` tokens on this model's weights: for each kind, a runner per (layer,
    config), the bytes one product reads, its shape key, and a cuBLAS runner for the same weights. Always our
    kernels' products: int4 weights are passed without PyTorch's layout, so that a product of
    kernels.LIBRARY_TOKENS tokens or more runs the tile it is given, not tinygemm (a forward still takes tinygemm
    there: those tiles serve only where it does not, in fp32 or with SPARK_SPEC_LIBRARY_TOKENS=0). So are the model's
    own weights at kernels.LIBRARY_PLAIN's token counts (`tune` times them with cuBLAS off; a forward of 33-64 tokens
    takes cuBLAS, so the keep check finds nothing to keep there unless SPARK_SPEC_LIBRARY_PLAIN=0)."""
    dev, dtype = model.device, model.cos.dtype
    hidden = model.model.config.get_text_config().hidden_size
    layers = model.layers
    h = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    attn = torch.randn(tokens, model.heads * model.head_dim, device=dev, dtype=dtype)
    act = torch.randn(tokens, model.intermediate, device=dev, dtype=dtype)
    q = torch.empty(tokens, model.heads * model.head_dim, device=dev, dtype=dtype)
    gu_out = torch.empty(tokens, model.intermediate, device=dev, dtype=dtype)
    head_w = model.model.lm_head.weight
    packed_head = ours(model.head_weight)  # the weights as the fused step reads them: packed, with --*-quant
    step = [tuple(ours(w) for w in layer) for layer in model.step_weights]  # per layer: q/k/v, o, gate/up, down
    logits = torch.empty(tokens, head_w.shape[0], device=dev, dtype=torch.float32)
    residual = [torch.randn(tokens, hidden, device=dev, dtype=dtype) for _ in layers]
    start = residual[0].clone()
    norm = model.model.model.norm
    half = model.head_dim // 2

    def qkv(i, c):
        norm1, (_, b), *_ = layers[i]
        kernels.qkv_rope(h, norm1.weight, norm1.variance_epsilon, step[i][0], b, model.cos, model.sin, model.pos, q,
                         model.k_cache[i], model.v_cache[i], model.heads, model.kv_heads, config=c)
        return q  # (and the caches' position 0, which `check` adds)

    def o(i, c):
        kernels.gemv(attn, step[i][1], residual[i], kernels.ADD, config=c, head_major=model.head_dim)
        return residual[i]

    def gate_up(i, c):
        kernels.gemv(h, step[i][2], gu_out, kernels.SILU_MUL, layers[i][3].weight, layers[i][3].variance_epsilon,
                     config=c)
        return gu_out

    def down(i, c):
        kernels.gemv(act, step[i][3], residual[i], kernels.ADD, config=c)
        return residual[i]

    def head(i, c):
        kernels.gemv(h, packed_head, logits, kernels.LOGITS, norm.weight, norm.variance_epsilon, config=c)
        return logits

    size = lambda w: w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes()  # noqa: E731
    n_layers = len(layers)
    reset = lambda: residual[0].copy_(start)  # noqa: E731
    return {
        "qkv": dict(run=qkv, check=lambda out: torch.cat([out.flatten(), model.k_cache[0][:, :tokens].flatten(),
                                                          model.v_cache[0][:, :tokens].flatten()]),
                    key=("qkv", half, hidden), layers=n_layers, bytes=size(step[0][0]),
                    cublas=lambda i: F.linear(h, *layers[i][1])),
        "o": dict(run=o, reset=reset, key=("add", hidden, attn.shape[-1]), layers=n_layers,
                  bytes=size(step[0][1]), cublas=lambda i: F.linear(attn, layers[i][2].weight)),
        "gate_up": dict(run=gate_up, key=("silu_mul", model.intermediate, hidden), layers=n_layers,
                        bytes=size(step[0][2]), cublas=lambda i: F.linear(h, layers[i][4][0])),
        "down": dict(run=down, reset=reset, key=("add", hidden, model.intermediate), layers=n_layers,
                     bytes=size(step[0][3]), cublas=lambda i: F.linear(act, layers[i][6].weight)),
        "head": dict(run=head, key=("logits", packed_head.shape[0], hidden), layers=1, bytes=size(packed_head),
                     cublas=lambda i: F.linear(h, head_w)),
    }


def tune(model: GraphModel, bandwidth: float, role: str, tokens: int = 1,
         only: tuple[str, ...] = ("qkv", "o", "gate_up", "down", "head")) -> list[dict]:
    with kernels.plain_library(None):  # our tiles at every width, though a forward may take cuBLAS there
        return _tune(model, bandwidth, role, tokens, only)


def _tune(model: GraphModel, bandwidth: float, role: str, tokens: int, only: tuple[str, ...]) -> list[dict]:
    rows = []
    for name, p in products(model, tokens).items():
        if name not in only:
            continue
        kind, n, k = p["key"]
        default = kernels.gemv_config(kind, n, k, tokens=tokens, quant=model.quant)  # the rule, not a tuned entry
        reset = p.get("reset", lambda: None)  # `add` kernels accumulate into the residual: start it over
        configs = candidates(kind, n, tokens, model.quant)
        with kernels.compiling_ahead(ignore_errors=True) as ahead:  # every variant compiles at once; nothing runs
            for config in [default, *configs] if ahead else ():  # (one that cannot compile is skipped below)
                p["run"](0, config)
        reset()
        check = p.get("check", lambda out: out)
        reference = check(p["run"](0, default)).float().clone()
        scale = float(reference.abs().max()) or 1.0
        results = []
        with log.bar(total=len(configs), desc=f"{role} {name} x{tokens}") as bar:
            for config in configs:
                reset()
                try:
                    error = float((check(p["run"](0, config)).float() - reference).abs().max()) / scale
                    us = _time_graph(lambda i, run=p["run"], config=config: run(i, config), p["layers"])
                except Exception as err:  # Triton's OutOfResources, say: a tile this GPU cannot hold
                    error, us = float("inf"), float("inf")
                    log.info(f"{role} {name} {config}: {type(err).__name__}: {str(err)[:200]}")
                results.append({"config": config, "us": us, "error": error})
                bar.update()
        ok = [r for r in results if r["error"] < 2e-2]
        if not ok:
            log.info(f"{role} {name} x{tokens}: none of {len(configs)} tiles ran and matched the default's output")
            continue
        best = min(ok, key=lambda r: r["us"])
        cublas_us = _time_graph(p["cublas"], p["layers"])
        default_us = next(r["us"] for r in results if r["config"] == default) if default in configs else \
            _time_graph(lambda i, run=p["run"], default=default: run(i, default), p["layers"])
        rows.append({
            "role": role, "product": name, "kind": kernels.tuned_kind(kind, tokens, model.quant), "tokens": tokens,
            "quant": model.quant, "n": n, "k": k, "bn": best["config"][0], "block_k": best["config"][1],
            "warps": best["config"][2], **({"stages": best["config"][3]} if len(best["config"]) > 3 else {}),
            "us": best["us"],
            "tb_s": p["bytes"] / best["us"] / 1e6, "of_copy": p["bytes"] / best["us"] / 1e-6 / bandwidth,
            "default_us": default_us, "cublas_us": cublas_us, "rejected": len(results) - len(ok),
            "sweep": [{"config": r["config"], "us": r["us"], "error": r["error"]} for r in results],
        })
    return rows


KEEP_MARGIN = 0.005  # tuned tiles are kept where the whole forward runs at least this much faster with them


def whole_forward_ms(m, role: str, quant: str, tokens: int, entries: dict) -> tuple[float, float]:
    """Milliseconds of the whole model's forward of `tokens` tokens (a token tree's past 16), captured as a graph,
    with the tiles in effect and with `entries` on trial: each in a fresh GraphModel (a graph keeps the tiles it
    was captured with), alternated twice, the faster of each."""
    def once(trial: dict) -> float:
        with kernels.trying(trial):
            model = GraphModel(m.model, m.vocab, name=role, max_length=256, quant=quant)
            ms = model.replay_ms(tokens, tree=tokens > kernels.MAX_FUSED_TOKENS)
        del model
        torch.cuda.empty_cache()
        return ms

    times = [(once({}), once(entries)) for _ in range(2)]
    return min(t[0] for t in times), min(t[1] for t in times)


def keep_tuned(rules_ms: float, tuned_ms: float) -> bool:
    """Whether a forward's tuned tiles earn their place: a product timed alone is not a step (on an H100 the
    winners for a 64-token verify lost in the whole forward, 9.76 ms against 9.25)."""
    return tuned_ms < rules_ms * (1 - KEEP_MARGIN)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spec.tune_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, auto_draft=False)  # the format named is the one tuned
    parser.add_argument("--no-save", action="store_true", help="print the table; do not write the GPU's config file")
    parser.add_argument("--tokens", default="1", help="forward sizes to tune, comma-separated: 1 tunes the "
                        "one-token kernels, one of 2-16 the fused verify kernels (one table serves every size; 9 is "
                        "the verify of K = 8), one of 17-32 and one of 33-64 a token tree's verify (default: 1)")
    parser.add_argument("--roles", default="target,draft", help="which models to tune (default: both)")
    parser.add_argument("--products", default="qkv,o,gate_up,down,head", help="which products to tune (default: all)")
    args = parser.parse_args(argv)
    args.backend = "eager"
    if not kernels.available():
        sys.exit("error: tuning needs a CUDA device and Triton")
    quants = {"target": args.target_quant, "draft": args.draft_quant}
    args.target_quant = args.draft_quant = "none"  # the pair loads plain; GraphModel packs what is tuned
    pair = load_from_args(args)
    if pair.device.type != "cuda":
        sys.exit("error: tuning needs a CUDA device (pass --device cuda)")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        sys.exit(f"error: --tokens takes comma-separated token counts, got {args.tokens}")
    # one table each: one token, and the tiles 16 (2-16 tokens), 32 and 64 tokens wide
    widths = [1 if t == 1 else kernels.tile_tokens(t) if 1 < t <= kernels.MAX_KERNEL_TOKENS else 0 for t in tokens]
    if 0 in widths or len(set(widths)) < len(widths):
        sys.exit(f"error: --tokens takes 1 and/or one size each of 2-16, 17-32 and 33-64 (one table serves each "
                 f"range), got {args.tokens}")
    if not set(args.products.split(",")) <= {"qkv", "o", "gate_up", "down", "head"}:
        sys.exit(f"error: --products takes qkv, o, gate_up, down and/or head, got {args.products}")
    roles = args.roles.split(",")
    if not set(roles) <= {"target", "draft"}:
        sys.exit(f"error: --roles takes target and/or draft, got {args.roles}")
    bandwidth = copy_bandwidth(pair.device, megabytes=2048, reps=10, trials=1)
    label = {role: role + ("" if quant == "none" else " " + quant) for role, quant in quants.items()}
    rows = []
    with torch.no_grad():
        for role in roles:
            m = getattr(pair, role)
            if m is None:
                continue
            model = GraphModel(m.model, m.vocab, name=role, max_length=256, quant=quants[role])
            for t in tokens:
                if quants[role] == "none" and kernels.library_product(model.head_weight, t):
                    log.info(f"{label[role]} x{t}: a forward of {t} tokens runs cuBLAS's products here "
                             "(kernels.LIBRARY_PLAIN), not these tiles: the whole-forward check keeps none "
                             "(SPARK_SPEC_LIBRARY_PLAIN=0 tunes them for forwards without it)")
                found = tune(model, bandwidth, role, t, tuple(args.products.split(",")))
                if not found:
                    continue
                before, after = whole_forward_ms(m, role, quants[role], t, dict(map(kernels.tuned_entry, found)))
                kept = keep_tuned(before, after)
                print(f"{label[role]} x{t}: the whole forward {before:.3f} ms as the table stands, {after:.3f} ms "
                      "with these tiles: " + ("kept" if kept else "not kept (a product timed alone is not a step)"))
                rows += [{**r, "forward_ms": before, "forward_ms_tuned": after, "kept": kept} for r in found]
    name = torch.cuda.get_device_name(pair.device)
    print(table(rows, [("role", "s"), ("product", "s"), ("quant", "s"), ("tokens", "d"), ("n", "d"), ("k", "d"),
                       ("bn", "d"), ("block_k", "d"), ("warps", "d"), ("us", ".2f"), ("tb_s", ".2f"),
                       ("of_copy", ".2f"), ("default_us", ".2f"), ("cublas_us", ".2f"), ("rejected", "d")]))
    layers = {role: len(getattr(pair, role).model.model.layers) for role in roles}
    total = {f"{label[role]} x{t}":
             sum(r["us"] * (1 if r["product"] == "head" else layers[role])
                 for r in rows if r["role"] == role and r["tokens"] == t)
             for role in roles for t in tokens}
    print("products per forward (tuned), ms:", ", ".join(f"{key} tokens {us / 1e3:.3f}" for key, us in total.items()))
    data = {"device_name": name, "pair": pair.name, "dtype": dtype_name(pair.dtype), "quants": quants,
            "bandwidth_gb_s": bandwidth / 1e9, "products_ms": {r: us / 1e3 for r, us in total.items()}, "rows": rows}
    path = save_json("tune_kernels", data)
    if not args.no_save:
        target = kernels.tuned_path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(target.read_text())["configs"] if target.is_file() else []
        kept = [r for r in rows if r["kept"]]
        keys = {(r["kind"], r["n"], r["k"]) for r in kept}
        configs = [c for c in old if (c["kind"], c["n"], c["k"]) not in keys] + [
            {key: r[key] for key in ("kind", "n", "k", "bn", "block_k", "warps", "stages", "us") if key in r}
            for r in kept]
        target.write_text(json.dumps({"device_name": name, "configs": configs}, indent=1))
        kernels._tuned.cache_clear()
        print(f"wrote {target}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
