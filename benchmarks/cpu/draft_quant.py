"""Quantized drafts side by side, one process: for each draft format, one product's time, a draft step's time and c,
then plain and speculative greedy decoding on the same prompts (identity, alpha-hat, tokens per round, tok/s,
speedup), and each draft's agreement with the target on one and the same text.

    python benchmarks/cpu/draft_quant.py --pair qwen-coder --prompts short,code --limit 3 --max-new-tokens 64

Each format loads the pair again (the target from the user cache, the draft quantized as it loads), so every
speedup is over plain decoding measured in the same load. Rows go to results/draft_quant-<time>.jsonl as they come.

Alpha-hat is measured on each run's own text, and a bf16 near-tie of the target sends runs of different drafts
through different texts after it, so alpha-hats of two formats differ by more than their drafts do. `agreement` does
not: every format's draft reads the same texts (the first format's speculative outputs, the target's greedy text up
to its near-ties) in one forward, and counts the positions where its argmax is the text's next token, which is what
greedy speculation accepts. `agreement_vs_first` is the difference from the first format on those same positions,
with its paired standard error sqrt(positions where exactly one of the two agrees) / positions.

`int4+a8` in --quants is the int4 draft with every product's inputs rounded to 8 bits a group of 32 first, as a
`w4a8` draft's one-token products round them on CUDA (`quant.inputs_in_8_bits`, in PyTorch before each packed
layer): what those 8 bits cost the draft's agreement and alpha-hat, measured where the pair runs (w4a8 itself is
CUDA's; here every forward of the draft rounds, on a GPU only its one-token steps). Its times are not w4a8's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spec.cli import add_model_args, load_from_args  # noqa: E402
from spec.harness import Setup, forward_times, run_prompt, warm_up  # noqa: E402
from spec.io import Results, load_prompts, table  # noqa: E402
from spec.models import chat_ids  # noqa: E402
from spec.models.quant import QUANTS, QuantLinear, inputs_in_8_bits  # noqa: E402

EMULATED_A8 = "int4+a8"  # the int4 draft, its products' inputs rounded to 8 bits first (w4a8's rounding)


def round_inputs_to_8_bits(wrapper) -> int:
    """Every packed layer a wrapped draft calls takes its input rounded to 8 bits a group (w4a8's rounding), by a
    forward pre-hook; returns the layers hooked. The graph backend's joined q/k/v and gate/up layers are its own
    (`GraphModel.layers`), not the transformers model's modules, so they are looked for there too."""
    def hook(module, args):
        xq, step = inputs_in_8_bits(args[0])
        return ((xq * step).reshape(args[0].shape).to(args[0].dtype),)

    holders = [wrapper.model, *(part for layer in getattr(wrapper, "layers", ()) for part in layer)]
    modules = [m for h in holders for m in (h if isinstance(h, tuple) else (h,)) if isinstance(m, torch.nn.Module)]
    layers = {id(m): m for h in modules for m in h.modules() if isinstance(m, QuantLinear)}
    for layer in layers.values():
        layer.register_forward_pre_hook(hook)
    return len(layers)

COLUMNS = [("quant", ""), ("prompts", ""), ("draft_step_ms", ".1f"), ("c", ".3f"), ("identical", ""),
           ("alpha", ".3f"), ("agreement", ".3f"), ("agreement_vs_first", "+.3f"), ("agreement_se", ".3f"),
           ("tokens_per_round", ".2f"), ("plain_tok_s", ".2f"), ("spec_tok_s", ".2f"), ("speedup", ".2f")]


def product_ms(scheme: str, n: int = 4864, k: int = 896, trials: int = 200, tokens: int = 1) -> float:
    """A [tokens, k] x [k, n] product in bf16 (default: one token through the 0.5B draft's gate/up), as the draft
    runs it, on the CPU."""
    import time

    import torch

    from spec.models.quant import QuantLinear

    linear = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
    layer = linear if scheme == "none" else QuantLinear(linear, scheme)
    x = torch.randn(tokens, k).to(torch.bfloat16)
    with torch.inference_mode():
        for _ in range(10):
            layer(x)
        start = time.perf_counter()
        for _ in range(trials):
            layer(x)
    return (time.perf_counter() - start) / trials * 1e3


def agreements(model, prompt: list[int], text: list[int]) -> list[bool]:
    """Teacher-forced: at each position of `text` after `prompt`, whether the model's argmax is the text's token.
    One forward over the whole text (a prompt's path, not the decoding steps' own: a near-tie can fall either way)."""
    import torch

    if not text:
        return []
    model.reset()
    with torch.inference_mode():
        logits = model.forward(prompt + text[:-1], keep=len(text))
    model.reset()
    return (logits.argmax(-1).cpu() == torch.tensor(text)).tolist()


def step_ms(model, context: list[int], trials: int) -> float:
    return statistics.median(forward_times(model, context, context[-1:], trials)) * 1e3


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--quants", default="none,int8,int4", help="draft formats to compare (default none,int8,int4)")
    parser.add_argument("--prompts", default="short,code", help="prompt sets (default short,code)")
    parser.add_argument("--limit", type=int, default=3, help="prompts per set (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--k", type=int, default=4, help="drafts per round (default 4)")
    parser.add_argument("--trials", type=int, default=10, help="timed forwards per step measurement (default 10)")
    parser.add_argument("--products-only", action="store_true",
                        help="time only one [1, 896] x [896, 4864] product per format (random weights; seconds)")
    parser.add_argument("--product-tokens", default="1",
                        help="with --products-only: token counts to time the product at, e.g. 1,2,5,8,16 (a verify "
                             "of K drafts is K + 1 tokens; default 1)")
    args = parser.parse_args(argv)
    quants = args.quants.split(",")
    if unknown := set(quants) - {*QUANTS, EMULATED_A8}:
        parser.error(f"unknown --quants {', '.join(sorted(unknown))}; choose from {', '.join(QUANTS)}, {EMULATED_A8}")
    if EMULATED_A8 in quants and args.products_only:
        parser.error(f"{EMULATED_A8} is int4's products with a rounding before them: --products-only times int4")
    if args.products_only:  # CPU kernels: how a product's time grows with the tokens it carries
        rows = [{"tokens": m, **{quant: product_ms(quant, tokens=m) for quant in quants}}
                for m in (int(t) for t in args.product_tokens.split(","))]
        print("a [tokens, 896] x [896, 4864] bf16 product on the CPU, ms:")
        print(table(rows, [("tokens", "d"), *((q, ".3f") for q in quants)]))
        return {"products_ms": rows}
    products = {quant: product_ms(quant) for quant in quants if quant != EMULATED_A8}
    print("one [1, 896] x [896, 4864] bf16 product (CPU): " +
          ", ".join(f"{q} {ms:.3f} ms" for q, ms in products.items()))
    results, summary = Results("draft_quant"), []
    texts, first_agrees = {}, {}  # the first format's outputs (prompt ids, text), and its agreement there
    sets = {name: load_prompts(name)[: args.limit] for name in args.prompts.split(",")}
    for quant in quants:
        args.draft_quant = "int4" if quant == EMULATED_A8 else quant
        pair = load_from_args(args)
        if quant == EMULATED_A8 and not round_inputs_to_8_bits(pair.draft):
            raise SystemExit(f"{EMULATED_A8}: the draft has no packed layers to hook")
        context = chat_ids(pair.tokenizer, next(iter(sets.values()))[0]["prompt"])
        # untimed: the graph backend captures its graphs for every text length these prompts reach, and times
        # packed weights' small forwards against one-token steps (GraphModel.stepwise); then one short generation
        longest = max(len(chat_ids(pair.tokenizer, p["prompt"])) for ps in sets.values() for p in ps)
        warm_up(pair, Setup(k=args.k, max_new_tokens=8), longest + args.max_new_tokens)
        draft_ms, target_ms = step_ms(pair.draft, context, args.trials), step_ms(pair.target, context, args.trials)
        for name, prompts in sets.items():
            rows = [results.add({"quant": quant, "set": name, **run_prompt(pair, p, Setup(k=args.k, max_new_tokens=
                                 args.max_new_tokens), args.k)}) for p in prompts]
            agree = []
            for p, r in zip(prompts, rows):
                ids, text = texts.setdefault(p["id"], (chat_ids(pair.tokenizer, p["prompt"]), r["spec_tokens"]))
                agree += agreements(pair.draft, ids, text)
            first = first_agrees.setdefault(name, agree)
            discordant = sum(a != b for a, b in zip(agree, first))
            drafted = sum(r["spec"]["drafted"] for r in rows)
            tokens, plain_s, spec_s = (sum(r[key] for r in rows) for key in ("tokens", "plain_s", "spec_s"))
            summary.append({
                "quant": quant, "prompts": f"{name} x{len(rows)}", "draft_step_ms": draft_ms,
                "target_step_ms": target_ms, "c": draft_ms / target_ms,
                "stepwise": getattr(pair.draft, "stepwise", 0),  # forwards of up to this many tokens run as steps
                "identical": all(r["identical"] for r in rows),
                "alpha": sum(r["spec"]["accepted"] for r in rows) / drafted if drafted else float("nan"),
                "agreement": sum(agree) / max(1, len(agree)),
                "agreement_vs_first": (sum(agree) - sum(first)) / max(1, len(agree)),
                "agreement_se": discordant ** 0.5 / max(1, len(agree)), "positions": len(agree),
                "tokens_per_round": tokens / sum(r["spec"]["rounds"] for r in rows),
                "plain_tok_s": sum(r["plain_tokens"] for r in rows) / plain_s, "spec_tok_s": tokens / spec_s,
            })
            summary[-1]["speedup"] = summary[-1]["spec_tok_s"] / summary[-1]["plain_tok_s"]
        del pair
    print(table(summary, COLUMNS))
    setup = {**vars(args), "quants": quants, "products_ms": products}
    setup.pop("draft_quant")  # each row names its own
    out = results.finish({"setup": setup, "summary": summary})
    print(f"wrote {out}")
    return {"summary": summary}


if __name__ == "__main__":
    main()
